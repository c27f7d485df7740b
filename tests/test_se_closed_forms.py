"""State evolution: closed forms, free-entropy stationarity, CLI."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.special import k0, k1  # noqa: F401  (used by the threshold tests' helper)

import aimsym
from aimsym.smi import se
from aimsym.errors import AimsymError
from aimsym.derive.files import derivations_dir

ROOT = Path(__file__).resolve().parents[1]
DER = derivations_dir()


class PhaseRetrieval:
    """y = |z| (p = T = 1) with its closed-form two-point posterior; a stand-in for the generated
    glm_phase_retrieval denoiser (a dim-0 reduction the code generator does not compile yet)."""

    p, tokens, output_shape, noise, parameters = 1, 1, (1, 1), 0.0, {}

    def hash(self):
        return "phase-retrieval-closed-form"

    def link(self, Z):
        return np.abs(Z)

    def denoiser(self, **_):
        return _PRDenoiser()


class _PRDenoiser:
    accuracy = {"path": "closed form"}

    def __call__(self, y, omega, V):
        y = np.asarray(y).reshape(-1)
        w = omega.reshape(-1)
        v = float(np.asarray(V).reshape(-1)[0])
        th = np.tanh(y * w / v)
        mean, var = y * th, y**2 * (1 - th**2)
        logz = (np.logaddexp(-(y - w) ** 2 / (2 * v), -(y + w) ** 2 / (2 * v))
                - 0.5 * np.log(2 * np.pi * v))
        n = y.size

        class Out:
            g_out = ((mean - w) / v).reshape(n, 1, 1)
            dg_out = (var / v**2 - 1 / v).reshape(n, 1, 1, 1, 1)
            log_z_out = logz
        return Out()


@pytest.mark.parametrize("alpha,Delta", [(0.3, 0.5), (1.3, 0.5), (2.0, 0.1)])
def test_gaussian_channel_closed_form(alpha, Delta):
    model = aimsym.load(DER / "gaussian_channel.toml", Delta=Delta)
    res = se.state_evolution(model, alpha, samples=8192, replicas=16, seed=1, errors=False, tol=1e-7)
    exact = se.gaussian_channel_fixed_point(alpha, Delta)
    assert res.converged
    assert abs(res.Q[0, 0] - exact) < 5 * res.Q_stderr[0, 0] + 1e-4
    assert res.provenance["model_hash"] == model.hash()


def test_gaussian_channel_informed_equals_uninformed():
    model = aimsym.load(DER / "gaussian_channel.toml", Delta=0.3)
    a = se.state_evolution(model, 0.8, init="uninformed", samples=2048, errors=False, tol=1e-7)
    b = se.state_evolution(model, 0.8, init="informed", samples=2048, errors=False, tol=1e-7)
    assert abs(a.Q[0, 0] - b.Q[0, 0]) < 1e-5


def _phi_of_q(ch, Q, Q_hat, alpha):
    _, psi = se.se_map(ch, Q, alpha)
    return se.free_entropy(Q, Q_hat, alpha, psi.mean())


@pytest.mark.parametrize("alpha", [0.7, 1.5])
def test_fixed_point_is_stationary_point_of_free_entropy_gaussian(alpha):
    model = aimsym.load(DER / "gaussian_channel.toml", Delta=0.4)
    ch = se.make_channel(model, samples=4096, replicas=8, seed=3)
    res = se.state_evolution(model, alpha, channel=ch, errors=False, tol=1e-8)
    Q, Qh, h = res.Q, res.Q_hat, 1e-3
    d = (_phi_of_q(ch, Q + h, Qh, alpha) - _phi_of_q(ch, Q - h, Qh, alpha)) / (2 * h)
    # scale of each term of dPhi/dQ is Q_hat / 2
    assert abs(d) < 0.02 * Qh[0, 0] / 2 + 1e-4


def test_fixed_point_is_stationary_point_of_free_entropy_phase_retrieval():
    model = PhaseRetrieval()
    ch = se.make_channel(model, samples=1 << 14, replicas=8, seed=5)
    res = se.state_evolution(model, 0.8, channel=ch, errors=False, tol=1e-8)
    assert 0.05 < res.Q[0, 0] < 0.999
    Q, Qh, h = res.Q, res.Q_hat, 1e-3
    d = (_phi_of_q(ch, Q + h, Qh, 0.8) - _phi_of_q(ch, Q - h, Qh, 0.8)) / (2 * h)
    assert abs(d) < 0.03 * Qh[0, 0] / 2


def test_phase_retrieval_zero_below_positive_above_half():
    model = PhaseRetrieval()
    lo = se.state_evolution(model, 0.4, samples=4096, errors=False)
    hi = se.state_evolution(model, 0.7, samples=4096, errors=False)
    assert lo.Q[0, 0] < 1e-3 < 0.05 < hi.Q[0, 0]


def test_se_with_a_sample_whose_quadrature_error_is_not_controlled_says_so():
    """A denoiser that returns one sample without an error estimate (inf, as the k >= 6 QMC
    stage does for heavy-tailed weights): the fixed point is still computed, its Q_stderr is inf
    (not nan, not the statistical error alone) and the diagnostics count and name the sample."""

    class Uncontrolled(PhaseRetrieval):
        def denoiser(self, **_):
            inner = _PRDenoiser()

            def den(y, omega, V):
                out = inner(y, omega, V)
                out.error = np.zeros(np.size(out.log_z_out))
                out.error[0] = np.inf
                return out

            den.accuracy = inner.accuracy
            return den

    res = se.state_evolution(Uncontrolled(), 0.8, samples=1024, replicas=4, errors=False, seed=2)
    assert 0.05 < res.Q[0, 0] < 0.999
    assert np.all(res.Q_stderr == np.inf)
    d = res.diagnostics
    assert d["quadrature_uncontrolled"] == 1 and d["quadrature_to_statistical"] == np.inf
    assert "not controlled" in d["quadrature_note"] and "Q_stderr is inf" in d["quadrature_note"]


def test_two_layer_fixed_point_structure():
    """alpha = 0.5, skip = 1: only the last layer is learned; Q symmetric, within [0, I]."""
    model = aimsym.load(DER / "attention_L2_T2.toml", skip=1.0)
    res = se.state_evolution(model, 0.5, samples=1024, replicas=8, errors=True, tol=1e-3)
    assert res.Q[0, 0] < 1e-3 and 0.6 < res.Q[1, 1] < 0.9
    assert np.allclose(res.Q, res.Q.T)
    assert res.errors["prediction"].bayes_optimal <= res.errors["prediction"].plug_in + 0.01
    assert np.isfinite(res.free_entropy)


def test_bad_input():
    model = aimsym.load(DER / "gaussian_channel.toml", Delta=0.3)
    for kw in ({"alpha": -1.0}, {"alpha": 1.0, "damping": 1.0}, {"alpha": 1.0, "init": "nope"},
               {"alpha": 1.0, "replicas": 1}):
        with pytest.raises(AimsymError):
            se.state_evolution(model, **kw)


def test_cli_se_json():
    out = subprocess.run([sys.executable, "-m", "aimsym.cli", "se", str(DER / "gaussian_channel.toml"),
                          "--set", "Delta=0.5", "--alpha", "1.3", "--json"], capture_output=True, text=True,
                         check=True)
    d = json.loads(out.stdout)
    for key in ("alpha", "Q", "Q_stderr", "errors", "free_entropy", "iterations", "provenance"):
        assert key in d
    assert abs(d["Q"][0][0] - se.gaussian_channel_fixed_point(1.3, 0.5)) < 0.003
    bad = subprocess.run([sys.executable, "-m", "aimsym.cli", "se", str(DER / "gaussian_channel.toml"),
                          "--set", "Delta=0.5", "--alpha", "-2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "alpha" in bad.stderr and "Traceback" not in bad.stderr


def _sign_fixed_point(alpha):
    """Bayes-optimal SE of y = sign(z), Gaussian prior, by quadrature over both outputs:
    Q_hat = alpha E_xi sum_y phi(x)^2 / ((1 - Q) Phi(y x)), x = sqrt(Q) xi / sqrt(1 - Q)."""
    from scipy import integrate, optimize
    from scipy.special import log_ndtr
    from scipy.stats import norm

    def q_hat(q):
        a = np.sqrt(q / (1 - q))
        lp = lambda x: norm.logpdf(x)
        f = lambda xi: np.exp(lp(xi) + 2 * lp(a * xi) - log_ndtr(a * xi)) + np.exp(lp(xi) + 2 * lp(a * xi)
                                                                                    - log_ndtr(-a * xi))
        return alpha * integrate.quad(f, -np.inf, np.inf, epsabs=1e-13)[0] / (1 - q)

    return optimize.brentq(lambda q: q_hat(q) / (1 + q_hat(q)) - q, 1e-6, 1 - 1e-6, xtol=1e-12)


@pytest.mark.parametrize("alpha", [0.6, 1.5])
def test_sign_channel_converges_to_its_closed_form(alpha):
    """The SE sums over the two outputs (a smooth map), converges and lands on the closed form
    within its error bar."""
    res = se.state_evolution(aimsym.load(DER / "glm_sign.toml"), alpha, errors=False)
    assert res.converged and res.diagnostics["outputs"] == 2
    q = _sign_fixed_point(alpha)
    assert abs(res.Q[0, 0] - q) < 3 * res.Q_stderr[0, 0], (res.Q[0, 0], q, res.Q_stderr[0, 0])


def test_quadrature_share_scales_with_the_per_sample_estimates():
    """The quadrature bound on Q_hat's diagonal is linear in the denoiser's estimates and is
    compared with Q_hat's replica standard error; an entry that vanishes by symmetry is ignored."""
    rng = np.random.default_rng(0)
    R, n, p, T = 8, 64, 2, 2
    g = rng.standard_normal((R, n, p, T))
    g[:, :, 0] *= 1e-14  # a layer at Q = 0: g vanishes by its sign symmetry
    Q_hat_r = 0.5 * np.einsum("rnkt,rnlt->rkl", g, g) / n
    small = se.quadrature_share(g, np.full(R * n, 1e-8), 0.5, Q_hat_r)
    large = se.quadrature_share(g, np.full(R * n, 1e-1), 0.5, Q_hat_r)
    assert large["quadrature_Q_hat_bound"] == pytest.approx(1e7 * small["quadrature_Q_hat_bound"])
    assert small["quadrature_to_statistical"] < 1e-4 < 1 < large["quadrature_to_statistical"]
    assert se.quadrature_share(g, None, 0.5, Q_hat_r)["quadrature_to_statistical"] is None


