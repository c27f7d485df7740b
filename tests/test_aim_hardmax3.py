"""AIM hardmax output channel for T = 3: orthant probabilities, exact score, SE rule."""

import itertools

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from aimsym.aim import se
from aimsym.aim.channels import (
    Hardmax3Channel,
    hardmax3_moments,
    hardmax3_patterns,
    make_channel,
    pairs,
    to_matrix,
)
from aimsym.errors import AimsymError, ChannelError

W = np.array([2.0, 1.0, 1.0, 2.0, 1.0, 2.0])  # variance weights of 00, 01, 02, 11, 12, 22
PATTERNS = hardmax3_patterns()


def cheap():
    """A fast SE rule for the tests (640 points, 8 table nodes); the default is 5120 / 14."""
    return Hardmax3Channel(qmc_log2=6, table_nodes=8)


def draw_h(omega, V, n, rng):
    h = omega + np.sqrt(W * V) * rng.standard_normal((n, 6))
    return to_matrix(h, 3)


omegas = st.lists(st.floats(-3, 3), min_size=6, max_size=6).map(np.array)


@settings(max_examples=25, deadline=None)
@given(omega=omegas, V=st.floats(0.05, 4.0))
@example(omega=np.array([0.0, -3.0, 3.0, 0.0, 0.0, 3.0]), V=0.05078125)  # deep tails (was NaN)
def test_probabilities_sum_to_one(omega, V):
    logZ, _, _ = hardmax3_moments(omega[None], V, second=False)
    Z = np.exp(logZ[0])
    assert np.sum(Z) == pytest.approx(1.0, abs=1e-12)
    # the two cyclic patterns (o01 > o02 > o12 > o01 and reverse) are impossible
    cyclic = [i for i, y in enumerate(PATTERNS) if tuple(y) in ((1, 2, 0), (2, 0, 1))]
    assert np.all(Z[cyclic] == 0) and np.all(Z[[i for i in range(27) if i not in cyclic]] > 0)


def _scipy_reference(omega, V, y):
    """Independent reference: Z = P(D h > 0) with D the 6 pairwise comparisons fixed by y, from
    scipy's multivariate normal CDF (Genz's randomised lattice rule; D has rank 5 because of the
    shift invariance, hence allow_singular)."""
    from scipy.stats import multivariate_normal

    P = pairs(3)
    rows = []
    for a in range(3):
        for b in range(3):
            if b != y[a]:
                r = np.zeros(6)
                r[P.index(tuple(sorted((a, int(y[a])))))] += 1.0
                r[P.index(tuple(sorted((a, b))))] -= 1.0
                rows.append(r)
    D = np.array(rows)
    cov = D @ np.diag(W * V) @ D.T
    mvn = multivariate_normal(mean=-D @ omega, cov=cov, allow_singular=True, abseps=1e-6, releps=1e-6,
                              maxpts=1_500_000, seed=1)
    return mvn.cdf(np.zeros(6))


@pytest.mark.parametrize("omega,V", [(np.array([0.3, -0.2, 0.5, 0.0, 0.1, -0.4]), 0.7),
                                     (np.array([1.5, 0.0, -1.0, -0.5, 0.8, 0.2]), 1.3)])
def test_partition_matches_scipy_mvn(omega, V):
    Z = np.exp(hardmax3_moments(omega[None], V, second=False)[0][0])
    for i in (5, 7, 13, 21):  # (0,1,2), (0,2,1), (1,1,1), (2,1,0)
        assert Z[i] == pytest.approx(_scipy_reference(omega, V, PATTERNS[i]), abs=2e-5)  # scipy error ~5e-6 at 1.5e6 points


def test_sampled_frequencies_match_partition():
    """Frequencies of sample(h) for h ~ N(omega, V W) match Z(y; omega, V) for all 27 patterns."""
    ch = Hardmax3Channel()
    rng = np.random.default_rng(5)
    omega, V, n = np.array([0.4, -0.1, 0.3, 0.2, -0.3, 0.0]), 0.8, 400_000
    y = ch.sample(draw_h(omega, V, n, rng))
    freq = np.bincount(9 * y[:, 0] + 3 * y[:, 1] + y[:, 2], minlength=27) / n
    Z = np.exp(ch.log_partition_all(omega[None], V)[0])
    z = np.abs(freq - Z) / np.sqrt(np.maximum(Z * (1 - Z), 1e-12) / n)
    assert np.max(z) < 4.5  # 27 patterns, 4.5 standard errors


