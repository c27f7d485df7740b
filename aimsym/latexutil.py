"""Shared LaTeX helpers: formulas printed from the same SymPy objects the code runs."""

from __future__ import annotations

import re

import sympy as sp

_Z = re.compile(r"^z_(\d+)_(\d+)$")


def _symbol_names(exprs) -> dict:
    names = {}
    for e in exprs:
        for s in e.free_symbols:
            m = _Z.match(s.name)
            if m:
                names[s] = f"z_{{{m.group(1)},{m.group(2)}}}"
            elif re.match(r"^h_(\d+)$", s.name):
                names[s] = f"h_{{{s.name[2:]}}}"
            elif re.match(r"^y_(\d+)$", s.name):
                names[s] = f"y_{{{s.name[2:]}}}"
    return names


def latex(expr, **kw) -> str:
    exprs = list(expr) if isinstance(expr, sp.MatrixBase) else [expr]
    return sp.latex(expr, symbol_names=_symbol_names(exprs), **kw)


def latex_cse(named: list[tuple[str, sp.Expr]], max_chars: int = 20000) -> list[str]:
    """Aligned LaTeX lines ``x_i = ...`` then ``name = ...`` after common subexpression
    elimination, so that large links stay readable and of bounded size."""
    exprs = [e for _, e in named]
    repl, reduced = sp.cse(exprs, symbols=sp.numbered_symbols("x"), optimizations="basic")
    names = _symbol_names(exprs)
    lines = []
    for sym, sub in repl:
        lines.append(f"{sp.latex(sym)} &= {sp.latex(sub, symbol_names=names)}")
    for (name, _), e in zip(named, reduced):
        lines.append(f"{name} &= {sp.latex(e, symbol_names=names)}")
    out, total = [], 0
    for ln in lines:
        total += len(ln)
        if total > max_chars:
            out.append(r"\text{(%d further lines omitted)}" % (len(lines) - len(out)))
            break
        out.append(ln)
    return out
