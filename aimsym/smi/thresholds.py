"""Weak-recovery thresholds and the grand staircase (theory section 5).

Stability operator on a block P of indices, around an SE overlap Q* supported on U = complement:

    D_ts(y, omega) = dg_out[P, t; P, s](y, omega, V),   omega = Q*^{1/2} xi, V = I - Q*
    F(M) = E[ sum_{t,s} D_ts M D_ts^T ]          (M symmetric |P| x |P|)

At Q* = 0 (omega = 0, V = I) D_ts = E[z_t z_s^T | y] - delta_ts I = G_ts of section 5. Linearising
the SE map in the P block gives delta Q_P -> alpha F(delta Q_P) (g_out vanishes on P at omega_P = 0
by the sign-flip symmetry of the links this applies to), so the block is learned where
alpha * rho(F) = 1, rho the cone spectral radius (power iteration from I / sqrt(|P|)).

F is returned as an explicit matrix on an orthonormal basis of symmetric matrices (E_aa, and
(E_ab + E_ba)/sqrt 2 for a < b), with per-entry standard errors from the QMC replicas.

rho is estimated without the upward bias of "top eigenvalue of a noisy F" (docs/se.md):
 - restricted to the block of F invariant under the link's sign-flip symmetries (exact for the
   cone spectral radius; removes symmetry-forced degeneracies such as y = z0 z1's),
 - cross-fitted: each replica's F_r is evaluated (Rayleigh quotient) along the top direction of
   the other replicas' mean, independent of F_r; rho = mean over replicas,
 - its standard error is a jackknife of that whole procedure (directions recomputed without the
   left-out replica), which keeps the direction's dependence on the data in the error bar,
 - at Q = 0 (alpha_c) the points are drawn from N(0, TAIL_SCALE^2) and reweighted to N(0, 1):
   the posterior moments in F grow polynomially in |Z|, and the reweighted integrand is bounded.
"""

from __future__ import annotations

import itertools
import json
import time
import warnings
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.optimize import brentq

from ..errors import AimsymError
from ..provenance import provenance
from ..results import Result, to_builtin
from .passes import Kept, as_passes, points_id
from .se import Channel, denoiser_accuracy, finer_rule, make_channel, state_evolution, sym


# ----------------------------------------------------------------------------- symmetric basis
def sym_basis(n: int) -> np.ndarray:
    """Orthonormal (Frobenius) basis of symmetric n x n matrices: (n (n + 1) / 2, n, n)."""
    out = []
    for a in range(n):
        for b in range(a, n):
            E = np.zeros((n, n))
            if a == b:
                E[a, a] = 1.0
            else:
                E[a, b] = E[b, a] = 1.0 / np.sqrt(2.0)
            out.append(E)
    return np.array(out)


