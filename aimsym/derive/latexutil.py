"""Shared LaTeX helpers: formulas printed from the same SymPy objects the code runs.

Two users: the code generator (docstrings of the generated kernels, 0-based names matching the
array indices ``Z[k, t]`` of the code, output unchanged so committed modules stay current) and
the LaTeX document (``one_based=True``: papers number rows and tokens from 1; long lines broken
so that they fit the page).
"""

from __future__ import annotations

import re

import sympy as sp

from .spec import AttentionSpec

_Z = re.compile(r"^z_(\d+)_(\d+)$")


def z_name(k: int, t: int, p: int | None = None, tokens: int | None = None) -> str:
    """LaTeX of the index entry Z[k, t] (0-based arguments), 1-based: ``z_{k+1,t+1}``; with a
    single token the token index is dropped (``z_{k+1}``), with a single entry it is ``z``."""
    if tokens == 1:
        return "z" if p == 1 else f"z_{{{k + 1}}}"
    return f"z_{{{k + 1},{t + 1}}}"


def symbol_names(exprs, extra: dict | None = None, one_based: bool = False,
                  p: int | None = None, tokens: int | None = None) -> dict:
    names = dict(extra or {})
    o = 1 if one_based else 0
    for e in exprs:
        for s in e.free_symbols:
            m = _Z.match(s.name)
            if s in names:  # named by the caller (e.g. a log-integrated index printed as s)
                continue
            if m:
                k, t = int(m.group(1)), int(m.group(2))
                names[s] = z_name(k, t, p, tokens) if one_based else f"z_{{{k},{t}}}"
            elif re.match(r"^h_(\d+)$", s.name):
                names[s] = f"h_{{{int(s.name[2:]) + o}}}"
            elif re.match(r"^y_(\d+)$", s.name):
                names[s] = "y" if one_based else f"y_{{{s.name[2:]}}}"
            elif s.name.startswith("_d") and "__" in s.name and s not in names:
                base, _, i = s.name[2:].rpartition("__")
                inner = names.get(sp.Symbol(base, real=True)) or _plain(base, one_based)
                if one_based and tokens:
                    k, t = divmod(int(i), tokens)
                    names[s] = rf"\partial_{{{z_name(k, t, p, tokens)}}}{inner}"
                else:
                    names[s] = rf"\partial_{{{i}}}{inner}"
            elif s.name.startswith("_") and s not in names:
                names[s] = _plain(s.name, one_based)
    return names


def _plain(name: str, one_based: bool = False) -> str:
    r"""An unnamed program intermediate ``_F0_1_0_0`` as ``\mathrm{F0}_{1,0,0}`` (code) or, one-based,
    ``\mathrm{F}^{(1,1)}_{11}`` (Runge-Kutta step 1, stage 1, entry (1, 1))."""
    stem, *idx = name.strip("_").split("_")
    if not one_based:
        return rf"\mathrm{{{stem}}}" + (f"_{{{','.join(idx)}}}" if idx else "")
    m = re.match(r"^([A-Za-z]+)(\d+)$", stem)
    if m and len(idx) == 3 and all(i.isdigit() for i in idx):
        # a Runge-Kutta stage matrix _Y{step}_{stage}_{a}_{b} (step and entries 0-based, stage 1-based)
        step, stage, a, b = int(m.group(2)), idx[0], int(idx[1]), int(idx[2])
        return rf"\mathrm{{{m.group(1)}}}^{{({step + 1},{stage})}}_{{{a + 1}{b + 1}}}"
    idx = [str(int(i) + 1) if i.isdigit() else i for i in idx]
    return rf"\mathrm{{{stem}}}" + (f"_{{{','.join(idx)}}}" if idx else "")


def latex(expr, one_based: bool = False, p: int | None = None, tokens: int | None = None, **kw) -> str:
    exprs = list(expr) if isinstance(expr, sp.MatrixBase) else [expr]
    return sp.latex(expr, symbol_names=symbol_names(exprs, None, one_based, p, tokens), **kw)


