"""Benchmarks of the AIM solvers: ``python -m aimsym.bench.aim`` (numbers go to docs/performance.md).

- 100-point softmax SE curve (parametric, root-finding in Delta), cold caches;
- 100-point hardmax SE curve (T = 2, root-finding with continuation), cold caches;
- one m(Delta) evaluation (the spectral quadrature, CPU time incl. the edges), median of many;
- one AMP run at d = 150 (softmax, T = 2, rho = 0.5, alpha = 0.1): seconds per iteration, isotropic
  and exact Onsager forms.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def _clear_caches():
    from ..aim import spectral

    spectral._rie_mmse_cached.cache_clear()
    spectral._edges_cached.cache_clear()
    spectral._panels_cached.cache_clear()


def _timed(fn):
    """(wall seconds, CPU seconds of this process): the CPU time is the meaningful number on a
    shared, oversubscribed machine."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def bench_softmax_curve():
    from ..aim import se

    _clear_caches()
    return _timed(lambda: se.curve(np.linspace(0.002, 0.2, 100), 0.5, 2, "softmax"))


def bench_hardmax_curve():
    from ..aim import se

    _clear_caches()
    return _timed(lambda: se.curve(np.geomspace(0.01, 10, 100), 0.5, 2, "hardmax"))


def bench_rie_mmse(n=200):
    from ..aim.spectral import rie_mmse_scalar

    rng = np.random.default_rng(0)
    times = []
    for D, rho in zip(10 ** rng.uniform(-4, 1, n), rng.uniform(0.05, 2.0, n)):
        _clear_caches()
        t = time.process_time()
        rie_mmse_scalar(float(D), float(rho))
        times.append(time.process_time() - t)
    return float(np.median(times)), float(np.max(times))


def bench_amp(d=150, alpha=0.1, iterations=30, onsager="isotropic"):
    from ..aim import amp
    from ..aim import data as data_mod

    data = data_mod.generate(d, alpha, 0.5, 2, "softmax", seed=0)
    box = {}
    wall, cpu = _timed(lambda: box.update(out=amp.run(data, 2, "softmax", iterations=iterations, tol=0.0,
                                                      onsager=onsager)))
    n = box["out"].iterations + box["out"].rejected_steps
    return wall / n, cpu / n, n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-amp", action="store_true")
    args = p.parse_args(argv)
    res = {}
    res["softmax_curve_100_wall_s"], res["softmax_curve_100_cpu_s"] = bench_softmax_curve()
    res["rie_mmse_median_ms"], res["rie_mmse_max_ms"] = (1e3 * x for x in bench_rie_mmse())
    res["hardmax_curve_100_wall_s"], res["hardmax_curve_100_cpu_s"] = bench_hardmax_curve()
    if not args.skip_amp:
        (res["amp_d150_wall_s_per_iteration"], res["amp_d150_cpu_s_per_iteration"],
         res["amp_iterations"]) = bench_amp()
        (res["amp_exact_d150_wall_s_per_iteration"], res["amp_exact_d150_cpu_s_per_iteration"],
         res["amp_exact_iterations"]) = bench_amp(onsager="exact")
    import os

    res["load_average_1min"] = os.getloadavg()[0]
    from ..provenance import versions

    res["versions"] = versions()
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
