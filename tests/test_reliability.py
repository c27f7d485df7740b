"""Nothing wrong, nothing lost: every bad input is one line and exit 2 before any work; degenerate
models are refused with the reason; unconverged iterations warn; a sweep killed with SIGKILL
resumes bit-identical, locally and on a Dask LocalCluster whose workers run in another folder."""

import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest

import aimsym
from aimsym import cli
from aimsym.studies import sweep
from aimsym.errors import AimsymError, ChannelError, ConvergenceWarning
from aimsym.derive.files import derivations_dir

DER = derivations_dir()
GC = str(DER / "gaussian_channel.toml")  # Delta symbolic; its kernels are committed and compile fast
L1 = str(DER / "attention_L1_T2.toml")  # beta symbolic
L2 = str(DER / "attention_L2_T2.toml")  # skip symbolic


def _toml(tmp_path, name, body):
    f = tmp_path / f"{name}.toml"
    f.write_text("[model]\n" + body + "\n")
    return str(f)


def _bad_inputs(tmp_path):
    """(argv, message) pairs: each must end in exit 2 and one line holding the message."""
    att = 'kind = "attention"\ntokens = 2\nlayers = 1\n'
    store = str(tmp_path / "never.sqlite")
    sw = ["sweep", GC, "--store", store, "--alpha", "0.5"]
    return [
        (["se", GC, "--set", "Delta=1", "--alpha", "1", "--seed", "-5"], "--seed: must be an integer >= 0"),
        (["thresholds", GC, "--set", "Delta=1", "--seed", "-5"], "--seed: must be an integer >= 0"),
        (["thresholds", GC, "--set", "Delta=1", "--stair-steps", "0"], "--stair-steps: must be an integer >= 1"),
        (["amp", GC, "--set", "Delta=1", "--seed", "-5"], "--seed: must be an integer >= 0"),
        (sw + ["--set", "Delta=1", "--seed", "-5"], "--seed: must be an integer >= 0"),
        (["aim", "amp", "--seeds=-5", "--d", "10"], "--seeds: seeds are integers >= 0"),
        (["erm", "train", "--alpha", "1", "--seeds=-1"], "--seeds: seeds are integers >= 0"),
        (sw + ["--set", "Delta=abc"], "--set Delta: expected START:STOP:NUM"),
        (sw + ["--set", "Delta=nan"], "--set Delta: expected START:STOP:NUM"),
        (sw + ["--set", "skip=1"], "skip: not a symbolic parameter of this model; allowed: Delta, noise"),
        (["sweep", GC, "--store", store, "--set", "Delta=1", "--alpha", "0.5,inf"], "--alpha: expected"),
        (["sweep", GC, "--store", store, "--set", "Delta=1", "--alpha", "0:1:0"], "--alpha: expected"),
        (sw + ["--set", "Delta=1", "--samples", "8", "--replicas", "8"], "--samples: need at least 2 points"),
        (["se", GC, "--set", "Delta=1", "--alpha", "1", "--max-iter", "0"], "--max-iter: must be an integer >= 1"),
        (["se", GC, "--set", "Delta=1", "--alpha", "1", "--tol", "0"], "--tol: must be a finite number > 0"),
        (["se", GC, "--set", "Delta=1", "--alpha", "1", "--tol", "-1"], "--tol: must be a finite number > 0"),
        (["se", GC, "--set", "Delta=1", "--alpha", "nan"], "--alpha: must be a finite number >= 0"),
        (["amp", GC, "--set", "Delta=1", "--max-iter", "0"], "--max-iter: must be an integer >= 1"),
        (["amp", GC, "--set", "Delta=1", "--tol", "0"], "--tol: must be a finite number > 0"),
        (["se", L1, "--set", "beta=1e308", "--alpha", "1"], "beta: layer 1: |beta| must be <= 10000"),
        (["derive", _toml(tmp_path, "bbig", att + "beta = 1e308")], "|beta| must be <= 10000"),
        (["derive", _toml(tmp_path, "skipnan", att + 'skip = "nan"')], "skip: must be a finite number"),
        (["derive", _toml(tmp_path, "t1", 'kind = "attention"\ntokens = 1\nlayers = 1')],
         "tokens: a softmax or hardmax over one token is identically 1"),
        (["derive", _toml(tmp_path, "b0", att + "beta = 0.0")], "beta: beta = 0 in every layer makes the output"),
        (["derive", _toml(tmp_path, "b0last", att.replace("layers = 1", "layers = 2") + "beta = [1.0, 0.0]")],
         "beta: beta = 0 in the last layer"),
        (["se", L1, "--set", "beta=0", "--alpha", "1"], "beta: beta = 0 in every layer"),
        (["thresholds", L1, "--over", "beta=0:1:3"], "beta: beta = 0 in every layer"),
        (["thresholds", L2, "--over", "skip=-1:4:16", "--out", str(tmp_path / "never.json")],
         "--over skip: skip -1 < 0 in layer 1: the mixing matrix c I + S_1 can be singular"),
        (["thresholds", L2, "--set", "skip=-0.5", "--json"], "skip: skip -0.5 < 0 in layer 1"),
        (["derive", _toml(tmp_path, "const", 'kind = "smi"\nindices = 1\ntokens = 1\nlink = "z[0] - z[0]"')],
         "link: does not depend on z[k, t]"),
        (["derive", _toml(tmp_path, "minus", f'kind = "smi"\nindices = 1\ntokens = 1\nlink = "{"-" * 3900}z[0]"')],
         "link: expression nested too deeply"),
        (["derive", _toml(tmp_path, "pow", f'kind = "smi"\nindices = 1\ntokens = 1\nlink = "z[0]{"**1" * 400}"')],
         "link: expression nested too deeply"),
        (["derive", _toml(tmp_path, "tower", 'kind = "smi"\nindices = 1\ntokens = 1\nlink = "z[0] * 2**2**2**2**2**2"')],
         "link: a numeric exponent must be at most 1000"),
    ]


