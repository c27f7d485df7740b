"""GAMP at finite size follows its state evolution (theory sections 4, 6, 9)."""

import numpy as np
import pytest

import aimsym
from aimsym.errors import AimsymError
from aimsym.smi.amp import gamp, run_amp
from aimsym.smi.data import teacher_student


def se_gaussian(alpha, Delta, lam, iters):
    """Closed-form SE of y = z + sqrt(Delta) xi: Q_hat = alpha / (1 - Q + Delta)."""
    Q, out = 0.0, [0.0]
    for _ in range(iters):
        q_hat = alpha / (1 - Q + Delta)
        Q = (q_hat + lam) / (1 + q_hat + lam)
        out.append(Q)
    return np.array(out)


def se_phase_retrieval(alpha, lam, iters, nodes=120):
    """SE of y = |z| by a 2-D Gauss-Hermite rule over (xi, eta); g_out = (y tanh(y omega / V) - omega) / V."""
    x, w = np.polynomial.hermite_e.hermegauss(nodes)
    w = w / w.sum()
    xi, eta = np.meshgrid(x, x, indexing="ij")
    W = np.outer(w, w)
    Q, out = 0.0, [0.0]
    for _ in range(iters):
        V = 1 - Q
        omega = np.sqrt(Q) * xi
        y = np.abs(omega + np.sqrt(V) * eta)
        g = (y * np.tanh(y * omega / V) - omega) / V
        q_hat = alpha * np.sum(W * g**2)
        Q = (q_hat + lam) / (1 + q_hat + lam)
        out.append(Q)
    return np.array(out)


def _follows(res, se, k=4.0, atol=0.01):
    M, M_se = res["overlaps"]["M"][:, 0, 0], res["overlaps"]["M_stderr"][:, 0, 0]
    Q, Q_se = res["overlaps"]["Q"][:, 0, 0], res["overlaps"]["Q_stderr"][:, 0, 0]
    t = min(len(M), len(se))
    assert np.all(np.abs(M[:t] - se[:t]) <= k * M_se[:t] + atol), (M[:t], se[:t], M_se[:t])
    assert np.all(np.abs(Q[:t] - se[:t]) <= k * Q_se[:t] + atol), (Q[:t], se[:t], Q_se[:t])


def test_se_helpers_closed_form():
    # fixed point of the Gaussian channel at alpha = 1, Delta = 0.5 is Q = 1/2 (Q_hat = 1)
    assert se_gaussian(1.0, 0.5, 0.0, 60)[-1] == pytest.approx(0.5, abs=1e-8)
    # phase retrieval: Q = 0 is a fixed point without side information; alpha_c = 1/2
    assert se_phase_retrieval(0.4, 0.0, 5)[-1] == 0.0
    assert se_phase_retrieval(0.45, 1e-4, 200)[-1] < 0.01 < se_phase_retrieval(0.6, 1e-4, 200)[-1]


@pytest.mark.parametrize("d,seeds", [pytest.param(300, 6, id="d300"),
                                     pytest.param(2000, 4, id="d2000", marks=pytest.mark.slow)])
def test_gaussian_channel_follows_se(d, seeds):
    model = aimsym.load("gaussian_channel", Delta=0.5)
    res = run_amp(model, d=d, alpha=0.8, seeds=seeds, seed=11, lam=0.0, max_iter=8, tol=0.0)
    _follows(res, se_gaussian(0.8, 0.5, 0.0, 8))


class PhaseRetrievalDenoiser:
    """Closed-form denoiser of y = |z| (p = T = 1): posterior on z = +-y, E[z|y] = y tanh(y omega / V)."""

    accuracy = {"path": "closed form (test)"}

    def __init__(self, model):
        self.model = model

    def __call__(self, y, omega, V):
        from types import SimpleNamespace

        v = float(V.reshape(-1)[0])
        yv, om = y.reshape(-1), omega.reshape(-1)
        th = np.tanh(yv * om / v)
        g = (yv * th - om) / v
        dg = (yv**2 * (1 - th**2) / v - 1) / v  # (Var(z|y) / V - 1) / V
        n = len(yv)
        return SimpleNamespace(g_out=g.reshape(n, 1, 1), dg_out=dg.reshape(n, 1, 1, 1, 1))


