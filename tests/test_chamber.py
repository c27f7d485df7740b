"""The chamber rule (aimsym.denoise.chamber): the reduced integral of tied attention models over the
chambers of each block's braid arrangement. Geometry, agreement with independent rules (the
two-layer polar rule, scipy cubature), honesty of its level-difference estimate, the fallback
when a model is beyond its budget, and the defaults that select it."""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from modal_reference import h_of, outputs, polar_reference, reference
from untied_reference import reference_fine

import aimsym
from aimsym.denoise import chamber, modal
from aimsym.denoise.output import difference
from aimsym.derive.files import derivations_dir
from aimsym.smi import se

D = derivations_dir()


def load(name, c=1.0):
    return aimsym.load(D / f"{name}.toml", c=c)


def points(m, rng, n, kinds=(0, 1, 2, 3)):
    """SE-like points: (omega, obs, V) in four regimes (moderate; last layer nearly known;
    first layer partly known; correlated V)."""
    p, T = m.p, m.tokens
    oms, obs, Vs = [], [], []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if kind == 0:
            V = rng.uniform(0.3, 0.9) * np.eye(p)
        elif kind == 1:
            V = np.diag(np.r_[rng.uniform(0.5, 1.0, p - 1), rng.uniform(0.02, 0.1)])
        elif kind == 2:
            V = np.diag(np.r_[rng.uniform(0.2, 0.5), rng.uniform(0.5, 1.0, p - 1)])
        else:
            A = rng.standard_normal((p, p))
            V = 0.4 * np.eye(p) + 0.1 * A @ A.T
            V = V / max(1.0, np.linalg.eigvalsh(V).max() / 0.95)
        Q = np.eye(p) - V
        om = np.linalg.cholesky(Q + 1e-12 * np.eye(p)) @ rng.standard_normal((p, T))
        Z = om + np.linalg.cholesky(V) @ rng.standard_normal((p, T))
        oms.append(om)
        obs.append(m.observation(Z))
        Vs.append(V)
    return np.array(oms), np.array(obs), np.array(Vs)


@settings(max_examples=30, deadline=None)
@given(T=st.integers(2, 4), seed=st.integers(0, 2**32 - 1))
def test_chambers_tile_the_space(T, seed):
    """Every point of R^T lies in exactly one chamber C or -C (q = +-E_C g, g >= 0), and the
    gap matrices are unimodular: (T + 1)!/2 pairs, each cone the sorted order of (q, 0)."""
    E = chamber.chambers(T)
    assert len(E) == np.prod(np.arange(1, T + 2)) // 2
    assert np.allclose(np.abs(np.linalg.det(E)), 1.0)
    q = np.random.default_rng(seed).standard_normal((64, T))
    g = np.einsum("cij,nj->nci", np.linalg.inv(E), q)  # gaps of q in chamber c
    inside = np.all(g >= 0, axis=2) | np.all(g <= 0, axis=2)  # C or -C
    assert np.all(inside.sum(axis=1) == 1)


def test_node_count_is_the_kernels():
    m = load("attention_L2_T3")
    K = modal.load(m.kernels)
    om, obs, V = points(m, np.random.default_rng(0), 1)
    _, _, ex, st_ = chamber.evaluate(K, obs, om, V, m.params_array(), 1, np.ones(1))
    assert st_[0] == 0 and ex[0, 1] == chamber.nodes_per_block(3, 1)


@pytest.mark.parametrize("c", [0.3, 1.0, 3.0])
def test_two_layer_chamber_rule_matches_the_polar_rule(c):
    """Two layers at T = 2: the chamber rule (one block, its six chambers) against the mapped polar
    rule (an independent rule with its own tests), both far below 1e-9, in four SE regimes."""
    m = load("attention_L2_T2", c)
    K = modal.load(m.kernels)
    om, obs, V = points(m, np.random.default_rng(int(10 * c)), 8)
    ok, g, dg, lz, est, _, status = chamber.run(K, obs, om, V, m.params_array(), tol=1e-11)
    ref = m.denoiser(tol=1e-12)(None, om, V, obs=obs)
    assert np.all(status == 0) and np.all(est <= 1e-9)
    assert np.all(difference(g, dg, ref.g_out, ref.dg_out, lz, ref.log_z_out) <= 1e-10 + est + ref.error)