def latex_program(program, named: list[tuple[str, sp.Expr]], max_chars: int = 20000, *,
                  one_based: bool = False, p: int | None = None, tokens: int | None = None,
                  width: float | None = None, skip: set | None = None) -> list[str]:
    """Aligned LaTeX lines: the program definitions the named expressions need, then them.

    ``width`` (in the units of :func:`tex_width`) breaks longer lines into several; ``skip``
    leaves out definitions already printed elsewhere (e.g. the link's program before the
    Jacobian's)."""
    exprs = [e for _, e in named]
    defs = [(s, e) for s, e in program.closure(exprs) if not skip or s not in skip]
    names = symbol_names(exprs + [e for _, e in defs] + [s for s, _ in defs], program.latex_names,
                          one_based, p, tokens)
    items = [(names.get(sym, sp.latex(sym)), e) for sym, e in defs] + list(named)
    lines: list[str] = []
    for lhs, e in items:
        if width is None:
            lines.append(f"{lhs} &= {sp.latex(e, symbol_names=names)}")
        else:
            lines += broken_lines(lhs, e, names, width)
    out, total = [], 0
    for ln in lines:
        total += len(ln)
        if total > max_chars:
            gap = "&" if one_based else ""  # (the code generator's docstrings keep their form)
            out.append(gap + r"\text{(%d further lines omitted)}" % (len(lines) - len(out)))
            break
        out.append(ln)
    return out


# ----------------------------------------------------------------------------- line breaking

_CMD = re.compile(r"\\([A-Za-z]+|.)")
_WORDS = {"log": 2.4, "exp": 2.4, "det": 2.2, "sin": 2.2, "cos": 2.4, "tanh": 3.2, "operatorname": 0.0}
_ZERO = {"left", "right", "big", "Big", "bigg", "Bigg", "mathrm", "mathcal", "mathbf", "mathbb",
         "displaystyle", "limits", "nonumber"}


def tex_width(s: str) -> float:
    """Rough printed width of a math-mode LaTeX string, in units of one 11 pt italic letter
    (about 5.5 pt). Enough to decide where to break a line; the compile test has the last word."""
    width, _ = _width(s, 0)
    return width


def _group(s: str, i: int) -> tuple[float, int]:
    """Width of the group (or single token) starting at s[i]; returns (width, next index)."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return 0.0, i
    if s[i] == "{":
        return _width(s, i + 1, close=True)
    if s[i] == "\\":
        m = _CMD.match(s, i)
        return (0.0 if m.group(1) in _ZERO else 1.0), m.end()
    return 1.0, i + 1


def _width(s: str, i: int, close: bool = False) -> tuple[float, int]:
    w = 0.0
    while i < len(s):
        ch = s[i]
        if ch == "}":
            return w, i + 1
        if ch == "{":
            g, i = _width(s, i + 1, close=True)
            w += g
        elif ch in "_^":
            g, i = _group(s, i + 1)
            w += 0.7 * g
        elif ch == "\\":
            m = _CMD.match(s, i)
            cmd, i = m.group(1), m.end()
            if cmd == "frac":
                a, i = _group(s, i)
                b, i = _group(s, i)
                w += max(a, b) + 0.4
            elif cmd in ("left", "right"):
                _, i = _group(s, i)  # the delimiter
                w += 0.6
            elif cmd in ("quad", "qquad"):
                w += 2.0 if cmd == "quad" else 4.0
            elif cmd in ("\\", "&"):
                pass
            elif cmd in _WORDS:
                w += _WORDS[cmd]
            elif cmd in _ZERO:
                pass
            elif len(cmd) == 1:  # \, \; \{ ...
                w += 0.3 if cmd in ",;:! " else 1.0
            else:
                w += 1.0
        elif ch in "+-=<>":
            w += 2.0
        elif ch in " &":
            i += 1
            continue
        else:
            w += 1.0
        if ch not in "{_^\\":
            i += 1
    return w, i


def _terms(e: sp.Expr, names: dict) -> list[str]:
    """LaTeX of the terms of a sum, each with its sign (``+ a``, ``- b``), in SymPy's print order."""
    out = []
    for t in sp.Add.make_args(e) if e.is_Add else [e]:
        s = sp.latex(t, symbol_names=names)
        out.append(s if s.startswith("-") else "+ " + s)
    if e.is_Add:
        # SymPy's printer orders the terms of a sum its own way; follow it so the broken form
        # reads like the unbroken one
        order = sp.latex(e, symbol_names=names)
        out.sort(key=lambda s: order.find(s.lstrip("+- ")) if s.lstrip("+- ") in order else len(order))
    return out


