"""Spectrum of the AIM prior plus semicircle noise, and the rotationally invariant estimator.

Prior: S = W W^T / sqrt(r d), W in R^{d x r} Gaussian, r = rho d. Its spectral law is
sqrt(rho) * MP(ratio 1/rho): an atom of mass 1 - rho at 0 when rho < 1 and no atom for
rho >= 1 (for rho = 1 the density diverges like x^{-1/2} at 0, still without an atom).
Mean sqrt(rho), second moment Q0 = 1 + rho.

Observation Y = S + sqrt(Delta) Z with Z a GOE matrix whose spectrum is the semicircle on
[-2, 2] (Delta is the *variance* of the semicircle). Subordination G(z) = G_S(z - Delta G(z))
turns the prior's quadratic into the cubic (theory.md section 7)

    Delta G^3 - (z + sqrt(rho) Delta) G^2 + (sqrt(rho) z + 1 - rho) G - sqrt(rho) = 0,

with G(z) = integral mu(t) / (z - t) dt. For real x we return G(x - i0), whose imaginary part is
pi * density(x) >= 0.

Public functions (all vectorised over their first argument):

- ``stieltjes(z, rho, Delta)``: the physical root G(z);
- ``density(x, rho, Delta)``: mu_Delta(x);
- ``support_edges(rho, Delta)``: array of shape (n_bulks, 2) with the bulk intervals;
- ``rie_mmse(Delta, rho)``: m(Delta) = Delta - (4 pi^2 / 3) Delta^2 integral mu^3, the MMSE per
  (1/d) ||.||_F^2 of the RIE (Bayes-optimal among rotation-invariant estimators);
- ``rie_map(lam, rho, Delta)``: eigenvalue shrinkage f(lambda) = lambda - 2 Delta Re G(lambda - i0).
"""

from __future__ import annotations

import functools

import numpy as np
from numpy.polynomial import polynomial as P

from ..errors import AimsymError

__all__ = [
    "prior_second_moment",
    "stieltjes",
    "density",
    "support_edges",
    "rie_mmse",
    "rie_mmse_inverse",
    "rie_map",
    "prior_density",
    "QUAD_NODES",
]

# Gauss-Legendre nodes per panel for integral mu^3 (panels graded toward edges and necks, see
# _panels_cached; tests check ~1e-12 relative against 8x the nodes).
QUAD_NODES = 48
_EPS_BRANCH = 1e-9  # imaginary shift used only to select the branch, then polished away


def _check_params(rho, Delta, *, allow_zero_delta=True):
    rho = float(rho)
    Delta = float(Delta)
    if not np.isfinite(rho) or rho <= 0:
        raise AimsymError("rho", f"must be a finite number > 0, got {rho}")
    if not np.isfinite(Delta) or Delta < 0 or (Delta == 0 and not allow_zero_delta):
        allowed = ">= 0" if allow_zero_delta else "> 0"
        raise AimsymError("Delta", f"must be a finite number {allowed}, got {Delta}")
    return rho, Delta


def prior_second_moment(rho: float) -> float:
    """Q0 = Tr(S^2)/d = 1 + rho."""
    return 1.0 + float(rho)


# ---------------------------------------------------------------------------------------
# Cubic roots, vectorised
# ---------------------------------------------------------------------------------------


def _coefficients(z, rho, Delta):
    s = np.sqrt(rho)
    a3 = Delta
    a2 = -(z + s * Delta)
    a1 = s * z + 1.0 - rho
    a0 = -s + 0.0 * z
    return a3, a2, a1, a0


def _poly_eval(a3, a2, a1, a0, G):
    return ((a3 * G + a2) * G + a1) * G + a0


def _poly_deriv(a3, a2, a1, G):
    return (3.0 * a3 * G + 2.0 * a2) * G + a1


