"""AIM state evolution: parametric == iterated, beta independence, counting thresholds,
hardmax root == iteration, power-law decay, small-width closed form."""

import numpy as np
import pytest

from aimsym.aim import se
from aimsym.aim.channels import SoftmaxChannel, counting_constant
from aimsym.aim.spectral import rie_mmse
from aimsym.errors import AimsymError


@pytest.mark.parametrize("T,rho", [(2, 0.5), (3, 0.3), (2, 1.7), (4, 0.8)])
def test_parametric_equals_iterated(T, rho):
    a_pr = se.perfect_recovery_counting(rho, T)
    for frac in (0.1, 0.5, 0.85):
        alpha = frac * a_pr
        p = se.solve_softmax(alpha, rho, T)
        it = se.iterate(alpha, rho, T, "softmax", tol=1e-14)
        assert it.converged
        assert p.mmse == pytest.approx(it.mmse, abs=1e-9)
        # the parametric point satisfies alpha(Delta) = m(Delta) / (c Delta) with mmse = m(Delta)
        a_back, m_back = se.softmax_parametric(1.0 / p.q_hat, rho, T)
        assert a_back == pytest.approx(alpha, rel=1e-9) and m_back == pytest.approx(p.mmse, rel=1e-12)


class _NumericSoftmax(SoftmaxChannel):
    """Softmax channel whose information is computed through softmax(beta h) itself."""

    def information(self, q, V):
        return self.information_numeric(V, omega=np.array([0.3, -0.2, 0.5]), n_nodes=3)


@pytest.mark.parametrize("beta", [0.2, 1.0, 5.0])
def test_softmax_se_independent_of_beta(beta):
    alpha, rho = 0.12, 0.5
    it = se.iterate(alpha, rho, 2, "softmax", beta, channel=_NumericSoftmax(2, beta), tol=1e-13)
    assert it.mmse == pytest.approx(se.solve_softmax(alpha, rho).mmse, abs=1e-8)


@pytest.mark.parametrize("T", [2, 3, 4])
@pytest.mark.parametrize("rho", [0.1, 0.5, 0.9, 1.0, 2.5])
def test_perfect_recovery_counting(T, rho):
    """alpha_PR from the spectral small-Delta limit equals the counting formula, and the mmse
    reaches 0 linearly there."""
    a_pr = se.perfect_recovery_counting(rho, T)
    expected = (2 * rho - rho**2) / (T * T + T - 2) if rho <= 1 else 1 / (T * T + T - 2)
    assert a_pr == pytest.approx(expected, rel=1e-14)
    tol = 1e-4 if rho == 1.0 else 1e-8  # rho = 1: non-analytic (Delta^(2/3)) correction
    assert se.perfect_recovery_numeric(rho, T) == pytest.approx(a_pr, rel=tol)
    assert se.solve_softmax(a_pr * 1.001, rho, T).mmse == 0.0
    m1 = se.solve_softmax(a_pr * (1 - 1e-4), rho, T).mmse
    m2 = se.solve_softmax(a_pr * (1 - 2e-4), rho, T).mmse
    # linear vanishing, except at rho = 1 where m(Delta)/Delta = 1 - O(Delta^(2/3)) gives
    # mmse ~ (alpha_PR - alpha)^(3/2) (see docs/aim.md)
    exponent = 1.5 if rho == 1.0 else 1.0
    assert 0 < m1 < m2 and m2 / m1 == pytest.approx(2.0**exponent, rel=0.02)


def test_linear_threshold_uses_T2_plus_T():
    assert se.perfect_recovery_counting(0.5, 2, "linear") == pytest.approx(0.75 / 6)
    assert counting_constant(3, "linear") == 12


def test_informed_and_uninformed_agree_softmax():
    for alpha in (0.05, 0.15):
        u = se.iterate(alpha, 0.5, init="uninformed", tol=1e-13)
        i = se.iterate(alpha, 0.5, init="informed", tol=1e-13)
        assert u.mmse == pytest.approx(i.mmse, abs=1e-8)


