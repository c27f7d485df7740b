"""A long randomised-QMC reference at one SE point, in resumable chunks, against the chamber rule.

    python -m aimsym.bench.reference --state DIR [--model attention_L4_T2] [--point 3] [--v 0.6]
        [--tol 1e-6] [--combinations 1.3e10] [--log-n 28] [--seeds 8] [--nu 30] [--chunk 20]
        [--variant KAPPA=3] [--variant RADIUS=11] ...

The chamber rule's claim at k = 6 (tol 1e-6 with a raised budget) needs an independent value with
a standard error of a few 1e-7, which the k >= 6 stage (``aimsym.denoise.rqmc``) reaches only
after hours of CPU. This command computes both and keeps its work on disk:

- the chamber rule's answer at the point (``chamber.npz``: values, estimate, CPU time), and with
  ``--variant`` its answer with one node-placement setting changed (``chamber_NAME_VALUE.npz``),
  which shows an error all its levels share;
- per seed, the proposal (the modal components after the population-Monte-Carlo refits) and, per
  scrambling, the moment sums of the points done so far (``qmc_<seed>.npz``), written after every
  chunk of 2^chunk points per scrambling. A stopped run resumes where it stopped: the Sobol
  engines are fast-forwarded past the points already summed, so the result is the one an
  uninterrupted run gives.

It prints the comparison (chamber minus QMC mean over the seeds, the seeds' standard error, the
largest |t| over the entries) after every round of chunks, and the seeds' standard error per
quantity. Points as in the slow test of tests/test_denoiser_certified.py: omega ~ N(0, 1 - v),
Z ~ N(omega, v I) from ``default_rng(point)``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import warnings
from pathlib import Path

import numpy as np

from aimsym.bench.denoiser import load_bench_model
from aimsym.denoise import modal, rqmc


def _save(path: Path, d: dict) -> None:
    """np.savez, atomically (a run stopped while writing leaves the former file)."""
    tmp = path.with_name(path.stem + ".part.npz")
    np.savez(tmp, **d)
    os.replace(tmp, path)


def se_point(model, point: int, v: float):
    """(omega (1, p, T), observation (1, n_obs), V) of the slow tests' SE point ``point``."""
    rng = np.random.default_rng(point)
    p, T = model.p, model.tokens
    V = v * np.eye(p)
    om = np.linalg.cholesky(np.eye(p) - V) @ rng.standard_normal((p, T))
    Z = om + np.linalg.cholesky(V) @ rng.standard_normal((p, T))
    return om[None], model.observation(Z)[None], V


def chamber(model, om, obs, V, tol: float, combinations: float, path: Path) -> dict:
    """The cascade's answer (chamber rule with the raised budget), computed once and kept."""
    if path.exists():
        return dict(np.load(path))
    t = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = model.denoiser(rule="modal", tol=tol, max_combinations=int(combinations))(None, om, V, obs=obs)
    res = {"g": out.g_out[0], "dg": out.dg_out[0], "lz": np.float64(out.log_z_out[0]),
           "error": np.float64(out.error[0]), "cpu": np.float64(time.process_time() - t)}
    _save(path, res)
    return res


# the chamber rule's node-placement settings a variant may change (aimsym.denoise.chamber)
VARIANTS = ("KAPPA", "RADIUS", "CRAD")


def parse_variant(text: str) -> tuple[str, float]:
    """'KAPPA=3' -> ('KAPPA', 3.0), with the name checked."""
    name, _, value = text.partition("=")
    name = name.strip().upper()
    if name not in VARIANTS or not value:
        raise SystemExit(f"error: --variant {text!r}: expected NAME=VALUE with NAME one of {', '.join(VARIANTS)}")
    try:
        v = float(value)
    except ValueError:
        raise SystemExit(f"error: --variant {text!r}: {value!r} is not a number") from None
    if not (math.isfinite(v) and v > 0):
        raise SystemExit(f"error: --variant {text!r}: the value must be a positive number")
    return name, v


def variant(m, om, obs, V, tol: float, combinations: float, state: Path, name: str, value: float) -> dict:
    """The chamber rule's answer with one node-placement setting changed (kept on disk): an error
    that the level differences cannot see, because every level shares the setting, moves with it."""
    from aimsym.denoise import chamber as rule

    old = getattr(rule, name)
    setattr(rule, name, value)
    try:
        return chamber(m, om, obs, V, tol, combinations, state / f"chamber_{name}_{value:g}.npz")
    finally:
        setattr(rule, name, old)


def moved(ref: dict, alt: dict) -> dict:
    """How far a variant's answer is from ref (g_out, dg_out relative to ref's size, at least 1)."""
    return {"lz": abs(float(alt["lz"]) - float(ref["lz"])),
            "g": float(np.abs(alt["g"] - ref["g"]).max() / max(1.0, np.abs(ref["g"]).max())),
            "dg": float(np.abs(alt["dg"] - ref["dg"]).max() / max(1.0, np.abs(ref["dg"]).max()))}


