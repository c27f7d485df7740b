"""Two-layer models a user declares with a linear or hardmax first layer (softmax second, T = 2):
the generated code runs and equals plain numpy, and the certified denoiser agrees with an
independent integral of the reduced posterior (theory section 3), with an honest estimate.

(The polar rule of attention_L2_T2 needs a softmax first layer; these models go through the
mode-centred cascade and the chamber rule. Before, code generation stopped with an assertion for
the linear one and the chamber kernel referred to names it never defined.)"""

import warnings

import numpy as np
import pytest
from modal_reference import outputs

import aimsym
from aimsym.denoise import modal

C, BETA = 0.7, 1.3


def declare(tmp_path, first):
    f = tmp_path / f"L2_T2_{first}_first.toml"
    f.write_text('[model]\nkind = "attention"\ntokens = 2\nlayers = 2\nrank = 1\nheads = 1\ntied = true\n'
                 f'skip = {C}\nactivation = ["{first}", "softmax"]\nbeta = {BETA}\noutput = "attention"\n')
    return aimsym.load(f)


def activation(first, q):
    """sigma(beta q q^T) of a first layer, plain numpy, for a batch q (n, 2)."""
    A = BETA * q[:, :, None] * q[:, None, :]
    if first == "linear":
        return A
    return (A == A.max(axis=2, keepdims=True)).astype(float)  # hardmax rows


def mixing(first, q):
    return C * np.eye(2) + activation(first, q)


@pytest.mark.parametrize("first", ["linear", "hardmax"])
def test_generated_block_and_observation_equal_plain_numpy(tmp_path, first):
    m = declare(tmp_path, first)
    K = modal.load(m.kernels)
    assert len(m.kernels.POLAR_ANGLES) == 0  # (no polar rule without a first-layer softmax)
    rng = np.random.default_rng(3)
    q = 1.5 * rng.standard_normal((20, 2))
    S = np.empty((2, 2))
    for i in range(len(q)):
        K.block_activation(0, q[i], m.params_array(), S)
        assert np.allclose(S, activation(first, q[i:i + 1])[0], rtol=1e-13, atol=1e-13)
    Z = rng.standard_normal((20, 2, 2))
    h = np.einsum("nab,nb->na", mixing(first, Z[:, 0]), Z[:, 1])
    assert np.allclose(m.observation(Z), h, rtol=1e-12, atol=1e-12)


def reduced_moments(first, h, omega, V, n=160):
    """log Z_out, E[Z], E[vec Z vec Z^T] of the reduced posterior over u = z_1 (z_2 = +-M(u)^{-1} h,
    weight N(Z; omega, V) / |det M(u)|) by polar Gauss-Legendre: the angle split where the first
    layer's attention switches (u_1 = 0, u_2 = 0, u_1 = u_2: smooth within each piece, also for
    hardmax), the radius on [0, R] in panels. Plain numpy, none of the package's code."""
    p, T = omega.shape
    Vinv = np.linalg.inv(V)
    R = np.linalg.norm(omega[0]) + 12 * np.sqrt(V[0, 0])
    xs, ws = np.polynomial.legendre.leggauss(n)
    edges = np.array([0, 1, 2, 4, 5, 6, 8]) * np.pi / 4
    th = np.concatenate([0.5 * (a + b) + 0.5 * (b - a) * xs for a, b in zip(edges[:-1], edges[1:])])
    wt = np.concatenate([0.5 * (b - a) * ws for a, b in zip(edges[:-1], edges[1:])])
    redges = R * np.linspace(0, 1, 9) ** 2
    r = np.concatenate([0.5 * (a + b) + 0.5 * (b - a) * xs for a, b in zip(redges[:-1], redges[1:])])
    wr = np.concatenate([0.5 * (b - a) * ws for a, b in zip(redges[:-1], redges[1:])])
    u = np.stack([np.multiply.outer(r, np.cos(th)), np.multiply.outer(r, np.sin(th))], -1).reshape(-1, 2)
    w = np.multiply.outer(wr * r, wt).reshape(-1)
    M = mixing(first, u)
    det = M[:, 0, 0] * M[:, 1, 1] - M[:, 0, 1] * M[:, 1, 0]
    z2 = np.stack([M[:, 1, 1] * h[0] - M[:, 0, 1] * h[1], M[:, 0, 0] * h[1] - M[:, 1, 0] * h[0]], -1) / det[:, None]
    logw = []
    Zs = []
    for s in (1.0, -1.0):
        Z = np.stack([u, s * z2], axis=1)  # (N, p, T)
        D = Z - omega
        quad = sum(Vinv[k, l] * (D[:, k] * D[:, l]).sum(axis=1) for k in range(p) for l in range(p))
        logw.append(np.log(w) - np.log(np.abs(det)) - 0.5 * quad)
        Zs.append(Z)
    logw, Zs = np.concatenate(logw), np.concatenate(Zs)
    top = logw.max()
    W = np.exp(logw - top)
    S0 = W.sum()
    mean = np.einsum("n,nkt->kt", W, Zs) / S0
    flat = Zs.reshape(len(Zs), -1)
    second = np.einsum("n,ni,nj->ij", W, flat, flat) / S0
    log_z = np.log(S0) + top - 0.5 * T * (np.linalg.slogdet(V)[1] + p * np.log(2 * np.pi))
    return log_z, mean, second