def _newton(a3, a2, a1, a0, G, steps=3):
    """Newton steps, each kept only where it does not increase |P|: next to a double root (a
    support edge) P' vanishes and a full step can throw the root arbitrarily far (an Im G of 2e8
    at x = 986.358508922 for rho = 1e-5, Delta = 243221.43)."""
    res = np.abs(_poly_eval(a3, a2, a1, a0, G))
    for _ in range(steps):
        d = _poly_deriv(a3, a2, a1, G)
        safe = np.abs(d) > 0
        step = np.where(safe, _poly_eval(a3, a2, a1, a0, G) / np.where(safe, d, 1.0), 0.0)
        G_new = G - step
        res_new = np.abs(_poly_eval(a3, a2, a1, a0, G_new))
        better = res_new <= res
        G, res = np.where(better, G_new, G), np.where(better, res_new, res)
    return G


def _cubic_roots(z, rho, Delta):
    """All roots of the cubic at complex z, shape (3,) + z.shape (Cardano, Newton-polished)."""
    a3, a2, a1, a0 = _coefficients(z, rho, Delta)
    B, C, D = a2 / a3, a1 / a3, a0 / a3
    p = C - B * B / 3.0
    q = 2.0 * B**3 / 27.0 - B * C / 3.0 + D
    disc = np.sqrt(q * q / 4.0 + p**3 / 27.0 + 0j)
    # take the sign of the square root that avoids cancellation in -q/2 +- disc
    w1 = -q / 2.0 + disc
    w2 = -q / 2.0 - disc
    w = np.where(np.abs(w1) >= np.abs(w2), w1, w2)
    u = w ** (1.0 / 3.0)
    omega = np.exp(2j * np.pi / 3.0)
    cands = []
    for k in range(3):
        uk = u * omega**k
        safe = np.abs(uk) > 0
        t = np.where(safe, uk - p / (3.0 * np.where(safe, uk, 1.0)), 0.0)
        cands.append(t - B / 3.0)
    cands = np.stack(cands)
    # Cardano is accurate only for the root of largest modulus (for small Delta it is ~ z/Delta
    # and swamps the others): keep it and deflate with Vieta's relations, which do not cancel:
    # r2 r3 = -D / r1 and r2 + r3 = (C - r2 r3) / r1.
    idx = np.argmax(np.abs(cands), axis=0)
    r1 = np.take_along_axis(cands, idx[None], axis=0)[0]
    r1 = _newton(a3, a2, a1, a0, r1, steps=2)
    r1_safe = np.where(np.abs(r1) > 0, r1, 1.0)
    prod = -D / r1_safe
    ssum = (C - prod) / r1_safe
    sq = np.sqrt(ssum * ssum - 4.0 * prod + 0j)
    big = np.where(np.abs(ssum + sq) >= np.abs(ssum - sq), ssum + sq, ssum - sq) / 2.0
    big_safe = np.where(np.abs(big) > 0, big, 1.0)
    small = np.where(np.abs(big) > 0, prod / big_safe, 0.0)
    roots = np.stack([r1, big, small])
    roots = np.where(np.abs(r1) > 0, roots, cands)  # p = q = 0: triple root, keep Cardano
    return _newton(a3, a2, a1, a0, roots, steps=3)


def _quadratic_root(z, rho):
    """Delta = 0: physical root of z G^2 - (sqrt(rho) z + 1 - rho) G + sqrt(rho) = 0."""
    s = np.sqrt(rho)
    A = z
    Bc = -(s * z + 1.0 - rho)
    disc = np.sqrt(Bc * Bc - 4.0 * A * s + 0j)
    r1 = (-Bc + disc) / (2.0 * A)
    r2 = (-Bc - disc) / (2.0 * A)
    return np.stack([r1, r2])


def _select_branch(roots, z):
    """Herglotz branch: Im G has the sign opposite to Im z (so Im G > 0 for z = x - i eps)."""
    sign = -np.sign(np.imag(z))
    sign = np.where(sign == 0, 1.0, sign)
    idx = np.argmax(sign * np.imag(roots), axis=0)
    return np.take_along_axis(roots, idx[None], axis=0)[0]