@pytest.mark.parametrize("d,seeds,denoiser", [
    pytest.param(400, 6, "closed_form", id="d400-closed-form"),
    pytest.param(400, 6, "generated", id="d400-generated"),
    pytest.param(2000, 4, "closed_form", id="d2000-closed-form", marks=pytest.mark.slow)])
def test_phase_retrieval_follows_se(d, seeds, denoiser):
    model = aimsym.load("glm_phase_retrieval")
    den = PhaseRetrievalDenoiser(model) if denoiser == "closed_form" else model.denoiser()
    lam = 0.05
    res = run_amp(model, d=d, alpha=0.9, seeds=seeds, seed=5, lam=lam, max_iter=12, tol=0.0, den=den)
    se = se_phase_retrieval(0.9, lam, 12)
    assert se[-1] > 0.3  # the comparison is not trivial: the overlap grows
    _follows(res, se)


def test_check_can_fail_without_onsager():
    """The SE comparison has teeth: GAMP without the Onsager term leaves the SE trajectory."""
    model = aimsym.load("gaussian_channel", Delta=0.5)
    den = model.denoiser()
    se = se_gaussian(1.5, 0.5, 0.0, 6)
    good, bad = [], []
    for s in range(8):
        data = teacher_student(model, 400, alpha=1.5, seed=100 + s)
        good.append(gamp(den, data, max_iter=6, tol=0.0).M[:, 0, 0])
        bad.append(gamp(den, data, max_iter=6, tol=0.0, onsager=False).M[:, 0, 0])
    good, bad = np.array(good), np.array(bad)
    se_good = good.std(0, ddof=1) / np.sqrt(len(good)) + 1e-3
    se_bad = bad.std(0, ddof=1) / np.sqrt(len(bad)) + 1e-3
    assert np.all(np.abs(good.mean(0) - se[:7]) < 4 * se_good + 0.01)
    assert np.max(np.abs(bad.mean(0) - se[:7]) / se_bad) > 8, (bad.mean(0), se)


def test_two_layer_last_layer_first():
    model = aimsym.load("attention_L2_T2", skip=1.0)
    res = run_amp(model, d=300, alpha=1.2, seeds=2, seed=2, lam=1e-2, max_iter=40)
    M = res["overlaps"]["M"]
    m1, m2 = M[:, 0, 0], M[:, 1, 1]
    t2 = int(np.argmax(m2 > 0.5))
    assert m2[t2] > 0.5 and m1[t2] < 0.2  # last layer learned while the first is still ~0
    assert m2[-1] > 0.9 and m1[-1] > 0.5  # both learned at alpha = 1.2 (loose at d = 300)
    t1 = int(np.argmax(m1 > 0.5))
    assert t1 > t2


@pytest.mark.slow
def test_two_layer_matches_se_fixed_point_d1000():
    from aimsym.smi.se import state_evolution

    model = aimsym.load("attention_L2_T2", skip=1.0)
    lam = 1e-2
    res = run_amp(model, d=1000, alpha=1.2, seeds=4, seed=7, lam=lam, max_iter=60)
    se = state_evolution(model, 1.2, side_info=lam, errors=False)
    Q_se = np.diag(se.Q)
    M = np.diag(res["final"]["M"])
    assert np.all(np.abs(M - Q_se) < 0.05), (M, Q_se)


def test_quadrature_audit_detects_a_coarse_rule():
    """The audit compares the run's fixed rule with the error-controlled one: a 3-node rule is far
    off in the bulk, the 24-node rule much closer; the audited iterations are the first, middle and last."""
    model = aimsym.load("attention_L2_T2", skip=1.0)
    coarse = run_amp(model, d=100, alpha=0.5, seeds=1, max_iter=6, den=model.denoiser(nodes=3))
    fine = run_amp(model, d=100, alpha=0.5, seeds=1, max_iter=6, den=model.denoiser(nodes=24))
    for res in (coarse, fine):
        qa = res.quadrature
        assert qa["audited"] and [r["iteration"] for r in qa["iterations"]] == [1, 3, 6]
        assert all(r["samples"] == 32 and r["reference_missed_tol"] == 0 for r in qa["iterations"])
    assert coarse.quadrature["max_error"] > 1e-2
    assert fine.quadrature["max_error"] < coarse.quadrature["max_error"] / 10
    controlled = run_amp(model, d=100, alpha=0.5, seeds=1, max_iter=3, den=model.denoiser())
    assert not controlled.quadrature["audited"] and "error-controlled" in controlled.quadrature["note"]
    qc = controlled.quadrature  # its own record: every evaluation, with the estimates against tol
    assert qc["evaluations"] == 3 * 50 and len(qc["per_iteration"]) == 3
    assert qc["missed"] == sum(r["missed"] for r in qc["per_iteration"])
    assert qc["max_error"] <= qc["tol"] or qc["missed"] > 0
    assert qc["uncontrolled"] == sum(r["uncontrolled"] for r in qc["per_iteration"]) == 0  # (k = 2: no QMC)


