"""Gradient-descent baseline on AIM data: Adam on the square loss, in numpy.

Student W in R^{d x r} (r = rho d, as the teacher), S_W = W W^T / sqrt(r d),
H_W = (X^T S_W X - Tr S_W I) / sqrt(d), prediction sigma(beta H_W) (softmax rows or linear).
Loss (1/n) sum_mu ||sigma(beta H_W^mu) - y^mu||_F^2 (all T^2 entries), full batch, Adam.
Error: ||S_W - S||_F^2 / d. "AGD": the average of the S_W of several runs from independent
initialisations on the same data (approaches the Bayes-optimal error, which is a posterior mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import AimsymError
from ..provenance import provenance
from ..results import Result
from .data import generate


def _forward(W, X, beta, activation):
    d, r = W.shape
    Z = np.einsum("ir,nia->nra", W, X, optimize=True)  # W^T x_a
    H = (np.einsum("nra,nrb->nab", Z, Z, optimize=True) - np.sum(W * W) * np.eye(X.shape[2]))
    H = H / np.sqrt(r * d) / np.sqrt(d)
    if activation == "linear":
        return Z, H, H
    z = beta * H
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return Z, H, e / e.sum(axis=-1, keepdims=True)


def loss_and_grad(W, X, Y, beta=1.0, activation="softmax"):
    """Mean square loss and its gradient in W (manual backpropagation)."""
    d, r = W.shape
    n, _, T = X.shape
    Z, H, Yh = _forward(W, X, beta, activation)
    diff = Yh - Y
    loss = float(np.sum(diff * diff) / n)
    dY = 2.0 * diff / n
    if activation == "linear":
        P = dY
    else:  # row softmax Jacobian
        P = beta * Yh * (dY - np.sum(dY * Yh, axis=-1, keepdims=True))
    c = 1.0 / (np.sqrt(r * d) * np.sqrt(d))
    P = 0.5 * (P + np.swapaxes(P, 1, 2))
    # dL/dW = 2 c [sum_mu X P X^T W - Tr(P) W]; X P X^T W = sum_ab P_ab x_a (x_b^T W)
    XPZ = np.einsum("nia,nab,nrb->ir", X, P, Z, optimize=True)
    trP = np.sum(np.trace(P, axis1=1, axis2=2))
    grad = 2.0 * c * (XPZ - trP * W)
    return loss, grad


def adam(W, X, Y, *, beta=1.0, activation="softmax", steps=3000, lr=0.02, b1=0.9, b2=0.999, eps=1e-8):
    m = np.zeros_like(W)
    v = np.zeros_like(W)
    loss = np.nan
    for t in range(1, steps + 1):
        loss, g = loss_and_grad(W, X, Y, beta, activation)
        if not np.isfinite(loss):
            raise AimsymError("lr", f"Adam diverged at step {t} (lr={lr}); lower --lr")
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        W = W - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return W, loss


@dataclass
class GDPoint(Result):
    """Adam at one alpha over seeds: mmse of single runs (gd) and of their average (agd), with
    standard errors, the final training loss and the SE value."""

    alpha: float
    rho: float
    d: int
    tokens: int
    activation: str
    beta: float
    mmse_gd: float
    mmse_gd_sem: float | None
    mmse_agd: float
    mmse_agd_sem: float | None
    train_loss: float
    mmse_se: float
    provenance: dict


def train_averaged(data, runs=4, *, beta=1.0, activation="softmax", steps=3000, lr=0.02, seed=0, rho=None):
    """``runs`` Adam runs from independent initialisations (seeded by ``[seed, 7919]``) on one data
    set. Returns a dict: ``gd`` (errors ||S_W - S||^2 / d of the single runs), ``agd`` (error of the
    averaged S_W), ``agd_inf`` and ``train_loss`` (per run).

    ``agd_inf`` estimates the error of the average over infinitely many runs (the mean of the
    initialisation law of GD's estimate on this data set): with S_k independent given the data,
    E ||mean_K S_k - S||^2 = ||E S_k - S||^2 + v/K (v = E ||S_k - E S_k||^2), and the sample
    variance s^2 = (1/(K-1)) sum_k ||S_k - mean S||^2 / d is unbiased for v / d, so
    agd_inf = agd - s^2 / K is an unbiased estimate of ||E S_k - S||^2 / d (None for K = 1)."""
    Y = data.y
    if activation == "linear":
        from .channels import to_matrix

        Y = to_matrix(Y, data.X.shape[2])
    d = data.S.shape[0]
    r = max(1, int(round((data.rho if rho is None else rho) * d)))
    rng = np.random.default_rng([seed, 7919])
    S_list, losses = [], []
    for _ in range(runs):
        W0 = rng.standard_normal((d, r))
        W, loss = adam(W0, data.X, Y, beta=beta, activation=activation, steps=steps, lr=lr)
        S_list.append(W @ W.T / np.sqrt(r * d))
        losses.append(float(loss))
    S_bar = np.mean(S_list, axis=0)
    agd = float(np.sum((S_bar - data.S) ** 2) / d)
    out = {"gd": [float(np.sum((Sw - data.S) ** 2) / d) for Sw in S_list], "agd": agd, "agd_inf": None,
           "train_loss": losses}
    if runs > 1:
        s2 = sum(float(np.sum((Sw - S_bar) ** 2) / d) for Sw in S_list) / (runs - 1)
        out["agd_inf"] = agd - s2 / runs
    return out


def run_many(alpha, rho, d, tokens=2, activation="softmax", beta=1.0, seeds=(0,), steps=3000,
             lr=0.02, runs=4):
    """For each data seed: ``runs`` Adam runs from independent inits; mean single-run error (GD)
    and the error of the averaged estimate (AGD); mean and standard error over seeds."""
    if activation == "hardmax":
        raise AimsymError("activation", "gradient descent needs a differentiable activation (softmax or linear)")
    if runs < 1:
        raise AimsymError("runs", f"must be >= 1, got {runs}")
    gd_err, agd_err, train_loss = [], [], []
    rho_eff = rho
    for seed in seeds:
        data = generate(d, alpha, rho, tokens, activation, beta, seed=seed)
        rho_eff = data.rho
        out = train_averaged(data, runs, beta=beta, activation=activation, steps=steps, lr=lr, seed=seed, rho=rho)
        train_loss += out["train_loss"]
        gd_err.append(np.mean(out["gd"]))
        agd_err.append(out["agd"])
    from . import se

    def sem(x):
        return float(np.std(x, ddof=1) / np.sqrt(len(x))) if len(x) > 1 else None

    return GDPoint(
        alpha=float(alpha), rho=float(rho_eff), d=int(d), tokens=int(tokens), activation=activation,
        beta=float(beta), mmse_gd=float(np.mean(gd_err)), mmse_gd_sem=sem(gd_err),
        mmse_agd=float(np.mean(agd_err)), mmse_agd_sem=sem(agd_err), train_loss=float(np.mean(train_loss)),
        mmse_se=se.solve(alpha, rho_eff, tokens, activation, beta).mmse,
        provenance=provenance(seed=list(seeds), accuracy={"steps": steps, "lr": lr, "runs": runs}),
    )
