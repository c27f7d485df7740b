"""What every denoiser returns (the contract solvers rely on)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ChannelError


@dataclass
class DenoiserOutput:
    g_out: np.ndarray  # (..., p, T)
    dg_out: np.ndarray  # (..., p, T, p, T)
    log_z_out: np.ndarray  # (...)
    ess: np.ndarray  # (...) effective number of quadrature nodes of the final pass
    error: np.ndarray | None = None  # (...) estimated absolute error of g_out/dg_out
    path: str = ""
    polar: np.ndarray | None = None  # (...) True where the polar rule was used (else Gauss-Hermite)


def validate_tol(tol, name: str = "tol"):
    """A denoiser tolerance: None, or a number in (0, 1)."""
    if tol is None:
        return None
    if isinstance(tol, bool) or not (isinstance(tol, float | int) and 0 < tol < 1):
        raise ChannelError(name, f"must be a number in (0, 1) or None, got {tol!r}")
    return float(tol)


def difference(g, dg, g2, dg2, lz, lz2, g_floor=1.0, dg_floor=1.0) -> np.ndarray:
    """Per sample: largest difference of g_out and dg_out, relative to their size (at least
    g_floor, dg_floor: 1, or per sample), and of log Z_out (absolute)."""
    n = len(g)
    gs = np.maximum(g_floor, np.abs(g).reshape(n, -1).max(axis=1))
    ds = np.maximum(dg_floor, np.abs(dg).reshape(n, -1).max(axis=1))
    return np.maximum.reduce([np.abs(g - g2).reshape(n, -1).max(axis=1) / gs,
                              np.abs(dg - dg2).reshape(n, -1).max(axis=1) / ds, np.abs(lz - lz2)])


def raise_on_status(failed: np.ndarray, status: np.ndarray, messages: dict) -> None:
    """One ChannelError for a batch kernel's statuses: the field and message (``messages``:
    status -> (field, message)) of the first sample where ``failed``, and how many failed."""
    bad = np.flatnonzero(failed)
    if bad.size:
        i = int(bad[0])
        fld, msg = messages.get(int(status[i]), ("input", f"failed with status {int(status[i])}"))
        more = f" ({bad.size} samples affected)" if bad.size > 1 else ""
        raise ChannelError(fld, f"sample {i}: {msg}{more}")


def mean_target_met(err, mean_tol) -> bool:
    """Whether a batch's mean error estimate meets a batch target (``mean_tol``, None: no target)."""
    return mean_tol is not None and err is not None and np.size(err) > 0 and bool(np.mean(err) <= mean_tol)


def refine_to_tol(err: np.ndarray, tol, max_refine: int, redo) -> int:
    """The refinement loop of the wedge paths: while samples exceed tol (at most max_refine times)
    ``redo(bad, level)`` recomputes them on a finer rule, stores their values and returns their new
    estimates. Warns with the count still above tol; returns the number of refinements made."""
    level = 0
    while tol is not None and level < max_refine:
        bad = np.flatnonzero(~(err <= tol))
        if not bad.size:
            break
        level += 1
        err[bad] = redo(bad, level)
    if tol is not None and np.any(~(err <= tol)):
        import warnings

        warnings.warn(f"denoiser: {int(np.sum(~(err <= tol)))} of {len(err)} samples did not reach tol={tol:g} "
                      f"(largest estimated error {np.nanmax(err):.1e}; {level} refinements)", RuntimeWarning,
                      stacklevel=3)
    return level
