"""Limit OpenBLAS threads for the duration of a computation (no threadpoolctl dependency).

Small matrix products (d ~ 100) on a few shared cores run many times faster on one thread than
on several (spin-waiting under contention; numbers in docs/performance.md). The limit is scoped:
``with blas_threads(1): ...`` or the ``limit_blas_threads`` decorator restore the previous count.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import inspect
import os

import numpy as np

_SETTERS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads")
_GETTERS = ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads")


@functools.cache
def _library():
    """(setter, getter) of the OpenBLAS bundled with numpy, or (None, None)."""
    libdir = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in glob.glob(os.path.join(libdir, "*openblas*.so*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for s, g in zip(_SETTERS, _GETTERS):
            setter, getter = getattr(lib, s, None), getattr(lib, g, None)
            if setter is not None:
                return setter, getter
    return None, None


@contextlib.contextmanager
def blas_threads(n: int = 1):
    """Run the block with ``n`` OpenBLAS threads, then restore the previous count."""
    setter, getter = _library()
    before = int(getter()) if getter is not None else None
    if setter is not None:
        setter(ctypes.c_int(int(n)))
    try:
        yield
    finally:
        if setter is not None and before is not None:
            setter(ctypes.c_int(before))


def limit_blas_threads(param: str | None = None, n: int = 1):
    """Decorator: run the function inside ``blas_threads``; the count is ``n`` or, with ``param``,
    that argument of the call (None or 0 there leaves the setting alone)."""

    def deco(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            threads = n
            if param is not None:
                bound = sig.bind(*args, **kwargs)
                threads = bound.arguments.get(param, sig.parameters[param].default)
            if not threads:  # None or 0: leave the setting alone
                return fn(*args, **kwargs)
            with blas_threads(int(threads)):
                return fn(*args, **kwargs)

        return wrapper

    return deco
