"""Leaving and staying at Q_kk ~ 0 in the SE iteration (aimsym/smi/se.py). The escape jump
(``_escape_jump``): a diagonal entry growing out of ~0 by a steady factor per step (a layer just
above its weak-recovery threshold) is moved to ESCAPE_TO at once instead of over dozens of linear
steps. The re-seeding's early verdict (``_decaying``): a re-seeded entry decaying steadily settles
"stable" after RESEED_STEPS steps. Either way the fixed point must be the one the plain iteration
reaches, in fewer maps."""

import numpy as np
import pytest

import aimsym.smi.se as se
from se_counting import counted_se


def _steps(Q0, rates, n):
    """A diagonal path Q_t with Q_kk multiplied by rates[k] per step, fed to _escape_jump;
    returns the step of the first jump (or None) and the jumped matrix."""
    growth, escaped = [], np.zeros(Q0.shape[0], bool)
    active = np.ones(Q0.shape[0], bool)
    Q = Q0.copy()
    for t in range(n):
        Q_new = Q * np.sqrt(np.outer(rates(t), rates(t)))
        out = se._escape_jump(Q, Q_new, growth, escaped, active)
        if out is not None:
            return t, out, escaped
        Q = Q_new
    return None, Q, escaped


def test_steady_growth_jumps_once_keeping_correlations():
    Q0 = np.array([[1e-4, 2e-5, 0.0], [2e-5, 0.3, 0.0], [0.0, 0.0, 0.9]])
    t, Q, escaped = _steps(Q0, lambda t: np.array([1.08, 1.0, 1.0]), 20)
    assert t == se.ESCAPE_STEPS - 1 and list(escaped) == [True, False, False]
    assert Q[0, 0] == pytest.approx(se.ESCAPE_TO, rel=1e-9)
    assert Q[1, 1] == pytest.approx(0.3) and Q[2, 2] == pytest.approx(0.9)
    # the row and column scaled alike: the correlation Q_01 / sqrt(Q_00 Q_11) is kept
    r0 = Q0[0, 1] / np.sqrt(Q0[0, 0] * Q0[1, 1])
    assert Q[0, 1] / np.sqrt(Q[0, 0] * Q[1, 1]) == pytest.approx(r0, rel=1e-6)
    assert np.linalg.eigvalsh(Q).min() >= 0


@pytest.mark.parametrize("rates", [
    lambda t: np.array([0.95, 1.0]),                        # decaying
    lambda t: np.array([1.002, 1.0]),                       # below ESCAPE_RATE
    lambda t: np.array([1.08 if t % 2 else 1.3, 1.0]),      # not steady (not the linear regime)
])
def test_no_jump_without_a_steady_linear_escape(rates):
    t, _, escaped = _steps(np.diag([1e-4, 0.5]), rates, 30)
    assert t is None and not escaped.any()


def test_no_jump_once_the_entry_is_past_the_linear_regime():
    t, _, _ = _steps(np.diag([5e-3, 0.5]), lambda t: np.array([1.08, 1.0]), 30)
    assert t is None


def _run(alpha, steps, reseed_steps=se.RESEED_STEPS):
    r, calls = counted_se(alpha, 1024, ESCAPE_STEPS=steps, RESEED_STEPS=reseed_steps)
    return r, calls["maps"]


@pytest.mark.parametrize("alpha", [0.76, 0.85])
def test_escape_reaches_the_plain_fixed_point_in_fewer_maps(alpha):
    """Two layers at skip 1 just above layer 1's threshold (from the uninformed start layer 2 is
    learned first, then layer 1 escapes slowly from ~0)."""
    plain, n0 = _run(alpha, 10**9)
    esc, n1 = _run(alpha, se.ESCAPE_STEPS)
    assert plain.converged and esc.converged
    assert 0.01 < plain.Q[0, 0] < 0.5  # (the regime of the test: layer 1 escaped, not yet large)
    assert n1 <= n0 - 10, (n1, n0)
    assert np.all(np.abs(esc.Q - plain.Q) <= 0.1 * plain.Q_stderr + 1e-6), (esc.Q, plain.Q, plain.Q_stderr)


def test_reseed_settles_a_stable_zero_in_fewer_maps():
    """Two layers at skip 1 below layer 1's threshold: layer 1 stays at 0; its re-seeding at 1e-4
    decays and is settled after RESEED_STEPS steps instead of at convergence (69 maps against 46)."""
    plain, n0 = _run(0.7, se.ESCAPE_STEPS, reseed_steps=10**9)
    fast, n1 = _run(0.7, se.ESCAPE_STEPS)
    assert plain.converged and fast.converged
    assert plain.Q[0, 0] < 1e-6 and fast.Q[0, 0] < 1e-6 and plain.Q[1, 1] > 0.9
    assert n1 <= n0 - 5, (n1, n0)
    assert np.all(np.abs(fast.Q - plain.Q) <= 0.1 * plain.Q_stderr + 1e-6), (fast.Q, plain.Q, plain.Q_stderr)


def test_decaying_watch():
    small = np.array([True, False])
    w = se._decaying(small)
    Q = np.diag([1e-4, 0.5])
    fired = []
    for rate in (0.7, 0.8, 0.85, 0.7, 0.7):
        Q_new = np.diag([Q[0, 0] * rate, 0.5])
        fired.append(w(Q, Q_new))
        Q = Q_new
    assert fired == [False, False, False, True, True]
    w = se._decaying(small)  # a step that grows (or decays too slowly) restarts the count
    Q = np.diag([1e-4, 0.5])
    fired = []
    for rate in (0.7, 0.95, 0.7, 0.7, 0.7, 0.7, 1.2, 0.7):
        Q_new = np.diag([Q[0, 0] * rate, 0.5])
        fired.append(w(Q, Q_new))
        Q = Q_new
    assert fired == [False, False, False, False, False, True, False, False]
