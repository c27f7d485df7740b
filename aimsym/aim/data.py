"""Teacher-student data of the attention-indexed model: teacher S = W W^T / sqrt(r d) of width
r = rho d, tokens X, index matrices h and labels y (theory section 7), from an explicit seed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import AimsymError
from .channels import entry_weights, make_channel, pairs, to_matrix


@dataclass
class AIMData:
    X: np.ndarray  # (n, d, T)
    y: np.ndarray  # channel output per sample
    S: np.ndarray  # teacher (d, d)
    rho: float  # r / d actually used
    alpha: float
    seed: int | None
    prior: str = "mp"  # "mp": S = W W^T / sqrt(r d); "gaussian": S = sqrt(rho) I + GOE (a check, see run)
    sensing: str = "rank1"  # "rank1": X holds the tokens; "goe": X holds dense (n, L, d, d) GOE matrices


def check_size(d, alpha, rho):
    if int(d) != d or d < 4:
        raise AimsymError("d", f"must be an integer >= 4, got {d}")
    if not np.isfinite(alpha) or alpha <= 0:
        raise AimsymError("alpha", f"must be > 0 for finite-d runs, got {alpha}")
    if not np.isfinite(rho) or rho <= 0:
        raise AimsymError("rho", f"must be > 0, got {rho}")
    n = int(round(alpha * d * d))
    if n * d > 2e8:
        raise AimsymError("d", f"n d = {n * d:.2g} too large for memory (alpha={alpha}, d={d})")
    return int(d), n


def teacher(d, rho, rng):
    r = max(1, int(round(rho * d)))
    W = rng.standard_normal((d, r))
    return W @ W.T / np.sqrt(r * d), r / d


def index_matrices(S, X):
    """H^mu = (X^T S X - Tr S I) / sqrt(d), shape (n, T, T)."""
    d = S.shape[0]
    SX = np.einsum("ij,njt->nit", S, X, optimize=True)
    H = np.einsum("nia,nib->nab", X, SX, optimize=True)
    T = X.shape[2]
    H = H - np.trace(S) * np.eye(T)
    return H / np.sqrt(d)


def generate(d, alpha, rho, tokens=2, activation="softmax", beta=1.0, seed=0, prior="mp",
             sensing="rank1") -> AIMData:
    """AIM data with an explicit numpy Generator seed.

    Two checks beyond the model (docs/aim.md section 4): ``prior="gaussian"`` draws
    S = sqrt(rho) I + GOE (off-diagonal variance 1/d, diagonal 2/d; same mean and Q0 = 1 + rho as the
    model), for which ``run`` uses the exact Gaussian denoiser and the finite-d Bayes estimator is
    known (``gaussian_posterior_mean``); ``sensing="goe"`` replaces the rank-one sensing matrices by
    independent GOE matrices with the same second moments (E<Z_k, M>^2 = w_k Tr M^2 / d), stored
    densely (n, L, d, d): small d only."""
    d, n = check_size(d, alpha, rho)
    if prior not in ("mp", "gaussian"):
        raise AimsymError("prior", f"must be 'mp' or 'gaussian', got {prior!r}")
    if sensing not in ("rank1", "goe"):
        raise AimsymError("sensing", f"must be 'rank1' or 'goe', got {sensing!r}")
    rng = np.random.default_rng(seed)
    ch = make_channel(activation, tokens, beta)
    if prior == "mp":
        S, rho_eff = teacher(d, rho, rng)
    else:
        A = rng.standard_normal((d, d))
        S, rho_eff = np.sqrt(rho) * np.eye(d) + (A + A.T) / np.sqrt(2 * d), float(rho)
    if sensing == "rank1":
        X = rng.standard_normal((n, d, ch.tokens))
    else:
        L = len(pairs(ch.tokens))
        if n * L * d * d > 5e7:
            raise AimsymError("d", f"GOE sensing stores n L d^2 = {n * L * d * d:.2g} numbers (limit 5e7)")
        w = entry_weights(ch.tokens)
        A = rng.standard_normal((n, L, d, d))
        X = (A + A.transpose(0, 1, 3, 2)) * (0.5 * np.sqrt(w / d))[None, :, None, None]
    data = AIMData(X, None, S, rho_eff, alpha, seed, prior, sensing)
    data.y = ch.sample(sensed_index(data, S, ch.tokens))
    return data


def sensed_index(data, M, tokens):
    """Index matrices (n, T, T) of the matrix M for the data's sensing matrices."""
    if data.sensing == "rank1":
        return index_matrices(M, data.X)
    return to_matrix(np.einsum("nkij,ij->nk", data.X, M, optimize=True), tokens)