def _against_cubature(name, p, T, seed):
    """The chamber rule at tol 1e-9 against scipy's adaptive Gauss-Kronrod cubature on a prior box
    (tests/modal_reference.py) at rtol 1e-10, at one SE point (Q = 0.4 I): their difference."""
    m = load(name)
    K = modal.load(m.kernels)
    rng = np.random.default_rng(seed)
    V = 0.6 * np.eye(p)
    om = np.sqrt(0.4) * rng.standard_normal((p, T))
    Z = om + np.sqrt(0.6) * rng.standard_normal((p, T))
    h = h_of(name, Z, 1.0)
    lz_ref, mean, second, status = reference(name, h, om, V, 1.0, rtol=1e-10)
    assert status == "converged"
    g_ref, dg_ref = outputs(V, om, mean, second)
    ok, g, dg, lz, est, _, st_ = chamber.run(K, h[None], om[None], V[None], m.params_array(), tol=1e-9)
    assert ok[0] and st_[0] == 0
    return difference(g, dg, g_ref[None], dg_ref[None], lz, np.array([lz_ref]))[0]


def test_three_token_chamber_rule_matches_independent_cubature():
    """Two layers at T = 3 (k = 3): 1e-8."""
    assert _against_cubature("attention_L2_T3", 2, 3, 21) <= 1e-8


# SE points of the k = 4 models for the polar-product reference: isotropic and anisotropic V
K4_POINTS = [(23, (0.6, 0.6, 0.6)), (24, (0.6, 0.6, 0.6)), (25, (0.3, 0.8, 0.5))]


def _against_polar_reference(name, seed, v):
    """The chamber rule at tol 1e-9 against the polar-product reference (tests/modal_reference.py:
    each block's row in polar coordinates split at its walls, tanh-sinh in angle) at two sizes:
    (difference to the finer reference, the references' own difference, the rule's estimate)."""
    m = load(name)
    K = modal.load(m.kernels)
    rng = np.random.default_rng(seed)
    V = np.diag(v)
    om = np.sqrt(1 - np.array(v))[:, None] * rng.standard_normal((3, 2))
    Z = om + np.sqrt(np.array(v))[:, None] * rng.standard_normal((3, 2))
    h = h_of(name, Z, 1.0)
    refs = []
    for n_angle, n_radius in ((20, 16), (24, 20)):
        lz_ref, mean, second = polar_reference(name, h, om, V, 1.0, n_angle=n_angle, n_radius=n_radius)
        refs.append((*outputs(V, om, mean, second), lz_ref))
    (g1, dg1, lz1), (g2, dg2, lz2) = refs
    own = difference(g1[None], dg1[None], g2[None], dg2[None], np.array([lz1]), np.array([lz2]))[0]
    ok, g, dg, lz, est, _, st_ = chamber.run(K, h[None], om[None], V[None], m.params_array(), tol=1e-9)
    assert ok[0] and st_[0] == 0
    return difference(g, dg, g2[None], dg2[None], lz, np.array([lz2]))[0], own, est[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["attention_L3_T2", "attention_L2_T2_heads2"])
@pytest.mark.parametrize("seed,v", K4_POINTS)
def test_four_dimensional_chamber_rule_matches_independent_reference(name, seed, v):
    """k = 4 (two blocks: a product of chamber rules) against an independent rule: 1e-8, with the
    reference resolved (its two sizes agree to 1e-8; the finer is the closer). About a minute of CPU per point."""
    actual, own, est = _against_polar_reference(name, seed, v)
    print(name, seed, v, "difference", actual, "reference's own", own, "estimate", est)
    assert own <= 1e-8 and actual <= 1e-8, (actual, own, est)


