"""What every denoiser returns (the contract solvers rely on)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class DenoiserOutput:
    g_out: np.ndarray  # (..., p, T)
    dg_out: np.ndarray  # (..., p, T, p, T)
    log_z_out: np.ndarray  # (...)
    ess: np.ndarray  # (...) effective number of quadrature nodes of the final pass
    error: np.ndarray | None = None  # (...) estimated absolute error of g_out/dg_out
    path: str = ""
    polar: np.ndarray | None = None  # (...) True where the polar rule was used (else Gauss-Hermite)


def difference(g, dg, g2, dg2, lz, lz2, g_floor=1.0, dg_floor=1.0) -> np.ndarray:
    """Per sample: largest difference of g_out and dg_out, relative to their size (at least
    g_floor, dg_floor: 1, or per sample), and of log Z_out (absolute)."""
    n = len(g)
    gs = np.maximum(g_floor, np.abs(g).reshape(n, -1).max(axis=1))
    ds = np.maximum(dg_floor, np.abs(dg).reshape(n, -1).max(axis=1))
    return np.maximum.reduce([np.abs(g - g2).reshape(n, -1).max(axis=1) / gs,
                              np.abs(dg - dg2).reshape(n, -1).max(axis=1) / ds, np.abs(lz - lz2)])


def mean_target_met(err, mean_tol) -> bool:
    """Whether a batch's mean error estimate meets a batch target (``mean_tol``, None: no target)."""
    return mean_tol is not None and err is not None and np.size(err) > 0 and bool(np.mean(err) <= mean_tol)
