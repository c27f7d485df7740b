"""Teacher-student data for SMI models (theory section 1) and a plain numpy attention network.

Layout. ``X`` has the public shape (n, d, T) (tokens as columns, as in the theory). It is a
view of a token-major array ``X_rows`` of shape (n, T, d), so that the products AMP and GD need
(W X_mu / sqrt(d) for every mu, and sum_mu G_mu X_mu^T) are single BLAS matrix products.

Randomness. Samples are drawn in fixed blocks of ``BLOCK`` samples, each from its own child of
``SeedSequence(seed)``: the data do not depend on the memory budget (``chunk``), block ``b``
can be regenerated alone, and d = 2000, n = 4000, T = 2 (128 MB) is generated without
temporaries larger than one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import AimsymError
from ..derive.spec import AttentionSpec

BLOCK = 256  # samples per independently seeded block


@dataclass
class TeacherStudentData:
    """n samples (X_mu, y_mu) of ``model`` with teacher ``W_star`` (p x d)."""

    X_rows: np.ndarray  # (n, T, d): X_rows[mu, t] is token t of sample mu
    W_star: np.ndarray  # (p, d), entries N(0, 1)
    Z: np.ndarray  # (n, p, T) = W_star X_mu / sqrt(d)
    y: np.ndarray  # (n, *output_shape)
    seed: object = None
    meta: dict = field(default_factory=dict)

    @property
    def X(self) -> np.ndarray:
        """(n, d, T) view of the inputs."""
        return self.X_rows.transpose(0, 2, 1)

    @property
    def n(self) -> int:
        return self.X_rows.shape[0]

    @property
    def d(self) -> int:
        return self.X_rows.shape[2]

    @property
    def alpha(self) -> float:
        return self.n / self.d


def _seed_sequence(seed) -> np.random.SeedSequence:
    if isinstance(seed, np.random.SeedSequence):
        return seed
    if isinstance(seed, np.random.Generator):
        # derive a reproducible child sequence from the generator's state
        return np.random.SeedSequence(seed.integers(0, 2**63, size=4).tolist())
    if seed is None:
        raise AimsymError("seed", "an explicit seed (int, SeedSequence or numpy Generator) is required")
    return np.random.SeedSequence(seed)


def check_size(d, n=None, alpha=None) -> tuple[int, int]:
    """Validate (d, n or alpha) -> (d, n)."""
    if not (isinstance(d, int | np.integer) and d >= 1):
        raise AimsymError("d", f"must be a positive integer, got {d!r}")
    if n is None:
        if alpha is None or not (np.isfinite(alpha) and alpha > 0):
            raise AimsymError("alpha", f"must be a positive number, got {alpha!r}")
        n = int(round(alpha * d))
    if not (isinstance(n, int | np.integer) and n >= 1):
        raise AimsymError("n", f"must be a positive integer (n = alpha d), got {n!r}")
    return int(d), int(n)


def teacher_student(model, d: int, *, alpha: float | None = None, n: int | None = None, seed=None,
                    W_star: np.ndarray | None = None, chunk: int = 4096) -> TeacherStudentData:
    """Draw X (i.i.d. N(0, 1)), the teacher W* (unless given), Z = W* X / sqrt(d), y = g(Z) (+ noise).

    ``seed``: int, SeedSequence or Generator (required). ``chunk``: samples processed at a time.
    """
    d, n = check_size(d, n, alpha)
    p, T = model.p, model.tokens
    ss = _seed_sequence(seed)
    s_teacher, s_blocks = ss.spawn(2)
    if W_star is None:
        W_star = np.random.default_rng(s_teacher).standard_normal((p, d))
    W_star = np.asarray(W_star, dtype=float)
    if W_star.shape != (p, d):
        raise AimsymError("W_star", f"expected shape ({p}, {d}), got {W_star.shape}")
    n_blocks = -(-n // BLOCK)
    block_seeds = s_blocks.spawn(n_blocks)
    X_rows = np.empty((n, T, d))
    Z = np.empty((n, p, T))
    y = np.empty((n, *model.output_shape))
    noise = model.noise
    per_chunk = max(1, int(chunk) // BLOCK)
    for b0 in range(0, n_blocks, per_chunk):
        lo = b0 * BLOCK
        hi = min(n, (b0 + per_chunk) * BLOCK)
        for b in range(b0, min(n_blocks, b0 + per_chunk)):
            rng = np.random.default_rng(block_seeds[b])
            s, e = b * BLOCK, min(n, (b + 1) * BLOCK)
            X_rows[s:e] = rng.standard_normal((e - s, T, d))
            y_noise = rng.standard_normal((e - s, *model.output_shape)) if noise > 0 else None
            if y_noise is not None:
                y[s:e] = np.sqrt(noise) * y_noise
        Z[lo:hi] = indices(W_star, X_rows[lo:hi])
        clean = model.link(Z[lo:hi])
        y[lo:hi] = clean + y[lo:hi] if noise > 0 else clean
    meta = {"d": d, "n": n, "alpha": n / d, "p": p, "T": T, "noise": noise, "block": BLOCK,
            "seed_entropy": str(ss.entropy), "seed_spawn_key": list(ss.spawn_key)}
    return TeacherStudentData(X_rows=X_rows, W_star=W_star, Z=Z, y=y, seed=seed, meta=meta)


def indices(W: np.ndarray, X_rows: np.ndarray) -> np.ndarray:
    """Z_mu = W X_mu / sqrt(d) for every mu: (p, d), (n, T, d) -> (n, p, T).

    einsum, not BLAS: with p = 1..4 the product is memory-bound, and multithreaded OpenBLAS on
    such thin products was 5-30x slower than einsum's single loop on the 2-core test machine.
    """
    return np.einsum("ntd,kd->nkt", X_rows, W / np.sqrt(X_rows.shape[2]))


def back_project(G: np.ndarray, X_rows: np.ndarray) -> np.ndarray:
    """(1 / sqrt(d)) sum_mu G_mu X_mu^T: (n, p, T), (n, T, d) -> (p, d) (einsum, see ``indices``)."""
    return np.einsum("nkt,ntd->kd", G, X_rows) / np.sqrt(X_rows.shape[2])


# ----------------------------------------------------------------------------- attention network


def _value(v, params: dict) -> float:
    if isinstance(v, str):
        if v not in params:
            raise AimsymError(v, "symbolic parameter needs a value")
        return float(params[v])
    return float(v)


def _activate(name: str, A: np.ndarray) -> np.ndarray:
    if name == "softmax":
        A = A - A.max(axis=-1, keepdims=True)
        E = np.exp(A)
        return E / E.sum(axis=-1, keepdims=True)
    if name == "hardmax":
        return (A == A.max(axis=-1, keepdims=True)).astype(float)
    if name == "linear":
        return A
    raise AimsymError("activation", f"unknown activation {name!r}")


def layer_rows(model) -> list[list[tuple[int, list[int], list[int]]]]:
    """For each layer, for each head: (head, query rows, key rows) of Z / W (0-based)."""
    labels = model.labels
    out = []
    for l, layer in enumerate(model.spec.layers, start=1):
        heads = []
        for h in range(layer.heads):
            q = [k for k, lb in enumerate(labels) if lb.layer == l and lb.head == h and lb.role in ("w", "q")]
            kk = q if layer.tied else [k for k, lb in enumerate(labels)
                                       if lb.layer == l and lb.head == h and lb.role == "k"]
            heads.append((h, q, kk))
        out.append(heads)
    return out


def attention_network(model, W: np.ndarray, X_rows: np.ndarray) -> np.ndarray:
    """Plain forward pass of the attention network on the tokens themselves (theory section 2).

    x^(l) = x^(l-1) (c_l I + S_l)^T with S_l = sigma(beta x^(l-1)^T W_l W_l^T x^(l-1) / d) (tied;
    queries/keys for untied; heads mixed by their readout weights). Works in the d-dimensional
    token space, independently of the SMI link. Returns S_L (output "attention", (n, T, T)) or
    x^(L) token-major (output "tokens", (n, T, d)).
    """
    spec = model.spec
    if not isinstance(spec, AttentionSpec):
        raise AimsymError("model", "attention_network needs an attention model")
    if spec.head_mode != "mean":
        raise AimsymError("head_mode", "the numpy forward pass supports head_mode = 'mean' only")
    params = model.parameters
    n, T, d = X_rows.shape
    x = X_rows  # (n, T, d) token-major: row a is token a
    S_total = None
    for layer, heads in zip(spec.layers, layer_rows(model)):
        beta = _value(layer.beta, params)
        S_total = np.zeros((n, T, T))
        for (h, q_rows, k_rows), a in zip(heads, layer.head_weights()):
            q = x @ W[q_rows].T / np.sqrt(d)  # (n, T, r)
            k = x @ W[k_rows].T / np.sqrt(d)
            S_total += _value(a, params) * _activate(layer.activation, beta * q @ k.transpose(0, 2, 1))
        x = _value(layer.skip, params) * x + S_total @ x  # token a <- c x_a + sum_b S[a, b] x_b
    return S_total if spec.output == "attention" else x
