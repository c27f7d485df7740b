"""Sweeps of the SE over alpha and model parameters, with a resumable SQLite store.

Layout: one *chain* per parameter combination runs the alpha grid in order, warm-starting each
point from the previous fixed point. The client (the process running :func:`run_sweep`) submits
one point at a time per chain to a local process pool (default) or a Dask distributed cluster
(``scheduler=ADDRESS``); the workers only compute and return the record, and the client alone
writes the SQLite file as each point completes. So the store may sit on any path and any file
system (the workers never see it), and a crash of either side loses at most the points in flight.
The model travels to the workers as the text of its TOML file (its spec hash keys the store),
never as a path. A re-run skips what is stored and restarts each chain from its last stored
point, so an interrupted sweep ends bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import multiprocessing
import sqlite3
import warnings
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path

import numpy as np

from ..errors import AimsymError, ConvergenceWarning
from ..results import to_builtin
from ..smi.passes import clear as clear_passes

_SCHEMA = """CREATE TABLE IF NOT EXISTS points (
    key TEXT PRIMARY KEY, model_hash TEXT, params TEXT, alpha REAL, init TEXT, record TEXT)"""
_COLUMNS = ["key", "model_hash", "params", "alpha", "init", "record"]


def _select(path, sql: str, *, create: bool = True) -> list:
    """All rows of one query on the store; a damaged file is one error naming it."""
    con = _connect(path, create=create)
    try:
        return con.execute(sql).fetchall()
    except sqlite3.DatabaseError as exc:
        raise _store_error(path, f"damaged ({exc}); move it away and re-run into a new --store") from None
    finally:
        con.close()


def _store_error(path, what: str) -> AimsymError:
    return AimsymError("--store", f"{path}: {what}")


def _connect(path, *, create: bool = True, check: bool = True):
    """Open the store, checking that it is an aimsym sweep store (one clear error otherwise);
    ``check``: also run SQLite's integrity check (once per sweep, not per stored point)."""
    path = Path(path)
    if not create and not path.is_file():
        raise _store_error(path, "no such file")
    if create:
        _make_folder(path)
    try:
        con = sqlite3.connect(str(path), timeout=60)
        cols = [r[1] for r in con.execute("PRAGMA table_info(points)")]
        others = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        if cols and cols != _COLUMNS or (not cols and others):
            con.close()
            raise _store_error(path, "is an SQLite file not written by 'aimsym sweep' (unexpected tables or "
                                     "columns); choose another --store")
        if create:
            # (SQLite's default rollback journal: WAL needs shared memory, which network file
            # systems do not provide, and only this process writes the file anyway)
            con.execute(_SCHEMA)
        bad = con.execute("PRAGMA quick_check").fetchone()[0] if check else "ok"
        if bad != "ok":
            con.close()
            raise sqlite3.DatabaseError(bad)
    except sqlite3.DatabaseError as exc:
        raise _store_error(path, f"damaged or not an SQLite store ({exc}); move it away and re-run into a new "
                                 "--store (stored points can be recovered with 'sqlite3 FILE .recover')") from None
    except sqlite3.Error as exc:
        raise _store_error(path, f"cannot open ({exc})") from None
    return con


def _make_folder(path) -> None:
    path = Path(path)
    if path.is_dir():
        raise _store_error(path, "is a folder; give a file name such as sweep.sqlite")
    if not path.parent.is_dir():
        try:  # a typo in a folder name should not cost the sweep: create it, as --out does
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _store_error(path, f"cannot create its folder ({exc.strerror})") from None


# settings that bound the work on a point without changing a converged result: not in its key (a
# point stored as not converged within its map budget is kept, and says so, when a later run raises it)
UNKEYED = ("max_iter",)


def point_key(model_hash, alpha, init, opts) -> str:
    keyed = {k: v for k, v in opts.items() if k not in UNKEYED}
    return json.dumps([model_hash, round(float(alpha), 12), init, keyed], sort_keys=True)


def _decode(record):
    """A stored record, or None where it is damaged (such a point is computed again)."""
    try:
        rec = json.loads(record)
        np.asarray(rec["Q"], dtype=float)
        return rec
    except (TypeError, ValueError, KeyError):
        return None


def finished(path, keys) -> dict:
    """Stored, readable records among ``keys``."""
    keys = set(keys)
    if not Path(path).exists():  # (created by the first stored point: a failed start leaves no file)
        _make_folder(path)
        return {}
    rows = _select(path, "SELECT key, record FROM points")
    out = {}
    for k, r in rows:
        if k in keys and (rec := _decode(r)) is not None:
            out[k] = rec
    return out


