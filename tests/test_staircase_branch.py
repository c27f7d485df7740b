"""The parametric restricted branch of the staircase (thresholds.next_threshold_branch).

With one learned index k the restricted SE is scalar and its fixed point through q sits at
alpha(q) = q / ((1 - q) E[sum_t g_out[k, t]^2]); the staircase walks the records of alpha(q).
"""


import numpy as np
import pytest

import aimsym
from aimsym.smi import se
from aimsym.smi import thresholds as th
from aimsym.errors import AimsymError
from aimsym.derive.files import derivations_dir

DER = derivations_dir()
R = 8


def test_branch_alpha_is_the_restricted_se_fixed_point():
    """Iterating the restricted SE at alpha(q), on the same points, returns to q."""
    model = aimsym.load(DER / "attention_L2_T2.toml", skip=1.0)
    ch = se.make_channel(model, samples=1 << 10, replicas=R, seed=5)
    for q in (0.3, 0.8):
        bp = th.branch_point(ch, 1, [0], q)
        assert bp["op"]["block"] == [0] and np.isfinite(bp["f"])
        r = se.state_evolution(model, bp["alpha"], restrict=[1], channel=ch, errors=False, tol=1e-7,
                               init=np.diag([0.0, q + 0.05]))
        assert r.Q[1, 1] == pytest.approx(q, abs=2e-4)
        assert r.Q[0, 0] == 0.0
        # the error-controlled rule's estimates give alpha and f quadrature bounds, small at its tol
        assert 0.0 < bp["alpha_quad"] < 1e-3 * bp["alpha"] and 0.0 < bp["f_quad"] < 1e-2


class FakeBranch:
    """branch_point stand-in: alpha(q) and rho(q) given as functions (no replica noise), optionally
    with fixed quadrature bounds on alpha and f."""

    def __init__(self, alpha, rho, alpha_quad=None, f_quad=None, f_spread=0.0):
        self.alpha, self.rho, self.calls = alpha, rho, 0
        self.quad = {"alpha_quad": alpha_quad, "f_quad": f_quad}
        self.spread = f_spread * np.resize([1.0, -1.0], R)  # leave-one-out values around f

    def __call__(self, ch, k, P, q):
        self.calls += 1
        a, r = float(self.alpha(q)), float(self.rho(q))
        Q = np.zeros((2, 2))
        Q[k, k] = q
        op = th.Operator(F=np.array([[r]]), F_stderr=np.zeros((1, 1)), rho=r, rho_stderr=0.0,
                         rho_loo=np.full(R, r), direction=np.ones((1, 1)), block=list(P), invariant_block=[0])
        return {"q": q, "alpha": a, "alpha_loo": np.full(R, a), "op": op, "f": a * r - 1.0,
                "f_loo": a * r - 1.0 + self.spread, "Q": Q, **self.quad}


class Tiny:
    p = 2


def walk(monkeypatch, alpha, rho, start=0.2, **quad):
    fake = FakeBranch(alpha, rho, **quad)
    monkeypatch.setattr(th, "branch_point", fake)
    return th.next_threshold_branch(Tiny(), 1, start, ch=None), fake


def test_walk_continuous_root(monkeypatch):
    # alpha(q) = 0.2 + q, rho = 1 + 3 q: root of (0.2 + q)(1 + 3 q) = 1 at q = (-1.6 + sqrt(12.16)) / 6
    res, fake = walk(monkeypatch, lambda q: 0.2 + q, lambda q: 1 + 3 * q)
    q = (-1.6 + np.sqrt(12.16)) / 6
    assert not res["jump"] and res["subspace"] == [0]
    assert res["alpha"] == pytest.approx(0.2 + q, abs=2e-4)
    assert res["stderr"] == 0.0 and fake.calls < 20


