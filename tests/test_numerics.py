"""The shared numeric kernels: the Pareto tail index against draws of known shape."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aimsym.numerics import pareto_tail_index, tail_size


@pytest.mark.parametrize("xi", [0.2, 0.5, 0.7, 0.95])
def test_pareto_tail_index_recovers_the_shape_of_pareto_draws(xi):
    """Pareto draws with tail index 1/xi: the estimate is within 0.12 of xi at 32 768 draws
    (its spread there is ~0.06-0.09) for each of five seeds."""
    for seed in range(5):
        w = np.random.default_rng(seed).pareto(1 / xi, 32768) + 1.0
        assert abs(pareto_tail_index(w) - xi) < 0.12, seed


def test_pareto_tail_index_of_light_tails_is_small():
    """Exponential (xi = 0), half-normal (xi < 0 in the limit) and uniform (xi = -1) weights."""
    rng = np.random.default_rng(2)
    assert abs(pareto_tail_index(rng.exponential(size=32768))) < 0.1
    assert pareto_tail_index(np.abs(rng.standard_normal(32768))) < 0.1
    assert pareto_tail_index(rng.random(32768)) < -0.8


@settings(max_examples=25, deadline=None)
@given(st.integers(100, 20000), st.floats(0.05, 1.2), st.floats(1e-200, 1e200), st.integers(0, 2**31))
def test_pareto_tail_index_needs_only_the_largest_weights_and_no_scale(n, xi, scale, seed):
    """The estimate from the tail_size(n) + 1 largest of n weights (told n) equals the one from
    all n, and does not change with the weights' scale (the stage's sums carry exp(-fshift))."""
    w = np.random.default_rng(seed).pareto(1 / xi, n) + 1.0
    full = pareto_tail_index(w)
    top = -np.sort(-w)[: tail_size(n) + 1]
    assert pareto_tail_index(top, n) == pytest.approx(full, abs=1e-12)
    assert pareto_tail_index(w * scale) == pytest.approx(full, abs=1e-9)


def test_pareto_tail_index_of_too_few_or_equal_weights():
    assert np.isnan(pareto_tail_index(np.ones(10)))
    assert pareto_tail_index(np.ones(1000)) == -np.inf
    assert np.isnan(pareto_tail_index(np.r_[np.zeros(1000), 1.0, 2.0]))