def operator_matrix(D: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """D: (n, T, T, k, k) blocks D_ts per sample -> mean of F in the symmetric basis (m, m);
    ``w``: per-sample weights (importance sampling), mean of w * (...)."""
    B = sym_basis(D.shape[-1])
    # F(E_j) = mean_n sum_ts D E_j D^T ; entry <E_i, F(E_j)>
    if w is None:
        FE = np.einsum("ntsab,jbc,ntsdc->jad", D, B, D, optimize=True) / D.shape[0]
    else:
        FE = np.einsum("n,ntsab,jbc,ntsdc->jad", w, D, B, D, optimize=True) / D.shape[0]
    return np.einsum("iad,jad->ij", B, FE)


def apply(F: np.ndarray, M: np.ndarray) -> np.ndarray:
    B = sym_basis(M.shape[0])
    c = np.einsum("iab,ab->i", B, M)
    return np.einsum("i,iab->ab", F @ c, B)


def _power(F: np.ndarray, c: np.ndarray, tol: float, max_iter: int):
    """Power iteration c <- F c / |F c| on basis coefficients (|c| = ||M||_F: the basis is orthonormal)."""
    rho = 0.0
    for _ in range(max_iter):
        Fc = F @ c
        nrm = float(np.linalg.norm(Fc))
        if not np.isfinite(nrm):
            raise AimsymError("operator", "non-finite entries; raise samples or nodes")
        if nrm == 0.0:
            return 0.0, c
        c_new = Fc / nrm
        done = np.linalg.norm(c_new - c) < tol
        c, rho = c_new, nrm
        if done:
            break
    return rho, c


def cone_spectral_radius(F: np.ndarray, n: int, *, tol: float = 1e-13, max_iter: int = 20000):
    """Power iteration M <- F(M)/||F(M)||_F from I/sqrt(n): (rho, maximising M)."""
    B = sym_basis(n)
    rho, c = _power(F, np.einsum("iab,ab->i", B, np.eye(n) / np.sqrt(n)), tol, max_iter)
    return rho, np.einsum("i,iab->ab", c, B)


# ----------------------------------------------------------------------------- symmetries
_SYMMETRIES: dict[int, tuple] = {}


def sign_symmetries(model, *, checks: int = 64) -> list[np.ndarray]:
    """Sign patterns s (one +-1 per index, not all +1) with link(diag(s) Z) = +-link(Z), checked on
    ``checks`` random Z. Then the posterior given y of diag(s) Z is that of Z given +-y (noise is
    symmetric), so F commutes with M -> S M S. Subsets of up to 8 indices (single flips beyond)."""
    hit = _SYMMETRIES.get(id(model))
    if hit is not None and hit[0] is model:
        return hit[1]
    p, T = model.p, model.tokens
    Z = np.random.default_rng(20240).standard_normal((checks, p, T))
    pats = itertools.product((1.0, -1.0), repeat=p) if p <= 8 else (1 - 2 * np.eye(p))
    out = []
    try:
        with np.errstate(all="ignore"):
            y = np.asarray(model.link(Z), dtype=float)
            for s in pats:
                s = np.asarray(s, dtype=float)
                if np.all(s == 1):
                    continue
                ys = np.asarray(model.link(Z * s[:, None]), dtype=float)
                if np.all(np.isfinite(y)) and (np.allclose(ys, y, rtol=1e-10, atol=1e-12)
                                               or np.allclose(ys, -y, rtol=1e-10, atol=1e-12)):
                    out.append(s)
    except Exception:  # a link that cannot be evaluated on plain arrays: no symmetry assumed
        out = []
    _SYMMETRIES[id(model)] = (model, out)
    return out


def invariant_indices(k: int, signs) -> list[int]:
    """Indices of :func:`sym_basis` (k) elements E_ab with s_a s_b = 1 for every sign pattern s."""
    idx, i = [], 0
    for a in range(k):
        for b in range(a, k):
            if all(s[a] * s[b] > 0 for s in signs):
                idx.append(i)
            i += 1
    return idx


# ----------------------------------------------------------------------------- estimator
def _top_vector(F: np.ndarray) -> np.ndarray:
    # F is self-adjoint (G_ts^T = G_st); its largest eigenvalue is the cone spectral radius
    # (Krein-Rutman), and the Rayleigh quotient needs no PSD representative of a degenerate space
    return np.linalg.eigh(sym(F))[1][:, -1]


def _cross_fit(Fr: np.ndarray) -> np.ndarray:
    """Rayleigh quotient of each replica's F_r along the top vector of the other replicas' mean."""
    R = Fr.shape[0]
    S = Fr.sum(axis=0)
    out = np.empty(R)
    for r in range(R):
        v = _top_vector((S - Fr[r]) / (R - 1))
        out[r] = v @ Fr[r] @ v
    return out


def cross_fitted_rho(Fr: np.ndarray) -> tuple[float, np.ndarray]:
    """(rho, rho_loo): the cross-fitted estimate and its leave-one-replica-out values (the whole
    procedure redone on R - 1 replicas, directions included) for the jackknife."""
    R = Fr.shape[0]
    if R < 3:
        raise AimsymError("replicas", f"the cross-fitted operator estimate needs at least 3 replicas, got {R}")
    rho = float(_cross_fit(Fr).mean())
    loo = np.array([_cross_fit(np.delete(Fr, j, axis=0)).mean() for j in range(R)])
    return rho, loo


# ----------------------------------------------------------------------------- evaluation
def operator_blocks(ch: Channel, Q: np.ndarray, block, denoised=None) -> np.ndarray:
    """D_ts on ``block`` at SE overlap Q for every point: (R, n, T, T, k, k). ``denoised``: the
    result of ``ch.denoise(Q)`` if already computed."""
    out, R, n = denoised if denoised is not None else ch.denoise(Q)
    P = np.asarray(block)
    dg = out.dg_out[:, P][:, :, :, P]  # (N, k, T, k, T)
    D = np.transpose(dg, (0, 2, 4, 1, 3))  # (N, t, s, k, k')
    if not np.all(np.isfinite(D)):
        raise AimsymError("operator", "denoiser returned non-finite dg_out; raise nodes")
    return D.reshape(R, n, *D.shape[1:])


def quadrature_bound(out, D: np.ndarray, weights=None) -> float | None:
    """Bound on the change of F (operator norm on symmetric matrices, hence of rho by Weyl: F is
    symmetric) from the denoiser's per-sample error estimates e_n, which bound every entry of
    dg_out to d_n = e_n max(1, max |dg_out|): ||dF|| <= mean_n sum_ts (2 k ||D_ts||_F d_n + k^2 d_n^2).
    ``D``: the blocks of :func:`operator_blocks` (R, n, T, T, k, k). None where the denoiser gives
    no estimate."""
    err = getattr(out, "error", None)  # (outputs assembled by hand carry only g_out, dg_out)
    if err is None:
        return None
    N, k = out.dg_out.shape[0], D.shape[-1]
    w = np.ones(N) if weights is None else np.asarray(weights, float).reshape(N)
    e = np.asarray(err, float).reshape(N)
    if not np.isfinite(e[w != 0]).all():  # (a sample without an estimate: no bound; inf * 0 would give nan)
        return float("inf")
    d = np.where(w != 0, e, 0.0) * np.maximum(1.0, np.abs(out.dg_out).reshape(N, -1).max(axis=1))
    norms = np.sqrt(np.einsum("ntsab,ntsab->nts", D.reshape(N, *D.shape[2:]), D.reshape(N, *D.shape[2:])))
    b = np.sum(2 * k * norms * d[:, None, None] + k * k * d[:, None, None] ** 2, axis=(1, 2))
    return float(np.mean(w * b))


@dataclass
class Operator(Result):
    """The weak-recovery operator F on a block at one Q (see :func:`operator`)."""

    F: np.ndarray
    F_stderr: np.ndarray
    rho: float
    rho_stderr: float
    rho_loo: np.ndarray
    direction: np.ndarray
    block: list
    invariant_block: list
    rho_quadrature: float | None = None  # bound on |d rho| from the denoiser's error estimates
    OPTIONAL = ("rho_quadrature",)


@dataclass
class Threshold(Result):
    """One weak-recovery threshold alpha = 1/rho(F) with the operator it comes from. The optional
    fields are set by the method that located it (initial, restricted SE, parametric branch)."""

    alpha: float
    stderr: float
    rho: float
    rho_stderr: float
    direction: np.ndarray
    subspace: list
    F: np.ndarray
    F_stderr: np.ndarray
    tail_scale: float | None = None
    jump: bool | None = None
    Q_branch: np.ndarray | None = None
    q_before: float | None = None
    q_after: float | None = None
    method: str | None = None
    # the quadrature error of alpha, folded into ``stderr`` (then sqrt(statistical^2 + quadrature^2)):
    # a fixed rule's difference to the rule with twice (explicit nodes) or half (refined default)
    # its nodes; an error-controlled rule's bound from its per-sample estimates (alpha_c and the
    # staircase steps)
    quadrature_error: float | None = None
    statistical_stderr: float | None = None
    nodes: int | None = None  # the fixed rule's nodes per dimension (after its refinement)
    OPTIONAL = ("tail_scale", "jump", "Q_branch", "q_before", "q_after", "method", "quadrature_error",
                "statistical_stderr", "nodes")


@dataclass
class StaircaseStep(Result):
    """One step of the grand staircase: the subspace learned at alpha. The first step (alpha_c)
    and the phase diagram's steps carry only some of the optional fields."""

    subspace: list
    alpha: float
    stderr: float
    jump: bool | None = None
    method: str | None = None
    direction: np.ndarray | None = None
    rho: float | None = None
    Q_branch: np.ndarray | None = None
    replicas: int | None = None
    quadrature_error: float | None = None  # folded into stderr (parametric branch, error-controlled rule)
    OPTIONAL = ("jump", "method", "direction", "rho", "Q_branch", "replicas", "quadrature_error")


def operator(ch: Channel, Q: np.ndarray, block, denoised=None, weights=None) -> Operator:
    """F (mean, stderr per entry), rho (cross-fitted on the sign-symmetric block) with jackknife
    stderr, direction; ``rho_loo``: its leave-one-replica-out values (for jackknifing derived
    quantities). ``weights`` (R, n): importance weights of the points (see :func:`initial_threshold`).
    The symmetries are those of the link at Q diagonal (sign flips commute with a diagonal Q)."""
    denoised = denoised if denoised is not None else ch.denoise(Q)
    D = operator_blocks(ch, Q, block, denoised)
    R, k = D.shape[0], D.shape[-1]
    Fr = np.stack([operator_matrix(D[r], None if weights is None else weights[r]) for r in range(R)])
    F = Fr.mean(axis=0)
    diagonal = np.allclose(Q, np.diag(np.diag(Q)))
    signs = [s[list(block)] for s in sign_symmetries(ch.model)] if diagonal else []
    keep = invariant_indices(k, signs)
    Fk = Fr[:, keep][:, :, keep]
    rho, loo = cross_fitted_rho(Fk)
    # reported direction: cone power iteration of the mean on the invariant block, from I (invariant)
    B = sym_basis(k)
    c0 = np.einsum("iab,ab->i", B, np.eye(k) / np.sqrt(k))[keep]
    _, c = _power(F[np.ix_(keep, keep)], c0, 1e-13, 20000)
    M = np.einsum("i,iab->ab", c, B[keep])
    return Operator(F=F, F_stderr=Fr.std(axis=0, ddof=1) / np.sqrt(R), rho=rho, rho_stderr=jackknife_stderr(loo),
                    rho_loo=loo, direction=M, block=[int(i) for i in block], invariant_block=[int(i) for i in keep],
                    rho_quadrature=quadrature_bound(denoised[0], D, weights))


def jackknife_stderr(loo: np.ndarray) -> float:
    """Standard error from leave-one-out values."""
    R = len(loo)
    return float(np.sqrt((R - 1) / R * np.sum((loo - loo.mean()) ** 2)))


def direction_support(M: np.ndarray, block, rel: float = 0.05) -> list[int]:
    """Indices of ``block`` where the maximising direction has weight (diagonal > rel * max)."""
    d = np.abs(np.diag(M))
    return [int(block[i]) for i in np.flatnonzero(d > rel * d.max())]


# Points of the Q = 0 operator are drawn from N(0, TAIL_SCALE^2) per entry of Z and reweighted:
# posterior second moments grow polynomially in |Z|, so plain normal points leave a heavy-tailed,
# skewed replica mean. The weights' own spread grows like 1.2^(p T): fine up to p T ~ 8.
# (Measurements: docs/tuning.md, docs/se.md.)
TAIL_SCALE = 1.5


def tail_scaled(ch: Channel, scale: float) -> tuple[Channel, np.ndarray]:
    """At Q = 0, Z = eta: the channel with eta scaled by ``scale`` and the weights (R, n) that take
    the scaled law back to N(0, I) (phi(x) / (phi(x / s) / s) per entry)."""
    p, T = ch.p, ch.T
    pts = ch.points.copy()
    e = pts[..., p * T: 2 * p * T] * scale
    pts[..., p * T: 2 * p * T] = e
    logw = e.shape[-1] * np.log(scale) - 0.5 * (1.0 - scale**-2) * np.sum(e * e, axis=-1)
    return ch.with_points(pts), np.exp(logw)


# Denoiser nodes of the Q = 0 operator (one pass, so cheap) where the SE default biases alpha_c
# beyond its reweighted QMC error (measured against the closed-form denoiser: docs/tuning.md).
THRESHOLD_NODES = {1: 120}
# a fixed rule's threshold is refined (nodes doubled) while its quadrature error dominates, up to
# these nodes per dimension of the integral (2-D: 128^2 nodes per sample)
THRESHOLD_MAX_NODES = {1: 256, 2: 128}


def _with_quadrature(th: Threshold, quad: float | None) -> Threshold:
    """Fold a quadrature error of alpha into the threshold's stderr (kept apart in its fields)."""
    if quad is None:
        return th
    return replace(th, quadrature_error=float(quad), statistical_stderr=th.stderr,
                   stderr=float(np.hypot(th.stderr, quad)))


def _threshold_denoiser(model, ch: Channel) -> Channel:
    dim = int(model.kernels.INTEGRAL_DIM) if hasattr(model, "kernels") else 0
    if dim not in THRESHOLD_NODES:
        return ch
    return ch.with_denoiser(model.denoiser(**denoiser_accuracy(model, THRESHOLD_NODES[dim])))


def initial_threshold(model, *, samples: int = 1 << 16, replicas: int = 8, nodes=None, seed=0,
                      channel: Channel | None = None, tail_scale: float = TAIL_SCALE) -> Threshold:
    """alpha_c = 1/rho(F) at Q = 0 (omega = 0, V = I) on all indices (points scaled by ``tail_scale``
    and reweighted; 1: plain normal points). ``nodes`` None: THRESHOLD_NODES where set (also
    replacing a given ``channel``'s denoiser), else the SE default."""
    ch = channel or make_channel(model, samples=samples, replicas=replicas, seed=seed, nodes=nodes)
    if nodes is None:
        ch = _threshold_denoiser(model, ch)
    p = model.p
    weights = None
    if tail_scale != 1.0:
        ch, weights = tail_scaled(ch, tail_scale)
    op = operator(ch, np.zeros((p, p)), list(range(p)), weights=weights)
    th = replace(_as_threshold(op, alpha_factor=1.0), tail_scale=float(tail_scale))
    finer = finer_rule(model, ch.den)
    if finer is None and op.rho_quadrature is not None and op.rho > 0:
        # an error-controlled rule: the bound from its per-sample estimates
        return _with_quadrature(th, op.rho_quadrature / op.rho**2)
    while finer is not None:
        th2 = replace(_as_threshold(operator(ch.with_denoiser(finer), np.zeros((p, p)), list(range(p)),
                                             weights=weights), alpha_factor=1.0), tail_scale=float(tail_scale))
        quad = abs(th2.alpha - th.alpha)
        if nodes is not None:  # the requested rule's value, with its error against twice its nodes
            return replace(_with_quadrature(th, quad), nodes=int(ch.den.nodes))
        # with the rule left at its default, refine while the rule's error dominates the statistical
        # one (nodes doubled each time, up to the cap); the finer rule's value is reported, with the
        # difference to half its nodes as its error (conservative where the rule converges)
        if quad <= th2.stderr or finer.nodes * 2 > THRESHOLD_MAX_NODES.get(int(model.kernels.INTEGRAL_DIM), 0):
            return replace(_with_quadrature(th2, quad), nodes=int(finer.nodes))
        ch, th, finer = ch.with_denoiser(finer), th2, finer_rule(model, finer)
    return th


def _as_threshold(op: Operator, alpha_factor: float) -> Threshold:
    rho, se = op.rho, op.rho_stderr
    alpha = 1.0 / rho if rho > 0 else float("inf")
    return Threshold(alpha=alpha, stderr=se / rho**2 if rho > 0 else float("inf"), rho=rho, rho_stderr=se,
                     direction=op.direction, subspace=direction_support(op.direction, op.block),
                     F=op.F, F_stderr=op.F_stderr)


# ----------------------------------------------------------------------------- staircase
RESTRICTED_SE_TOL = 1e-3


def _root_xtol(e_lo: dict, e_hi: dict, lo: float, hi: float, xtol: float) -> float:
    """brentq's tolerance for the root of f = alpha rho - 1 on [lo, hi]: a tenth of the root's
    statistical error (f's replica error over the bracket's slope), at least ``xtol``. Each
    evaluation is a restricted SE run (for three layers, minutes to an hour), and a finer root
    would only resolve replica noise."""
    slope = (e_hi["f"] - e_lo["f"]) / (hi - lo)
    f_err = max(lo * e_lo["op"].rho_stderr, hi * e_hi["op"].rho_stderr)
    return max(xtol, 0.1 * f_err / slope) if slope > 0 and np.isfinite(f_err) else xtol


def _grid(alpha: float) -> float:
    return float(f"{alpha:.4g}")


def _operator_from_json(d: dict) -> Operator:
    return Operator(F=np.asarray(d["F"], float), F_stderr=np.asarray(d["F_stderr"], float), rho=float(d["rho"]),
                    rho_stderr=float(d["rho_stderr"]), rho_loo=np.asarray(d["rho_loo"], float),
                    direction=np.asarray(d["direction"], float), block=list(d["block"]),
                    invariant_block=list(d["invariant_block"]), rho_quadrature=d.get("rho_quadrature"))


def next_threshold(model, learned, alpha_start: float, *, ch_op: Channel, ch_se: Channel,
                   alpha_max: float = 20.0, xtol: float = 1e-4, kept=None) -> Threshold:
    """Smallest alpha > alpha_start with alpha * rho(F_P(Q*_U(alpha))) = 1, U = learned, P = rest.

    Q*_U(alpha) is the SE fixed point restricted to U (uninformed start, warm-started along alpha).
    ``kept``: a folder keeping each finished alpha (restricted SE fixed point and operator: an
    hour each for three layers) across runs and code versions (:class:`~aimsym.smi.passes.Kept`);
    the same call again replays them in order and goes on from the first one missing.
    """
    p = model.p
    P = [i for i in range(p) if i not in learned]
    cache: dict[float, dict] = {}
    store = None if kept is None else Kept(kept, {
        "kind": "restricted SE step", "learned": [int(i) for i in learned], "se": points_id(ch_se),
        "op": points_id(ch_op), "se_tol": RESTRICTED_SE_TOL, "alpha_max": alpha_max})

    def evaluate(alpha):
        if alpha in cache:
            return cache[alpha]
        if store is not None and (rec := store.get(repr(float(alpha)))) is not None:
            cache[alpha] = {"op": _operator_from_json(rec["op"]), "Q": np.asarray(rec["Q"], float), "f": rec["f"]}
            return cache[alpha]
        # warm start from the branch *below* alpha only (the uninformed branch continued upwards);
        # a start from a larger alpha could land on an informed branch (e.g. Q*_U -> I)
        below = [a for a in cache if a < alpha]
        if below:
            init = cache[max(below)]["Q"] + 1e-4 * np.diag(np.isin(np.arange(p), learned))  # keep it alive
        else:
            init = "uninformed"
        # tol 1e-3 (the Newton polish then checks the distance): on the two-layer staircase
        # (parametric=False, 1024 SE points) 1e-5 and 1e-3 give the same root, 0.7218 +- 0.0047,
        # in 538 and 327 SE iterations
        se = state_evolution(model, alpha, init=init, restrict=learned, channel=ch_se, errors=False,
                             tol=RESTRICTED_SE_TOL, init_eps=1e-3)
        op = operator(ch_op, se.Q, P)
        cache[alpha] = {"op": op, "Q": se.Q, "f": alpha * op.rho - 1.0}
        if store is not None:
            store.put(repr(float(alpha)), json.loads(json.dumps(cache[alpha], default=to_builtin)))
        return cache[alpha]

    # Bracket upwards in steps of 15 %. The point right after the previous threshold is evaluated
    # only when the first step is already unstable: there the restricted SE is critically slow
    # (hundreds of iterations), and it is needed only to tell "unstable at once" from a root
    # inside the first step.
    # (the bracket's alphas are rounded to 4 digits: a run whose previous threshold came out a hair
    # different, e.g. recomputed by another code version, asks for the same alphas, and the kept
    # points serve it)
    lo, hi = alpha_start * 1.0001, None
    a_first = _grid(lo * 1.15)
    if a_first > alpha_max:
        raise AimsymError("alpha", f"no further threshold below alpha_max = {alpha_max} for block {P}")
    if evaluate(a_first)["f"] >= 0:
        hi = lo if evaluate(lo)["f"] >= 0 else a_first  # already unstable right after the previous threshold
    a = a_first
    while hi is None:
        a_next = _grid(a * 1.15)
        if a_next > alpha_max:
            raise AimsymError("alpha", f"no further threshold below alpha_max = {alpha_max} for block {P}")
        if evaluate(a_next)["f"] >= 0:
            lo, hi = a, a_next
        a = a_next
    root = lo if hi == lo else brentq(lambda x: evaluate(x)["f"], lo, hi, xtol=_root_xtol(evaluate(lo), evaluate(hi),
                                                                                         lo, hi, xtol))
    ev = evaluate(root)
    # stderr: QMC error of rho propagated through the slope of alpha * rho(alpha)
    a2 = root * 1.01
    slope = (evaluate(a2)["f"] - ev["f"]) / (a2 - root)
    stderr = root * ev["op"].rho_stderr / max(slope, 1e-12)
    th = replace(_as_threshold(ev["op"], 1.0), alpha=float(root), stderr=float(stderr), Q_branch=ev["Q"], jump=False)
    # quadrature: rho off by its bound moves f = alpha rho - 1 by alpha |d rho|, the root by that over f'
    rq = ev["op"].rho_quadrature
    th = _with_quadrature(th, None if rq is None else root * rq / max(slope, 1e-12))
    # The branch Q*_U(alpha) can jump to perfect recovery of U (Q*_U -> I, a first-order
    # transition of the restricted SE). Across the jump alpha * rho jumps from < 1 to > 1 (the
    # degenerate "U perfectly learned" operator of theory section 5), so the root sits at the
    # jump: the linear-stability direction there is meaningless and every index of P becomes
    # learnable at once. Flag it; subspace = P; stderr = the bracket of the jump.
    a1 = root * 0.99
    q_lo = float(np.max(np.diag(evaluate(a1)["Q"])[list(learned)]))
    q_hi = float(np.max(np.diag(evaluate(a2)["Q"])[list(learned)]))
    if q_hi > 1 - 1e-6 and q_lo < 1 - 1e-3:
        th = replace(th, jump=True, subspace=list(P), stderr=float(a2 - a1) / 2, quadrature_error=None,
                     statistical_stderr=None,
                     direction=np.eye(len(P)) / np.sqrt(len(P)))
    return th


# ----------------------------------------------------------------------------- scalar branch
# When the learned block U is a single index k (the last layer of the attention models), the
# restricted SE is scalar: q = a e(q) / (1 + a e(q)), e(q) = E[sum_t g_out[k, t]^2] at
# Q = q e_k e_k^T, and e(q) does not depend on alpha. So q is a fixed point exactly at
#
#     alpha(q) = q / ((1 - q) e(q)),
#
# and the branch is parametric in q: no SE iteration. An uninformed start grows until the first q
# with alpha(q) >= alpha (the map is increasing in q), so the branch is the set of records (running
# maxima) of alpha(q) from q = 0+; a local maximum followed by a dip is a first-order jump of the
# branch. One denoiser pass at Q gives both alpha(q) and the stability operator on the rest P.

BRANCH_S0 = 0.05  # first point of the walk in s = -log(1 - q) (q = 0.049)
BRANCH_STEP = 0.4  # step in s (1 - q shrinks by a factor 0.67 per step)
BRANCH_S_MAX = 9.2  # last point: 1 - q = 1e-4


def branch_point(ch: Channel, k: int, P, q: float) -> dict:
    """alpha(q) of the scalar restricted branch and the operator on P at Q = q e_k e_k^T, with their
    leave-one-replica-out values; f = alpha rho - 1 (>= 0: P is unstable on the branch at q)."""
    p = ch.p
    Q = np.zeros((p, p))
    Q[k, k] = q
    den = ch.denoise(Q)
    out, R, n = den
    g = out.g_out.reshape(R, n, p, ch.T)[:, :, k]
    e_r = np.einsum("rnt,rnt->r", g, g) / n
    if not (np.all(np.isfinite(e_r)) and np.all(e_r > 0)):
        raise AimsymError("Q_hat", f"E[g_out^2] on the learned index is not finite and positive at q = {q:.6g}; "
                                   "raise nodes or samples")
    e_loo = (e_r.sum() - e_r) / (R - 1)
    op = operator(ch, Q, P, den)
    a = q / ((1.0 - q) * e_r.mean())
    a_loo = q / ((1.0 - q) * e_loo)
    # quadrature bounds from the per-sample estimates (error-controlled rules): |d e| then alpha ~ 1/e,
    # and f = alpha rho - 1 moves by at most alpha |d rho| + rho |d alpha|
    a_quad = f_quad = None
    err = getattr(out, "error", None)
    if err is not None and op.rho_quadrature is not None:
        gn = np.abs(g).reshape(R * n, -1)
        # (the estimate is relative to the largest entry of the whole g_out, at least 1)
        size = np.maximum(1.0, np.abs(out.g_out).reshape(R * n, -1).max(axis=1))
        d = np.asarray(err, float).reshape(R * n) * size
        e_quad = float(np.mean(np.sum(2 * gn * d[:, None] + d[:, None] ** 2, axis=1)))
        a_quad = float(a * e_quad / e_r.mean())
        f_quad = float(a * op.rho_quadrature + op.rho * a_quad)
    return {"q": q, "alpha": float(a), "alpha_loo": a_loo, "op": op, "f": float(a * op.rho - 1.0),
            "f_loo": a_loo * op.rho_loo - 1.0, "Q": Q, "alpha_quad": a_quad, "f_quad": f_quad}


def next_threshold_branch(model, k: int, alpha_start: float, *, ch: Channel, alpha_max: float = 20.0,
                          xtol: float = 1e-4) -> Threshold:
    """Like :func:`next_threshold` for a single learned index k, from the parametric branch alpha(q):
    walk the records of alpha(q) upwards in s = -log(1 - q) and stop at the first point where
    alpha rho(F_P) >= 1; the root is refined by brentq in s (continuous branch), or sits at a jump
    of the branch (flagged ``jump``: at the local maximum of alpha(q), to the q where alpha(q)
    returns to that value, or to perfect recovery q -> 1 if it never does)."""
    P = [i for i in range(model.p) if i != k]
    cache: dict[float, dict] = {}

    def at(s):
        s = float(s)
        if s not in cache:
            cache[s] = branch_point(ch, k, P, -np.expm1(-s))
        return cache[s]

    def too_far(pt):
        if pt["alpha"] > alpha_max:
            raise AimsymError("alpha", f"no further threshold below alpha_max = {alpha_max} for block {P}")

    def local_max(lo, hi):
        from scipy.optimize import minimize_scalar

        r = minimize_scalar(lambda s: -at(s)["alpha"], bounds=(lo, hi), method="bounded",
                            options={"xatol": 1e-3})
        best = max((s for s in cache if lo <= s <= hi), key=lambda s: cache[s]["alpha"])
        return best if cache[best]["alpha"] >= -r.fun else float(r.x)

    def jump(s_a, s_b):
        """Threshold at the jump of the branch from its local maximum s_a to s_b (None: to q = 1)."""
        a, b = at(s_a), (at(s_b) if s_b is not None else None)
        return _with_quadrature(replace(
            _as_threshold(b["op"] if b is not None else a["op"], 1.0),
            alpha=a["alpha"], stderr=jackknife_stderr(a["alpha_loo"]), jump=True, subspace=list(P),
            direction=np.eye(len(P)) / np.sqrt(len(P)),
            Q_branch=(b["Q"] if b is not None else np.diag(np.eye(model.p)[k])), q_before=a["q"],
            q_after=(b["q"] if b is not None else 1.0), method="parametric branch"), a.get("alpha_quad"))

    def root(lo, hi):
        """Continuous root of f in [lo, hi] (f(lo) < 0 <= f(hi)), jackknifed. brentq stops at a tenth
        of the root's statistical error in s (f's jackknife error over the bracket's slope): each
        evaluation is a full denoiser pass, and a finer root would only resolve replica noise."""
        f_lo, f_hi = at(lo), at(hi)
        bracket_slope = (f_hi["f"] - f_lo["f"]) / (hi - lo)
        s_err = max(jackknife_stderr(f_lo["f_loo"]), jackknife_stderr(f_hi["f_loo"])) / bracket_slope
        s_root = brentq(lambda x: at(x)["f"], lo, hi, xtol=max(xtol, 0.1 * s_err))
        r = at(s_root)
        s2 = s_root + 0.05
        r2 = at(s2)
        # per leave-one-out replica set, the root of the linearised f and alpha there
        slope = (r2["f_loo"] - r["f_loo"]) / (s2 - s_root)
        s_loo = s_root - r["f_loo"] / np.where(slope > 0, slope, np.inf)
        a_loo = r["alpha_loo"] + (r2["alpha_loo"] - r["alpha_loo"]) / (s2 - s_root) * (s_loo - s_root)
        # quadrature: f off by f_quad moves the root by f_quad / f' in s, alpha by alpha' times that,
        # plus alpha's own error there
        quad = None
        if r.get("f_quad") is not None:
            f_slope = (r2["f"] - r["f"]) / (s2 - s_root)
            a_slope = (r2["alpha"] - r["alpha"]) / (s2 - s_root)
            quad = abs(a_slope) * r["f_quad"] / f_slope + r["alpha_quad"] if f_slope > 0 else np.inf
        return _with_quadrature(replace(_as_threshold(r["op"], 1.0), alpha=r["alpha"], stderr=jackknife_stderr(a_loo),
                                        jump=False, Q_branch=r["Q"], q_before=r["q"], q_after=r["q"],
                                        method="parametric branch"), quad)

    # walk: amax = running maximum of alpha(q) (the branch's alpha so far); lo = last branch point
    # with f < 0; dip = s of the last record before alpha(q) fell below amax (None on the branch)
    amax, lo, dip, s_prev = alpha_start, None, None, None
    s = BRANCH_S0
    while s <= BRANCH_S_MAX + 1e-12:
        pt = at(s)
        if dip is not None and pt["alpha"] >= amax:
            # back above the old maximum: the branch jumped at the local maximum of alpha(q) near dip
            s_a = local_max(max(dip - BRANCH_STEP, BRANCH_S0), min(dip + BRANCH_STEP, s))
            amax = max(amax, at(s_a)["alpha"])
            if pt["alpha"] >= amax:
                s_b = brentq(lambda x: at(x)["alpha"] - amax, s_prev, s, xtol=xtol)
                if amax * at(s_b)["op"].rho - 1.0 >= 0:
                    return jump(s_a, s_b)
                lo, dip = s_b, None
        if dip is None and pt["alpha"] >= amax:  # on the branch
            too_far(pt)
            if pt["f"] >= 0:
                if lo is None:  # unstable already at the first point: the root lies below it
                    lo = 1e-3
                    if at(lo)["f"] >= 0:
                        raise AimsymError("alpha", f"the block {P} is unstable right after alpha = {alpha_start}")
                return root(lo, s)
            lo, amax = s, pt["alpha"]
        elif dip is None:
            dip = lo if lo is not None else s
        s_prev, s = s, s + BRANCH_STEP
    if dip is not None:  # never returns above its maximum: the branch jumps to perfect recovery of k
        return jump(local_max(max(dip - BRANCH_STEP, BRANCH_S0), min(dip + BRANCH_STEP, BRANCH_S_MAX)), None)
    raise AimsymError("alpha", f"the branch reaches q = {1 - np.exp(-BRANCH_S_MAX):.4f} on index {k} with "
                               f"alpha rho < 1 on {P}: no threshold located")


# Replicas of the staircase operator points: short replicas lose no QMC accuracy on this
# heavy-tailed integrand, and many of them give a ± that holds (docs/tuning.md).
STAIR_REPLICAS = 32


def staircase(model, alpha_c: float, first: list[int], *, samples: int = 1 << 14, replicas: int = 8,
              se_samples: int = 2048, nodes=None, seed=0, parametric: bool = True,
              op_replicas: int = STAIR_REPLICAS, max_steps: int | None = None,
              checkpoint=None, kept=None) -> list[StaircaseStep]:
    """Ordered list of the next thresholds after ``first`` is learned at alpha_c. A single learned
    index uses the parametric branch (:func:`next_threshold_branch`, operator points only) unless
    ``parametric`` is False; larger learned blocks iterate the restricted SE (``se_samples``,
    ``replicas``). The operator points have ``op_replicas`` replicas (fewer if ``samples`` is small).
    ``max_steps``: stop after that many steps (None: until every index is learned).
    ``checkpoint``: a folder keeping the denoiser passes (a stopped run resumes; smi/passes.py);
    ``kept``: a folder keeping the restricted SE steps' finished points across runs and code
    versions (:func:`next_threshold`)."""
    op_replicas = max(3, min(op_replicas, samples // 32))  # keep >= 32 points per replica
    ch_op = make_channel(model, samples=samples, replicas=op_replicas, seed=seed + 1, nodes=nodes,
                         checkpoint=checkpoint)
    ch_se = None  # only the iterated restricted SE needs its own points
    learned, alpha, steps = list(first), alpha_c, []
    while len(learned) < model.p and (max_steps is None or len(steps) < max_steps):
        if len(learned) == 1 and parametric:
            th = next_threshold_branch(model, learned[0], alpha, ch=ch_op)
        else:
            ch_se = ch_se or make_channel(model, samples=se_samples, replicas=replicas, seed=seed + 2, nodes=nodes,
                                          checkpoint=checkpoint)
            th = next_threshold(model, learned, alpha, ch_op=ch_op, ch_se=ch_se, kept=kept)
        sub = th.subspace or [i for i in range(model.p) if i not in learned]
        steps.append(StaircaseStep(subspace=sub, alpha=th.alpha, stderr=th.stderr, jump=th.jump,
                                   method=th.method or "restricted SE", direction=th.direction, rho=th.rho,
                                   Q_branch=th.Q_branch, replicas=op_replicas, quadrature_error=th.quadrature_error))
        learned, alpha = sorted(set(learned) | set(sub)), th.alpha
    return steps


# ----------------------------------------------------------------------------- second method
@dataclass
class SideInfoThreshold(Result):
    """alpha_c located by the SE with tiny side information (see :func:`threshold_by_side_information`)."""

    alpha: float
    bracket: list
    lam: float
    level: float
    samples: int


def threshold_by_side_information(model, *, lo: float, hi: float, block=None, learned=None, lam: float = 1e-8,
                                  level: float = 1e-4, samples: int = 8192, replicas: int = 8, nodes=None,
                                  seed=0, xtol: float = 2e-4) -> SideInfoThreshold:
    """Bisection in alpha for where the SE overlap on ``block`` (tiny side information lam there)
    leaves zero: max diag Q_block > level. ``learned``: indices started informed-ish (1e-3),
    the others at 0. Returns alpha, bracket and the QMC stderr of the SE's own operator."""
    p = model.p
    block = list(range(p)) if block is None else list(block)
    ch = make_channel(model, samples=samples, replicas=replicas, seed=seed, nodes=nodes)
    init = np.diag([1e-3 if learned and i in learned else 0.0 for i in range(p)])

    def learned_at(alpha):
        r = state_evolution(model, alpha, init=init, side_info=lam, side_block=block, channel=ch,
                            errors=False, tol=1e-6, max_iter=2000,
                            stop=lambda Q: float(np.max(np.diag(Q)[block])) > level)
        return float(np.max(np.diag(r.Q)[block])) > level

    if learned_at(lo) or not learned_at(hi):
        raise AimsymError("alpha", f"bracket [{lo}, {hi}] does not contain the threshold")
    while hi - lo > xtol:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if learned_at(mid) else (mid, hi)
    return SideInfoThreshold(alpha=0.5 * (lo + hi), bracket=[lo, hi], lam=lam, level=level, samples=samples)


# ----------------------------------------------------------------------------- report
@dataclass
class ThresholdReport(Result):
    """What ``aimsym thresholds`` prints: alpha_c (``initial``), the staircase, the optional
    side-information check and perfect-recovery transition, accuracy and provenance."""

    initial: Threshold
    staircase: list
    check: SideInfoThreshold | None = None
    perfect_recovery: object = None  # aimsym.smi.perfect.PerfectRecovery
    accuracy: dict = field(default_factory=dict)
    seconds: float = 0.0
    provenance: dict = field(default_factory=dict)
    failed: dict | None = None  # stage -> "ErrorType: message" for the stages after alpha_c that failed
    OPTIONAL = ("check", "perfect_recovery", "failed")
    INITIAL_KEYS = ("alpha", "stderr", "rho", "rho_stderr", "direction", "subspace", "F", "F_stderr")

    def to_json(self) -> dict:
        out = super().to_json()
        # the report's alpha_c leaves out how its points were drawn (tail_scale)
        out["initial"] = {k: getattr(self.initial, k) for k in self.INITIAL_KEYS}
        if self.initial.quadrature_error is not None:  # a fixed rule: its error, folded into stderr
            q, st = self.initial.quadrature_error, self.initial.statistical_stderr
            out["initial"].update(quadrature_error=q, statistical_stderr=st, quadrature_dominates=bool(q > st),
                                  nodes=self.initial.nodes)
        return out


def threshold_report(model, *, samples: int = 1 << 16, replicas: int = 8, nodes=None, seed=0,
                     staircase_steps: bool = True, staircase: bool | None = None, se_samples: int = 2048,
                     check: bool = False, perfect: bool = True, pr_samples: int = 1024,
                     pr_algorithmic: bool = True, stair_steps: int | None = None,
                     checkpoint=None, kept=None) -> ThresholdReport:
    """alpha_c, the staircase (its first ``stair_steps`` steps past alpha_c; None: all) and
    (``perfect``) the perfect-recovery transition (:func:`aimsym.smi.perfect.perfect_recovery` on
    ``pr_samples`` SE points; ``pr_algorithmic=False``: local stability only). ``checkpoint``: a
    folder keeping every denoiser pass, so that the same call again resumes where it stopped (the
    caller clears it once the report is written); ``kept``: a folder keeping the staircase's
    restricted SE points across runs and code versions (:func:`next_threshold`)."""
    if stair_steps is not None and (isinstance(stair_steps, bool) or not isinstance(stair_steps, int | np.integer)
                                    or stair_steps < 1):
        raise AimsymError("stair_steps", f"must be an integer >= 1 or None, got {stair_steps!r}")
    t0 = time.perf_counter()
    _check_mixing(model)
    do_stairs = staircase_steps if staircase is None else staircase
    passes = as_passes(checkpoint)
    ch = make_channel(model, samples=samples, replicas=replicas, seed=seed, nodes=nodes, checkpoint=passes)
    ini = initial_threshold(model, channel=ch, nodes=nodes)
    steps = [StaircaseStep(subspace=ini.subspace, alpha=ini.alpha, stderr=ini.stderr)]
    rep = ThresholdReport(initial=ini, staircase=steps)
    # The later stages are independent of each other and can each take hours: one that fails is
    # recorded (and warned about) instead of discarding alpha_c and the stages that succeeded.
    if do_stairs and len(ini.subspace) < model.p and np.isfinite(ini.alpha):
        _stage(rep, "staircase", lambda: steps.extend(_staircase(
            model, ini.alpha, ini.subspace, samples=max(samples // 4, 1024), replicas=replicas,
            se_samples=se_samples, nodes=nodes, seed=seed, max_steps=stair_steps, checkpoint=passes, kept=kept)))
    if check and np.isfinite(ini.alpha):
        a = ini.alpha
        _stage(rep, "check", lambda: setattr(rep, "check", threshold_by_side_information(
            model, lo=0.8 * a, hi=1.25 * a, nodes=nodes, seed=seed + 7)))
    if perfect:
        from .perfect import perfect_recovery

        _stage(rep, "perfect_recovery", lambda: setattr(rep, "perfect_recovery", perfect_recovery(
            model, samples=pr_samples, replicas=replicas, seed=seed, nodes=nodes, algorithmic=pr_algorithmic,
            checkpoint=passes)))
    accuracy = {**ch.den.accuracy, "samples": samples, "replicas": replicas, "se_samples": se_samples,
                "pr_samples": pr_samples if perfect else None, "rule": "scrambled Sobol (randomised QMC)"}
    rep.accuracy = accuracy
    rep.seconds = time.perf_counter() - t0
    rep.provenance = provenance(seed=seed, model_hash=model.hash(), accuracy=accuracy,
                                parameters=dict(model.parameters))
    return rep


_staircase = staircase


def _stage(rep: ThresholdReport, name: str, run) -> None:
    """Run one stage of the report; a failure is recorded in ``rep.failed`` and warned about."""
    try:
        run()
    except Exception as exc:  # noqa: BLE001 (any failure of a stage; interrupts still propagate)
        msg = f"{type(exc).__name__}: {exc}".strip()
        rep.failed = {**(rep.failed or {}), name: msg}
        warnings.warn(f"thresholds: the {name} stage failed ({msg}); the other results are kept",
                      RuntimeWarning, stacklevel=2)


# ----------------------------------------------------------------------------- phase diagram
def singular_mixing(model) -> str | None:
    """Why the exact reduction of ``model`` is degenerate at its bound parameters, or None.

    The attention reductions solve z_L = M_{L-1}(u)^{-1} h, M_l = (c_l I + S_l) M_{l-1}. For tied
    softmax layers det(c I + S) >= c^T > 0 when c > 0 (theory section 2; T = 2: >= c (1 + c)). At
    c = 0 det S vanishes only on a null set (two tokens' indices equal), where the kernels give zero
    weight: the model is evaluated, at a cost that grows as c -> 0 (docs/se.md, "Skip c -> 0").
    A negative skip is refused: c I + S then loses the bound that keeps the reduction well posed
    (det can change sign across the bulk), mirroring the derivation's note "skip <= 0: M_{L-1} can
    be singular"."""
    layers = getattr(getattr(model, "spec", None), "layers", None)
    if not layers or len(layers) < 2:
        return None
    params = dict(getattr(model, "parameters", {}) or {})
    for i, ly in enumerate(layers[:-1], start=1):
        c = ly.skip if isinstance(ly.skip, int | float) else params.get(str(ly.skip))
        if c is not None and float(c) < 0:
            return (f"skip {float(c):g} < 0 in layer {i}: the mixing matrix c I + S_{i} can be singular inside the "
                    f"bulk, so the exact reduction z_L = M^-1 h is degenerate; thresholds need skip >= 0 (the cost "
                    f"grows as skip -> 0: docs/se.md, 'Skip c -> 0')")
    return None


def _check_mixing(model, what: str = "skip") -> None:
    why = singular_mixing(model)
    if why is not None:
        raise AimsymError(what, why)


@dataclass
class PhasePoint(Result):
    """One point of the phase diagram; in JSON the swept parameter's name is the key of its value."""

    parameter: str
    value: float
    staircase: list
    perfect_recovery: dict | None
    direction: list
    seconds: float
    provenance: dict

    def to_json(self) -> dict:
        out = super().to_json()
        del out["parameter"], out["value"]
        return {self.parameter: self.value, **out}


@dataclass
class PhaseDiagram(Result):
    """:func:`phase_point` at every value of one parameter, sorted by value."""

    model: str
    parameter: str
    points: list
    seconds: float


def phase_point(model_path, name: str, value: float, *, samples: int = 1 << 14, replicas: int = 8,
                stair_samples: int = 1 << 13, se_samples: int = 1024, seed: int = 0, nodes=None,
                stair_nodes=None, staircase: bool = True, perfect: bool = False, pr_samples: int = 1024,
                pr_algorithmic: bool = True) -> PhasePoint:
    """alpha_c and the staircase thresholds of one model at ``name = value`` (one phase-diagram
    point); ``perfect``: also the perfect-recovery transition (:mod:`aimsym.smi.perfect`): where
    the uninformed SE reaches Q = I, or with ``pr_algorithmic=False`` only where Q = I is locally
    stable (local_alpha: ~100x cheaper, no SE runs)."""
    from ..model import load

    t0 = time.perf_counter()
    model = load(model_path, **{name: float(value)})
    _check_mixing(model, name)
    n_ini = nodes
    n_st = stair_nodes if stair_nodes is not None else n_ini
    ini = initial_threshold(model, samples=samples, replicas=replicas, nodes=n_ini, seed=seed)
    steps = [StaircaseStep(subspace=ini.subspace, alpha=ini.alpha, stderr=ini.stderr)]
    if staircase and len(ini.subspace) < model.p and np.isfinite(ini.alpha):
        for s in _staircase(model, ini.alpha, ini.subspace, samples=stair_samples, replicas=replicas,
                            se_samples=se_samples, nodes=n_st, seed=seed):
            steps.append(StaircaseStep(subspace=s.subspace, alpha=s.alpha, stderr=s.stderr, jump=s.jump,
                                       method=s.method))
    pr = None
    if perfect:
        from .perfect import perfect_recovery

        full = perfect_recovery(model, samples=pr_samples, replicas=replicas, seed=seed, nodes=n_st,
                                algorithmic=pr_algorithmic)
        pr = {k: full.get(k) for k in ("alpha", "stderr", "kind", "counting_alpha", "local_alpha",
                                       "local_alpha_stderr", "trace_Pi", "trace_Pi_stderr", "m")}
    accuracy = {"samples": samples, "stair_samples": stair_samples, "se_samples": se_samples,
                "replicas": replicas, "nodes_initial": n_ini, "nodes_staircase": n_st,
                "pr_samples": pr_samples if perfect else None, "pr_algorithmic": pr_algorithmic if perfect else None,
                "rule": "scrambled Sobol (randomised QMC)"}
    return PhasePoint(parameter=name, value=float(value), staircase=steps,
                      perfect_recovery=pr, direction=ini.direction.tolist(), seconds=time.perf_counter() - t0,
                      provenance=provenance(seed=seed, model_hash=model.hash(), accuracy=accuracy,
                                            parameters=dict(model.parameters)))


def phase_diagram(model_path, name: str, values, *, workers=None, progress: bool = False, **kw) -> PhaseDiagram:
    """:func:`phase_point` at every value, in a local (spawned) process pool; sorted by value.
    Every value is checked first (:func:`singular_mixing`): a degenerate one is refused before any work."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from ..model import load

    t0 = time.perf_counter()
    values = [float(v) for v in values]
    if not values:
        raise AimsymError("--over", "needs at least one value")
    base = load(model_path)
    for v in values:
        _check_mixing(base.with_values(**{name: v}), f"--over {name}")
    from tqdm.auto import tqdm

    if workers == 1:
        pts = [phase_point(model_path, name, v, **kw)
               for v in tqdm(values, desc="phase diagram", disable=not progress)]
    else:
        pts = []
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as ex:
            futs = [ex.submit(phase_point, str(model_path), name, v, **kw) for v in values]
            for f in tqdm(as_completed(futs), total=len(futs), desc="phase diagram", disable=not progress):
                pts.append(f.result())
    pts.sort(key=lambda d: d.value)
    return PhaseDiagram(model=str(model_path), parameter=name, points=pts, seconds=time.perf_counter() - t0)


def phase_rows(pd: dict) -> list[dict]:
    """Flatten a :func:`phase_diagram` result to plot rows {"skip", "alpha", "stderr", "step"}; the
    perfect-recovery rows also carry "perfect" ("algorithmic" or "local") and "counting" (p/m)."""
    name = pd["parameter"]
    rows = [{"skip": pt[name], "alpha": s["alpha"], "stderr": s["stderr"], "step": i,
             "subspace": s["subspace"], "jump": bool(s.get("jump", False))}
            for pt in pd["points"] for i, s in enumerate(pt["staircase"])]
    # the perfect-recovery transition as one more curve, after the staircase's steps
    last = max((r["step"] for r in rows), default=-1) + 1
    rows += [{"skip": pt[name], "alpha": pr["alpha"], "stderr": pr["stderr"], "step": last, "subspace": None,
              "jump": pr["kind"] == "jump", "perfect": "algorithmic", "counting": pr.get("counting_alpha")}
             for pt in pd["points"] if (pr := pt.get("perfect_recovery")) and pr.get("alpha") is not None
             and np.isfinite(pr["alpha"])]
    if not any(r.get("perfect") for r in rows):  # local stability only (pr_algorithmic=False)
        rows += [{"skip": pt[name], "alpha": pr["local_alpha"], "stderr": pr["local_alpha_stderr"], "step": last,
                  "subspace": None, "jump": False, "perfect": "local", "counting": pr.get("counting_alpha")}
                 for pt in pd["points"] if (pr := pt.get("perfect_recovery")) and pr.get("local_alpha") is not None
                 and np.isfinite(pr["local_alpha"])]
    return rows
