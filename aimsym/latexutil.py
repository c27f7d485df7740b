"""Shared LaTeX helpers: formulas printed from the same SymPy objects the code runs."""

from __future__ import annotations

import re

import sympy as sp

_Z = re.compile(r"^z_(\d+)_(\d+)$")


def _symbol_names(exprs, extra: dict | None = None) -> dict:
    names = dict(extra or {})
    for e in exprs:
        for s in e.free_symbols:
            m = _Z.match(s.name)
            if m:
                names[s] = f"z_{{{m.group(1)},{m.group(2)}}}"
            elif re.match(r"^h_(\d+)$", s.name):
                names[s] = f"h_{{{s.name[2:]}}}"
            elif re.match(r"^y_(\d+)$", s.name):
                names[s] = f"y_{{{s.name[2:]}}}"
            elif s.name.startswith("_d") and "__" in s.name and s not in names:
                base, _, i = s.name[2:].rpartition("__")
                inner = names.get(sp.Symbol(base, real=True)) or _plain(base)
                names[s] = rf"\partial_{{{i}}}{inner}"
            elif s.name.startswith("_") and s not in names:
                names[s] = _plain(s.name)
    return names


def _plain(name: str) -> str:
    r"""An unnamed program intermediate ``_F0_1_0_0`` as ``\mathrm{F0}_{1,0,0}``."""
    stem, *idx = name.strip("_").split("_")
    return rf"\mathrm{{{stem}}}" + (f"_{{{','.join(idx)}}}" if idx else "")


def latex(expr, **kw) -> str:
    exprs = list(expr) if isinstance(expr, sp.MatrixBase) else [expr]
    return sp.latex(expr, symbol_names=_symbol_names(exprs), **kw)


def latex_program(program, named: list[tuple[str, sp.Expr]], max_chars: int = 20000) -> list[str]:
    """Aligned LaTeX lines: the program definitions the named expressions need, then them."""
    exprs = [e for _, e in named]
    defs = program.closure(exprs)
    names = _symbol_names(exprs + [e for _, e in defs] + [s for s, _ in defs], program.latex_names)
    lines = [f"{names.get(sym, sp.latex(sym))} &= {sp.latex(e, symbol_names=names)}" for sym, e in defs]
    lines += [f"{name} &= {sp.latex(e, symbol_names=names)}" for name, e in named]
    out, total = [], 0
    for ln in lines:
        total += len(ln)
        if total > max_chars:
            out.append(r"\text{(%d further lines omitted)}" % (len(lines) - len(out)))
            break
        out.append(ln)
    return out
