"""Benchmark: ``python -m aimsym.bench.erm [--quick]``.

1. one fixed point (T = 2, kappa0 = 0.5, lam = 0.01, Delta = 0.5, alpha = 0.05);
2. a 50-point test-error curve (alpha in [0.01, 4], log grid, warm starts);
3. one Adam run at d = 100 (alpha = 0.5).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from ..erm.params import ERMParams
from ..erm.se import Accuracy, curve, fixed_point
from ..erm.train import train


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aimsym.bench.erm")
    ap.add_argument("--quick", action="store_true", help="10-point curve, Adam at d = 40")
    args = ap.parse_args(argv)
    p = ERMParams(tokens=2, kappa0=0.5, lam=0.01, Delta=0.5)
    acc = Accuracy()
    out = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "numpy": np.__version__, "load_avg": os.getloadavg()[0]}}
    t = time.perf_counter()
    fp = fixed_point(p, 0.05, acc)
    out["fixed_point"] = {"seconds": time.perf_counter() - t, "iterations": fp.iterations,
                          "test": fp.test, "test_error_bound": fp.stderr["test"]}
    n = 10 if args.quick else 50
    t = time.perf_counter()
    fps = curve(p, np.geomspace(0.01, 4.0, n), acc)
    out["curve"] = {"points": n, "seconds": time.perf_counter() - t,
                    "iterations": int(sum(f.iterations for f in fps)),
                    "all_converged": all(f.converged for f in fps)}
    d = 40 if args.quick else 100
    t = time.perf_counter()
    r = train(p, 0.5, d, seed=0)
    fp5 = fixed_point(p, 0.5, acc)
    out["adam"] = {"d": d, "n": r.n, "seconds": time.perf_counter() - t, "steps": r.steps,
                   "stop": r.stop, "test": r.test, "predicted_test": fp5.test,
                   "train": r.train, "predicted_train": fp5.train}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
