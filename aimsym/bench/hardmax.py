"""Benchmark of the hardmax-last-layer denoiser: ``NUMBA_NUM_THREADS=1 python -m aimsym.bench.hardmax``
(fixed polar rules at moderate V) and ``... --adaptive`` (the error-controlled rule per regime)."""

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


def regime_points(kind: str, n: int, seed: int = 0):
    """(y, omega, V) at n points of the two-layer model (c = 1): SE points (V = v I, v in
    0.05-0.99), the first layer nearly known (ridge1: V_00 in 1e-4..1e-2) or the last (ridge2:
    V_11 in 1e-4..1e-2); omega ~ N(0, I - V) per layer, y from Z ~ N(omega, V). Far tails
    (tail): V = v I, omega ~ 3 N(0, 1), y from Z ~ N(0, I) drawn independently of omega."""
    from ..model import load

    m = load("hardmax_L2_T2", c=1.0)
    rng = np.random.default_rng(seed)
    V = np.zeros((n, 2, 2))
    if kind == "tail":
        V[:] = rng.uniform(0.05, 0.99, n)[:, None, None] * np.eye(2)
        om = 3 * rng.standard_normal((n, 2, 2))
        return m, np.asarray(m.link(rng.standard_normal((n, 2, 2)))), om, V
    if kind == "se":
        V[:] = rng.uniform(0.05, 0.99, n)[:, None, None] * np.eye(2)
    else:
        k = {"ridge1": 0, "ridge2": 1}[kind]
        V[:, k, k] = 10 ** rng.uniform(-4, -2, n)
        V[:, 1 - k, 1 - k] = rng.uniform(0.2, 0.9, n)
    d = np.diagonal(V, axis1=1, axis2=2)
    om = np.sqrt(1 - d)[:, :, None] * rng.standard_normal((n, 2, 2))
    Z = om + np.sqrt(d)[:, :, None] * rng.standard_normal((n, 2, 2))
    return m, np.asarray(m.link(Z)), om, V


def bench_adaptive(n: int = 32, seed: int = 0, tols=(1e-3, 1e-4, 1e-6), ref_tol: float = 1e-8) -> list[dict]:
    """The adaptive rule per regime and tol: CPU time per evaluation (one process), largest and
    median actual error against the same rule at ref_tol with 16 wedge nodes, largest estimate,
    and how many estimates fall below the actual error."""
    import time
    import warnings

    from ..denoise.output import difference

    rows = []
    for kind in ("se", "ridge1", "ridge2", "tail"):
        m, y, om, V = regime_points(kind, n, seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            HardmaxMixedDenoiser(m, tol=1e-3)(y[:1], om[:1], V[:1])  # compile
            t = time.process_time()
            ref = HardmaxMixedDenoiser(m, wedge=16, tol=ref_tol, max_regions=5000)(y, om, V)
            t_ref = (time.process_time() - t) / n
            for tol in tols:
                t = time.process_time()
                out = HardmaxMixedDenoiser(m, tol=tol)(y, om, V)
                dt = (time.process_time() - t) / n
                act = difference(out.g_out, out.dg_out, ref.g_out, ref.dg_out, out.log_z_out, ref.log_z_out)
                rows.append({"regime": kind, "tol": tol, "ms_per_eval": dt * 1e3, "ref_ms_per_eval": t_ref * 1e3,
                             "actual_max": float(act.max()), "actual_median": float(np.median(act)),
                             "estimate_max": float(out.error.max()), "under": int(np.sum(act > out.error)),
                             "above_tol": int(np.sum(out.error > tol)), "ref_estimate_max": float(ref.error.max()),
                             "n": n})
    return rows


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m aimsym.bench.hardmax", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="points from the two-layer model (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adaptive", action="store_true",
                    help="the adaptive rule (what a tol selects) per regime, against itself at 1e-8")
    args = ap.parse_args(argv)
    if args.adaptive:
        for r in bench_adaptive(n=args.n, seed=args.seed):
            print(f"{r['regime']:>6} tol {r['tol']:.0e}: {r['ms_per_eval']:.0f} ms / evaluation (reference "
                  f"{r['ref_ms_per_eval']:.0f} ms, its largest estimate {r['ref_estimate_max']:.1e}); actual error max "
                  f"{r['actual_max']:.1e} (median {r['actual_median']:.1e}); estimate max {r['estimate_max']:.1e}; "
                  f"estimate below actual {r['under']} of {r['n']}; above tol {r['above_tol']}")
        return 0
    for row in bench(n=args.n, seed=args.seed):
        print(f"polar {row['polar']}: {row['ms_per_eval']:.2f} ms / evaluation, "
              f"max rel. error of g_out {row['max_rel_err_g_out']:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
