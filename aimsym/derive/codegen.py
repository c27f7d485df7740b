"""Code generation: a derivation -> one self-contained Python module of scalar ``@njit``
kernels (the link, its Jacobian, the reduced-posterior branches) and plain data for the
solvers. The hand-written batch drivers it names in ``DRIVERS`` are appended at load time
(aimsym.denoise.drivers), so generated/ holds model-specific code only.

The module imports only ``math``, ``numpy``, ``numba`` and ``llvmlite`` (numba's LLVM binding,
for two bitcast intrinsics). Its text is deterministic (a function of the spec and the
generator version), which ``aimsym generate --check`` uses to detect stale committed modules.
"""

from __future__ import annotations

import re
from pathlib import Path

import sympy as sp
from sympy.printing.pycode import PythonCodePrinter

from .files import (  # noqa: F401 (locations and loading, re-exported for callers of codegen)
    GENERATOR_VERSION, REPO_ROOT, cache_dir, generated_dir, header_matches, import_module, is_bundled,
    module_path)
from .latexutil import latex_program
from .spec import Spec, to_toml
from .symbolic import Derivation, derive



class _Printer(PythonCodePrinter):
    """Prints against ``math``; Heaviside and sign as small local helpers."""

    def _print_Heaviside(self, expr):
        return f"_heaviside({self._print(expr.args[0])})"

    def _print_sign(self, expr):
        return f"_sign({self._print(expr.args[0])})"

    def _print_DiracDelta(self, expr):
        return "0.0"  # derivative of a step: zero almost everywhere

    def _print_Symbol(self, expr):
        return expr.name

    def _print_Rational(self, expr):
        return f"{float(expr)!r}"

    def _print_Float(self, expr):
        return repr(float(expr))


_P = _Printer({"fully_qualified_modules": True, "standard": "python3"})


def _code(expr) -> str:
    return _P.doprint(expr)


def _cse_block(exprs: list[sp.Expr], indent: str = "    ", prefix: str = "x") -> tuple[list[str], list[str]]:
    repl, reduced = sp.cse(exprs, symbols=sp.numbered_symbols(prefix), optimizations="basic", order="canonical")
    lines = [f"{indent}{sym} = {_code(sub)}" for sym, sub in repl]
    return lines, [_code(e) for e in reduced]


_SOFTMAX_NAME = re.compile(r"^(_S[0-9a-z]*)_(\d+)_(\d+)$")


def _softmax_entry_args(e) -> list | None:
    """Exponent arguments of a row-softmax entry 1 / (1 + sum_c exp(x_c)) (None if not of that form)."""
    if not (e.is_Pow and e.exp == -1 and e.base.is_Add):
        return None
    args, one = [], 0
    for t in e.base.args:
        if t == 1:
            one += 1
        elif isinstance(t, sp.exp):
            args.append(t.args[0])
        else:
            return None
    return args if one == 1 else None


def _softmax_rows(defs) -> dict:
    """Row softmaxes among the program definitions (as written by ``symbolic.softmax_rows``):
    {first entry's symbol: (entry symbols in column order, logits relative to column 0)}.
    A row is recognised only if every entry b equals 1 / (1 + sum_{c != b} exp(r_c - r_b)) for
    the same relative logits r (checked symbolically), so the rewrite is exact."""
    groups: dict[tuple[str, int], dict[int, tuple]] = {}
    for sym, e in defs:
        mt = _SOFTMAX_NAME.match(sym.name)
        if mt:
            groups.setdefault((mt.group(1), int(mt.group(2))), {})[int(mt.group(3))] = (sym, e)
    rows = {}
    for _, ent in groups.items():
        T = len(ent)
        if T < 2 or sorted(ent) != list(range(T)):
            continue
        args0 = _softmax_entry_args(ent[0][1])
        if args0 is None or len(args0) != T - 1:
            continue
        # relative logits r_c = A_c - A_0: the exponents of entry 0, matched to columns below
        ok = True
        rel = [sp.Integer(0)] * T
        for b in range(1, T):
            args = _softmax_entry_args(ent[b][1])
            if args is None or len(args) != T - 1:
                ok = False
                break
            # entry b contains exp(r_0 - r_b) = exp(-r_b)
            cands = [a for a in args0 if any(sp.expand(a + x) == 0 for x in args)]
            if len(cands) != 1:
                ok = False
                break
            rel[b] = cands[0]
        if not ok or len(set(rel)) != T:
            continue
        for b in range(T):
            want = sorted((sp.srepr(sp.expand(rel[c] - rel[b])) for c in range(T) if c != b))
            have = sorted(sp.srepr(sp.expand(a)) for a in _softmax_entry_args(ent[b][1]))
            if want != have:
                ok = False
                break
        if ok:
            rows[ent[0][0]] = ([ent[b][0] for b in range(T)], rel)
    return rows