def _level_honesty(name, n, top, seed):
    """Actual error of each level against level ``top`` vs its estimate (the difference to the
    level before): the share of (point, level) pairs with actual <= estimate."""
    m = load(name)
    K = modal.load(m.kernels)
    om, obs, V = points(m, np.random.default_rng(seed), n)
    res = [chamber.evaluate(K, obs, om, V, m.params_array(), lv, np.ones(n)) for lv in range(top + 1)]
    ref = res[-1]
    checked = 0
    bad = []
    for lv in range(1, top - 1):  # (levels next to the reference are not independent of it)
        cur, prev = res[lv], res[lv - 1]
        est = difference(cur[0], cur[1], prev[0], prev[1], cur[2][:, 0], prev[2][:, 0])
        act = difference(cur[0], cur[1], ref[0], ref[1], cur[2][:, 0], ref[2][:, 0])
        checked += n
        bad += [(lv, i, act[i], est[i]) for i in np.flatnonzero(act > est)]
    return checked, bad


def test_level_difference_estimate_is_honest_T3():
    checked, bad = _level_honesty("attention_L2_T3", 16, 6, 5)
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize("name", ["attention_L3_T2", "attention_L2_T2_heads2"])
def test_level_difference_estimate_is_honest_4d(name):
    checked, bad = _level_honesty(name, 16, 5, 6)
    assert not bad, bad


