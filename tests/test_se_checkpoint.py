"""Kept denoiser passes (aimsym/smi/passes.py): a state evolution stopped mid-way resumes from
its last pass and ends bit for bit where the uninterrupted run ends; a change to anything the
pass depends on is a different key; the sweep and the CLI remove the passes once the result is
safe."""

import json
import subprocess
import sys

import numpy as np
import pytest

import aimsym
from aimsym.derive.files import derivations_dir
from aimsym.smi.passes import Passes, channel_key
from aimsym.smi.se import make_channel, state_evolution
from aimsym.studies import sweep

D = derivations_dir()


class Stop(Exception):
    pass


def _stopping_after(k):
    calls = {"n": 0}

    def on_pass(_):
        calls["n"] += 1
        if calls["n"] == k:
            raise Stop

    return on_pass


@pytest.mark.parametrize("model_file, alpha", [("attention_L2_T2.toml", 0.6), ("glm_phase_retrieval.toml", 1.5)])
def test_a_stopped_run_resumes_to_the_same_bits(tmp_path, model_file, alpha):
    m = aimsym.load(D / model_file, **({"c": 1.0} if "attention" in model_file else {}))
    kw = dict(samples=256, replicas=4, seed=3)
    fresh = Passes(tmp_path / "fresh")  # (a run repeats a few Q itself: the final map at the fixed point)
    ref = state_evolution(m, alpha, errors=False, channel=make_channel(m, **kw, checkpoint=fresh))
    plain = state_evolution(m, alpha, errors=False, channel=make_channel(m, **kw))
    assert np.array_equal(plain.Q, ref.Q)  # keeping passes changes nothing
    n_ref = ref.iterations
    assert n_ref >= 4  # (a run long enough to stop in the middle)

    # stop after 3 passes (as a wall-time kill would), then the same call again
    passes = Passes(tmp_path / "passes")
    ch = make_channel(m, **kw, checkpoint=passes)
    ch.on_pass = _stopping_after(3)
    with pytest.raises(Stop):
        state_evolution(m, alpha, errors=False, channel=ch)
    assert passes.writes == 3 and len(list((tmp_path / "passes").glob("*.npz"))) == 3

    again = Passes(tmp_path / "passes")
    res = state_evolution(m, alpha, errors=False, channel=make_channel(m, **kw, checkpoint=again))
    # the three passes made before the stop are replayed, not recomputed
    assert again.hits == fresh.hits + 3 and again.writes == fresh.writes - 3
    assert np.array_equal(res.Q, ref.Q) and np.array_equal(res.Q_stderr, ref.Q_stderr)
    assert res.iterations == ref.iterations and res.history == ref.history
    assert res.free_entropy == ref.free_entropy

    # a third run replays every pass (nothing computed)
    third = Passes(tmp_path / "passes")
    res3 = state_evolution(m, alpha, errors=False, channel=make_channel(m, **kw, checkpoint=third))
    assert third.writes == 0 and third.hits >= n_ref and np.array_equal(res3.Q, ref.Q)


def test_the_key_covers_what_a_pass_depends_on():
    m = aimsym.load(D / "attention_L2_T2.toml", c=1.0)
    ch = make_channel(m, samples=64, replicas=2, seed=0)
    base = channel_key(m, ch.den, ch.points)
    assert channel_key(m, ch.den, ch.points.copy()) == base
    assert channel_key(aimsym.load(D / "attention_L2_T2.toml", c=2.0), ch.den, ch.points) != base  # parameters
    assert channel_key(m, m.denoiser(tol=1e-6), ch.points) != base  # denoiser settings
    pts = ch.points.copy()
    pts[0, 0, 0] += 1e-15
    assert channel_key(m, ch.den, pts) != base  # points


def test_damaged_pass_is_computed_again(tmp_path):
    m = aimsym.load(D / "glm_sign.toml")
    passes = Passes(tmp_path)
    ch = make_channel(m, samples=64, replicas=2, seed=0, checkpoint=passes)
    Q = np.array([[0.3]])
    out, _, _ = ch.denoise(Q)
    (f,) = list(tmp_path.glob("*.npz"))
    f.write_bytes(f.read_bytes()[:40])  # a write cut short (not by us: ours are renamed into place)
    again, _, _ = ch.denoise(Q)
    assert passes.hits == 0 and passes.writes == 2
    assert np.array_equal(again.g_out, out.g_out)
    third, _, _ = ch.denoise(Q)
    assert passes.hits == 1 and np.array_equal(third.dg_out, out.dg_out)


def test_sweep_removes_the_passes_of_stored_points(tmp_path):
    store = tmp_path / "s.sqlite"
    n = sweep.run_sweep(str(D / "glm_sign.toml"), [0.5, 1.0], store=store, samples=128, workers=1, progress=False)
    assert n == 2
    assert not sweep.passes_folder(store).exists()


