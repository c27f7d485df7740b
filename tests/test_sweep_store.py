"""Sweeps: warm starts, resumable store (kill mid-run), CSV, Dask LocalCluster."""

import csv
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from aimsym.studies import sweep
from aimsym.smi.se import gaussian_channel_fixed_point
from aimsym.derive.files import derivations_dir

DER = derivations_dir()
GC = str(DER / "gaussian_channel.toml")


def _count(store):
    try:
        with sqlite3.connect(store) as con:
            return con.execute("SELECT COUNT(*) FROM points").fetchone()[0]
    except sqlite3.OperationalError:  # table not created yet
        return 0


def test_sweep_runs_resumes_and_exports(tmp_path):
    store = tmp_path / "s.sqlite"
    alphas = [0.5, 1.0, 1.5]
    n = sweep.run_sweep(GC, alphas, params={"Delta": [0.3, 0.6]}, store=store, samples=512, workers=1,
                        progress=False)
    assert n == 6 and _count(store) == 6
    assert sweep.run_sweep(GC, alphas, params={"Delta": [0.3, 0.6]}, store=store, samples=512, workers=1,
                           progress=False) == 0
    rows = sweep.export(store, tmp_path / "out.csv")
    for r in rows:
        assert abs(r["Q_00"] - gaussian_channel_fixed_point(r["alpha"], r["Delta"])) < 0.01
        assert r["model_hash"] and r["versions"] and r["seed"] == 0
    with open(tmp_path / "out.csv") as fh:
        assert len(list(csv.DictReader(fh))) == 6


def test_serial_sweep_shows_each_points_denoiser_passes(tmp_path, capsys):
    """A serial sweep with progress shows, besides the points, the passes of the point in progress
    (a three-layer point takes tens of minutes); without progress nothing is drawn."""
    sweep.run_sweep(GC, [0.5], params={"Delta": [0.3]}, store=tmp_path / "s.sqlite", samples=256, workers=1,
                    progress=True)
    err = capsys.readouterr().err
    assert "SE points" in err and "SE alpha=0.5" in err
    sweep.run_sweep(GC, [1.0], params={"Delta": [0.3]}, store=tmp_path / "t.sqlite", samples=256, workers=1,
                    progress=False)
    assert "SE alpha" not in capsys.readouterr().err


def test_killed_sweep_resumes_without_loss_or_duplicates(tmp_path):
    store = tmp_path / "k.sqlite"
    alphas = ",".join(str(0.2 + 0.1 * i) for i in range(40))
    cmd = [sys.executable, "-m", "aimsym.cli", "sweep", GC, "--set", "Delta=0.5", "--alpha", alphas,
           "--store", str(store), "--samples", "4096", "--tol", "1e-7", "--workers", "1", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and (not store.exists() or _count(store) < 3):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = _count(store)
    assert 3 <= partial < 40
    subprocess.run(cmd, check=True, capture_output=True)
    assert _count(store) == 40
    rows = sweep.table(store)
    assert len({r["alpha"] for r in rows}) == 40


def test_process_pool(tmp_path):
    store = tmp_path / "p.sqlite"
    n = sweep.run_sweep(GC, [0.5, 1.0], params={"Delta": [0.2, 0.4]}, store=store, samples=256, workers=2,
                        progress=False)
    assert n == 4


def test_dask_local_cluster(tmp_path):
    distributed = pytest.importorskip("dask.distributed")
    store = tmp_path / "d.sqlite"
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True) as cluster:
        with distributed.Client(cluster) as client:
            n = sweep.run_sweep(GC, [0.5, 1.0], params={"Delta": [0.2, 0.4]}, store=store, samples=256,
                                scheduler=client, progress=False)
    assert n == 4 and _count(store) == 4


def test_parquet(tmp_path):
    pytest.importorskip("pyarrow")
    store = tmp_path / "q.sqlite"
    sweep.run_sweep(GC, [1.0], params={"Delta": [0.5]}, store=store, samples=256, workers=1, progress=False)
    sweep.export(store, parquet_path=tmp_path / "o.parquet")
    assert (tmp_path / "o.parquet").stat().st_size > 0


def test_read_records_reuses_finished_runs(tmp_path):
    """A resumed JSON-lines series: records by key, the last one of a repeated key wins, and an
    absent file (or None) holds nothing yet."""
    from aimsym.studies import read_records

    path = tmp_path / "runs.jsonl"
    assert read_records(path, lambda r: r["d"]) == {} and read_records(None, lambda r: r["d"]) == {}
    path.write_text('{"d": 60, "err": 1.0}\n{"d": 100, "err": 0.5}\n{"d": 60, "err": 0.9}\n')
    done = read_records(path, lambda r: r["d"])
    assert sorted(done) == [60, 100] and done[60]["err"] == 0.9


def test_map_budget_stops_a_point_and_is_not_part_of_its_key(tmp_path):
    """The SE of a point stops at its map budget (the record's iterations; the Newton polish after it
    may still settle the fixed point, and converged says whether it did); a run with another budget
    finds the point (the budget bounds the work, it is not a setting of the result), and the keys of
    stores made before the budget existed are unchanged."""
    store = tmp_path / "s.sqlite"
    kw = dict(params={"Delta": [0.3]}, store=store, samples=256, workers=1, progress=False, tol=1e-12)
    sweep.run_sweep(GC, [1.0], **{**kw, "store": tmp_path / "free.sqlite"})
    (free,) = sweep.export(tmp_path / "free.sqlite")
    assert free["iterations"] > 2
    assert sweep.run_sweep(GC, [1.0], max_iter=2, **kw) == 1
    (row,) = sweep.export(store)
    assert row["iterations"] == 2
    assert sweep.run_sweep(GC, [1.0], max_iter=50, **kw) == 0
    assert sweep.run_sweep(GC, [1.0], **kw) == 0
    opts = {"samples": 256, "replicas": 8, "seed": 0, "nodes": None, "tol": 1e-12}
    assert sweep.point_key("h", 1.0, "uninformed", {**opts, "max_iter": 7}) == sweep.point_key("h", 1.0, "uninformed", opts)
    with pytest.raises(sweep.AimsymError, match="max_iter"):
        sweep.run_sweep(GC, [1.0], max_iter=0, **kw)
