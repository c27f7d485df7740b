"""Proximal (Moreau) step of the softmax square loss, batched.

    h* = argmin_h ||h - z||^2 / (2 Sigma) + ||Y - softmax_rows(beta H(h))||_F^2

The loss is not convex in h, so we run a safeguarded Newton method from two starts -- the
student field z itself and the interpolating point (z moved, within the learned directions,
onto the logits of Y) -- and keep the lower objective.  Along the softmax-invariant direction
the loss is flat, so h - z is orthogonal to it exactly.
"""

from __future__ import annotations

import numpy as np

from .geometry import flat, isometric_to_vector
from .loss import loss, loss_grad_hess


def interpolating_point(z: np.ndarray, Y: np.ndarray, beta: float) -> np.ndarray:
    """z with its learned part replaced by logits that reproduce Y (where Y > 0).

    Y = softmax_rows(beta H) with H symmetric fixes H up to c 11^T: H_ab = log(Y_ab)/beta + c_a,
    the row constants c_a making it symmetric.
    """
    T = Y.shape[-1]
    lg = np.log(np.clip(Y, 1e-300, None)) / beta
    anti = lg - np.swapaxes(lg, -1, -2)
    c = -anti.mean(axis=-1)  # c_a - c_b = lg_ba - lg_ab for consistent Y
    H = lg + c[..., :, None]
    H = 0.5 * (H + np.swapaxes(H, -1, -2))
    h = isometric_to_vector(H)
    u = flat(T)
    # keep the student's component along the flat direction (the prox does not move it)
    return h + np.outer((z - h) @ u, u)


def _objective(h, z, Y, Sigma, beta):
    return ((h - z) ** 2).sum(-1) / (2 * Sigma) + loss(h, Y, beta)


def _newton(h, z, Y, Sigma, beta, iters, tol):
    """Safeguarded Newton, working only on the points not yet converged."""
    L = h.shape[-1]
    eye = np.eye(L)
    h = h.copy()
    f = _objective(h, z, Y, Sigma, beta)
    idx = np.arange(h.shape[0])
    for _ in range(iters):
        hi, zi, Yi, fi = h[idx], z[idx], Y[idx], f[idx]
        _, g, Hs = loss_grad_hess(hi, Yi, beta)
        g = g + (hi - zi) / Sigma
        Hs = Hs + eye / Sigma
        keep = np.sqrt((g * g).sum(-1)) > tol * (1.0 + np.sqrt((hi * hi).sum(-1)) / Sigma)
        if not keep.any():
            break
        idx, hi, zi, Yi, fi, g, Hs = idx[keep], hi[keep], zi[keep], Yi[keep], fi[keep], g[keep], Hs[keep]
        # Levenberg shift where the Hessian is not positive definite (non-convex loss).
        lam_min = np.linalg.eigvalsh(Hs)[:, 0]
        shift = np.where(lam_min < 1e-3 / Sigma, 1e-3 / Sigma - lam_min, 0.0)
        step = np.linalg.solve(Hs + shift[:, None, None] * eye, g[..., None])[..., 0]
        slope = (g * step).sum(-1)
        t = np.ones(idx.size)
        new_h, new_f = hi.copy(), fi.copy()
        todo = np.arange(idx.size)
        for _ in range(40):  # backtracking (Armijo) on the objective, per point
            trial = hi[todo] - t[todo, None] * step[todo]
            ft = _objective(trial, zi[todo], Yi[todo], Sigma, beta)
            ok = ft <= fi[todo] - 1e-4 * t[todo] * slope[todo]
            new_h[todo[ok]], new_f[todo[ok]] = trial[ok], ft[ok]
            todo = todo[~ok]
            if todo.size == 0:
                break
            t[todo] *= 0.5
        moved = new_f < fi
        h[idx], f[idx] = new_h, new_f
        # points that could not decrease further are at a (numerical) stationary point
        idx = idx[moved]
        if idx.size == 0:
            break
    return h, f


def prox(z: np.ndarray, Y: np.ndarray, Sigma: float, beta: float, *,
         iters: int = 60, tol: float = 1e-10, warm: np.ndarray | None = None) -> np.ndarray:
    """Batched proximal map; z (N, L), Y (N, T, T) -> h (N, L).

    ``warm``: a start close to the answer (e.g. the previous fixed-point iterate's solution);
    when given, only it is used (the caller re-runs the two cold starts periodically)."""
    if not np.isfinite(Sigma) or Sigma <= 0:
        raise ValueError(f"Sigma must be positive and finite, got {Sigma}")
    if warm is not None:
        return _newton(warm, z, Y, Sigma, beta, iters, tol)[0]
    starts = (z.copy(), interpolating_point(z, Y, beta))
    best_h, best_f = None, None
    for h0 in starts:
        h, f = _newton(h0, z, Y, Sigma, beta, iters, tol)
        if best_h is None:
            best_h, best_f = h, f
        else:
            better = f < best_f
            best_h = np.where(better[:, None], h, best_h)
            best_f = np.where(better, f, best_f)
    return best_h
