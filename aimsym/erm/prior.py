"""Prior (penalty) side of the ERM fixed point: J(delta, eps) and its derivatives (theory.md §8).

The penalty's proximal map acts on the eigenvalues of Y = S* + delta Z (Z GOE, semicircle on
[-2, 2]); Y's spectral law rho_delta is the AIM prior (Wishart, rho = kappa0) freely convolved
with a semicircle of variance delta^2 (``aimsym.aim.spectral`` with Delta = delta^2).
With eta the eigenvalue map on its active set A,

    J       = int_A rho_delta(y) eta(y)^2 dy
    dJ/deps = -2 int_A rho_delta |eta(y)| dy
    dJ/ddelta = 4 delta int_A rho_delta(y) eta(y) Re G_delta(y) dy

The last line is analytic: the free heat flow (Burgers equation dG/dt = -G dG/dz, t = delta^2)
gives d/dt int rho_t phi = int phi'(y) Re G_t(y) rho_t(y) dy, here with phi' = 2 eta.  When a
student rank cap kappa binds (PSD penalty), A = {y > t} with t the (1 - kappa)-quantile; the
formula still holds because the top-kappa sum of phi has gradient phi' on the kept eigenvalues.
Integrals use Gauss-Legendre in theta on each bulk piece, y = mid - half cos(theta), which
absorbs the square-root edges.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq

from ..aim.spectral import stieltjes, support_edges
from .freeconv import FREE_NODES, PriorIntegrals, gl_theta
from .freeconv import integrals as free_integrals

PENALTIES = ("pnn", "snn", "ridge")
PRIOR_NODES = 160  # Gauss-Legendre nodes per panel


def pieces(edges: np.ndarray, cuts_above: float | None = None,
           cuts_abs: float | None = None) -> list[tuple[float, float]]:
    """Support intervals intersected with (cuts_above, inf) or with |y| > cuts_abs."""
    out = []
    for lo, hi in edges:
        if cuts_above is not None:
            lo = max(lo, cuts_above)
            if hi > lo:
                out.append((lo, hi))
        elif cuts_abs is not None:
            if hi > cuts_abs:
                out.append((max(lo, cuts_abs), hi))
            if lo < -cuts_abs:
                out.append((lo, min(hi, -cuts_abs)))
        else:
            out.append((lo, hi))
    return out


def nodes(kappa0: float, delta: float, intervals, n: int = PRIOR_NODES):
    """Quadrature nodes y, weights w (Jacobian included) and G(y - i0) on the intervals."""
    theta, wt = gl_theta(n)
    ys, ws = [], []
    # extra panel breaks where the broadened atom at 0 (a semicircle of radius
    # ~2 delta sqrt(1 - kappa0)) meets the Wishart bulk: the density has a sharp dip there
    w0 = 2.0 * delta * np.sqrt(max(1.0 - kappa0, 0.0))
    breaks = [0.0, -w0, w0, 2 * w0] if w0 > 0 else [0.0]
    split = []
    for lo, hi in intervals:
        inner = sorted(b for b in breaks if lo + 1e-12 * (hi - lo) < b < hi - 1e-12 * (hi - lo))
        pts = [lo, *inner, hi]
        split.extend(zip(pts[:-1], pts[1:]))
    for lo, hi in split:
        mid, half = 0.5 * (lo + hi), 0.5 * (hi - lo)
        ys.append(mid - half * np.cos(theta))
        ws.append(wt * half * np.sin(theta))
    if not ys:
        return np.zeros(0), np.zeros(0), np.zeros(0, complex)
    y = np.concatenate(ys)
    G = stieltjes(y, kappa0, delta * delta)
    return y, np.concatenate(ws), G


def cdf_above(t: float, kappa0: float, delta: float, n: int = PRIOR_NODES) -> float:
    """Mass of rho_delta above t."""
    edges = support_edges(kappa0, delta * delta)
    y, w, G = nodes(kappa0, delta, pieces(edges, cuts_above=t), n)
    return float(np.sum(w * np.imag(G)) / np.pi)


def top_quantile(kappa: float, kappa0: float, delta: float) -> float:
    """t with mass kappa of rho_delta above t (the student's rank cap)."""
    edges = support_edges(kappa0, delta * delta)
    lo, hi = edges[0, 0], edges[-1, 1]
    return brentq(lambda t: cdf_above(t, kappa0, delta) - kappa, lo, hi, xtol=1e-13, rtol=1e-12)


def integrals(penalty: str, kappa0: float, delta: float, eps: float,
              kappa: float | None = None, n: int = PRIOR_NODES) -> PriorIntegrals:
    """J, dJ/ddelta, dJ/deps, rank for the PSD ('pnn') or symmetric ('snn') nuclear norm."""
    if not (np.isfinite(delta) and delta > 0):
        raise ValueError(f"delta must be positive and finite, got {delta}")
    edges = support_edges(kappa0, delta * delta)
    if penalty == "pnn":
        t = max(eps, edges[0, 0])
        if kappa is not None and kappa < 1.0 and cdf_above(t, kappa0, delta, n) > kappa:
            t = top_quantile(kappa, kappa0, delta)
        y, w, G = nodes(kappa0, delta, pieces(edges, cuts_above=t), n)
        eta = y - eps
        aeta = eta
    elif penalty == "snn":
        t = max(eps, 0.0)
        y, w, G = nodes(kappa0, delta, pieces(edges, cuts_abs=t), n)
        aeta = np.abs(y) - eps
        eta = np.sign(y) * aeta
    else:
        raise ValueError(f"integrals: unknown penalty {penalty!r}")
    rho = np.maximum(np.imag(G), 0.0) / np.pi
    J = np.sum(w * rho * eta * eta)
    dJ_deps = -2.0 * np.sum(w * rho * aeta)
    dJ_ddelta = 4.0 * delta * np.sum(w * rho * eta * np.real(G))
    rank = np.sum(w * rho)
    return PriorIntegrals(float(J), float(dJ_ddelta), float(dJ_deps), float(rank), float(t))


@dataclass(frozen=True)
class PriorStep:
    q: float
    m: float
    Sigma: float
    rank: float
    delta: float
    eps: float
    threshold: float


def prior_step(penalty: str, q_hat: float, m_hat: float, Sigma_hat: float, lam: float,
               kappa0: float, kappa: float | None = None, n: int = PRIOR_NODES, *,
               law=None, free_nodes: int | None = None) -> PriorStep:
    """q, m, Sigma from the conjugates (theory.md §8, prior side).  ``law``: a target law of
    ``aimsym.erm.target`` (generic free convolution, ``free_nodes`` per panel); None: the
    Wishart target of rank ratio kappa0 through the cubic."""
    if not (q_hat > 0 and m_hat > 0 and Sigma_hat > 0):
        raise FloatingPointError(
            f"prior step needs positive conjugates, got q_hat={q_hat}, m_hat={m_hat}, "
            f"Sigma_hat={Sigma_hat}")
    delta = np.sqrt(q_hat) / m_hat
    Q0 = 1.0 + kappa0 if law is None else law.Q0
    if penalty == "ridge":
        # S_hat = m_hat Y / (Sigma_hat + 4 lam): the prox of 2 lam ||S||^2 in the §8 normalisation
        c = m_hat / (Sigma_hat + 4.0 * lam)
        return PriorStep(q=c * c * (Q0 + delta**2), m=c * Q0, Sigma=1.0 / (Sigma_hat + 4.0 * lam),
                         rank=1.0, delta=float(delta), eps=0.0, threshold=-np.inf)
    eps = 2.0 * lam / m_hat
    if law is None:
        I = integrals(penalty, kappa0, delta, eps, kappa, n)
    else:
        I = free_integrals(law, penalty, float(delta), float(eps), kappa, free_nodes or FREE_NODES)
    r = m_hat / Sigma_hat
    q = r * r * I.J
    m = r * I.J - np.sqrt(q_hat) / (2 * Sigma_hat) * I.dJ_ddelta - lam / Sigma_hat * I.dJ_deps
    Sigma = m_hat * I.dJ_ddelta / (2.0 * np.sqrt(q_hat) * Sigma_hat)
    return PriorStep(q=float(q), m=float(m), Sigma=float(Sigma), rank=I.rank, delta=float(delta),
                     eps=float(eps), threshold=I.threshold)