def test_walk_root_stops_at_its_statistical_resolution(monkeypatch):
    """With replica noise on f the root is refined only to a tenth of its statistical error in s:
    fewer denoiser passes than the noiseless walk, and alpha within that resolution."""
    xtols = []

    def brentq(f, a, b, xtol):
        xtols.append(xtol)
        return th.brentq.__wrapped__(f, a, b, xtol=xtol)

    brentq.__wrapped__ = th.brentq
    monkeypatch.setattr(th, "brentq", brentq)
    exact, f0 = walk(monkeypatch, lambda q: 0.2 + q, lambda q: 1 + 3 * q)
    noisy, f1 = walk(monkeypatch, lambda q: 0.2 + q, lambda q: 1 + 3 * q, f_spread=0.01)
    # jackknife error of f: sqrt((R - 1) / R * sum (loo - mean)^2) = 0.01 sqrt(R - 1); slope of f in s
    # over the bracket is about 2, so xtol is about 0.1 * 0.026 / 2
    assert xtols[0] == 1e-4 and 5e-4 < xtols[1] < 5e-3
    assert f1.calls <= f0.calls
    assert abs(noisy["alpha"] - exact["alpha"]) < noisy["stderr"]


def test_walk_root_folds_the_quadrature_bounds(monkeypatch):
    """f off by f_quad moves the root by f_quad / f'(s), alpha by alpha'(s) times that, plus alpha's
    own bound: with alpha = 0.2 + q, rho = 1 + 3 q (q = 1 - e^-s) that is f_quad / (rho + 3 alpha)
    + alpha_quad at the root; statistical part 0, so stderr is the quadrature error."""
    res, _ = walk(monkeypatch, lambda q: 0.2 + q, lambda q: 1 + 3 * q, alpha_quad=1e-3, f_quad=2e-2)
    q = (-1.6 + np.sqrt(12.16)) / 6
    want = 2e-2 / ((1 + 3 * q) + 3 * (0.2 + q)) + 1e-3
    assert res["quadrature_error"] == pytest.approx(want, rel=0.05)
    assert res["statistical_stderr"] == 0.0 and res["stderr"] == pytest.approx(res["quadrature_error"])


def bump(q):
    """alpha(q): rises to a local maximum 0.6 at q = 0.5, dips to ~0.53 near q = 0.75, is back at 0.6
    near q = 0.86 and reaches 1.32 at q = 1."""
    return 0.2 + 1.6 * q - 1.6 * q**2 + 2.0 * np.maximum(q - 0.6, 0.0) ** 2 * (1 + 40 * np.maximum(q - 0.75, 0) ** 2)


def test_walk_jump_onto_an_unstable_point(monkeypatch):
    """rho large enough after the jump: the threshold is the local maximum of alpha(q), flagged."""
    res, _ = walk(monkeypatch, bump, lambda q: 1.0 + 5.0 * max(q - 0.7, 0.0))
    assert res["jump"] and res["subspace"] == [0]
    assert res["alpha"] == pytest.approx(0.6, abs=1e-4)
    assert 0.5 <= res["q_before"] < 0.52 and res["q_after"] > 0.75
    assert bump(res["q_after"]) == pytest.approx(0.6, abs=1e-3)


def test_walk_jump_then_root_further_up(monkeypatch):
    """After the jump the rest is still stable; the root is found on the branch beyond it."""
    res, _ = walk(monkeypatch, bump, lambda q: 1.0)
    # f = alpha - 1 = 0 where the branch beyond the dip reaches alpha = 1
    assert not res["jump"] and res["alpha"] == pytest.approx(1.0, abs=1e-3) and res["q_before"] > 0.75


def test_walk_jump_to_perfect_recovery(monkeypatch):
    """alpha(q) never returns above its maximum: the branch jumps to q = 1 there."""
    res, _ = walk(monkeypatch, lambda q: 0.2 + 1.6 * q - 1.6 * q**2, lambda q: 1.0)
    assert res["jump"] and res["q_after"] == 1.0 and res["alpha"] == pytest.approx(0.6, abs=1e-4)


def test_walk_without_threshold_is_an_error(monkeypatch):
    with pytest.raises(AimsymError, match="alpha"):
        walk(monkeypatch, lambda q: 0.2 + q, lambda q: 0.1)


def test_fresh_uninformed_start_escapes_an_unstable_zero():
    """Above alpha_1 a fresh uninformed start learns layer 1 (its overlap first shrinks to ~1e-12
    while layer 2 is learned; the re-seeding at convergence lets it escape); below, it stays at 0."""
    model = aimsym.load(DER / "attention_L2_T2.toml", skip=1.0)
    ch = se.make_channel(model, samples=1 << 10, replicas=R, seed=0)
    hi = se.state_evolution(model, 0.85, channel=ch, errors=False, tol=1e-3)
    lo = se.state_evolution(model, 0.65, channel=ch, errors=False, tol=1e-3)
    assert hi.Q[0, 0] > 0.1 and hi.Q[1, 1] > 0.95
    assert lo.Q[0, 0] < 1e-6 and lo.Q[1, 1] > 0.9


