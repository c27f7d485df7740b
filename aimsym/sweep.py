"""Sweeps of the SE over alpha and model parameters, with a resumable SQLite store.

Layout: one *chain* per parameter combination runs the alpha grid in order, warm-starting each
point from the previous fixed point. Chains run in a local process pool (default) or on a Dask
distributed cluster (``scheduler=ADDRESS``). Every finished point is committed to the SQLite file
at once (one row per key: model hash, alpha, init, samples, replicas, seed, nodes), so a killed
sweep loses at most the points in flight and a re-run skips what is stored.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import sqlite3
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

from .errors import AimsymError

_SCHEMA = """CREATE TABLE IF NOT EXISTS points (
    key TEXT PRIMARY KEY, model_hash TEXT, params TEXT, alpha REAL, init TEXT, record TEXT)"""


def _connect(path):
    con = sqlite3.connect(str(path), timeout=60)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute(_SCHEMA)
    return con


def point_key(model_hash, alpha, init, opts) -> str:
    return json.dumps([model_hash, round(float(alpha), 12), init, opts], sort_keys=True)


def finished(path, keys) -> dict:
    with _connect(path) as con:
        rows = con.execute("SELECT key, record FROM points").fetchall()
    keys = set(keys)
    return {k: json.loads(r) for k, r in rows if k in keys}


def run_chain(model_path, params: dict, alphas, init: str, opts: dict, store: str) -> int:
    """Run one alpha chain (warm starts), storing each point as soon as it is done."""
    import aimsym
    from .se import make_channel, state_evolution

    model = aimsym.load(model_path, **params)
    keys = [point_key(model.hash(), a, init, opts) for a in alphas]
    done = finished(store, keys)
    todo = [(a, k) for a, k in zip(alphas, keys) if k not in done]
    if not todo:
        return 0
    ch = make_channel(model, samples=opts["samples"], replicas=opts["replicas"], seed=opts["seed"],
                      nodes=opts["nodes"])
    prev = None
    for a, k in zip(alphas, keys):
        if k in done:
            prev = np.array(done[k]["Q"])
            continue
        start = init if prev is None or init == "informed" else np.maximum(prev, 1e-4 * np.eye(model.p))
        res = state_evolution(model, a, init=start, channel=ch, seed=opts["seed"], tol=opts["tol"])
        rec = res.to_dict()
        rec["init"] = init
        rec["params"] = params
        prev = res.Q
        with _connect(store) as con:
            con.execute("INSERT OR IGNORE INTO points VALUES (?, ?, ?, ?, ?, ?)",
                        (k, model.hash(), json.dumps(params, sort_keys=True), float(a), init,
                         json.dumps(rec, default=_jsonable)))
    return len(todo)


def _jsonable(o):
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(type(o).__name__)


def grid(params: dict[str, list[float]]) -> list[dict]:
    names = sorted(params)
    return [dict(zip(names, vals)) for vals in itertools.product(*(params[n] for n in names))] or [{}]


def run_sweep(model_path, alphas, *, params: dict | None = None, inits=("uninformed",), store="sweep.sqlite",
              samples=2048, replicas=8, seed=0, nodes=None, tol=1e-4, workers=None, scheduler=None,
              progress=True) -> int:
    """Run (or resume) the sweep; returns the number of points computed in this call."""
    alphas = sorted(float(a) for a in alphas)
    if not alphas or any(a < 0 for a in alphas):
        raise AimsymError("alpha", "need a non-empty grid of alpha >= 0")
    opts = {"samples": int(samples), "replicas": int(replicas), "seed": int(seed), "nodes": nodes, "tol": tol}
    jobs = [(str(model_path), p, alphas, init, opts, str(store)) for p in grid(params or {}) for init in inits]
    _connect(store).close()
    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), desc="SE chains", disable=not progress)
    n = 0
    if scheduler:
        try:
            from dask.distributed import Client, as_completed as dask_completed
        except ImportError:
            raise AimsymError("--scheduler", "needs the dask extra: pip install 'aimsym[dask]'") from None
        client = scheduler if hasattr(scheduler, "submit") else Client(scheduler)
        futs = [client.submit(run_chain, *j, pure=False) for j in jobs]
        for f in dask_completed(futs):
            n += f.result()
            bar.update()
    elif workers == 1 or len(jobs) == 1:
        for j in jobs:
            n += run_chain(*j)
            bar.update()
    else:
        # spawn, not fork: numba's OpenMP threading layer does not survive fork
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as ex:
            for f in as_completed([ex.submit(run_chain, *j) for j in jobs]):
                n += f.result()
                bar.update()
    bar.close()
    return n


def table(store) -> list[dict]:
    """Tidy rows (one per point) from the store, sorted by parameters, init and alpha."""
    with _connect(store) as con:
        rows = con.execute("SELECT model_hash, params, alpha, init, record FROM points").fetchall()
    out = []
    for h, params, alpha, init, rec in rows:
        r = json.loads(rec)
        row = {"model_hash": h, **json.loads(params), "alpha": alpha, "init": init}
        Q, Qs = np.array(r["Q"]), np.array(r["Q_stderr"])
        for i in range(Q.shape[0]):
            for j in range(i, Q.shape[0]):
                row[f"Q_{i}{j}"], row[f"Q_stderr_{i}{j}"] = Q[i, j], Qs[i, j]
        for i, e in enumerate(r["errors"]["layers"]):
            row[f"error_layer{i + 1}"] = e
        pe = r["errors"].get("prediction", {})
        row.update({f"prediction_{k}": v for k, v in pe.items()})
        prov = r["provenance"]
        row.update(free_entropy=r["free_entropy"], free_entropy_stderr=r["free_entropy_stderr"],
                   iterations=r["iterations"], converged=r["converged"], seed=prov["seed"],
                   samples=r["accuracy"]["samples"], nodes=r["accuracy"].get("nodes_per_dim"),
                   versions=json.dumps(prov["versions"], sort_keys=True), created=prov["created"])
        out.append(row)
    out.sort(key=lambda d: (d["model_hash"], d["init"], d["alpha"]))
    return out


def export(store, csv_path=None, parquet_path=None) -> list[dict]:
    rows = table(store)
    if csv_path:
        import csv

        cols = list(dict.fromkeys(k for r in rows for k in r))
        with open(csv_path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)
    if parquet_path:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise AimsymError("--parquet", "needs the parquet extra: pip install 'aimsym[parquet]'") from None
        pq.write_table(pa.Table.from_pylist(rows), parquet_path)
    return rows


# ----------------------------------------------------------------------------- CLI
def register_cli(sub) -> None:
    p = sub.add_parser("sweep", help="SE over a grid of alpha (and parameters); resumable")
    p.add_argument("model")
    p.add_argument("--alpha", required=True, help="START:STOP:NUM (linspace) or comma-separated values")
    p.add_argument("--set", action="append", metavar="NAME=V1[,V2...]", help="parameter value(s) (repeatable)")
    p.add_argument("--init", default="uninformed", help="uninformed, informed or both (comma-separated)")
    p.add_argument("--store", default="sweep.sqlite")
    p.add_argument("--csv", default=None)
    p.add_argument("--parquet", default=None)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--scheduler", default=None, help="Dask distributed scheduler ADDRESS")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd)


def parse_grid(text: str) -> list[float]:
    try:
        if ":" in text:
            a, b, n = text.split(":")
            return np.linspace(float(a), float(b), int(n)).tolist()
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise AimsymError("--alpha", f"expected START:STOP:NUM or comma-separated numbers, got {text!r}") from None


def _cmd(args) -> int:
    from .cli import print_json

    if not Path(args.model).is_file():
        raise AimsymError("model", f"no such file: {args.model}")
    params = {}
    for item in args.set or ():
        k, _, v = item.partition("=")
        if not v:
            raise AimsymError("--set", f"expected NAME=V1[,V2...], got {item!r}")
        params[k.strip()] = [float(x) for x in v.split(",")]
    inits = tuple(s.strip() for s in args.init.split(","))
    if any(i not in ("uninformed", "informed") for i in inits):
        raise AimsymError("--init", f"expected uninformed and/or informed, got {args.init!r}")
    t0 = time.perf_counter()
    n = run_sweep(args.model, parse_grid(args.alpha), params=params, inits=inits, store=args.store,
                  samples=args.samples, replicas=args.replicas, seed=args.seed, nodes=args.nodes, tol=args.tol,
                  workers=args.workers, scheduler=args.scheduler, progress=not args.json)
    rows = export(args.store, args.csv, args.parquet)
    summary = {"computed": n, "stored": len(rows), "store": args.store, "csv": args.csv, "parquet": args.parquet,
               "seconds": time.perf_counter() - t0}
    if args.json:
        print_json(summary)
    else:
        print(f"computed {n} points, {len(rows)} in {args.store} ({summary['seconds']:.1f} s)")
    return 0
