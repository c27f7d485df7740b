"""Benchmark of the hardmax-last-layer denoiser: ``NUMBA_NUM_THREADS=1 python -m aimsym.bench.hardmax``."""

from __future__ import annotations

import numpy as np

from ..denoise.hardmax_channel import HardmaxMixedDenoiser


def bench(n: int = 64, seed: int = 0, sizes=((8, 24), (12, 32), (16, 40))) -> list[dict]:
    """Time per evaluation and max relative error of g_out against polar (48, 128), wedge 16, at
    n points from the two-layer model (c = 1), omega ~ 0.6 N(0, 1), V = [[1, .2], [.2, .8]].
    Run single-threaded with ``NUMBA_NUM_THREADS=1 python -m aimsym.bench.hardmax``."""
    import time

    from ..model import load

    m = load("hardmax_L2_T2", c=1.0)
    rng = np.random.default_rng(seed)
    _, y = m.sample(n, rng)
    om = 0.6 * rng.normal(size=(n, 2, 2))
    V = np.array([[1.0, 0.2], [0.2, 0.8]])
    ref = HardmaxMixedDenoiser(m, polar=(48, 128), wedge=16)(y, om, V)
    rows = []
    for pol in sizes:
        den = HardmaxMixedDenoiser(m, polar=pol)
        den(y[:1], om[:1], V)  # compile
        best = np.inf
        for _ in range(3):
            t = time.perf_counter()
            out = den(y, om, V)
            best = min(best, (time.perf_counter() - t) / n)
        err = float(np.abs(out.g_out - ref.g_out).max() / np.abs(ref.g_out).max())
        rows.append({"polar": pol, "ms_per_eval": best * 1e3, "max_rel_err_g_out": err})
    return rows


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m aimsym.bench.hardmax", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="points from the two-layer model (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for row in bench(n=args.n, seed=args.seed):
        print(f"polar {row['polar']}: {row['ms_per_eval']:.2f} ms / evaluation, "
              f"max rel. error of g_out {row['max_rel_err_g_out']:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
