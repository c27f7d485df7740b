"""Coordinates of the symmetric T x T pre-activation matrix (theory.md §8).

An L-vector (L = T(T+1)/2, upper-triangle entries a <= b) maps to a symmetric matrix with
the diagonal multiplied by sqrt(2): with this scaling every coordinate of the student's
pre-activation has variance q (Var H_aa = 2q, Var H_ab = q).  Adding c 11^T to H leaves every
softmax row unchanged; in L-coordinates that is the direction ``flat`` below, along which the
loss is constant (so only L - 1 directions are learned: alpha_bar = alpha (L - 1)).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


@lru_cache(maxsize=16)
def pairs(T: int) -> tuple[np.ndarray, np.ndarray]:
    """Upper-triangle index pairs (a, b), a <= b, in numpy's triu order."""
    a, b = np.triu_indices(T)
    return a, b


@lru_cache(maxsize=16)
def embedding(T: int) -> np.ndarray:
    """Matrix M (T*T, L) with vec(H) = M h (row-major vec)."""
    a, b = pairs(T)
    M = np.zeros((T * T, len(a)))
    for k, (i, j) in enumerate(zip(a, b)):
        if i == j:
            M[i * T + i, k] = np.sqrt(2.0)
        else:
            M[i * T + j, k] = 1.0
            M[j * T + i, k] = 1.0
    M.setflags(write=False)
    return M


@lru_cache(maxsize=16)
def flat(T: int) -> np.ndarray:
    """Unit L-vector u with H(u) proportional to the all-ones matrix (softmax-invariant)."""
    a, b = pairs(T)
    u = np.where(a == b, 1.0 / np.sqrt(2.0), 1.0)
    u = u / np.linalg.norm(u)
    u.setflags(write=False)
    return u


@lru_cache(maxsize=16)
def learned_basis(T: int) -> np.ndarray:
    """Orthonormal basis (L, L-1) of the complement of ``flat(T)``."""
    u = flat(T)
    L = u.size
    # Householder-free: QR of [u, I] gives u first, then an orthonormal complement.
    q, _ = np.linalg.qr(np.column_stack([u, np.eye(L)]))
    B = q[:, 1:L]
    B.setflags(write=False)
    return B


def isometric_to_matrix(h: np.ndarray, T: int) -> np.ndarray:
    """(..., L) -> (..., T, T) symmetric, through the isometric embedding: a diagonal entry of the
    matrix is sqrt(2) times its coordinate, so Frobenius norms equal Euclidean ones (unlike
    aimsym.aim.channels.to_matrix, which copies the unique entries as they are)."""
    return (h @ embedding(T).T).reshape(h.shape[:-1] + (T, T))


def isometric_to_vector(H: np.ndarray) -> np.ndarray:
    """(..., T, T) symmetric -> (..., L); inverse of :func:`isometric_to_matrix`."""
    T = H.shape[-1]
    a, b = pairs(T)
    scale = np.where(a == b, 1.0 / np.sqrt(2.0), 1.0)
    return H[..., a, b] * scale


def n_learned(T: int) -> int:
    """L - 1 = (T^2 + T - 2)/2: identifiable entries per sample; alpha_bar = alpha * this."""
    return T * (T + 1) // 2 - 1