def stieltjes(z, rho, Delta):
    """G(z) = integral mu_Delta(t)/(z - t) dt of Wishart(rho) + semicircle(variance Delta).

    ``z`` may be complex (any half-plane, exact branch: Im G has the sign opposite to Im z) or
    real, in which case G(x - i0) is returned (Im G = pi * density >= 0). For real x the branch
    is selected at x - i eps (eps = 1e-9 (1 + |x|)) and then Newton-polished on the real axis,
    so the answer carries no eps bias.
    """
    rho, Delta = _check_params(rho, Delta)
    z = np.asarray(z)
    real_input = not np.iscomplexobj(z)
    zc = z.astype(complex)
    if real_input:
        zc = zc - 1j * _EPS_BRANCH * (1.0 + np.abs(zc))
    if Delta == 0.0:
        G = _select_branch(_quadratic_root(zc, rho), zc)
        if real_input:
            G = _select_branch(_quadratic_root(z.astype(complex) - 0j * z, rho), zc)
            G = np.real(G) + 1j * np.abs(np.imag(G))
        return G
    G = _select_branch(_cubic_roots(zc, rho, Delta), zc)
    if real_input:
        a3, a2, a1, a0 = _coefficients(z.astype(complex), rho, Delta)
        G = _newton(a3, a2, a1, a0, G, steps=4)
        G = np.real(G) + 1j * np.abs(np.imag(G))
    return G


def density(x, rho, Delta):
    """Spectral density mu_Delta(x) = Im G(x - i0) / pi (continuous part; Delta = 0 and rho < 1
    also has an atom of mass 1 - rho at 0, not included)."""
    x = np.asarray(x, dtype=float)
    rho_, Delta_ = _check_params(rho, Delta)
    if Delta_ == 0.0:
        return prior_density(x, rho_)
    return np.maximum(np.imag(stieltjes(x, rho_, Delta_)), 0.0) / np.pi


def prior_density(x, rho):
    """Continuous part of the Delta = 0 law sqrt(rho) MP(1/rho)."""
    rho = float(rho)
    x = np.asarray(x, dtype=float)
    lo, hi = (np.sqrt(rho) - 1.0) ** 2 / np.sqrt(rho), (np.sqrt(rho) + 1.0) ** 2 / np.sqrt(rho)
    inside = (x > lo) & (x < hi) & (x > 0)
    xs = np.where(inside, x, 0.5 * (lo + hi))
    val = np.sqrt(np.maximum((hi - xs) * (xs - lo), 0.0)) * np.sqrt(rho) / (2.0 * np.pi * xs)
    return np.where(inside, val, 0.0)


# ---------------------------------------------------------------------------------------
# Support edges from the discriminant quartic
# ---------------------------------------------------------------------------------------


def _discriminant_poly(rho, Delta):
    """Coefficients (increasing powers of z) of the discriminant of the cubic in G."""
    s = np.sqrt(rho)
    a = np.array([Delta])
    b = np.array([-s * Delta, -1.0])
    c = np.array([1.0 - rho, s])
    d = np.array([-s])
    m = P.polymul
    terms = [
        18.0 * m(m(m(a, b), c), d),
        -4.0 * m(m(m(b, b), b), d),
        m(m(b, b), m(c, c)),
        -4.0 * m(a, m(m(c, c), c)),
        -27.0 * m(m(a, a), m(d, d)),
    ]
    out = np.zeros(5)
    for t in terms:
        out[: len(t)] += t
    return out


def _polish_real_roots(coef, roots, steps=6):
    dcoef = P.polyder(coef)
    for _ in range(steps):
        f = P.polyval(roots, coef)
        df = P.polyval(roots, dcoef)
        ok = np.abs(df) > 1e-300
        roots = roots - np.where(ok, f / np.where(ok, df, 1.0), 0.0)
    return roots


