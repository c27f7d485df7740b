"""Limit OpenBLAS threads at run time (no threadpoolctl dependency).

Adam's matrix products are small (d ~ 100); with 2 cores shared with other processes,
multithreaded BLAS was measured ~30x slower than one thread (spin-waiting under contention).
"""

from __future__ import annotations

import ctypes
import glob
import os

import numpy as np

_NAMES = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
          "openblas_set_num_threads")


def set_blas_threads(n: int = 1) -> bool:
    """Best effort; returns True if an OpenBLAS setter was found and called."""
    libdir = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in glob.glob(os.path.join(libdir, "*openblas*.so*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _NAMES:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                return True
    return False
