"""AIM data at finite d, and matrix GAMP with the RIE denoiser (GAMP-RIE).

Data: W in R^{d x r} Gaussian, S = W W^T / sqrt(r d); n = round(alpha d^2) sequences X^mu in
R^{d x T} (tokens as columns, N(0,1) entries); H^mu = (X^T S X - Tr S I) / sqrt(d); y = sigma(beta H).

The unique entries h_ab = <X_ab, S> (Frobenius) with X_ab = (x_a x_b^T + x_b x_a^T)/(2 sqrt d) for
a < b and X_aa = (x_a x_a^T - I)/sqrt d: a GLM on the symmetric matrix S. GAMP (isotropic
variances, theory.md section 6 specialised to a rotation-invariant prior):

    omega_k = <X_k, S_hat> - w_k V g_k^prev                   (Onsager; w = 2 diag, 1 off)
    g, dg   = channel.denoise(y, omega, V)
    A       = -(1/d) sum_mu sum_k w_k dg_k                      (precision, per d/2 entries)
    R       = S_hat + (1/A) sum_mu sum_k g_k X_k                (effective observation)
    Delta   = d / (2 A)                                         (its semicircle variance)
    S_hat   = RIE(R; rho, Delta) (eigenvalues mapped by f),  V = m(Delta)

Tracked per iteration: the true error ||S_hat - S||_F^2 / d and the predicted V = m(Delta).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..errors import AimsymError
from ..provenance import provenance
from .channels import entry_weights, make_channel, pairs, to_vector
from .spectral import prior_second_moment, rie_map, rie_mmse


@dataclass
class AIMData:
    X: np.ndarray  # (n, d, T)
    y: np.ndarray  # channel output per sample
    S: np.ndarray  # teacher (d, d)
    rho: float  # r / d actually used
    alpha: float
    seed: int | None


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


def generate(d, alpha, rho, tokens=2, activation="softmax", beta=1.0, seed=0) -> AIMData:
    """AIM data with an explicit numpy Generator seed."""
    d, n = check_size(d, alpha, rho)
    rng = np.random.default_rng(seed)
    ch = make_channel(activation, tokens, beta)
    S, rho_eff = teacher(d, rho, rng)
    X = rng.standard_normal((n, d, ch.tokens))
    y = ch.sample(index_matrices(S, X))
    return AIMData(X, y, S, rho_eff, alpha, seed)


def adjoint(X, G_vec, tokens):
    """sum_mu sum_k G_k X_k (d x d): (1/sqrt d) [sum_mu X G X^T - (sum diag G) I], with the
    off-diagonal weights halved (X_ab contains both x_a x_b^T and x_b x_a^T)."""
    d = X.shape[1]
    G = np.zeros(G_vec.shape[:-1] + (tokens, tokens))
    for k, (a, b) in enumerate(pairs(tokens)):
        if a == b:
            G[..., a, a] = G_vec[..., k]
        else:
            G[..., a, b] = G[..., b, a] = 0.5 * G_vec[..., k]
    XG = np.einsum("nia,nab->nib", X, G, optimize=True)
    M = np.einsum("nia,nja->ij", XG, X, optimize=True)
    diag_sum = sum(G_vec[..., k].sum() for k, (a, b) in enumerate(pairs(tokens)) if a == b)
    M = M - diag_sum * np.eye(d)
    return (M + M.T) / (2.0 * np.sqrt(d))


def rie_denoise(R, rho, Delta, with_variance=False):
    """RIE of R = S + sqrt(Delta) GOE. With ``with_variance`` also returns the variance implied by
    the exact divergence of the matrix map (eigenvalue and eigenvector terms):
    div = sum_i f'(lam_i) + sum_{i<j} (f_i - f_j)/(lam_i - lam_j),  V = 2 Delta div / d^2."""
    lam, O = np.linalg.eigh(R)
    d = len(lam)
    fmap = lambda x: rie_map(x, rho, Delta)  # noqa: E731
    f = fmap(lam)
    S_hat = (O * f) @ O.T
    if not with_variance:
        return S_hat
    eps = 1e-6 * (1.0 + np.abs(lam))
    fprime = (fmap(lam + eps) - fmap(lam - eps)) / (2 * eps)
    dl = lam[:, None] - lam[None, :]
    df = f[:, None] - f[None, :]
    iu = np.triu_indices(d, 1)
    close = np.abs(dl[iu]) < 1e-10
    ratio = np.where(close, 0.5 * (fprime[iu[0]] + fprime[iu[1]]), df[iu] / np.where(close, 1.0, dl[iu]))
    div = fprime.sum() + ratio.sum()
    return S_hat, 2.0 * Delta * div / d**2