def test_amp_controlled_summary_counts_uncontrolled_evaluations():
    """Evaluations without an estimate (inf: the QMC stage's heavy-tailed samples) are counted
    per iteration and in all, next to those above tol."""
    from aimsym.smi.amp import controlled_summary

    class Trace:
        quadrature = [(1e-4, 0, 50, 0), (np.inf, 3, 50, 2)]

    s = controlled_summary([Trace(), Trace()], 1e-3)
    assert s["evaluations"] == 200 and s["missed"] == 6 and s["uncontrolled"] == 4 and s["max_error"] == np.inf
    assert [r["uncontrolled"] for r in s["per_iteration"]] == [0, 2]


def test_amp_denoiser_tolerance_follows_the_statistical_error():
    """'auto': error-controlled at 0.1 / sqrt(n) (clipped to [1e-8, 1e-3]) where the reduced
    integral has dimension >= 3; the audited fixed rule below (see AMP_CONTROLLED_MIN_DIM);
    explicit nodes or None always give the fixed rule; a number is used as given."""
    from aimsym.smi.amp import amp_tol, make_denoiser

    assert amp_tol(100) == pytest.approx(1e-3) and amp_tol(10**6) == pytest.approx(1e-4)
    assert amp_tol(10**20) == 1e-8 and amp_tol(1) == 1e-3
    l3 = aimsym.load("attention_L2_T3", skip=1.0)
    assert make_denoiser(l3, 10**6).tol == pytest.approx(1e-4)
    assert make_denoiser(l3, 100, denoiser_tol=1e-5).tol == pytest.approx(1e-5)
    assert make_denoiser(l3, 100, nodes=8).tol is None and make_denoiser(l3, 100, denoiser_tol=None).tol is None
    l2 = aimsym.load("attention_L2_T2", skip=1.0)
    assert make_denoiser(l2, 100).tol is None and make_denoiser(l2, 100, denoiser_tol=1e-6).tol == 1e-6
    with pytest.raises(AimsymError):
        make_denoiser(l3, 100, denoiser_tol="fast")
    with pytest.raises(AimsymError):
        make_denoiser(l3, 100, denoiser_tol=-1.0)


def test_held_layer_blocks_or_enables_the_first():
    """SMI appendix E: GAMP with the last layer held at overlap q. The held row keeps its overlap
    (q |W*_2|^2 / d within the noise of its draw, the same at every iteration), and the first layer
    is learned only when q is large (q = 0: it stays near zero)."""
    model = aimsym.load("attention_L2_T2", skip=1.0)
    den = model.denoiser(nodes=16)
    data = teacher_student(model, 200, alpha=1.2, seed=0)
    d = data.W_star.shape[1]
    norm2 = float(data.W_star[1] @ data.W_star[1]) / d
    final = {}
    for q in (0.0, 0.99):
        tr = gamp(den, data, lam=1e-2, rng=np.random.default_rng(1), max_iter=30, tol=0.0, hold={1: q})
        m22 = tr.M[1:, 1, 1]
        assert np.allclose(m22, m22[-1])
        assert abs(m22[-1] - q * norm2) < 4 * np.sqrt(q * (1 - q) * norm2 / d) + 1e-12, (q, m22[-1], norm2)
        final[q] = tr.M[-1, 0, 0]
    assert abs(final[0.0]) < 0.1
    assert abs(final[0.99]) > 0.3


@pytest.mark.parametrize("hold,field", [({1: 1.0}, "overlap of row 1"), ({5: 0.5}, "row 5"), ({0: 0.5, 1: 0.5}, "every row")])
def test_hold_rejects_bad_values(hold, field):
    model = aimsym.load("attention_L2_T2", skip=1.0)
    with pytest.raises(aimsym.AimsymError, match=field):
        run_amp(model, d=50, alpha=0.5, seeds=1, max_iter=2, hold=hold)
