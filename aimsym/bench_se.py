"""Benchmarks: ``python -m aimsym.bench_se`` (numbers go to docs/performance.md)."""

import time

import aimsym
from aimsym import se, thresholds


def main():
    m = aimsym.load("derivations/attention_L2_T2.toml", skip=1.0)
    se.state_evolution(m, 0.5, samples=256, errors=False)  # compile / warm up
    t = time.perf_counter()
    r = se.state_evolution(m, 0.5, samples=4096, tol=1e-4, errors=False)
    print(f"SE fixed point L2_T2 skip=1 alpha=0.5: Q22={r.Q[1, 1]:.4f}±{r.Q_stderr[1, 1]:.4f} "
          f"({r.iterations} it) {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    th = thresholds.initial_threshold(m, samples=1 << 16)
    print(f"alpha_c L2_T2 skip=1: {th['alpha']:.4f}±{th['stderr']:.4f} {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
