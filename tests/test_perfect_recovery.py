"""Perfect recovery (theory section 4): the counting bound m, alpha_PR = p/m, the state evolution
near Q = I (convergence relative to 1 - Q, honest fixed-point errors), the local stability of
Q = I and the algorithmic threshold of the uninformed SE."""

from __future__ import annotations


import numpy as np
import pytest
import sympy as sp
from hypothesis import given, settings
from hypothesis import strategies as st

import aimsym
from aimsym.derive.spec import loads
from aimsym.smi.perfect import local_stability, perfect_recovery
from aimsym.smi.se import PERFECT_RESOLUTION, make_channel, state_evolution
from aimsym.derive.symbolic import counting_rank, derive
from aimsym.derive.files import derivations_dir

ROOT = str(derivations_dir()) + "/"

LINEAR = """[model]
kind = "smi"
name = "linear_noiseless"
indices = 1
tokens = 1
link = "z[0, 0]"
"""


def _exact_rank(d, rng) -> int:
    """Generic rank of dy/dZ from SymPy's expanded Jacobian at random rational points (exact
    arithmetic: an independent check of the numerical rank with its singular-value gap)."""
    J = d.jacobian
    flat = sp.Matrix(int(np.prod(d.output_shape)), d.p * d.tokens, list(sp.flatten(J.tolist())))
    best = 0
    for _ in range(3):
        subs = {z: sp.Rational(int(rng.integers(-9, 10)) or 1, int(rng.integers(1, 7))) for z in d.Z}
        subs.update({s: sp.Rational(int(rng.integers(2, 9)), 4) for s in d.params})
        best = max(best, flat.subs(subs).rank())
    return best


# ----------------------------------------------------------------------------- counting
@pytest.mark.parametrize("name, m, alpha_pr", [
    ("attention_L2_T2", 2, 1.0), ("attention_L2_T3", 3, 2 / 3), ("attention_L3_T2", 2, 1.5),
    ("attention_L1_T2", 2, 0.5), ("attention_L2_T2_heads2", 2, 1.5), ("attention_L2_T2_untied", 2, 2.0),
    ("glm_phase_retrieval", 1, 1.0), ("mim_product", 1, 2.0),
])
def test_counting_rank_of_bundled_noiseless_models(name, m, alpha_pr):
    c = aimsym.load(ROOT + name + ".toml").derivation.counting
    assert c["m"] == m and c["noiseless"]
    assert c["alpha_pr"] == pytest.approx(alpha_pr, rel=1e-12)
    assert c["margin"] is None or c["margin"] > 1e4


@pytest.mark.parametrize("name", ["glm_sign", "attention_hardmax_L1_T2", "hardmax_L2_T2"])
def test_discrete_outputs_are_never_perfectly_recovered(name):
    model = aimsym.load(ROOT + name + ".toml")
    c = model.derivation.counting
    assert c["m"] == 0 and c["alpha_pr"] is None and "discrete" in c["note"]
    pr = perfect_recovery(model, algorithmic=False)
    assert pr["alpha"] is None and pr["local_alpha"] is None


def test_noisy_link_has_no_perfect_recovery():
    model = aimsym.load(ROOT + "gaussian_channel.toml", Delta=0.5)
    assert "Delta = 0" in model.derivation.counting["note"]
    pr = perfect_recovery(model, algorithmic=False)
    assert pr["alpha"] is None and "noisy" in pr["note"]


def _fd_rank(model, rng, n_points: int = 4, h: float = 1e-6) -> int:
    """Rank of central finite differences of the generated link kernel (another code path than
    the derivation's chain rule), read off a gap of 1e4 in the singular values."""
    best = 0
    for _ in range(n_points):
        Z = rng.standard_normal((model.p, model.tokens))
        cols = []
        for k in range(model.p):
            for t in range(model.tokens):
                E = np.zeros_like(Z)
                E[k, t] = h
                cols.append(((model.link(Z + E) - model.link(Z - E)) / (2 * h)).ravel())
        s = np.linalg.svd(np.array(cols).T, compute_uv=False)
        gaps = s[:-1] / np.maximum(s[1:], 1e-300)
        r = int(np.argmax(gaps > 1e4)) + 1 if np.any(gaps > 1e4) else len(s)
        best = max(best, r)
    return best


