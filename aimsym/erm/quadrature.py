"""Expectations over the Gaussian fields of the output step.

Per learned direction j = 1..L-1 (the flat direction does not enter), the pair
(y*_j, g_j) is drawn in whitened form; the fields are y* = sqrt(Q0 + Delta/2) g_y and
z = a y* + b g_z.  The rule is either a Gauss-Hermite tensor product in the 2(L-1) whitened
variables (deterministic; default for T = 2, 4 dimensions) or randomised quasi-Monte Carlo
(scrambled Sobol, several independent scrambles -> mean and standard error; default T >= 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy.stats import norm, qmc


@dataclass(frozen=True)
class Rule:
    """Nodes g (R, N, 2, D) standard normal, weights w (N,), R replicates (1 for Gauss-Hermite)."""

    g: np.ndarray
    w: np.ndarray
    kind: str
    size: int

    def describe(self) -> dict:
        return {"rule": self.kind, "points": int(self.g.shape[1]), "replicates": int(self.g.shape[0]),
                "size": self.size}


@lru_cache(maxsize=16)
def gauss_hermite(D: int, n: int, prune: float = 1e-6) -> Rule:
    """Tensor Gauss-Hermite (probabilists') in 2 D dimensions, n nodes per dimension; nodes with
    product weight below ``prune`` times the largest are dropped (far tails, ~1e-6 of mass)."""
    x, w = np.polynomial.hermite_e.hermegauss(n)
    w = w / w.sum()
    dims = 2 * D
    grids = np.meshgrid(*([x] * dims), indexing="ij")
    wgrids = np.meshgrid(*([w] * dims), indexing="ij")
    g = np.stack([gr.ravel() for gr in grids], axis=-1).reshape(-1, 2, D)
    weight = np.prod(np.stack([wg.ravel() for wg in wgrids], axis=-1), axis=-1)
    keep = weight > prune * weight.max()
    return Rule(g[keep][None], weight[keep] / weight[keep].sum(), "gauss-hermite", n)


@lru_cache(maxsize=16)
def rqmc(D: int, log2_points: int, replicates: int, seed: int) -> Rule:
    """Scrambled Sobol points mapped through the normal quantile; ``replicates`` scrambles."""
    rng = np.random.default_rng(seed)
    gs = []
    for _ in range(replicates):
        u = qmc.Sobol(2 * D, scramble=True, seed=rng).random_base2(log2_points)
        gs.append(norm.ppf(np.clip(u, 1e-15, 1 - 1e-15)).reshape(-1, 2, D))
    n = gs[0].shape[0]
    return Rule(np.stack(gs), np.full(n, 1.0 / n), "rqmc-sobol", 2**log2_points)


def expect(values: np.ndarray, rule: Rule) -> tuple[float, float]:
    """Mean and standard error of per-node values shaped (R, N)."""
    per = values @ rule.w
    mean = float(per.mean())
    se = float(per.std(ddof=1) / np.sqrt(per.size)) if per.size > 1 else 0.0
    return mean, se