def _print_defs(defs, indent: str) -> list[str]:
    """Print definitions; row softmaxes are computed stably with one exp per entry (one per row
    for T = 2, via ``_softmax2``) instead of the T - 1 exps per entry of the symbolic form."""
    rows = _softmax_rows(defs)
    members = {s for syms, _ in rows.values() for s in syms[1:]}
    lines = []
    for sym, e in defs:
        if sym in members:
            continue
        if sym in rows:
            syms, rel = rows[sym]
            names = [s.name for s in syms]
            if len(syms) == 2:
                lines.append(f"{indent}{names[0]}, {names[1]} = _softmax2({_code(rel[1])})")
            else:
                stem = names[0] + "_"
                lines.append(f"{indent}{stem}r = ({', '.join(['0.0'] + [_code(r) for r in rel[1:]])})")
                lines.append(f"{indent}{stem}m = max({stem}r)")
                for c, nm in enumerate(names):
                    lines.append(f"{indent}{nm} = math.exp({stem}r[{c}] - {stem}m)")
                lines.append(f"{indent}{stem}s = 1.0 / ({' + '.join(names)})")
                for nm in names:
                    lines.append(f"{indent}{nm} *= {stem}s")
            continue
        lines.append(f"{indent}{sym.name} = {_code(e)}")
    return lines


def _program_block(d: Derivation, outputs: list, extra_defs=(), indent: str = "    ") -> tuple[list[str], list[str]]:
    """Print the program definitions ``outputs`` need, then cse the outputs themselves."""
    from .symbolic import Program

    prog = Program()
    prog.defs = list(d.program.defs) + list(extra_defs)
    closure = prog.closure(outputs)
    # a recognised softmax row is printed whole: its other entries are needed with the first
    need = {s for s, _ in closure}
    rows = _softmax_rows(prog.defs)
    for syms, _ in rows.values():
        if any(s in need for s in syms):
            need |= set(syms)
    closure = [(s, e) for s, e in prog.defs if s in need] if rows else closure
    closure = prog.closure([s for s, _ in closure]) if rows else closure
    lines = _print_defs(closure, indent)
    cse_lines, reduced = _cse_block(outputs, indent)
    return lines + cse_lines, reduced


def _docstring(title: str, latex_lines: list[str], indent: str = "    ") -> list[str]:
    body = [f'{indent}r"""{title}', "", f"{indent}.. math::", ""]
    body += [f"{indent}    {ln} \\\\" for ln in latex_lines]
    body += [f'{indent}"""']
    return body


def _unpack(d: Derivation, entries, source: str, indent="    ") -> list[str]:
    return [f"{indent}{d.Z[k, t].name} = {source}[{i}]" for i, (k, t) in enumerate(entries)]


def _unpack_Z(d: Derivation, indent="    ") -> list[str]:
    return [f"{indent}{d.Z[k, t].name} = Z[{k}, {t}]" for k in range(d.p) for t in range(d.tokens)]


def _unpack_params(d: Derivation, indent="    ") -> list[str]:
    return [f"{indent}{s.name} = params[{i}]" for i, s in enumerate(d.params)]


def _link_kernel(d: Derivation) -> list[str]:
    out = list(d.link)
    rows, cols = d.link.shape
    names = [(f"y_{{{a},{b}}}", d.link[a, b]) for a in range(rows) for b in range(cols)]
    lines = ["@njit(cache=True)", "def link(Z, params, out):"]
    lines += _docstring("Link y = g(Z); Z has shape (P, T), out has shape LINK_SHAPE.",
                        latex_program(d.program, names, 6000))
    lines += _unpack_Z(d) + _unpack_params(d)
    body, reduced = _program_block(d, out)
    lines += body
    lines += [f"    out[{a}, {b}] = {reduced[a * cols + b]}" for a in range(rows) for b in range(cols)]
    return lines


def _jacobian_kernel(d: Derivation) -> list[str]:
    defs, J = d.jacobian_program
    rows, cols = d.link.shape
    flat = [e for row in J for e in row]
    lines = ["@njit(cache=True)", "def link_jacobian(Z, params, out):"]
    lines += [
        '    r"""Jacobian out[a, b, k, t] = d y_{a,b} / d z_{k,t} (derivative of the link above,',
        "    by SymPy; entries identically zero are left as written by the caller's zeroing).",
        '    """',
    ]
    lines += _unpack_Z(d) + _unpack_params(d)
    body, reduced = _program_block(d, flat, defs)
    lines += body
    i = 0
    for a in range(rows):
        for b in range(cols):
            for k in range(d.p):
                for t in range(d.tokens):
                    lines.append(f"    out[{a}, {b}, {k}, {t}] = {reduced[i]}")
                    i += 1
    return lines