def seed_state(K, om, obs, V, params, seed: int, path: Path) -> dict:
    """A seed's proposal and sums (made on first use: the modes and two refits)."""
    if path.exists():
        return dict(np.load(path))
    nc, (cb, cm, cL, cla) = modal.modes(K, obs, om, V[None], params)
    nc, cb, cm, cL, cla = rqmc.proposal(K, obs, om, V[None], params, nc, cb, cm, cL, cla, np.arange(1), seed)
    pt = om.shape[1] * om.shape[2]
    st = {"nc": nc, "cb": cb, "cm": cm, "cL": cL, "cla": cla, "count": np.int64(0),
          "sums": np.zeros((rqmc.REPS, 1 + pt + pt * (pt + 1) // 2)), "fshift": np.float64(np.nan),
          "cpu": np.float64(0.0)}
    _save(path, st)
    return st


def advance(K, om, obs, V, params, st: dict, seed: int, n: int, nu: float) -> dict:
    """The next n points of each scrambling added to the seed's sums."""
    D = int(K.INTEGRAL_DIM)
    t = time.process_time()
    engines = rqmc.scramblings(seed, D, int(st["count"]))
    sums = st["sums"].copy()
    fs = np.empty(1)
    for r, eng in enumerate(engines):
        x, w = rqmc.t_points(eng, D, n, nu)
        tot = np.zeros((1, sums.shape[1]))
        K.modal_rule(obs, om, V[None], params, st["nc"], st["cb"], st["cm"], st["cL"], st["cla"], x, w,
                     np.arange(1), tot, fs, np.zeros((1, 0)))
        sums[r] += tot[0]
    return {**st, "sums": sums, "count": np.int64(int(st["count"]) + n), "fshift": np.float64(fs[0]),
            "cpu": np.float64(float(st["cpu"]) + time.process_time() - t)}


def _values(K, om, V, sums: np.ndarray, count: int, fshift: float):
    """(g, dg, log Z) of moment sums over count points."""
    g, dg, lz, status = rqmc._finish(K, om, V[None], np.arange(1), sums[None] / count, np.array([fshift]))
    if status[0] != 0:
        raise RuntimeError(f"QMC values: status {int(status[0])}")
    return g[0], dg[0], float(lz[0])


def seed_values(K, om, V, st: dict):
    """(g, dg, log Z) of one seed: the mean over its scramblings' sums."""
    return _values(K, om, V, st["sums"].mean(axis=0), int(st["count"]), float(st["fshift"]))


def scrambling_values(K, om, V, st: dict) -> list:
    """(g, dg, log Z) of each scrambling of one seed (replicates given the seed's proposal)."""
    return [_values(K, om, V, row, int(st["count"]), float(st["fshift"])) for row in st["sums"]]


# entries listed per quantity in the comparison (a symmetric dg_out pair counts twice)
WORST = 4


def _t(d: np.ndarray, se: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(se > 0, np.abs(d) / se, 0.0)


def compare(ref: dict, values: list, replicates: list | None = None) -> dict:
    """Chamber minus the seeds' mean, the seeds' standard error and the largest |t|, per quantity
    (g_out and dg_out relative to the chamber rule's size, at least 1: the denoiser's metric).
    With ``replicates`` (every scrambling of every seed) also their standard error of the mean and
    |t|, and per entry how many replicates lie below the chamber value (importance weights make
    the replicates right-skewed, so the t of the mean is a rough guide; a shift shows in both)."""
    out = {}
    s = len(values)
    for k, name in ((0, "g"), (1, "dg"), (2, "lz")):
        a = np.array([v[k] for v in values]).reshape(s, -1)
        ours = np.atleast_1d(ref[name]).ravel()
        scale = 1.0 if name == "lz" else max(1.0, float(np.abs(ours).max()))
        se = a.std(axis=0, ddof=1) / np.sqrt(s)
        d = ours - a.mean(axis=0)
        out[name] = {"difference": float(np.abs(d).max() / scale), "stderr": float(se.max() / scale),
                     "t_max": float(_t(d, se).max())}
        if replicates:
            r = np.array([v[k] for v in replicates]).reshape(len(replicates), -1)
            se_r = r.std(axis=0, ddof=1) / np.sqrt(len(replicates))
            t_r = _t(ours - r.mean(axis=0), se_r)
            below = (r < ours).sum(axis=0)
            out[name].update({"replicates": len(replicates), "stderr_replicates": float(se_r.max() / scale),
                              "t_max_replicates": float(t_r.max()), "below": below.tolist(),
                              # the entries furthest out in the replicates' view, each with both views
                              "worst": [{"entry": int(i), "difference": float(d[i] / scale), "t": float(_t(d, se)[i]),
                                         "t_replicates": float(t_r[i]), "below": int(below[i])}
                                        for i in np.argsort(-t_r, kind="stable")[:WORST]]})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", type=Path, required=True, help="directory of the kept work (made if missing)")
    ap.add_argument("--model", default="attention_L4_T2")
    ap.add_argument("--point", type=int, default=3)
    ap.add_argument("--v", type=float, default=0.6, help="V = v I")
    ap.add_argument("--tol", type=float, default=1e-6, help="the chamber rule's tol")
    ap.add_argument("--combinations", type=float, default=1.3e10, help="the chamber rule's max_combinations")
    ap.add_argument("--log-n", type=int, default=28, help="points per scrambling: 2^log_n")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--nu", type=float, default=30.0, help="degrees of freedom of the Student-t proposal")
    ap.add_argument("--chunk", type=int, default=20, help="points per scrambling per saved step: 2^chunk")
    ap.add_argument("--no-chamber", action="store_true", help="only the QMC (no comparison)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE",
                    help="also run the chamber rule with one of its node-placement settings changed "
                         f"({', '.join(VARIANTS)}; repeatable, each kept as chamber_NAME_VALUE.npz) and "
                         "print how far it moves from the default's answer")
    a = ap.parse_args(argv)
    variants = [parse_variant(v) for v in a.variant]  # (checked before any work)
    a.state.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(a, k) for k in ("model", "point", "v", "tol", "combinations", "seeds", "nu")}
    sfile = a.state / "settings.json"
    if sfile.exists() and json.loads(sfile.read_text()) != settings:
        raise SystemExit(f"error: --state {a.state} holds another run ({sfile.read_text().strip()}); use a new directory")
    sfile.write_text(json.dumps(settings))
    m = load_bench_model(a.model, c=1.0)
    K = modal.load(m.kernels)
    params = m.params_array()
    om, obs, V = se_point(m, a.point, a.v)
    ref = None if a.no_chamber else chamber(m, om, obs, V, a.tol, a.combinations, a.state / "chamber.npz")
    if ref is not None:
        print(f"chamber rule: log Z {float(ref['lz']):.10f}, estimate {float(ref['error']):.2e}, "
              f"CPU {float(ref['cpu']):.0f} s", flush=True)
    for name, value in variants:
        alt = variant(m, om, obs, V, a.tol, a.combinations, a.state, name, value)
        if ref is not None:
            print(f"chamber rule with {name} = {value:g}: " + ", ".join(
                f"{k} moves {d:.1e}" for k, d in moved(ref, alt).items()) + f" (estimate {float(alt['error']):.2e})",
                flush=True)
    states = [seed_state(K, om, obs, V, params, s, a.state / f"qmc_{s}.npz") for s in range(a.seeds)]
    target, step = 2 ** a.log_n, 2 ** a.chunk
    while True:
        done = min(int(st["count"]) for st in states)
        if done:
            values = [seed_values(K, om, V, st) for st in states]
            replicates = [v for st in states for v in scrambling_values(K, om, V, st)]
            cpu = sum(float(st["cpu"]) for st in states)
            line = f"{done} points x {rqmc.REPS} x {a.seeds} seeds, QMC CPU {cpu:.0f} s: log Z " \
                   f"{np.mean([v[2] for v in values]):.10f}"
            if ref is not None:
                c = compare(ref, values, replicates)
                line += "; " + ", ".join(f"{k}: chamber - QMC {c[k]['difference']:.2e} (se {c[k]['stderr']:.2e}, "
                                         f"|t| <= {c[k]['t_max']:.2f})" for k in ("lz", "g", "dg"))
                z = c["lz"]
                line += f"; log Z over the {z['replicates']} scramblings: se {z['stderr_replicates']:.2e}, " \
                        f"|t| {z['t_max_replicates']:.2f}, {z['below'][0]} below the chamber value"
                w = c["dg"]["worst"][0]
                line += f"; dg_out entry {w['entry']} (furthest over the scramblings): {w['difference']:.2e}, " \
                        f"|t| {w['t']:.2f} (seeds) {w['t_replicates']:.2f} (scramblings), {w['below']} below"
                (a.state / "comparison.json").write_text(json.dumps({"points": done, "cpu": cpu, **c}, indent=1))
            print(line, flush=True)
        if done >= target:
            return 0
        for s, st in enumerate(states):
            if int(st["count"]) == done:
                states[s] = advance(K, om, obs, V, params, st, s, min(step, target - done), a.nu)
                _save(a.state / f"qmc_{s}.npz", states[s])


if __name__ == "__main__":
    raise SystemExit(main())
