"""Benchmark of the compiled denoiser against a straightforward scipy ``nquad`` evaluation.

    python -m aimsym.bench.denoiser [--batch 100000] [--skip-nquad]
    python -m aimsym.bench.denoiser --modal-only [--modal-batch 1024] [--modal-check 8] [--modal-tol 1e-8]
    python -m aimsym.bench.denoiser --budget [--budget-model attention_L3_T2] [--budget-q 0.99] [--budget-n 16] [--budget-combos 6e6,4.1e7]
    python -m aimsym.bench.denoiser --mean-tol [--budget-model attention_L3_T2] [--budget-n 64]
    python -m aimsym.bench.denoiser --levels [--levels-models attention_L2_T3,attention_L3_T2] [--levels-n 8]

Measures, in one run: CPU time per evaluation of (g_out, dg_out, log_z_out) single-threaded
for the old (Legendre) and new (mapped) polar rules and Gauss-Hermite, in each SE regime, with
the error against a converged reference; a batch on all cores; the three-layer T = 2 and
two-layer T = 3 models; and one nquad evaluation of the same quantities (log Z, E[Z | y];
tolerance 1e-10) for the ratio. ``--modal`` / ``--modal-only``: the certified denoiser of every
bundled attention model with a reduction (the polar rule at k = 2, the chamber rule and its
cascade at k = 3, 4, the untied rule at k = 5) at SE-regime points, with the error against the
same denoiser at a 100x smaller tol and against the independent Gauss-Kronrod cubature of
tests/modal_reference.py at one point. Prints the load average (shared machines).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import numba
import numpy as np
from scipy import integrate

from aimsym.model import load
from aimsym.denoise.channel import DEFAULT_POLAR
from aimsym.denoise import rqmc
from aimsym.denoise.output import difference
from aimsym.derive.files import derivations_dir

ROOT = derivations_dir()  # the bundled models
# models the benchmark declares from a bundled one (k = 6: no bundled model has three blocks)
DECLARED = {"attention_L4_T2": ("attention_L3_T2", "layers = 3", "layers = 4"),
            "attention_L2_T3_heads2": ("attention_L2_T2_heads2", "tokens = 2", "tokens = 3")}


def load_bench_model(name: str, **params):
    """A bundled derivation, or one of ``DECLARED`` (a bundled file with one line changed)."""
    if name not in DECLARED:
        return load(ROOT / f"{name}.toml", **params)
    from aimsym.derive.spec import loads

    base, old, new = DECLARED[name]
    text = (ROOT / f"{base}.toml").read_text()
    assert old in text, (base, old)
    text = text.replace(old, new).replace(f'name = "{base}"', f'name = "{name}"')
    return load(loads(text, default_name=name), **params)
# the default rule without the error control (model.denoiser(tol=None))
FIXED_DEFAULT = (f"mapped {DEFAULT_POLAR['sinh']} fixed (default rule, tol=None)", {"tol": None})


def _timed(fn, repeat=3, clock=time.perf_counter):
    """Best of ``repeat`` timings of fn() on ``clock`` (wall by default; ``time.process_time`` for
    the CPU time of this process: with single-threaded numba, CPU time = work, whatever the load)."""
    best = np.inf
    for _ in range(repeat):
        t = clock()
        out = fn()
        best = min(best, clock() - t)
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


# (scale of omega per layer, V) along the SE path (omega ~ N(0, Q), V = I - Q): moderate, last
# layer nearly known (staircase), first layer half learned after it, both nearly known
SE_PATH = [
    (np.array([0.6, 0.6]), np.array([[1.0, 0.2], [0.2, 0.8]])),
    (np.array([0.1, 0.97]), np.diag([1.0, 0.05])),
    (np.array([0.7, 0.99]), np.diag([0.5, 0.02])),
    (np.array([0.99, 0.99]), 0.02 * np.eye(2)),
]


def _points(m, rng, regimes, per):
    ys, oms, Vs = [], [], []
    for scale, V in regimes:
        for _ in range(per):
            om = scale[:, None] * rng.standard_normal((2, 2))
            ys.append(m.link(om + np.linalg.cholesky(V) @ rng.standard_normal((2, 2))))
            oms.append(om)
            Vs.append(V)
    return np.array(ys), np.array(oms), np.array(Vs)


def _rel_err(out, ref):
    n = len(ref.g_out)
    gs = np.maximum(1.0, np.abs(ref.g_out).reshape(n, -1).max(axis=1))
    ds = np.maximum(1.0, np.abs(ref.dg_out).reshape(n, -1).max(axis=1))
    return np.maximum(np.abs(out.g_out - ref.g_out).reshape(n, -1).max(axis=1) / gs,
                      np.abs(out.dg_out - ref.dg_out).reshape(n, -1).max(axis=1) / ds)


def _load() -> str:
    try:
        return "load average " + ", ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:  # pragma: no cover
        return "load average unavailable"


SE_LABELS = ["moderate", "V=diag(1,.05)", "V=diag(.5,.02)", "V=.02 I"]


def bench_budget(name="attention_L3_T2", n=16, q=0.99,
                 budgets=((100_000, None), (2_000, None), (2_000, 6_000_000), (2_000, 41_000_000))):
    """The SE's budgets for the certified rule (smi.se.SE_CERTIFIED_REGIONS, _COMBINATIONS): CPU
    time and error estimate per sample, one thread, a model (skip 1) at Q = diag(0, .., 0, q) (the
    last layer nearly known: the regime of a staircase branch), tol 1e-3, SE points
    omega ~ N(0, Q), Z ~ N(omega, I - Q)."""
    m = load(ROOT / f"{name}.toml", skip=1.0)
    rng = np.random.default_rng(0)
    p, T = m.p, m.tokens
    Q = np.diag([0.0] * (p - 1) + [q])
    V = np.eye(p) - Q
    om = np.sqrt(Q) @ rng.standard_normal((n, p, T))
    obs = np.array([m.observation(z) for z in om + np.sqrt(V) @ rng.standard_normal((n, p, T))])
    numba.set_num_threads(1)
    print(f"{name} (skip 1), Q = diag(0, .., 0, {q}), {n} SE points, tol 1e-3, one thread; {_load()}")
    for budget, combos in budgets:
        den = m.denoiser(tol=1e-3, max_regions=budget, max_combinations=combos)
        den(None, om[:1], V[None], obs=obs[:1])  # compile / load
        times, errs = [], []
        for i in range(n):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                t, out = _timed(lambda i=i: den(None, om[i:i + 1], V[None], obs=obs[i:i + 1]), repeat=1,
                                clock=time.process_time)
            times.append(t)
            errs.append(float(out.error[0]))
        times, errs = np.array(times), np.array(errs)
        slow = times > 1.0
        above = errs > 1e-3
        print(f"  budget {budget} regions, {den.max_combinations:.1e} node combinations: mean {1e3 * times.mean():.0f} ms "
              f"per sample; {int(np.sum(~slow))} samples at {1e3 * times[~slow].min():.0f}-{1e3 * times[~slow].max():.0f} ms"
              + (f", {int(slow.sum())} at {times[slow].min():.1f}-{times[slow].max():.1f} s" if slow.any() else "")
              + f"; above tol: {int(above.sum())}"
              + (f" (estimates {errs[above].min():.1e}-{errs[above].max():.1e})" if above.any() else "")
              + f"; mean estimate {errs.mean():.1e}", flush=True)


def bench_mean_tol(name="attention_L3_T2", n=64, qs=((0.0, 0.0, 0.98), (0.2, 0.2, 0.99)), seeds=(1, 2)):
    """The SE's batch target (``mean_tol``, smi.se.denoiser_accuracy): one SE batch of n points per
    (Q, seed), omega ~ N(0, Q), Z ~ N(omega, I - Q), with the SE's denoiser settings, with and
    without mean_tol; CPU time (one thread), integrand evaluations, mean and largest estimate, and
    the largest distance between the two results in units of their two estimates."""
    from aimsym.smi.se import denoiser_accuracy

    m = load(ROOT / f"{name}.toml", skip=1.0)
    p, T = m.p, m.tokens
    numba.set_num_threads(1)
    acc = denoiser_accuracy(m, samples=512)
    print(f"{name} (skip 1), {n} SE points per batch, SE settings {acc}, one thread; {_load()}")
    for q in qs:
        for seed in seeds:
            rng = np.random.default_rng(seed)
            Q = np.diag(q)
            V = np.eye(p) - Q
            om = np.sqrt(Q) @ rng.standard_normal((n, p, T))
            obs = np.array([m.observation(z) for z in om + np.sqrt(V) @ rng.standard_normal((n, p, T))])
            outs, line = [], []
            for label, a in (("with mean_tol", acc), ("per sample", {k: v for k, v in acc.items() if k != "mean_tol"})):
                den = m.denoiser(**a)
                den(None, om[:1], V, obs=obs[:1])  # compile / load
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    t, out = _timed(lambda den=den: den(None, om, V, obs=obs), repeat=1, clock=time.process_time)
                e = np.asarray(out.error)
                outs.append(out)
                line.append(f"{label}: {t:.2f} s, {np.sum(out.ess):.2e} evaluations, mean estimate {e.mean():.1e}, "
                            f"largest {e.max():.1e}, {int(np.sum(e > acc['tol']))} above tol")
            a, b = outs
            d = difference(a.g_out, a.dg_out, b.g_out, b.dg_out, a.log_z_out, b.log_z_out)
            ratio = float(np.max(d / (np.asarray(a.error) + np.asarray(b.error))))
            print(f"  Q = diag{tuple(q)}, seed {seed}: " + "; ".join(line)
                  + f"; largest distance / (sum of the estimates) {ratio:.2f}", flush=True)


def bench_levels(names, n=8, top=6):
    """Each chamber level alone (node tables warm, one call per level on n SE points, Q = 0.4 I):
    CPU per sample and its actual error against the finest level ``top``. This is the cost of
    meeting a tol with an error estimate that cost nothing: a floor under the certified rule's
    cost, which also evaluates the level before for its estimate. Returns the printed rows."""
    from aimsym.denoise import chamber, modal

    rows = []
    print(f"chamber levels alone, {n} SE points (Q = 0.4 I), 1 thread, warm tables; {_load()}")
    for name in names:
        m = load_bench_model(name, c=1.0)
        K = modal.load(m.kernels)
        rng = np.random.default_rng(7)
        p, T = m.p, m.tokens
        om = np.sqrt(0.4) * rng.standard_normal((n, p, T))
        obs = np.array([m.observation(z) for z in om + np.sqrt(0.6) * rng.standard_normal((n, p, T))])
        V, prm = 0.6 * np.eye(p)[None], m.params_array()
        runs = []
        for lv in range(top + 1):
            def call(lv=lv):
                return chamber.evaluate(K, obs, om, V, prm, lv, np.ones(n))
            call()  # node tables built and cached
            t, (g, dg, ex, st) = _timed(call, repeat=1, clock=time.process_time)
            assert not st.any(), (name, lv, st)
            runs.append((g, dg, ex, t / n))
        ref = runs[top]
        for lv, (g, dg, ex, t) in enumerate(runs[:top]):
            e = difference(ref[0], ref[1], g, dg, ref[2][:, 0], ex[:, 0])
            rows.append({"model": name, "level": lv, "combinations": float(np.median(ex[:, 1])), "cpu": t,
                         "error_median": float(np.median(e)), "error_max": float(e.max())})
            print(f"  {name} level {lv} {chamber.LEVELS[lv]}: {np.median(ex[:, 1]):.3g} node combinations, "
                  f"{t * 1e3:.2f} ms CPU per sample ({t / np.median(ex[:, 1]) * 1e9:.0f} ns each), "
                  f"actual error median {np.median(e):.1e}, max {e.max():.1e}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=100_000)
    ap.add_argument("--per", type=int, default=8, help="points per SE regime")
    ap.add_argument("--skip-nquad", action="store_true")
    ap.add_argument("--skip-others", action="store_true", help="skip the three-layer and T = 3 models")
    ap.add_argument("--modal", action="store_true", help="also benchmark rule='modal' (k = 3, 4)")
    ap.add_argument("--modal-only", action="store_true", help="only benchmark rule='modal'")
    ap.add_argument("--modal-batch", type=int, default=8, help="SE-regime points per model for rule='modal' (timed)")
    ap.add_argument("--modal-check", type=int, default=8,
                    help="of these, the points also computed at tol/100 for the actual error")
    ap.add_argument("--untied-tol", type=float, default=1e-4,
                    help="tol for attention_L2_T2_untied in --modal-models (its rule reaches ~1e-5)")
    ap.add_argument("--modal-tol", type=float, default=1e-8)
    ap.add_argument("--modal-models",
                    default="attention_L2_T2,attention_L2_T3,attention_L3_T2,attention_L2_T2_heads2,attention_L2_T2_untied",
                    help="comma-separated bundled derivations, or the declared k = 6 models " + ", ".join(DECLARED))
    ap.add_argument("--modal-reference", action="store_true", help="also time the independent cubature (1 point)")
    ap.add_argument("--budget", action="store_true",
                    help="only the SE's budgets: a model at Q = diag(0, .., 0, q), tol 1e-3, per sample")
    ap.add_argument("--budget-model", default="attention_L3_T2", help="derivation for --budget")
    ap.add_argument("--budget-q", type=float, default=0.99, help="the last layer's overlap for --budget")
    ap.add_argument("--budget-n", type=int, default=None, help="SE points for --budget (default 16) or --mean-tol (64)")
    ap.add_argument("--budget-combos", default=None,
                    help="comma-separated node-combination budgets for --budget (2 000 regions each); "
                         "default: the four pairs of the table in docs/performance.md")
    ap.add_argument("--mean-tol", action="store_true",
                    help="only the SE's batch target mean_tol: SE batches with and without it (three layers)")
    ap.add_argument("--levels", action="store_true",
                    help="only the chamber rule's levels alone: CPU and actual error per level (k = 3, 4)")
    ap.add_argument("--levels-models", default="attention_L2_T3,attention_L3_T2,attention_L2_T2_heads2")
    ap.add_argument("--levels-n", type=int, default=8, help="SE points per model for --levels")
    args = ap.parse_args(argv)
    if args.levels:
        bench_levels(args.levels_models.split(","), args.levels_n)
        return
    if args.mean_tol:
        bench_mean_tol(args.budget_model, args.budget_n or 64)
        return
    if args.budget:
        pairs = None if args.budget_combos is None else \
            tuple((2_000, int(float(c))) for c in args.budget_combos.split(","))
        bench_budget(args.budget_model, args.budget_n or 16, args.budget_q,
                     **({} if pairs is None else {"budgets": pairs}))
        return
    if args.modal or args.modal_only:
        bench_modal(args)
        if args.modal_only:
            return
    rng = np.random.default_rng(0)
    m = load(ROOT / "attention_L2_T2.toml", skip=1.0)
    print(f"threads available: {numba.config.NUMBA_NUM_THREADS}; {_load()}")
    print("two-layer T = 2 (skip 1), single thread, CPU microseconds per evaluation of (g_out, dg_out, log_z_out);")
    print("error = max over points of |g_out, dg_out - reference| / max(1, size) and |log_z_out - reference|,")
    print("reference = mapped polar rule (48, 120) (agrees with the Legendre rule (60, 160) to ~1e-13)")
    sets = {"moderate V (32)": _points(m, rng, SE_PATH[:1], 32)}
    for lab, reg in zip(SE_LABELS, SE_PATH):
        sets[f"SE {lab}"] = _points(m, rng, [reg], args.per)
    refs = {k: m.denoiser(polar=(48, 120), nodes=48, tol=None)(*v) for k, v in sets.items()}

    def err(out, ref):
        e = _rel_err(out, ref)
        return float(np.max(np.maximum(e, np.abs(out.log_z_out - ref.log_z_out))))

    rules = [("Gauss-Hermite 16", {"nodes": 16, "polar": None}),
             ("Legendre (8, 24) [old SE]", {"polar": (8, 24), "polar_map": "legendre", "tol": None}),
             ("Legendre (18, 48) [old fixed]", {"polar": (18, 48), "polar_map": "legendre", "tol": None}),
             ("Legendre, tol 1e-8 [old default]", {"polar": (18, 48), "polar_map": "legendre", "tol": 1e-8})]
    rules += [(f"mapped {pr}", {"polar": pr, "tol": None}) for pr in ((6, 16), (8, 24), (10, 24), (12, 32))]
    rules += [("mapped, tol 1e-8 [default]", {})]
    numba.set_num_threads(1)
    print(f"  {'rule':34s} " + " ".join(f"{k:>24s}" for k in sets))
    for label, acc in rules:
        den = m.denoiser(**acc)
        row = []
        for k, (y, om, V) in sets.items():
            den(y[:1], om[:1], V[:1])  # compile / load
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                t, out = _timed(lambda: den(y, om, V), repeat=3, clock=time.process_time)
            row.append(f"{1e6 * t / len(y):8.0f} us, err {err(out, refs[k]):7.0e}")
        print(f"  {label:34s} " + " ".join(f"{r:>24s}" for r in row), flush=True)
    print(f"  ({_load()})")
    # per evaluation without the per-call Python overhead (~0.2-0.3 ms per call of the default
    # denoiser, ~10 us per point in the 32-point rows above): a 1024-point batch on one thread;
    # cold = a fresh denoiser (node tables built in the call), warm = the tables cached
    yk, omk, Vk = _points(m, rng, SE_PATH[:1], 1024)
    per_eval = {}
    for label, acc in (FIXED_DEFAULT, ("mapped, tol 1e-8 [default]", {})):
        den = m.denoiser(**acc)
        den(yk[:1], omk[:1], Vk[0])  # compile / load
        den._tables.clear()
        t_cold, _ = _timed(lambda: den(yk, omk, Vk[0]), repeat=1, clock=time.process_time)
        t_warm, _ = _timed(lambda: den(yk, omk, Vk[0]), repeat=3, clock=time.process_time)
        per_eval[label] = t_warm / 1024
        print(f"  1 thread, batch of 1024 (moderate V), {label}: {1e6 * t_cold / 1024:.1f} us cold, "
              f"{1e6 * t_warm / 1024:.1f} us warm per evaluation", flush=True)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    big = args.batch
    if big > 0:
        yb, omb, Vb = _points(m, rng, SE_PATH[:1], big)
        for label, acc in (("Gauss-Hermite 16", {"nodes": 16, "polar": None}), FIXED_DEFAULT,
                           ("mapped, tol 1e-8 [default]", {})):
            den = m.denoiser(**acc)
            den(yb[:2], omb[:2], Vb[0])
            t0, c0 = time.perf_counter(), time.process_time()
            den(yb, omb, Vb[0])
            t, c = time.perf_counter() - t0, time.process_time() - c0
            print(f"  batch of {big} (moderate V) on {numba.get_num_threads()} threads, {label}: {t:.2f} s wall, "
                  f"{c:.2f} s CPU ({1e6 * t / big:.1f} us wall per evaluation; {_load()})", flush=True)
    if not args.skip_others:
        for name, vals in (("attention_L3_T2", {"skip": 1.0}), ("attention_L2_T3", {"skip": 1.0})):
            mm = load(ROOT / f"{name}.toml", **vals)
            Zm, ym = mm.sample(16, rng)
            omm = 0.6 * rng.standard_normal((16, mm.p, mm.tokens))
            numba.set_num_threads(1)
            for acc in ({"tol": None}, {}):
                den = mm.denoiser(**acc)
                den(ym[:1], omm[:1], np.eye(mm.p))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    t, out = _timed(lambda: den(ym, omm, np.eye(mm.p), error=True), repeat=2, clock=time.process_time)
                print(f"{name}: nodes {den.nodes}, tol {den.tol}: {1e3 * t / len(ym):.2f} ms CPU per evaluation "
                      f"(1 thread, with the error estimate), estimated error max {np.max(out.error):.0e}", flush=True)
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    if not args.skip_nquad:
        y, om, V = sets["moderate V (32)"]
        h = m.denoiser().observe(y[:1])[0]
        t0 = time.perf_counter()
        lz, mean = nquad_l2t2(h, om[0], V[0], 1.0)
        t_nq = time.perf_counter() - t0
        numba.set_num_threads(1)
        g_nq = np.linalg.solve(V[0], mean - om[0])
        for label, acc, key in (("default (tol 1e-8)", {}, "mapped, tol 1e-8 [default]"), (*FIXED_DEFAULT, FIXED_DEFAULT[0])):
            den = m.denoiser(**acc)
            den(y[:1], om[:1], V[0])
            t_ex, out = _timed(lambda: den(y[:1], om[:1], V[0]), clock=time.process_time)
            batch = (f"; per evaluation in the 1024 batch above {1e6 * per_eval[key]:.1f} us: ratio "
                     f"{t_nq / per_eval[key]:.2g}") if key in per_eval else ""
            print(f"scipy nquad (tol 1e-10, log Z and E[Z|y] only): {t_nq:.1f} s per evaluation; aimsym {label}: "
                  f"one call of one point (Python entry included) {1e3 * t_ex:.3f} ms: ratio {t_nq / t_ex:.0f}{batch}; "
                  f"|g_out - g_nquad| / |g| = {np.max(np.abs(out.g_out[0] - g_nq)) / np.max(np.abs(g_nq)):.1e}")
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    print(_load())


def _head(out, n):
    """The first n samples of a DenoiserOutput (g_out, dg_out only, for _rel_err)."""
    from types import SimpleNamespace

    return SimpleNamespace(g_out=out.g_out[:n], dg_out=out.dg_out[:n])


def bench_modal(args):
    """The certified denoiser of every reduced dimension per evaluation (one thread, CPU time) on
    SE-regime points: omega ~ N(0, Q), Z ~ N(omega, I - Q), Q = 0.4 I. rule='modal' (the chamber
    rule, the fast path, the adaptive cubature; for two layers at T = 2 the default polar rule);
    the actual error against the same denoiser at tol / 100 on the first ``--modal-check`` points
    (and its own estimate), and optionally against the independent cubature at the first point."""
    import sys

    numba.set_num_threads(1)
    print(f"certified denoiser, {args.modal_batch} SE points (Q = 0.4 I), 1 thread; {_load()}")
    for name in args.modal_models.split(","):
        m = load_bench_model(name, c=1.0)
        p, T = m.p, m.tokens
        rng = np.random.default_rng(17)
        n, nc = args.modal_batch, min(args.modal_check, args.modal_batch)
        tol = args.untied_tol if name.endswith("untied") else args.modal_tol
        V = 0.6 * np.eye(p)
        om = np.sqrt(0.4) * rng.standard_normal((n, p, T))
        Z = om + np.sqrt(0.6) * rng.standard_normal((n, p, T))
        obs = m.observation(Z)
        kw = {} if name == "attention_L2_T2" else {"rule": "modal"}
        den = m.denoiser(tol=tol, **kw)
        den(None, om[:1], V, obs=obs[:1])  # compile / load
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            t, out = _timed(lambda: den(None, om, V, obs=obs), repeat=1, clock=time.process_time)
            rqmc.SEED = 1  # (the check at k >= 6 must not share the randomised-QMC stage's points)
            try:
                tr, ref = _timed(lambda: m.denoiser(tol=tol / 100, **kw)(None, om[:nc], V, obs=obs[:nc]), repeat=1,
                                 clock=time.process_time)
            finally:
                rqmc.SEED = 0  # (the default)
        e = np.maximum(_rel_err(_head(out, nc), ref), np.abs(out.log_z_out[:nc] - ref.log_z_out))
        print(f"  {name} (k = {den.dim}, tol {tol:g}): {1e3 * t / n:.2f} ms CPU per evaluation, median "
              f"evaluations {np.median(out.ess):.0f}; estimate max {np.max(out.error):.1e}, above tol "
              f"{int(np.sum(out.error > tol))}/{n}; error vs tol/100 at {nc} points: max {e.max():.1e}, actual <= "
              f"estimate at {np.mean(e <= out.error[:nc] + ref.error):.0%} ({1e3 * tr / nc:.1f} ms per point)",
              flush=True)
        if args.modal_reference and name in ("attention_L2_T3", "attention_L3_T2", "attention_L2_T2_heads2"):
            sys.path.insert(0, str(ROOT.parent / "tests"))
            from modal_reference import h_of, outputs, reference

            h = h_of(name, Z[0], 1.0)
            t0 = time.process_time()
            lz, mean, second, status = reference(name, h, om[0], V, 1.0, rtol=tol / 10)
            t_ref = time.process_time() - t0
            g, dg = outputs(V, om[0], mean, second)
            o1 = den(None, om[:1], V, obs=h[None])
            err = max(np.abs(o1.g_out[0] - g).max() / max(1, np.abs(g).max()),
                      np.abs(o1.dg_out[0] - dg).max() / max(1, np.abs(dg).max()), abs(o1.log_z_out[0] - lz))
            print(f"    independent cubature (gk21, rtol {tol / 10:g}, {status}): {t_ref:.1f} s CPU, "
                  f"ratio {t_ref / (t / n):.0f}; certified denoiser vs it: {err:.1e} (estimate {o1.error[0]:.1e})",
                  flush=True)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)

if __name__ == "__main__":
    raise SystemExit(main())