@pytest.mark.slow
def test_staircase_second_method_side_information():
    """Second method on the same points: the SE with a tiny side information on layer 1 (layer 2
    started learned) leaves zero 4 % above the parametric root and stays at zero 4 % below it."""
    model = aimsym.load(DER / "attention_L2_T2.toml", skip=1.0)
    ch = se.make_channel(model, samples=1 << 11, replicas=R, seed=3)
    root = th.next_threshold_branch(model, 1, 0.1857, ch=ch)["alpha"]

    def learned_at(alpha):
        r = se.state_evolution(model, alpha, init=np.diag([0.0, 1e-3]), side_info=1e-8, side_block=[0], channel=ch,
                               errors=False, tol=1e-6, max_iter=2000, stop=lambda Q: Q[0, 0] > 1e-4)
        return r.Q[0, 0] > 1e-4

    assert not learned_at(0.96 * root) and learned_at(1.04 * root)


def test_restricted_se_root_folds_the_operator_quadrature_bound(monkeypatch):
    """next_threshold (learned blocks iterated by the restricted SE): rho's quadrature bound moves
    f = alpha rho - 1 by alpha |d rho|, so the root by alpha |d rho| / f'(alpha). With rho = 1 - 0.2
    (1 - alpha) the root is alpha = 1, f' = 1.2 there, and the bound 0.01 gives 0.01 / 1.2."""
    from types import SimpleNamespace

    def fake_se(model, alpha, **kw):
        return SimpleNamespace(Q=np.diag([0.0, alpha / (1.0 + alpha)]))

    def fake_operator(ch, Q, block, denoised=None, weights=None):
        a = Q[1, 1] / (1.0 - Q[1, 1])
        r = 1.0 - 0.2 * (1.0 - a)
        return th.Operator(F=np.array([[r]]), F_stderr=np.zeros((1, 1)), rho=r, rho_stderr=0.0,
                           rho_loo=np.full(R, r), direction=np.ones((1, 1)), block=list(block),
                           invariant_block=[0], rho_quadrature=0.01)

    monkeypatch.setattr(th, "state_evolution", fake_se)
    monkeypatch.setattr(th, "operator", fake_operator)
    res = th.next_threshold(Tiny(), [1], 0.5, ch_op=None, ch_se=None)
    assert res["alpha"] == pytest.approx(1.0, abs=1e-4) and not res["jump"]
    assert res["quadrature_error"] == pytest.approx(0.01 / 1.2, rel=0.02)
    assert res["statistical_stderr"] == 0.0 and res["stderr"] == pytest.approx(res["quadrature_error"])


def test_staircase_stops_after_max_steps(monkeypatch):
    """staircase(..., max_steps=1) returns after its first step; None continues until every index is
    learned (here one index per step of a three-index stand-in)."""
    from types import SimpleNamespace

    def step(model, learned, alpha_start, **kw):
        learned = [learned] if np.isscalar(learned) else list(learned)
        nxt = min(i for i in range(3) if i not in learned)
        return th.Threshold(alpha=alpha_start + 0.1, stderr=0.01, rho=1.0, rho_stderr=0.0, direction=np.ones((1, 1)),
                            subspace=[nxt], F=np.ones((1, 1)), F_stderr=np.zeros((1, 1)), method="stand-in")

    monkeypatch.setattr(th, "next_threshold_branch", step)
    monkeypatch.setattr(th, "next_threshold", step)
    monkeypatch.setattr(th, "make_channel", lambda *a, **k: None)
    model = SimpleNamespace(p=3)
    assert [s.subspace for s in th.staircase(model, 0.2, [2], samples=1024)] == [[0], [1]]
    one = th.staircase(model, 0.2, [2], samples=1024, max_steps=1)
    assert [s.subspace for s in one] == [[0]] and one[0].alpha == pytest.approx(0.3)


