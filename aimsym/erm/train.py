"""Finite-size ERM: Adam on the square loss of a single tied attention layer (theory.md §8).

Data: tokens X (n, T, d) with N(0, 1) entries, teacher S* = W* W*^T / sqrt(r* d), r* = kappa0 d,
labels Y = softmax_rows(beta0 (H* + sqrt(Delta) Xi)) (Var Xi_aa = 1, Var Xi_ab = 1/2).
Students:
- factorised: W (d, r), r = kappa d, S = W W^T / sqrt(r d); objective
  sum_mu l_mu + (lam / sqrt(kappa)) ||W||_F^2  (= lam d Tr S, the PSD nuclear norm);
- direct: symmetric S trained element-wise; objective sum_mu l_mu + lam d ||S||_F^2 (ridge).
Output 'label': l = ||softmax(beta H) - Y||_F^2; 'sequence': l = ||(softmax(beta H) - Y) X||_F^2 / d.

Full-batch Adam with analytic gradients.  Stopping rule: the learning rate is halved whenever
the objective has not improved by a relative 1e-6 for ``patience`` steps; training stops when
the rate falls below lr * 1e-3, when the relative gradient norm is below ``gtol``, or after
``max_steps``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..errors import AimsymError
from ..blas import limit_blas_threads
from ..numerics import softmax_rows
from .params import ERMParams


@dataclass(frozen=True)
class Data:
    X: np.ndarray       # (n, T, d)
    Y: np.ndarray       # (n, T, T) noisy labels
    Yclean: np.ndarray  # (n, T, T) noise-free teacher outputs


def teacher(d: int, kappa0: float, rng: np.random.Generator) -> np.ndarray:
    r = max(1, int(round(kappa0 * d)))
    W = rng.standard_normal((d, r))
    return W @ W.T / np.sqrt(r * d)


def preactivation(X: np.ndarray, S: np.ndarray) -> np.ndarray:
    """H = (X S X^T - Tr(S) I) / sqrt(d), batched."""
    d = X.shape[-1]
    T = X.shape[-2]
    H = np.einsum("nad,de,nbe->nab", X, S, X, optimize=True)
    return (H - np.trace(S) * np.eye(T)) / np.sqrt(d)


def sample(params: ERMParams, S_star: np.ndarray, n: int, rng: np.random.Generator) -> Data:
    d, T = S_star.shape[0], params.tokens
    X = rng.standard_normal((n, T, d))
    Hs = preactivation(X, S_star)
    G = rng.standard_normal((n, T, T))
    Xi = (G + np.swapaxes(G, -1, -2)) / 2.0  # off-diagonal variance 1/2, diagonal 1
    Y = softmax_rows(params.beta0 * (Hs + np.sqrt(params.Delta) * Xi))
    return Data(X, Y, softmax_rows(params.beta0 * Hs))


def _loss_and_dH(P, Y, X, beta, output):
    """Per-sample loss and dl/dH (n, T, T) for softmax outputs P = softmax(beta H)."""
    R = P - Y
    if output == "sequence":
        K = np.einsum("nad,nbd->nab", X, X) / X.shape[-1]
        RK = R @ K
        val = np.einsum("nab,nab->n", RK, R)
        g = 2.0 * RK
    else:
        val = (R * R).sum((-1, -2))
        g = 2.0 * R
    G = beta * P * (g - (P * g).sum(-1, keepdims=True))
    return val, G


def _dS(X, G):
    """d/dS of sum_mu <G_mu, H_mu(S)> = sum (X^T G_sym X - Tr(G) I) / sqrt(d)."""
    d = X.shape[-1]
    Gs = 0.5 * (G + np.swapaxes(G, -1, -2))
    n, T, _ = X.shape
    Z = np.einsum("nab,nbd->nad", Gs, X).reshape(n * T, d)
    A = X.reshape(n * T, d).T @ Z
    A = 0.5 * (A + A.T)
    A[np.diag_indices(d)] -= np.trace(Gs, axis1=-2, axis2=-1).sum()
    return A / np.sqrt(d)


def objective_and_grad(theta, params: ERMParams, data: Data, r: int | None = None):
    """Objective (sum of losses + penalty) and its gradient for W (factorised) or S (direct)."""
    X, d = data.X, data.X.shape[-1]
    if params.model == "factorised":
        W = theta
        c = np.sqrt(r * d)
        S = W @ W.T / c
    else:
        S = theta
    P = softmax_rows(params.beta * preactivation(X, S))
    val, G = _loss_and_dH(P, data.Y, X, params.beta, params.output)
    A = _dS(X, G)
    if params.model == "factorised":
        kappa = r / d
        obj = val.sum() + params.lam / np.sqrt(kappa) * (W * W).sum()
        grad = 2.0 * A @ W / c + 2.0 * params.lam / np.sqrt(kappa) * W
    else:
        obj = val.sum() + params.lam * d * (S * S).sum()
        grad = A + 2.0 * params.lam * d * S
        grad = 0.5 * (grad + grad.T)
    return float(obj), grad, S, val


@dataclass
class TrainResult:
    alpha: float
    d: int
    n: int
    seed: int
    train: float
    test: float
    test_clean: float
    q: float
    m: float
    matrix_error: float
    rank: float
    steps: int
    stop: str
    seconds: float
    eigenvalues: np.ndarray
    singular_values: np.ndarray | None

    def asdict(self, spectrum: bool = False) -> dict:
        out = {k: getattr(self, k) for k in ("alpha", "d", "n", "seed", "train", "test", "test_clean",
                                             "q", "m", "matrix_error", "rank", "steps", "stop", "seconds")}
        if spectrum:
            out["eigenvalues"] = self.eigenvalues
            out["singular_values"] = self.singular_values
        return out

    def to_json(self) -> dict:
        return self.asdict()


@limit_blas_threads(param="blas_threads")
def train(params: ERMParams, alpha: float, d: int, *, seed: int = 0, lr: float = 0.02,
          max_steps: int = 5000, patience: int = 50, gtol: float = 1e-7, n_test: int | None = None,
          init_scale: float = 0.5, blas_threads: int | None = 1) -> TrainResult:
    """One Adam run at size d with n = alpha d^2 samples; seed fixes teacher, data and init."""
    if d < 4:
        raise AimsymError("d", f"must be an integer >= 4, got {d}")
    if not (np.isfinite(alpha) and alpha > 0):
        raise AimsymError("alpha", f"must be a finite number > 0, got {alpha}")
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    S_star = teacher(d, params.kappa0, rng)
    n = max(1, int(round(alpha * d * d)))
    data = sample(params, S_star, n, rng)
    test = sample(params, S_star, n_test or max(n, 2000), rng)
    r = None
    if params.model == "factorised":
        r = d if params.kappa is None else max(1, int(round(params.kappa * d)))
        theta = init_scale * rng.standard_normal((d, r)) * (r / d) ** 0.25
    else:
        theta = np.zeros((d, d))
    m1, m2 = np.zeros_like(theta), np.zeros_like(theta)
    b1, b2, eps = 0.9, 0.999, 1e-12
    rate, best, since, stop = lr, np.inf, 0, "max_steps"
    best_theta = theta.copy()
    step = 0
    for step in range(1, max_steps + 1):
        obj, g, S, _ = objective_and_grad(theta, params, data, r)
        if not np.isfinite(obj):
            raise FloatingPointError(f"objective became non-finite at step {step}")
        if obj < best * (1 - 1e-6):
            best, since = obj, 0
            best_theta = theta.copy()
        else:
            since += 1
            if since >= patience:
                rate *= 0.5
                since = 0
                theta = best_theta.copy()
                if rate < lr * 1e-3:
                    stop = "lr_floor"
                    break
        gn = np.linalg.norm(g) / (1.0 + np.linalg.norm(theta))
        if gn < gtol:
            stop = "gradient"
            break
        m1 = b1 * m1 + (1 - b1) * g
        m2 = b2 * m2 + (1 - b2) * g * g
        theta = theta - rate * (m1 / (1 - b1**step)) / (np.sqrt(m2 / (1 - b2**step)) + eps)
    theta = best_theta
    _, _, S, val = objective_and_grad(theta, params, data, r)
    P_test = softmax_rows(params.beta * preactivation(test.X, S))
    if params.output == "sequence":
        errs = _loss_and_dH(P_test, test.Y, test.X, params.beta, "sequence")[0]
        errs_c = _loss_and_dH(P_test, test.Yclean, test.X, params.beta, "sequence")[0]
    else:
        errs = ((P_test - test.Y) ** 2).sum((-1, -2))
        errs_c = ((P_test - test.Yclean) ** 2).sum((-1, -2))
    ev = np.linalg.eigvalsh(S)
    q = float((S * S).sum() / d)
    m = float((S * S_star).sum() / d)
    Q0 = float((S_star * S_star).sum() / d)
    sv = np.linalg.svd(theta / np.sqrt(d), compute_uv=False) if params.model == "factorised" else None
    scale = np.abs(ev).max() if ev.size else 1.0
    return TrainResult(alpha=float(alpha), d=d, n=n, seed=seed, train=float(val.mean()),
                       test=float(errs.mean()), test_clean=float(errs_c.mean()), q=q, m=m,
                       matrix_error=Q0 + q - 2 * m, rank=float(np.mean(np.abs(ev) > 1e-3 * scale)),
                       steps=step, stop=stop, seconds=time.perf_counter() - t0,
                       eigenvalues=ev, singular_values=sv)
