"""The resumable randomised-QMC reference (aimsym.bench.reference): the k >= 6 stage's points,
kept on disk so that a stopped run resumes to the same bits, and its comparison with the chamber
rule. Run here on two layers at T = 3 (k = 3: cheap, and the chamber rule is certified there)."""

import json
import warnings

import numpy as np

from aimsym.bench import reference
from aimsym.bench.denoiser import load_bench_model
from aimsym.denoise import modal, rqmc

MODEL = "attention_L2_T3"


def _run(state, *extra):
    return reference.main(["--state", str(state), "--model", MODEL, "--point", "1", *extra])


def test_a_resumed_run_gives_the_bits_of_an_uninterrupted_one(tmp_path):
    common = ("--no-chamber", "--chunk", "10", "--seeds", "2")
    _run(tmp_path / "once", "--log-n", "12", *common)
    _run(tmp_path / "twice", "--log-n", "11", *common)
    _run(tmp_path / "twice", "--log-n", "12", *common)
    for s in range(2):
        a, b = np.load(tmp_path / "once" / f"qmc_{s}.npz"), np.load(tmp_path / "twice" / f"qmc_{s}.npz")
        assert int(a["count"]) == int(b["count"]) == 4096
        assert np.array_equal(a["sums"], b["sums"])


def test_one_seed_is_the_denoisers_qmc_stage(tmp_path):
    """With the stage's proposal (nu = 4) and one step, the reference's seed 0 is rqmc.run's answer."""
    _run(tmp_path, "--no-chamber", "--log-n", "12", "--chunk", "12", "--seeds", "1", "--nu", "4")
    m = load_bench_model(MODEL, c=1.0)
    K = modal.load(m.kernels)
    om, obs, V = reference.se_point(m, 1, 0.6)
    nc, (cb, cm, cL, cla) = modal.modes(K, obs, om, V[None], m.params_array())
    g, dg, ex, st = rqmc.run(K, obs, om, V[None], m.params_array(), nc, cb, cm, cL, cla, np.arange(1), 1e-12,
                             max_points=4096, seed=0)
    ours = reference.seed_values(K, om, V, dict(np.load(tmp_path / "qmc_0.npz")))
    assert st[0] == 0
    np.testing.assert_allclose(ours[0], g[0], rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(ours[1], dg[0], rtol=1e-13, atol=1e-13)
    assert abs(ours[2] - ex[0, 0]) <= 1e-13


def test_comparison_with_the_chamber_rule_agrees_within_the_qmc_error(tmp_path):
    """At k = 3 the chamber rule at tol 1e-7 is far more accurate than 4 seeds of 2^14 points, so the
    comparison must show agreement within a few of the QMC's standard errors, and a shifted value
    must show as a large |t|."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _run(tmp_path, "--log-n", "14", "--chunk", "13", "--seeds", "4", "--tol", "1e-7", "--combinations", "2e7")
    c = json.loads((tmp_path / "comparison.json").read_text())
    assert c["points"] == 2**14
    for q in ("lz", "g", "dg"):
        assert 0 < c[q]["stderr"] < 1e-3
        assert c[q]["difference"] <= 5 * c[q]["stderr"] + 1e-7, (q, c[q])
    ref = dict(np.load(tmp_path / "chamber.npz"))
    assert ref["error"] <= 1e-7
    m = load_bench_model(MODEL, c=1.0)
    K = modal.load(m.kernels)
    om, _, V = reference.se_point(m, 1, 0.6)
    values = [reference.seed_values(K, om, V, dict(np.load(tmp_path / f"qmc_{s}.npz"))) for s in range(4)]
    # the 32 scramblings as replicates: the same picture, and on both sides of the chamber value
    n = 4 * rqmc.REPS
    assert c["lz"]["replicates"] == n and 0 < c["lz"]["stderr_replicates"] < 1e-3
    for q in ("lz", "g", "dg"):
        assert c[q]["difference"] <= 5 * c[q]["stderr_replicates"] + 1e-7, (q, c[q])
        assert all(0 < b < n for b in c[q]["below"]), (q, c[q]["below"])
    replicates = [v for s in range(4) for v in reference.scrambling_values(K, om, V, dict(np.load(tmp_path / f"qmc_{s}.npz")))]
    shifted = reference.compare({**ref, "lz": ref["lz"] + 50 * c["lz"]["stderr"]}, values, replicates)
    assert shifted["lz"]["t_max"] > 20 and shifted["lz"]["t_max_replicates"] > 20
    assert shifted["lz"]["below"] == [n]
    # the worst entries in both views: the shifted log Z first, and each listed entry's numbers
    # are the ones of the whole quantity where it is the largest
    w = shifted["lz"]["worst"][0]
    assert w["entry"] == 0 and w["below"] == n and w["t_replicates"] == shifted["lz"]["t_max_replicates"]
    for q in ("g", "dg"):
        top = c[q]["worst"][0]
        assert top["t_replicates"] == c[q]["t_max_replicates"] and abs(top["difference"]) <= c[q]["difference"]
        assert [e["t_replicates"] for e in c[q]["worst"]] == sorted((e["t_replicates"] for e in c[q]["worst"]),
                                                                    reverse=True)


def test_a_variant_of_the_chamber_rule_moves_its_answer_by_less_than_its_tol(tmp_path, capsys):
    """An error every level shares (a node-placement setting) cannot show in the level differences;
    a variant changes the setting. At k = 3 and tol 1e-9 the switching width and the radial domain
    move the answer by far less than tol, the variant is kept on disk and the setting restored; a
    wrong name or value is one line and exit."""
    from aimsym.denoise import chamber

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _run(tmp_path, "--log-n", "10", "--chunk", "10", "--seeds", "2", "--tol", "1e-9", "--combinations", "2e7",
             "--variant", "kappa=3", "--variant", "RADIUS=11")
    out = capsys.readouterr().out
    assert "chamber rule with KAPPA = 3: lz moves" in out and "chamber rule with RADIUS = 11:" in out
    assert chamber.KAPPA == 2.0 and chamber.RADIUS == 8.5
    ref = dict(np.load(tmp_path / "chamber.npz"))
    for f in ("chamber_KAPPA_3.npz", "chamber_RADIUS_11.npz"):
        alt = dict(np.load(tmp_path / f))
        assert max(reference.moved(ref, alt).values()) < 1e-9, (f, reference.moved(ref, alt))
    # and a shifted answer shows as moved by the shift
    assert abs(reference.moved(ref, {**ref, "lz": ref["lz"] + 1e-6})["lz"] - 1e-6) < 1e-15
    for bad in ("KAPPA", "NODES=3", "KAPPA=-1", "KAPPA=x"):
        try:
            _run(tmp_path / "bad", "--no-chamber", "--log-n", "10", "--variant", bad)
        except SystemExit as e:
            assert str(e).startswith(f"error: --variant {bad!r}"), e
        else:
            raise AssertionError(bad)
    assert not (tmp_path / "bad").exists()  # (nothing made before the arguments are checked)