def _branch_kernel(d: Derivation) -> list[str]:
    """``branch(b, u, obs, params, z) -> log weight factor`` for the reduced posterior."""
    red = d.reduction
    if red is not None and red.marginal:
        return _marginal_branch_kernel(d)
    # IEEE division: where det M_{L-1} = 0 (skip c = 0 and two tokens' indices equal, a null set)
    # log J is +inf and the drivers give the point zero weight instead of raising ZeroDivisionError
    lines = ['@njit(cache=True, error_model="numpy")', "def branch(b, u, obs, params, z):"]
    if red is not None:
        named = [(f"z_{{{k},{t}}}^{{(s={'+-'[i] if red.kind == 'attention-rank1' else i})}}", e)
                 for i, br in enumerate(red.branches) for (k, t), e in zip(red.solved, br)]
        named += [(f"\\log J^{{({i})}}", e) for i, e in enumerate(red.log_jacobian)]
        title = ("Reduced posterior branch b: fills z (P, T) from the free entries u and the observed "
                 "quantity obs; returns the log of the weight factor (Jacobian).")
        lines += _docstring(title, latex_program(d.program, named, 8000))
        lines += _unpack(d, red.free, "u")
        lines += [f"    {s.name} = obs[{i}]" for i, s in enumerate(red.obs)]
        lines += _unpack_params(d)
        for i, (k, t) in enumerate(red.free):
            if i in red.log_free:  # the slot holds s = log|z|; the sign is the branch's
                lines.append(f"    z[{k}, {t}] = (1.0 if b < {len(red.branches) // 2} else -1.0) * math.exp({d.Z[k, t].name})")
            else:
                lines.append(f"    z[{k}, {t}] = {d.Z[k, t].name}")
        exprs = [e for br in red.branches for e in br] + list(red.log_jacobian)
        body, reduced = _program_block(d, exprs)
        lines += body
        n_solved = len(red.solved)
        for i in range(len(red.branches)):
            lines.append(f"    {'if' if i == 0 else 'elif'} b == {i}:")
            for j, (k, t) in enumerate(red.solved):
                lines.append(f"        z[{k}, {t}] = {reduced[i * n_solved + j]}")
            lines.append(f"        return {reduced[len(red.branches) * n_solved + i]}")
        lines.append("    return -math.inf")
        return lines
    # generic path: u is all of Z (row-major); the factor is the Gaussian output noise
    entries = [(k, t) for k in range(d.p) for t in range(d.tokens)]
    lines += [
        '    r"""Generic path: u holds all entries of Z (row-major); returns',
        "    log N(obs; g(Z), Delta I) with Delta = NOISE (or params[NOISE_PARAM]).",
        '    """',
    ]
    lines += _unpack(d, entries, "u") + _unpack_params(d)
    lines += [f"    z[{k}, {t}] = {d.Z[k, t].name}" for k, t in entries]
    body, reduced = _program_block(d, list(d.link))
    lines += body
    lines.append("    Delta = noise_variance(params)")
    lines.append("    acc = 0.0")
    for i, e in enumerate(reduced):
        lines.append(f"    r = obs[{i}] - ({e})")
        lines.append("    acc += r * r")
    lines.append(f"    return -0.5 * acc / Delta - {0.5 * len(d.link)} * math.log(2.0 * math.pi * Delta)")
    return lines


def _marginal_branch_kernel(d: Derivation) -> list[str]:
    """``branch`` of a generalised reduction (kind "attention-untied"): fills the free entries,
    the solved block and one particular solution of the marginalised block's functionals; the
    driver's ``_marginal`` then moves the latter to its conditional mean (theory section 3)."""
    red = d.reduction
    aux_slots = [i for i, (k, _) in enumerate(red.free) if k < 0]
    entries = list(red.solved) + list(red.marginal)
    named = [(f"z_{{{k},{t}}}^{{(\\pm)}}", e) for (k, t), e in zip(entries, red.branches[0])]
    named.append((r"\log J^{(+)}", red.log_jacobian[0]))
    # IEEE division: where det M_{L-1} or det F F^T vanishes (untied earlier layers: c I + S is not
    # bounded away from singular) log J is +-inf and the driver gives the point zero weight
    lines = ['@njit(cache=True, error_model="numpy")', "def branch(b, u, obs, params, z):"]
    title = ("Reduced posterior branch b (sign of lambda): fills z (P, T) from the free entries u (the last slot: "
             "s = log|lambda| - s_ref), qhat and ehat in obs; the marginalised block gets one particular "
             "solution of its functionals (the driver's _marginal projects it). Returns the log weight factor.")
    lines += _docstring(title, latex_program(d.program, named, 8000))
    lines += [f"    {d.Z[k, t].name} = u[{i}]" for i, (k, t) in enumerate(red.free) if k >= 0]
    lines += [f"    {a.name} = u[{i}]" for a, i in zip(red.aux, aux_slots)]
    lines += [f"    {s.name} = obs[{i}]" for i, s in enumerate(red.obs)]
    lines += _unpack_params(d)
    lines += [f"    z[{k}, {t}] = {d.Z[k, t].name}" for (k, t) in red.free if k >= 0]
    exprs = [e for br in red.branches for e in br] + list(red.log_jacobian)
    body, reduced = _program_block(d, exprs)
    lines += body
    n_e = len(entries)
    for i in range(len(red.branches)):
        lines.append(f"    {'if' if i == 0 else 'elif'} b == {i}:")
        for j, (k, t) in enumerate(entries):
            lines.append(f"        z[{k}, {t}] = {reduced[i * n_e + j]}")
        lines.append(f"        return {reduced[len(red.branches) * n_e + i]}")
    lines.append("    return -math.inf")
    return lines


