"""AIM at finite d: data, adjoint, GAMP-RIE tracking the SE, gradient descent."""

import numpy as np
import pytest

from aimsym.aim import amp, gd, se
from aimsym.aim.channels import pairs, to_vector
from aimsym.errors import AimsymError


def test_generate_reproducible_and_consistent():
    a = amp.generate(30, 0.2, 0.5, 2, "softmax", seed=5)
    b = amp.generate(30, 0.2, 0.5, 2, "softmax", seed=5)
    assert np.array_equal(a.y, b.y) and np.array_equal(a.S, b.S)
    assert a.X.shape == (180, 30, 2) and a.rho == 0.5
    # labels are softmax rows of the index matrix of S
    H = amp.index_matrices(a.S, a.X)
    assert np.allclose(np.log(a.y[:, 0, 1] / a.y[:, 0, 0]), H[:, 0, 1] - H[:, 0, 0])


def test_index_variances():
    """Var h_ab = Tr(S^2)/d off the diagonal and twice that on it (over the tokens)."""
    rng = np.random.default_rng(0)
    S, _ = amp.teacher(60, 0.5, rng)
    X = rng.standard_normal((20000, 60, 2))
    H = amp.index_matrices(S, X)
    Q = np.trace(S @ S) / 60
    assert np.var(H[:, 0, 1]) == pytest.approx(Q, rel=0.03)
    assert np.var(H[:, 0, 0]) == pytest.approx(2 * Q, rel=0.03)