def test_quadrature_bounds_are_inf_not_nan_for_a_sample_without_an_estimate():
    """One sample without an error estimate (inf) at a layer whose g vanishes exactly: the Q_hat
    and Nishimori bounds are inf (no bound), not nan (inf * 0), and nishimori_z stays a number."""
    rng = np.random.default_rng(1)
    R, n, p, T = 4, 16, 2, 2
    g = rng.standard_normal((R, n, p, T))
    g[:, :, 0] = 0.0
    dg = rng.standard_normal((R, n, p, T, p, T))
    err = np.full(R * n, 1e-6)
    err[3] = np.inf
    Q_hat_r = np.einsum("rnkt,rnlt->rkl", g, g) / n
    share = se.quadrature_share(g, err, 0.5, Q_hat_r)
    assert share["quadrature_Q_hat_bound"] == np.inf and share["quadrature_to_statistical"] == np.inf
    quad = se.nishimori_quadrature(g, dg, err)
    assert quad.shape == (p, p) and np.all(quad == np.inf)
    gg_r = np.einsum("rnkt,rnlt->rkl", g, g) / n
    assert np.isfinite(se.nishimori_residual(gg_r, -gg_r, quad)["nishimori_z"])
    err[3] = 1e-6
    assert np.all(np.isfinite(se.nishimori_quadrature(g, dg, err)))


