"""Benchmarks: ``python -m aimsym.bench.se [--figure]`` (numbers go to docs/performance.md).

Without options: one SE fixed point and one threshold of the two-layer T = 2 model (skip 1).
``--figure``: also the whole two-layer figure, by exactly the commands of docs/se.md (thresholds
at skip 1, 41-point alpha sweep, plot, 16-point phase diagram over skip in [0.25, 4]), timing each;
the figures are written to ``--figures`` (default docs/figures) and the data to ``--data``.
``--workers N`` is passed to the phase diagram (default: all cores, as in docs/se.md).
``--share``: instead, the share of one SE step's CPU time spent inside the denoiser, per model
(what a fused SE kernel could save at most).
"""

import argparse
import os
import shlex
import subprocess
import sys
import time

import numpy as np

from aimsym.model import load
from aimsym.smi import se, thresholds

L2 = "derivations/attention_L2_T2.toml"


def figure_commands(figures: str, data: str, workers: int | None = None) -> list[str]:
    th, db = f"{data}/se_L2_T2_thresholds_skip1.json", f"{data}/se_L2_T2_skip1.sqlite"
    pool = f" --workers {workers}" if workers else ""
    return [
        f"aimsym thresholds {L2} --set skip=1 --samples 32768 --pr-local --json > {th}",
        f"aimsym sweep {L2} --set skip=1 --alpha 0.1:1.1:41 --samples 1024 --tol 1e-3 --store {db} "
        f"--csv {data}/se_L2_T2_skip1.csv --json",
        f"aimsym plot {db} --thresholds {th} --title 'two layers, T = 2, skip 1' "
        f"--out {figures}/se_L2_T2_overlaps_skip1.png",
        f"aimsym thresholds {L2} --over skip=0.25:4:16 --samples 16384 --stair-samples 8192 --se-samples 1024 "
        f"--pr-local{pool} --out {data}/se_L2_T2_phase_diagram.json --figure {figures}/se_L2_T2_phase_diagram.png "
        f"--json > /dev/null",
    ]


def run_figure(figures: str, data: str, workers: int | None = None) -> float:
    os.makedirs(data, exist_ok=True)
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    total = 0.0
    for cmd in figure_commands(figures, data, workers):
        t = time.perf_counter()
        subprocess.run(cmd, shell=True, check=True, env=env, stderr=subprocess.DEVNULL)
        dt = time.perf_counter() - t
        total += dt
        print(f"{dt:7.1f} s  {cmd}", flush=True)
    print(f"whole two-layer figure: {total:.1f} s (goal 120 s)")
    return total


SHARE_CASES = (("attention_L2_T2", 4096), ("attention_L2_T3", 256), ("attention_L3_T2", 128))


def denoiser_share(name: str, samples: int, q: float = 0.5, steps: int = 3) -> tuple[float, float]:
    """CPU seconds of one SE output step (se_map) at Q = q on the last layer, and of the denoiser
    calls inside it (the rest: drawing Z, the observation, the accumulation)."""
    m = load(f"derivations/{name}.toml", skip=1.0)
    ch = se.make_channel(m, samples=samples, replicas=8, seed=0)
    Q = np.diag([0.0] * (m.p - 1) + [q])
    se.se_map(ch, Q, 0.5)  # compile, node tables
    den, inside = ch.den, [0.0]

    class Timed:
        def __getattr__(self, name):
            return getattr(den, name)

        def __call__(self, *a, **k):
            t = time.process_time()
            out = den(*a, **k)
            inside[0] += time.process_time() - t
            return out

    ch = se.Channel(ch.model, Timed(), ch.points)
    t = time.process_time()
    for _ in range(steps):
        se.se_map(ch, Q, 0.5)
    return (time.process_time() - t) / steps, inside[0] / steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--figure", action="store_true", help="also time the whole two-layer figure")
    ap.add_argument("--figures", default="docs/figures")
    ap.add_argument("--data", default="/tmp/aimsym_bench_se")
    ap.add_argument("--workers", type=int, default=None, help="processes of the phase diagram (default: all cores)")
    ap.add_argument("--share", action="store_true", help="share of an SE step spent in the denoiser")
    args = ap.parse_args(argv)
    if args.share:
        for name, n in SHARE_CASES:
            step, inside = denoiser_share(name, n)
            print(f"{name}, {n} points, Q = diag(0, ..., 0.5): SE step {1e3 * step:.1f} ms CPU, "
                  f"denoiser {1e3 * inside:.1f} ms ({100 * inside / step:.1f} %)", flush=True)
        return 0
    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores)")
    m = load(L2, skip=1.0)
    se.state_evolution(m, 0.5, samples=256, errors=False)  # compile / warm up
    t = time.perf_counter()
    r = se.state_evolution(m, 0.5, samples=4096, tol=1e-4, errors=False)
    print(f"SE fixed point L2_T2 skip=1 alpha=0.5: Q22={r.Q[1, 1]:.4f}±{r.Q_stderr[1, 1]:.4f} "
          f"({r.iterations} it) {time.perf_counter() - t:.1f} s", flush=True)
    t = time.perf_counter()
    th = thresholds.initial_threshold(m, samples=1 << 16)
    print(f"alpha_c L2_T2 skip=1: {th.alpha:.4f}±{th.stderr:.4f} {time.perf_counter() - t:.1f} s", flush=True)
    if args.figure:
        run_figure(args.figures, args.data, args.workers)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
