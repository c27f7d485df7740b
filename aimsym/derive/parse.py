"""Safe parsing of free-form links: derivation files are data, not code.

SymPy's ``sympify`` of a string runs ``eval``. Here the string is parsed by Python's
``ast`` module and the tree is translated node by node into SymPy objects: only number
literals, the indices ``z[k, t]``, declared parameter names, ``pi``/``E`` and a whitelist
of functions are accepted. Nothing is ever evaluated as Python.
"""

from __future__ import annotations

import ast
import operator

import sympy as sp

from ..errors import SpecError
from .activation import activate

FUNCTIONS = {
    "abs": sp.Abs,
    "sign": sp.sign,
    "exp": sp.exp,
    "log": sp.log,
    "sqrt": sp.sqrt,
    "tanh": sp.tanh,
    "sin": sp.sin,
    "cos": sp.cos,
    "erf": sp.erf,
    "heaviside": lambda x: sp.Heaviside(x, sp.Rational(1, 2)),
    "relu": lambda x: sp.Max(x, 0),
    "max": sp.Max,
    "min": sp.Min,
}
CONSTANTS = {"pi": sp.pi, "E": sp.E}
# deeper trees than any model needs; beyond this Python's parser and SymPy recurse past their limits
MAX_DEPTH = 100
# a numeric exponent larger than this is refused: 2**2**2**2**2**2 would be evaluated exactly
MAX_EXPONENT = 1000
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.Pow: operator.pow}


def index_symbol(k: int, t: int) -> sp.Symbol:
    """The SMI index z[k, t] (row k of Z, token t), real."""
    return sp.Symbol(f"z_{k}_{t}", real=True)


def parse_expression(text: str, *, indices: int, tokens: int, parameters, fld: str = "link") -> sp.Expr:
    if not isinstance(text, str):
        raise SpecError(fld, f"expected an expression string, got {text!r}")
    if len(text) > 4000:
        raise SpecError(fld, "expression too long (4000 characters at most)")
    shown = text if len(text) <= 60 else text[:40] + "..." + text[-12:]
    too_deep = SpecError(fld, f"expression nested too deeply (at most {MAX_DEPTH} levels of operators, "
                              f"signs, calls or parentheses): {shown!r}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise SpecError(fld, f"not a valid expression ({exc.msg}): {shown!r}") from None
    except (RecursionError, MemoryError):
        raise too_deep from None
    if _depth(tree) > MAX_DEPTH:
        raise too_deep
    params = {name: sp.Symbol(name, real=True) for name in parameters}
    allowed = "z[k, t], " + ", ".join(sorted(params) + sorted(CONSTANTS) + [f + "()" for f in sorted(FUNCTIONS)])

    def bad(what):
        return SpecError(fld, f"{what} is not allowed in a link; allowed: numbers, + - * / **, {allowed}")

    def conv(node):
        if isinstance(node, ast.Expression):
            return conv(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return sp.nsimplify(node.value) if isinstance(node.value, int) else sp.Float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = conv(node.left), conv(node.right)
            if isinstance(node.op, ast.Pow) and right.is_number and not abs(right) <= MAX_EXPONENT:
                raise SpecError(fld, f"a numeric exponent must be at most {MAX_EXPONENT} in size, got {right}")
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = conv(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.Name):
            if node.id in params:
                return params[node.id]
            if node.id in CONSTANTS:
                return CONSTANTS[node.id]
            raise bad(f"the name {node.id!r}")
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "z":
            idx = node.slice
            elts = idx.elts if isinstance(idx, ast.Tuple) else [idx]
            if not all(isinstance(e, ast.Constant) and type(e.value) is int for e in elts):
                raise SpecError(fld, "indices are written z[k, t] with integer k and t")
            if len(elts) == 1 and tokens == 1:
                elts = [elts[0], ast.Constant(0)]
            if len(elts) != 2:
                raise SpecError(fld, "indices are written z[k, t] (row k, token t)")
            k, t = elts[0].value, elts[1].value
            if not (0 <= k < indices and 0 <= t < tokens):
                raise SpecError(fld, f"z[{k}, {t}] is out of range: k in 0..{indices - 1}, t in 0..{tokens - 1}")
            return index_symbol(k, t)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
            if node.func.id not in FUNCTIONS:
                raise bad(f"the function {node.func.id!r}")
            return FUNCTIONS[node.func.id](*[conv(a) for a in node.args])
        raise bad(f"the construct {type(node).__name__!r}")

    try:
        return conv(tree)
    except RecursionError:
        raise too_deep from None


def _depth(tree) -> int:
    """Depth of an ast tree, without recursion."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        stack.extend((child, d + 1) for child in ast.iter_child_nodes(node))
    return deepest


def parse_link(spec) -> sp.Matrix | sp.Expr:
    """SymPy form of an :class:`~aimsym.derive.spec.SMISpec` link (scalar, vector or matrix); a
    matrix link is passed through the spec's row ``activation`` (softmax / hardmax)."""

    def one(s):
        return parse_expression(s, indices=spec.indices, tokens=spec.tokens, parameters=spec.parameters_)

    link = spec.link
    if isinstance(link, str):
        return one(link)
    if isinstance(link[0], tuple):
        M = sp.Matrix([[one(e) for e in row] for row in link])
        act = getattr(spec, "activation", "linear")
        if act != "linear":
            # sigma along rows, by the very functions attention layers use
            M = activate(act, M)
        return M
    return sp.Matrix([one(e) for e in link])