def test_operator_quadrature_bound_is_inf_for_a_weighted_sample_without_an_estimate():
    """The weak-recovery operator's bound: inf where a sample that counts has no estimate (not nan
    from a zero block), finite where that sample's weight is 0, and linear in small estimates."""
    from aimsym.smi.thresholds import quadrature_bound

    rng = np.random.default_rng(3)
    N, T, k = 6, 2, 2
    D = rng.standard_normal((2, 3, T, T, k, k))
    D[0, 1] = 0.0

    class Out:
        dg_out = rng.standard_normal((N, k, T, k, T))
        error = np.full(N, 1e-8)

    small = quadrature_bound(Out, D)
    Out.error = np.full(N, 2e-8)
    assert quadrature_bound(Out, D) == pytest.approx(2 * small, rel=1e-6)
    Out.error[1] = np.inf
    assert quadrature_bound(Out, D) == np.inf
    w = np.ones(N)
    w[1] = 0.0
    assert np.isfinite(quadrature_bound(Out, D, w))


def test_fixed_rule_se_estimates_its_quadrature_error():
    """The generic noisy path runs a fixed rule: the SE estimates its error at the fixed point
    against twice the nodes, folds it into the stderr, and says when it dominates (a 4-node rule
    on a noisy attention layer does; the Gaussian channel, where Gauss-Hermite is exact, does not)."""
    import aimsym
    from aimsym.derive import spec as S
    from aimsym.smi.se import state_evolution

    noisy = aimsym.load(S.make_attention(tokens=2, noise=0.1, name="l1_noisy_se_check"))
    coarse = state_evolution(noisy, 1.0, samples=256, replicas=4, nodes=4)
    d = coarse.diagnostics
    assert "twice its nodes" in d["quadrature_note"] and d["quadrature_error_max"] > 1e-2
    assert d["quadrature_to_statistical"] > 1 and "dominates" in d["quadrature_note"]
    gauss = state_evolution(aimsym.load("gaussian_channel", Delta=0.5), 1.0, samples=256, replicas=4)
    assert gauss.diagnostics["quadrature_error_max"] < 1e-8 and "dominates" not in gauss.diagnostics["quadrature_note"]