def test_beyond_the_budget_the_cascade_falls_back(monkeypatch):
    """With a budget below every level's node count the chamber rule cannot estimate its error;
    the fast path and the adaptive cubature take over and still meet tol."""
    m = load("attention_L2_T3")
    om, obs, V = points(m, np.random.default_rng(8), 2, kinds=(0,))
    ref = m.denoiser(tol=1e-9)(None, om, V, obs=obs)
    monkeypatch.setattr(chamber, "MAX_COMBINATIONS", 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = m.denoiser(rule="modal", tol=1e-5, max_regions=200_000)(None, om, V, obs=obs)
    assert np.all(out.error <= 1e-5)
    assert np.all(difference(out.g_out, out.dg_out, ref.g_out, ref.dg_out, out.log_z_out, ref.log_z_out)
                  <= out.error + ref.error)


@pytest.mark.parametrize("name", ["attention_L2_T3", "attention_L3_T2", "attention_L2_T2_heads2"])
def test_k3_and_k4_defaults_are_certified(name):
    """model.denoiser() and the SE's denoiser are the certified rule for k >= 3 attention models,
    the SE's tol set by its sample count; an explicit Gauss-Hermite size stays a fixed rule."""
    m = load(name)
    den = m.denoiser()
    assert den.rule == "modal" and den.tol == 1e-8
    assert se.denoiser_accuracy(m, samples=1 << 16) == {"rule": "modal", "tol": pytest.approx(se.SE_STAT_SHARE / 256),
                                                       "max_regions": se.SE_CERTIFIED_REGIONS,
                                                       "max_combinations": se.SE_CERTIFIED_COMBINATIONS,
                                                       "mean_tol": pytest.approx(se.SE_STAT_SHARE / 256)}
    assert se.denoiser_accuracy(m, samples=1024)["tol"] == se.SE_TOL_MAX
    assert se.denoiser_accuracy(m, nodes=6).get("nodes") == 6
    assert m.denoiser(nodes=6).rule == "auto"


@pytest.mark.parametrize("name", ["attention_L3_T2", "attention_L2_T2_heads2"])
def test_se_budget_reaches_the_finest_chamber_level(name):
    """The SE's node-combination budget admits the chamber levels of two T = 2 blocks up to
    (22, 48): where one layer is nearly known only the fine levels settle the far-tail samples
    (docs/performance.md); the two finer ones (~1e-9 and below) are for tight tolerances."""
    K = modal.load(load(name).kernels)
    assert chamber.max_level(K, se.SE_CERTIFIED_COMBINATIONS) == chamber.LEVELS.index((22, 48))


def test_untied_se_tol_follows_the_statistical_error():
    """Two untied layers (served by the mode-centred rule alone): the SE's denoiser tol is
    SE_STAT_SHARE / sqrt(samples), capped at SE_MODAL_TOL, so small SE runs use a cheaper level
    and large ones a finer one; the result's quadrature fields carry whatever it leaves."""
    m = load("attention_L2_T2_untied")
    small, large = se.denoiser_accuracy(m, samples=64), se.denoiser_accuracy(m, samples=1 << 16)
    assert small["tol"] == se.SE_MODAL_TOL
    assert large["tol"] == pytest.approx(se.SE_STAT_SHARE / 256)
    assert small["max_regions"] == large["max_regions"] == se.SE_MODAL_REGIONS
    assert small["mean_tol"] == small["tol"] and large["mean_tol"] == large["tol"]  # (its error is a mean)
    den = m.denoiser(**se.denoiser_accuracy(m, samples=512))
    assert den.rule == "modal" and den.tol == pytest.approx(se.SE_STAT_SHARE / np.sqrt(512))


@pytest.mark.slow
def test_untied_rule_matches_the_adaptive_cubature(monkeypatch):
    """Two untied layers at T = 2 (k = 5): the untied chamber rule against the mode-centred adaptive
    cubature (an independent rule over all five coordinates) within the two estimates."""
    m = load("attention_L2_T2_untied")
    om, obs, V = points(m, np.random.default_rng(4), 2, kinds=(0, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = m.denoiser(tol=1e-4)(None, om, V, obs=obs)
        monkeypatch.setattr(chamber, "applies", lambda K: False)
        ref = m.denoiser(tol=1e-4, max_regions=60_000)(None, om, V, obs=obs)
    assert np.all(out.error <= 1e-4)
    act = difference(out.g_out, out.dg_out, ref.g_out, ref.dg_out, out.log_z_out, ref.log_z_out)
    assert np.all(act <= out.error + ref.error), (act, out.error, ref.error)


def test_untied_level_difference_estimate_is_honest():
    m = load("attention_L2_T2_untied")
    K = modal.load(m.kernels)
    om, obs, V = points(m, np.random.default_rng(9), 4)
    res = [chamber.untied_evaluate(K, obs, om, V, m.params_array(), lv, np.ones(4)) for lv in range(4)]
    ref = res[-1]
    for lv in (1, 2):
        cur, prev = res[lv], res[lv - 1]
        est = difference(cur[0], cur[1], prev[0], prev[1], cur[2][:, 0], prev[2][:, 0])
        act = difference(cur[0], cur[1], ref[0], ref[1], cur[2][:, 0], ref[2][:, 0])
        assert np.all(act <= est), (lv, act, est)


@pytest.mark.slow
def test_untied_rule_matches_independent_reference_to_1e6():
    """Two methods at k = 5 (issue: 1e-6 for k <= 6): the certified untied denoiser at tol 1e-7
    against ``reference_fine`` (plain numpy; the key mean in closed form, a trapezoid in
    log|lambda| on each node's whole window, composite Gauss-Legendre in (z1Q, delta1) with panels
    at the attention's switching scale), whose two sizes agree within 1e-7. About 5 min."""
    m = load("attention_L2_T2_untied")
    om, obs, V = points(m, np.random.default_rng(4), 3, kinds=(0, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # level 4 ends at estimates 1e-7..5e-6
        out = m.denoiser(tol=1e-7)(None, om, V, obs=obs)
    for i in range(len(om)):
        refs = [reference_fine(obs[i][:2], om[i], V[i], 1.0, n_gl=n, n_t=128, panel=2.0) for n in (6, 8)]
        assert max(r[3] for r in refs) < 1e-12  # no weight on the windows' ends or the box's faces
        (l0, g0, d0), (l1, g1, d1) = ((r[0], *outputs(V[i], om[i], r[1], r[2])) for r in refs)
        ref_err = difference(g1[None], d1[None], g0[None], d0[None], np.array([l1]), np.array([l0]))[0]
        act = difference(out.g_out[i:i + 1], out.dg_out[i:i + 1], g1[None], d1[None], out.log_z_out[i:i + 1],
                         np.array([l1]))[0]
        print(f"point {i}: diag V {np.round(np.diag(V[i]), 3)}, denoiser vs reference {act:.1e}, reference two "
              f"sizes {ref_err:.1e}, denoiser's estimate {out.error[i]:.1e}")  # the table in docs/denoiser.md (-s)
        assert ref_err < 1e-7, (i, ref_err)
        assert act < 1e-6, (i, act, out.error[i])
        assert act <= out.error[i] + ref_err, (i, act, out.error[i], ref_err)


def test_fine_levels_split_a_batch_so_its_node_tables_fit_the_memory_cap(monkeypatch):
    """chamber.evaluate splits a batch into groups whose distinct node tables (one per block and
    grid radius) fit MAX_TABLE_BYTES: each sample in exactly one group, each group within the cap
    or a single sample, and the results those of the unsplit batch."""
    m = load("attention_L2_T3")
    K = modal.load(m.kernels)
    rng = np.random.default_rng(3)
    n = 6
    om = rng.standard_normal((n, 2, 3)) * np.linspace(0.5, 4.0, n)[:, None, None]  # (radii apart)
    V = 0.5 * np.eye(2)
    obs = np.array([m.observation(o + np.sqrt(0.5) * rng.standard_normal((2, 3))) for o in om])
    whole = chamber.evaluate(K, obs, om, V[None], m.params_array(), 2, np.ones(n))
    one = chamber.nodes_per_block(3, 2) * (9 + 3 + 2) * 8
    R = np.exp2(np.arange(n) // 2)[:, None] * np.ones((n, 1))  # three radii, two samples each
    groups = chamber.table_groups(R, one)
    assert sorted(np.concatenate(groups).tolist()) == list(range(n))
    assert all(len({float(r) for r in R[g, 0]}) * one <= chamber.MAX_TABLE_BYTES or g.size == 1 for g in groups)
    monkeypatch.setattr(chamber, "MAX_TABLE_BYTES", 2 * one)
    assert [len(g) for g in chamber.table_groups(R, one)] == [4, 2]
    Rs = np.empty((n, 1))
    K.chamber_radii(om, V[None], m.params_array(), chamber.RADIUS, np.ones(n), Rs)
    assert len(chamber.table_groups(chamber.radius_grid(Rs), one)) > 1  # (the batch is split)
    K.__dict__.pop("_chamber_tables", None)
    split = chamber.evaluate(K, obs, om, V[None], m.params_array(), 2, np.ones(n))
    for a, b in zip(whole, split):
        assert np.array_equal(a, b)


def test_combination_budget_sets_the_finest_level():
    """max_level(K, budget) is the finest level whose node combinations (per block, to the power of
    the blocks) fit the budget; the denoiser passes its max_combinations through."""
    m = load("attention_L3_T2")
    K = modal.load(m.kernels)
    nb = len(K.CHAMBER_BLOCKS)
    for lv in range(1, len(chamber.LEVELS)):
        n = chamber.nodes_per_block(int(K.T), lv) ** nb
        assert chamber.max_level(K, n) == lv and chamber.max_level(K, n - 1) == lv - 1
    assert m.denoiser(rule="modal", max_combinations=123).max_combinations == 123


@pytest.mark.slow
def test_budget_bench_reports_each_budget():
    """bench.denoiser --budget (the numbers behind the SE's budgets in docs/performance.md): one
    line per budget, with its count above tol and a finite mean estimate."""
    import re
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "aimsym.bench.denoiser", "--budget", "--budget-model",
                          "attention_L2_T2_heads2", "--budget-q", "0.9", "--budget-n", "2", "--budget-combos",
                          "1e5,6e6"], capture_output=True, text=True, check=True).stdout
    lines = [ln for ln in out.splitlines() if "node combinations" in ln]
    assert [re.search(r"regions, ([\d.e+]+) node", ln).group(1) for ln in lines] == ["1.0e+05", "6.0e+06"]
    for ln in lines:
        assert int(re.search(r"above tol: (\d+)", ln).group(1)) <= 2
        assert np.isfinite(float(re.search(r"mean estimate ([\d.e+-]+)", ln).group(1)))


def test_levels_bench_shows_the_rule_converging():
    """bench.denoiser --levels (the cost floor in docs/performance.md): each level alone against
    the finest, two layers at T = 3; the actual error falls by at least 5x per level (spectral
    convergence) and the node count grows."""
    from aimsym.bench.denoiser import bench_levels

    rows = bench_levels(["attention_L2_T3"], n=2, top=3)
    assert [r["level"] for r in rows] == [0, 1, 2]
    for a, b in zip(rows, rows[1:]):
        assert b["error_max"] <= a["error_max"] / 5 and b["combinations"] > a["combinations"]
    assert rows[0]["error_max"] > 1e-6  # (the coarsest level is far from 1e-8: the floor is real)


def test_untied_estimate_is_relative_to_the_returned_dg_out():
    """Two untied layers with the last key nearly known (V_KK = 2e-3; point 229 of the 1 000-point
    honesty run, seed 42): the marginalised key's residual covariance, added to dg_out after the
    integral, cancels most of it (|dg_out| 251 before, 1.7 after), so a level difference taken
    relative to dg_out before that understated the error 40x (estimate 2.6e-4, actual 5.2e-4).
    The estimate is relative to the dg_out returned, and bounds the actual error against the rule's
    finest level."""
    from test_denoiser_certified import _regime_points

    m = load("attention_L2_T2_untied")
    om, obs, V = (a[229:230] for a in _regime_points(m, np.random.default_rng(42), 230))
    assert V[0, 3, 3] < 3e-3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = m.denoiser(rule="modal", tol=1e-3, max_regions=2000)(None, om, V, obs=obs)
        top = m.denoiser(rule="modal", tol=1e-9, max_regions=2000)(None, om, V, obs=obs)
    actual = difference(out.g_out, out.dg_out, top.g_out, top.dg_out, out.log_z_out, top.log_z_out)[0]
    assert actual <= out.error[0] + top.error[0], (actual, out.error, top.error)
    K = modal.load(m.denoiser().kernels)
    res = chamber.residual_covariance(K, V)
    assert res is not None and chamber.final_scale(top.dg_out - res, res)[0] > 10  # the cancellation


def test_a_level_difference_that_did_not_shrink_is_not_taken_alone(monkeypatch):
    """Levels whose differences grow are not yet converging: a sample the finest level leaves above
    tol reports the sum of the last two differences where the last did not shrink (it can come
    close to the level before by chance), the last difference alone where it shrank."""
    from types import SimpleNamespace

    def run_with(lz_of_level):
        def fake_evaluate(K, obs, omega, V, params, level, growth):
            n = omega.shape[0]
            extra = np.zeros((n, 4))
            extra[:, 0] = lz_of_level[level]
            return np.zeros((n, 1, 2)), np.zeros((n, 1, 2, 1, 2)), extra, np.zeros(n, np.int64)

        monkeypatch.setattr(chamber, "evaluate", fake_evaluate)
        om, V, obs = np.zeros((1, 1, 2)), np.eye(1)[None], np.zeros((1, 2))
        ok, _, _, lz, est, _, _ = chamber.run(SimpleNamespace(), obs, om, V, np.zeros(0), tol=1e-9, start=1,
                                              max_level=3)
        assert not ok[0] and lz[0] == lz_of_level[3]
        return est[0]

    # differences 1e-3, 1e-4, 2e-4 (grew): 3e-4;  1e-3, 2e-4, 1e-4 (shrank): 1e-4
    assert run_with({0: 0.0, 1: 1e-3, 2: 1.1e-3, 3: 1.3e-3}) == pytest.approx(3e-4)
    assert run_with({0: 0.0, 1: 1e-3, 2: 1.2e-3, 3: 1.3e-3}) == pytest.approx(1e-4)


def test_batch_budget_continues_the_largest_estimates_until_the_excess_is_covered():
    est = np.array([1e-4, 5e-3, 2e-2, 3e-4, 8e-3, np.inf])
    active = np.array([1, 2, 4])
    # sum 3.34e-2, excess 2.34e-2: the two largest (gains 0.75 x 2e-2, 0.75 x 8e-3) cover 2.1e-2 only,
    # the third is needed too
    est[5] = 0.0
    assert chamber._within_budget(est, active, 1e-2).tolist() == [True, True, True]
    assert chamber._within_budget(est, active, 2e-2).tolist() == [False, True, False]  # 2e-2 alone covers 1.34e-2
    assert not chamber._within_budget(est, active, 4e-2).any()  # within the budget: nobody goes on
    est[5] = np.inf  # a sample without an estimate: the budget cannot be judged met
    assert chamber._within_budget(est, active, 1.0).all()


def test_mean_tol_stops_the_far_tail_samples_once_the_batch_mean_is_met():
    """SE points with the last layer nearly known (the three-layer SE past alpha = 0.8): with
    mean_tol = tol the costly samples stop above tol once the batch's mean estimate meets it; the
    others are the same bits as without it; each stopped sample keeps an estimate that covers its
    distance to the fully refined value; the warning says why."""
    m = load("attention_L3_T2")
    rng = np.random.default_rng(1)
    n, p, T = 32, m.p, m.tokens
    Q = np.diag([0.0, 0.0, 0.98])
    V = np.eye(p) - Q
    om = np.sqrt(Q) @ rng.standard_normal((n, p, T))
    obs = np.array([m.observation(z) for z in om + np.sqrt(V) @ rng.standard_normal((n, p, T))])
    acc = se.denoiser_accuracy(m, samples=512)
    assert acc["mean_tol"] == acc["tol"] == 1e-3
    with pytest.warns(RuntimeWarning, match="met mean_tol"):
        a = m.denoiser(**acc)(None, om, V, obs=obs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        b = m.denoiser(**{k: v for k, v in acc.items() if k != "mean_tol"})(None, om, V, obs=obs)
    ea, eb = np.asarray(a.error), np.asarray(b.error)
    stopped = ea > 1e-3
    assert stopped.any() and np.all(eb <= 1e-3)  # (not vacuous: some samples were stopped)
    assert ea.mean() <= 1e-3 and np.sum(a.ess) < 0.8 * np.sum(b.ess)
    d = difference(a.g_out, a.dg_out, b.g_out, b.dg_out, a.log_z_out, b.log_z_out)
    assert np.all(d[~stopped] == 0.0)
    assert np.all(d[stopped] <= ea[stopped] + eb[stopped])


def test_mean_tol_is_checked():
    with pytest.raises(aimsym.errors.ChannelError, match="mean_tol"):
        load("attention_L3_T2").denoiser(rule="modal", tol=1e-3, mean_tol=2.0)


def test_se_quadrature_summary_reports_the_batch_mean():
    class Out:
        error = np.array([2e-4, 3e-4, 4e-3, 1e-4])

    class Den:
        tol, mean_tol = 1e-3, 2e-3

    s = se.quadrature_summary(Out(), Den())
    assert s["quadrature_missed"] == 1 and s["quadrature_error_mean"] == pytest.approx(1.15e-3)
    assert s["quadrature_mean_tol"] == 2e-3
    assert "mean estimate met mean_tol = 0.002" in s["quadrature_note"]
    Den.mean_tol = 1e-3  # the mean is above it: the samples above tol are not explained by it
    assert "mean_tol" not in se.quadrature_summary(Out(), Den())["quadrature_note"]


@pytest.mark.slow
def test_samples_stopped_by_mean_tol_keep_honest_estimates():
    """The samples the batch target leaves above tol are the hard ones (the far tail where one
    layer is nearly known): against the rule at tol 1e-6, their actual error stays within their
    estimate (plus the reference's own), in four SE regimes of three layers (128 points each;
    seen: 72 stopped samples, actual / estimate <= 0.41; ~6 min of CPU)."""
    m = load("attention_L3_T2")
    p, T = m.p, m.tokens
    acc = se.denoiser_accuracy(m, samples=512)
    stopped, ok = 0, 0
    for q, seed in (((0, 0, 0.99), 3), ((0.2, 0.2, 0.995), 4), ((0.5, 0.3, 0.98), 5), ((0, 0, 0.97), 6)):
        rng = np.random.default_rng(seed)
        Q = np.diag(q)
        V = np.eye(p) - Q
        om = np.sqrt(Q) @ rng.standard_normal((128, p, T))
        obs = np.array([m.observation(z) for z in om + np.sqrt(V) @ rng.standard_normal((128, p, T))])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            a = m.denoiser(**acc)(None, om, V, obs=obs)
            e = np.asarray(a.error)
            st = np.flatnonzero(e > acc["tol"])
            ref = m.denoiser(rule="modal", tol=1e-6, max_regions=acc["max_regions"],
                             max_combinations=acc["max_combinations"])(None, om[st], V, obs=obs[st])
        act = difference(a.g_out[st], a.dg_out[st], ref.g_out, ref.dg_out, a.log_z_out[st], ref.log_z_out)
        stopped += st.size
        ok += int(np.sum(act <= e[st] + np.asarray(ref.error)))
    assert stopped >= 40  # (the target did stop samples: the check is not vacuous)
    assert ok >= 0.99 * stopped, (ok, stopped)


def test_se_quadrature_summary_counts_samples_without_an_estimate():
    """A sample whose error is not controlled (estimate inf: heavy-tailed weights at k >= 6) is
    counted and named in the note; the batch's maximum and mean say inf, not a finite number."""
    class Out:
        error = np.array([2e-4, np.inf, 3e-4])

    class Den:
        tol, mean_tol = 1e-3, None

    s = se.quadrature_summary(Out(), Den())
    assert s["quadrature_uncontrolled"] == 1 and s["quadrature_missed"] == 1
    assert s["quadrature_error_max"] == np.inf and s["quadrature_error_mean"] == np.inf
    assert "1 without an error estimate (not controlled)" in s["quadrature_note"]
    Out.error = np.array([2e-4, 3e-4])
    assert se.quadrature_summary(Out(), Den())["quadrature_uncontrolled"] == 0


def test_se_rewarn_sums_the_heavy_tail_counts_into_one_warning():
    """The QMC stage warns per call about heavy-tailed samples; the SE replaces those, and the
    'did not reach tol' ones, by one warning per pass that counts the uncontrolled samples."""
    import warnings as w

    class Out:
        error = np.array([2e-4, np.inf, 5e-3, 1e-4])

    caught = [w.WarningMessage("denoiser: 1 of 2 samples have heavy-tailed importance weights", RuntimeWarning,
                               "x.py", 1),
              w.WarningMessage("denoiser: 2 of 4 samples did not reach tol=0.001", RuntimeWarning, "x.py", 2),
              w.WarningMessage("something else", UserWarning, "x.py", 3)]
    with w.catch_warnings(record=True) as got:
        w.simplefilter("always")
        se._rewarn(caught, Out(), 1e-3)
    msgs = [str(x.message) for x in got]
    assert len(msgs) == 2 and "something else" in msgs
    summary = next(m for m in msgs if "did not reach" in m)
    assert "2 of 4 samples did not reach tol=0.001" in summary and "1 not controlled" in summary