def test_restricted_se_root_stops_at_a_tenth_of_its_statistical_error(monkeypatch):
    """next_threshold's brentq stops at a tenth of the root's statistical error (rho's replica
    error over the slope of f = alpha rho - 1), not at 1e-4: each evaluation is a restricted SE
    run. With rho = 1 - 0.2 (1 - a) (root alpha = 1, f' = 1.2) and rho_stderr 0.02, the root's
    statistical error is ~0.017: the root lands within 2e-3 of 1 in fewer SE runs than with
    rho_stderr = 0 (xtol 1e-4)."""
    from types import SimpleNamespace

    def run(rho_stderr):
        calls = []

        def fake_se(model, alpha, **kw):
            calls.append(alpha)
            return SimpleNamespace(Q=np.diag([0.0, alpha / (1.0 + alpha)]))

        def fake_operator(ch, Q, block, denoised=None, weights=None):
            a = Q[1, 1] / (1.0 - Q[1, 1])
            r = 1.0 - 0.2 * (1.0 - a) + 0.01 * np.sin(40 * a)  # (a wiggle: brentq cannot finish in one secant step)
            return th.Operator(F=np.array([[r]]), F_stderr=np.zeros((1, 1)), rho=r, rho_stderr=rho_stderr,
                               rho_loo=np.full(R, r), direction=np.ones((1, 1)), block=list(block),
                               invariant_block=[0], rho_quadrature=None)

        monkeypatch.setattr(th, "state_evolution", fake_se)
        monkeypatch.setattr(th, "operator", fake_operator)
        return th.next_threshold(Tiny(), [1], 0.5, ch_op=None, ch_se=None), len(set(calls))

    fine, n_fine = run(0.0)
    coarse, n_coarse = run(0.02)
    assert coarse["stderr"] > 0.01
    assert abs(coarse["alpha"] - fine["alpha"]) <= 0.1 * coarse["stderr"]
    assert n_coarse < n_fine, (n_coarse, n_fine)


def test_restricted_se_step_keeps_its_finished_points_and_resumes(monkeypatch, tmp_path):
    """next_threshold(kept=folder): each finished alpha (restricted SE fixed point and operator) is
    kept as JSON; a run stopped after two SE runs is resumed by the same call, which runs only the
    missing ones and returns exactly the uninterrupted result; a third call runs none. Another
    channel (other points) does not reuse them."""
    from types import SimpleNamespace

    calls, fail_after = [], [None]

    def fake_se(model, alpha, **kw):
        if fail_after[0] is not None and len(calls) >= fail_after[0]:
            raise KeyboardInterrupt  # (a job stopped mid-step)
        calls.append(alpha)
        return SimpleNamespace(Q=np.diag([0.0, alpha / (1.0 + alpha)]))

    def fake_operator(ch, Q, block, denoised=None, weights=None):
        a = Q[1, 1] / (1.0 - Q[1, 1])
        r = 1.0 - 0.2 * (1.0 - a) + 0.01 * np.sin(40 * a)
        return th.Operator(F=np.array([[r]]), F_stderr=np.zeros((1, 1)), rho=r, rho_stderr=0.01,
                           rho_loo=np.full(R, r), direction=np.ones((1, 1)), block=list(block),
                           invariant_block=[0], rho_quadrature=1e-3)

    monkeypatch.setattr(th, "state_evolution", fake_se)
    monkeypatch.setattr(th, "operator", fake_operator)

    def chan(seed):
        return SimpleNamespace(model=SimpleNamespace(hash=lambda: "m", parameters={"c": 1.0}),
                               den=SimpleNamespace(accuracy={"tol": 1e-3}),
                               points=np.random.default_rng(seed).standard_normal((2, 4, 8)))

    def run(folder, seed=0, start=0.5):
        calls.clear()
        return th.next_threshold(Tiny(), [1], start, ch_op=chan(seed), ch_se=chan(seed + 10), kept=folder)

    whole = run(None)
    n_whole = len(calls)
    fail_after[0] = 2
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path)
    fail_after[0] = None
    resumed = run(tmp_path)
    assert len(calls) == n_whole - 2  # (the two finished SE runs were replayed)
    assert resumed.to_json().keys() == whole.to_json().keys()
    for k, v in whole.to_json().items():
        assert np.array_equal(np.asarray(resumed[k]), np.asarray(v)), k
    run(tmp_path)
    assert calls == []
    again = run(tmp_path, start=0.5 * (1 + 1e-9))  # the previous threshold recomputed a hair off
    assert calls == [] and again["alpha"] == whole["alpha"]
    run(tmp_path, seed=1)
    assert len(calls) == n_whole  # other points: nothing reused