def run(data: AIMData, tokens=2, activation="softmax", beta=1.0, *, iterations=80, damping=0.5,
        tol=1e-7, rho=None, variance="divergence", max_damping=0.95, noise_ratio_max=2.5):
    """GAMP-RIE on ``data``. Returns a dict with the per-iteration history and final errors.

    Damping mixes S_hat and V with their previous values. Safeguard (finite d): the noise power
    of R, measured as Tr(R^2)/d - E Tr(S^2)/d with E Tr(S^2)/d = 1 + rho + 1/d, should match
    Delta = d/(2A) up to O(1/d); rank-one sensing (x x^T) lets low-rank error modes grow at
    finite d, so when the measured power exceeds ``noise_ratio_max`` Delta the step is rejected,
    the last accepted state restored and the damping raised (1 - damping halves).
    ``variance``: "divergence" (exact divergence of the RIE map) or "theory" (V = m(Delta)).
    """
    if not 0.0 <= damping < 1.0:
        raise AimsymError("damping", f"must lie in [0, 1), got {damping}")
    ch = make_channel(activation, tokens, beta)
    T = ch.tokens
    rho = data.rho if rho is None else float(rho)
    X, y, S = data.X, data.y, data.S
    d = S.shape[0]
    w = entry_weights(T)
    Q0 = prior_second_moment(rho)
    S_hat = np.sqrt(rho) * np.eye(d)
    V = Q0 - rho  # = m(inf) = 1
    g_prev = np.zeros((X.shape[0], len(w)))
    last_iteration = None
    unstable = False
    last = None  # (S_before, V_before, g_before, S_proposed, V_proposed, g) of the last accepted step
    history, rejected = [], 0
    t0 = time.perf_counter()
    it = 0
    while it < iterations:
        it += 1
        omega = to_vector(index_matrices(S_hat, X), T) - w * V * g_prev
        g, dg = ch.denoise(y, omega, V)
        A = -np.sum(dg * w) / d if np.all(np.isfinite(dg)) else np.nan
        ok = np.isfinite(A) and A > 0 and np.all(np.isfinite(g))
        if ok:
            R = S_hat + adjoint(X, g, T) / A
            Delta = d / (2.0 * A)
            power = float(np.sum(R * R) / d) - (Q0 + 1.0 / d)
            # the first steps from the prior mean overshoot transiently (ratio up to ~2)
            ok = np.isfinite(power) and (power <= noise_ratio_max * Delta or it <= 3)
        if not ok:
            # the last step let an unstable mode grow: redo it with more damping
            if last is None:
                raise AimsymError("damping", f"AMP unstable at its first iteration (alpha={data.alpha})")
            if damping >= max_damping:
                # give up: return the last accepted estimate, flagged as not converged
                S_hat, V, g_prev = last[0], last[1], last[2]
                unstable = True
                break
            damping = 1.0 - 0.5 * (1.0 - damping)
            S_b, V_b, g_b, S_p, V_p, g_p = last
            S_hat = (1.0 - damping) * S_p + damping * S_b
            V = (1.0 - damping) * V_p + damping * V_b
            g_prev = g_p
            rejected += 1
            if history and history[-1]["iteration"] == last_iteration:
                history.pop()  # that step is being redone
            continue
        if variance == "divergence":
            S_new, V_new = rie_denoise(R, rho, Delta, with_variance=True)
        else:
            S_new, V_new = rie_denoise(R, rho, Delta), rie_mmse(Delta, rho)
        last = (S_hat, V, g_prev, S_new, V_new, g)
        last_iteration = it
        V_old = V
        S_hat = (1.0 - damping) * S_new + damping * S_hat
        V = (1.0 - damping) * V_new + damping * V
        g_prev = g
        err = float(np.sum((S_hat - S) ** 2) / d)
        history.append({"iteration": it, "mmse": err, "V": V, "Delta": Delta,
                        "noise_ratio": power / Delta, "damping": damping})
        if V < 1e-10 or abs(V - V_old) < tol * max(V, 1e-12):
            break
    elapsed = time.perf_counter() - t0
    return {
        "mmse": float(np.sum((S_hat - S) ** 2) / d),
        "V": float(V),
        "iterations": len(history),
        "rejected_steps": rejected,
        "unstable": unstable,
        "final_damping": damping,
        "seconds_per_iteration": elapsed / max(1, len(history) + rejected),
        "history": history,
        "S_hat": S_hat,
    }


def run_many(alpha, rho, d, tokens=2, activation="softmax", beta=1.0, seeds=(0,), iterations=80,
             damping=0.5):
    """AMP over several seeds; mean and standard error of the final mmse, with the SE value."""
    from . import se

    errs, secs, rho_eff = [], [], rho
    for seed in seeds:
        data = generate(d, alpha, rho, tokens, activation, beta, seed=seed)
        rho_eff = data.rho
        out = run(data, tokens, activation, beta, iterations=iterations, damping=damping)
        errs.append(out["mmse"])
        secs.append(out["seconds_per_iteration"])
    errs = np.array(errs)
    sem = float(errs.std(ddof=1) / np.sqrt(len(errs))) if len(errs) > 1 else None
    se_res = se.solve(alpha, rho_eff, tokens, activation, beta)
    return {
        "alpha": float(alpha), "rho": float(rho_eff), "d": int(d), "tokens": int(tokens),
        "activation": activation, "beta": float(beta),
        "mmse": float(errs.mean()), "mmse_sem": sem, "mmse_runs": errs.tolist(),
        "mmse_se": se_res.mmse, "seconds_per_iteration": float(np.mean(secs)),
        "provenance": provenance(seed=list(seeds), accuracy={"iterations": iterations, "damping": damping}),
    }


def to_matrix_from_vector(y, tokens):
    """Linear-channel labels (unique entries) -> symmetric T x T matrices."""
    from .channels import to_matrix

    return to_matrix(np.asarray(y), tokens)