def _write(store, row) -> None:
    con = _connect(store, check=False)
    try:
        with con:
            # replace only a damaged record: a readable one (e.g. from a concurrent sweep) stays
            con.execute("INSERT INTO points VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET "
                        "record = excluded.record WHERE json_valid(points.record) = 0 "
                        "OR json_type(points.record, '$.Q') IS NULL", row)
    except sqlite3.Error as exc:
        raise _store_error(store, f"cannot write ({exc})") from None
    finally:
        con.close()


# ----------------------------------------------------------------------------- worker side
@functools.lru_cache(maxsize=8)
def _worker_model(text: str, name: str, params_json: str):
    from ..model import load
    from ..derive.spec import loads

    return load(loads(text, default_name=name), **json.loads(params_json))


@functools.lru_cache(maxsize=4)
def _worker_channel(text: str, name: str, params_json: str, opts_json: str):
    from ..smi.se import make_channel

    opts = json.loads(opts_json)
    return make_channel(_worker_model(text, name, params_json), samples=opts["samples"],
                        replicas=opts["replicas"], seed=opts["seed"], nodes=opts["nodes"])


def passes_folder(store) -> Path:
    """Where the sweep keeps the denoiser passes of the points in progress (smi/passes.py): a point
    stopped mid-way resumes from its last pass; a stored point's passes are removed."""
    return Path(str(store) + ".passes")


def _point_passes(root, key: str) -> Path:
    return Path(root) / hashlib.sha256(key.encode()).hexdigest()[:20]


def run_point(text: str, name: str, params: dict, alpha: float, init: str, opts: dict, prev, passes=None,
              progress: bool = False):
    """Compute one point of a chain (on a worker): warm start from ``prev`` (the previous point's
    Q, or None); ``passes``: the folder of the sweep's kept denoiser passes (None: none kept);
    ``progress``: a display of the point's denoiser passes (the serial sweep: a three-layer point
    takes tens of minutes). Returns the row the client stores; nothing is written to the store here."""
    from ..smi.se import state_evolution

    pj, oj = json.dumps(params, sort_keys=True), json.dumps(opts, sort_keys=True)
    model = _worker_model(text, name, pj)
    ch = _worker_channel(text, name, pj, oj)
    key = point_key(model.hash(), alpha, init, opts)
    start = init if prev is None or init == "informed" else np.maximum(np.asarray(prev), 1e-4 * np.eye(model.p))
    with warnings.catch_warnings():  # (the client counts the points that did not converge)
        warnings.simplefilter("ignore", ConvergenceWarning)
        budget = {} if opts.get("max_iter") is None else {"max_iter": opts["max_iter"]}
        res = state_evolution(model, alpha, init=start, channel=ch, seed=opts["seed"], tol=opts["tol"], **budget,
                              checkpoint=None if passes is None else _point_passes(passes, key), progress=progress)
    rec = res.to_dict()
    rec["init"] = init
    rec["params"] = params
    return (key, model.hash(), pj, float(alpha), init, json.dumps(rec, default=to_builtin))


def grid(params: dict[str, list[float]]) -> list[dict]:
    names = sorted(params)
    return [dict(zip(names, vals)) for vals in itertools.product(*(params[n] for n in names))] or [{}]


# ----------------------------------------------------------------------------- client side
class _Chain:
    """The alpha grid of one (parameters, init): which point is next and its warm start."""

    def __init__(self, params, init, alphas, keys, done):
        self.params, self.init, self.alphas, self.keys = params, init, alphas, keys
        self.done = done  # key -> Q of stored points
        self.i, self.prev = 0, None

    def next_point(self):
        """(alpha, prev) of the next point to compute, skipping stored ones; None at the end."""
        while self.i < len(self.alphas) and self.keys[self.i] in self.done:
            self.prev = self.done[self.keys[self.i]]
            self.i += 1
        if self.i == len(self.alphas):
            return None
        return self.alphas[self.i], self.prev

    def advance(self, Q):
        self.prev = Q
        self.i += 1