# the conditional-mean projection of a marginalised block (rank one: one row K of Z), appended to
# the modules of models with one; the driver calls it after ``branch``
_MARGINAL_KERNEL = '''@njit(cache=True)
def _marginal(z, omega, Vinv):
    """Move the marginalised row K = MARGINAL_ROWS[0] of z (a solution of its functionals F z_K^T = d)
    to its conditional mean given d and the other rows: z_K += N N^T (mu - z_K), mu_t the prior's
    conditional mean of z_{K,t} given z_{-K,t} (variance sigma^2 = 1 / Vinv[K, K]) and N the
    functionals' null space (MARGINAL_NULL, T x n_null, orthonormal). Returns the log factor
    (n_null / 2) log(2 pi sigma^2) that turns prod_t N(z_t; omega_t, V) at that point into the
    prior of the other rows times the Gaussian density of d (theory section 3)."""
    K = MARGINAL_ROWS[0]
    p = z.shape[0]
    nt = z.shape[1]
    s2 = 1.0 / Vinv[K, K]
    nn = MARGINAL_NULL.shape[1]
    for c in range(nn):
        coef = 0.0
        for t in range(nt):
            acc = 0.0
            for j in range(p):
                if j != K:
                    acc += Vinv[K, j] * (z[j, t] - omega[j, t])
            mu = omega[K, t] - s2 * acc
            coef += MARGINAL_NULL[t, c] * (mu - z[K, t])
        for t in range(nt):
            z[K, t] += coef * MARGINAL_NULL[t, c]
    return 0.5 * nn * math.log(2.0 * math.pi * s2)
'''

_MARGINAL_STUB = '''@njit(cache=True)
def _marginal(z, omega, Vinv):
    """No marginalised block in this model."""
    return 0.0
'''


def _polar_kernels(spec: Spec, d: Derivation) -> list[str]:
    """``polar_branch(u, obs, params, w) -> J``: for models with the polar rule (``POLAR_ANGLES``),
    branch 0's solved row w (T) at the free indices u (branch 1 is -w) and the weight factor
    J = exp(log J) = 1/|det M_{L-1}(u)| (linear: no log per node); ``polar_beta(params)``: the
    first layer's inverse temperature (its logits are beta u_a u_b). Stubs for other models."""
    red = d.reduction
    lines = ["@njit(cache=True)", "def polar_beta(params):"]
    if not _polar_angles(spec, d):
        lines += ["    return math.nan", "", "", "@njit(cache=True)", "def polar_branch(u, obs, params, w):",
                  "    return math.nan", "", "", "@njit(cache=True)", "def polar_rows(U, n, obs, params, W, J, E):",
                  "    return None", "", "", "POLAR_ROWS = 1", "POLAR_LINEAR_OBS = False"]
        return lines
    from .symbolic import param_symbol

    lines += _unpack_params(d)
    lines.append(f"    return float({_code(param_symbol(spec.layers[0].beta))})")
    lines += ["", "", '@njit(cache=True, error_model="numpy")', "def polar_branch(u, obs, params, w):",
              '    """Branch 0 of the reduced posterior: w = solved row (branch 1: -w); returns 1/|det M|."""']
    lines += _unpack(d, red.free, "u")
    lines += [f"    {s.name} = obs[{i}]" for i, s in enumerate(red.obs)]
    lines += _unpack_params(d)
    jac = sp.exp(red.log_jacobian[0])
    body, reduced = _program_block(d, list(red.branches[0]) + [jac])
    lines += body
    for j, (k, t) in enumerate(red.solved):
        assert k == d.p - 1, "polar rule: the solved entries are the last layer's row"
        lines.append(f"    w[{t}] = {reduced[j]}")
    lines.append(f"    return {reduced[-1]}")
    return lines + ["", ""] + _polar_rows_kernel(d, body, reduced)


def _reuse_reciprocal(expr: str, body: list[str]) -> str:
    """``1/abs(x)`` -> ``abs(y)`` when the program already has ``y = 1/x`` (the CSE keeps both
    divisions; IEEE division is correctly rounded and odd, so the value is the same, one
    division per node less)."""
    m = re.fullmatch(r"1/abs\((\w+)\)", expr)
    if m:
        for ln in body:
            ma = _ASSIGN_LINE.match(ln)
            if ma and ma.group(2) == f"1/{m.group(1)}":
                return f"abs({ma.group(1)})"
    return expr


_SOFTMAX2_LINE = re.compile(r"^(\s*)(\w+), (\w+) = _softmax2\((.*)\)$")
_ASSIGN_LINE = re.compile(r"^\s*(\w+) = (.*)$")


