"""Small numeric kernels shared by the stages (numpy only)."""

from __future__ import annotations

import numpy as np


def softmax_rows(A: np.ndarray) -> np.ndarray:
    """Row softmax of (..., T, T) (or any last axis), shifted by the row max (no overflow)."""
    e = np.exp(A - A.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