def test_bad_inputs_end_in_one_line_and_exit_2(tmp_path, capsys):
    for argv, message in _bad_inputs(tmp_path):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("aimsym: error: "), (argv, err)
        assert message in lines[0], (argv, lines[0])
    assert not (tmp_path / "never.sqlite").exists()  # nothing written by any of them
    assert not (tmp_path / "never.json").exists()


def _store_with_points(path):
    sweep.run_sweep(GC, [0.5, 1.0], params={"Delta": [0.5]}, store=path, samples=64, workers=1, progress=False)


def test_damaged_and_foreign_stores_are_named_with_a_way_out(tmp_path, capsys):
    good = tmp_path / "good.sqlite"
    _store_with_points(good)
    cases = {}
    truncated = tmp_path / "truncated.sqlite"
    shutil.copy(good, truncated)
    with open(truncated, "r+b") as fh:
        fh.truncate(truncated.stat().st_size // 2)
    cases[truncated] = "damaged or not an SQLite store"
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"this is not a database" * 100)
    cases[garbage] = "damaged or not an SQLite store"
    foreign = tmp_path / "foreign.sqlite"
    with sqlite3.connect(foreign) as con:
        con.execute("CREATE TABLE results (x REAL)")
    cases[foreign] = "not written by 'aimsym sweep'"
    for path, message in cases.items():
        for argv in (["plot", str(path), "--out", str(tmp_path / "x.png")],
                     ["sweep", GC, "--set", "Delta=0.5", "--alpha", "0.5", "--store", str(path)]):
            assert cli.main(argv) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith(f"aimsym: error: --store: {path}") and message in err and "\n" not in err
    assert cli.main(["plot", str(tmp_path / "missing.sqlite")]) == 2
    assert "no such file" in capsys.readouterr().err
    # a broken JSON record: the plot says so, and re-running the sweep computes that point again
    with sqlite3.connect(good) as con:
        key, rec = con.execute("SELECT key, record FROM points ORDER BY alpha").fetchone()
        con.execute("UPDATE points SET record = ? WHERE key = ?", (rec[: len(rec) // 2], key))
    assert cli.main(["plot", str(good), "--out", str(tmp_path / "x.png")]) == 2
    assert "1 damaged record(s)" in capsys.readouterr().err
    _store_with_points(good)
    with sqlite3.connect(good) as con:
        again = json.loads(con.execute("SELECT record FROM points WHERE key = ?", (key,)).fetchone()[0])
    assert again["Q"] == json.loads(rec)["Q"]  # recomputed, bit-identical
    assert len(sweep.table(good)) == 2


def test_store_in_a_missing_folder_is_created_and_an_impossible_one_refused(tmp_path, capsys):
    deep = tmp_path / "new" / "folder" / "s.sqlite"
    _store_with_points(deep)
    assert len(sweep.table(deep)) == 2
    blocker = tmp_path / "afile"
    blocker.write_text("")
    assert cli.main(["sweep", GC, "--set", "Delta=1", "--alpha", "1", "--store", str(blocker / "s.sqlite")]) == 2
    assert "cannot create its folder" in capsys.readouterr().err


def test_parquet_without_pyarrow_fails_before_the_sweep(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    store = tmp_path / "p.sqlite"
    argv = ["sweep", GC, "--set", "Delta=1", "--alpha", "1", "--store", str(store), "--parquet", str(tmp_path / "o.pq")]
    assert cli.main(argv) == 2
    assert "--parquet: needs the parquet extra" in capsys.readouterr().err
    assert not store.exists()


def test_unwritable_kernel_cache_is_one_line(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    monkeypatch.setenv("AIMSYM_CACHE", str(blocker / "cache"))
    model = _toml(tmp_path, "fresh_cache_model", 'kind = "smi"\nindices = 1\ntokens = 1\nlink = "z[0] ** 3"')
    assert cli.main(["se", model, "--alpha", "1", "--samples", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("aimsym: error: cache: cannot write the kernels of fresh_cache_model") and "AIMSYM_CACHE" in err


def test_compile_notice_once_for_a_new_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AIMSYM_CACHE", str(tmp_path / "cache"))
    model = aimsym.load(_toml(tmp_path, "fresh_notice_model", 'kind = "smi"\nindices = 1\ntokens = 1\nlink = "z[0] ** 3"'))
    assert model.compile_notice("link_batch") is True
    assert capsys.readouterr().err == "aimsym: compiling kernels for fresh_notice_model, once (cached for later runs)\n"
    assert model.compile_notice("link_batch") is False  # once per process
    bundled = aimsym.load(GC, Delta=0.5)
    bundled.link(np.zeros((1, 1, 1)))  # compiled (and cached on disk) here at the latest
    capsys.readouterr()  # (its own notice, when this test runs first in the process)
    monkeypatch.setattr("aimsym.model._NOTICED", set())  # as in a new process
    assert bundled.compile_notice() is False and capsys.readouterr().err == ""


def test_compile_notice_sees_the_cached_mode_centred_module(tmp_path, monkeypatch):
    """At k >= 6 the denoiser runs only the assembled mode-centred module, never the driver's
    denoise_batch: its cached code counts as compiled (before, such models printed 'compiling
    kernels' in every process). A model never run on that path has no such module."""
    m = aimsym.load("attention_L2_T3", c=1.0)
    rng = np.random.default_rng(0)
    om = 0.5 * rng.standard_normal((1, 2, 3))
    obs = m.observation(om[0] + 0.5 * rng.standard_normal((2, 3)))[None]
    m.denoiser(rule="modal", tol=1e-2)(None, om, 0.6 * np.eye(2), obs=obs)
    assert m._modal_compiled()
    monkeypatch.setenv("AIMSYM_CACHE", str(tmp_path / "cache"))
    fresh = aimsym.load(_toml(tmp_path, "fresh_modal_model", 'kind = "smi"\nindices = 1\ntokens = 1\nlink = "z[0] ** 3"'))
    assert not fresh._modal_compiled()


def test_channel_refuses_non_symmetric_V_and_mismatched_batches():
    m = aimsym.load(str(DER / "mim_product.toml"))  # p = 2 indices
    den = m.denoiser()
    Z, y = m.sample(5, np.random.default_rng(0))
    V = np.array([[0.7, 0.1], [0.0, 0.7]])
    with pytest.raises(ChannelError, match=r"V: must be symmetric, got max \|V - V\^T\| = 0.1"):
        den(y, 0.5 * Z, V)
    with pytest.raises(ChannelError, match="y: batch shapes do not match"):
        den(y, 0.5 * Z[:3], 0.75 * np.eye(2))
    out = den(y, 0.5 * Z, (V + V.T) / 2, tol=None)
    assert out.g_out.shape == (5, 2, 1) and np.all(np.isfinite(out.g_out))


def test_unconverged_se_and_amp_warn_in_one_line(capsys, monkeypatch):
    # (a tolerance one iteration cannot meet, even with the SE's Newton polish, and no stop within
    # the statistical error, which the polish of this Gaussian channel would reach)
    import aimsym.smi.se as se

    monkeypatch.setattr(se, "STAT_STOP", 0.0)
    assert cli.main(["se", GC, "--set", "Delta=0.5", "--alpha", "0.5", "--max-iter", "1", "--tol", "1e-15",
                     "--samples", "256", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["converged"] is False
    assert err.startswith("aimsym: warning: state evolution at alpha = 0.5 did not converge") and err.count("\n") == 1
    assert cli.main(["amp", GC, "--set", "Delta=0.5", "--d", "40", "--alpha", "2", "--max-iter", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["converged"] == [False]
    assert err.startswith("aimsym: warning: GAMP: 1 of 1 runs stopped at max_iter = 1") and err.count("\n") == 1
    with pytest.warns(ConvergenceWarning):
        from aimsym.smi.se import state_evolution

        state_evolution(aimsym.load(GC, Delta=0.5), 0.5, max_iter=1, tol=1e-15, samples=256, errors=False)


def test_sweep_progress_counts_points_and_errors_start_on_a_fresh_line(tmp_path, capsys, monkeypatch):
    store = tmp_path / "b.sqlite"
    sweep.run_sweep(GC, [0.5, 1.0, 1.5], params={"Delta": [0.5]}, store=store, samples=64, workers=1)
    err = capsys.readouterr().err
    assert "SE points" in err and "3/3" in err  # one chain, three points

    calls = []

    def failing_point(*a, **kw):
        if calls:
            raise AimsymError("alpha", "stand-in failure after the first point")
        calls.append(a)
        return real(*a, **kw)

    real = sweep.run_point
    monkeypatch.setattr(sweep, "run_point", failing_point)
    argv = ["sweep", GC, "--set", "Delta=0.7", "--alpha", "0.5,1", "--samples", "64", "--workers", "1",
            "--store", str(store)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "\naimsym: error: alpha: stand-in failure" in err and "1/2" in err
    assert len(sweep.table(store)) == 4  # the point done before the failure is kept


# ----------------------------------------------------------------------------- kill -9 and resume
ALPHAS = "0.3:2.4:10"
SWEEP_OPTS = ["--set", "Delta=0.4,0.8", "--alpha", ALPHAS, "--samples", "1024", "--tol", "1e-7", "--json"]


def _records(store):
    """key -> record without the fields that differ between runs (wall time, creation time)."""
    with sqlite3.connect(store) as con:
        rows = con.execute("SELECT key, record FROM points").fetchall()
    out = {}
    for k, r in rows:
        rec = json.loads(r)
        rec.pop("seconds")
        rec["provenance"].pop("created")
        out[k] = rec
    return out


def _count(store):
    try:
        with sqlite3.connect(store) as con:
            return con.execute("SELECT COUNT(*) FROM points").fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def _kill_and_resume(cmd, store, cwd, kill_after):
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and _count(store) < kill_after and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = _count(store)
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return partial, json.loads(done.stdout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted sweep, in this process."""
    store = tmp_path_factory.mktemp("ref") / "ref.sqlite"
    assert cli.main(["sweep", GC, "--store", str(store), "--workers", "1"] + SWEEP_OPTS) == 0
    recs = _records(store)
    assert len(recs) == 20
    return recs


def test_killed_local_sweep_resumes_bit_identical(tmp_path, reference):
    store = tmp_path / "k.sqlite"
    kill_after = random.Random().randint(1, 17)  # a random point of the run
    cmd = [sys.executable, "-m", "aimsym.cli", "sweep", GC, "--store", str(store)] + SWEEP_OPTS
    partial, summary = _kill_and_resume(cmd, store, tmp_path, kill_after)
    assert partial < 20 and summary["computed"] == 20 - partial and summary["stored"] == 20
    assert _records(store) == reference


def test_dask_sweep_with_relative_paths_from_another_folder_killed_and_resumed(tmp_path, monkeypatch, reference):
    """Workers start in workers/, the client runs in client/ with a relative model path and a
    relative store in a folder that does not exist yet: the client alone writes the store."""
    distributed = pytest.importorskip("dask.distributed")
    (tmp_path / "workers").mkdir()
    client_dir = tmp_path / "client"
    client_dir.mkdir()
    shutil.copy(GC, client_dir / "gaussian_channel.toml")
    monkeypatch.chdir(tmp_path / "workers")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster:
        monkeypatch.chdir(client_dir)
        cmd = [sys.executable, "-m", "aimsym.cli", "sweep", "gaussian_channel.toml", "--store", "out/d.sqlite",
               "--scheduler", cluster.scheduler_address] + SWEEP_OPTS
        partial, summary = _kill_and_resume(cmd, client_dir / "out" / "d.sqlite", client_dir,
                                            random.Random().randint(1, 17))
    assert partial < 20 and summary["stored"] == 20
    assert _records(client_dir / "out" / "d.sqlite") == reference
    assert not list((tmp_path / "workers").rglob("*.sqlite"))  # workers wrote nothing


def test_plot_draws_one_labelled_curve_per_parameter_set(tmp_path):
    from aimsym.plot import se as plot

    store = tmp_path / "two.sqlite"
    sweep.run_sweep(GC, [0.5, 1.0, 1.5], params={"Delta": [0.3, 1.0]}, store=store, samples=64, workers=1,
                    progress=False)
    rows = sweep.table(store)
    ths = [{"alpha": 0.8, "stderr": 0.01, "subspace": [0]}]
    labels = plot.overlaps(rows, tmp_path / "f.png", ths)
    curves = [lb for lb in labels if lb.startswith("$Q_{11}$")]
    assert curves == ["$Q_{11}$ (Delta = 0.3)", "$Q_{11}$ (Delta = 1)"]  # never one merged zig-zag
    assert "threshold 1 (layer 1): $\\alpha$ = 0.800 ± 0.010" in labels
    assert {"phase: no layer learnable", "phase: layer 1 learnable"} <= set(labels)
    assert (tmp_path / "f.png").stat().st_size > 0
    # without thresholds the phases are unknown: none is named
    bare = plot.overlaps(rows, tmp_path / "g.png")
    assert bare == curves
    # a point that stopped at its map budget is drawn open, and the legend says what that means
    assert all(r["converged"] for r in rows) and plot.OPEN_LABEL not in labels
    flagged = [{**r, "converged": False} if r["alpha"] == 1.5 else r for r in rows]
    drawn = plot.overlaps(flagged, tmp_path / "h.png")
    assert sorted(drawn) == sorted(curves + [plot.OPEN_LABEL])


def test_plot_reads_a_thresholds_report_and_a_reproduce_state(tmp_path, capsys):
    """`aimsym plot --thresholds` takes the JSON of `aimsym thresholds --json` and a reproduce run's
    state file (the same report under "value", with its resume key), and draws the same marks."""
    import json

    from aimsym.cli import main

    store = tmp_path / "gc.sqlite"
    sweep.run_sweep(GC, [0.5, 1.0], params={"Delta": [0.3]}, store=store, samples=64, workers=1, progress=False)
    report = {"staircase": [{"alpha": 0.8, "stderr": 0.01, "subspace": [0]}], "perfect_recovery": None}
    (tmp_path / "th.json").write_text(json.dumps(report))
    (tmp_path / "state.json").write_text(json.dumps({"key": {"samples": 64}, "value": report}))
    sizes = []
    for th in ("th.json", "state.json"):
        out = tmp_path / f"{th}.png"
        assert main(["plot", str(store), "--thresholds", str(tmp_path / th), "--out", str(out)]) == 0
        sizes.append(out.stat().st_size)
    assert sizes[0] == sizes[1] > 0
    (tmp_path / "bad.json").write_text(json.dumps({"key": 1, "value": {"staircase": 3}}))
    assert main(["plot", str(store), "--thresholds", str(tmp_path / "bad.json")]) == 2
    assert "--thresholds" in capsys.readouterr().err


def test_user_errors_survive_the_trip_from_a_worker_process():
    import pickle

    from aimsym.errors import SpecError

    err = pickle.loads(pickle.dumps(SpecError("beta", "must be finite")))
    assert type(err) is SpecError and err.field == "beta" and str(err) == "beta: must be finite"


def test_an_index_absent_from_the_link_is_kept_and_never_learned(tmp_path):
    """Handled, not refused: y = z0 with two indices; the SE learns z0 (noiseless linear channel:
    Q_00 = alpha below 1) and z1 not at all."""
    from aimsym.smi.se import state_evolution

    model = aimsym.load(_toml(tmp_path, "unused_index", 'kind = "smi"\nindices = 2\ntokens = 1\nlink = "z[0]"'))
    res = state_evolution(model, 0.5, samples=512, errors=False)
    assert abs(res.Q[0, 0] - 0.5) < 0.02 and abs(res.Q[1, 1]) < 1e-6


def test_a_failed_thresholds_stage_keeps_alpha_c(capsys, monkeypatch):
    """A stage after alpha_c that fails (here perfect recovery, as the untied model's local
    stability once did inside a compiled kernel after 27 min) is named in the output, the exit
    code is 1, and alpha_c is printed all the same."""
    import json

    from aimsym.smi import perfect

    def boom(*a, **k):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(perfect, "perfect_recovery", boom)
    argv = ["thresholds", GC, "--set", "Delta=0.3", "--samples", "1024", "--no-staircase", "--json"]
    with pytest.warns(RuntimeWarning, match="perfect_recovery stage failed"):
        assert cli.main(argv) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["failed"] == {"perfect_recovery": "ZeroDivisionError: division by zero"}
    assert out["initial"]["alpha"] == pytest.approx(1.69, rel=1e-3)  # (1 + Delta)^2
    with pytest.warns(RuntimeWarning):
        assert cli.main(argv[:-1]) == 1
    text = capsys.readouterr().out
    assert "alpha_c = 1.69" in text and "perfect_recovery: failed (ZeroDivisionError" in text