def _polar_rows_kernel(d: Derivation, body: list[str], reduced: list[str]) -> list[str]:
    """``polar_rows``: ``polar_branch`` over a block of nodes, written so that LLVM vectorises
    it. The first layer's row softmaxes need one exp each per node; a first pass stores their
    arguments -|d|, one ``_vexp`` call per row exponentiates them in SIMD, and a second pass
    runs the program with ``_softmax2e`` (the softmax from the stored exp). The first pass
    prints only the definitions the logits need (a line that uses a softmax entry is skipped)."""
    red = d.reduction
    n_rows = 0
    first, second, tainted = [], [], set()
    for ln in body:
        mt = _SOFTMAX2_LINE.match(ln)
        if mt:
            ind, a, b, arg = mt.groups()
            first.append(f"{ind}    E[{n_rows}, i] = -abs({arg})")
            second.append(f"{ind}    {a}, {b} = _softmax2e({arg}, E[{n_rows}, i])")
            tainted |= {a, b}
            n_rows += 1
            continue
        ma = _ASSIGN_LINE.match(ln)
        assert ma, f"polar_rows: unexpected line {ln!r}"
        if set(re.findall(r"\w+", ma.group(2))) & tainted:
            tainted.add(ma.group(1))
        else:
            first.append("    " + ln)
        second.append("    " + ln)
    assert n_rows > 0, "polar_rows: the first layer's softmax rows were not recognised"
    unpack = [f"        {d.Z[k, t].name} = U[{i}, i]" for i, (k, t) in enumerate(red.free)]
    lines = ['@njit(cache=True, error_model="numpy")  # IEEE division (1/det M = inf is handled by the caller): no',
             "# ZeroDivisionError branch, so the loops vectorise",
             "def polar_rows(U, n, obs, params, W, J, E):",
             '    """``polar_branch`` at the nodes i < n, vectorised: U (2, N) free indices, W (T, N)',
             "    branch 0's solved row, J (N) = 1/|det M|; E (POLAR_ROWS, N) is scratch.",
             '    The softmax exps run in SIMD through ``_vexp`` (tests: equal to polar_branch per node)."""']
    lines += [f"    {s.name} = obs[{i}]" for i, s in enumerate(red.obs)]
    lines += _unpack_params(d)
    lines += ["    for i in range(n):"] + unpack + first
    lines += [f"    for k in range({n_rows}):", "        _vexp(E[k], n, 0.0)"]
    lines += ["    for i in range(n):"] + unpack + second
    for j, (k, t) in enumerate(red.solved):
        lines.append(f"        W[{t}, i] = {reduced[j]}")
    lines.append(f"        J[i] = {_reuse_reciprocal(reduced[-1], body)}")
    # the solved row w = M(u)^{-1} h is linear in the observation: a node table of M^{-1} (and
    # of the nodes and weights) then serves every sample of a batch (driver: polar_tables)
    zero = {s: 0 for s in red.obs}
    linear = all(e.subs(zero) == 0 and all(sp.diff(e, a, b) == 0 for a in red.obs for b in red.obs)
                 for e in red.branches[0])
    lines += ["", "", f"POLAR_ROWS = {n_rows}", f"POLAR_LINEAR_OBS = {linear}"]
    return lines


def _noise_kernel(d: Derivation) -> list[str]:
    noise = d.spec.noise
    names = [s.name for s in d.params]
    body = f"params[{names.index(noise)}]" if isinstance(noise, str) else repr(float(noise))
    return ["@njit(cache=True)", "def noise_variance(params):", f"    return {body}"]


def _last_beta_kernel(d: Derivation) -> list[str]:
    red = d.reduction
    beta = red.beta if (red is not None and red.beta is not None) else sp.Integer(1)
    lines = ["@njit(cache=True)", "def last_beta(params):"]
    lines += _unpack_params(d)
    lines.append(f"    return {_code(beta)}")
    return lines


def _mixing_kernel(d: Derivation) -> list[str]:
    """``mixing(u, params, M)``: the earlier layers' mixing matrix M_{L-1}(u) at the free
    indices u (for the hardmax-last-layer reduction, where y constrains v = M_{L-1}(u) z_L)."""
    red = d.reduction
    mix = red.mixing
    T = mix.shape[0]
    named = [(f"(M_{{L-1}})_{{{a},{b}}}", mix[a, b]) for a in range(T) for b in range(T)]
    named.append((r"\det M_{L-1}", red.det_mixing))
    lines = ["@njit(cache=True)", "def mixing(u, params, M):"]
    lines += _docstring("Mixing matrix M_{L-1}(u) of the earlier layers at the free indices u; out M (T, T).",
                        latex_program(d.program, named, 8000))
    lines += _unpack(d, red.free, "u") + _unpack_params(d)
    body, reduced = _program_block(d, list(mix))
    lines += body
    lines += [f"    M[{a}, {b}] = {reduced[a * T + b]}" for a in range(T) for b in range(T)]
    return lines


