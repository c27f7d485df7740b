"""Benchmark: GAMP iterations of the two-layer T = 2 softmax model (skip 1) at d = 1000, alpha = 1.5.

    python -m aimsym.bench.amp [--d 1000] [--alpha 1.5] [--iters 8] [--nodes 16 48]

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

from ..plot.se import save_figure


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
    ap.add_argument("--only", nargs="+", choices=FIGURES, default=None,
                    help="with --figures: draw only these figures (default: all)")
    args = ap.parse_args(argv)
    if args.figures:
        return figures(args.figures, args.model, args.only or FIGURES)

    import numba

    from aimsym.model import load
    from aimsym.smi.amp import gamp
    from aimsym.smi.data import teacher_student

    model = load(args.model, skip=1.0)
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


# figure name -> file (docs/figures/amp_<...>.png)
FIGURES = ("iterations", "gd", "gaussian", "alpha", "glm_alpha")


def se_trajectory(model, alpha, lam, iters, seed=0, samples=4096, replicas=8):
    """SE iterated step by step from Q = 0 with side information lam (aimsym.smi.se's sampled map):
    one trajectory per replica of the points (samples / replicas each), so that their spread is the
    trajectory's Monte Carlo error. Returns (mean, stderr), each (iters + 1, p, p)."""
    from aimsym.smi.se import Channel, make_channel, q_from_q_hat, se_map, side_matrix

    ch = make_channel(model, samples=samples, replicas=replicas, seed=seed)
    Lam = side_matrix(model.p, lam)
    paths = []
    for r in range(replicas):
        ch_r = Channel(ch.model, ch.den, ch.points[r:r + 1])
        Q = np.zeros((model.p, model.p))
        out = [Q]
        for _ in range(iters):
            Q_hat_r, _ = se_map(ch_r, Q, alpha)
            Q = q_from_q_hat(Q_hat_r.mean(0), Lam)
            out.append(Q)
        paths.append(out)
    paths = np.array(paths)
    return paths.mean(axis=0), paths.std(axis=0, ddof=1) / np.sqrt(replicas)


def se_gaussian_fixed_point(alpha, Delta, lam=0.0, iters=2000, tol=1e-12):
    """Closed-form SE of y = z + sqrt(Delta) xi iterated to its fixed point: Q_hat = alpha / (1 - Q + Delta)."""
    Q = 0.0
    for _ in range(iters):
        q_hat = alpha / (1 - Q + Delta)
        Q_new = (q_hat + lam) / (1 + q_hat + lam)
        if abs(Q_new - Q) < tol:
            return Q_new
        Q = Q_new
    return Q


def se_phase_retrieval_fixed_point(alpha, lam, Q0=0.0, iters=5000, tol=1e-10, nodes=120):
    """SE of y = |z| (2-D Gauss-Hermite over (xi, eta), closed-form g_out) iterated to its fixed point."""
    x, w = np.polynomial.hermite_e.hermegauss(nodes)
    w = w / w.sum()
    xi, eta = np.meshgrid(x, x, indexing="ij")
    W = np.outer(w, w)
    Q = Q0
    for _ in range(iters):
        V = max(1 - Q, 1e-12)
        omega = np.sqrt(Q) * xi
        y = np.abs(omega + np.sqrt(V) * eta)
        g = (y * np.tanh(y * omega / V) - omega) / V
        q_hat = alpha * np.sum(W * g**2)
        Q_new = (q_hat + lam) / (1 + q_hat + lam)
        if abs(Q_new - Q) < tol:
            return Q_new
        Q = Q_new
    return Q


def _final_points(model, alphas, *, d, seeds, seed, lam, max_iter, tol=1e-4, den=None):
    """GAMP final overlap (diagonal of M, mean and s.e. over seeds) at each alpha."""
    from aimsym.smi.amp import run_amp
    from aimsym.errors import AimsymError

    rows = []
    for i, a in enumerate(alphas):
        try:
            r = run_amp(model, d=d, alpha=float(a), seeds=seeds, seed=seed + i, lam=lam, max_iter=max_iter,
                        tol=tol, den=den)
        except AimsymError as exc:  # reported (JSON, figure skips the point), never silently dropped
            rows.append({"alpha": float(a), "error": str(exc)})
            print(json.dumps({"amp_point": model.name, **rows[-1]}), flush=True)
            continue
        rows.append({"alpha": float(a), "M": np.diag(r.final["M"]).tolist(),
                     "M_stderr": np.diag(r.final["M_stderr"]).tolist(),
                     "M_per_seed": [np.diag(x).tolist() for x in r.final["M_per_seed"]],
                     "Q": np.diag(r.final["Q"]).tolist(),
                     "iterations_per_seed": r.iterations_per_seed, "converged": r.converged})
        print(json.dumps({"amp_point": model.name, **rows[-1]}), flush=True)
    return rows


def _save(fig, path):
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(json.dumps({"figure": path, "bytes": os.path.getsize(path)}), flush=True)


def figures(outdir, model_path, only=FIGURES) -> int:
    """AMP vs SE per iteration and vs alpha (L2_T2, Gaussian channel, phase retrieval) and Adam per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from aimsym.model import load
    from aimsym.smi.amp import run_amp

    os.makedirs(outdir, exist_ok=True)
    model = load(model_path, skip=1.0)
    here = os.path.dirname(model_path)
    summary = {}
    if "iterations" in only:
        summary["iterations"] = iterations_figure(model, outdir)

    if "gd" in only:
        summary["gd"] = gd_figure(model, outdir)

    if "gaussian" in only:
        # Gaussian channel per iteration: closed-form SE (the same recursion as tests/test_amp_se.py)
        gauss = load(os.path.join(here, "gaussian_channel.toml"), Delta=0.5)
        rg = run_amp(gauss, d=2000, alpha=0.8, seeds=4, seed=3, lam=0.0, max_iter=8, tol=0.0)
        Q, se_g = 0.0, [0.0]
        for _ in range(8):
            q_hat = 0.8 / (1 - Q + 0.5)
            Q = q_hat / (1 + q_hat)
            se_g.append(Q)
        fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
        ax.errorbar(np.arange(9), rg.overlaps["M"][:, 0, 0], yerr=rg.overlaps["M_stderr"][:, 0, 0], fmt="o",
                    label="AMP, Gaussian channel Delta=0.5, alpha=0.8 (d=2000, 4 seeds)")
        ax.plot(np.arange(9), se_g, "-", label="SE (closed form)")
        ax.set(xlabel="iteration", ylabel="overlap M")
        ax.legend(fontsize=7)
        _save(fig, os.path.join(outdir, "amp_gaussian_channel_se.png"))

    if "alpha" in only:
        # per-layer overlaps vs alpha: SE fixed point (aimsym.smi.se, same lambda, same points at every alpha)
        # and GAMP final overlaps at d = 1000, 4 seeds per alpha
        from aimsym.smi.se import make_channel, state_evolution

        lam = 1e-2
        ch = make_channel(model, samples=4096, replicas=8, seed=0)
        se_alphas = np.round(np.sort(np.r_[np.linspace(0.1, 1.5, 15), 0.75, 0.85]), 4)
        se_rows = []
        for a in se_alphas:
            r = state_evolution(model, float(a), side_info=lam, errors=False, channel=ch)
            se_rows.append({"alpha": float(a), "Q": np.diag(r.Q).tolist(), "Q_stderr": np.diag(r.Q_stderr).tolist(),
                            "converged": bool(r.converged)})
            print(json.dumps({"se_point": model.name, **se_rows[-1]}), flush=True)
        amp_rows = _final_points(model, [0.3, 0.6, 0.9, 1.2, 1.5], d=1000, seeds=4, seed=20, lam=lam, max_iter=250)
        amp_rows = [r for r in amp_rows if "error" not in r]
        fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
        Qse = np.array([r["Q"] for r in se_rows])
        Mamp = np.array([r["M"] for r in amp_rows])
        Samp = np.array([r["M_stderr"] for r in amp_rows])
        aa = [r["alpha"] for r in amp_rows]
        for k, c in zip(range(model.p), ("C0", "C3")):
            ax.plot(se_alphas, Qse[:, k], "-", color=c, lw=1.2, label=f"SE layer {k + 1}")
            ax.errorbar(aa, Mamp[:, k], yerr=Samp[:, k], fmt="o", ms=4, capsize=3, color=c,
                        label=f"GAMP layer {k + 1} (d=1000, 4 seeds)")
        ax.set(xlabel="alpha = n / d", ylabel="overlap (SE Q_ll, GAMP M_ll)", ylim=(-0.05, 1.1),
               title=f"Two-layer T=2 softmax, skip 1, lambda={lam}: GAMP (mean ± s.e.) on the SE")
        ax.title.set_fontsize(8)
        ax.legend(fontsize=7)
        _save(fig, os.path.join(outdir, "amp_L2_T2_alpha.png"))
        summary["alpha"] = {"se": se_rows, "amp": amp_rows}

    if "glm_alpha" in only:
        from aimsym.smi.se import gaussian_channel_fixed_point

        gauss = load(os.path.join(here, "gaussian_channel.toml"), Delta=0.5)
        pr = load(os.path.join(here, "glm_phase_retrieval.toml"))
        grid = np.linspace(0.05, 2.0, 40)
        se_g = np.array([se_gaussian_fixed_point(a, 0.5) for a in grid])
        se_g_closed = np.array([gaussian_channel_fixed_point(a, 0.5) for a in grid])  # aimsym.smi.se closed form
        lam_pr = 1e-2
        se_pr = np.array([se_phase_retrieval_fixed_point(a, lam_pr) for a in grid])
        se_pr0 = np.array([se_phase_retrieval_fixed_point(a, 0.0, Q0=1e-4) if a != 0.5 else 0.0 for a in grid])
        amp_g = _final_points(gauss, [0.25, 0.5, 1.0, 1.5, 2.0], d=2000, seeds=4, seed=40, lam=0.0,
                              max_iter=200, tol=1e-6)
        amp_pr_all = _final_points(pr, [0.3, 0.6, 0.9, 1.2, 1.5], d=2000, seeds=4, seed=60, lam=lam_pr,
                                   max_iter=300, tol=1e-5)
        amp_pr = [r for r in amp_pr_all if "error" not in r]
        fig, axs = plt.subplots(1, 2, figsize=(8, 3.3), dpi=100)
        ax = axs[0]
        ax.plot(grid, se_g, "-", lw=1.2, label="SE (closed form)")
        ax.errorbar([r["alpha"] for r in amp_g], [r["M"][0] for r in amp_g], yerr=[r["M_stderr"][0] for r in amp_g],
                    fmt="o", ms=4, capsize=3, label="GAMP (d=2000, 4 seeds)")
        ax.set(xlabel="alpha", ylabel="overlap", title="Gaussian channel, Delta=0.5, lambda=0")
        ax.legend(fontsize=7)
        ax = axs[1]
        ax.plot(grid, se_pr, "-", lw=1.2, label=f"SE, lambda={lam_pr}")
        ax.plot(grid, se_pr0, "--", lw=1, color="gray", label="SE, lambda=0 from Q=1e-4 (alpha_c=1/2)")
        ax.errorbar([r["alpha"] for r in amp_pr], [r["M"][0] for r in amp_pr],
                    yerr=[r["M_stderr"][0] for r in amp_pr], fmt="o", ms=4, capsize=3,
                    label=f"GAMP, lambda={lam_pr} (d=2000, 4 seeds)")
        failed = [r["alpha"] for r in amp_pr_all if "error" in r]
        ax.set(xlabel="alpha", ylabel="overlap", title="Phase retrieval y=|z|"
               + (f" (GAMP failed at alpha={failed}, see docs)" if failed else ""))
        ax.legend(fontsize=7)
        for ax in axs:
            ax.title.set_fontsize(9)
            ax.set_ylim(-0.05, 1.1)
        _save(fig, os.path.join(outdir, "amp_glm_alpha.png"))
        summary["glm_alpha"] = {"gaussian_se_max_diff_closed_form": float(np.max(np.abs(se_g - se_g_closed))),
                                "gaussian": [{**r, "SE": se_gaussian_fixed_point(r["alpha"], 0.5)} for r in amp_g],
                                "phase_retrieval": [{**r, "SE": se_phase_retrieval_fixed_point(r["alpha"], lam_pr)}
                                                    for r in amp_pr],
                                "phase_retrieval_failed": [r for r in amp_pr_all if "error" in r]}
    print(json.dumps(summary))
    return 0


def iterations_figure(model, outdir, *, d=1000, seeds=4, iters=40, alpha=1.2, lam=1e-2, se_samples=4096):
    """GAMP per-layer overlaps per iteration (mean ± s.e. over ``seeds``) on the SE iterated step by
    step from Q = 0 with the same side information ``lam`` (amp_L2_T2_iterations.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from aimsym.smi.amp import run_amp

    import warnings

    from aimsym.errors import ConvergenceWarning

    with warnings.catch_warnings():  # (tol = 0: a fixed number of iterations, by design)
        warnings.simplefilter("ignore", ConvergenceWarning)
        res = run_amp(model, d=d, alpha=alpha, seeds=seeds, seed=1, lam=lam, max_iter=iters, tol=0.0, progress=True)
    se, se_err = se_trajectory(model, alpha, lam, iters, samples=se_samples)
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
    t = np.arange(len(res.overlaps["M"]))
    for k, c in zip(range(model.p), ("C0", "C3")):
        ax.errorbar(t + 1, res.overlaps["M"][:, k, k], yerr=res.overlaps["M_stderr"][:, k, k], fmt="o",
                    ms=3, color=c, label=f"AMP layer {k + 1} (d={d}, {seeds} seeds)")
        ax.errorbar(np.arange(len(se)) + 1, se[:, k, k], yerr=se_err[:, k, k], fmt="-", color=c, lw=1,
                    label=f"SE layer {k + 1}")
    ax.set(xscale="log", xlabel="iteration + 1", ylabel="overlap M_ll", ylim=(-0.05, 1.1),
           title=f"GAMP vs SE, two-layer T=2 softmax, skip 1, alpha={alpha}, lambda={lam}")
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7)
    _save(fig, os.path.join(outdir, "amp_L2_T2_iterations.png"))
    return {"L2_T2_final_M": np.diag(res.final["M"]).tolist(),
            "L2_T2_final_M_stderr": np.diag(res.final["M_stderr"]).tolist(),
            "SE_final_Q": np.diag(se[-1]).tolist(), "SE_final_Q_stderr": np.diag(se_err[-1]).tolist(),
            "settings": res.settings}


def held_layer_figure(model, outdir, *, d=1000, seeds=4, iters=60, alpha=1.2, lam=1e-2, held=1,
                      overlaps=(0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 0.99)):
    """GAMP with row ``held`` (the last layer) held at a fixed overlap q with the teacher (SMI paper,
    appendix E): the other layers' final overlaps vs q, mean +- s.e. over ``seeds``, with the free
    run's final overlaps as horizontal lines (amp_L2_T2_held_layer.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import warnings

    from aimsym.errors import ConvergenceWarning
    from aimsym.smi.amp import run_amp

    rows = [k for k in range(model.p) if k != held]
    final, final_se = [], []
    with warnings.catch_warnings():  # (a fixed number of iterations where a run has not settled)
        warnings.simplefilter("ignore", ConvergenceWarning)
        for q in overlaps:
            r = run_amp(model, d=d, alpha=alpha, seeds=seeds, seed=1, lam=lam, max_iter=iters, hold={held: q})
            final.append(np.diag(r.final["M"]))
            final_se.append(np.diag(r.final["M_stderr"]))
        free = run_amp(model, d=d, alpha=alpha, seeds=seeds, seed=1, lam=lam, max_iter=iters)
    final, final_se = np.array(final), np.array(final_se)
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
    for k, c in zip(rows, ("C0", "C2", "C1")):
        ax.errorbar(overlaps, final[:, k], yerr=final_se[:, k], fmt="o-", ms=3, color=c,
                    label=f"layer {k + 1}, layer {held + 1} held at q, d={d}")
        ax.axhline(free.final["M"][k, k], color=c, ls=":", lw=1, label=f"layer {k + 1}, free run, d={d}")
    ax.set(xlabel=f"held overlap q of layer {held + 1}", ylabel="final overlap M_ll", ylim=(-0.05, 1.1),
           title=f"GAMP with layer {held + 1} held, alpha={alpha}, d={d}, {seeds} seeds, lambda={lam}")
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7)
    _save(fig, os.path.join(outdir, "amp_L2_T2_held_layer.png"))
    return {"held_row": held, "held_overlaps": list(overlaps), "final_M_diag": final.tolist(),
            "final_M_diag_stderr": final_se.tolist(), "free_final_M_diag": np.diag(free.final["M"]).tolist(),
            "settings": {"d": d, "seeds": seeds, "iters": iters, "alpha": alpha, "lambda": lam}}


def gd_figure(model, outdir, *, d=200, seeds=3, epochs=1000, alphas=(16, 8)):
    """Adam per-layer overlaps vs epoch at d = 200: alpha = 16 (both layers learned, last layer first)
    and alpha = 8 (dashed: the last layer is learned, the first stalls near 0.55)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from aimsym.smi.gd import run_gd

    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
    out = {}
    for alpha, style in zip(alphas, ("o-", "--", ":", "-.")):
        g = run_gd(model, d=d, alpha=alpha, seeds=seeds, seed=1, optimizer="adam", lr=0.03, epochs=epochs,
                   progress=True)
        e = np.asarray(g.epochs_logged)
        ov, se = g.overlaps["layer"], g.overlaps["layer_stderr"]
        for k, c in zip(range(ov.shape[1]), ("C0", "C3")):
            ax.errorbar(e + 1, ov[:, k], yerr=se[:, k], fmt=style, ms=2.5, lw=1, color=c,
                        alpha=1.0 if alpha == alphas[0] else 0.6, label=f"layer {k + 1}, alpha={alpha}, d={d}")

        def first(k, th, ov=ov, e=e):
            j = int(np.argmax(ov[:, k] > th))
            return int(e[j]) if ov[j, k] > th else None

        out[f"alpha_{alpha}"] = {"final_overlap": ov[-1].tolist(), "final_overlap_stderr": se[-1].tolist(),
                                 "final_train_loss": float(g["train_loss"]["mean"][-1]),
                                 "first_epoch_mean_overlap_above_0.5": [first(k, 0.5) for k in range(ov.shape[1])],
                                 "first_epoch_mean_overlap_above_0.9": [first(k, 0.9) for k in range(ov.shape[1])]}
        print(json.dumps({"gd": out[f"alpha_{alpha}"], "alpha": alpha}), flush=True)
    ax.set(xscale="log", xlabel="epoch + 1", ylabel="|cosine overlap| per layer", ylim=(-0.05, 1.05),
           title=f"Adam (lr 0.03, full batch), two-layer T=2 softmax, skip 1, d={d}, {seeds} seeds (mean ± s.e.)")
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7)
    _save(fig, os.path.join(outdir, "amp_gd_L2_T2_epochs.png"))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
