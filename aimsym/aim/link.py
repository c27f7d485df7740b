r"""The AIM output link y = sigma(beta h) through the symbolic pipeline, and the counting
constants derived from its generated Jacobian (theory.md section 7).

The link as an aimsym model
---------------------------
The index matrix h is symmetric, so its T(T+1)/2 unique entries, ordered like
:func:`aimsym.aim.channels.pairs` ([(a, b) for a <= b]), are the p = L indices of a one-token
SMI model, z[k, 0] = h_{pairs[k]}. :func:`aim_link_spec` declares it as an
:class:`~aimsym.derive.spec.SMISpec` whose matrix link is the logit matrix ``beta * z[k(a, b), 0]``
passed along its rows through ``activation`` -- the spec's row activation is applied by
:func:`aimsym.derive.symbolic.activate`, i.e. by the very ``softmax_rows`` / ``hardmax_rows`` that
attention layers use. beta stays a symbolic parameter, so one generated module per
(T, activation) serves every beta. The rest is the ordinary pipeline: SymPy derivation
(link, forward-mode Jacobian), code generation into the cache directory
(``$AIMSYM_CACHE/<spec hash>/``, ``njit(cache=True)``), batch kernels with ``prange``.

* softmax: y = softmax_rows(beta h) (written 1 / sum_c exp(beta (h_ac - h_ab)), no overflow);
* hardmax: y = hardmax_rows(beta h) = hardmax_rows(h) for beta > 0 (row argmax indicator);
* linear:  y = beta h.

Counting constants from the link
--------------------------------
Channel law (aimsym.aim.channels): given the estimate omega, the unique entries are
independent, h_k ~ N(omega_k, w_k V) with w_k = 2 on the diagonal (a = b) and 1 off it. Write
xi = h - omega ~ N(0, D), D = V W, W = diag(w), and let J(h) = dy / dh_unique (T^2 x L).

Assume (and check numerically, see below) that the null space N of J is the same at every h
and that y is exactly constant along it, so the level set {h' : y(h') = y(h)} is the affine
space h + N. Then y reveals h up to N, and the posterior of h given (y, omega) is the prior
N(omega, D) restricted to h + N, a Gaussian on that affine space. Its mean minimises
(h' - omega)^T D^{-1} (h' - omega) over h' = h + N c:

    E[h | y] - omega = P xi,     P = I - N (N^T W^{-1} N)^{-1} N^T W^{-1}

(V cancels): P projects onto the identifiable directions (the row space of J, transported by W)
along N, and it is self-adjoint for the metric W^{-1}. The score is
g = D^{-1}(E[h | y] - omega) = W^{-1} P xi / V, hence

    I = 2 E[ sum_{a<b} g_ab^2 + 2 sum_a g_aa^2 ] = 2 E[g^T W g]
      = 2 E[xi^T P^T W^{-1} P xi] / V^2 = 2 tr(P^T W^{-1} P D) / V^2
      = 2 tr(P^T W^{-1} P W) / V  =:  c / V.

The information constant c = 2 tr(P^T W^{-1} P W) is the W-weighted trace of the projector:
independent of omega, q and V, and of beta as long as N is. Since P^T W^{-1} = W^{-1} P and
P^2 = P it also equals 2 tr P = 2 rank J -- twice the number of directions y reveals. For the
softmax N = span(1) (the global shift h + c 1 1^T moves every unique entry by c), rank L - 1,
c = 2L - 2 = T^2 + T - 2; for the linear link nothing is lost, c = 2L = T^2 + T. The code below
evaluates the weighted trace from the numerical null space; the closed forms appear only in
the tests, as the check.

Numerical rank. J is evaluated by the generated kernel at ``points`` random h drawn from the
channel law (V = 1, seeded). Each nonzero row of J is divided by its norm first (a left
multiplication by an invertible diagonal matrix: same row and null space) because at large beta a
nearly one-hot softmax row has derivatives ~ y_ab, many orders below the others, yet reveals the
same directions. The rank is the number of singular values above ``rtol`` (default 1e-8) times the
largest; it must be the same at every point and for all points stacked (one common identifiable
subspace), and y must stay unchanged (to 1e-9) when h moves by O(1) along N. A link failing these
checks (hardmax: J = 0 almost everywhere, rank 0) has no counting constant and is refused with an
error naming ``activation``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ..errors import AimsymError
from .channels import entry_weights, pairs

ACTIVATIONS = ("softmax", "linear", "hardmax")
# an SMI model has at most 16 indices: T (T + 1) / 2 <= 16
MAX_TOKENS = 5


def _check_tokens(tokens) -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, int | np.integer):
        raise AimsymError("tokens", f"must be an integer in 2..{MAX_TOKENS}, got {tokens!r}")
    if not 2 <= int(tokens) <= MAX_TOKENS:
        raise AimsymError("tokens", f"must be an integer in 2..{MAX_TOKENS} (the link has T(T+1)/2 <= 16 "
                                    f"indices), got {tokens!r}")
    return int(tokens)


def _check_activation(activation) -> str:
    if activation not in ACTIVATIONS:
        raise AimsymError("activation", f"must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    return activation


def _check_beta(beta) -> float:
    try:
        b = float(beta)
    except (TypeError, ValueError):
        raise AimsymError("beta", f"must be a finite number > 0, got {beta!r}") from None
    if isinstance(beta, bool) or not math.isfinite(b) or b <= 0:
        raise AimsymError("beta", f"must be a finite number > 0, got {beta!r}")
    return b


def unique_index(tokens: int) -> np.ndarray:
    """(T, T) integer matrix: position of h_ab (= h_ba) among the unique entries ``pairs(T)``."""
    T = _check_tokens(tokens)
    K = np.empty((T, T), dtype=int)
    for k, (a, b) in enumerate(pairs(T)):
        K[a, b] = K[b, a] = k
    return K


@functools.lru_cache(maxsize=32)
def aim_link_spec(tokens: int, activation: str):
    """The SMISpec of the AIM link: L = T(T+1)/2 indices (the unique entries of h), one token,
    link ``activation`` along the rows of the logit matrix ``beta * h`` (beta symbolic)."""
    from ..derive.spec import make_smi

    T = _check_tokens(tokens)
    act = _check_activation(activation)
    K = unique_index(T)
    logits = [[f"beta * z[{K[a, b]}, 0]" for b in range(T)] for a in range(T)]
    return make_smi(
        indices=len(pairs(T)),
        tokens=1,
        link=logits,
        parameters=("beta",),
        activation=act,
        name=f"aim_{act}_T{T}",
        description=f"AIM output link y = {act}_rows(beta h), h symmetric {T}x{T}; indices: the unique "
                    "entries h_ab, a <= b, row-major",
    )


@functools.lru_cache(maxsize=32)
def _model(tokens: int, activation: str):
    from ..model import Model

    return Model(aim_link_spec(tokens, activation))


class AimLink:
    """y = sigma(beta h) on the unique entries of h, by the generated numba kernels."""

    def __init__(self, tokens: int, activation: str, beta: float = 1.0):
        self.tokens = _check_tokens(tokens)
        self.activation = _check_activation(activation)
        self.beta = _check_beta(beta)
        self.n_unique = len(pairs(self.tokens))
        self.spec = aim_link_spec(self.tokens, self.activation)
        self._params = np.array([self.beta])

    @property
    def kernels(self):
        """The generated module (link, link_jacobian, link_batch, link_jacobian_batch, ...)."""
        return _model(self.tokens, self.activation).kernels

    def _flat(self, h_unique) -> tuple[tuple[int, ...], np.ndarray]:
        try:
            h = np.asarray(h_unique, dtype=float)
        except (TypeError, ValueError):
            raise AimsymError("h_unique", "must be an array of numbers") from None
        if h.ndim == 0 or h.shape[-1] != self.n_unique:
            raise AimsymError("h_unique", f"expected shape (..., {self.n_unique}) (the unique entries a <= b of "
                                          f"the {self.tokens}x{self.tokens} index matrix), got {h.shape}")
        if not np.all(np.isfinite(h)):
            raise AimsymError("h_unique", "entries must be finite")
        return h.shape[:-1], np.ascontiguousarray(h.reshape(-1, self.n_unique, 1))

    def link(self, h_unique) -> np.ndarray:
        """y of shape (..., T, T) for h_unique of shape (..., L)."""
        batch, Z = self._flat(h_unique)
        T = self.tokens
        out = np.empty((Z.shape[0], T, T))
        self.kernels.link_batch(Z, self._params, out)
        return out.reshape(*batch, T, T)

    def jacobian(self, h_unique) -> np.ndarray:
        """dy_ab / dh_k of shape (..., T, T, L) for h_unique of shape (..., L)."""
        batch, Z = self._flat(h_unique)
        T, L = self.tokens, self.n_unique
        out = np.zeros((Z.shape[0], T, T, L, 1))
        self.kernels.link_jacobian_batch(Z, self._params, out)
        return out.reshape(*batch, T, T, L)

    def __repr__(self) -> str:
        return f"AimLink(tokens={self.tokens}, activation={self.activation!r}, beta={self.beta})"


def aim_link(tokens: int, activation: str, beta: float = 1.0) -> AimLink:
    """The AIM link y = sigma(beta h) (sigma = row softmax, row hardmax or identity) with
    ``link(h_unique) -> (..., T, T)`` and ``jacobian(h_unique) -> (..., T, T, L)``."""
    return AimLink(tokens, activation, beta)


@dataclass(frozen=True)
class IdentifiableSubspace:
    """What y reveals about h: the numerical null space of the link Jacobian and the constant."""

    tokens: int
    activation: str
    beta: float
    constant: float  # c = 2 tr(P^T W^{-1} P W), I = c / V
    rank: int  # rank of J (identifiable directions)
    null_space: np.ndarray  # (L, L - rank) orthonormal basis of N
    projector: np.ndarray  # (L, L) P = I - N (N^T W^{-1} N)^{-1} N^T W^{-1}
    singular_values: np.ndarray  # of the stacked, row-equilibrated Jacobian, descending, / max
    rtol: float
    points: int


def identifiable_subspace(tokens: int, activation: str, beta: float = 1.0, *, points: int = 6,
                          seed: int = 0, rtol: float = 1e-8) -> IdentifiableSubspace:
    """Null space N of dy/dh_unique (the directions y does not reveal) from the generated
    Jacobian at ``points`` random h, the projector P and c = 2 tr(P^T W^{-1} P W) (module
    docstring). Raises AimsymError naming ``activation`` when the link has no counting
    constant (no common null space, y not constant along it, or nothing revealed)."""
    lk = aim_link(tokens, activation, beta)
    if isinstance(points, bool) or not isinstance(points, int) or points < 1:
        raise AimsymError("points", f"must be an integer >= 1, got {points!r}")
    if not (isinstance(rtol, float | int) and 0 < rtol < 1e-2):
        raise AimsymError("rtol", f"must be a number in (0, 1e-2), got {rtol!r}")
    T, L = lk.tokens, lk.n_unique
    w = entry_weights(T)
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((points, L)) * np.sqrt(w)  # the channel law at omega = 0, V = 1
    J = lk.jacobian(h).reshape(points, T * T, L)

    def equilibrate(rows):
        norms = np.linalg.norm(rows, axis=-1)
        keep = norms > 0
        return rows[keep] / norms[keep, None]

    def rank_of(rows):
        if rows.shape[0] == 0:
            return 0, np.zeros(0), np.zeros((0, L))
        _, s, vt = np.linalg.svd(rows)
        return int(np.sum(s > rtol * s[0])), s / s[0], vt

    ranks = [rank_of(equilibrate(Jp))[0] for Jp in J]
    r, s, vt = rank_of(equilibrate(J.reshape(-1, L)))
    if r == 0:
        raise AimsymError("activation", f"{lk.activation!r}: the link Jacobian vanishes (rank 0 at {points} random h): "
                                        "y is piecewise constant and reveals h only through discrete patterns; "
                                        "no counting constant (use the orthant channels of aimsym.aim.channels)")
    if any(rk != r for rk in ranks):
        raise AimsymError("activation", f"{lk.activation!r}: the Jacobian rank varies with h ({sorted(set(ranks))}, "
                                        f"{r} for all points together): no common identifiable subspace")
    # full right-singular basis: rows r.. of vt span the common null space
    if vt.shape[0] < L:
        vt = np.linalg.svd(np.vstack([vt, np.zeros((L - vt.shape[0], L))]))[2]
    N = vt[r:].T  # (L, L - r)
    if N.shape[1]:
        step = N @ rng.standard_normal((N.shape[1], points))
        y0, y1 = lk.link(h), lk.link(h + step.T)
        scale = 1.0 + np.max(np.abs(y0))
        if np.max(np.abs(y1 - y0)) > 1e-9 * scale:
            raise AimsymError("activation", f"{lk.activation!r}: y changes along the Jacobian null space "
                                            "(its level sets are not affine): no counting constant")
    Winv = np.diag(1.0 / w)
    P = np.eye(L)
    if N.shape[1]:
        P = P - N @ np.linalg.solve(N.T @ Winv @ N, N.T @ Winv)
    c = 2.0 * np.trace(P.T @ Winv @ P @ np.diag(w))
    return IdentifiableSubspace(tokens=T, activation=lk.activation, beta=lk.beta, constant=float(c), rank=r,
                                null_space=N, projector=P, singular_values=s, rtol=float(rtol), points=points)


def counting_constant_from_link(tokens: int, activation: str, beta: float = 1.0, **kwargs) -> float:
    """c with I = c / V (q_hat = c alpha / (Q0 - q)), derived from the generated link Jacobian:
    c = 2 tr(P^T W^{-1} P W), P the projector onto what y reveals (module docstring).
    Keywords go to :func:`identifiable_subspace` (points, seed, rtol)."""
    return identifiable_subspace(tokens, activation, beta, **kwargs).constant