def chamber_blocks(spec: Spec, d: Derivation) -> list[tuple[int, int, int]]:
    """The free rows of Z as attention blocks for the chamber rule: (row, layer, head) per row,
    where every free row is the tied rank-one index of one head of an earlier layer (softmax,
    hardmax or linear) and the last layer is solved (reduction kind attention-rank1). Such a head's
    attention sigma(beta q q^T), q = M_{l-1} z_row^T, switches across the hyperplanes q_a = 0 and
    q_a = q_b only (the chambers of the braid arrangement of (q, 0)); [] for other models."""
    from .spec import AttentionSpec

    red = d.reduction
    if not (isinstance(spec, AttentionSpec) and red is not None and red.kind == "attention-rank1"
            and len(spec.layers) >= 2 and not spec.shared_flow):
        return []
    if any(not ly.tied or ly.rank != 1 or ly.activation not in ("softmax", "hardmax", "linear")
           for ly in spec.layers[:-1]):
        return []
    blocks = [(k, lb.layer, lb.head) for k, lb in enumerate(d.labels[:-1])]
    if red.free != [(k, t) for k, _, _ in blocks for t in range(d.tokens)]:
        return []
    return blocks


def untied_first(spec: Spec, d: Derivation) -> tuple[int, int] | None:
    """(query row, key row) of an untied first layer for the untied chamber rule: two layers at
    T = 2, an untied softmax last layer (reduction kind attention-untied) after one untied rank-one
    single-head softmax layer, whose attention sigma(beta q k^T) switches across q_a = 0 and
    k_1 = k_2 only. None for other models."""
    from .spec import AttentionSpec

    red = d.reduction
    if not (isinstance(spec, AttentionSpec) and red is not None and red.kind == "attention-untied"
            and len(spec.layers) == 2 and spec.tokens == 2 and not spec.shared_flow):
        return None
    first = spec.layers[0]
    if first.tied or first.rank != 1 or first.heads != 1 or first.activation != "softmax":
        return None
    rows = {lb.role: k for k, lb in enumerate(d.labels) if lb.layer == 1}
    if red.free[:4] != [(rows["q"], 0), (rows["q"], 1), (rows["k"], 0), (rows["k"], 1)]:
        return None
    return rows["q"], rows["k"]


def _untied_kernels(spec: Spec, d: Derivation) -> list[str]:
    """``UNTIED_FIRST`` (query row, key row) and ``untied_beta(params)`` for the untied chamber rule."""
    from .symbolic import param_symbol

    rows = untied_first(spec, d)
    lines = [f"UNTIED_FIRST = {tuple(rows) if rows else ()!r}  # (query row, key row) of an untied first layer",
             "", "", "@njit(cache=True)", "def untied_beta(params):"]
    if not rows:
        return lines + ["    return math.nan"]
    return lines + _unpack_params(d) + [f"    return abs(float({_code(param_symbol(spec.layers[0].beta))}))"]


def _chamber_kernels(spec: Spec, d: Derivation) -> list[str]:
    """For the chamber rule (``CHAMBER_BLOCKS``): ``block_activation(b, q, params, S)`` fills S
    (T, T) with block b's term a_h sigma(beta q q^T) of its layer's mixing matrix
    M_l = (c_l I + sum_h a_h sigma(beta q_h q_h^T)) M_{l-1}; ``layer_skip(l, params)`` is c_l;
    ``block_beta(b, params)`` the block's inverse temperature (0 for a linear block: no switching)
    and ``block_bound(b, R, params)`` a bound on the spectral norm of its term for |q| <= R."""
    from .symbolic import Program, activate, param_symbol

    blocks = chamber_blocks(spec, d)
    T = d.tokens
    lines = [f"CHAMBER_BLOCKS = {tuple((k, l) for k, l, _ in blocks)!r}  # (row of Z, layer) per free row",
             f"CHAMBER_LAYERS = {len(spec.layers) - 1 if blocks else 0}", ""]
    if not blocks:
        return lines + ["", "@njit(cache=True)", "def block_activation(b, q, params, S):", "    return None", "", "",
                        "@njit(cache=True)", "def layer_skip(l, params):", "    return math.nan", "", "",
                        "@njit(cache=True)", "def block_beta(b, params):", "    return math.nan", "", "",
                        "@njit(cache=True)", "def block_bound(b, R, params):", "    return math.nan"]
    q = sp.Matrix([sp.Symbol(f"q_{t}", real=True) for t in range(T)])
    act = ["", "", "@njit(cache=True)", "def block_activation(b, q, params, S):"]
    act += _docstring("Block b's term a_h sigma(beta q q^T) of its layer's mixing matrix, into S (T, T).",
                      [f"S^{{(b={i})}} = {sp.latex(param_symbol(spec.layers[l - 1].head_weights()[h]))}"
                       rf" \sigma_{{\mathrm{{{spec.layers[l - 1].activation}}}}}"
                       rf"\left({sp.latex(param_symbol(spec.layers[l - 1].beta))}\, q q^\top\right)"
                       for i, (_, l, h) in enumerate(blocks)])
    act += [f"    q_{t} = q[{t}]" for t in range(T)] + _unpack_params(d)
    beta_k = ["", "", "@njit(cache=True)", "def block_beta(b, params):"] + _unpack_params(d)
    bound_k = ["", "", "@njit(cache=True)", "def block_bound(b, R, params):"] + _unpack_params(d)
    for i, (_, l, h) in enumerate(blocks):
        layer = spec.layers[l - 1]
        beta, a = param_symbol(layer.beta), param_symbol(layer.head_weights()[h])
        prog = Program()
        # (the entries as the program returns them: a trivial entry, e.g. q_0 q_1 of a linear
        # block, is kept as its expression and gets no name of its own)
        S = prog.matrix(f"S{i}", activate(layer.activation, prog.matrix(f"A{i}", beta * (q * q.T))))
        entries = [S[r, c] for r in range(T) for c in range(T)]
        kw = "if" if i == 0 else "elif"
        act.append(f"    {kw} b == {i}:")
        act += _print_defs(prog.closure(entries), "        ")
        act += [f"        S[{r}, {c}] = {_code(a * entries[r * T + c])}" for r in range(T) for c in range(T)]
        if layer.activation in ("softmax", "hardmax"):
            # (a hardmax block is constant inside each chamber: the grading towards the walls at
            # the softmax's width is then only a smooth change of variables)
            beta_k += [f"    {kw} b == {i}:", f"        return abs(float({_code(beta)}))"]
            bound_k += [f"    {kw} b == {i}:", f"        return abs(float({_code(a)})) * {float(T) ** 0.5!r}"]
        else:
            beta_k += [f"    {kw} b == {i}:", "        return 0.0"]
            bound_k += [f"    {kw} b == {i}:", f"        return abs(float({_code(a * beta)})) * R * R"]
    act.append("    return None")
    beta_k.append("    return math.nan")
    bound_k.append("    return math.nan")
    skip = ["", "", "@njit(cache=True)", "def layer_skip(l, params):"] + _unpack_params(d)
    for l, layer in enumerate(spec.layers[:-1], start=1):
        skip += [f"    {'if' if l == 1 else 'elif'} l == {l}:", f"        return float({_code(param_symbol(layer.skip))})"]
    skip.append("    return math.nan")
    return lines + act + skip + beta_k + bound_k


