"""Learning curves at large alpha and their power-law exponents (docs/erm.md, "Power-law target
spectra").

With label noise inside the softmax (Delta > 0) the ERM estimator is not consistent: as
alpha -> infinity it tends to the population minimiser, which (the risk depending on S only
through (q, m)) is r* S* with r* = argmin_r R(q = r^2 Q0, m = r Q0), R the test error against
noisy labels.  ``population_limit`` computes r* and the limiting errors; the learning curves
are the *excess* errors over these limits, fitted by ``fit_exponent``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize_scalar

from .params import ERMParams
from .se import Accuracy, curve, test_errors


@dataclass(frozen=True)
class PopulationLimit:
    r: float            # S_hat -> r S*
    test: float         # test error against noisy labels (the noise floor of the ERM)
    test_clean: float
    matrix_error: float  # (1 - r)^2 Q0


def population_limit(params: ERMParams, accuracy: Accuracy = Accuracy()) -> PopulationLimit:
    rule = accuracy.rule(params.tokens, "test")
    Q0 = params.Q0

    def risk(r):
        return float(test_errors(params, r * r * Q0, r * Q0, rule)["test"][0])

    res = minimize_scalar(risk, bounds=(1e-3, 3.0), method="bounded", options={"xatol": 1e-10})
    r = float(res.x)
    out = test_errors(params, r * r * Q0, r * Q0, rule)
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


def fit_exponent(alpha, err, decades: float = 1.0) -> Exponent:
    """Least-squares slope of log err against log alpha on the last ``decades`` of the grid."""
    alpha, err = np.asarray(alpha, float), np.asarray(err, float)
    if np.any(err <= 0) or not np.all(np.isfinite(err)):
        raise ValueError("fit_exponent needs finite positive errors")
    keep = alpha >= alpha.max() / 10.0**decades
    x, y = np.log(alpha[keep]), np.log(err[keep])
    if x.size < 3:
        raise ValueError(f"fit_exponent needs >= 3 points in the last {decades} decades, got {x.size}")
    xc = x - x.mean()
    slope = float(np.sum(xc * (y - y.mean())) / np.sum(xc * xc))
    resid = y - y.mean() - slope * xc
    se = float(np.sqrt(np.sum(resid**2) / (x.size - 2) / np.sum(xc * xc)))
    return Exponent(exponent=-slope, stderr=se, points=int(x.size), alpha_min=float(alpha[keep].min()),
                    alpha_max=float(alpha.max()))


def learning_curve(params: ERMParams, alphas, accuracy: Accuracy = Accuracy()) -> dict:
    """Fixed points on the grid, the population limit and the excess errors."""
    fps = curve(params, alphas, accuracy)
    lim = population_limit(params, accuracy)
    a = np.array([f.alpha for f in fps])
    test = np.array([f.test for f in fps])
    merr = np.array([f.matrix_error for f in fps])
    return {"alpha": a, "test": test, "test_clean": np.array([f.test_clean for f in fps]),
            "matrix_error": merr, "rank": np.array([f.rank for f in fps]),
            "delta": np.array([f.delta for f in fps]), "eps": np.array([f.eps for f in fps]),
            "converged": np.array([f.converged for f in fps]),
            "limit": lim, "excess_test": test - lim.test, "excess_matrix": merr - lim.matrix_error}