@pytest.mark.parametrize("name", ["attention_L1_T2", "attention_L2_T2", "attention_L2_T3", "attention_L3_T2"])
def test_counting_rank_matches_finite_difference_rank_of_the_generated_link(name):
    model = aimsym.load(ROOT + name + ".toml", **({"skip": 1.0} if name != "attention_L1_T2" else {"beta": 1.0}))
    assert model.derivation.counting["m"] == _fd_rank(model, np.random.default_rng(1))


def test_counting_rank_matches_exact_rank_on_one_layer():
    d = aimsym.load(ROOT + "attention_L1_T2.toml").derivation
    assert counting_rank(d)["m"] == _exact_rank(d, np.random.default_rng(1)) == 2


@settings(max_examples=12, deadline=None)
@given(st.lists(st.sampled_from(["z[0, 0]", "z[1, 0]", "z[0, 0]*z[1, 0]", "z[0, 0]**2", "exp(z[1, 0])",
                                 "z[0, 0] + z[1, 0]", "3*z[0, 0] - 2*z[1, 0]", "z[0, 0]*z[0, 0]"]),
                min_size=1, max_size=3),
       st.integers(0, 1000))
def test_counting_rank_equals_exact_rank_on_declared_links(outputs, seed):
    """Links a user would declare: a vector of 2-4 outputs of two indices; the numerical rank
    equals SymPy's exact rank (at random rational points), and alpha_PR = p / m."""
    # (the last output uses both indices: a link that ignores one is refused as degenerate)
    link = "[" + ", ".join(f'"{o}"' for o in outputs + ["z[0, 0] * exp(z[1, 0])"]) + "]"
    spec = loads(f'[model]\nkind = "smi"\nindices = 2\ntokens = 1\nlink = {link}\n')
    d = derive(spec)
    c = counting_rank(d)
    assert c["m"] == _exact_rank(d, np.random.default_rng(seed))
    assert c["alpha_pr"] == (pytest.approx(2 / c["m"]) if c["m"] else None)


# ----------------------------------------------------------------------------- SE near Q = I
@pytest.fixture(scope="module")
def linear():
    return aimsym.load(LINEAR)


@pytest.mark.parametrize("alpha", [0.5, 0.9, 0.99])
def test_linear_noiseless_error_below_alpha_pr_is_one_minus_alpha(linear, alpha):
    """y = z, p = T = 1: the fixed point is 1 - Q = 1 - alpha below alpha = 1. Near alpha = 1
    the fixed point of the sampled map moves by 1/(1 - J) times the one-step spread: the
    reported standard error must cover the actual error (it did not when it was the one-step
    spread: 2e-5 against an actual 6e-3 at alpha = 0.99)."""
    res = state_evolution(linear, alpha, samples=1024, errors=False, max_iter=3000)
    assert res.converged
    e, s = res.errors["layers"][0], res.errors["layers_stderr"][0]
    assert e > 1e-6 and not res.errors["perfect_recovery"][0]
    assert abs(e - (1 - alpha)) < 4 * s
    assert s < 0.02


def test_linear_noiseless_fixed_point_errors_are_calibrated(linear):
    z = []
    for seed in range(8):
        res = state_evolution(linear, 0.95, samples=512, errors=False, max_iter=3000, seed=seed)
        z.append((res.errors["layers"][0] - 0.05) / res.errors["layers_stderr"][0])
    z = np.array(z)
    assert abs(z.mean()) < 1.5 and 0.4 < z.std(ddof=1) < 2.0, z


@pytest.mark.parametrize("alpha", [1.05, 2.0])
def test_linear_noiseless_perfect_recovery_above_alpha_pr(linear, alpha):
    res = state_evolution(linear, alpha, samples=1024, errors=False, max_iter=3000)
    assert res.converged and res.perfect_recovery
    assert res.errors["layers"] == [0.0] and res.errors["resolution"] == PERFECT_RESOLUTION


def test_convergence_is_relative_to_the_error():
    """Converged means 1 - Q_kk is located to relative accuracy tol: the fixed point at tol
    equals the one at tol / 100 to a few tol relative to 1 - Q (not to tol absolute in Q)."""
    model = aimsym.load(LINEAR)
    a = state_evolution(model, 0.99, samples=1024, errors=False, tol=1e-4, max_iter=5000)
    b = state_evolution(model, 0.99, samples=1024, errors=False, tol=1e-6, max_iter=5000)
    ea, eb = a.errors["layers"][0], b.errors["layers"][0]
    assert abs(ea - eb) < 5e-4 * eb


