"""Newton steps inside the SE iteration (aimsym/smi/se.py, ``_newton_jump``): where the plain
iteration contracts slowly and steadily, one Newton step on the learned entries replaces dozens
of steps. The fixed point must be the one the plain iteration reaches (same branch, within the
convergence tolerance), in fewer maps; heading for Q = I (perfect recovery), no step is tried."""

import numpy as np
import pytest

import aimsym.smi.se as se
from se_counting import counted_se


def _run(alpha, tries):
    return counted_se(alpha, 2048, NEWTON_TRIES=tries)


@pytest.mark.parametrize("alpha", [0.8, 0.9, pytest.param(1.0, marks=pytest.mark.slow)])
def test_newton_steps_reach_the_plain_fixed_point_in_fewer_maps(alpha):
    plain, c0 = _run(alpha, 0)
    newton, c1 = _run(alpha, se.NEWTON_TRIES)
    assert plain.converged and newton.converged
    assert c0["jumps"] == 0 and c1["jumps"] >= 1
    assert c1["maps"] < c0["maps"], (c1, c0)
    # the same fixed point: within a few convergence tolerances of the error scale (tol 1e-3)
    s = np.sqrt(se.error_scale(plain.Q))
    assert np.max(np.abs(newton.Q - plain.Q) / np.outer(s, s)) < 1e-2, (newton.Q, plain.Q)
    assert np.all(np.abs(newton.Q - plain.Q) <= plain.Q_stderr + 1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [1.05, 1.1])
def test_towards_perfect_recovery_newton_steps_cost_nothing(alpha):
    """Where the iteration heads for Q = I, a Newton step would not be local (1 - Q_kk -> 0): the
    extrapolated step refuses it before its maps are paid, and the result is perfect recovery, as
    without Newton steps."""
    plain, c0 = _run(alpha, 0)
    newton, c1 = _run(alpha, se.NEWTON_TRIES)
    assert all(plain.errors["perfect_recovery"]) and all(newton.errors["perfect_recovery"])
    assert c1["maps"] <= c0["maps"], (c1, c0)
