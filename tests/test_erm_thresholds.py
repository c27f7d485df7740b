"""Thresholds of theory.md §8: closed forms and their location on the lambda -> 0+ fixed point."""

import numpy as np
import pytest
from scipy.integrate import quad

from aimsym.erm import thresholds as th


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("x", [-1.5, 0.0, 0.7, 2.0])
def test_partial_semicircle_moments(k, x):
    ref = quad(lambda t: np.sqrt(4 - t * t) * t**k / (2 * np.pi), -2, x)[0]
    assert abs(th.semicircle_partial_moment(k, x) - ref) < 1e-10


def test_closed_form_limits():
    assert th.pr_factorised(1.0)[0] == 0.5
    assert th.pr_factorised(1e-6)[0] < 1e-3
    for k0 in (0.1, 0.5, 0.9):
        assert th.pr_bayes(k0) < th.pr_factorised(k0)[0] < th.pr_direct(k0)


@pytest.mark.parametrize("kappa0", [0.3, 0.5, 0.8])
def test_factorised_perfect_recovery_located_on_fixed_point(kappa0):
    located = th.locate_perfect_recovery(kappa0, "factorised")
    closed = th.pr_factorised(kappa0)[0]
    assert abs(located - closed) < 2e-4, (located, closed)


def test_direct_perfect_recovery_located_on_fixed_point():
    assert abs(th.locate_perfect_recovery(0.5, "direct") - 0.5) < 1e-9
    # and the branch is min-norm interpolation: error (1 - 2 alpha_bar) Q0 without noise
    r = th.ridgeless(0.3, 0.5, model="direct")
    assert abs(r.matrix_error - 0.4 * 1.5) < 1e-12


def test_factorised_branch_error_vanishes_above_threshold():
    below = th.ridgeless(0.3, 0.5)
    assert below.converged and below.matrix_error > 0.1


def test_interpolation_threshold_small_noise_limit():
    # the closed form is the Delta -> 0+ limit; the threshold decreases with the noise to 1/4
    closed = th.interpolation_factorised(0.5)
    small = th.locate_interpolation(0.5, 1e-8)
    assert abs(small - closed) < 2e-3
    values = [th.locate_interpolation(0.5, D) for D in (1e-4, 0.5, 100.0)]
    assert values[0] > values[1] > values[2] > 0.25
    assert abs(values[2] - 0.25) < 5e-3