def _polar_angles(spec: Spec, d: Derivation) -> list[float]:
    """Sector boundaries of the polar rule, where it applies: two layers, T = 2, the free
    indices u = z_1 of a tied rank-one single-head softmax first layer, whose attention (logits
    beta u_a u_b) switches across the lines u_1 = 0, u_2 = 0 and u_1 = u_2."""
    import math

    from .spec import AttentionSpec

    red = d.reduction
    if not (isinstance(spec, AttentionSpec) and red is not None and red.kind == "attention-rank1"
            and len(spec.layers) == 2 and spec.tokens == 2 and not spec.shared_flow):
        return []
    first = spec.layers[0]
    # (a linear or hardmax first layer has no row softmax for the rule's SIMD kernel; the modal
    # cascade with the chamber rule integrates it)
    if not (first.tied and first.rank == 1 and first.heads == 1 and first.activation == "softmax") \
            or red.free != [(0, 0), (0, 1)]:
        return []
    return [0.0, math.pi / 4, math.pi / 2, math.pi, 5 * math.pi / 4, 3 * math.pi / 2, 2 * math.pi]


def _observation_function(d: Derivation) -> list[str]:
    """numpy (not numba) map Z -> the denoiser's observation (h = M_{L-1} z_L^T for attention
    models), printed exactly as symbolic.numeric_function prints it; None where y is observed."""
    from .symbolic import numpy_source

    red = d.reduction
    if red is None or red.obs_from_Z is None:
        return ["observation_values = None  # the denoiser observes y itself"]
    src = numpy_source(d, red.obs_from_Z, "observation_values").splitlines()
    return [src[0], "    import numpy", *src[1:]]


