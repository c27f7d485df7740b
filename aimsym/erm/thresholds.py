"""Perfect-recovery and interpolation thresholds (theory.md §8), in alpha_bar = alpha (T^2+T-2)/2.

Closed forms, and the same thresholds located numerically on the lambda -> 0+ fixed point.

lambda -> 0+ while the training data are interpolated: the proximal step becomes the
projection onto the zero-loss set, h - z = P(c y* - z) (c = beta0 / beta, P the projector on
the L - 1 learned directions), Sigma -> infinity with lambda Sigma finite, and the §8 equations
reduce exactly (Gaussian integrals done in closed form) to

    m_hat/Sigma_hat = c,   delta^2 = (c^2 (Q0 + Delta/2) - 2 c m + q) / (2 alpha_bar c^2),
    dJ/ddelta (delta, eps) = 4 alpha_bar delta                     (fixes eps)
    q = c^2 J,   m = c (J - (delta/2) dJ/ddelta - (eps/2) dJ/deps).

(ridge: S_hat = 2 alpha_bar c Y.)  Perfect recovery = the matrix error Q0 + q - 2m of this
branch reaching 0; interpolation is lost where the branch stops existing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq

from ..errors import AimsymError
from ..results import Result
from .prior import integrals


# ---------------------------------------------------------------- closed forms

def semicircle_partial_moment(k: int, x: float) -> float:
    """P_k(x) = (1/2pi) int_{-2}^{x} sqrt(4 - t^2) t^k dt, k = 0, 1, 2 (t = 2 sin theta)."""
    x = float(np.clip(x, -2.0, 2.0))
    th = np.arcsin(x / 2.0)
    if k == 0:
        return (th + np.sin(th) * np.cos(th)) / np.pi + 0.5
    if k == 1:
        return -4.0 * np.cos(th) ** 3 / (3.0 * np.pi)
    if k == 2:
        return (th + np.pi / 2 - np.sin(4 * th) / 4.0) / np.pi
    raise ValueError("k must be 0, 1 or 2")


def pr_bayes(kappa0: float) -> float:
    """Bayes-optimal perfect recovery: kappa0 - kappa0^2/2 (1/2 for kappa0 >= 1)."""
    k = min(kappa0, 1.0)
    return k - k * k / 2.0


def pr_direct(kappa0: float) -> float:
    """Direct (element-wise S, ridge) perfect recovery: 1/2."""
    return 0.5


def pr_factorised(kappa0: float) -> tuple[float, float]:
    """Factorised, lambda -> 0+: (alpha_bar, c) with c = (1 - kappa0)(c P0(c) - P1(c)),
    alpha_bar = 1/2 - (1/2)(1 - kappa0)^2 (P2(c) - c P1(c))."""
    if kappa0 >= 1.0:
        return 0.5, 0.0
    P = semicircle_partial_moment
    f = lambda c: c - (1.0 - kappa0) * (c * P(0, c) - P(1, c))  # noqa: E731
    c = brentq(f, -2.0, 2.0, xtol=1e-14)
    return 0.5 - 0.5 * (1.0 - kappa0) ** 2 * (P(2, c) - c * P(1, c)), c


def interpolation_factorised(kappa0: float) -> float:
    """Noisy labels, factorised: (1 + 2 kappa0 - kappa0^2)/4."""
    k = min(kappa0, 1.0)
    return (1.0 + 2.0 * k - k * k) / 4.0


@dataclass
class ClosedForms(Result):
    """The closed-form thresholds in alpha_bar: perfect recovery (Bayes, direct, factorised and its
    c) and interpolation with noisy labels (factorised, direct)."""

    perfect_recovery: dict
    interpolation: dict


def closed_forms(kappa0: float) -> ClosedForms:
    pf, c = pr_factorised(kappa0)
    return ClosedForms(perfect_recovery={"bayes": pr_bayes(kappa0), "direct": pr_direct(kappa0),
                                         "factorised": pf, "factorised_c": c},
                       interpolation={"factorised": interpolation_factorised(kappa0), "direct": 0.5})


# ---------------------------------------------------------------- lambda -> 0+ fixed point

@dataclass
class Ridgeless:
    alpha_bar: float
    q: float
    m: float
    delta: float
    eps: float
    matrix_error: float
    rank: float
    converged: bool
    iterations: int


def _eps_from_constraint(penalty, kappa0, delta, alpha_bar, kappa):
    """eps with dJ/ddelta(delta, eps) = 4 alpha_bar delta (dJ/ddelta decreases with eps)."""
    g = lambda e: integrals(penalty, kappa0, delta, e, kappa).dJ_ddelta - 4 * alpha_bar * delta  # noqa: E731
    hi = 2.0 + np.sqrt(kappa0) + 10 * delta + 10.0
    lo = -1.0
    while g(lo) < 0:
        lo *= 2.0
        if lo < -1e6:
            return None  # no interpolating solution
    if g(hi) > 0:
        return None
    return brentq(g, lo, hi, xtol=1e-13, rtol=1e-12)


def ridgeless(alpha_bar: float, kappa0: float, *, model: str = "factorised", Delta: float = 0.0,
              c: float = 1.0, kappa: float | None = None, tol: float = 1e-11,
              max_iter: int = 5000, damping: float = 0.5) -> Ridgeless | None:
    """Fixed point of the interpolating lambda -> 0+ branch (None if it does not exist)."""
    Q0, Qy = 1.0 + kappa0, 1.0 + kappa0 + Delta / 2.0
    if model == "direct":
        if alpha_bar >= 0.5:
            return None
        # S_hat = 2 alpha_bar c Y: explicit
        m = 2 * alpha_bar * c * Q0
        # q = (2 ab c)^2 (Q0 + delta^2), delta^2 = (c^2 Qy - 2 c m + q)/(2 ab c^2): linear in q
        k = (2 * alpha_bar * c) ** 2
        q = k * (Q0 + (c * c * Qy - 2 * c * m) / (2 * alpha_bar * c * c)) / (1 - k / (2 * alpha_bar * c * c))
        delta = np.sqrt((c * c * Qy - 2 * c * m + q) / (2 * alpha_bar * c * c))
        return Ridgeless(alpha_bar, q, m, float(delta), 0.0, Q0 + q - 2 * m, 1.0, True, 0)
    penalty = "pnn" if model == "factorised" else model
    q, m = 0.5 * Q0, 0.5 * Q0
    it = 0
    for it in range(1, max_iter + 1):
        d2 = (c * c * Qy - 2 * c * m + q) / (2 * alpha_bar * c * c)
        if d2 <= 1e-24:
            return Ridgeless(alpha_bar, q, m, 0.0, 0.0, Q0 + q - 2 * m, np.nan, True, it)
        delta = np.sqrt(d2)
        eps = _eps_from_constraint(penalty, kappa0, delta, alpha_bar, kappa)
        if eps is None:
            return None
        I = integrals(penalty, kappa0, delta, eps, kappa)
        qn = c * c * I.J
        mn = c * (I.J - 0.5 * delta * I.dJ_ddelta - 0.5 * eps * I.dJ_deps)
        change = max(abs(qn - q), abs(mn - m)) / Q0
        q, m = damping * q + (1 - damping) * qn, damping * m + (1 - damping) * mn
        if change < tol:
            return Ridgeless(alpha_bar, q, m, float(delta), float(eps), Q0 + q - 2 * m, I.rank, True, it)
    return Ridgeless(alpha_bar, q, m, float(delta), float(eps), Q0 + q - 2 * m, I.rank, False, it)


def _branch_residual(alpha_bar, delta, kappa0, Delta=0.0, c=1.0, eps=None):
    """F = delta^2-equation residual / delta^2 on the lambda -> 0+ branch at given delta
    (eps from the dJ/ddelta constraint unless given), and the eps used."""
    Q0, Qy = 1.0 + kappa0, 1.0 + kappa0 + Delta / 2.0
    if eps is None:
        eps = _eps_from_constraint("pnn", kappa0, delta, alpha_bar, None)
    I = integrals("pnn", kappa0, delta, eps)
    q = c * c * I.J
    m = c * (I.J - 0.5 * delta * I.dJ_ddelta - 0.5 * eps * I.dJ_deps)
    return ((c * c * Qy - 2 * c * m + q) / (2 * alpha_bar * c * c) - delta**2) / delta**2, eps


def locate_perfect_recovery(kappa0: float, model: str = "factorised", *,
                            delta0: float = 1e-4) -> float:
    """Noiseless perfect recovery located on the lambda -> 0+ fixed point.

    factorised: the branch reaches delta -> 0 (matrix error 0) where the residual of the
    delta equation at delta0 -> 0 changes sign (eps >= 0 is required since eps = 2 lam / m_hat);
    direct: the error on the explicit branch is linear in alpha_bar, extrapolated to 0."""
    if model == "direct":
        e1 = ridgeless(0.40, kappa0, model="direct").matrix_error
        e2 = ridgeless(0.45, kappa0, model="direct").matrix_error
        return 0.45 + e2 * 0.05 / (e1 - e2)
    if kappa0 >= 1.0:
        return 0.5
    top = integrals("pnn", kappa0, delta0, 0.0).dJ_ddelta / (4 * delta0)  # eps = 0 there
    lo = pr_bayes(kappa0) * (1 + 1e-6)
    g = lambda ab: _branch_residual(ab, delta0, kappa0)[0]  # noqa: E731
    grid = np.linspace(lo, top, 41)[:-1]
    for a0, a1 in zip(grid[:-1], grid[1:]):  # first + -> - sign change
        if g(a0) > 0 >= g(a1):
            return brentq(g, a0, a1, xtol=1e-10)
    raise FloatingPointError(f"perfect recovery not found for kappa0={kappa0}")


def locate_interpolation(kappa0: float, Delta: float, *, c: float = 1.0) -> float:
    """Noisy labels, factorised, lambda -> 0+: end of the interpolating branch, where eps = 2 lam
    / m_hat reaches 0 on it.  Along eps = 0 the constraint gives alpha_bar(delta) =
    (dJ/ddelta)(delta, 0) / (4 delta); the end is the delta solving the delta equation there.
    As Delta -> 0+ this tends to (1 + 2 kappa0 - kappa0^2)/4; as Delta -> inf to 1/4."""
    if Delta <= 0:
        raise AimsymError("Delta", "the interpolation threshold needs label noise Delta > 0")

    def ab_of(delta):
        return integrals("pnn", kappa0, delta, 0.0).dJ_ddelta / (4 * delta)

    def resid(logd):
        d = np.exp(logd)
        return _branch_residual(ab_of(d), d, kappa0, Delta, c, eps=0.0)[0]
    grid = np.linspace(np.log(1e-4), np.log(1e3), 60)
    vals = [resid(x) for x in grid]
    for x0, x1, v0, v1 in zip(grid[:-1], grid[1:], vals[:-1], vals[1:]):
        if v0 > 0 >= v1 or v0 < 0 <= v1:
            return float(ab_of(np.exp(brentq(resid, x0, x1, xtol=1e-12))))
    raise FloatingPointError(f"no end of the interpolating branch found for Delta={Delta}")
