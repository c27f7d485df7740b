"""Learning curves at large alpha and their power-law exponents (docs/erm.md, "Power-law target
spectra").

With label noise inside the softmax (Delta > 0) the ERM estimator is not consistent: as
alpha -> infinity it tends to the population minimiser, which (the risk depending on S only
through (q, m)) is r* S* with r* = argmin_r R(q = r^2 Q0, m = r Q0), R the test error against
noisy labels.  ``population_limit`` computes r* and the limiting errors; the learning curves
are the *excess* test error over this limit and the alignment error 1 - m^2 / (Q0 q) (the squared
sine of the angle between S_hat and S*, scale-free, positive, 0 only for S_hat proportional to S*),
fitted by ``fit_exponent``.  (The matrix error itself tends to (1 - r*)^2 Q0, but not
monotonically: S_hat keeps noise eigenvalues above the vanishing threshold eps.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import minimize_scalar

from .params import ERMParams
from .se import Accuracy, curve, fixed_point, test_errors


@dataclass(frozen=True)
class PopulationLimit:
    r: float            # S_hat -> r S*
    test: float         # test error against noisy labels (the noise floor of the ERM)
    test_clean: float
    matrix_error: float  # (1 - r)^2 Q0


def population_limit(params: ERMParams, accuracy: Accuracy = Accuracy()) -> PopulationLimit:
    """r* minimises the risk under the *iteration* rule of ``accuracy`` (the quadrature whose
    fixed point tends to it); the limiting errors use the final test rule, as the fixed point's
    reported errors do, so that excess errors tend to 0 and not to a quadrature floor."""
    Q0 = params.Q0
    it_rule = accuracy.rule(params.tokens)

    def risk(r):
        return float(test_errors(params, r * r * Q0, r * Q0, it_rule)["test"][0])

    res = minimize_scalar(risk, bounds=(1e-3, 3.0), method="bounded", options={"xatol": 1e-12})
    r = float(res.x)
    out = test_errors(params, r * r * Q0, r * Q0, accuracy.rule(params.tokens, "test"))
    return PopulationLimit(r=r, test=float(out["test"][0]), test_clean=float(out["test_clean"][0]),
                           matrix_error=float((1 - r) ** 2 * Q0))


@dataclass(frozen=True)
class Exponent:
    """err ~ A alpha^(-exponent) fitted on the points with alpha >= alpha_min."""

    exponent: float
    stderr: float       # residual-based standard error of the least-squares slope
    points: int
    alpha_min: float
    alpha_max: float


def fit_exponent(alpha, err, decades: float = 1.0, alpha_max: float | None = None) -> Exponent:
    """Least-squares slope of log err against log alpha on [alpha_max / 10^decades, alpha_max]
    (default: the last ``decades`` of the grid)."""
    alpha, err = np.asarray(alpha, float), np.asarray(err, float)
    top = alpha.max() if alpha_max is None else alpha_max
    keep = (alpha >= top / 10.0**decades * (1 - 1e-9)) & (alpha <= top * (1 + 1e-9))
    alpha, err = alpha[keep], err[keep]
    keep = np.ones(alpha.shape, bool)
    if np.any(err <= 0) or not np.all(np.isfinite(err)):
        raise ValueError("fit_exponent needs finite positive errors")
    x, y = np.log(alpha[keep]), np.log(err[keep])
    if x.size < 3:
        raise ValueError(f"fit_exponent needs >= 3 points in the last {decades} decades, got {x.size}")
    xc = x - x.mean()
    slope = float(np.sum(xc * (y - y.mean())) / np.sum(xc * xc))
    resid = y - y.mean() - slope * xc
    se = float(np.sqrt(np.sum(resid**2) / (x.size - 2) / np.sum(xc * xc)))
    return Exponent(exponent=-slope, stderr=se, points=int(x.size), alpha_min=float(alpha.min()),
                    alpha_max=float(alpha.max()))


def decade_exponents(alpha, err) -> list[Exponent]:
    """Local exponents, one least-squares fit per decade [10^j, 10^(j+1)] covered by the grid."""
    alpha = np.asarray(alpha, float)
    lo, hi = np.ceil(np.log10(alpha.min()) - 1e-9), np.floor(np.log10(alpha.max()) + 1e-9)
    return [fit_exponent(alpha, err, 1.0, 10.0 ** (j + 1)) for j in np.arange(lo, hi)]


def _fixed_points(params: ERMParams, alphas, accuracy: Accuracy, lam_scale: float | None):
    if lam_scale is None:
        return curve(params, alphas, accuracy)
    out, init = [], None
    for a in alphas:  # weight decay lam = lam_scale sqrt(alpha), warm-started along the grid
        fp = fixed_point(replace(params, lam=float(lam_scale * np.sqrt(a))), float(a), accuracy, init=init)
        out.append(fp)
        if fp.converged and fp.q > 0:
            init = (fp.q, fp.m, fp.Sigma)
    return out


def learning_curve(params: ERMParams, alphas, accuracy: Accuracy = Accuracy(),
                   lam_scale: float | None = None) -> dict:
    """Fixed points on the grid, the population limit and the excess errors.  ``lam_scale``:
    weight decay lam = lam_scale sqrt(alpha) (then eps / delta stays of order 1 and the noise
    in the null space of S* is thresholded away) instead of the fixed params.lam."""
    fps = _fixed_points(params, alphas, accuracy, lam_scale)
    lim = population_limit(params, accuracy)
    a = np.array([f.alpha for f in fps])
    test = np.array([f.test for f in fps])
    merr = np.array([f.matrix_error for f in fps])
    align = np.array([1.0 - f.m * f.m / (f.params.Q0 * f.q) if f.q > 0 else 1.0 for f in fps])
    return {"alpha": a, "test": test, "test_clean": np.array([f.test_clean for f in fps]),
            "matrix_error": merr, "rank": np.array([f.rank for f in fps]),
            "delta": np.array([f.delta for f in fps]), "eps": np.array([f.eps for f in fps]),
            "lam": np.array([f.params.lam for f in fps]),
            "converged": np.array([f.converged for f in fps]),
            "limit": lim, "excess_test": test - lim.test, "alignment_error": align}
