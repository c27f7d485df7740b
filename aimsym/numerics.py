"""Small numeric kernels shared by the stages (numpy only)."""

from __future__ import annotations

import numpy as np


def softmax_rows(A: np.ndarray) -> np.ndarray:
    """Row softmax of (..., T, T) (or any last axis), shifted by the row max (no overflow)."""
    e = np.exp(A - A.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def tail_size(n: int) -> int:
    """How many of n importance weights make the tail of ``pareto_tail_index``: min(n/5, 3 sqrt n)."""
    return int(min(0.2 * n, 3.0 * np.sqrt(n)))


def pareto_tail_index(largest: np.ndarray, n: int | None = None) -> float:
    """Shape xi of a generalised Pareto fit to the largest of n importance weights (the tail of
    their distribution): xi < 1/2, finite variance, a replicate spread measures the error;
    xi >= 1/2, infinite variance, the error of a mean falls only like n^-(1 - xi) and a spread
    seen so far understates it (the diagnostic of Pareto-smoothed importance sampling, Vehtari et
    al.). ``largest``: the weights, or at least their ``tail_size(n) + 1`` largest (n: how many
    there were; None: all given). The tail is the M = tail_size(n) largest weights above the next
    one; xi is the posterior mean of the profile likelihood over the grid of Zhang and Stephens
    (2009). Returns nan for a tail of fewer than 5 positive weights, -inf for one of equal
    weights."""
    w = np.sort(largest[np.isfinite(largest) & (largest > 0)])
    N = w.size if n is None else int(n)
    M = min(tail_size(N), w.size - 1)
    if M < 5:
        return float("nan")
    x = w[w.size - M:] / w[w.size - M - 1] - 1.0  # exceedances, scaled (xi is scale-free)
    if not x[-1] > 0:
        return float("-inf")
    m = x.size
    grid = 30 + int(np.sqrt(m))
    quartile = x[max(int(m / 4 + 0.5) - 1, 0)]
    quartile = quartile if quartile > 0 else x[-1] / m
    j = np.arange(1, grid + 1)
    theta = -1.0 / x[-1] - (1.0 - np.sqrt(grid / (j - 0.5))) / (3.0 * quartile)  # theta = xi / sigma
    xi = np.log1p(np.outer(theta, x)).mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        loglik = m * (np.log(theta / xi) - xi - 1.0)
    ok = np.isfinite(loglik)
    if not ok.any():
        return float("nan")
    post = np.exp(loglik[ok] - loglik[ok].max())
    theta_hat = float(np.sum(post * theta[ok]) / post.sum())
    return float(np.log1p(theta_hat * x).mean())