@functools.lru_cache(maxsize=4096)
def _edges_cached(rho: float, Delta: float) -> tuple:
    if Delta == 0.0:
        lo, hi = (np.sqrt(rho) - 1.0) ** 2 / np.sqrt(rho), (np.sqrt(rho) + 1.0) ** 2 / np.sqrt(rho)
        return ((lo, hi),)
    coef = _discriminant_poly(rho, Delta)
    roots = P.polyroots(coef)
    scale = 1.0 + np.max(np.abs(roots))
    real = np.sort(np.real(roots[np.abs(np.imag(roots)) < 1e-7 * scale]))
    real = _polish_real_roots(coef, real)
    # a bulk lies between consecutive real roots where the cubic has a complex pair
    bulks = []
    for lo, hi in zip(real[:-1], real[1:]):
        if hi - lo <= 1e-14 * scale:
            continue
        mid = 0.5 * (lo + hi)
        if np.imag(stieltjes(np.array([mid]), rho, Delta))[0] > 1e-12:
            if bulks and abs(bulks[-1][1] - lo) <= 1e-12 * scale:
                bulks[-1] = (bulks[-1][0], hi)  # touching bulks (merging point): one bulk
            else:
                bulks.append((lo, hi))
    if not bulks:
        raise AimsymError("Delta", f"no spectral support found for rho={rho}, Delta={Delta}")
    return tuple(bulks)


def support_edges(rho, Delta):
    """Bulk intervals of mu_Delta as an array of shape (n_bulks, 2), sorted.

    Edges are the real roots of the discriminant (a quartic in z) of the cubic, Newton-polished;
    one bulk, or two for rho < 1 and small Delta (the broadened atom at 0 and the MP bulk).
    """
    rho, Delta = _check_params(rho, Delta)
    return np.array(_edges_cached(rho, Delta))


# ---------------------------------------------------------------------------------------
# RIE mmse and eigenvalue map
# ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _gauss_legendre_theta(n: int):
    t, w = np.polynomial.legendre.leggauss(n)
    theta = 0.5 * np.pi * (t + 1.0)
    return theta, 0.5 * np.pi * w


@functools.lru_cache(maxsize=4096)
def _panels_cached(rho: float, Delta: float) -> tuple:
    """Integration panels covering the support, graded toward the special points.

    Special points are the quartic (discriminant) roots: real ones are the bulk edges, complex
    pairs close to the axis mark a neck (the bulks have just merged). Each has a local scale, its
    distance to the nearest other root (the gap before merging, 2 |Im| after); panels are cut at
    geometric distances scale * 4^k from it so that a fixed rule per panel resolves both scales.
    """
    coef = _discriminant_poly(rho, Delta)
    roots = P.polyroots(coef)
    cuts_all = []
    for lo, hi in _edges_cached(rho, Delta):
        cuts = {lo, hi}
        width = hi - lo
        for i, r in enumerate(roots):
            others = np.delete(roots, i)
            scale = float(np.min(np.abs(others - r))) if len(others) else width
            x0 = float(np.real(r))
            if scale >= 0.25 * width or not (lo - scale <= x0 <= hi + scale):
                continue
            if lo < x0 < hi:
                cuts.add(x0)
            step = scale
            while step < 0.5 * width:
                for c in (x0 - step, x0 + step):
                    if lo < c < hi:
                        cuts.add(c)
                step *= 4.0
        cuts = np.sort(np.array(sorted(cuts)))
        keep = np.concatenate([[True], np.diff(cuts) > 1e-13 * (1.0 + width)])
        cuts_all.append(tuple(cuts[keep]))
    return tuple(cuts_all)


