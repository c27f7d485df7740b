"""Gradient-descent baselines: train the student network on teacher-student data (square loss).

Student: the same architecture with weights W (p x d, rows as the rows of Z), prediction
y_hat_mu = g(W X_mu / sqrt(d)). For attention models g(W X / sqrt(d)) *is* the network's forward
pass (theory section 2; ``aimsym.smi.data.attention_network`` computes it on the tokens), so the
exact gradient follows from the chain rule through the generated link Jacobian:

    objective  R(W) = (1/n) sum_mu 1/2 ||y_hat_mu - y_mu||^2 + (weight_decay / (2 d)) ||W||_F^2
    grad       = (1/n) (1/sqrt(d)) sum_mu G_mu X_mu^T + (weight_decay / d) W,
                 G_mu[k, t] = sum_o (y_hat_mu - y_mu)[o] dy_o / dZ[k, t]

Optimisers. ``gd``: full batch, W <- W - lr d grad (the factor d makes lr dimension-free: the
overlaps move by O(lr) per step). ``sgd``: the same step on mini-batches of a fixed data set,
reshuffled every epoch (batches are reused across epochs). ``adam``: Adam (beta1 0.9, beta2
0.999, eps 1e-8) on mini-batches or the full batch, coupled weight decay.

Overlaps per layer (sign and rotation invariant): overlap_l = ||W_l W*_l^T||_* / (||W_l|| ||W*_l||)
(the absolute cosine for rank one), plus M and Q with each symmetric group sign-normalised.
Averaged estimator (``average`` = K > 1): K students from independent inits on the same data;
the test error is that of the averaged prediction (1/K) sum_k g(W_k X / sqrt(d)).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .amp import index_labels, sign_flips
from .data import back_project, indices, teacher_student
from ..errors import AimsymError
from ..results import Result

DEFAULT_LR = {"gd": 1.0, "sgd": 0.5, "adam": 0.01}


def layer_groups(model) -> list[list[int]]:
    """Rows of W belonging to each layer (attention), or one group per index (free-form links)."""
    if getattr(model.spec, "kind", "") == "attention":
        labels = model.labels
        return [[k for k, lb in enumerate(labels) if lb.layer == l] for l in range(1, len(model.spec.layers) + 1)]
    return [[k] for k in range(model.p)]


def loss_and_grad(model, W, X_rows, y, weight_decay: float = 0.0):
    """Objective R(W) (see module docstring) and its exact gradient (p x d)."""
    n, T, d = X_rows.shape
    Z = indices(W, X_rows)
    r = (model.link(Z) - y).reshape(n, -1)
    J = model.link_jacobian(Z).reshape(n, r.shape[1], model.p, T)
    G = np.einsum("no,nokt->nkt", r, J)
    loss = 0.5 * np.mean(np.sum(r**2, axis=1)) + 0.5 * weight_decay / d * np.sum(W**2)
    grad = back_project(G, X_rows) / n + weight_decay / d * W
    return float(loss), grad


def per_layer_overlap(model, W, W_star) -> np.ndarray:
    out = []
    for rows in layer_groups(model):
        a, b = W[rows], W_star[rows]
        den = np.linalg.norm(a) * np.linalg.norm(b)
        out.append(np.linalg.svd(a @ b.T, compute_uv=False).sum() / den if den > 0 else 0.0)
    return np.array(out)


def log_epochs(epochs: int, points: int = 60) -> np.ndarray:
    """Epochs at which overlaps are logged: 0 and a log-spaced grid up to ``epochs``."""
    grid = np.unique(np.round(np.logspace(0, np.log10(max(epochs, 1)), points)).astype(int))
    return np.concatenate([[0], grid[grid <= epochs]])


@dataclass
class GDTrace:
    W: list  # final students (one per averaged init)
    epochs_logged: np.ndarray
    overlap: np.ndarray  # (logged, layers), mean over averaged students
    M: np.ndarray  # (logged, p, p) of the first student, sign-normalised at the end
    Q: np.ndarray
    train_loss: np.ndarray  # (logged,)
    test_error: np.ndarray  # (logged,) of the (averaged) prediction
    extra: dict = field(default_factory=dict)


def train(model, data, *, optimizer: str = "adam", lr: float | None = None, epochs: int = 200,
          batch_size: int | None = None, weight_decay: float = 0.0, init_scale: float = 0.1,
          average: int = 1, rng: np.random.Generator | None = None, test=None, callback=None) -> GDTrace:
    """Train ``average`` students from independent inits on ``data``; log overlaps per epoch."""
    if optimizer not in DEFAULT_LR:
        raise AimsymError("optimizer", f"must be one of {', '.join(DEFAULT_LR)}, got {optimizer!r}")
    lr = DEFAULT_LR[optimizer] if lr is None else lr
    if not (np.isfinite(lr) and lr > 0):
        raise AimsymError("lr", f"must be > 0, got {lr!r}")
    if not (isinstance(epochs, int | np.integer) and epochs >= 1):
        raise AimsymError("epochs", f"must be a positive integer, got {epochs!r}")
    if not (np.isfinite(weight_decay) and weight_decay >= 0):
        raise AimsymError("weight_decay", f"must be >= 0, got {weight_decay!r}")
    if not (np.isfinite(init_scale) and init_scale > 0):
        raise AimsymError("init_scale", f"must be > 0 (W = 0 is a critical point of even links), got {init_scale!r}")
    if not (isinstance(average, int | np.integer) and average >= 1):
        raise AimsymError("average", f"must be a positive integer, got {average!r}")
    if rng is None:
        raise AimsymError("rng", "an explicit numpy Generator is required")
    n, d, p = data.n, data.d, model.p
    bs = n if batch_size is None else int(batch_size)
    if optimizer == "gd":
        bs = n
    if not 1 <= bs <= n:
        raise AimsymError("batch_size", f"must be in 1..{n}, got {batch_size!r}")
    Ws = [init_scale * rng.standard_normal((p, d)) for _ in range(average)]
    m1 = [np.zeros((p, d)) for _ in Ws]
    m2 = [np.zeros((p, d)) for _ in Ws]
    step = 0
    logged = set(log_epochs(epochs).tolist())
    ep_log, ov, Ms, Qs, tl, te = [], [], [], [], [], []

    def log(epoch):
        ep_log.append(epoch)
        ov.append(np.mean([per_layer_overlap(model, W, data.W_star) for W in Ws], axis=0))
        Ms.append(Ws[0] @ data.W_star.T / d)
        Qs.append(Ws[0] @ Ws[0].T / d)
        tl.append(np.mean([loss_and_grad(model, W, data.X_rows, data.y, weight_decay)[0] for W in Ws]))
        if test is not None:
            y_hat = np.mean([model.link(indices(W, test.X_rows)) for W in Ws], axis=0)
            te.append(float(np.mean(np.sum((y_hat - test.y).reshape(test.n, -1) ** 2, axis=1))))
        else:
            te.append(np.nan)
        if callback is not None:
            callback(epoch, ov[-1])

    log(0)
    for epoch in range(1, epochs + 1):
        order = rng.permutation(n) if bs < n else np.arange(n)
        for start in range(0, n, bs):
            idx = order[start:start + bs]
            Xb, yb = (data.X_rows, data.y) if bs == n else (data.X_rows[idx], data.y[idx])
            step += 1
            for k, W in enumerate(Ws):
                _, grad = loss_and_grad(model, W, Xb, yb, weight_decay)
                if optimizer == "adam":
                    m1[k] = 0.9 * m1[k] + 0.1 * grad
                    m2[k] = 0.999 * m2[k] + 0.001 * grad**2
                    mh = m1[k] / (1 - 0.9**step)
                    vh = m2[k] / (1 - 0.999**step)
                    W -= lr * mh / (np.sqrt(vh) + 1e-8)
                else:
                    W -= lr * d * grad
                if not np.all(np.isfinite(W)):
                    raise AimsymError("lr", f"training diverged at epoch {epoch} (non-finite weights); lower lr")
        if epoch in logged:
            log(epoch)
    s = sign_flips(model, Ms[-1])
    flip = s[:, None] * s[None, :]
    return GDTrace(W=Ws, epochs_logged=np.array(ep_log), overlap=np.array(ov),
                   M=np.array(Ms) * s[None, :, None], Q=np.array(Qs) * flip[None],
                   train_loss=np.array(tl), test_error=np.array(te))


@dataclass
class GDResult(Result):
    """Gradient-descent students over seeds, averaged: per-layer overlaps, M, Q, losses per
    logged epoch (``overlaps``, ``train_loss``, ``test_error``) and at the end (``final``)."""

    model: str
    parameters: dict
    index_labels: list
    layers: list
    settings: dict
    epochs: int
    epochs_logged: list
    overlaps: dict
    train_loss: dict
    test_error: dict
    final: dict
    provenance: dict


def run_gd(model, *, d: int, alpha: float, seeds: int = 1, seed: int = 0, optimizer: str = "adam",
           lr: float | None = None, epochs: int = 200, batch_size: int | None = None, weight_decay: float = 0.0,
           init_scale: float = 0.1, average: int = 1, n_test: int | None = None, progress: bool = False) -> GDResult:
    """Train on ``seeds`` independent data sets (seeded like ``run_amp``); mean and s.e. per logged epoch."""
    from ..provenance import provenance

    if not (isinstance(seeds, int | np.integer) and seeds >= 1):
        raise AimsymError("seeds", f"must be a positive integer, got {seeds!r}")
    n_test = n_test if n_test is not None else min(2000, max(200, int(round(alpha * d))))
    bar = None
    if progress:
        import sys

        from tqdm import tqdm

        bar = tqdm(total=seeds * epochs, desc=optimizer, unit="epoch", file=sys.stderr)
    traces = []
    for r, ss in enumerate(np.random.SeedSequence(seed).spawn(seeds)):
        s_data, s_test, s_train = ss.spawn(3)
        data = teacher_student(model, d, alpha=alpha, seed=s_data)
        test = teacher_student(model, d, n=n_test, seed=s_test, W_star=data.W_star)
        last = [0]

        def cb(epoch, o, _last=last):
            if bar is not None:
                bar.update(epoch - _last[0])
                _last[0] = epoch
                bar.set_postfix(overlap=np.round(o, 3).tolist())

        traces.append(train(model, data, optimizer=optimizer, lr=lr, epochs=epochs, batch_size=batch_size,
                            weight_decay=weight_decay, init_scale=init_scale, average=average,
                            rng=np.random.default_rng(s_train), test=test, callback=cb))
    if bar is not None:
        bar.close()
    k = len(traces)

    def stats(name):
        a = np.array([getattr(tr, name) for tr in traces])
        se = a.std(axis=0, ddof=1) / np.sqrt(k) if k > 1 else np.full(a.shape[1:], np.nan)
        return a.mean(0), se

    ov, ov_se = stats("overlap")
    M, M_se = stats("M")
    Q, Q_se = stats("Q")
    tl, tl_se = stats("train_loss")
    te, te_se = stats("test_error")
    lr_used = DEFAULT_LR[optimizer] if lr is None else lr
    return GDResult(
        model=model.name, parameters=model.parameters, index_labels=index_labels(model),
        layers=[[int(r) for r in g] for g in layer_groups(model)],
        settings={"d": d, "alpha": alpha, "n": int(round(alpha * d)), "n_test": n_test, "seeds": seeds,
                  "optimizer": optimizer, "lr": lr_used, "epochs": epochs, "batch_size": batch_size,
                  "weight_decay": weight_decay, "init_scale": init_scale, "average": average},
        epochs=epochs,
        epochs_logged=traces[0].epochs_logged,
        overlaps={"layer": ov, "layer_stderr": ov_se, "M": M, "M_stderr": M_se, "Q": Q, "Q_stderr": Q_se},
        train_loss={"mean": tl, "stderr": tl_se},
        test_error={"mean": te, "stderr": te_se},
        final={"overlap": ov[-1], "overlap_stderr": ov_se[-1], "M": M[-1], "M_stderr": M_se[-1],
               "Q": Q[-1], "Q_stderr": Q_se[-1], "train_loss": tl[-1], "test_error": te[-1],
               "test_error_stderr": te_se[-1],
               "overlap_per_seed": np.array([tr.overlap[-1] for tr in traces])},
        provenance=provenance(seed=seed, model_hash=model.hash(), accuracy={"exact_gradient": "link_jacobian"},
                              seeds_spawned=seeds),
    )