@pytest.mark.parametrize("first", [pytest.param("linear", marks=pytest.mark.slow), "hardmax"])
def test_denoiser_matches_independent_integral_with_honest_estimate(tmp_path, first):
    """Three SE-like points (one with the last layer nearly known): the certified denoiser at tol
    1e-6 against the reference at two sizes (their difference is the reference's own error)."""
    m = declare(tmp_path, first)
    rng = np.random.default_rng(7)
    for V in (0.6 * np.eye(2), np.diag([0.8, 0.5]), np.diag([0.9, 0.02])):
        Q = np.eye(2) - V
        om = np.linalg.cholesky(Q) @ rng.standard_normal((2, 2))
        Z = om + np.linalg.cholesky(V) @ rng.standard_normal((2, 2))
        h = m.observation(Z)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (the estimate is asserted instead)
            out = m.denoiser(tol=1e-6)(None, om[None], V, obs=h[None])
        # (the nearly known last layer puts the posterior of u on a thin curve: more nodes)
        ref = [reduced_moments(first, h, om, V, n) for n in ((240, 400) if V[1, 1] < 0.1 else (120, 160))]
        (lz, g, dg), (lz0, g0, dg0) = [(r[0], *outputs(V, om, r[1], r[2])) for r in ref[::-1]]
        size = lambda x: max(1.0, np.abs(x).max())  # noqa: E731
        own = max(abs(lz - lz0), np.abs(g - g0).max() / size(g), np.abs(dg - dg0).max() / size(dg))
        actual = max(abs(out.log_z_out[0] - lz), np.abs(out.g_out[0] - g).max() / size(g),
                     np.abs(out.dg_out[0] - dg).max() / size(dg))
        assert own < 1e-9, own
        assert actual <= out.error[0] + own, (np.diag(V), actual, out.error[0])
        if first == "linear":  # (smooth integrand: the cascade meets its tol)
            assert out.error[0] <= 1e-6 and actual < 1e-6


def _batch(m, rng, n, V):
    p, T = m.p, m.tokens
    om = np.einsum("ij,njt->nit", np.linalg.cholesky(np.eye(p) - V), rng.standard_normal((n, p, T)))
    Z = om + np.einsum("ij,njt->nit", np.linalg.cholesky(V), rng.standard_normal((n, p, T)))
    return om, m.observation(Z)


@pytest.mark.parametrize("first", ["linear", "hardmax"])
def test_g_out_and_dg_out_are_derivatives_of_log_z(tmp_path, first):
    """Central differences of the denoiser's own log Z_out and g_out in every entry of omega, at
    an SE point and with the last layer nearly known."""
    m = declare(tmp_path, first)
    den = m.denoiser(rule="modal", tol=1e-9)
    rng = np.random.default_rng(11)
    step = 1e-3
    for V in (0.6 * np.eye(2), np.diag([0.7, 0.05])):
        om, obs = _batch(m, rng, 1, V)
        oms = [om[0]]
        for k in range(2):
            for t in range(2):
                for s in (1, -1):
                    o = om[0].copy()
                    o[k, t] += s * step
                    oms.append(o)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            out = den(None, np.array(oms), V, obs=np.repeat(obs, len(oms), axis=0))
        g0, dg0 = out.g_out[0], out.dg_out[0]
        scale = max(1.0, np.abs(dg0).max())
        i = 1
        for k in range(2):
            for t in range(2):
                fd_g = (out.log_z_out[i] - out.log_z_out[i + 1]) / (2 * step)
                fd_dg = (out.g_out[i] - out.g_out[i + 1]) / (2 * step)
                # (central differences: O(step^2 * third derivative), ~1e-6 relative here)
                assert abs(fd_g - g0[k, t]) < 1e-5 * max(1.0, abs(g0[k, t])), (first, k, t, fd_g, g0[k, t])
                assert np.abs(fd_dg - dg0[:, :, k, t]).max() < 1e-4 * scale, (first, k, t)
                i += 2


@pytest.mark.parametrize("first", ["linear", "hardmax"])
def test_nishimori_identity(tmp_path, first):
    """E[g g^T] = -E[sum_t dg_out[:, t; :, t]] at a random Q, within its Monte Carlo error."""
    m = declare(tmp_path, first)
    rng = np.random.default_rng(32)
    A = rng.standard_normal((2, 2))
    Q = 0.5 * A @ A.T / np.trace(A @ A.T) * 2 * 0.5
    V = np.eye(2) - Q
    n = 1024
    om, obs = _batch(m, rng, n, V)
    out = m.denoiser(rule="modal", tol=1e-6)(None, om, V, obs=obs)
    diff = np.einsum("nkt,nlt->nkl", out.g_out, out.g_out) + np.einsum("nktlt->nkl", out.dg_out)
    mean, se = diff.mean(0), diff.std(0, ddof=1) / np.sqrt(len(diff))
    assert np.all(np.abs(mean) < 4 * se + 1e-4), (mean, se)
    assert np.abs(np.einsum("nkt,nlt->kl", out.g_out, out.g_out)).max() / n > 5 * se.max()  # (not vacuous)


@pytest.mark.parametrize("first", ["linear", "hardmax"])
@pytest.mark.parametrize("V", [1e-4 * np.eye(2), np.diag([1e-2, 1e-6])], ids=["iso", "aniso"])
def test_rank_identity_near_V0(tmp_path, first, V):
    """E[sum_t g_t^T V g_t] -> m = 2 as V -> 0 (y fixes h = M(z_1) z_2 up to sign at T = 2)."""
    m = declare(tmp_path, first)
    om, obs = _batch(m, np.random.default_rng(22), 64, V)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = m.denoiser(rule="modal", tol=1e-5)(None, om, V, obs=obs)
    s = np.einsum("nkt,kl,nlt->n", out.g_out, V, out.g_out)
    mean, se = s.mean(), s.std(ddof=1) / np.sqrt(len(s))
    assert abs(mean - 2) < max(4 * se, 0.05), (first, mean, se)