def _integral_mu_cubed(rho, Delta, n):
    """integral mu^3 dx: on each panel x = mid + half cos(theta), Gauss-Legendre in theta
    (removes the sqrt edge behaviour and clusters nodes at panel ends)."""
    theta, w = _gauss_legendre_theta(n)
    cos_t, sin_t = np.cos(theta), np.sin(theta)
    xs, ws = [], []
    for cuts in _panels_cached(rho, Delta):
        lo, hi = np.asarray(cuts[:-1]), np.asarray(cuts[1:])
        mid, half = 0.5 * (lo + hi), 0.5 * (hi - lo)
        xs.append((mid[:, None] + half[:, None] * cos_t[None, :]).ravel())
        ws.append((half[:, None] * (w * sin_t)[None, :]).ravel())
    x, wx = np.concatenate(xs), np.concatenate(ws)
    mu = np.maximum(np.imag(_stieltjes_inside(x, rho, Delta)), 0.0) / np.pi
    return float(np.sum(wx * mu**3))


def _stieltjes_inside(x, rho, Delta):
    """G(x - i0) at points strictly inside the support: the root with the largest Im part of
    the real-axis cubic (inside the bulk the physical root is the one of the complex pair with
    Im > 0), so no eps shift is needed."""
    roots = _cubic_roots(x.astype(complex), rho, Delta)
    idx = np.argmax(np.imag(roots), axis=0)
    return np.take_along_axis(roots, idx[None], axis=0)[0]


def rie_mmse_scalar(Delta, rho, n=QUAD_NODES):
    if Delta == 0.0:
        return 0.0
    m = Delta - (4 * np.pi**2 / 3) * Delta**2 * _integral_mu_cubed(rho, Delta, n)
    return float(min(max(m, 0.0), Delta))


def rie_mmse(Delta, rho):
    """m(Delta): MMSE (per (1/d)||.||_F^2) of denoising S from S + sqrt(Delta) Z, Z GOE.

    m(Delta) = Delta - (4 pi^2 / 3) Delta^2 integral mu_Delta(x)^3 dx, computed with Gauss-Legendre
    in theta (x = mid + half cos theta) on panels graded toward the edges and necks (fixed rule,
    ~1e-12 relative; cancellation limits it to ~1e-14 Delta / m). Vectorised over Delta. m(0) = 0, m(inf) = 1 (the variance
    of S around its mean sqrt(rho) I).
    """
    Delta_arr = np.asarray(Delta, dtype=float)
    rho_f = float(rho)
    if not np.isfinite(rho_f) or rho_f <= 0:
        raise AimsymError("rho", f"must be a finite number > 0, got {rho}")
    if np.any(~np.isfinite(Delta_arr)) or np.any(Delta_arr < 0):
        raise AimsymError("Delta", "must be finite and >= 0")
    out = np.array([_rie_mmse_cached(float(D), rho_f) for D in Delta_arr.ravel()])
    return out.reshape(Delta_arr.shape) if Delta_arr.ndim else float(out[0])


@functools.lru_cache(maxsize=65536)
def _rie_mmse_cached(Delta, rho):
    return rie_mmse_scalar(Delta, rho)


def rie_mmse_inverse(m_target, rho, *, rtol=1e-12):
    """Delta with m(Delta) = m_target (m is increasing from 0 to 1)."""
    from scipy.optimize import brentq

    m_target = float(m_target)
    if not 0.0 < m_target < 1.0:
        raise AimsymError("mmse", f"must lie in (0, 1), got {m_target}")
    lo, hi = m_target, 2.0 * m_target  # m(Delta) <= Delta, so Delta >= m_target
    while rie_mmse(hi, rho) < m_target:
        hi *= 4.0
        if hi > 1e12:
            raise AimsymError("mmse", f"no Delta reaches m = {m_target} for rho={rho}")
    f = lambda logD: rie_mmse(np.exp(logD), rho) - m_target  # noqa: E731
    return float(np.exp(brentq(f, np.log(lo), np.log(hi), rtol=rtol, xtol=1e-14)))


def rie_map(lam, rho, Delta):
    """RIE eigenvalue shrinkage f(lambda) = lambda - 2 Delta Re G(lambda - i0) (vectorised)."""
    rho, Delta = _check_params(rho, Delta)
    lam = np.asarray(lam, dtype=float)
    if Delta == 0.0:
        return lam.copy()
    return lam - 2.0 * Delta * np.real(stieltjes(lam, rho, Delta))