def test_fixed_rule_se_refines_its_default_rule_while_the_quadrature_dominates():
    """The noisy attention layer at Delta = 0.1: the default 24-node rule's error dominates, so the
    SE doubles the nodes (up to SE_MAX_NODES) and says so; an explicit rule is left as asked."""
    import aimsym
    from aimsym.derive import spec as S
    from aimsym.smi.se import SE_MAX_NODES, state_evolution

    noisy = aimsym.load(S.make_attention(tokens=2, noise=0.1, depth_limit_tau=2.0, name="dl_noisy_refine_check"))
    res = state_evolution(noisy, 1.0, samples=512, replicas=4)
    d = res.diagnostics
    assert 24 < d["refined_nodes"] <= SE_MAX_NODES[2] and "refined to" in d["quadrature_note"]
    assert "refined_nodes" not in state_evolution(noisy, 1.0, samples=512, replicas=4, nodes=24).diagnostics


def test_amplification_ignores_entries_without_one_step_spread():
    """fixed_point_stderr: stderr = sqrt(diag((I - J)^-1 C (I - J)^-T)) per free entry; the reported
    amplification is the largest ratio to the one-step spread over the entries that have one (an
    unlearned layer the map keeps at exactly 0 has none and used to give ~1e130)."""
    resp = se.Response(free=[(0, 0), (1, 1)], F0=np.zeros((2, 2)), J=np.array([[0.5, 0.4], [0.0, 0.0]]))
    rng = np.random.default_rng(0)
    Q_r = np.zeros((8, 2, 2))
    Q_r[:, 1, 1] = 0.5 + 0.01 * rng.standard_normal(8)  # entry (0, 0) stays exactly 0
    out, amp = se.fixed_point_stderr(resp, Q_r)
    A = np.linalg.inv(np.eye(2) - resp.J)
    step = Q_r[:, 1, 1].std(ddof=1) / np.sqrt(8)
    assert out[1, 1] == pytest.approx(abs(A[1, 1]) * step)
    assert out[0, 0] == pytest.approx(abs(A[0, 1]) * step)  # (coupled to the learned entry)
    assert amp == pytest.approx(abs(A[1, 1]))


def test_nishimori_z_counts_only_what_the_quadrature_bound_cannot_explain():
    """An entry that vanishes by symmetry has a replica error far below the denoiser's tol: its
    residual within the quadrature bound is not a violation; beyond it, it is."""
    from aimsym.smi.se import nishimori_quadrature, nishimori_residual

    rng = np.random.default_rng(0)
    R, n, p, T = 8, 64, 2, 2
    g = rng.standard_normal((R, n, p, T))
    g[:, :, 0] = 0.0  # an unlearned layer
    gg_r = np.einsum("rnkt,rnlt->rkl", g, g) / n
    dg_r = -gg_r.copy() + 1e-9 * rng.standard_normal((R, p, p))  # Nishimori up to replica noise
    dg_r[:, 0, 0] += 1e-5  # a quadrature-sized offset on the vanishing entry
    err = np.full((R, n), 1e-3)
    dg = np.zeros((R, n, p, T, p, T))
    quad = nishimori_quadrature(g, dg, err)
    assert quad[0, 0] >= 1e-5
    plain, bounded = nishimori_residual(gg_r, dg_r), nishimori_residual(gg_r, dg_r, quad)
    assert plain["nishimori_z"] > 100 and bounded["nishimori_z"] == 0.0
    dg_r[:, 0, 0] += 1.0  # a real violation is still seen
    assert nishimori_residual(gg_r, dg_r, quad)["nishimori_z"] > 100
