"""AIM output channels: counting constants, beta independence, hardmax orthant score."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import multivariate_normal

from aimsym.aim.channels import (
    HardmaxChannel,
    LinearChannel,
    SoftmaxChannel,
    bvn_log_derivatives,
    counting_constant,
    log_bvn_cdf,
    small_width_information_closed_form,
)
from aimsym.errors import AimsymError


@pytest.mark.parametrize("T", [2, 3, 4])
@pytest.mark.parametrize("beta", [0.3, 1.0, 4.0])
def test_softmax_information_is_counting_and_beta_free(T, beta):
    """I = 2 E[sum w g^2] computed through the actual softmax(beta h), the log-ratio inversion
    and the posterior on the line h0 + c 1 equals (T^2 + T - 2)/V for every beta."""
    ch = SoftmaxChannel(T, beta)
    rng = np.random.default_rng(T)
    V = 0.37
    omega = rng.standard_normal(T * (T + 1) // 2)
    I = ch.information_numeric(V, omega=omega, n_nodes=3 if T < 4 else 2)
    assert I == pytest.approx(counting_constant(T, "softmax") / V, rel=1e-9)
    assert counting_constant(T, "softmax") == T * T + T - 2


@pytest.mark.parametrize("T", [2, 3])
def test_linear_information_counting(T):
    ch = LinearChannel(T)
    V = 0.8
    L = T * (T + 1) // 2
    w = np.array([2.0 if a == b else 1.0 for a in range(T) for b in range(a, T)])
    x, wx = np.polynomial.hermite_e.hermegauss(3)
    wx = wx / wx.sum()
    grids = np.meshgrid(*([x] * L), indexing="ij")
    xi = np.stack([g.ravel() for g in grids], -1) * np.sqrt(w * V)
    weight = np.prod(np.meshgrid(*([wx] * L), indexing="ij"), axis=0).ravel()
    g, dg = ch.denoise(xi, np.zeros(L), V)
    assert 2 * np.sum(weight * np.sum(w * g**2, -1)) == pytest.approx(counting_constant(T, "linear") / V)
    # Nishimori: E g^2 = -E dg entrywise
    assert np.allclose(np.sum(weight[:, None] * g**2, 0), -dg[0], rtol=1e-10)


def test_softmax_denoiser_mean_is_consistent():
    """E[h | y] reproduces softmax(beta h) exactly, and g is orthogonal to the shift direction."""
    ch = SoftmaxChannel(3, 2.0)
    rng = np.random.default_rng(0)
    h = rng.standard_normal((5, 3, 3))
    h = h + np.swapaxes(h, 1, 2)
    y = ch.sample(h)
    omega = rng.standard_normal((5, 6))
    g, dg = ch.denoise(y, omega, 0.5)
    w = np.array([2.0 if a == b else 1.0 for a in range(3) for b in range(a, 3)])
    mean = omega + w * 0.5 * g
    from aimsym.aim.channels import to_matrix

    assert np.allclose(ch.sample(to_matrix(mean, 3)), y, atol=1e-12)
    assert np.allclose(np.sum(g, axis=1), 0.0, atol=1e-10)  # no information along h + c 1


@pytest.mark.parametrize("r", [1 / 3, -1 / 3])
def test_bvn_cdf_matches_scipy(r):
    pts = [(0.0, 0.0), (-1.0, 2.0), (1.5, -0.5), (-2.0, -2.5), (3.0, 1.0), (0.3, 0.2)]
    for a, b in pts:
        ref = multivariate_normal(mean=[0, 0], cov=[[1, r], [r, 1]]).cdf([a, b])
        assert np.exp(log_bvn_cdf(a, b, r)) == pytest.approx(ref, abs=2e-6)


def test_bvn_deep_tail_finite_and_accurate():
    """log Phi_2 deep in the lower tail: finite, and Phi_2 -> Phi(min) when the other is large."""
    from scipy.special import log_ndtr

    v = log_bvn_cdf(np.array([-40.0, -25.0]), np.array([40.0, -30.0]), 1 / 3)
    assert np.all(np.isfinite(v))
    assert v[0] == pytest.approx(log_ndtr(-40.0), rel=1e-12)
    _, Ra, Rb, Haa, Hab, Hbb = bvn_log_derivatives(np.array([-30.0]), np.array([-35.0]), -1 / 3)
    assert np.all(np.isfinite([Ra, Rb, Haa, Hab, Hbb]))


@settings(max_examples=60, deadline=None)
@given(
    o11=st.floats(-4, 4), o12=st.floats(-4, 4), o22=st.floats(-4, 4),
    V=st.floats(0.01, 3.0), s1=st.sampled_from([-1.0, 1.0]), s2=st.sampled_from([-1.0, 1.0]),
)
def test_hardmax_score_is_derivative_of_log_partition(o11, o12, o22, V, s1, s2):
    """g = d log Z / d omega and dg = d g / d omega (diagonal) by central finite differences."""
    ch = HardmaxChannel()
    y = np.array([[s1, s2]])
    omega = np.array([[o11, o12, o22]])
    g, dg = ch.denoise(y, omega, V)
    h = 1e-5 * max(1.0, np.sqrt(V))
    for k in range(3):
        e = np.zeros(3)
        e[k] = h
        fd = (ch.log_partition(y, omega + e, V) - ch.log_partition(y, omega - e, V)) / (2 * h)
        assert g[0, k] == pytest.approx(fd[0], rel=1e-5, abs=1e-6)
        gp, _ = ch.denoise(y, omega + e, V)
        gm, _ = ch.denoise(y, omega - e, V)
        assert dg[0, k] == pytest.approx((gp[0, k] - gm[0, k]) / (2 * h), rel=1e-4, abs=1e-5)


def test_joint_density_is_not_the_score():
    """The mixed derivative (joint density) differs from the partial derivative used in g."""
    a, b, r = np.array([0.3]), np.array([-0.4]), 1 / 3
    logZ, Ra, _, _, _, _ = bvn_log_derivatives(a, b, r)
    joint = np.exp(-(a**2 - 2 * r * a * b + b**2) / (2 * (1 - r**2))) / (2 * np.pi * np.sqrt(1 - r**2))
    assert abs(Ra[0] - joint[0] / np.exp(logZ[0])) > 0.1


def test_hardmax_probabilities_sum_to_one():
    ch = HardmaxChannel()
    rng = np.random.default_rng(3)
    omega = rng.standard_normal((20, 3)) * 2
    tot = sum(np.exp(ch.log_partition(np.broadcast_to([s1, s2], (20, 2)), omega, 0.7))
              for s1 in (1.0, -1.0) for s2 in (1.0, -1.0))
    assert np.allclose(tot, 1.0, atol=1e-12)


def test_hardmax_sampling_matches_orthant_probability():
    """Frequencies of the sampled signs at fixed omega match Z(y; omega, V)."""
    ch = HardmaxChannel()
    rng = np.random.default_rng(11)
    omega = np.array([0.4, -0.2, 0.1])
    V = 0.6
    n = 200000
    h = np.empty((n, 2, 2))
    h[:, 0, 0] = omega[0] + np.sqrt(2 * V) * rng.standard_normal(n)
    h[:, 1, 1] = omega[2] + np.sqrt(2 * V) * rng.standard_normal(n)
    h[:, 0, 1] = h[:, 1, 0] = omega[1] + np.sqrt(V) * rng.standard_normal(n)
    y = ch.sample(h)
    for s in ([1, 1], [1, -1], [-1, 1], [-1, -1]):
        freq = np.mean(np.all(y == s, axis=1))
        Z = np.exp(ch.log_partition(np.array([s], float), omega[None], V))[0]
        assert freq == pytest.approx(Z, abs=4 * np.sqrt(Z * (1 - Z) / n))


def test_hardmax_information_nishimori_and_converged():
    """I(q, V) with g^2 equals the one with -dg (Nishimori), and the rule is converged."""
    ch = HardmaxChannel()
    fine = HardmaxChannel(quad_step=0.08)
    for q, V in [(0.5, 1.0), (1.45, 0.05), (1.4999, 1e-4)]:
        I = ch.information(q, V)
        assert I == pytest.approx(fine.information(q, V), rel=1e-7)
        # Nishimori with the same quadrature: replace g^2 by -dg
        orig = ch._integrand

        def minus_dg(u, V, ch=ch):
            total = np.zeros(len(u))
            omega = np.stack([u[:, 0], np.zeros(len(u)), u[:, 1]], -1)
            for s1 in (1.0, -1.0):
                for s2 in (1.0, -1.0):
                    y = np.broadcast_to([s1, s2], (len(u), 2))
                    Z = np.exp(ch.log_partition(y, omega, V))
                    _, dg = ch.denoise(y, omega, V)
                    total += Z * -(2 * dg[:, 0] + 2 * dg[:, 2] + dg[:, 1])
            return 2 * total

        ch._integrand = minus_dg
        try:
            assert ch.information(q, V) == pytest.approx(I, rel=1e-6)
        finally:
            ch._integrand = orig


def test_small_width_closed_form_matches_quadrature():
    """E[G^2] at q = 0, V = 1 from arcsin(1/3) equals the channel expectation at q -> 0."""
    ch = HardmaxChannel()
    assert 0.5 * ch.information(0.0, 1.0) == pytest.approx(small_width_information_closed_form(), rel=1e-12)
    assert 0.5 * ch.information(1e-10, 1.0) == pytest.approx(small_width_information_closed_form(), rel=1e-6)


def test_channel_input_errors():
    with pytest.raises(AimsymError, match="tokens"):
        HardmaxChannel(3)
    with pytest.raises(AimsymError, match="beta"):
        SoftmaxChannel(2, -1.0)
    with pytest.raises(AimsymError, match="tokens"):
        SoftmaxChannel(1)
