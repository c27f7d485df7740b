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