def broken_lines(lhs: str, e: sp.Expr, names: dict, width: float) -> list[str]:
    """``lhs &= e`` as one aligned line, or several (``&\\quad + ...``) when wider than ``width``.

    A sum is broken between terms; a quotient or product with a long sum is written
    ``prefix \\Big( ... \\Big)`` and the sum broken inside."""
    text = sp.latex(e, symbol_names=names)
    if tex_width(lhs) + tex_width(text) + 2 <= width:
        return [f"{lhs} &= {text}"]
    prefix, body, suffix = "", e, ""
    if not e.is_Add:
        num, den = sp.fraction(e)
        sign = ""
        if num.is_Mul and num.args[0] == -1:
            sign, num = "-", -num
        if num.is_Mul:  # pull the non-sum factors out front
            sums = [a for a in num.args if a.is_Add]
            if len(sums) == 1:
                rest = sp.Mul(*[a for a in num.args if a is not sums[0]])
                prefix = sign + sp.latex(rest / den, symbol_names=names) + r"\Big("
                num, suffix = sums[0], r"\Big)"
                sign, den = "", sp.Integer(1)
        if not num.is_Add:
            return [f"{lhs} &= {text}"]  # nothing to break at: left for the compile test to judge
        if den != 1:
            prefix = sign + r"\frac{1}{" + sp.latex(den, symbol_names=names) + r"}\Big("
            suffix = r"\Big)"
        elif sign:
            prefix, suffix = r"-\Big(", r"\Big)"
        body = num
    terms = _terms(body, names)
    if terms[0].startswith("+ "):
        terms[0] = terms[0][2:]
    lines, cur = [], prefix
    avail = width - tex_width(lhs) - 2
    for t in terms:
        if cur and cur != prefix and tex_width(cur + " " + t) > avail:
            lines.append(cur)
            cur, avail = t, width - 4  # continuation lines start after \quad
        else:
            cur = f"{cur} {t}" if cur else t
    lines.append(cur + suffix)
    first = f"{lhs} &= {lines[0]}"
    return [first] + [rf"&\quad {ln}" for ln in lines[1:]]


# ----------------------------------------------------------------------------- document pieces

_TEX_SPECIAL = {"\\": r"\textbackslash{}", "_": r"\_", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#",
                "{": r"\{", "}": r"\}", "^": r"\textasciicircum{}", "~": r"\textasciitilde{}"}


def esc(text: str) -> str:
    """Plain text made safe for LaTeX."""
    return "".join(_TEX_SPECIAL.get(ch, ch) for ch in text)


def align(lines: list[str], star: bool = True, small: bool = False) -> str:
    """Aligned formulas (``align*``, or numbered ``align``); ``small``: printed \\small."""
    if not lines:
        return ""
    env = "align*" if star else "align"
    body = f"\\begin{{{env}}}\n" + " \\\\\n".join(lines) + f"\n\\end{{{env}}}\n"
    return "{\\small\n" + body + "}\n" if small else body


def block_name(spec: AttentionSpec, layer: int, head: int, role: str) -> str:
    """Index block of one weight matrix: z_l, z_l^{(j)} (head j), z_l^Q, z_l^{K(j)} (untied).

    Heads and roles go upstairs: a subscript pair z_{k,t} is an entry of Z (row k, token t)."""
    H = spec.layers[layer - 1].heads
    sup = ("" if role == "w" else role.upper()) + ("" if H == 1 else f"({head + 1})")
    return f"z_{{{layer}}}" + (f"^{{{sup}}}" if sup else "")


def index_blocks(d) -> list[tuple[str, list[int]]]:
    """(name, rows of Z) for each index block of a derivation, in row order; for free-form links
    one per row."""
    if not isinstance(d.spec, AttentionSpec):
        return [(row_name(d, k), [k]) for k in range(d.p)]
    out: dict[tuple, list[int]] = {}
    for k, lb in enumerate(d.labels):
        out.setdefault((lb.layer, lb.head, lb.role), []).append(k)
    return [(block_name(d.spec, *key), rows) for key, rows in out.items()]


def row_name(d, k: int) -> str:
    """Row k (0-based) of Z of a free-form link: z_{k+1} (one token) or z_{k+1,.}."""
    if d.tokens == 1:
        return z_name(k, 0, d.p, 1)
    return f"z_{{{k + 1},\\cdot}}"