def test_token_permutation_symmetry():
    """Relabelling the tokens permutes omega and y: Z(pi y; pi omega) = Z(y; omega)."""
    rng = np.random.default_rng(2)
    omega = rng.standard_normal(6)
    P = pairs(3)
    base = hardmax3_moments(omega[None], 0.6, second=False)[0][0]
    for perm in itertools.permutations(range(3)):
        inv = np.argsort(perm)
        # omega'_{ab} = omega_{inv a, inv b}
        om2 = np.array([omega[P.index(tuple(sorted((inv[a], inv[b]))))] for a, b in P])
        lz = hardmax3_moments(om2[None], 0.6, second=False)[0][0]
        for i, y in enumerate(PATTERNS):
            y2 = [perm[y[inv[a]]] for a in range(3)]  # row a of h' is row inv a of h
            j = 9 * y2[0] + 3 * y2[1] + y2[2]
            assert lz[j] == pytest.approx(base[i], abs=1e-12) or (np.isinf(lz[j]) and np.isinf(base[i]))


@settings(max_examples=30, deadline=None)
@given(omega=omegas, V=st.floats(0.05, 3.0), yi=st.integers(0, 26))
def test_score_is_derivative_of_log_partition(omega, V, yi):
    """g = d log Z / d omega and dg = d g / d omega (diagonal) by central finite differences."""
    y = PATTERNS[yi]
    assume(tuple(y) not in ((1, 2, 0), (2, 0, 1)))
    ch = Hardmax3Channel()
    g, dg = ch.denoise(y[None], omega[None], V)
    eps = 1e-5 * np.sqrt(V)
    for k in range(6):
        e = np.zeros(6)
        e[k] = eps
        lp = ch.log_partition(y[None], (omega + e)[None], V)[0]
        lm = ch.log_partition(y[None], (omega - e)[None], V)[0]
        assert g[0, k] == pytest.approx((lp - lm) / (2 * eps), rel=1e-5, abs=1e-5 / np.sqrt(V))
        gp, _ = ch.denoise(y[None], (omega + e)[None], V)
        gm, _ = ch.denoise(y[None], (omega - e)[None], V)
        assert dg[0, k] == pytest.approx((gp[0, k] - gm[0, k]) / (2 * eps), rel=1e-4, abs=1e-4 / V)


def test_score_is_shift_invariant_and_tails_finite():
    """Hardmax ignores h + c 11^T (every unique entry shifts by c), so sum_k g_k = 0. Deep tails
    (log Z down to about -1000) stay finite and agree with 4x finer panels."""
    ch = Hardmax3Channel()
    rng = np.random.default_rng(4)
    omega = rng.standard_normal((40, 6)) * 2
    y = PATTERNS[rng.integers(0, 27, 40)]
    keep = ~np.isin(9 * y[:, 0] + 3 * y[:, 1] + y[:, 2], [15, 19])  # drop cyclic patterns
    g, _ = ch.denoise(y[keep], omega[keep], 0.5)
    assert np.allclose(g.sum(axis=1), 0.0, atol=1e-9)
    # tails: row 0 picks 01 although omega_00 - omega_01 = 40 sqrt(V), etc.
    om = np.array([[40.0, 0, 0, 0, 0, 0], [0, 30.0, 0, -30.0, 0, 0], [-50.0, 0, 5.0, 0, 0, 20.0]])
    ref, gref, _ = hardmax3_moments(om, 1.0, nodes=20, width=0.2)
    ok = np.flatnonzero(np.all(np.isfinite(ref), axis=0))
    omb = np.repeat(om, len(ok), axis=0)
    ys = np.tile(PATTERNS[ok], (3, 1))
    lz = ch.log_partition(ys, omb, 1.0)
    g, dg = ch.denoise(ys, omb, 1.0)
    r = ref[:, ok].ravel()
    gr = gref[:, ok].reshape(-1, 6)
    assert lz.min() < -500 and np.all(np.isfinite(g)) and np.all(np.isfinite(dg))
    assert np.allclose(lz, r, rtol=1e-10, atol=1e-10)
    assert np.allclose(g, gr, rtol=1e-8, atol=1e-8)


def test_se_rule_nishimori_pointwise():
    """E[sum w g^2] = -E[sum w dg] with the same rule: the identity holds for every omega after
    summing y over its 27 patterns weighted by Z, so it holds to rounding inside the rule."""
    ch = Hardmax3Channel(qmc_log2=5)
    for s in (0.0, 0.3, 4.0, 60.0):
        assert ch.J(s, nishimori=True) == pytest.approx(ch.J(s), rel=1e-9)


def test_se_rule_accuracy_small_s():
    """Two independent scramblings agree to the stated accuracy (5e-4 at s <= 1), J(s) -> J(0)."""
    a = Hardmax3Channel(qmc_log2=7, qmc_seed=0, interpolate=False)
    b = Hardmax3Channel(qmc_log2=7, qmc_seed=1, interpolate=False)
    assert a.J(0.5) == pytest.approx(b.J(0.5), rel=2e-3)
    assert a.J(1e-4) == pytest.approx(a.J(0.0), rel=1e-3)
    # q = 0 (s = 0): one point omega = 0, information is J(0) / V
    assert a.information(0.0, 2.0) == pytest.approx(a.J(0.0) / 2.0, rel=1e-12)
    assert a.information(1.0, 2.0) == pytest.approx(a.J(0.5) / 2.0, rel=1e-12)


