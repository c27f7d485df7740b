"""Bayes-optimal state evolution of the single-layer AIM (theory.md section 7).

Scalar order parameters: overlap q = Tr(S_hat S)/d in [rho, Q0] (q = rho is what the prior mean
sqrt(rho) I alone gives, i.e. alpha = 0), q_hat its conjugate, mmse = Q0 - q, Q0 = 1 + rho.

    prior step   q     = Q0 - m(1 / q_hat)                 (m: RIE mmse, spectral.rie_mmse)
    output step  q_hat = alpha * I(q, Q0 - q)              (I: channel.information)

Softmax/linear: I = c / V, so the fixed point is explicit in Delta = 1/q_hat:
alpha(Delta) = m(Delta) / (c Delta), mmse = m(Delta) (``softmax_parametric``).

Small width (rho -> 0; ``small_width_se``): alpha = alpha_bar rho, q_hat = rho / t,
q = [max(1 - t, 0)]^2, t = 1 / (alpha_bar I(q, 1 - q)); softmax/linear in closed form
(t = 2 - c alpha_bar, weak recovery at alpha_bar_c = 1/c, perfect recovery at 2/c), hardmax by
iteration. Derivation and checks: docs/aim.md section 3.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
from scipy.optimize import brentq

from ..errors import AimsymError
from ..provenance import provenance
from ..results import Result
from .channels import (
    HardmaxChannel,
    pairs as channels_pairs,
    counting_constant,
    make_channel,
    small_width_information_closed_form,
)
from .spectral import prior_second_moment, rie_mmse

_MMSE_FLOOR = 1e-13  # below this the mmse is reported as 0 (perfect recovery)


@dataclass
class AIMSEResult:
    """One state-evolution point of the attention-indexed model: scalar overlap q of the
    extensive-width matrix (the SMI solvers' matrix-valued result is aimsym.smi.se.SEResult)."""

    alpha: float
    q: float
    q_hat: float
    mmse: float
    rho: float
    tokens: int
    activation: str
    beta: float
    method: str
    init: str = "uninformed"
    iterations: int = 0
    converged: bool = True
    accuracy: dict = field(default_factory=dict)

    def to_dict(self, with_provenance=True):
        out = asdict(self)
        # JSON has no infinity: q_hat = inf (perfect recovery) is reported as null
        out = {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in out.items()}
        if with_provenance:
            out["provenance"] = provenance(accuracy=self.accuracy)
        return out

    def to_json(self) -> dict:
        return self.to_dict()


def _check(alpha, rho):
    alpha = float(alpha)
    if not np.isfinite(alpha) or alpha < 0:
        raise AimsymError("alpha", f"must be a finite number >= 0, got {alpha}")
    rho = float(rho)
    if not np.isfinite(rho) or rho <= 0:
        raise AimsymError("rho", f"must be a finite number > 0, got {rho}")
    return alpha, rho


def _prior_step(q_hat, rho):
    Q0 = prior_second_moment(rho)
    if q_hat <= 0:
        return rho  # m(inf) = 1
    return Q0 - rie_mmse(1.0 / q_hat, rho)


# ---------------------------------------------------------------------------------------
# Iterated SE (reference solver, any channel)
# ---------------------------------------------------------------------------------------


def iterate(alpha, rho, tokens=2, activation="softmax", beta=1.0, *, init="uninformed",
            damping=0.0, tol=1e-11, max_iter=20000, channel=None) -> AIMSEResult:
    """Damped fixed-point iteration of the two SE steps.

    init="uninformed" starts at q = rho (prior mean only), "informed" at q = Q0 (1 - 1e-9).
    Stops when |q_new - q| < tol (1 + q) or the mmse falls below 1e-13 (perfect recovery).
    """
    alpha, rho = _check(alpha, rho)
    if not 0.0 <= damping < 1.0:
        raise AimsymError("damping", f"must lie in [0, 1), got {damping}")
    if init not in ("uninformed", "informed"):
        raise AimsymError("init", f"must be 'uninformed' or 'informed', got {init!r}")
    ch = channel or make_channel(activation, tokens, beta)
    Q0 = prior_second_moment(rho)
    q = rho if init == "uninformed" else Q0 * (1.0 - 1e-9)
    q_hat = 0.0
    converged = False
    it = 0
    for it in range(1, max_iter + 1):
        V = Q0 - q
        if V <= _MMSE_FLOOR:
            converged, q = True, Q0
            break
        q_hat = alpha * ch.information(q, V)
        q_new = (1.0 - damping) * _prior_step(q_hat, rho) + damping * q
        if not np.isfinite(q_new):
            raise AimsymError("alpha", f"state evolution produced a non-finite overlap at alpha={alpha}")
        if abs(q_new - q) < tol * (1.0 + abs(q)):
            q = q_new
            converged = True
            break
        q = q_new
    mmse = max(Q0 - q, 0.0)
    if mmse <= _MMSE_FLOOR:
        mmse, q = 0.0, Q0
    return AIMSEResult(alpha, q, q_hat, mmse, rho, ch.tokens, ch.activation, ch.beta, "iterate", init,
                    it, converged, {"tol": tol, "damping": damping, "max_iter": max_iter})


# ---------------------------------------------------------------------------------------
# Softmax / linear: parametric (explicit) curve
# ---------------------------------------------------------------------------------------


def softmax_parametric(Delta, rho, tokens=2, activation="softmax"):
    """alpha(Delta) = m(Delta) / (c Delta) and mmse = m(Delta) (no iteration)."""
    c = counting_constant(tokens, activation)
    Delta = np.asarray(Delta, dtype=float)
    m = rie_mmse(Delta, rho)
    return m / (c * Delta), m


def perfect_recovery_counting(rho, tokens=2, activation="softmax"):
    """alpha_PR = (2 rho - rho^2) / c for rho <= 1, 1 / c for rho >= 1 (degrees of freedom of a
    rank-rho d PSD matrix per d^2/2, over the c/2 independent constraints per sample)."""
    c = counting_constant(tokens, activation)
    rho = float(rho)
    return (2.0 * rho - rho * rho) / c if rho <= 1.0 else 1.0 / c


def perfect_recovery_numeric(rho, tokens=2, activation="softmax"):
    """lim_{Delta -> 0} m(Delta) / (c Delta) from the spectral quadrature (Richardson, linear
    correction in Delta), independent of the counting argument."""
    c = counting_constant(tokens, activation)
    D = 1e-6
    r1 = rie_mmse(D, rho) / D
    r2 = rie_mmse(D / 2, rho) / (D / 2)
    return (2.0 * r2 - r1) / c


def solve_softmax(alpha, rho, tokens=2, activation="softmax", beta=1.0) -> AIMSEResult:
    """Fixed point of the softmax/linear SE from the parametric form: solve m(D)/D = c alpha
    (m(D)/D decreases from 2 rho - rho^2 (or 1) to 0), mmse = 0 above alpha_PR."""
    alpha, rho = _check(alpha, rho)
    make_channel(activation, tokens, beta)  # validation only
    c = counting_constant(tokens, activation)
    Q0 = prior_second_moment(rho)
    target = c * alpha
    if alpha == 0.0:
        return AIMSEResult(0.0, rho, 0.0, 1.0, rho, tokens, activation, beta, "parametric")
    if alpha >= perfect_recovery_counting(rho, tokens, activation) * (1.0 - 1e-12):
        return AIMSEResult(alpha, Q0, np.inf, 0.0, rho, tokens, activation, beta, "parametric")
    f = lambda logD: rie_mmse(np.exp(logD), rho) / np.exp(logD) - target  # noqa: E731
    lo, hi = np.log(1e-3), np.log(1.0)
    while f(lo) < 0:
        lo -= 3.0
        if lo < np.log(1e-300):
            return AIMSEResult(alpha, Q0, np.inf, 0.0, rho, tokens, activation, beta, "parametric")
    while f(hi) > 0:
        hi += 3.0
    logD = brentq(f, lo, hi, xtol=1e-13, rtol=1e-13)
    Delta = float(np.exp(logD))
    m = rie_mmse(Delta, rho)
    return AIMSEResult(alpha, Q0 - m, 1.0 / Delta, m, rho, tokens, activation, beta, "parametric",
                    accuracy={"xtol_logDelta": 1e-13})


def softmax_curve(alphas, rho, tokens=2, activation="softmax", beta=1.0):
    """Vector version of solve_softmax (one root-find per alpha)."""
    return [solve_softmax(a, rho, tokens, activation, beta) for a in np.atleast_1d(alphas)]


# ---------------------------------------------------------------------------------------
# General channels (hardmax): root of the fixed-point equation in Delta = 1/q_hat
# ---------------------------------------------------------------------------------------


def solve_root(alpha, rho, tokens=2, activation="hardmax", beta=1.0, channel=None,
               guess_Delta=None) -> AIMSEResult:
    """Fixed point by Brent's method on F(Delta) = 1/(alpha I(q, V)) - Delta with q = Q0 - m(Delta),
    V = m(Delta); one channel evaluation per step (the iteration can need hundreds).
    Agrees with ``iterate`` (tested); assumes a single fixed point, as for the hardmax channel."""
    alpha, rho = _check(alpha, rho)
    ch = channel or make_channel(activation, tokens, beta)
    Q0 = prior_second_moment(rho)
    if alpha == 0.0:
        return AIMSEResult(0.0, rho, 0.0, 1.0, rho, ch.tokens, ch.activation, ch.beta, "root")

    def F(logD):
        D = np.exp(logD)
        m = rie_mmse(D, rho)
        return np.log(1.0 / (alpha * ch.information(Q0 - m, m))) - logD

    # bracket: start from a guess (continuation along a curve) or from the SE step at q = rho
    if guess_Delta is None:
        lo = np.log(1.0 / (alpha * ch.information(rho, Q0 - rho)))
        step = 1.0
    else:
        lo = np.log(guess_Delta)
        step = 0.1
    f_lo = F(lo)
    hi = lo
    while True:
        hi = hi - step if f_lo < 0 else hi + step
        f_hi = F(hi)
        if np.sign(f_hi) != np.sign(f_lo) or f_hi == 0:
            break
        step *= 2.0
        if abs(hi - lo) > 200:
            raise AimsymError("alpha", f"no state-evolution fixed point bracketed at alpha={alpha}")
    a, b = sorted((lo, hi))
    logD = brentq(F, a, b, xtol=1e-10, rtol=1e-10)
    D = float(np.exp(logD))
    m = rie_mmse(D, rho)
    acc = {"xtol_logDelta": 1e-10, "quad_step": getattr(ch, "step", None)}
    acc.update(getattr(ch, "accuracy", {}))
    return AIMSEResult(alpha, Q0 - m, 1.0 / D, m, rho, ch.tokens, ch.activation, ch.beta, "root", accuracy=acc)


def curve(alphas, rho, tokens=2, activation="softmax", beta=1.0, progress=False, channel=None):
    """SE on a grid of alpha. Softmax/linear: parametric; hardmax: root-finding with
    continuation (each solution brackets the next). Hardmax T = 3 evaluates I(q, V) = J(q/V)/V from
    an interpolant of J built on first use (the one slow step; cost in docs/performance.md)."""
    alphas = np.atleast_1d(np.asarray(alphas, dtype=float))
    if activation in ("softmax", "linear"):
        return softmax_curve(alphas, rho, tokens, activation, beta)
    ch = channel or make_channel(activation, tokens, beta)
    out, guess = [None] * len(alphas), None
    order = np.argsort(alphas)
    it = order
    if progress:
        from tqdm import tqdm

        it = tqdm(order, desc="SE", unit="alpha")
    for i in it:
        res = solve_root(alphas[i], rho, tokens, activation, beta, channel=ch, guess_Delta=guess)
        guess = 1.0 / res.q_hat if res.q_hat > 0 else None
        out[i] = res
    return out


def solve(alpha, rho, tokens=2, activation="softmax", beta=1.0, *, method="auto", init="uninformed",
          damping=0.0) -> AIMSEResult:
    """Dispatch: softmax/linear -> parametric, hardmax -> root (method='iterate' forces the
    damped iteration from the requested init)."""
    if method == "iterate":
        return iterate(alpha, rho, tokens, activation, beta, init=init, damping=damping)
    if method not in ("auto", "parametric", "root"):
        raise AimsymError("method", f"must be auto, iterate, parametric or root, got {method!r}")
    if activation in ("softmax", "linear") and method in ("auto", "parametric"):
        return solve_softmax(alpha, rho, tokens, activation, beta)
    return solve_root(alpha, rho, tokens, activation, beta)


# ---------------------------------------------------------------------------------------
# Small width (rho -> 0): alpha = alpha_bar rho, q_hat = rho / t
# ---------------------------------------------------------------------------------------
#
# Prior side (any channel): S -> rho d eigenvalues near 1/sqrt(rho), seen in GOE noise of variance
# Delta = 1/q_hat = t/rho, so the rescaled problem is a spike of strength 1 in noise t (BBP at t = 1):
# m(t/rho, rho) -> 1 - [max(1 - t, 0)]^2, i.e. q = [max(1 - t, 0)]^2 (q = Q0 - m -> 1 - m).
# Output side: q_hat = alpha I(q, 1 - q) gives t = 1 / (alpha_bar I(q, 1 - q)).
# Softmax/linear, I = c / V: t = (1 - q) / (c alpha_bar); with 1 - q = t (2 - t) this is explicit,
# t = 2 - c alpha_bar between the weak-recovery threshold 1/c and perfect recovery 2/c.

_SMALL_WIDTH_METHODS = ("auto", "iterate", "closed_form")


def small_width_alpha_bar_c(tokens=2, activation="hardmax") -> float:
    """Weak-recovery threshold of the small-width SE, alpha_bar_c = 1 / I(q = 0, V = 1), where the
    uninformed fixed point q = 0 stops being one (t(q = 0) = 1).

    softmax / linear: I = c_T / V, alpha_bar_c = 1 / c_T (softmax 1 / (T^2 + T - 2), any T, any
    beta); hardmax T = 2: arcsin(1/3) closed form; T = 3: E[G^2] = J(0) / 2 from the exact
    quadrature at omega = 0 (all 27 patterns)."""
    ch = make_channel(activation, tokens)  # validates activation and tokens
    if activation in ("softmax", "linear"):
        return 1.0 / counting_constant(ch.tokens, activation)
    if ch.tokens == 3:
        return 1.0 / ch.J(0.0)
    return 1.0 / (2.0 * small_width_information_closed_form())


def small_width_perfect_recovery(tokens=2, activation="softmax"):
    """alpha_bar where the small-width mmse reaches 0: 2 / c_T for softmax / linear (t = 2 - c
    alpha_bar = 0; the rho -> 0 limit of the counting threshold (2 rho - rho^2) / (c rho));
    None for hardmax (power-law decay, no perfect recovery)."""
    ch = make_channel(activation, tokens)
    if activation in ("softmax", "linear"):
        return 2.0 / counting_constant(ch.tokens, activation)
    return None


def small_width_mmse(alpha_bar, tokens=2, activation="softmax"):
    """Closed-form small-width mmse of softmax / linear (vectorised in alpha_bar >= 0):
    1 for c alpha_bar <= 1, 1 - (c alpha_bar - 1)^2 up to c alpha_bar = 2, then 0."""
    if activation not in ("softmax", "linear"):
        raise AimsymError("activation",
                          f"the closed-form small-width mmse is for softmax or linear, got {activation!r}")
    ch = make_channel(activation, tokens)
    u = counting_constant(ch.tokens, activation) * np.asarray(alpha_bar, dtype=float)
    return np.where(u <= 1.0, 1.0, 1.0 - (np.minimum(u, 2.0) - 1.0) ** 2)


@dataclass
class SmallWidthPoint(Result):
    """Fixed point of the rescaled small-width SE (rho -> 0) at one alpha_bar = alpha / rho;
    t = rho / q_hat (0: perfect recovery), mmse = t (2 - t) for t < 1, else 1."""

    alpha_bar: float
    q: float
    t: float
    mmse: float
    iterations: int
    tokens: int = 2
    activation: str = "hardmax"
    method: str = "iterate"
    converged: bool = True


def small_width_se(alpha_bar, *, init="uninformed", tol=1e-12, max_iter=5000, channel=None, tokens=2,
                   activation="hardmax", method="auto"):
    """Rescaled SE for rho -> 0 (alpha = alpha_bar rho, q_hat = rho / t):
    q = [max(1 - t, 0)]^2, t = 1 / (alpha_bar I(q, 1 - q)) (hardmax: I = 2 E[G^2]);
    mmse = t (2 - t) (1 when t >= 1).

    method: "iterate" (uninformed start q = 1e-8, as q = 0 is a fixed point below threshold;
    "informed" 1 - 1e-9), "closed_form" (softmax / linear: t = 1 / (c alpha_bar) below 1 / c,
    2 - c alpha_bar up to 2 / c, 0 beyond: the attracting fixed point from any start q < 1),
    "auto" = closed_form for softmax / linear, iterate for hardmax."""
    alpha_bar = float(alpha_bar)
    if not np.isfinite(alpha_bar) or alpha_bar <= 0:
        raise AimsymError("alpha_bar", f"must be a finite number > 0, got {alpha_bar}")
    if method not in _SMALL_WIDTH_METHODS:
        raise AimsymError("method", f"small width: must be one of {', '.join(_SMALL_WIDTH_METHODS)}, got {method!r}")
    if init not in ("uninformed", "informed"):
        raise AimsymError("init", f"must be 'uninformed' or 'informed', got {init!r}")
    ch = channel or make_channel(activation, tokens)
    explicit = ch.activation in ("softmax", "linear")
    if method == "closed_form" and not explicit:
        raise AimsymError("method", f"closed_form is for softmax or linear; {ch.activation} needs 'iterate'")
    if explicit and method in ("auto", "closed_form"):
        u = counting_constant(ch.tokens, ch.activation) * alpha_bar
        t = 1.0 / u if u <= 1.0 else max(2.0 - u, 0.0)
        q = max(1.0 - t, 0.0) ** 2
        t_eff = min(t, 1.0)
        return SmallWidthPoint(alpha_bar=alpha_bar, q=q, t=t, mmse=t_eff * (2.0 - t_eff), iterations=0,
                               tokens=ch.tokens, activation=ch.activation, method="closed_form")
    q = 1e-8 if init == "uninformed" else 1.0 - 1e-9
    t = np.inf
    converged = False
    it = 0
    for it in range(1, max_iter + 1):
        V = 1.0 - q
        if V <= _MMSE_FLOOR:  # perfect recovery (softmax / linear above 2 / c): I = c / V diverges
            q, t, converged = 1.0, 0.0, True
            break
        t = 1.0 / (alpha_bar * ch.information(q, V))
        q_new = max(1.0 - t, 0.0) ** 2
        if abs(q_new - q) < tol:
            q = q_new
            converged = True
            break
        q = q_new
    t_eff = min(t, 1.0)
    return SmallWidthPoint(alpha_bar=alpha_bar, q=q, t=t, mmse=t_eff * (2.0 - t_eff), iterations=it,
                           tokens=ch.tokens, activation=ch.activation, method="iterate", converged=converged)


class _NumericInformation:
    """A softmax / linear channel whose I(q, V) is computed through the link itself (Gauss-Hermite
    over h - omega, y = softmax(beta h), the log-ratio recovery and the Gaussian posterior on the
    shift line): no counting constant and no 1 / V law is used."""

    def __init__(self, activation, tokens):
        self.channel = make_channel(activation, tokens)
        self.activation, self.tokens = activation, self.channel.tokens
        L = len(channels_pairs(self.tokens))
        self.n_nodes = 3 if L <= 6 else 2  # g is linear in h - omega: 2 nodes are already exact

    def information(self, q, V):
        return self.channel.information_numeric(V, n_nodes=self.n_nodes)


def small_width_alpha_bar_c_numeric(tol=1e-10, tokens=2, activation="hardmax"):
    """alpha_bar_c located numerically.

    hardmax: root of t(q = 0) = 1 (linear stability), E[G^2] from the quadrature at q -> 0.
    softmax / linear: bisection on alpha_bar for "the iterated small-width SE from the uninformed
    start ends at q > 0", with the information I(q, V) computed through the link itself
    (Gauss-Hermite over h; see ``_NumericInformation``), not from c_T / V."""
    T = make_channel(activation, tokens).tokens
    if activation in ("softmax", "linear"):
        ch = _NumericInformation(activation, T)
        lo, hi = 1e-3, 1e3
        # below the threshold the iteration from q = 1e-8 lands exactly on the absorbing q = 0 within
        # two steps; above it every iterate stays >= F(0) > 0 (F increases with q): 10 steps decide
        learns = lambda ab: small_width_se(ab, channel=ch, method="iterate", max_iter=10).q > 0.0  # noqa: E731
        if learns(lo) or not learns(hi):
            raise AimsymError("alpha_bar", "weak-recovery threshold not bracketed in [1e-3, 1e3]")
        while hi - lo > tol * hi:
            mid = np.sqrt(lo * hi)
            lo, hi = (lo, mid) if learns(mid) else (mid, hi)
        return float(np.sqrt(lo * hi))
    if T == 2:
        EG2 = 0.5 * HardmaxChannel().information(1e-16, 1.0)
    else:  # T = 3: the SE rule (quasi-Monte-Carlo over omega) at s = q / V = 1e-6
        EG2 = 0.5 * make_channel("hardmax", T, 1.0).J(1e-6)
    f = lambda ab: 1.0 / (2.0 * ab * EG2) - 1.0  # noqa: E731
    return brentq(f, 1e-3, 1e3, xtol=tol)


def small_width_gap(rho, alpha_bars, tokens=2, activation="softmax"):
    """Finite-rho SE minus its small-width limit at the same alpha_bar: mmse(alpha = rho alpha_bar,
    rho) - mmse_small_width(alpha_bar), one value per alpha_bar (the check that the finite-rho
    curves approach the limit)."""
    alpha_bars = np.atleast_1d(np.asarray(alpha_bars, dtype=float))
    _check(0.0, rho)
    finite = np.array([r.mmse for r in curve(alpha_bars * float(rho), rho, tokens, activation)])
    limit = np.array([small_width_se(a, tokens=tokens, activation=activation).mmse for a in alpha_bars])
    return finite - limit


@dataclass
class AIMThresholds(Result):
    """Perfect- and weak-recovery thresholds of the attention-indexed model (see :func:`thresholds`);
    ``perfect_recovery_numeric`` only where perfect recovery exists (softmax, linear)."""

    tokens: int
    rho: float
    activation: str
    perfect_recovery: float | None
    perfect_recovery_numeric: float | None
    weak_recovery: dict | None
    provenance: dict
    OPTIONAL = ("perfect_recovery_numeric",)


def thresholds(tokens, rho, activation="softmax", beta=1.0) -> AIMThresholds:
    """Perfect-recovery and weak-recovery thresholds (alpha = n / d^2).

    softmax/linear: perfect recovery by counting (and located numerically from the spectral
    limit). hardmax: no perfect recovery (power-law decay of the mmse). Weak recovery, for every
    activation, exists only in the small-width limit, alpha = rho * alpha_bar_c (at finite rho
    q > rho for every alpha > 0: the prior mean makes omega informative, and the threshold is a
    crossover); softmax/linear: alpha_bar_c = 1 / c_T.
    """
    _check(0.0, rho)
    make_channel(activation, tokens, beta)
    pr = pr_numeric = None
    if activation in ("softmax", "linear"):
        pr = perfect_recovery_counting(rho, tokens, activation)
        pr_numeric = perfect_recovery_numeric(rho, tokens, activation)
    ab = small_width_alpha_bar_c(tokens, activation)
    weak = {
        "alpha": float(rho) * ab,
        "alpha_bar": ab,
        "alpha_bar_numeric": small_width_alpha_bar_c_numeric(tokens=tokens, activation=activation),
        "regime": "small width rho -> 0 (alpha = rho * alpha_bar); a crossover at finite rho",
    }
    return AIMThresholds(tokens=int(tokens), rho=float(rho), activation=activation, perfect_recovery=pr,
                         perfect_recovery_numeric=pr_numeric, weak_recovery=weak,
                         provenance=provenance(accuracy={"richardson_Delta": 1e-6}))
