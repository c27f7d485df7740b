"""The finite output set of a noiseless discrete link (sign, hardmax), for the SE's exact sum
over outputs.

Sampling y = g(Z) at fixed points makes the sampled SE map jump wherever a sample's y flips as Q
moves, so its iteration cycles and its Jacobian (hence the fixed point's error) is that of the
jumps. Summing over the outputs instead,

    E_y[f(y, omega)] = sum_y Z_out(y; omega, V) f(y, omega),   Z_out(y) = P(g(Z) = y | omega, V),

keeps the map smooth in Q (omega = Q^{1/2} xi at fixed xi) with the same expectation.
"""

from __future__ import annotations

import numpy as np

# normal draws at Q = 0 from which the output set is read: an output whose probability there is
# above ~1e-3 appears with probability 1 - e^{-16}; the mass check in the SE catches the rest
SET_DRAWS = 1 << 14
# smallest total output probability of an expectation point before the SE warns that the set is
# incomplete
MASS_TOL = 1e-6

_CACHE: dict = {}


def discrete(model) -> bool:
    """True for a noiseless link whose output takes finitely many values (generic rank m = 0)."""
    counting = getattr(getattr(model, "kernels", None), "COUNTING", None) or {}
    return bool(getattr(model, "noise", 1.0) == 0 and counting.get("m") == 0 and counting.get("noiseless"))


def output_set(model) -> np.ndarray | None:
    """The distinct outputs y (K, *output_shape) of a discrete link, read from SET_DRAWS draws of Z
    ~ N(0, I) (a fixed seed, so the set is the same in every run); None for other links."""
    if not discrete(model):
        return None
    key = model.hash()
    if key not in _CACHE:
        Z = np.random.default_rng(0).standard_normal((SET_DRAWS, model.p, model.tokens))
        y = np.asarray(model.link(Z), dtype=float)
        flat = np.unique(y.reshape(SET_DRAWS, -1), axis=0)
        _CACHE[key] = flat.reshape((flat.shape[0],) + y.shape[1:])
    return _CACHE[key]


def weights(log_z: np.ndarray) -> np.ndarray:
    """P(y | omega, V) = exp(log_z_out) (K, N); 0 where the output is impossible (log_z = -inf or
    not finite)."""
    with np.errstate(over="ignore", invalid="ignore"):
        w = np.exp(log_z)
    return np.where(np.isfinite(w), w, 0.0)