def check_settings(*, samples, replicas, seed, nodes, tol, workers=None, max_iter=None) -> None:
    """Sweep settings, checked before any work (the CLI checks the same flags up front)."""
    def whole(v, fld, low):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < low:
            raise AimsymError(fld, f"must be an integer >= {low}, got {v!r}")

    whole(samples, "samples", 4)
    whole(replicas, "replicas", 2)
    whole(seed, "seed", 0)
    if nodes is not None:
        whole(nodes, "nodes", 1)
    if workers is not None:
        whole(workers, "workers", 1)
    if max_iter is not None:
        whole(max_iter, "max_iter", 1)
    if isinstance(tol, bool) or not isinstance(tol, int | float) or not (math.isfinite(tol) and tol > 0):
        raise AimsymError("tol", f"must be a finite number > 0, got {tol!r}")
    if samples // replicas < 2:
        raise AimsymError("samples", f"need at least 2 points per replica: samples >= {2 * replicas} for "
                                     f"{replicas} replicas, got {samples}")


def model_source(model_path) -> tuple[str, str]:
    """(TOML text, default name) of a model file: what travels to the workers."""
    import re

    from ..derive.files import resolve

    path = resolve(model_path)
    if not path.is_file():
        raise AimsymError("model", f"no such file: {model_path}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise AimsymError("model", f"cannot read {model_path}: {exc}") from None
    return text, re.sub(r"[^A-Za-z0-9_.-]", "_", path.stem)


def run_sweep(model_path, alphas, *, params: dict | None = None, inits=("uninformed",), store="sweep.sqlite",
              samples=2048, replicas=8, seed=0, nodes=None, tol=1e-4, workers=None, scheduler=None,
              progress=True, max_iter: int | None = None) -> int:
    """Run (or resume) the sweep; returns the number of points computed in this call. ``max_iter``:
    the SE's map budget per point (None: ``state_evolution``'s default); a point that reaches it is
    stored as not converged (its record says so; a Newton step to the fixed point, where one is
    taken, is in its error bars)."""
    from ..model import load
    from ..derive.spec import loads

    alphas = [float(a) for a in alphas]
    if not alphas or any(not (math.isfinite(a) and a >= 0) for a in alphas):
        raise AimsymError("alpha", f"need a non-empty grid of finite alpha >= 0, got {alphas}")
    alphas = sorted(alphas)
    for i in inits:
        if i not in ("uninformed", "informed"):
            raise AimsymError("init", f"expected uninformed and/or informed, got {i!r}")
    check_settings(samples=samples, replicas=replicas, seed=seed, nodes=nodes, tol=tol, workers=workers,
                   max_iter=max_iter)
    opts = {"samples": int(samples), "replicas": int(replicas), "seed": int(seed),
            "nodes": None if nodes is None else int(nodes), "tol": float(tol),
            "max_iter": None if max_iter is None else int(max_iter)}
    text, name = model_source(model_path)
    spec = loads(text, default_name=name)
    combos = grid({k: [float(v) for v in vs] for k, vs in (params or {}).items()})
    # every combination is loaded here, so a bad name or value stops the sweep before any work
    models = [load(spec, **p) for p in combos]
    for m in models:
        m.params_array()  # every symbolic parameter has a value
    if progress:
        models[0].compile_notice()
    keys_of = {(i, init): [point_key(m.hash(), a, init, opts) for a in alphas]
               for i, m in enumerate(models) for init in inits}
    stored = finished(store, [k for ks in keys_of.values() for k in ks])
    done = {k: np.array(r["Q"]) for k, r in stored.items()}
    chains = [_Chain(combos[i], init, alphas, ks, done) for (i, init), ks in keys_of.items()]
    total = sum(len(c.keys) for c in chains)
    client, own_client = _dask_client(scheduler) if scheduler else (None, False)
    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=len(stored), desc="SE points", unit="pt", disable=not progress)
    try:
        if client is not None:
            n = _run_dask(client, chains, text, name, opts, store, bar)
        elif workers == 1 or len(chains) == 1 and workers is None:
            n = _run_serial(chains, text, name, opts, store, bar)
        else:
            # spawn, not fork: numba's OpenMP threading layer does not survive fork
            with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                     initializer=_quiet_worker) as ex:
                n = _run_pool(ex, chains, text, name, opts, store, bar)
    finally:
        bar.close()  # (also on errors: a message then starts on a fresh line)
        if own_client:
            client.close()
        try:
            passes_folder(store).rmdir()  # (only if no point is left in progress)
        except OSError:
            pass
    return n


def _quiet_worker() -> None:
    from .. import model

    model.COMPILE_NOTICE = False  # (the client has said it once)