def test_damping_does_not_move_fixed_point():
    a = se.iterate(0.1, 0.5, damping=0.0, tol=1e-13)
    b = se.iterate(0.1, 0.5, damping=0.6, tol=1e-13)
    assert a.mmse == pytest.approx(b.mmse, abs=1e-9) and b.iterations > a.iterations


@pytest.mark.parametrize("alpha", [0.05, 0.5])
def test_hardmax_root_equals_iteration(alpha):
    r = se.solve_root(alpha, 0.5, activation="hardmax")
    it = se.iterate(alpha, 0.5, activation="hardmax", tol=1e-12)
    it_inf = se.iterate(alpha, 0.5, activation="hardmax", tol=1e-12, init="informed")
    assert r.mmse == pytest.approx(it.mmse, rel=1e-7)
    assert it_inf.mmse == pytest.approx(it.mmse, rel=1e-6)
    # fixed point: q = Q0 - m(1/q_hat) and q_hat = alpha I(q, Q0 - q)
    assert r.q == pytest.approx(1.5 - rie_mmse(1 / r.q_hat, 0.5), abs=1e-12)


def test_hardmax_no_perfect_recovery_power_law():
    alphas = np.array([10.0, 20.0, 40.0])
    m = np.array([se.solve_root(a, 0.5, activation="hardmax").mmse for a in alphas])
    assert np.all(m > 0) and np.all(np.diff(m) < 0)
    slopes = np.diff(np.log(m)) / np.diff(np.log(alphas))
    assert slopes[1] == pytest.approx(slopes[0], abs=0.05)  # a power law at large alpha
    assert -2.2 < slopes[1] < -1.8


def test_small_width_closed_form_and_fixed_point():
    ab_c = se.small_width_alpha_bar_c()
    z_plus = 0.25 + np.arcsin(1 / 3) / (2 * np.pi)
    z_minus = 0.25 - np.arcsin(1 / 3) / (2 * np.pi)
    assert ab_c == pytest.approx(1 / (2 * ((2 / (3 * np.pi)) / z_plus + (1 / (3 * np.pi)) / z_minus)), rel=1e-14)
    assert se.small_width_alpha_bar_c_numeric() == pytest.approx(ab_c, rel=1e-8)
    assert se.small_width_se(0.95 * ab_c)["q"] == 0.0
    assert se.small_width_se(1.05 * ab_c)["q"] > 0.0
    for ab in (0.6, 1.0, 3.0):
        out = se.small_width_se(ab)
        q = out["q"]
        from aimsym.aim.channels import HardmaxChannel

        t = 1 / (HardmaxChannel().information(q, 1 - q) * ab)  # t = 1/(2 ab E[G^2])
        assert q == pytest.approx(max(1 - t, 0) ** 2, abs=1e-10)
        assert out["mmse"] == pytest.approx(t * (2 - t), abs=1e-9)


@pytest.mark.parametrize("ab", [1.0, 3.0])
def test_small_width_is_limit_of_finite_rho(ab):
    rho = 1e-4
    r = se.solve_root(ab * rho, rho, activation="hardmax")
    assert r.mmse == pytest.approx(se.small_width_se(ab)["mmse"], abs=2e-3)


def test_thresholds_dict():
    t = se.thresholds(2, 0.5, "softmax")
    assert t["perfect_recovery"] == pytest.approx(0.1875)
    # weak recovery only as the small-width statement alpha = rho / c_T (tests/test_aim_small_width.py)
    assert t["weak_recovery"]["alpha"] == pytest.approx(0.5 * se.small_width_alpha_bar_c(2, "softmax"))
    h = se.thresholds(2, 0.5, "hardmax")
    assert h["perfect_recovery"] is None
    assert h["weak_recovery"]["alpha"] == pytest.approx(0.5 * se.small_width_alpha_bar_c())


def test_se_bad_input():
    with pytest.raises(AimsymError, match="alpha"):
        se.solve(-1.0, 0.5)
    with pytest.raises(AimsymError, match="rho"):
        se.solve(0.1, 0.0)
    with pytest.raises(AimsymError, match="damping"):
        se.iterate(0.1, 0.5, damping=1.0)