@pytest.fixture(scope="module")
def phase_retrieval():
    return aimsym.load(ROOT + "glm_phase_retrieval.toml")


@pytest.mark.parametrize("alpha", [0.9, 0.99])
def test_phase_retrieval_no_perfect_recovery_below_counting_bound(phase_retrieval, alpha):
    for init in ("uninformed", "informed"):
        res = state_evolution(phase_retrieval, alpha, init=init, samples=1024, errors=False, max_iter=3000)
        assert min(res.errors["layers"]) > 1e-6 and not any(res.errors["perfect_recovery"])


def test_phase_retrieval_rank_identity_and_local_stability(phase_retrieval):
    """tr Pi = m = 1 at V -> 0 (within its standard error and the O(sqrt V) finite-V term) and
    Q = I attracts just above the counting bound: informed start at 1.05 -> Q = I; the
    uninformed start at 1.05 stays below (its threshold is a jump further up)."""
    ch = make_channel(phase_retrieval, samples=4096, replicas=8, seed=0)
    loc = local_stability(ch)
    assert abs(loc["trace_Pi"] - 1.0) < 3 * loc["trace_Pi_stderr"] + 3e-3
    assert loc["local_alpha"] == pytest.approx(1.0, abs=3 * loc["local_alpha_stderr"] + 3e-3)
    _nishimori_form_agrees(loc, 1.0, 1.0)
    inf = state_evolution(phase_retrieval, 1.05, init="informed", channel=ch, errors=False, max_iter=3000)
    assert inf.perfect_recovery
    uninf = state_evolution(phase_retrieval, 1.05, channel=ch, errors=False, max_iter=3000)
    assert not uninf.perfect_recovery and min(uninf.errors["layers"]) > 0.05


@pytest.mark.slow
def test_phase_retrieval_algorithmic_threshold_is_a_jump_above_the_counting_bound(phase_retrieval):
    pr = perfect_recovery(phase_retrieval, samples=4096)
    assert pr["counting_alpha"] == 1.0 and pr["kind"] == "jump"
    assert 1.05 < pr["alpha"] < 1.25 and pr["stderr"] < 0.03


