"""Bayes-optimal state evolution of the single-layer AIM (theory.md section 7).

Scalar order parameters: overlap q = Tr(S_hat S)/d in [rho, Q0] (q = rho is what the prior mean
sqrt(rho) I alone gives, i.e. alpha = 0), q_hat its conjugate, mmse = Q0 - q, Q0 = 1 + rho.

    prior step   q     = Q0 - m(1 / q_hat)                 (m: RIE mmse, spectral.rie_mmse)
    output step  q_hat = alpha * I(q, Q0 - q)              (I: channel.information)

Softmax/linear: I = c / V, so the fixed point is explicit in Delta = 1/q_hat:
alpha(Delta) = m(Delta) / (c Delta), mmse = m(Delta) (``softmax_parametric``).
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
# Small width (rho -> 0), hardmax T = 2
# ---------------------------------------------------------------------------------------


def small_width_alpha_bar_c(tokens=2) -> float:
    """Weak-recovery threshold alpha_bar_c = 1 / (2 E[G^2]) at q = 0. T = 2: arcsin(1/3) closed
    form; T = 3: E[G^2] = J(0) / 2 from the exact quadrature at omega = 0 (all 27 patterns)."""
    if int(tokens) == 3:
        return 1.0 / make_channel("hardmax", 3).J(0.0)
    return 1.0 / (2.0 * small_width_information_closed_form())


@dataclass
class SmallWidthPoint(Result):
    """Fixed point of the rescaled small-width SE (hardmax, rho -> 0) at one alpha_bar."""

    alpha_bar: float
    q: float
    t: float
    mmse: float
    iterations: int


def small_width_se(alpha_bar, *, init="uninformed", tol=1e-12, max_iter=5000, channel=None, tokens=2):
    """Rescaled SE for rho -> 0 (alpha = alpha_bar rho, q_hat = rho / t):
    q = [max(1 - t, 0)]^2, t = 1 / (2 alpha_bar E[G^2](q)), E[G^2] at V = 1 - q; mmse = t (2 - t)
    (1 when t >= 1). Uninformed start q = 1e-8 (q = 0 is always a fixed point)."""
    alpha_bar = float(alpha_bar)
    if not np.isfinite(alpha_bar) or alpha_bar <= 0:
        raise AimsymError("alpha_bar", f"must be a finite number > 0, got {alpha_bar}")
    ch = channel or make_channel("hardmax", tokens)
    q = 1e-8 if init == "uninformed" else 1.0 - 1e-9
    t = np.inf
    for it in range(1, max_iter + 1):
        EG2 = 0.5 * ch.information(q, 1.0 - q)
        t = 1.0 / (2.0 * alpha_bar * EG2)
        q_new = max(1.0 - t, 0.0) ** 2
        if abs(q_new - q) < tol:
            q = q_new
            break
        q = q_new
    t_eff = min(t, 1.0)
    return SmallWidthPoint(alpha_bar=alpha_bar, q=q, t=t, mmse=t_eff * (2.0 - t_eff), iterations=it)


def small_width_alpha_bar_c_numeric(tol=1e-10, tokens=2):
    """alpha_bar_c located by bisection on where the small-width SE leaves q = 0
    (linear stability: t(q = 0) = 1), with E[G^2] from the quadrature at q -> 0."""
    if int(tokens) == 2:
        EG2 = 0.5 * HardmaxChannel().information(1e-16, 1.0)
    else:  # T = 3: the SE rule (quasi-Monte-Carlo over omega) at s = q / V = 1e-6
        EG2 = 0.5 * make_channel("hardmax", tokens, 1.0).J(1e-6)
    f = lambda ab: 1.0 / (2.0 * ab * EG2) - 1.0  # noqa: E731
    return brentq(f, 1e-3, 1e3, xtol=tol)


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
    limit); no weak-recovery threshold (q > rho for every alpha > 0: the prior mean makes omega
    informative). hardmax: no perfect recovery (power-law decay of the mmse); weak recovery only
    in the small-width limit, alpha = rho * alpha_bar_c (at finite rho it is a crossover).
    """
    _check(0.0, rho)
    make_channel(activation, tokens, beta)
    pr = pr_numeric = weak = None
    if activation in ("softmax", "linear"):
        pr = perfect_recovery_counting(rho, tokens, activation)
        pr_numeric = perfect_recovery_numeric(rho, tokens, activation)
    else:
        ab = small_width_alpha_bar_c(tokens)
        weak = {
            "alpha": float(rho) * ab,
            "alpha_bar": ab,
            "alpha_bar_numeric": small_width_alpha_bar_c_numeric(tokens=tokens),
            "regime": "small width rho -> 0 (alpha = rho * alpha_bar); a crossover at finite rho",
        }
    return AIMThresholds(tokens=int(tokens), rho=float(rho), activation=activation, perfect_recovery=pr,
                         perfect_recovery_numeric=pr_numeric, weak_recovery=weak,
                         provenance=provenance(accuracy={"richardson_Delta": 1e-6}))
