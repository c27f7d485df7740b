"""Convergence within the statistical error (aimsym/smi/se.py, STAT_STOP): the SE iteration and
its Newton polish also stop where every entry's remaining step is below STAT_STOP of its replica
error. Near a transition (critically slow contraction, large errors) that saves most of the maps;
the fixed point must stay within a small fraction of its error, and the step left is in Q_stderr."""

import numpy as np

import aimsym.smi.se as se
from se_counting import counted_se


def test_converged_entry_by_entry():
    Q = np.diag([0.005, 0.97])
    h = [1e-2 * 0.99**k for k in range(6)]  # a steady rate 0.99: extrapolated distance ~1, far above tol
    step = np.diag([1e-4, 1e-6])
    noise = np.diag([1e-2, 1e-3])
    assert not se._converged(h, 1e-3)
    assert se._converged(h, 1e-3, step, 0.1 * noise, Q)  # every step below a tenth of its noise
    step_big = np.diag([2e-3, 1e-6])  # layer 1 still moves by a fifth of its noise per step
    assert not se._converged(h, 1e-3, step_big, 0.1 * noise, Q)
    # an entry without noise (a symmetric zero) must meet tol itself
    assert not se._converged(h, 1e-3, np.diag([1e-4, 1e-6]), 0.1 * np.diag([1e-2, 0.0]), Q)
    assert not se._converged(h + [1.1e-2], 1e-3, step, 0.1 * noise, Q)  # a growing step never
    erratic = [1e-2, 4e-3, 9e-3, 3e-3, 8e-3, 7e-3]  # (a cycle of a jumpy map: left to the stall test)
    assert not se._converged(erratic, 1e-3, step, 0.1 * noise, Q)


def _run(alpha, stat):
    r, calls = counted_se(alpha, 1024, STAT_STOP=stat)
    return r, calls["maps"]


def test_critically_slow_point_stops_within_its_error():
    """Two layers at skip 1, alpha = 0.74, just above layer 1's threshold: Q_11 = 0.006 +- 0.015.
    To the relative tol 1e-3 alone the iteration takes 205 maps; within a tenth of the error, 81."""
    plain, n0 = _run(0.74, 0.0)
    fast, n1 = _run(0.74, se.STAT_STOP)
    assert plain.converged and fast.converged
    assert n1 < 0.6 * n0, (n1, n0)
    assert np.all(np.abs(fast.Q - plain.Q) <= se.STAT_STOP * plain.Q_stderr + 1e-9), (fast.Q, plain.Q)
    assert np.allclose(fast.Q_stderr, plain.Q_stderr, rtol=0.01, atol=1e-12)  # (the step left is a small addition)