@pytest.mark.parametrize("algorithmic", [pytest.param(True, marks=pytest.mark.slow), False])
def test_phase_diagram_carries_the_perfect_recovery_curve(tmp_path, algorithmic):
    """One softmax layer (y fixes z up to sign: m = 2, p = 1, alpha_PR = 1/2) over beta: each
    point has the perfect-recovery threshold (the uninformed SE's, slow; or the local stability
    of Q = I) at or above the counting bound, and phase_rows turns it into one more curve after
    the staircase."""
    from aimsym.plot import se as plot
    from aimsym.smi.thresholds import phase_diagram, phase_rows

    pd = phase_diagram(ROOT + "attention_L1_T2.toml", "beta", [1.0, 2.0], workers=1, samples=1 << 11,
                       staircase=False, perfect=True, pr_samples=512, pr_algorithmic=algorithmic)
    for pt in pd["points"]:
        pr = pt["perfect_recovery"]
        assert pr["counting_alpha"] == 0.5 and pr["m"] == 2
        if algorithmic:
            assert pr["alpha"] >= 0.5 - 3 * pr["stderr"]
        assert pr["local_alpha"] >= 0.5 - 3 * pr["local_alpha_stderr"]
        assert abs(pr["trace_Pi"] - 2) < 3 * pr["trace_Pi_stderr"] + 0.02
    rows = phase_rows(pd)
    curve = [r for r in rows if r.get("perfect")]
    assert len(curve) == 2 and all(r["step"] == 1 for r in curve)
    plot.phase_diagram(rows, tmp_path / "pd.png")
    assert (tmp_path / "pd.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [0.9, 0.99])
def test_two_layers_no_perfect_recovery_below_the_counting_bound(alpha):
    """Two layers, T = 2, skip 1 (alpha_PR = 1): the certified SE (error control + mode-centred
    rescue) stays off Q = I below the bound; the former fixed rule reached 1 - Q ~ 1e-7 at 0.99."""
    model = aimsym.load(ROOT + "attention_L2_T2.toml", skip=1.0)
    res = state_evolution(model, alpha, samples=1024, errors=False)
    assert not any(res.errors["perfect_recovery"]) and min(res.errors["layers"]) > 1e-6
    assert res.diagnostics["quadrature_missed"] == 0


@pytest.mark.slow
def test_two_layers_rank_identity_near_V0():
    model = aimsym.load(ROOT + "attention_L2_T2.toml", skip=1.0)
    loc = local_stability(make_channel(model, samples=2048, replicas=8, seed=0))
    assert abs(loc["trace_Pi"] - 2.0) < 3 * loc["trace_Pi_stderr"]
    assert abs(loc["local_alpha"] - 1.0) < 3 * loc["local_alpha_stderr"] + 0.01
    _nishimori_form_agrees(loc, 2.0, 1.0)


@pytest.mark.parametrize("name, m, samples", [
    ("mim_product", 1, 1024),
    pytest.param("attention_L2_T3", 3, 512, marks=pytest.mark.slow),
    pytest.param("attention_L3_T2", 2, 1024, marks=pytest.mark.slow),
    pytest.param("attention_L2_T2_heads2", 2, 1024, marks=pytest.mark.slow),
])
def test_rank_identity_and_local_stability_beyond_two_dimensions(name, m, samples):
    """Models whose fixed rules fail near V = 0 (k >= 3; y = z1 z2, whose 1-D reduction has a
    1/|z1| singularity): with the mode-centred rule there, tr Pi = m and the local stability of
    Q = I at alpha = p / m, each within its standard error."""
    model = aimsym.load(ROOT + f"{name}.toml", **({} if name == "mim_product" else {"skip": 1.0}))
    loc = local_stability(make_channel(model, samples=samples, replicas=8, seed=0))
    assert abs(loc["trace_Pi"] - m) < 3 * loc["trace_Pi_stderr"]
    assert abs(loc["local_alpha"] - model.p / m) < 3 * loc["local_alpha_stderr"] + 0.01
    _nishimori_form_agrees(loc, m, model.p / m)


def _nishimori_form_agrees(loc, m, alpha_pr):
    """Pi's Nishimori form (from dg_out) estimates the same: tr = m and local_alpha = p/m within its
    own, much smaller, error (plus the O(V) finite-scale term), and the two forms agree within the
    g g^T form's error (a check of the denoiser)."""
    assert abs(loc["trace_Pi_nishimori"] - m) < 4 * loc["trace_Pi_nishimori_stderr"] + 2e-3 * m
    assert abs(loc["local_alpha_nishimori"] - alpha_pr) < 4 * loc["local_alpha_nishimori_stderr"] + 2e-3 * alpha_pr
    assert loc["trace_Pi_nishimori_stderr"] < loc["trace_Pi_stderr"]
    assert abs(loc["trace_Pi"] - loc["trace_Pi_nishimori"]) < 3 * loc["trace_Pi_stderr"]


def test_phase_diagram_local_perfect_recovery_curve(tmp_path):
    """--pr-local: the phase diagram's perfect-recovery curve is local_alpha (no SE bisection),
    labelled as local stability; at one softmax layer it sits at p/m = 1/2."""
    from aimsym.plot import se as plot
    from aimsym.smi.thresholds import phase_diagram, phase_rows

    pd = phase_diagram(ROOT + "attention_L1_T2.toml", "beta", [1.0, 2.0], workers=1, samples=1 << 11,
                       staircase=False, perfect=True, pr_samples=512, pr_algorithmic=False)
    assert all(pt["perfect_recovery"]["alpha"] is None for pt in pd["points"])
    curve = [r for r in phase_rows(pd) if r.get("perfect")]
    assert [r["perfect"] for r in curve] == ["local", "local"]
    assert all(r["counting"] == 0.5 for r in curve)  # the counting bound p/m, drawn as a line
    assert all(abs(r["alpha"] - 0.5) < 3 * r["stderr"] + 0.01 for r in curve)
    plot.phase_diagram(phase_rows(pd), tmp_path / "pd.png")
    assert (tmp_path / "pd.png").stat().st_size > 1000
