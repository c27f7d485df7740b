"""Row activations of a SymPy matrix (softmax, hardmax), shared by the link parser and the
attention derivation so that a declared link and an attention layer use the very same formula."""

from __future__ import annotations

import sympy as sp


def softmax_rows(A: sp.Matrix) -> sp.Matrix:
    """Row softmax written as 1 / sum_c exp(a_c - a_b): no overflow in the numerator."""
    n, m = A.shape
    return sp.Matrix(n, m, lambda a, b: 1 / sp.Add(*[sp.exp(A[a, c] - A[a, b]) if c != b else 1 for c in range(m)]))


def hardmax_rows(A: sp.Matrix) -> sp.Matrix:
    """Row argmax indicator (ties have probability zero under Gaussian indices)."""
    n, m = A.shape
    H = lambda x: sp.Heaviside(x, sp.Rational(1, 2))  # noqa: E731
    return sp.Matrix(n, m, lambda a, b: sp.Mul(*[H(A[a, b] - A[a, c]) for c in range(m) if c != b]))


def activate(name: str, A: sp.Matrix) -> sp.Matrix:
    if name == "softmax":
        return softmax_rows(A)
    if name == "hardmax":
        return hardmax_rows(A)
    return A
