"""Free convolution of a target law mu with a semicircle of variance delta^2, and the prior
integrals J(delta, eps) of theory.md §8 for any target law (``aimsym.erm.target``).

Subordination: G(z) = G_mu(omega(z)), omega = z - delta^2 G(z).  We use Biane's real
parametrisation of the boundary values, which needs no branch choice: for real u let
f(u) = int mu(s) / (u - s)^2 ds and U = {u : f(u) > 1 / delta^2} (a finite union of open
intervals, one around each atom or bulk of mu unless they merge).  For u in U there is a unique
v(u) > 0 with

    int mu(s) / ((u - s)^2 + v^2) ds = -Im G_mu(u + i v) / v = 1 / delta^2,

(the left side decreases in v from f(u) to 0, so v is found by bisection in log v), and

    x(u) = u + delta^2 Re G_mu(u + i v),     rho_delta(x(u)) = v / (pi delta^2),
    G(x - i0) = conj G_mu(u + i v)           (Im G = pi rho_delta, Re G = (x - u) / delta^2).

u -> x(u) is increasing and maps the closure of U onto the support of rho_delta (edges: v = 0).
Integrals over x are done in u: dx = x'(u) du with, from implicit differentiation,

    v' = -Im G_mu' / (Re G_mu' + 1 / delta^2),    x' = 1 + delta^2 (Re G_mu' - v' Im G_mu').

Quadrature: Gauss-Legendre in theta, u = mid - half cos(theta), on panels of U split at the
atoms and bulk edges of mu (and at the threshold of the active set); the cosine map absorbs the
square-root behaviour of v at the edges.  J, dJ/deps and the rank follow as in
``aimsym.erm.prior``; dJ/ddelta = 4 delta int_A rho eta Re G is the free heat-flow identity,
valid for any initial law.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

BISECT_STEPS = 64
GAP_STEPS = 90
FREE_NODES = 48  # Gauss-Legendre nodes per panel


@dataclass(frozen=True)
class PriorIntegrals:
    """J, its derivatives and the rank of the prior step (for the Wishart target in closed form in
    ``aimsym.erm.prior``, for any target law here)."""

    J: float
    dJ_ddelta: float
    dJ_deps: float
    rank: float        # fraction of non-zero eigenvalues of S_hat (1 - delta-peak mass)
    threshold: float   # lower end of the active set (eps, or the rank-cap quantile)


@lru_cache(maxsize=8)
def gl_theta(n: int):
    """Gauss-Legendre nodes and weights on the angle interval (0, pi)."""
    t, w = np.polynomial.legendre.leggauss(n)
    return 0.5 * np.pi * (t + 1.0), 0.5 * np.pi * w


def _bisect(fun, lo, hi, steps=BISECT_STEPS):
    """Vectorised bisection for a sign change of fun on [lo, hi] (fun(lo) > 0 > fun(hi) or the
    reverse, decided per element)."""
    lo, hi = np.array(lo, float), np.array(hi, float)
    flo = np.sign(fun(lo))
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        same = np.sign(fun(mid)) == flo
        lo = np.where(same, mid, lo)
        hi = np.where(same, hi, mid)
    return 0.5 * (lo + hi)


def _singular_set(law) -> list[tuple[float, float]]:
    """Atoms (degenerate intervals) and bulks of mu, sorted, overlaps merged."""
    parts = sorted([(s, s) for s, _ in law.atoms] + list(law.bulks))
    out = [list(parts[0])]
    for lo, hi in parts[1:]:
        if lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [tuple(p) for p in out]


def _f(law, u):
    """f(u) = int mu / (u - s)^2 for real u outside the support (= -G_mu'(u))."""
    return -np.real(law.dG(np.asarray(u, float) + 0j))


def u_intervals(law, delta: float) -> list[tuple[float, float]]:
    """The intervals of U = {f > 1/delta^2}, sorted."""
    c = 1.0 / (delta * delta)
    sing = _singular_set(law)
    g = lambda u: _f(law, u) - c  # noqa: E731
    # outer boundaries: f <= 1/dist^2 so the root is within delta of the support
    tiny = 1e-13 * (abs(sing[0][0]) + abs(sing[-1][1]) + delta)
    left = float(_bisect(g, sing[0][0] - 1.01 * delta, sing[0][0] - tiny))
    right = float(_bisect(g, sing[-1][1] + tiny, sing[-1][1] + 1.01 * delta))
    cuts = [left]
    if len(sing) > 1:
        a = np.array([s[1] for s in sing[:-1]])
        b = np.array([s[0] for s in sing[1:]])
        # f is convex on each gap and infinite at both ends: ternary search for its minimum
        lo, hi = a.copy(), b.copy()
        for _ in range(GAP_STEPS):
            m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
            left_lower = _f(law, m1) < _f(law, m2)
            hi = np.where(left_lower, m2, hi)
            lo = np.where(left_lower, lo, m1)
        umin = 0.5 * (lo + hi)
        gap = _f(law, umin) < c
        if gap.any():
            span = b - a
            r1 = _bisect(g, a + 1e-13 * span, umin)
            r2 = _bisect(g, umin, b - 1e-13 * span)
            for i in np.flatnonzero(gap):
                cuts.extend([float(r1[i]), float(r2[i])])
    cuts.append(right)
    return list(zip(cuts[0::2], cuts[1::2]))


def solve_v(law, delta: float, u):
    """v(u) > 0 with -Im G_mu(u + i v) / v = 1/delta^2 (0 outside U)."""
    u = np.asarray(u, float)
    c = 1.0 / (delta * delta)

    def h(t):  # decreasing in t = log v
        v = np.exp(t)
        return -np.imag(law.G(u + 1j * v)) / v - c

    lo = np.full(u.shape, np.log(delta) - 40.0)
    hi = np.full(u.shape, np.log(delta) + 1e-12)  # F <= 1/v^2, so v <= delta
    inside = h(lo) > 0
    t = _bisect(h, lo, hi)
    return np.where(inside, np.exp(t), 0.0)


def boundary_values(law, delta: float, u):
    """x(u), rho_delta(x(u)), G(x - i0) and x'(u) at points u of U."""
    u = np.asarray(u, float)
    d2 = delta * delta
    v = solve_v(law, delta, u)
    ok = v > 0
    if not ok.all():  # a node outside U (only by rounding at an edge): zero density there
        v = np.where(ok, v, 1e-300)
    w = u + 1j * v
    Gm = law.G(w)
    dG = law.dG(w)
    x = u + d2 * np.real(Gm)
    vp = -np.imag(dG) / (np.real(dG) + 1.0 / d2)
    xp = 1.0 + d2 * (np.real(dG) - vp * np.imag(dG))
    rho = np.where(ok, v / (np.pi * d2), 0.0)
    xp = np.where(ok, xp, 0.0)
    if not np.all(np.isfinite(x[ok])) or not np.all(np.isfinite(xp[ok])):
        raise FloatingPointError(f"free convolution: non-finite boundary values at delta={delta}")
    return x, rho, np.conj(Gm), xp


def _x_of_u(law, delta, u):
    u = np.atleast_1d(np.asarray(u, float))
    v = solve_v(law, delta, u)
    return float((u + delta * delta * np.real(law.G(u + 1j * np.maximum(v, 1e-300))))[0])


def support(law, delta: float) -> np.ndarray:
    """Support intervals of rho_delta, shape (n, 2): the images of the intervals of U."""
    ivs = u_intervals(law, delta)
    ends = np.array(ivs)
    x = ends + delta * delta * np.real(law.G(ends.ravel() + 0j)).reshape(ends.shape)
    return x


def _u_at(law, delta, t, lo, hi):
    """u in [lo, hi] with x(u) = t (x increasing; Brent's method)."""
    from scipy.optimize import brentq
    return float(brentq(lambda uu: _x_of_u(law, delta, uu) - t, lo, hi,
                        xtol=1e-15 * (abs(lo) + abs(hi) + delta), rtol=4 * np.finfo(float).eps))


def _panels(law, delta, x_lo=None, x_abs=None):
    """u-panels covering {x(u) > x_lo} or {|x(u)| > x_abs} (or all of U), split at the atoms and
    bulk edges of mu."""
    ivs = u_intervals(law, delta)
    ends = np.array(ivs)
    xe = ends + delta * delta * np.real(law.G(ends.ravel() + 0j)).reshape(ends.shape)
    pts_mu = sorted({p for s in _singular_set(law) for p in s})
    out = []

    def cut(lo, hi, xlo, xhi, t, keep_above):
        if keep_above:
            if xhi <= t:
                return []
            if xlo >= t:
                return [(lo, hi)]
            return [(_u_at(law, delta, t, lo, hi), hi)]
        if xlo >= t:
            return []
        if xhi <= t:
            return [(lo, hi)]
        return [(lo, _u_at(law, delta, t, lo, hi))]

    for (lo, hi), (xlo, xhi) in zip(ivs, xe):
        if x_lo is not None:
            pieces = cut(lo, hi, xlo, xhi, x_lo, True)
        elif x_abs is not None:
            pieces = cut(lo, hi, xlo, xhi, x_abs, True) + cut(lo, hi, xlo, xhi, -x_abs, False)
        else:
            pieces = [(lo, hi)]
        for a, b in pieces:
            inner = [p for p in pts_mu if a + 1e-12 * (b - a) < p < b - 1e-12 * (b - a)]
            bounds = [a, *inner, b]
            out.extend(zip(bounds[:-1], bounds[1:]))
    return out


def nodes(law, delta: float, panels, n: int = FREE_NODES):
    """Quadrature nodes: x, weights in x (Jacobian included), rho_delta(x), G(x - i0)."""
    theta, wt = gl_theta(n)
    if not panels:
        z = np.zeros(0)
        return z, z, z, z.astype(complex)
    P = np.array(panels)
    mid, half = 0.5 * (P[:, 0] + P[:, 1]), 0.5 * (P[:, 1] - P[:, 0])
    u = (mid[:, None] - half[:, None] * np.cos(theta)).ravel()
    wu = (wt * half[:, None] * np.sin(theta)).ravel()
    x, rho, G, xp = boundary_values(law, delta, u)
    return x, wu * xp, rho, G


def density(law, delta: float, x):
    """rho_delta at points x (by inverting x(u) on a fine u grid; for plots and checks)."""
    x = np.asarray(x, float)
    out = np.zeros_like(x)
    for lo, hi in u_intervals(law, delta):
        th = np.linspace(0, np.pi, 2001)
        u = 0.5 * (lo + hi) - 0.5 * (hi - lo) * np.cos(th)
        xu, rho, _, _ = boundary_values(law, delta, u)
        inside = (x >= xu[0]) & (x <= xu[-1])
        out[inside] = np.interp(x[inside], xu, rho)
    return out


def cdf_above(law, t: float, delta: float, n: int = FREE_NODES) -> float:
    x, w, rho, _ = nodes(law, delta, _panels(law, delta, x_lo=t), n)
    return float(np.sum(w * rho))


def integrals(law, penalty: str, delta: float, eps: float, kappa: float | None = None,
              n: int = FREE_NODES) -> PriorIntegrals:
    """J, dJ/ddelta, dJ/deps, rank of theory.md §8 for rho_delta = mu boxplus semicircle(delta^2)."""
    if not (np.isfinite(delta) and delta > 0):
        raise ValueError(f"delta must be positive and finite, got {delta}")
    if penalty == "pnn":
        sup = support(law, delta)
        t = max(eps, float(sup[0, 0]))
        if kappa is not None and kappa < 1.0 and cdf_above(law, t, delta, n) > kappa:
            from scipy.optimize import brentq
            t = brentq(lambda s: cdf_above(law, s, delta, n) - kappa, t, float(sup[-1, 1]),
                       xtol=1e-13, rtol=1e-12)
        x, w, rho, G = nodes(law, delta, _panels(law, delta, x_lo=t), n)
        eta = x - eps
        aeta = eta
    elif penalty == "snn":
        t = max(eps, 0.0)
        x, w, rho, G = nodes(law, delta, _panels(law, delta, x_abs=t), n)
        aeta = np.abs(x) - eps
        eta = np.sign(x) * aeta
    else:
        raise ValueError(f"integrals: unknown penalty {penalty!r}")
    J = np.sum(w * rho * eta * eta)
    dJ_deps = -2.0 * np.sum(w * rho * aeta)
    dJ_ddelta = 4.0 * delta * np.sum(w * rho * eta * np.real(G))
    rank = np.sum(w * rho)
    vals = np.array([J, dJ_ddelta, dJ_deps, rank])
    if not np.all(np.isfinite(vals)):
        raise FloatingPointError(f"non-finite prior integrals at delta={delta}, eps={eps}: {vals}")
    return PriorIntegrals(float(J), float(dJ_ddelta), float(dJ_deps), float(rank), float(t))


@lru_cache(maxsize=4096)
def cached_integrals(law, penalty, delta, eps, kappa, n):
    return integrals(law, penalty, delta, eps, kappa, n)
