"""Square loss of a softmax-attention output and its derivatives in L-coordinates.

l(h) = ||softmax_rows(beta H(h)) - Y||_F^2 over all T^2 entries.  Gradient and Hessian are
analytic (softmax Jacobian J = diag(p) - p p^T per row); tests check them by finite
differences.  Everything is batched over a leading axis.
"""

from __future__ import annotations

import numpy as np

from ..numerics import softmax_rows
from .geometry import embedding, isometric_to_matrix


def loss(h: np.ndarray, Y: np.ndarray, beta: float) -> np.ndarray:
    """(N, L), (N, T, T) -> (N,)."""
    T = Y.shape[-1]
    P = softmax_rows(beta * isometric_to_matrix(h, T))
    return ((P - Y) ** 2).sum(axis=(-1, -2))


def loss_grad_hess(h: np.ndarray, Y: np.ndarray, beta: float):
    """Loss (N,), gradient (N, L) and Hessian (N, L, L) with respect to h."""
    T = Y.shape[-1]
    M = embedding(T)
    N = h.shape[0]
    P = softmax_rows(beta * isometric_to_matrix(h, T))
    r = P - Y
    value = (r * r).sum(axis=(-1, -2))
    rp = (r * P).sum(axis=-1, keepdims=True)  # (N, T, 1): p . r per row
    G = 2.0 * beta * P * (r - rp)  # dl/dH_ab treating entries as free
    grad = G.reshape(N, T * T) @ M
    # Per-row Hessian in the logits s = beta H_a: 2 [J J + A - (r.p) J].
    eye = np.eye(T)
    J = P[..., :, None] * eye - P[..., :, None] * P[..., None, :]  # (N, T, T, T)
    w = r * P
    A = (
        w[..., :, None] * eye
        - w[..., :, None] * P[..., None, :]
        - P[..., :, None] * w[..., None, :]
        + rp[..., None] * P[..., :, None] * P[..., None, :]
    )
    Hrow = 2.0 * beta**2 * (J @ J + A - rp[..., None] * J)  # (N, T, T, T): row a, (b, c)
    # vec(H) index a*T + b; block-diagonal over rows a.
    Mr = M.reshape(T, T, -1)  # (a, b, k)
    hess = np.einsum("abk,nabc,acl->nkl", Mr, Hrow, Mr, optimize=True)
    return value, grad, hess
