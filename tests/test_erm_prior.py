"""Prior side: J(delta, eps), its analytic derivatives, rank cap, ridge."""

import numpy as np
import pytest

from aimsym.erm.prior import integrals, prior_step


@pytest.mark.parametrize("penalty,kappa0,delta,eps,kappa", [
    ("pnn", 0.5, 0.3, 0.2, None), ("pnn", 0.2, 0.1, 0.05, None), ("pnn", 1.5, 0.7, -0.1, None),
    ("pnn", 0.5, 0.5, 0.1, 0.3), ("snn", 0.5, 1.0, 0.5, None), ("snn", 0.3, 0.4, 0.1, None)])
def test_derivatives_of_J_match_finite_differences(penalty, kappa0, delta, eps, kappa):
    I = integrals(penalty, kappa0, delta, eps, kappa)
    h = 1e-5
    dd = (integrals(penalty, kappa0, delta + h, eps, kappa).J
          - integrals(penalty, kappa0, delta - h, eps, kappa).J) / (2 * h)
    de = (integrals(penalty, kappa0, delta, eps + h, kappa).J
          - integrals(penalty, kappa0, delta, eps - h, kappa).J) / (2 * h)
    assert abs(I.dJ_ddelta - dd) < 1e-6 * (1 + abs(dd))
    assert abs(I.dJ_deps - de) < 1e-6 * (1 + abs(de))


@pytest.mark.parametrize("kappa0,delta", [(0.5, 0.4), (0.2, 0.2), (2.0, 1.0)])
def test_J_without_threshold_is_free_convolution_moments(kappa0, delta):
    # eps below the support: J = E (y - eps)^2 with mean sqrt(kappa0), 2nd moment Q0 + delta^2;
    # dJ/ddelta = 2 delta exactly (only the variance depends on delta)
    eps = -10.0
    I = integrals("pnn", kappa0, delta, eps)
    J = 1 + kappa0 + delta**2 - 2 * eps * np.sqrt(kappa0) + eps**2
    assert abs(I.J - J) < 1e-8 * J
    assert abs(I.dJ_ddelta - 2 * delta) < 1e-6
    assert abs(I.rank - 1.0) < 1e-8


def test_rank_cap_binds():
    I = integrals("pnn", 0.5, 0.5, 0.05, kappa=0.3)
    free = integrals("pnn", 0.5, 0.5, 0.05)
    assert free.rank > 0.3
    assert abs(I.rank - 0.3) < 1e-8 and I.J < free.J


def test_ridge_prior_is_linear_shrinkage():
    st = prior_step("ridge", q_hat=0.04, m_hat=0.5, Sigma_hat=0.8, lam=0.1, kappa0=0.5)
    c = 0.5 / (0.8 + 0.4)
    assert np.isclose(st.m, c * 1.5) and np.isclose(st.Sigma, 1 / 1.2)
    assert np.isclose(st.q, c * c * (1.5 + 0.04 / 0.25))
