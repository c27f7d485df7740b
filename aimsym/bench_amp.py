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
    args = ap.parse_args(argv)

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


if __name__ == "__main__":
    raise SystemExit(main())
