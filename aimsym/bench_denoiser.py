"""Benchmark of the compiled denoiser against a straightforward scipy ``nquad`` evaluation.

    python -m aimsym.bench_denoiser [--batch 100000] [--skip-nquad]

Measures, in one run: per-evaluation time of (g_out, dg_out, log_z_out) single-threaded
at several accuracies (error against a 256-node reference), the throughput of a batch on
all cores, the same for the three-layer T = 2 and two-layer T = 3 models, and one nquad
evaluation of the same quantities (log Z, E[Z | y]; tolerance 1e-10) for the ratio.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numba
import numpy as np
from scipy import integrate

import aimsym

ROOT = Path(__file__).resolve().parent.parent / "derivations"


def _timed(fn, repeat=3):
    best = np.inf
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def nquad_l2t2(h, omega, V, c, tol=1e-10):
    """log Z_out and E[Z | y] of the two-layer T = 2 model by nested adaptive quadrature."""
    Vinv = np.linalg.inv(V)
    logdet = np.linalg.slogdet(V)[1]

    def weight(u1, u2, s):
        e = np.exp(np.outer([u1, u2], [u1, u2]) - np.max(np.outer([u1, u2], [u1, u2]), axis=1, keepdims=True))
        M = c * np.eye(2) + e / e.sum(axis=1, keepdims=True)
        zl = np.linalg.solve(M, s * h)
        Z = np.array([[u1, u2], zl])
        d = Z - omega
        q = sum(d[:, t] @ Vinv @ d[:, t] for t in range(2))
        return np.exp(-0.5 * q - logdet - 2 * np.log(2 * np.pi)) / abs(np.linalg.det(M)), Z

    sd = np.sqrt(V[0, 0])
    lim = [[omega[0, t] - 12 * sd, omega[0, t] + 12 * sd] for t in range(2)]
    opts = {"epsabs": 1e-14, "epsrel": tol, "limit": 200}
    vals = []
    for k in range(5):
        tot = 0.0
        for s in (1.0, -1.0):
            tot += integrate.nquad(lambda a, b, s=s: (lambda w, Z: w * (1.0 if k == 0 else Z.reshape(-1)[k - 1]))(*weight(a, b, s)),
                                   lim, opts=[opts, opts])[0]
        vals.append(tot)
    return np.log(vals[0]), np.array(vals[1:]).reshape(2, 2) / vals[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=100_000)
    ap.add_argument("--skip-nquad", action="store_true")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    m = aimsym.load(ROOT / "attention_L2_T2.toml", skip=1.0)
    Z, y = m.sample(64, rng)
    om = 0.6 * rng.standard_normal((64, 2, 2))
    V = np.array([[1.0, 0.2], [0.2, 0.8]])
    ref = m.denoiser(nodes=256, polar=None)(y, om, V)
    print(f"threads available: {numba.config.NUMBA_NUM_THREADS}")
    print("two-layer T = 2, single thread, per evaluation of (g_out, dg_out, log_z_out):")
    numba.set_num_threads(1)
    rules = [("Gauss-Hermite", {"nodes": n, "polar": None}) for n in (16, 24, 48, 96, 192)]
    rules += [("polar", {"polar": pr}) for pr in ((8, 24), (10, 32), (14, 40), (18, 48))]
    for kind, acc in rules:
        den = m.denoiser(**acc)
        den(y[:1], om[:1], V)  # compile / load
        t, out = _timed(lambda: den(y, om, V))
        err = np.max(np.abs(out.g_out - ref.g_out) / np.max(np.abs(ref.g_out), axis=(1, 2), keepdims=True))
        print(f"  {kind:13s} {str(acc.get('polar') or acc['nodes']):9s}: {1e6 * t / len(y):9.1f} us   "
              f"max rel. error of g_out vs 256-node Gauss-Hermite {err:.1e}")
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    big = args.batch
    Zb, yb = m.sample(big, rng)
    omb = 0.6 * rng.standard_normal((big, 2, 2))
    for label, acc in (("GH 16 nodes", {"nodes": 16, "polar": None}), ("default (polar 18x48)", {})):
        den = m.denoiser(**acc)
        t, _ = _timed(lambda: den(yb, omb, V), repeat=1)
        print(f"  batch of {big} on {numba.get_num_threads()} threads, {label}: {t:.2f} s "
              f"({1e6 * t / big:.1f} us per evaluation)")
    for name, vals in (("attention_L3_T2", {"skip": 1.0}), ("attention_L2_T3", {"skip": 1.0})):
        mm = aimsym.load(ROOT / f"{name}.toml", **vals)
        Zm, ym = mm.sample(32, rng)
        omm = 0.6 * rng.standard_normal((32, mm.p, mm.tokens))
        den = mm.denoiser()
        den(ym[:1], omm[:1], np.eye(mm.p))
        numba.set_num_threads(1)
        t, _ = _timed(lambda: den(ym, omm, np.eye(mm.p)), repeat=1)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        print(f"{name}: default rule {den.accuracy}: {1e3 * t / len(ym):.2f} ms per evaluation (1 thread)")
    if not args.skip_nquad:
        h = m.observation(Z[:1])[0]
        t0 = time.perf_counter()
        lz, mean = nquad_l2t2(h, om[0], V, 1.0)
        t_nq = time.perf_counter() - t0
        den = m.denoiser()  # default: polar rule at this (moderate) V
        numba.set_num_threads(1)
        t_ex, out = _timed(lambda: den(y[:1], om[:1], V))
        g_nq = np.linalg.solve(V, mean - om[0])
        print(f"scipy nquad (tol 1e-10, log Z and E[Z|y] only): {t_nq:.1f} s per evaluation")
        print(f"aimsym default: {1e3 * t_ex:.2f} ms; ratio nquad / aimsym = {t_nq / t_ex:.0f}; "
              f"|g_out - g_nquad| / |g| = {np.max(np.abs(out.g_out[0] - g_nq)) / np.max(np.abs(g_nq)):.1e}")


if __name__ == "__main__":
    main()