def test_a_sweep_point_stopped_mid_way_resumes_from_its_passes(tmp_path, monkeypatch):
    """The passes a killed sweep point left are replayed by the next run of the sweep."""
    store = tmp_path / "s.sqlite"
    text, name = sweep.model_source(str(D / "glm_sign.toml"))
    opts = {"samples": 128, "replicas": 8, "seed": 0, "nodes": None, "tol": 1e-4}
    key = sweep.point_key(aimsym.load(D / "glm_sign.toml").hash(), 1.0, "uninformed", opts)
    folder = sweep._point_passes(sweep.passes_folder(store), key)
    row = sweep.run_point(text, name, {}, 1.0, "uninformed", opts, None, str(sweep.passes_folder(store)))
    kept = len(list(folder.glob("*.npz")))
    assert kept >= 3  # (as if the client had been killed before storing the point)
    hits, load = [], Passes.load

    def counting(self, k, Q):
        out = load(self, k, Q)
        hits.append(out is not None)
        return out

    monkeypatch.setattr(Passes, "load", counting)
    sweep.run_sweep(str(D / "glm_sign.toml"), [1.0], store=store, samples=128, workers=1, progress=False)
    assert len(hits) >= kept and all(hits)  # every pass replayed, none recomputed
    assert sweep.export(store)[0]["Q_00"] == json.loads(row[5])["Q"][0][0]
    assert not folder.exists()


def test_cli_se_checkpoint_is_removed_after_the_result(tmp_path):
    folder = tmp_path / "ck"
    r = subprocess.run([sys.executable, "-m", "aimsym.cli", "se", str(D / "glm_sign.toml"), "--alpha", "1.0",
                        "--samples", "128", "--checkpoint", str(folder), "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["converged"]
    assert not folder.exists()


def test_thresholds_resume_from_their_passes(tmp_path):
    """The same threshold report again replays every pass (none computed) and gives the same bits."""
    from aimsym.smi.thresholds import threshold_report

    m = aimsym.load(D / "attention_L2_T2.toml", c=1.0)
    kw = dict(samples=4096, se_samples=256, pr_samples=256, pr_algorithmic=False, stair_steps=1)
    first = Passes(tmp_path / "th")
    a = threshold_report(m, **kw, checkpoint=first)
    assert first.writes > 0
    again = Passes(tmp_path / "th")
    b = threshold_report(m, **kw, checkpoint=again)
    assert again.writes == 0 and again.hits >= first.writes
    assert a.initial.alpha == b.initial.alpha and [s.alpha for s in a.staircase] == [s.alpha for s in b.staircase]
    assert b.perfect_recovery.local.local_alpha == a.perfect_recovery.local.local_alpha


def test_cli_checkpoint_with_a_phase_diagram_is_refused(tmp_path):
    r = subprocess.run([sys.executable, "-m", "aimsym.cli", "thresholds", str(D / "attention_L2_T2.toml"),
                        "--over", "c=0.5:1:2", "--checkpoint", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "--checkpoint" in r.stderr and "Traceback" not in r.stderr


def test_cli_checkpoint_clearing_removes_the_kept_points_too(tmp_path):
    """--checkpoint DIR holds passes and, in DIR/points, the staircase's kept restricted SE points
    (smi.passes.Kept): both go once the result is printed; files that are not ours stay."""
    from types import SimpleNamespace

    from aimsym.cli.se import _clear_checkpoint, _kept
    from aimsym.smi.passes import Kept

    args = SimpleNamespace(checkpoint=str(tmp_path / "ck"))
    Kept(_kept(args), {"step": 2}).put("1.1", {"f": 0.5})
    (tmp_path / "ck" / "a.npz").write_bytes(b"x")
    _clear_checkpoint(args)
    assert not (tmp_path / "ck").exists()
    Kept(_kept(args), {"step": 2}).put("1.1", {"f": 0.5})
    (tmp_path / "ck" / "notes.txt").write_text("mine")
    _clear_checkpoint(args)
    assert (tmp_path / "ck" / "notes.txt").is_file() and not (tmp_path / "ck" / "points").exists()


def test_kept_results_need_the_same_key(tmp_path):
    from aimsym.smi.passes import Kept

    Kept(tmp_path, {"a": 1}).put("x", [1.5, 2.0])
    assert Kept(tmp_path, {"a": 1}).get("x") == [1.5, 2.0]
    assert Kept(tmp_path, {"a": 2}).get("x") is None
    path = Kept(tmp_path, {"a": 1}).path
    path.write_text("{broken")
    assert Kept(tmp_path, {"a": 1}).get("x") is None  # (damaged: computed again)
