"""Predicted spectrum of the learned S (theory.md §8) and comparison with trained weights.

S_hat = (m_hat / Sigma_hat) eta(S* + delta Z): eigenvalues s = (m_hat/Sigma_hat) eta(y), y ~ rho_delta,
plus a delta peak at 0 of mass 1 - rank (nuclear norms).  Ridge: S_hat = m_hat Y / (Sigma_hat + 4 lam).
Singular values of W / sqrt(d) (factorised, W of width r = kappa d): sigma^2 = sqrt(kappa) s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..aim.spectral import density as rho_density
from ..aim.spectral import support_edges
from ..errors import AimsymError
from ..results import Result
from .prior import integrals
from .se import FixedPoint


def _map(fp: FixedPoint):
    """(scale, threshold, penalty) of the eigenvalue map s = scale * eta(y)."""
    p = fp.params
    if p.penalty == "ridge":
        return fp.m_hat / (fp.Sigma_hat + 4.0 * p.lam), None, "ridge"
    return fp.m_hat / fp.Sigma_hat, fp.eps, p.penalty


@dataclass
class Spectrum(Result):
    """Predicted eigenvalues of S_hat: density on the grid ``s``, the mass of the delta peak at 0,
    the rank; ``threshold``: the soft threshold of the non-ridge penalties."""

    s: np.ndarray
    density: np.ndarray
    delta_peak: float
    rank: float
    threshold: float | None = None
    OPTIONAL = ("threshold",)


@dataclass
class SingularValueDensity(Result):
    """Predicted non-zero singular values of W / sqrt(d) (factorised model)."""

    sigma: np.ndarray
    density: np.ndarray
    delta_peak: float


def spectrum(fp: FixedPoint, n: int = 400) -> Spectrum:
    """Density of the non-zero eigenvalues on a grid, the delta-peak mass and the rank."""
    p = fp.params
    if p.target != "wishart":
        raise AimsymError("target", "the predicted spectrum supports the wishart target only")
    scale, eps, pen = _map(fp)
    delta = fp.delta
    edges = support_edges(p.kappa0, delta * delta)
    if pen == "ridge":
        y = np.linspace(edges[0, 0], edges[-1, 1], n)
        s = scale * y
        dens = rho_density(y, p.kappa0, delta * delta) / scale
        return Spectrum(s=s, density=dens, delta_peak=0.0, rank=1.0)
    I = integrals(pen, p.kappa0, delta, eps, p.kappa)
    t = I.threshold
    if pen == "pnn":
        y = np.linspace(max(t, edges[0, 0]), edges[-1, 1], n)
        s = scale * (y - eps)
    else:
        yp = np.linspace(max(t, 0), max(edges[-1, 1], t), n // 2)
        ym = np.linspace(min(edges[0, 0], -t), -t, n // 2)
        y = np.concatenate([ym, yp])
        s = scale * np.sign(y) * (np.abs(y) - eps)
    dens = rho_density(y, p.kappa0, delta * delta) / scale
    return Spectrum(s=s, density=dens, delta_peak=1.0 - I.rank, rank=I.rank, threshold=t)


def cdf(fp: FixedPoint, x: np.ndarray, n: int = 2000) -> np.ndarray:
    """Predicted CDF of the eigenvalues of S_hat at points x (atom at 0 included)."""
    sp = spectrum(fp, n)
    s, dens = sp.s, sp.density
    order = np.argsort(s)
    s, dens = s[order], dens[order]
    # trapezoid cumulative of the continuous part (split at 0 for the symmetric case)
    cum = np.concatenate([[0.0], np.cumsum(0.5 * (dens[1:] + dens[:-1]) * np.diff(s))])
    cont = np.interp(x, s, cum, left=0.0, right=cum[-1])
    neg_mass = np.interp(0.0, s, cum, left=0.0, right=cum[-1]) if s[0] < 0 else 0.0
    atom = np.where(np.asarray(x) >= 0, sp.delta_peak, 0.0)
    total = cum[-1] + sp.delta_peak
    del neg_mass
    return (cont + atom) / total


def ks_distance(fp: FixedPoint, eigenvalues: np.ndarray, zero_tol: float = 1e-2) -> float:
    """Kolmogorov-Smirnov distance between trained eigenvalues and the prediction; eigenvalues
    with |s| < zero_tol max|s| are counted in the delta peak (Adam never reaches exact zeros).
    Ties (the peak) are handled with left and right limits of both CDFs."""
    ev = np.asarray(eigenvalues, float)
    ev = np.sort(np.where(np.abs(ev) < zero_tol * np.abs(ev).max(), 0.0, ev))
    n = ev.size
    right = np.searchsorted(ev, ev, "right") / n
    left = np.searchsorted(ev, ev, "left") / n
    F = cdf(fp, ev)
    F_left = F - np.where(ev == 0.0, _atom(fp), 0.0)
    return float(max(np.max(np.abs(right - F)), np.max(np.abs(left - F_left))))


def _atom(fp: FixedPoint) -> float:
    return spectrum(fp, 50).delta_peak


def singular_value_density(fp: FixedPoint, n: int = 400) -> SingularValueDensity:
    """Density of the non-zero singular values of W / sqrt(d): sigma = (sqrt(kappa) s)^(1/2)."""
    sp = spectrum(fp, n)
    kappa = fp.params.kappa or 1.0
    s = np.maximum(sp.s, 0.0)
    sigma = np.sqrt(np.sqrt(kappa) * s)
    # p_sigma = p_s ds/dsigma, ds/dsigma = 2 sigma / sqrt(kappa); densities per eigenvalue of
    # S (d of them); W / sqrt(d) has r = kappa d singular values, rescale to per-singular-value
    dens = sp.density * 2 * sigma / np.sqrt(kappa) / kappa
    return SingularValueDensity(sigma=sigma, density=dens, delta_peak=1.0 - sp.rank / kappa)