def test_adjoint_is_transpose_of_forward():
    rng = np.random.default_rng(1)
    for T in (2, 3):
        X = rng.standard_normal((40, 15, T))
        G = rng.standard_normal((40, T * (T + 1) // 2))
        E = rng.standard_normal((15, 15))
        E = E + E.T
        lhs = np.sum(amp.adjoint(X, G, T) * E)
        rhs = np.sum(G * to_vector(amp.index_matrices(E, X), T))
        assert lhs == pytest.approx(rhs, rel=1e-12)


def test_rie_divergence_variance_close_to_mmse():
    """The exact divergence of the RIE map gives V ~ m(Delta) on S + GOE noise."""
    rng = np.random.default_rng(2)
    d, rho, Delta = 300, 0.5, 0.2
    S, _ = amp.teacher(d, rho, rng)
    A = rng.standard_normal((d, d))
    _, V = amp.rie_denoise(S + np.sqrt(Delta) * (A + A.T) / np.sqrt(2 * d), rho, Delta, with_variance=True)
    from aimsym.aim.spectral import rie_mmse

    assert V == pytest.approx(rie_mmse(Delta, rho), rel=0.02)


def test_amp_hardmax_tracks_se_small_d():
    """Hardmax T = 2, d = 40: AMP error within 15 % of the SE (finite-d corrections ~ 1/d)."""
    errs = [amp.run(amp.generate(40, 0.5, 0.5, 2, "hardmax", seed=s), 2, "hardmax", iterations=30)["mmse"]
            for s in range(2)]
    m_se = se.solve(0.5, 0.5, 2, "hardmax").mmse
    assert np.mean(errs) == pytest.approx(m_se, rel=0.15)


def test_amp_softmax_small_d_improves_on_prior():
    data = amp.generate(50, 0.15, 0.5, 2, "softmax", seed=0)
    out = amp.run(data, 2, "softmax", iterations=40)
    assert out["mmse"] < 0.35 and out["mmse"] > 0.5 * se.solve(0.15, 0.5).mmse


def _explicit_sensing(X):
    """The sensing matrices X_ab = (x_a x_b^T + x_b x_a^T)/(2 sqrt d) - delta_ab I/sqrt d, (n, L, d, d)."""
    n, d, T = X.shape
    out = []
    for a, b in pairs(T):
        M = np.einsum("ni,nj->nij", X[:, :, a], X[:, :, b])
        out.append((M + M.transpose(0, 2, 1)) / (2 * np.sqrt(d)) - (a == b) * np.eye(d) / np.sqrt(d))
    return np.stack(out, axis=1)


@pytest.mark.parametrize("T", [2, 3])
def test_sensing_gram_and_onsager_reaction_exact(T):
    """Per-sample Gram <X_k, X_l> and reaction <X_k, J[X_l]> (J = Jacobian of the RIE map at R)
    against explicit matrices and central finite differences of the RIE map."""
    rng = np.random.default_rng(7)
    d, n = 12, 4
    X = rng.standard_normal((n, d, T))
    Xs = _explicit_sensing(X)
    assert np.allclose(amp.sensing_gram(X, T), np.einsum("nkij,nlij->nkl", Xs, Xs), atol=1e-12)
    S, _ = amp.teacher(d, 0.5, rng)
    Z = rng.standard_normal((d, d))
    R = S + 0.7 * (Z + Z.T) / np.sqrt(2 * d)
    _, U, fp, DD = amp.rie_spectral(R, 0.5, 0.49)
    O = amp.jacobian_forms(X, U, fp, DD, T)
    h = 1e-6
    for mu in range(n):
        for l in range(Xs.shape[1]):
            dF = (amp.rie_denoise(R + h * Xs[mu, l], 0.5, 0.49) - amp.rie_denoise(R - h * Xs[mu, l], 0.5, 0.49)) / (2 * h)
            assert np.allclose(O[mu, :, l], np.einsum("kij,ij->k", Xs[mu], dF), atol=1e-6 * np.abs(O).max())


def test_joint_output_steps():
    """Joint (full-covariance) output steps: hardmax equals the closed-form channel for the
    isotropic covariance and its g, dg equal finite differences of log Z for a general one;
    the softmax step puts the posterior mean on the line h0 + c 1."""
    from aimsym.aim.channels import log_bvn_cdf, make_channel

    rng = np.random.default_rng(3)
    n, V = 30, 0.3
    om = rng.standard_normal((n, 3))
    y = np.sign(rng.standard_normal((n, 2)))
    g1, dg1 = make_channel("hardmax", 2).denoise(y, om, V)
    g2, dg2 = amp.hardmax_joint_denoise(y, om, np.broadcast_to(np.diag([2 * V, V, 2 * V]), (n, 3, 3)))
    assert np.allclose(g1, g2, atol=1e-12) and np.allclose(dg1, np.einsum("nkk->nk", dg2), atol=1e-12)
    A = rng.standard_normal((n, 3, 3))
    Sig = np.einsum("nij,nkj->nik", A, A) + 0.3 * np.eye(3)
    B = np.array([[1.0, -1, 0], [0, -1, 1]])

    def logZ(o):
        m = o @ B.T
        C = np.einsum("ik,nkl,jl->nij", B, Sig, B)
        a, b = np.sqrt(C[:, 0, 0]), np.sqrt(C[:, 1, 1])
        k1, k2, r = y[:, 0] * m[:, 0] / a, y[:, 1] * m[:, 1] / b, y[:, 0] * y[:, 1] * C[:, 0, 1] / (a * b)
        return np.array([log_bvn_cdf(k1[i:i + 1], k2[i:i + 1], r[i])[0] for i in range(n)])

    g, dg = amp.hardmax_joint_denoise(y, om, Sig)
    e = 1e-5
    E = np.eye(3)
    fd = np.stack([(logZ(om + e * E[k]) - logZ(om - e * E[k])) / (2 * e) for k in range(3)], 1)
    fd2 = np.stack([(amp.hardmax_joint_denoise(y, om + e * E[k], Sig)[0]
                     - amp.hardmax_joint_denoise(y, om - e * E[k], Sig)[0]) / (2 * e) for k in range(3)], 2)
    assert np.allclose(g, fd, atol=1e-7) and np.allclose(dg, fd2, atol=1e-6)
    h0 = rng.standard_normal((n, 3))
    gs, _ = amp.joint_linear_denoise(h0, np.ones(3), om, Sig)
    mean = om + np.einsum("nkl,nl->nk", Sig, gs)
    shift = mean - h0
    assert np.allclose(shift, shift[:, :1], atol=1e-12)


@pytest.mark.parametrize("onsager", ["isotropic", "exact"])
def test_amp_softmax_onsager_small_d(onsager):
    """d = 50, alpha = 0.15, 4 seeds: mean error within 30 % of the SE (measured: 0.147 isotropic,
    0.146 exact vs SE 0.128; finite-d excess ~6.5/d, docs/aim.md section 4). Fails if the Onsager
    term is wrong: halving it gives 0.208, dropping it diverges."""
    errs = [amp.run(amp.generate(50, 0.15, 0.5, 2, "softmax", seed=s), 2, "softmax", onsager=onsager,
                    damping=0.3 if onsager == "exact" else None)["mmse"] for s in range(4)]
    m_se = se.solve(0.15, 0.5).mmse
    assert abs(np.mean(errs) - m_se) < 0.3 * m_se


# Finite-d allowance of the slow tests, relative to the SE mmse: C / d with C = 7. Measured gap of
# GAMP-RIE (isotropic, damping 0.5, 12 seeds) with the model's rank-one sensing, (mean/SE - 1) d:
# alpha = 0.1: 6.1 (d = 60), 6.4 (100), 6.5 (150); alpha = 0.15: 10 (60), 5.1 (100), 7.1 (150);
# the same code with GOE sensing matrices at d = 100, alpha = 0.1 is at the SE (0.3935 +- 0.0055
# vs 0.3922). See docs/aim.md section 4.
FINITE_D_C = 7.0


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [0.1, 0.15])
def test_amp_softmax_tracks_se_d150(alpha):
    """Softmax T = 2, rho = 0.5, d = 150, 8 seeds: |mean - SE| <= 3 s.e. + (7/d) SE."""
    d = 150
    res = amp.run_many(alpha, 0.5, d, 2, "softmax", seeds=list(range(8)), iterations=100)
    assert res["unstable_runs"] == 0
    assert abs(res["mmse"] - res["mmse_se"]) <= 3 * res["mmse_sem"] + FINITE_D_C / d * res["mmse_se"]


@pytest.mark.slow
def test_amp_hardmax_tracks_se_d100():
    res = amp.run_many(1.0, 0.5, 100, 2, "hardmax", seeds=list(range(8)), iterations=60)
    assert abs(res["mmse"] - res["mmse_se"]) < 3 * res["mmse_sem"] + 0.03 * res["mmse_se"]


def test_gd_gradient_is_exact():
    rng = np.random.default_rng(3)
    for act in ("softmax", "linear"):
        data = amp.generate(12, 0.5, 0.5, 2, act, seed=1)
        Y = data.y if act == "softmax" else amp.to_matrix_from_vector(data.y, 2)
        W = rng.standard_normal((12, 6))
        _, g = gd.loss_and_grad(W, data.X, Y, 1.3, act)
        E = rng.standard_normal(W.shape)
        h = 1e-6
        fd = (gd.loss_and_grad(W + h * E, data.X, Y, 1.3, act)[0] - gd.loss_and_grad(W - h * E, data.X, Y, 1.3, act)[0]) / (2 * h)
        assert np.sum(g * E) == pytest.approx(fd, rel=1e-6)


def test_gd_runs_and_averaging_helps():
    res = gd.run_many(0.15, 0.5, 20, seeds=[0, 1], steps=300, lr=0.02, runs=3)
    assert res["mmse_agd"] <= res["mmse_gd"] and res["train_loss"] < 1e-2


def test_finite_d_errors():
    with pytest.raises(AimsymError, match="alpha"):
        amp.generate(20, 0.0, 0.5)
    with pytest.raises(AimsymError, match="d"):
        amp.generate(2, 0.1, 0.5)
