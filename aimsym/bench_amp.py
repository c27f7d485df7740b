"""Benchmark: GAMP iterations of the two-layer T = 2 softmax model (skip 1) at d = 1000, alpha = 1.5.

    python -m aimsym.bench_amp [--d 1000] [--alpha 1.5] [--iters 8] [--nodes 16 48]

Reports seconds per GAMP iteration, split into the denoiser (n batch calls) and the linear
algebra (W_hat X, sum g X^T, Onsager term, inversions), for each denoiser accuracy. Numba
threads: all cores unless NUMBA_NUM_THREADS is set. The first iteration after a warm-up call
is included (compilation is excluded by the warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(os.path.dirname(__file__), "..", "derivations",
                                                    "attention_L2_T2.toml"))
    ap.add_argument("--d", type=int, default=1000)
    ap.add_argument("--alpha", type=float, default=1.5)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--nodes", type=int, nargs="+", default=[16, 48])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--figures", default=None, metavar="DIR",
                    help="instead of timing, draw docs/figures/amp_*.png into DIR")
    args = ap.parse_args(argv)
    if args.figures:
        return figures(args.figures, args.model)

    import numba

    import aimsym
    from aimsym.amp import gamp
    from aimsym.data import teacher_student

    model = aimsym.load(args.model, skip=1.0)
    t0 = time.perf_counter()
    data = teacher_student(model, args.d, alpha=args.alpha, seed=args.seed)
    t_data = time.perf_counter() - t0
    rows = []
    for nodes in args.nodes:
        den = model.denoiser(nodes=nodes)
        den(data.y[:4], np.zeros((4, model.p, model.tokens)), np.eye(model.p))  # compile / warm up
        t0 = time.perf_counter()
        tr = gamp(den, data, lam=1e-2, max_iter=args.iters, tol=0.0, rng=np.random.default_rng(args.seed))
        wall = time.perf_counter() - t0
        it = tr.iterations
        rows.append({"nodes_per_dim": nodes, "iterations": it, "s_per_iteration": wall / it,
                     "denoiser_s_per_iteration": tr.timing["denoiser_s"] / it,
                     "linear_algebra_s_per_iteration": tr.timing["linear_algebra_s"] / it,
                     "final_M_diag": np.diag(tr.M[-1]).round(4).tolist()})
    out = {"model": model.name, "d": args.d, "alpha": args.alpha, "n": data.n, "threads": numba.get_num_threads(),
           "cpu_count": os.cpu_count(), "data_generation_s": t_data, "runs": rows}
    print(json.dumps(out, indent=2))
    return 0


def _se_trajectory(model, alpha, lam, iters, seed=0):
    """SE iterated step by step from Q = 0 with side information lam (aimsym.se's sampled map)."""
    from aimsym.se import make_channel, q_from_q_hat, se_map, side_matrix

    ch = make_channel(model, samples=4096, replicas=8, seed=seed)
    Lam = side_matrix(model.p, lam)
    Q = np.zeros((model.p, model.p))
    out = [Q]
    for _ in range(iters):
        Q_hat_r, _ = se_map(ch, Q, alpha)
        Q = q_from_q_hat(Q_hat_r.mean(0), Lam)
        out.append(Q)
    return np.array(out)


def figures(outdir, model_path) -> int:
    """AMP vs SE per iteration (L2_T2, Gaussian channel, phase retrieval) and Adam per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import aimsym
    from aimsym.amp import run_amp
    from aimsym.gd import run_gd

    os.makedirs(outdir, exist_ok=True)
    model = aimsym.load(model_path, skip=1.0)
    alpha, lam, iters = 1.2, 1e-2, 40
    res = run_amp(model, d=1000, alpha=alpha, seeds=4, seed=1, lam=lam, max_iter=iters, tol=0.0)
    se = _se_trajectory(model, alpha, lam, iters)
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
    t = np.arange(len(res["overlaps"]["M"]))
    for k, c in zip(range(model.p), ("C0", "C3")):
        ax.errorbar(t + 1, res["overlaps"]["M"][:, k, k], yerr=res["overlaps"]["M_stderr"][:, k, k], fmt="o",
                    ms=3, color=c, label=f"AMP layer {k + 1} (d=1000, 4 seeds)")
        ax.plot(np.arange(len(se)) + 1, se[:, k, k], "-", color=c, lw=1, label=f"SE layer {k + 1}")
    ax.set(xscale="log", xlabel="iteration + 1", ylabel="overlap M_ll", ylim=(-0.05, 1.1),
           title=f"GAMP vs SE, two-layer T=2 softmax, skip 1, alpha={alpha}, lambda={lam}")
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, "amp_L2_T2_iterations.png"))
    plt.close(fig)

    g = run_gd(model, d=200, alpha=8, seeds=3, seed=1, optimizer="adam", lr=0.03, epochs=400)
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
    e = np.asarray(g["epochs_logged"])
    for k, c in zip(range(g["overlaps"]["layer"].shape[1]), ("C0", "C3")):
        ax.errorbar(e + 1, g["overlaps"]["layer"][:, k], yerr=g["overlaps"]["layer_stderr"][:, k], fmt="o-",
                    ms=3, lw=1, color=c, label=f"layer {k + 1}")
    ax.set(xscale="log", xlabel="epoch + 1", ylabel="|cosine overlap| per layer", ylim=(-0.05, 1.05),
           title="Adam (lr 0.03, full batch), two-layer T=2 softmax, skip 1, d=200, alpha=8, 3 seeds")
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, "amp_gd_L2_T2_epochs.png"))
    plt.close(fig)

    # GLMs: closed-form / 1-D SE (the same helpers as tests/test_amp_se.py)
    gauss = aimsym.load(os.path.join(os.path.dirname(model_path), "gaussian_channel.toml"), Delta=0.5)
    rg = run_amp(gauss, d=2000, alpha=0.8, seeds=4, seed=3, lam=0.0, max_iter=8, tol=0.0)
    Q, se_g = 0.0, [0.0]
    for _ in range(8):
        q_hat = 0.8 / (1 - Q + 0.5)
        Q = q_hat / (1 + q_hat)
        se_g.append(Q)
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
    ax.errorbar(np.arange(9), rg["overlaps"]["M"][:, 0, 0], yerr=rg["overlaps"]["M_stderr"][:, 0, 0], fmt="o",
                label="AMP, Gaussian channel Delta=0.5, alpha=0.8 (d=2000, 4 seeds)")
    ax.plot(np.arange(9), se_g, "-", label="SE (closed form)")
    ax.set(xlabel="iteration", ylabel="overlap M")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, "amp_gaussian_channel_se.png"))
    plt.close(fig)
    print(json.dumps({"L2_T2_final_M": np.diag(res["final"]["M"]).tolist(),
                      "L2_T2_final_M_stderr": np.diag(res["final"]["M_stderr"]).tolist(),
                      "SE_final_Q": np.diag(se[-1]).tolist(), "adam_final_overlap": g["final"]["overlap"].tolist()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