@pytest.mark.slow
def test_se_rule_accuracy_large_s_and_interpolant():
    """Default rule: scramblings agree to 1.5 % up to s = 5000, J sqrt(1 + s) is flat, and the
    Chebyshev interpolant matches the rule to 1e-3."""
    a, b = Hardmax3Channel(qmc_seed=0), Hardmax3Channel(qmc_seed=1)
    for s in (5.0, 50.0, 500.0, 5000.0):
        assert a.J(s) == pytest.approx(b.J(s), rel=1.5e-2)
        assert 5.5 < a.J(s) * np.sqrt(1 + s) < 7.5
    for s in (0.7, 20.0, 2000.0):
        assert a.J_interpolated(s) == pytest.approx(a.J(s), rel=1e-3)


def test_se_root_iterate_consistent_and_monotone():
    ch = cheap()
    Q0 = 1.5
    res = se.curve([0.05, 0.2, 0.8], 0.5, 3, "hardmax", channel=ch)
    m = [r.mmse for r in res]
    assert all(0 < x < 1 for x in m) and m[0] > m[1] > m[2]
    r = res[1]
    assert r.q_hat == pytest.approx(0.2 * ch.information(r.q, Q0 - r.q), rel=1e-8)
    it = se.iterate(0.2, 0.5, 3, "hardmax", tol=1e-12, channel=ch)
    it_inf = se.iterate(0.2, 0.5, 3, "hardmax", tol=1e-12, init="informed", channel=ch)
    assert it.mmse == pytest.approx(r.mmse, rel=1e-7) and it_inf.mmse == pytest.approx(r.mmse, rel=1e-6)
    assert it.q_hat == pytest.approx(r.q_hat, rel=1e-6)
    # more tokens reveal more comparisons: T = 3 beats T = 2 at the same alpha
    assert r.mmse < se.solve_root(0.2, 0.5, 2, "hardmax").mmse


def test_small_width_threshold_t3():
    ab = se.small_width_alpha_bar_c(3)
    assert ab == pytest.approx(1.0 / Hardmax3Channel().J(0.0), rel=1e-14)
    assert se.small_width_alpha_bar_c_numeric(tokens=3) == pytest.approx(ab, rel=1e-3)
    assert ab < se.small_width_alpha_bar_c(2)  # T = 3 labels are more informative


def test_input_errors():
    ch = Hardmax3Channel()
    with pytest.raises(ChannelError, match="y"):
        ch.denoise(np.array([[0, 3, 1]]), np.zeros((1, 6)), 1.0)
    with pytest.raises(ChannelError, match="y"):
        ch.denoise(np.array([[1, 2, 0]]), np.zeros((1, 6)), 1.0)  # cyclic: impossible
    with pytest.raises(ChannelError, match="omega"):
        ch.denoise(np.array([[0, 1, 2]]), np.zeros((1, 5)), 1.0)
    with pytest.raises(ChannelError, match="V"):
        ch.denoise(np.array([[0, 1, 2]]), np.zeros((1, 6)), -1.0)
    with pytest.raises(AimsymError, match="tokens"):
        make_channel("hardmax", 4)
    with pytest.raises(AimsymError, match="qmc_log2"):
        Hardmax3Channel(qmc_log2=2)
    assert isinstance(make_channel("hardmax", 3), Hardmax3Channel)
    # one-hot rows are accepted and give the same score as argmax indices
    y = np.array([[0, 0, 2]])
    onehot = np.eye(3)[y]
    om = np.array([[0.1, 0.3, -0.2, 0.0, 0.4, 0.5]])
    assert np.allclose(ch.denoise(onehot, om, 0.5)[0], ch.denoise(y, om, 0.5)[0])


@pytest.mark.slow
def test_cli_se_tokens3_hardmax(capsys):
    import json

    from aimsym.cli import main

    assert main(["aim", "se", "--tokens", "3", "--activation", "hardmax", "--rho", "0.5", "--alpha",
                 "0.1,0.3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["mmse"] > out[1]["mmse"] > 0 and out[1]["tokens"] == 3


def test_amp_runs_with_t3_denoiser_and_exact_form_refuses():
    """The isotropic GAMP uses the T = 3 denoiser generically (a few iterations at tiny d, the
    error drops below the prior's); the exact per-sample form has no T = 3 step and says so."""
    from aimsym.aim import amp

    data = amp.generate(12, 0.5, 0.5, 3, "hardmax", seed=0)
    assert data.y.shape == (72, 3)
    out = amp.run(data, 3, "hardmax", iterations=4)
    assert np.isfinite(out["mmse"]) and out["mmse"] < 1.0
    with pytest.raises(AimsymError, match="onsager"):
        amp.run(data, 3, "hardmax", iterations=2, onsager="exact")
