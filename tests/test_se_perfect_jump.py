"""The perfect-recovery jump (aimsym/smi/se.py, _perfect_ahead): near Q = I the SE map is
homogeneous in V = I - Q, so a steady geometric contraction of every 1 - Q_kk continues to V = 0.
Slow contractions (rates up to PERFECT_RATE_SLOW) jump only where the Aitken limit of 1 - Q_kk
is ~0: an approach to a fixed point short of I has a positive limit and must not jump."""

import numpy as np
import pytest

import aimsym.smi.se as se
from se_counting import counted_se


def _rates(e):
    e = np.asarray(e, dtype=float)
    return [np.atleast_1d(x) for x in e[1:] / e[:-1]]


def test_geometric_contraction_to_zero_jumps():
    e = 0.04 * 0.985 ** np.arange(12)
    assert se._perfect_ahead(_rates(e), float(e[-1]))
    fast = 0.015 * 0.9 ** np.arange(6)  # the fast path: PERFECT_STEPS steps below PERFECT_NEAR
    assert se._perfect_ahead(_rates(fast), float(fast[-1]))
    assert not se._perfect_ahead(_rates(fast), 0.03)  # (not near enough for 5 steps)


@pytest.mark.parametrize("e_star, rate", [(1e-3, 0.985), (2e-3, 0.98), (5e-3, 0.99), (1e-3, 0.9), (2e-3, 0.6)])
def test_approach_to_a_fixed_point_short_of_one_does_not_jump(e_star, rate):
    """e_k = e* + (e_0 - e*) rate^k: the rates of e creep up towards 1 (y = z at alpha < 1 is
    this with e* = 1 - alpha). Below PERFECT_NEAR_SLOW, e* / e >= 0.02 > PERFECT_LIMIT here."""
    e = e_star + (0.04 - e_star) * rate ** np.arange(60)
    r = _rates(e)
    for k in range(se.PERFECT_STEPS, len(r) + 1):
        assert not se._perfect_ahead(r[:k], float(e[k])), k


@pytest.mark.slow
def test_two_layers_reach_perfect_recovery_just_above_local_stability():
    """Two layers at skip 1, alpha = 1.075 (local stability of Q = I at 1.056 +- 0.030): 1 - Q_11
    contracts by ~0.985 per step. Without the slow jump the SE does not reach the resolution in
    300 maps; with it, the verdict is perfect recovery, confirmed at the clip, in about half."""
    r, calls = counted_se(1.075, 1024)
    assert r.converged and r.perfect_recovery, (np.diag(r.Q), r.iterations)
    assert calls["maps"] < 200, calls


@pytest.mark.slow
def test_without_the_slow_jump_the_same_point_does_not_converge():
    r, calls = counted_se(1.075, 1024, PERFECT_STEPS_SLOW=10**9)
    assert not r.perfect_recovery or calls["maps"] > 300