def module_source(spec: Spec) -> str:
    d = derive(spec)
    red = d.reduction
    info = d.summary()
    names = [s.name for s in d.params]
    polar_angles = _polar_angles(spec, d)
    rows, cols = d.link.shape
    drivers = (("driver", "hardmax") if red is not None and red.kind in ("hardmax-wedge", "hardmax-wedge-mixed")
               else ("driver",))
    marginal = list(red.marginal) if red is not None else []
    null = [list(map(float, r)) for r in red.marginal_null] if marginal else []
    assert len({k for k, _ in marginal}) <= 1, "marginalised blocks of more than one row are not supported"
    if red is not None:
        path, free, solved, n_branches = red.kind, red.free, red.solved, len(red.branches)
        obs_kind = {"attention-rank1": "h", "attention-untied": "qd"}.get(red.kind, "y")
        activation = red.activation
    else:
        path = "noisy"
        free = [(k, t) for k in range(d.p) for t in range(d.tokens)]
        solved, n_branches, obs_kind, activation = [], 1, "y", ""
    head = [
        '"""Generated by aimsym -- do not edit; regenerate with `aimsym generate`.',
        "",
        f"model: {spec.name}",
        f"spec hash: {spec.hash()}",
        f"generator: {GENERATOR_VERSION}",
        f"denoiser path: {info['denoiser_path']} ({info['reduction']['reason']})",
        "",
        "Spec:",
        "",
        *["    " + ln for ln in to_toml(spec).splitlines()],
        '"""',
        "",
        "import math",
        "",
        "import numpy as np",
        "from llvmlite import ir as llvm_ir",
        "from numba import njit, prange, types",
        "from numba.extending import intrinsic",
        "",
        f"SPEC_HASH = {spec.hash()!r}",
        f"GENERATOR_VERSION = {GENERATOR_VERSION!r}",
        f"NAME = {spec.name!r}",
        f"P = {d.p}",
        f"T = {d.tokens}",
        f"LINK_SHAPE = ({rows}, {cols})",
        f"OUTPUT_SHAPE = {tuple(d.output_shape)!r}",
        f"PARAM_NAMES = {tuple(names)!r}",
        f"PATH = {path!r}",
        f"OBS_KIND = {obs_kind!r}",
        f"LAST_ACTIVATION = {activation!r}",
        f"N_BRANCHES = {n_branches}",
        f"FREE = {tuple(free)!r}",
        f"SOLVED = {tuple(solved)!r}",
        f"INTEGRAL_DIM = {len(free)}",
        f"FREE_K = np.array({[k for k, _ in free]!r}, dtype=np.int64)",
        f"FREE_T = np.array({[t for _, t in free]!r}, dtype=np.int64)",
        f"FREE_LOG = np.array({[int(i in (red.log_free if red else [])) for i in range(len(free))]!r}, dtype=np.int64)",
        f"POLAR_ANGLES = np.array({polar_angles!r}, dtype=np.float64)",
        f"MARGINAL = {tuple(marginal)!r}",
        f"MARGINAL_ROWS = np.array({sorted({k for k, _ in marginal})!r}, dtype=np.int64)",
        f"MARGINAL_NULL = np.array({null!r}, dtype=np.float64).reshape({d.tokens}, {len(null[0]) if null else 0})",
        f"HAS_MARGINAL = {bool(marginal)}  # a compile-time constant: a Gaussian block marginalised analytically",
        f"HAS_POLAR = {bool(polar_angles)}  # a compile-time constant: models without the polar rule skip compiling it",
        f"EVEN_ROWS = {tuple(tuple(s['rows']) for s in d.symmetries if s['name'] != 'Z -> -Z')!r}",
        "# hand-written drivers appended at load time (aimsym/denoise/drivers.py); the second one",
        "# serves a hardmax last layer (kinds hardmax-wedge and hardmax-wedge-mixed)",
        f"DRIVERS = {drivers!r}",
        "",
        "# plain data for the solvers (solving needs no SymPy): row k of Z is (layer, head, role, rank)",
        f"INDEX_LABELS = {tuple((lb.layer, lb.head, lb.role, lb.rank) for lb in d.labels)!r}",
        f"SIGN_SYMMETRIES = {tuple((s['name'], tuple(s['rows'])) for s in d.symmetries)!r}",
        f"COUNTING = {d.counting!r}",
        f"REDUCTION_REASON = {d.reduction_reason!r}",
        "",
        "",
        "@njit(cache=True)",
        "def _heaviside(x):",
        "    return 1.0 if x > 0.0 else (0.0 if x < 0.0 else 0.5)",
        "",
        "",
        "@njit(cache=True)",
        "def _sign(x):",
        "    return 1.0 if x > 0.0 else (-1.0 if x < 0.0 else 0.0)",
        "",
        "",
        '@njit(cache=True, error_model="numpy")',
        "def _softmax2e(d, e):",
        '    """Row softmax of the logits (0, d) from e = exp(-|d|): no overflow."""',
        "    big = 1.0 / (1.0 + e)",
        "    return (big, e * big) if d <= 0.0 else (e * big, big)",
        "",
        "",
        "@njit(cache=True)",
        "def _softmax2(d):",
        '    """Row softmax of the logits (0, d): one exp (``polar_rows`` computes the exps in SIMD',
        '    and calls _softmax2e)."""',
        "    return _softmax2e(d, math.exp(-abs(d)))",
        "",
    ]
    hardmax_mixed = red is not None and red.kind == "hardmax-wedge-mixed"
    parts = [_link_kernel(d), _jacobian_kernel(d), _noise_kernel(d), _last_beta_kernel(d), _branch_kernel(d),
             (_MARGINAL_KERNEL if marginal else _MARGINAL_STUB).splitlines(), _polar_kernels(spec, d),
             _chamber_kernels(spec, d), _untied_kernels(spec, d)]
    parts.append(_observation_function(d))
    if hardmax_mixed:
        parts.append(_mixing_kernel(d))
    body = []
    for p in parts:
        body += ["", ""] + p
    return "\n".join(head + body) + "\n"


# ----------------------------------------------------------------------------- files


def write_module(spec: Spec, path: Path | None = None) -> Path:
    path = path or module_path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = module_source(spec)
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def is_stale(spec: Spec, path: Path) -> bool:
    return not path.exists() or path.read_text() != module_source(spec)
