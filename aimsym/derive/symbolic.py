"""Symbolic stage: from a spec to the SMI link g(Z), its Jacobian, symmetries and the
exact reduction of the denoiser integral (theory sections 2 and 3).

Everything downstream (LaTeX, generated kernels) is printed from the objects built here,
so the formulas in the documents are the ones the code runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import sympy as sp

from ..errors import SpecError
from .activation import activate, hardmax_rows, softmax_rows  # noqa: F401 (part of this module's API)
from .parse import index_symbol, parse_link
from .spec import AttentionSpec, SMISpec, Spec


@dataclass(frozen=True)
class IndexLabel:
    """What row k of Z is: layer l (1-based), head, role ('w' tied, 'q'/'k' untied), rank i."""

    layer: int
    head: int
    role: str
    rank: int

    def latex(self) -> str:
        sup = f"{self.layer}" if self.head == 0 else f"{self.layer},{self.head + 1}"
        role = "" if self.role == "w" else f"{self.role.upper()},"
        return f"z^{{({role}{sup})}}_{{{self.rank + 1}}}"


@dataclass
class Reduction:
    """Exact reduction of the denoiser integral (theory section 3).

    Given the observed quantity ``obs`` (``h`` for attention models: y determines h up to a
    global sign; ``y`` itself for free-form links), the ``solved`` entries of Z are explicit
    functions of the ``free`` entries on each branch; the reduced posterior weight on a
    branch is ``prod_t N(z_t; omega_t, V) * jacobian``.
    """

    kind: str  # "attention-rank1" or "solve"
    free: list[tuple[int, int]]  # (k, t) entries of Z integrated over (u)
    solved: list[tuple[int, int]]  # (k, t) entries determined by the branch
    obs: list[sp.Symbol]  # observed reduced quantity (h_t or y entries)
    branches: list[list[sp.Expr]]  # per branch: expressions of the solved entries
    log_jacobian: list[sp.Expr]  # per branch: log of the weight factor (e.g. -log|det M|)
    mixing: sp.Matrix | None = None  # M_{L-1}(u) for attention models
    det_mixing: sp.Expr | None = None
    activation: str = ""
    beta: sp.Expr | None = None
    notes: list[str] = field(default_factory=list)
    # positions in ``free`` integrated in s = log|u| (u = +-exp(s) on the branches)
    log_free: list[int] = field(default_factory=list)
    # the observed quantity as a function of Z (h = M_{L-1} z_L^T), e.g. to bypass y when
    # the output softmax underflows
    obs_from_Z: list[sp.Expr] | None = None
    # generalised reduction (theory section 3): a Gaussian block seen by the observation only
    # through a few linear functionals F(u) z_block^T is marginalised analytically. ``marginal``:
    # its (k, t) entries; the branch fills them with a particular solution of F z^T = observed
    # functionals, and the driver projects onto the (constant) null space of F with the prior's
    # conditional mean (``marginal_null``: orthonormal basis, T x n_null). Each branch's
    # expressions are those of ``solved`` followed by those of ``marginal``.
    marginal: list[tuple[int, int]] = field(default_factory=list)
    marginal_null: list[list[float]] | None = None
    functionals: sp.Matrix | None = None
    # free slots that are not entries of Z (listed in ``free`` as (-1, -1)), by symbol, e.g. the
    # log scale s of the key differences (normalised by the branch: unit prior scale around 0)
    aux: list[sp.Symbol] = field(default_factory=list)
    # what each step integrated, for derive --json and the LaTeX: [{"block", "how", "dim"}]
    steps: list[dict] = field(default_factory=list)

    @property
    def integral_dim(self) -> int:
        return len(self.free)


class Program:
    """Straight-line program: intermediate definitions ``(symbol, expr)`` in dependency order.

    Deep attention links are nested softmaxes of mixing products; written out in full they
    grow exponentially with depth (a three-layer T = 4 link has ~10^5 operations per entry).
    Naming every intermediate (queries, logits, attention entries, mixing products) keeps each
    expression small: derivation, differentiation, printing and compilation stay fast.
    Intermediate names start with ``_`` (user parameter names start with a letter).
    """

    def __init__(self):
        self.defs: list[tuple[sp.Symbol, sp.Expr]] = []
        self.latex_names: dict[sp.Symbol, str] = {}

    def define(self, name: str, expr, latex_name: str | None = None) -> sp.Expr:
        expr = sp.sympify(expr)
        if expr.is_Atom or (expr.is_Mul and len(expr.args) == 2 and all(a.is_Atom for a in expr.args)):
            return expr
        sym = sp.Symbol(name, real=True)
        self.defs.append((sym, expr))
        if latex_name:
            self.latex_names[sym] = latex_name
        return sym

    def matrix(self, stem: str, M: sp.Matrix, latex_stem: str | None = None) -> sp.Matrix:
        return sp.Matrix(M.shape[0], M.shape[1], lambda a, b: self.define(
            f"_{stem}_{a}_{b}", M[a, b], f"{latex_stem}_{{{a + 1}{b + 1}}}" if latex_stem else None))

    def closure(self, exprs) -> list[tuple[sp.Symbol, sp.Expr]]:
        """The definitions ``exprs`` depend on, in order."""
        need = set()
        for e in exprs:
            need |= sp.sympify(e).free_symbols
        out = []
        for sym, e in reversed(self.defs):
            if sym in need:
                out.append((sym, e))
                need |= e.free_symbols
        return out[::-1]

    def expand(self, expr) -> sp.Expr:
        """``expr`` with every intermediate substituted (can be very large for deep models)."""
        for sym, e in reversed(self.closure([expr])):
            expr = expr.xreplace({sym: e})
        return expr


@dataclass
class Derivation:
    spec: Spec
    Z: sp.Matrix  # p x T index symbols
    link: sp.Matrix  # output in terms of Z, parameters and the program's intermediates
    params: tuple[sp.Symbol, ...]
    labels: list[IndexLabel]
    symmetries: list[dict]
    reduction: Reduction | None
    reduction_reason: str
    output_shape: tuple[int, ...]
    program: Program = field(default_factory=Program)

    @property
    def p(self) -> int:
        return self.Z.shape[0]

    @property
    def tokens(self) -> int:
        return self.Z.shape[1]

    @functools.cached_property
    def jacobian_program(self) -> tuple[list[tuple[sp.Symbol, sp.Expr]], list[list[sp.Expr]]]:
        """Forward-mode chain rule through the program: (derivative definitions, J) with
        J[a*cols + b][k*T + t] = d y_{a,b} / d z_{k,t} in terms of (derivative) intermediates."""
        zs = list(self.Z)
        n = len(zs)
        deriv: dict[sp.Symbol, list] = {z: [sp.Integer(int(i == j)) for j in range(n)] for i, z in enumerate(zs)}
        defs = []

        def grad(e):
            deps = [x for x in e.free_symbols if x in deriv]
            parts = [(sp.diff(e, x), deriv[x]) for x in deps]
            return [sp.Add(*[pe * dx[i] for pe, dx in parts if dx[i] != 0 and pe != 0]) for i in range(n)]

        for sym, e in self.program.defs:
            row = []
            for i, g in enumerate(grad(e)):
                row.append(g if g.is_Atom else self._dsym(sym, i, g, defs))
            deriv[sym] = row
        J = [grad(g) for g in self.link]
        return defs, J

    @staticmethod
    def _dsym(sym, i, g, defs):
        d = sp.Symbol(f"_d{sym.name}__{i}", real=True)
        defs.append((d, g))
        return d

    @property
    def jacobian(self) -> sp.Array:
        """dg/dZ in full, shape output_shape + (p, T) (expands the program: small models only)."""
        defs, J = self.jacobian_program
        prog = Program()
        prog.defs = self.program.defs + defs
        flat = [prog.expand(e) for row in J for e in row]
        return sp.Array(flat).reshape(*self.link.shape, self.p, self.tokens)

    @functools.cached_property
    def numeric_link(self):
        """numpy function ``f(Z, params) -> y`` (Z of shape (..., p, T)) from the program."""
        return numeric_function(self, list(self.link), self.link.shape)

    @functools.cached_property
    def numeric_jacobian(self):
        defs, J = self.jacobian_program
        flat = [e for row in J for e in row]
        return numeric_function(self, flat, (*self.link.shape, self.p, self.tokens), extra_defs=defs)

    def summary(self) -> dict:
        red = self.reduction
        return {
            "name": self.spec.name,
            "kind": self.spec.kind,
            "spec_hash": self.spec.hash(),
            "indices": self.p,
            "p": self.p,
            "tokens": self.tokens,
            "output_shape": list(self.output_shape),
            "parameters": [str(s) for s in self.params],
            "index_labels": [_label_text(lb) for lb in self.labels],
            "symmetries": self.symmetries,
            "reduction": {
                "found": red is not None,
                "integral_dim": red.integral_dim if red else None,
                "kind": red.kind if red else None,
                "branches": len(red.branches) if red else None,
                "reason": self.reduction_reason,
                "notes": red.notes if red else [],
                "steps": red.steps if red else [],
            },
            "denoiser_path": "exact" if red is not None else "generic (noisy channel, Delta > 0)",
            "counting": self.counting,
        }

    @functools.cached_property
    def counting(self) -> dict:
        """The counting bound of perfect recovery (theory section 4): m = generic rank of dy/dZ
        and alpha_PR = p / m. See :func:`counting_rank`."""
        return counting_rank(self)


def _label_text(lb: IndexLabel) -> str:
    role = {"w": "W", "q": "W_Q", "k": "W_K"}[lb.role]
    head = f", head {lb.head + 1}" if lb.head else ""
    return f"layer {lb.layer}{head}: {role} column {lb.rank + 1}"


# ----------------------------------------------------------------------------- building


def index_matrix(p: int, T: int) -> sp.Matrix:
    return sp.Matrix(p, T, lambda k, t: index_symbol(k, t))


def param_symbol(v) -> sp.Expr:
    if isinstance(v, str):
        return sp.Symbol(v, real=True)
    f = float(v)
    r = sp.nsimplify(f, rational=True)
    return r if float(r) == f else sp.Float(f)


def layout(spec: AttentionSpec) -> list[IndexLabel]:
    labels = []
    for l, layer in enumerate(spec.layers, start=1):
        for h in range(layer.heads):
            roles = ("w",) if layer.tied else ("q", "k")
            for role in roles:
                labels += [IndexLabel(l, h, role, i) for i in range(layer.rank)]
    return labels


def initial_mixing(spec: AttentionSpec) -> sp.Matrix:
    """M_0: the identity, or in the large-depth limit the mean-field mixing Mbar(tau) of the
    first layers (numbers: computed here, written into the generated module)."""
    if spec.depth_limit_tau is None:
        return sp.eye(spec.tokens)
    from .depth import mean_field_mixing

    layer = spec.layers[0]
    mbar = mean_field_mixing(spec.depth_limit_tau, float(layer.beta), spec.tokens, layer.activation).matrix
    T = spec.tokens
    # the flow commutes with token permutations, so Mbar = (a - b) I + b 11^T exactly (diagonal a,
    # off-diagonal b): average the rule's (tiny) asymmetry away
    a = float(np.mean(np.diag(mbar)))
    b = float((mbar.sum() - np.trace(mbar)) / (T * (T - 1)))
    return sp.Matrix(T, T, lambda i, j: sp.Float(a if i == j else b, 17))


def attention_forward(spec: AttentionSpec, Z: sp.Matrix, prog: Program, upto: int | None = None):
    """Mixing products of theory section 2 on the index matrix Z, as program intermediates.

    Returns the list of (S_l, M_l) for l = 1..L (or 1..upto); M_0 = I (or Mbar(tau) in the
    large-depth limit).
    """
    T = spec.tokens
    labels = layout(spec)
    rows: dict[tuple[int, int, str], list[int]] = {}
    for k, lb in enumerate(labels):
        rows.setdefault((lb.layer, lb.head, lb.role), []).append(k)
    M = initial_mixing(spec)
    out = []
    for l, layer in enumerate(spec.layers, start=1):
        if upto is not None and l > upto:
            break
        beta = param_symbol(layer.beta)
        S_total = sp.zeros(T, T)
        H = layer.heads
        for h, a in enumerate(layer.head_weights()):
            tag = f"{l}" if H == 1 else f"{l}h{h + 1}"
            ltag = f"{l}" if H == 1 else f"{l},{h + 1}"
            zq = Z.extract(rows[(l, h, "w" if layer.tied else "q")], list(range(T)))
            q = prog.matrix(f"q{tag}", M * zq.T, f"q^{{({ltag})}}")  # T x r: queries in index form
            if layer.tied:
                k = q
            else:
                zk = Z.extract(rows[(l, h, "k")], list(range(T)))
                k = prog.matrix(f"k{tag}", M * zk.T, f"k^{{({ltag})}}")
            logits = prog.matrix(f"A{tag}", beta * (q * k.T), f"A^{{({ltag})}}")
            S = prog.matrix(f"S{tag}", activate(layer.activation, logits), f"S^{{({ltag})}}")
            S_total += param_symbol(a) * S
        if H > 1:
            S_total = prog.matrix(f"S{l}", S_total, f"S^{{({l})}}")
        M = prog.matrix(f"M{l}", (param_symbol(layer.skip) * sp.eye(T) + S_total) * M, f"M^{{({l})}}")
        out.append((S_total, M))
    return out


def _layer_attention(spec: AttentionSpec, layer, rows, Z, M, prog, tag, ltag):
    """sum_h a_h sigma(beta (M z_Q^T)(M z_K^T)^T) of one layer, as program intermediates."""
    T = spec.tokens
    beta = param_symbol(layer.beta)
    S_total = sp.zeros(T, T)
    for h, a in enumerate(layer.head_weights()):
        ht = "" if layer.heads == 1 else f"h{h + 1}"
        zq = Z.extract(rows[(1, h, "w" if layer.tied else "q")], list(range(T)))
        q = prog.matrix(f"q{tag}{ht}", M * zq.T, f"q^{{({ltag})}}")
        k = q if layer.tied else prog.matrix(
            f"k{tag}{ht}", M * Z.extract(rows[(1, h, "k")], list(range(T))).T, f"k^{{({ltag})}}")
        logits = prog.matrix(f"A{tag}{ht}", beta * (q * k.T), f"A^{{({ltag})}}")
        S_total += param_symbol(a) * prog.matrix(f"S{tag}{ht}", activate(layer.activation, logits), f"S^{{({ltag})}}")
    return S_total


def shared_flow_ode(spec: AttentionSpec, Z: sp.Matrix, prog: Program):
    """Large-depth limit: dM/dt = S(M) M, M(0) = I on [0, tau] (classical RK4, depth_steps
    steps; the error is O((tau / depth_steps)^4)). Returns (S(M(tau)), M(tau))."""
    T = spec.tokens
    layer = spec.layers[0]
    rows: dict[tuple[int, int, str], list[int]] = {}
    for k, lb in enumerate(layout(spec)):
        rows.setdefault((lb.layer, lb.head, lb.role), []).append(k)
    h = param_symbol(spec.tau) / spec.depth_steps
    M = sp.eye(T)

    def f(Mc, tag):
        S = _layer_attention(spec, layer, rows, Z, Mc, prog, tag, tag.replace("_", ","))
        return prog.matrix(f"F{tag}", S * Mc)

    for n in range(spec.depth_steps):
        k1 = f(M, f"{n}_1")
        k2 = f(prog.matrix(f"Y{n}_2", M + h / 2 * k1), f"{n}_2")
        k3 = f(prog.matrix(f"Y{n}_3", M + h / 2 * k2), f"{n}_3")
        k4 = f(prog.matrix(f"Y{n}_4", M + h * k3), f"{n}_4")
        M = prog.matrix(f"M{n + 1}", M + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4), f"M^{{({n + 1})}}")
    S = _layer_attention(spec, layer, rows, Z, M, prog, "out", r"\tau")
    return S, M


def derive(spec: Spec) -> Derivation:
    """Symbolic derivation of a spec (cached on the spec, which is frozen and hashable)."""
    return _derive(spec)


@functools.lru_cache(maxsize=64)
def _derive(spec: Spec) -> Derivation:
    prog = Program()
    if isinstance(spec, AttentionSpec) and spec.shared_flow:
        p, T = spec.p, spec.tokens
        Z = index_matrix(p, T)
        S_tau, M_tau = shared_flow_ode(spec, Z, prog)
        link = S_tau if spec.output == "attention" else M_tau
        labels = layout(spec)
        reduction, reason = None, ("no exact reduction: large-depth limit (the mixing product is the "
                                   "flow of an ODE, not invertible in closed form)")
    elif isinstance(spec, AttentionSpec):
        p, T = spec.p, spec.tokens
        Z = index_matrix(p, T)
        layers = attention_forward(spec, Z, prog)
        S_L, M_L = layers[-1]
        link = S_L if spec.output == "attention" else M_L
        labels = layout(spec)
        M_prev = layers[-2][1] if len(layers) > 1 else initial_mixing(spec)
        reduction, reason = _attention_reduction(spec, M_prev, prog)
    else:
        p, T = spec.indices, spec.tokens
        Z = index_matrix(p, T)
        g = parse_link(spec)
        link = g if isinstance(g, sp.MatrixBase) else sp.Matrix([[g]])
        if link.shape[1] == 1 and len(spec.output_shape) == 1:
            link = link.T
        labels = [IndexLabel(1, 0, "w", k) for k in range(p)]
        reduction, reason = _solve_reduction(spec, Z, link)
    params = tuple(sp.Symbol(n, real=True) for n in spec.parameters())
    d = Derivation(
        spec=spec,
        Z=Z,
        link=sp.Matrix(link),
        params=params,
        labels=labels,
        symmetries=[],
        reduction=reduction,
        reduction_reason=reason,
        output_shape=spec.output_shape,
        program=prog,
    )
    d.symmetries = detect_symmetries(d)
    return d


# ----------------------------------------------------------------------------- reduction


def _attention_reduction(spec: AttentionSpec, M_prev: sp.Matrix, prog: Program | None = None):
    last = spec.layers[-1]
    if spec.noise != 0.0:  # (a name too: the kernels serve every value, and y is then not a softmax)
        return None, "noisy channel (noise > 0): integrated over all of Z"
    why = []
    if spec.output != "attention":
        why.append("output = 'tokens' (the reduction inverts the last attention matrix)")
    if last.rank != 1:
        why.append(f"last layer rank {last.rank} (needs rank 1)")
    if last.heads != 1:
        why.append(f"last layer has {last.heads} heads (needs 1)")
    if not last.tied and not why and last.activation == "softmax" and not spec.shared_flow:
        return _untied_reduction(spec, M_prev, prog or Program())
    if not last.tied:
        why.append("last layer untied (needs tied query/key, or an untied softmax last layer whose earlier "
                   "layers' mixing keeps the all-ones direction)")
    if (last.activation == "hardmax" and not why and len(spec.layers) == 1 and spec.tokens == 2
            and not spec.shared_flow):
        # beta's sign decides which wedges give which output (the denoiser reads it from last_beta)
        red = Reduction(kind="hardmax-wedge", free=[], solved=[(0, 0), (0, 1)],
                        obs=[sp.Symbol("y_0", real=True)], branches=[], log_jacobian=[],
                        activation="hardmax", beta=param_symbol(last.beta),
                        notes=["y = hardmax(beta z z^T) fixes the signs of z_1, z_2, z_1 - z_2: the posterior "
                               "is the Gaussian restricted to a union of wedges (closed form in radius, "
                               "graded Gauss-Legendre in angle)"])
        return red, "hardmax, one layer, T = 2: region constraint (union of wedges), closed form in radius"
    if (last.activation == "hardmax" and not why and len(spec.layers) == 2 and spec.tokens == 2
            and not spec.shared_flow and _first_layer_rank1_tied(spec)):
        return _hardmax_mixed_reduction(spec, M_prev)
    if last.activation not in ("softmax", "linear"):
        why.append(f"last activation {last.activation} (needs softmax or linear; hardmax gives region constraints, "
                   "handled at T = 2 for one layer, or two layers with a tied rank-one single-head first layer)")
    if why:
        return None, "no exact reduction: " + "; ".join(why)
    T = spec.tokens
    p = spec.p
    h = [sp.Symbol(f"h_{t}", real=True) for t in range(T)]
    hv = sp.Matrix(h)
    free = [(k, t) for k in range(p - 1) for t in range(T)]
    solved = [(p - 1, t) for t in range(T)]
    notes = []
    if len(spec.layers) == 1 and spec.depth_limit_tau is None:
        det = sp.Integer(1)
        branches = [list(hv), list(-hv)]
    else:
        det, adj = det_adjugate(M_prev)
        zl = adj * hv / det
        branches = [list(zl), [-e for e in zl]]
        prev = spec.layers[:-1]
        if any(ly.activation == "hardmax" for ly in prev) or any(not ly.tied for ly in prev):
            notes.append("det M_{L-1} may vanish for hardmax or untied earlier layers; "
                         "points with det M_{L-1} = 0 have zero weight")
        if any(isinstance(ly.skip, float) and ly.skip <= 0 for ly in prev):
            notes.append("skip <= 0: M_{L-1} can be singular")
        if spec.depth_limit_tau is not None:
            from .depth import mean_field_mixing

            mf = mean_field_mixing(spec.depth_limit_tau, float(last.beta), T, last.activation)
            notes.append(f"large-depth limit: M_{{L-1}} = Mbar(tau = {spec.depth_limit_tau:g}), the mean-field "
                         f"mixing of the first layers: diagonal {float(M_prev[0, 0]):.15g}, off-diagonal "
                         f"{float(M_prev[0, 1]):.15g} (numerical error at most {mf.error:.1e})")
    logj = [-sp.log(sp.Abs(det))] * 2
    z_last = sp.Matrix([sp.Symbol(f"z_{p - 1}_{t}", real=True) for t in range(T)])
    red = Reduction(
        kind="attention-rank1",
        free=free,
        solved=solved,
        obs=h,
        branches=branches,
        log_jacobian=logj,
        mixing=M_prev,
        det_mixing=det,
        activation=last.activation,
        beta=param_symbol(last.beta),
        notes=notes,
        obs_from_Z=list(M_prev * z_last),
    )
    return red, "y determines h = M_{L-1} z_L^T up to a global sign; z_L enters linearly"


def _program_values(prog: Program, exprs, env: dict) -> list[float]:
    """Numeric values of ``exprs`` (in program intermediates) at the point ``env`` (symbol ->
    float), evaluating the closure definitions in order (a few points: no compilation)."""
    env = dict(env)
    for sym, e in prog.closure(exprs):
        env[sym] = float(sp.sympify(e).evalf(subs=env))
    return [float(sp.sympify(e).evalf(subs=env)) for e in exprs]


def _untied_reduction(spec: AttentionSpec, M_prev: sp.Matrix, prog: Program):
    """Generalised reduction for an untied rank-one softmax last layer (theory section 3).

    With q = M(u) z_Q^T and k = M(u) z_K^T (M = M_{L-1}, u the earlier layers' indices), the
    row softmax of beta q k^T gives l_ab = log(y_ab / y_aa) / beta = q_a (k_b - k_a), hence the
    rank-one matrix R = q d^T, d = D k = (k_b - k_1)_{b >= 2} (T - 1 key differences). y fixes
    R = qhat ehat^T up to the scale lambda: q = qhat / lambda, d = lambda ehat (ehat a unit vector).
    Two blocks are then reduced, each checked here:

    (a) z_Q enters linearly given (u, lambda) through the square coefficient M(u) (invertible:
        det M >= c^{L-1} for softmax layers): z_Q^T = M^{-1} qhat / lambda, integrated exactly;
    (b) z_K is Gaussian given (u, z_Q) and seen only through the T - 1 functionals
        F(u) z_K^T = d, F = D M(u), whose null space is the all-ones direction for every u
        (M 1 = prod (1 + c_l) 1: checked numerically): marginalised analytically.

    What remains is (u, s) with lambda = +-exp(s + s_ref(qhat)) on two branches, of dimension
    dim(u) + 1. The weight of a branch at (u, s) is
        prod_t N(z_t; omega_t, V) |det M|^{-1} |lambda|^{-1} det(F F^T)^{-1/2} (2 pi sigma_K^2)^{1/2}
    at z_K = its conditional mean given F z_K^T = d (the driver's projection), i.e. the prior of
    (u, z_Q) times the Gaussian density of d, times the Jacobian |det M|^{-1} |lambda|^{-2} of
    (z_Q, d) -> (qhat, ehat, lambda), times d lambda = |lambda| ds."""
    T = spec.tokens
    L = len(spec.layers)
    labels = layout(spec)
    rq = [k for k, lb in enumerate(labels) if lb.layer == L and lb.role == "q"]
    rk = [k for k, lb in enumerate(labels) if lb.layer == L and lb.role == "k"]
    if len(rq) != 1 or len(rk) != 1:  # (rank one, single head: checked by the caller)
        return None, "no exact reduction: untied last layer needs one query and one key row"
    kq, kk = rq[0], rk[0]
    last_syms = {index_symbol(k, t) for k in (kq, kk) for t in range(T)}
    # (a) given u the queries are M(u) z_Q^T with M free of the last layer's indices
    dep = set()
    for e in M_prev:
        dep |= sp.sympify(e).free_symbols
    for _, e in prog.closure(list(M_prev)):
        dep |= e.free_symbols
    if dep & last_syms:
        return None, "no exact reduction: the earlier layers' mixing depends on the last layer's indices"
    # (b) the null space of F = D M(u) is the all-ones direction at random u (M 1 proportional to 1)
    rng = np.random.default_rng(7)
    earlier = [index_symbol(k, t) for k in range(len(labels)) if k not in (kq, kk) for t in range(T)]
    pars = [sp.Symbol(n, real=True) for n in spec.parameters()]
    for _ in range(3):
        env = {z: float(rng.standard_normal()) for z in earlier}
        env.update({q: float(rng.uniform(0.5, 2.0)) for q in pars})
        Mv = np.array(_program_values(prog, list(M_prev), env)).reshape(T, T) if L > 1 else np.eye(T)
        rs = Mv.sum(axis=1)
        if not np.allclose(rs, rs[0], rtol=1e-9, atol=1e-12):
            return None, ("no exact reduction: untied last layer, but the earlier layers' mixing does not keep the "
                          "all-ones direction (the key differences' null space depends on u)")
    qh = [sp.Symbol(f"qhat_{a}", real=True) for a in range(T)]
    eh = [sp.Symbol(f"ehat_{b}", real=True) for b in range(T - 1)]
    s = sp.Symbol("_s", real=True)
    # s_ref balances |q| and |d| (lambda^2 ~ rms qhat): s is then O(1) at typical points
    s_ref = sp.log(sp.Add(*[x ** 2 for x in qh]) / T) / 4
    if L > 1:
        det, adj = det_adjugate(M_prev)
    else:
        det, adj = sp.Integer(1), sp.eye(T)
    Dm = sp.Matrix(T - 1, T, lambda b, t: (1 if t == b + 1 else 0) - (1 if t == 0 else 0))
    F = Dm * M_prev
    FF = F * F.T
    det_FF = det_adjugate(FF)[0] if T > 2 else FF[0, 0]
    branches, logj = [], []
    for sgn in (1, -1):
        lam = sgn * sp.exp(s + s_ref)
        zq = adj * sp.Matrix(qh) / (det * lam)
        zk = adj * sp.Matrix([0] + [lam * e for e in eh]) / det  # one solution of F z_K^T = lambda ehat
        branches.append(list(zq) + list(zk))
        logj.append(-sp.log(sp.Abs(det)) - s - s_ref - sp.log(det_FF) / 2)
    free = [(k, t) for k in range(len(labels)) if k not in (kq, kk) for t in range(T)] + [(-1, -1)]
    null = [[1.0 / np.sqrt(T)] for _ in range(T)]
    # the observation from Z (exact where y underflows): R = q d^T, ehat = sign(d_1) d / |d|
    zQ = sp.Matrix([index_symbol(kq, t) for t in range(T)])
    zK = sp.Matrix([index_symbol(kk, t) for t in range(T)])
    q = M_prev * zQ
    dk = Dm * (M_prev * zK)
    if T == 2:
        obs_Z = [q[a] * dk[0] for a in range(T)] + [sp.Integer(1)]
    else:
        nrm = sp.sqrt(sp.Add(*[x ** 2 for x in dk]))
        obs_Z = [q[a] * sp.sign(dk[0]) * nrm for a in range(T)] + [sp.sign(dk[0]) * x / nrm for x in dk]
    n_u = len(free) - 1
    steps = [
        {"block": f"z_{kq} (last layer's query, W_Q)", "how": "integrated exactly: linear given u and lambda, "
         "z_Q^T = M_{L-1}(u)^{-1} qhat / lambda (square, invertible coefficient)", "dim": T},
        {"block": f"z_{kk} (last layer's key, W_K)", "how": f"marginalised analytically: Gaussian, seen only "
         f"through the {T - 1} differences D M_{{L-1}}(u) z_K^T = lambda ehat; the all-ones direction keeps "
         "its conditional prior", "dim": T},
        {"block": "lambda (scale of q vs the key differences)", "how": "integrated numerically as s = log|lambda| "
         "- s_ref on two sign branches", "dim": 1},
        {"block": "u (earlier layers' indices)", "how": "integrated numerically", "dim": n_u},
    ]
    notes = [
        f"y = softmax(beta q k^T) gives R = q d^T (d = k_b - k_1): y fixes qhat = R ehat and the unit ehat; "
        "q = qhat / lambda, d = lambda ehat",
        f"reduced integral over u ({n_u} earlier-layer indices) and s = log|lambda| - s_ref on the two signs "
        f"of lambda: k = {n_u + 1}",
        "posterior moments of z_K include its residual conditional covariance along the all-ones direction",
    ]
    if any(ly.activation == "hardmax" or not ly.tied for ly in spec.layers[:-1]):
        notes.append("det M_{L-1} may vanish for hardmax or untied earlier layers (c I + S, S not a softmax of a Gram "
                     "matrix): the weight tends to 0 there (z_Q grows like 1/det), points with det M_{L-1} = 0 "
                     "have zero weight")
    if any(isinstance(ly.skip, float) and ly.skip <= 0 for ly in spec.layers[:-1]):
        notes.append("skip <= 0: M_{L-1} can be singular")
    red = Reduction(
        kind="attention-untied",
        free=free,
        solved=[(kq, t) for t in range(T)],
        obs=qh + eh,
        branches=branches,
        log_jacobian=logj,
        mixing=M_prev,
        det_mixing=det,
        activation="softmax",
        beta=param_symbol(spec.layers[-1].beta),
        notes=notes,
        obs_from_Z=obs_Z,
        marginal=[(kk, t) for t in range(T)],
        marginal_null=null,
        functionals=F,
        aux=[s],
        steps=steps,
    )
    return red, ("untied softmax last layer: y fixes q d^T (d: key differences); query integrated exactly, "
                 f"key marginalised analytically down to d; reduced integral of dimension {n_u + 1}")


def _first_layer_rank1_tied(spec: AttentionSpec) -> bool:
    first = spec.layers[0]
    return first.tied and first.rank == 1 and first.heads == 1


def _hardmax_mixed_reduction(spec: AttentionSpec, M_prev: sp.Matrix):
    """Hardmax last layer after a tied rank-one first layer, T = 2 (theory section 3, region
    constraints). With u = z_1 (free) and w = z_2 (solved region), the last layer sees
    v = M_1(u) w and y = hardmax(beta v v^T) reveals the signs of v_1 (v_1 - v_2) and
    v_2 (v_2 - v_1): v lies in a union of wedges cut by v_1 = 0, v_2 = 0, v_1 = v_2, so w lies
    in the union of their images under M_1(u)^{-1}, again wedges through the origin."""
    det, _ = det_adjugate(M_prev)
    notes = [
        "y = hardmax(beta v v^T), v = M_1(u) z_2, fixes the signs of v_1 (v_1 - v_2) and v_2 (v_2 - v_1): "
        "z_2 lies in the wedges M_1(u)^{-1} W_y (W_y: wedges cut by v_1 = 0, v_2 = 0, v_1 = v_2)",
        "given u = z_1 the prior of z_2 is an isotropic Gaussian (conditional of N(omega_t, V) per token): "
        "wedge probability and truncated moments in closed form in the radius (erfc) and by graded "
        "Gauss-Legendre in the angle",
        "the outer integral over u (dimension 2) is a polar rule split on u_1 = 0, u_2 = 0, u_1 = u_2 "
        "(where the first layer's attention switches)",
    ]
    prev = spec.layers[0]
    if prev.activation == "hardmax" or (isinstance(prev.skip, float) and prev.skip <= 0):
        notes.append("det M_1 may vanish (hardmax first layer or skip <= 0): points with det M_1 = 0 have zero weight")
    red = Reduction(
        kind="hardmax-wedge-mixed",
        free=[(0, 0), (0, 1)],
        solved=[(1, 0), (1, 1)],
        obs=[sp.Symbol("y_0", real=True)],
        branches=[],
        log_jacobian=[],
        mixing=M_prev,
        det_mixing=det,
        activation="hardmax",
        beta=param_symbol(spec.layers[-1].beta),
        notes=notes,
    )
    return red, ("hardmax last layer after a tied rank-one first layer, T = 2: region constraint "
                 "(z_2 in a union of wedges depending on z_1), 2-D integral over z_1")


def _solve_reduction(spec: SMISpec, Z: sp.Matrix, link: sp.Matrix):
    """Invert y = g(Z) for one index per output entry with SymPy's solver, if possible."""
    if spec.noise != 0.0:
        return None, "noisy channel (noise > 0): integrated over all of Z"
    outs = list(link)
    zs = list(Z)
    if len(outs) == 1 and Z.shape[1] == 1 and isinstance(outs[0], sp.sign) and outs[0].args[0] in zs:
        z = outs[0].args[0]
        k = zs.index(z)
        red = Reduction(kind="halfspace", free=[], solved=[(k, 0)], obs=[sp.Symbol("y_0", real=True)],
                        branches=[], log_jacobian=[],
                        notes=["y = sign(z): the posterior is the Gaussian truncated to the half-space "
                               "y z > 0 (closed form: Gaussian tail ratio)"])
        return red, f"sign of a single index ({z}): half-space constraint, closed form"
    if any(g.has(sp.sign, sp.Heaviside) or sp.diff(g, z) == 0 and g.has(z) for g in outs for z in zs):
        return None, "piecewise-constant link (region constraint): no point inversion"
    if len(outs) != 1:
        return None, "no exact reduction: free-form links are inverted for a scalar output only"
    g = outs[0]
    y = sp.Symbol("y_0", positive=True) if _nonneg(g) else sp.Symbol("y_0", real=True)
    # try the variables in reverse order so that the solved index is the last one it uses
    for z in reversed([z for z in zs if g.has(z)]):
        try:
            sols = sp.solve(sp.Eq(g, y), z, dict=False)
        except (NotImplementedError, ValueError, TypeError):
            continue
        sols = [s for s in sols if s.is_real is not False and not s.has(sp.I)]
        if not sols or any(s.has(z) for s in sols):
            continue
        dg = sp.diff(g, z)
        k_t = divmod(zs.index(z), Z.shape[1])
        free_syms = [zz for zz in zs if zz is not z]
        free = [divmod(zs.index(zz), Z.shape[1]) for zz in free_syms]
        logj = [-sp.log(sp.Abs(dg.subs(z, s))) for s in sols]
        branches = [[s] for s in sols]
        log_free = []
        # a solved index with a pole in a free one (z1 = y / z0) makes the integrand singular
        # at z0 = 0: integrate each side in the variable s = log|z0| instead (smooth in s)
        poles = [u for u in free_syms if any(sp.denom(sp.together(b)).has(u) for b in sols)]
        if len(poles) == 1:
            u = poles[0]
            sv = sp.Symbol(u.name, real=True)  # the free slot now carries s = log|u|
            new_b, new_j = [], []
            for sgn in (1, -1):
                rep = {u: sgn * sp.exp(sv)}
                for b, lj in zip(sols, logj):
                    new_b.append([b.xreplace(rep)])
                    new_j.append(lj.xreplace(rep) + sv)  # du = |u| ds
            branches, logj = new_b, new_j
            log_free = [free_syms.index(u)]
        red = Reduction(kind="solve", free=free, solved=[k_t], obs=[y], branches=branches,
                        log_jacobian=logj, log_free=log_free)
        if log_free:
            red.notes.append(f"{u} integrated as s = log|{u}| on each sign (pole of the solved index)")
        return red, f"solved y = g(Z) for {z} ({len(sols)} branch{'es' if len(sols) > 1 else ''})"
    return None, "no exact reduction: SymPy found no explicit inverse for any single index"


def det_adjugate(M: sp.Matrix) -> tuple[sp.Expr, sp.Matrix]:
    """Determinant and adjugate by cofactor expansion, without simplification (SymPy's
    Berkowitz/Bareiss try to cancel terms of large entries and are slow for T <= 4)."""
    n = M.shape[0]

    def det(A: sp.Matrix) -> sp.Expr:
        m = A.shape[0]
        if m == 1:
            return A[0, 0]
        if m == 2:
            return A[0, 0] * A[1, 1] - A[0, 1] * A[1, 0]
        return sp.Add(*[(-1) ** j * A[0, j] * det(_minor(A, 0, j)) for j in range(m)])

    if n == 1:
        return M[0, 0], sp.Matrix([[1]])
    adj = sp.Matrix(n, n, lambda i, j: (-1) ** (i + j) * det(_minor(M, j, i)))
    d = sp.Add(*[M[0, j] * adj[j, 0] for j in range(n)])
    return d, adj


def _minor(A: sp.Matrix, i: int, j: int) -> sp.Matrix:
    rows = [r for r in range(A.shape[0]) if r != i]
    cols = [c for c in range(A.shape[1]) if c != j]
    return A.extract(rows, cols)


def _nonneg(g: sp.Expr) -> bool:
    return bool(g.is_nonnegative)


# ----------------------------------------------------------------------------- numerics


def numpy_source(d: Derivation, outputs, name: str = "_f", extra_defs=()) -> str:
    """Source of a numpy function ``name(Z, params) -> list of arrays`` evaluating ``outputs``
    through the program (printed here, run by :func:`numeric_function` or written into a
    generated module, so that solving needs no SymPy)."""
    from sympy.printing.numpy import NumPyPrinter

    class _Printer(NumPyPrinter):
        def _print_Heaviside(self, expr):
            return f"numpy.heaviside({self._print(expr.args[0])}, 0.5)"

        def _print_DiracDelta(self, expr):
            return "0.0"

    pr = _Printer({"fully_qualified_modules": True})
    prog = Program()
    prog.defs = list(d.program.defs) + list(extra_defs)
    lines = [f"def {name}(Z, params):"]
    lines += [f"    {z.name} = Z[..., {k}, {t}]" for k in range(d.p) for t in range(d.tokens)
              for z in [d.Z[k, t]]]
    lines += [f"    {s.name} = params[{i}]" for i, s in enumerate(d.params)]
    lines += [f"    {sym.name} = {pr.doprint(e)}" for sym, e in prog.closure(outputs)]
    lines.append("    return [" + ", ".join(pr.doprint(e) for e in outputs) + "]")
    return "\n".join(lines)


def numeric_function(d: Derivation, outputs, shape, extra_defs=()):
    """A numpy function ``f(Z, params=()) -> array (..., *shape)`` evaluating ``outputs``
    through the program. The source is printed from SymPy objects built by aimsym itself
    (free-form links are parsed without eval), so compiling it runs no user code."""
    namespace = {"numpy": np}
    exec(compile(numpy_source(d, outputs, "_f", extra_defs), f"<aimsym {d.spec.name}>", "exec"), namespace)  # noqa: S102
    f = namespace["_f"]

    def fn(Zv, params=()):
        Zv = np.asarray(Zv, dtype=float)
        with np.errstate(over="ignore"):
            vals = f(Zv, np.asarray(params, dtype=float))
        batch = Zv.shape[:-2]
        vals = [np.broadcast_to(np.asarray(v, dtype=float), batch) for v in vals]
        return np.stack(vals, axis=-1).reshape(*batch, *shape)

    return fn


# singular values below COUNTING_RTOL * the largest are zero; a rank is accepted only where the
# spectrum has a gap of at least COUNTING_GAP between the kept and the dropped values
COUNTING_RTOL = 1e-8
COUNTING_GAP = 1e4
# a dropped singular value below COUNTING_ROUNDING * the largest is zero to rounding: its size is
# BLAS- and CPU-dependent, so the gap is then reported as None (infinite), which keeps the
# generated modules identical across machines; finite gaps are rounded to 3 significant digits
COUNTING_ROUNDING = 1e-12


def counting_rank(d: Derivation, n_points: int = 12, seed: int = 2024) -> dict:
    """Generic rank m of dy/dZ (the number of independent numbers one sample carries) and the
    counting threshold alpha_PR = p / m (theory section 4).

    m is the largest numerical rank of the Jacobian over ``n_points`` random Z ~ N(0, I) with
    parameters drawn in [0.5, 2]; each rank is read off a gap of at least COUNTING_GAP in the
    singular values (else the margin is reported as unclear; a dropped value at rounding level
    makes the margin None, i.e. unbounded). A link whose Jacobian vanishes
    (sign, hardmax: discrete outputs) has m = 0 and is never perfectly recovered; nor is a
    noisy one (the bound then holds only at Delta = 0, said in ``note``).
    """
    rng = np.random.default_rng(seed)
    jac = d.numeric_jacobian
    n_out = int(np.prod(d.output_shape))
    ranks, margins = [], []
    for _ in range(n_points):
        Z = rng.standard_normal((d.p, d.tokens))
        prm = rng.uniform(0.5, 2.0, size=len(d.params))
        with np.errstate(all="ignore"):
            J = jac(Z, prm).reshape(n_out, d.p * d.tokens)
        if not np.all(np.isfinite(J)):
            continue
        s = np.linalg.svd(J, compute_uv=False)
        if s.size == 0 or s[0] == 0.0:
            ranks.append(0)
            margins.append(np.inf)
            continue
        r = int(np.sum(s > COUNTING_RTOL * s[0]))
        kept = s[r - 1] if r > 0 else s[0]
        dropped = s[r] if r < s.size else 0.0
        ranks.append(r)
        margins.append(np.inf if dropped <= COUNTING_ROUNDING * s[0] else kept / dropped)
    if not ranks:
        return {"m": None, "alpha_pr": None, "margin": None, "noiseless": None,
                "note": "the Jacobian was not finite at any random point: rank not determined"}
    m = max(ranks)
    margin = float(min(g for r, g in zip(ranks, margins) if r == m))
    noise = d.spec.noise
    noiseless = not isinstance(noise, str) and float(noise) == 0.0
    alpha_pr = d.p / m if m > 0 else None
    if m == 0:
        note = "dy/dZ = 0 almost everywhere (discrete output): no perfect recovery at any alpha"
    elif isinstance(noise, str):
        note = f"perfect recovery only at {noise} = 0 (then above alpha_PR = p/m); none with output noise"
    elif not noiseless:
        note = "noisy link: no perfect recovery at any alpha"
    else:
        note = "Bayes-optimal error > 0 for alpha < alpha_PR = p/m"
    if margin < COUNTING_GAP:
        note += f"; unclear rank margin (singular-value gap {margin:.3g} < {COUNTING_GAP:g})"
    return {"m": m, "p": d.p, "alpha_pr": alpha_pr if (noiseless or isinstance(noise, str)) else None,
            "margin": None if not np.isfinite(margin) else float(f"{margin:.3g}"), "noiseless": noiseless, "note": note}


def detect_symmetries(d: Derivation, n_points: int = 6, seed: int = 12345) -> list[dict]:
    """Sign flips of index groups that leave g invariant, verified at random points.

    Candidates: every layer's indices (tied: z_l -> -z_l; untied: both Q and K), every head,
    and every single index for free-form links. A candidate is kept if g agrees to 1e-9 at
    ``n_points`` random Z (parameters drawn positive).
    """
    rng = np.random.default_rng(seed)
    spec = d.spec
    cands: list[tuple[str, list[int]]] = []
    if isinstance(spec, AttentionSpec):
        for l in range(1, len(spec.layers) + 1):
            rows = [k for k, lb in enumerate(d.labels) if lb.layer == l]
            cands.append((f"layer {l}: z_{l} -> -z_{l}", rows))
            if spec.layers[l - 1].heads > 1:
                for h in range(spec.layers[l - 1].heads):
                    rows_h = [k for k, lb in enumerate(d.labels) if lb.layer == l and lb.head == h]
                    cands.append((f"layer {l} head {h + 1}: sign flip", rows_h))
    else:
        for k in range(d.p):
            cands.append((f"z[{k}, :] -> -z[{k}, :]", [k]))
    cands.append(("Z -> -Z", list(range(d.p))))
    f = d.numeric_link
    found = []
    pts = [rng.normal(size=(d.p, d.tokens)) for _ in range(n_points)]
    prm = [rng.uniform(0.5, 2.0, size=len(d.params)) for _ in range(n_points)]
    base = [f(Zv, pv) for Zv, pv in zip(pts, prm)]
    for name, rows in cands:
        ok = True
        for Zv, pv, y0 in zip(pts, prm, base):
            Zf = Zv.copy()
            Zf[rows] *= -1
            if not np.allclose(f(Zf, pv), y0, rtol=1e-9, atol=1e-12):
                ok = False
                break
        if ok:
            found.append({"name": name, "rows": rows})
    return found


def check_spec(spec: Spec) -> None:
    if not isinstance(spec, AttentionSpec | SMISpec):
        raise SpecError("model", f"expected an AttentionSpec or SMISpec, got {type(spec).__name__}")