def _store_result(store, chain, row) -> None:
    _write(store, row)
    clear_passes(_point_passes(passes_folder(store), row[0]))  # (the point is safe in the store)
    chain.advance(np.array(json.loads(row[5])["Q"]))


def _run_serial(chains, text, name, opts, store, bar) -> int:
    n = 0
    for c in chains:
        while (nxt := c.next_point()) is not None:
            _store_result(store, c, run_point(text, name, c.params, nxt[0], c.init, opts, nxt[1],
                                              str(passes_folder(store)), progress=not bar.disable))
            n += 1
            bar.update()
    return n


def _submit(submit, chain, text, name, opts, passes=None):
    nxt = chain.next_point()
    if nxt is None:
        return None
    prev = None if nxt[1] is None else nxt[1].tolist()
    return submit(run_point, text, name, chain.params, nxt[0], chain.init, opts, prev, passes)


def _run_pool(ex, chains, text, name, opts, store, bar) -> int:
    pending = {}
    for c in chains:
        if (f := _submit(ex.submit, c, text, name, opts, str(passes_folder(store)))) is not None:
            pending[f] = c
    n = 0
    while pending:
        finished_now, _ = wait_futures(list(pending), return_when=FIRST_COMPLETED)
        for f in finished_now:
            c = pending.pop(f)
            _store_result(store, c, f.result())
            n += 1
            bar.update()
            if (g := _submit(ex.submit, c, text, name, opts, str(passes_folder(store)))) is not None:
                pending[g] = c
    return n


def _dask_client(scheduler):
    """(client, owned): a Dask client for an address (connected here, before any work) or as given."""
    if hasattr(scheduler, "submit"):
        return scheduler, False
    try:
        from dask.distributed import Client
    except ImportError:
        raise AimsymError("--scheduler", "needs the dask extra: pip install 'aimsym[dask]'") from None
    try:
        return Client(scheduler, timeout="20s"), True
    except (OSError, TimeoutError, ValueError) as exc:
        raise AimsymError("--scheduler", f"cannot reach the Dask scheduler at {scheduler!r} ({exc}); "
                                         "expected an address such as tcp://HOST:8786") from None


def _run_dask(client, chains, text, name, opts, store, bar) -> int:
    from dask.distributed import as_completed

    def submit(fn, *a):
        return client.submit(fn, *a, pure=False)

    owner, first = {}, []
    for c in chains:
        if (f := _submit(submit, c, text, name, opts)) is not None:
            owner[f.key] = c
            first.append(f)
    n = 0
    queue = as_completed(first)
    for f in queue:  # the client alone writes the store, as each point comes back
        c = owner.pop(f.key)
        _store_result(store, c, f.result())
        n += 1
        bar.update()
        if (g := _submit(submit, c, text, name, opts)) is not None:
            owner[g.key] = c
            queue.add(g)
    return n


# ----------------------------------------------------------------------------- reading
def table(store) -> list[dict]:
    """Tidy rows (one per point) from the store, sorted by parameters, init and alpha."""
    rows = _select(store, "SELECT model_hash, params, alpha, init, record FROM points", create=False)
    out, damaged = [], 0
    for h, params, alpha, init, rec in rows:
        r = _decode(rec)
        try:
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
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            damaged += 1
            continue
        out.append(row)
    if damaged:
        raise _store_error(store, f"{damaged} damaged record(s) (unreadable JSON); re-run the same "
                                  "'aimsym sweep' to compute them again")
    out.sort(key=lambda d: (d["model_hash"], d["init"], d["alpha"]))
    return out


def check_parquet(parquet_path) -> None:
    """Fail before a sweep, not after it, when Parquet output cannot be written."""
    if parquet_path:
        try:
            import pyarrow  # noqa: F401
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise AimsymError("--parquet", "needs the parquet extra: pip install 'aimsym[parquet]' "
                                           "(or use --csv)") from None


def export(store, csv_path=None, parquet_path=None) -> list[dict]:
    check_parquet(parquet_path)
    rows = table(store)
    if csv_path:
        import csv

        Path(csv_path).parent.mkdir(parents=True, exist_ok=True)
        cols = list(dict.fromkeys(k for r in rows for k in r))
        with open(csv_path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)
    if parquet_path:
        import pyarrow as pa
        import pyarrow.parquet as pq

        Path(parquet_path).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), parquet_path)
    return rows
