"""Hardmax last layer after a softmax first layer (two layers, T = 2): region constraints.

Model derivations/hardmax_L2_T2.toml; denoiser aimsym/denoise/hardmax_channel.py with the driver
aimsym/denoise/hardmax_template.py (theory section 3: region constraints under the u-integral).
"""

import mpmath as mp
import numpy as np
import pytest
from scipy import integrate
from hardmax_reference import reference

import aimsym
from aimsym.derive import spec as S
from aimsym.bench.hardmax import regime_points
from aimsym.denoise.hardmax_channel import ERROR_TOL, HardmaxMixedDenoiser, fejer2
from aimsym.denoise.output import difference
from aimsym.errors import ChannelError
from aimsym.derive.files import derivations_dir

D = derivations_dir()
PATTERNS = np.array([[[1, 0], [1, 0]], [[0, 1], [0, 1]], [[1, 0], [0, 1]]], dtype=float)  # the possible outputs


def load(c=1.0, name="hardmax_L2_T2"):
    return aimsym.load(D / f"{name}.toml", **({"c": c} if name == "hardmax_L2_T2" else {}))


def random_spd(rng, lo=0.3, hi=1.2):
    Q, _ = np.linalg.qr(rng.standard_normal((2, 2)))
    return Q @ np.diag(rng.uniform(lo, hi, 2)) @ Q.T


def mixing_numpy(u, c, beta=1.0):
    """M_1(u) = c I + softmax_rows(beta u u^T), written out independently of the generated code."""
    A = beta * np.einsum("na,nb->nab", u, u)
    S = np.exp(A - A.max(axis=2, keepdims=True))
    S /= S.sum(axis=2, keepdims=True)
    return c * np.eye(2)[None] + S


# ----------------------------------------------------------------------------- derivation


def test_derivation_detects_the_region_reduction():
    m = load()
    red = m.derivation.reduction
    assert red.kind == "hardmax-wedge-mixed" and red.integral_dim == 2
    assert red.free == [(0, 0), (0, 1)] and red.solved == [(1, 0), (1, 1)]
    assert "region constraint" in m.derivation.reduction_reason
    assert any("wedges" in n for n in red.notes)
    assert m.summary()["denoiser_path"] == "exact"
    assert m.denoiser().path == "exact"
    # the one-layer hardmax model keeps its own reduction (wedges in z itself)
    assert load(name="attention_hardmax_L1_T2").derivation.reduction.kind == "hardmax-wedge"


def test_other_hardmax_architectures_are_not_claimed():
    """Untied or rank-two first layers, or T = 3, fall back with a reason naming hardmax."""
    for kw in ({"tied": [False, True]}, {"rank": [2, 1]}, {"tokens": 3}):
        base = {"tokens": 2, "layers": 2, "activation": ["softmax", "hardmax"], "name": "hm_other"}
        base.update(kw)
        spec = S.make_attention(**base)
        d = aimsym.load(spec).derivation
        assert d.reduction is None and "hardmax" in d.reduction_reason, kw


def test_generated_mixing_kernel_and_wedge_geometry_match_the_link():
    """mixing(u) = c I + softmax(u u^T); the wedge of v = M_1(u) z_2 gives the link's output."""
    c = 0.7
    m = load(c)
    den = m.denoiser()
    rng = np.random.default_rng(0)
    Z = 1.5 * rng.standard_normal((400, 2, 2))
    M = np.empty((400, 2, 2))
    for i in range(400):
        m.kernels.mixing(np.ascontiguousarray(Z[i, 0]), m.params_array(), M[i])
    assert np.allclose(M, mixing_numpy(Z[:, 0], c), rtol=1e-13, atol=1e-14)
    v = np.einsum("nij,nj->ni", M, Z[:, 1])
    ang = np.mod(np.arctan2(v[:, 1], v[:, 0]), 2 * np.pi)
    k = np.searchsorted(np.array([1, 2, 4, 5, 6, 8]) * np.pi / 4, ang, side="right")
    assert np.array_equal(den.patterns[k], m.link(Z))
    # the anti-diagonal pattern never occurs
    assert not np.any(np.all(m.link(Z) == np.array([[0, 1], [1, 0]]), axis=(1, 2)))


def test_latex_describes_the_region_reduction():
    from aimsym.derive.latex import document

    tex = document(load().derivation)
    assert "hardmax" in tex and r"M_1(u)^{-1} W_y" in tex and "K_3 = a K_2 + 2K_1" in tex
    assert r"\det M_1" in tex


# ----------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("a", [-40.0, -12.0, -5.0, -3.0001, -2.9999, -1.0, -1e-3, 0.0, 0.7, 4.0, 25.0])
def test_radial_moments_against_mpmath(a):
    """log(e^{-a^2/2} K_1) and the moments E[t], E[t^2] of t = r - a under r e^{-r^2/2 + a r}
    (K_k = int_0^inf r^k e^{-r^2/2 + a r} dr: K_2/K_1 - a, K_3/K_1 - 2 a K_2/K_1 + a^2)."""
    k = load().kernels
    out = np.empty(3)
    k.hm_radial(a, out)
    mp.mp.dps = 30
    cuts = [0, 1, a, mp.inf] if a > 1 else [0, 1 / max(1.0, abs(a)), 1, mp.inf]
    K = [mp.quad(lambda r, j=j: r**j * mp.exp(-r * r / 2 + a * r), cuts) for j in (1, 2, 3)]
    assert abs(out[0] - float(-a * a / 2 + mp.log(K[0]))) <= 1e-13 * max(1.0, a * a)
    assert out[1] == pytest.approx(float(K[1] / K[0] - a), rel=1e-13)
    assert out[2] == pytest.approx(float(K[2] / K[0] - 2 * a * K[1] / K[0] + a * a), rel=1e-13)


@pytest.mark.parametrize("R,psi,span", [(0.4, 0.3, 2.5), (3.0, -0.2, 0.8), (3.0, 1.2, 1.0), (12.0, 0.05, 0.3),
                                         (12.0, 0.9, 0.6), (25.0, 2.0, 2.0), (25.0, -2.9, 0.4), (40.0, 1.5, 0.2),
                                         (60.0, -1.5, 1.2), (60.0, -2.4, 1.6)])
def test_single_wedge_against_two_dimensional_quadrature(R, psi, span):
    """Probability, mean and second moment of N(mu, I) on a wedge, including far tails
    (P ~ e^{-300}) and wedges on either side of mu's direction, against scipy dblquad (radius
    and angle both numerical) of the integrand scaled by its maximum over the wedge. The kernel
    gives the moments of d = x - mu."""
    k = load().kernels
    mu = R * np.array([np.cos(0.4), np.sin(0.4)])
    th0 = 0.4 + psi  # the wedge starts psi away from the direction of mu
    th1 = th0 + span
    gx, gw = np.polynomial.legendre.leggauss(10)
    acc, rad = np.empty(7), np.empty(3)
    acc[0], acc[1:] = -np.inf, 0.0
    k.hm_wedge(mu[0], mu[1], th0, th1, gx, gw, acc, rad)
    logP = acc[0] + np.log(acc[1]) - np.log(2 * np.pi)
    # closest distance of the wedge to mu: the integrand's maximum, divided out
    th_grid = np.linspace(th0, th1, 20001)
    rr = np.maximum(mu @ np.stack([np.cos(th_grid), np.sin(th_grid)]), 0)
    shift = -0.5 * np.min((rr * np.cos(th_grid) - mu[0]) ** 2 + (rr * np.sin(th_grid) - mu[1]) ** 2)
    ths = sorted({th0, th1, *[t for t in (0.4, 0.4 + np.pi, 0.4 - np.pi) if th0 < t < th1]})
    ths = np.concatenate([np.linspace(a, b, 9)[:-1] for a, b in zip(ths[:-1], ths[1:])] + [[th1]])

    def mom(f):
        tot = 0.0
        for a, b in zip(ths[:-1], ths[1:]):
            for r0, r1 in [(0, 0.5), (0.5, max(R - 6, 1)), (max(R - 6, 1), R + 6), (R + 6, R + 40)]:
                if r1 <= r0:
                    continue
                g = lambda r, th: f(th, r) * r * np.exp(-((r * np.cos(th) - mu[0]) ** 2 + (r * np.sin(th) - mu[1]) ** 2) / 2 - shift)  # noqa: E731
                tot += integrate.dblquad(g, a, b, r0, r1, epsabs=1e-15, epsrel=1e-12)[0]
        return tot

    P = mom(lambda th, r: 1.0)
    d = [mom(lambda th, r: r * np.cos(th) - mu[0]) / P, mom(lambda th, r: r * np.sin(th) - mu[1]) / P]
    d01 = mom(lambda th, r: (r * np.cos(th) - mu[0]) * (r * np.sin(th) - mu[1])) / P
    assert logP == pytest.approx(np.log(P / (2 * np.pi)) + shift, abs=1e-10 * max(1, abs(logP)))
    scale = max(1.0, abs(d[0]), abs(d[1]))
    assert abs(acc[2] / acc[1] - d[0]) < 1e-9 * scale
    assert abs(acc[3] / acc[1] - d[1]) < 1e-9 * scale
    assert abs(acc[5] / acc[1] - d01) < 1e-9 * scale**2


# ----------------------------------------------------------------------------- the channel


@pytest.mark.parametrize("c", [0.3, 1.0, 4.0])
def test_probabilities_of_the_outputs_sum_to_one(c):
    m = load(c)
    den = m.denoiser()
    rng = np.random.default_rng(1)
    for _ in range(3):
        om = 0.8 * rng.normal(size=(2, 2))
        V = random_spd(rng, 0.2, 1.5)
        out = den(PATTERNS, om, V)
        assert abs(np.exp(out.log_z_out).sum() - 1) < 1e-10
        assert np.all(out.log_z_out < 0)
    # the fourth pattern has probability zero: a clear error naming y
    with pytest.raises(ChannelError) as err:
        den(np.array([[0.0, 1.0], [1.0, 0.0]]), om, V)
    assert err.value.field == "y" and "probability zero" in str(err.value)


def _reference_points(n, seed):
    rng = np.random.default_rng(seed)
    pts = []
    for i in range(n):
        om = 0.6 * rng.normal(size=(2, 2))
        V = random_spd(rng, 0.3, 1.2)
        pts.append((PATTERNS[i % 3], om, V))
    return pts


def _check_reference(points, c, tol):
    m = load(c)
    den = m.denoiser()
    for y, om, V in points:
        wedges = [k for k in range(6) if np.array_equal(den.patterns[k], y)]
        Z, mean, status = reference(om, V, lambda u: mixing_numpy(u, c), wedges, rtol=1e-11)
        assert status == "converged"
        out = den(y, om, V)
        assert abs(out.log_z_out - np.log(Z)) <= tol
        mean_den = om + V @ out.g_out  # E[Z | y] = omega + V g_out
        assert np.max(np.abs(mean_den - mean)) <= tol * max(1.0, np.max(np.abs(mean)))


def test_matches_independent_cubature_reference():
    """Owen's-T orthant probabilities and Stein boundary terms for the inner region, scipy's
    adaptive cubature outside: no angular quadrature, no polar rule. Agreement to 1e-8."""
    _check_reference(_reference_points(2, seed=2), c=1.0, tol=1e-8)


@pytest.mark.slow
def test_matches_independent_cubature_reference_many_points():
    _check_reference(_reference_points(6, seed=3), c=1.0, tol=1e-8)
    _check_reference(_reference_points(3, seed=4), c=0.2, tol=1e-8)


def test_matches_monte_carlo_of_the_link():
    """P(y) and E[Z | y] against Monte Carlo of the indicator link(Z) == y, Z ~ N(omega, V) per token."""
    m = load(0.8)
    den = m.denoiser()
    rng = np.random.default_rng(5)
    om = np.array([[0.4, -0.3], [0.2, 0.5]])
    V = np.array([[0.9, 0.25], [0.25, 0.7]])
    n = 400_000
    L = np.linalg.cholesky(V)
    Z = om[None] + np.einsum("ij,njt->nit", L, rng.standard_normal((n, 2, 2)))
    Y = m.link(Z)
    out = den(PATTERNS, om, V)
    for k in range(3):
        ind = np.all(Y == PATTERNS[k], axis=(1, 2))
        p = ind.mean()
        assert abs(np.exp(out.log_z_out[k]) - p) < 5 * np.sqrt(p * (1 - p) / n)
        mean, se = Z[ind].mean(axis=0), Z[ind].std(axis=0) / np.sqrt(ind.sum())
        assert np.all(np.abs(om + V @ out.g_out[k] - mean) < 5 * se)


def test_g_out_is_gradient_of_log_z_and_dg_out_of_g_out():
    m = load(1.0)
    den = m.denoiser()
    rng = np.random.default_rng(4)
    _, y = m.sample(3, rng)
    om = 0.5 * rng.normal(size=(3, 2, 2))
    V = random_spd(rng, 0.4, 1.0)
    out = den(y, om, V)
    eps, tol = 1e-4, 1e-6
    for k in range(2):
        for t in range(2):
            E = np.zeros_like(om)
            E[:, k, t] = eps
            up, dn = den(y, om + E, V), den(y, om - E, V)
            assert np.allclose(out.g_out[:, k, t], (up.log_z_out - dn.log_z_out) / (2 * eps), rtol=10 * tol, atol=tol)
            assert np.allclose(out.dg_out[:, :, :, k, t], (up.g_out - dn.g_out) / (2 * eps), rtol=100 * tol, atol=10 * tol)
    flat = out.dg_out.reshape(3, 4, 4)
    assert np.allclose(flat, np.swapaxes(flat, 1, 2), atol=1e-9)


def test_vectorised_equals_scalar_loop():
    m = load(1.0)
    den = m.denoiser(polar=(8, 24))
    rng = np.random.default_rng(5)
    _, y = m.sample(6, rng)
    om = (0.7 * rng.normal(size=(2, 3, 2, 2)))
    V = np.stack([random_spd(rng) for _ in range(6)]).reshape(2, 3, 2, 2)
    batch = den(y.reshape(2, 3, 2, 2), om, V)
    assert batch.g_out.shape == (2, 3, 2, 2) and batch.dg_out.shape == (2, 3, 2, 2, 2, 2)
    for i in range(2):
        for j in range(3):
            one = den(y.reshape(2, 3, 2, 2)[i, j], om[i, j], V[i, j])
            assert np.array_equal(one.g_out, batch.g_out[i, j])
            assert np.array_equal(one.dg_out, batch.dg_out[i, j])
            assert np.array_equal(one.log_z_out, batch.log_z_out[i, j])


def test_uninformed_g_out_vanishes():
    """Both layers' sign flips are symmetries of the link: g_out(y, 0, diagonal V) = 0."""
    m = load(1.0)
    rng = np.random.default_rng(6)
    _, y = m.sample(4, rng)
    out = m.denoiser()(y, np.zeros((4, 2, 2)), np.diag([0.8, 1.3]))
    assert np.max(np.abs(out.g_out)) < 1e-10
    # and it does not vanish at an informative omega
    assert np.max(np.abs(m.denoiser()(y, 0.5 * np.ones((4, 2, 2)), np.eye(2)).g_out)) > 1e-2


def test_nishimori_identity():
    m = load(1.0)
    rng = np.random.default_rng(7)
    n = 1500
    A = rng.normal(size=(2, 2))
    Q = A @ A.T
    Q = 0.6 * Q / np.linalg.eigvalsh(Q).max()
    w, U = np.linalg.eigh(Q)
    sq = U @ np.diag(np.sqrt(np.clip(w, 0, None))) @ U.T
    sv = U @ np.diag(np.sqrt(1 - w)) @ U.T
    xi, eta = rng.normal(size=(2, n, 2, 2))
    om = np.einsum("ij,njt->nit", sq, xi)
    y = m.link(om + np.einsum("ij,njt->nit", sv, eta))
    out = m.denoiser(polar=(8, 24))(y, om, np.eye(2) - Q)
    diff = np.einsum("nkt,njt->nkj", out.g_out, out.g_out) + np.einsum("nktjt->nkj", out.dg_out)
    se = diff.std(axis=0) / np.sqrt(n)
    assert np.all(np.abs(diff.mean(axis=0)) < 5 * se + 1e-3)
    # the identity is not trivially satisfied: both sides are clearly non-zero
    gg = np.diag(np.einsum("nkt,njt->kj", out.g_out, out.g_out) / n)
    assert gg[0] > 1e-3 and gg[1] > 0.1


def test_large_skip_reduces_to_the_one_layer_wedge_channel():
    """c -> infinity: M_1 = c (I + S/c), the first layer drops out of the output and the z_2 part of
    the posterior is the one-hardmax-layer channel (closed form of attention_hardmax_L1_T2); the
    difference is O(1/c)."""
    one = load(name="attention_hardmax_L1_T2").denoiser()
    rng = np.random.default_rng(8)
    om = 0.7 * rng.normal(size=(3, 2, 2))
    V = np.diag([0.7, 0.5])
    ref = one(PATTERNS, om[:, 1:2, :], V[1:, 1:])
    errs = []
    for c in (1e3, 1e5):
        out = load(c).denoiser()(PATTERNS, om, V)
        e = max(np.max(np.abs(out.g_out[:, 1, :] - ref.g_out[:, 0, :])),
                np.max(np.abs(out.dg_out[:, 1, :, 1, :] - ref.dg_out[:, 0, :, 0, :])),
                np.max(np.abs(out.log_z_out - ref.log_z_out)))
        errs.append(e)
        # with diagonal V the first layer's index keeps its prior: g_out = 0, dg_out = -1/V_00
        assert np.max(np.abs(out.g_out[:, 0, :])) < 10 / c
    assert errs[1] < 1e-5 and 50 < errs[0] / errs[1] < 200  # converges like 1/c (measured 0.55 / c)


@pytest.mark.slow
def test_hardmax_first_layer_too():
    """Both layers hardmax: M_1(u) is piecewise constant and switches exactly on the rule's sector
    lines. Sum to one and Monte Carlo of the link (compiles a module for this spec: slow)."""
    m = aimsym.load(S.make_attention(tokens=2, layers=2, activation="hardmax", skip=0.5, name="hm_both"))
    assert m.derivation.reduction.kind == "hardmax-wedge-mixed"
    den = m.denoiser()
    om = np.array([[0.3, -0.6], [0.5, 0.1]])
    V = np.array([[0.8, -0.2], [-0.2, 0.6]])
    out = den(PATTERNS, om, V)
    assert abs(np.exp(out.log_z_out).sum() - 1) < 1e-10
    rng = np.random.default_rng(10)
    n = 400_000
    Z = om[None] + np.einsum("ij,njt->nit", np.linalg.cholesky(V), rng.standard_normal((n, 2, 2)))
    Y = m.link(Z)
    for k in range(3):
        ind = np.all(Y == PATTERNS[k], axis=(1, 2))
        p = ind.mean()
        assert abs(np.exp(out.log_z_out[k]) - p) < 5 * np.sqrt(p * (1 - p) / n)
        mean, se = Z[ind].mean(axis=0), Z[ind].std(axis=0) / np.sqrt(ind.sum())
        assert np.all(np.abs(om + V @ out.g_out[k] - mean) < 5 * se)


def test_error_estimate_and_refinement():
    m = load(1.0)
    rng = np.random.default_rng(9)
    _, y = m.sample(4, rng)
    om = 0.6 * rng.normal(size=(4, 2, 2))
    V = np.array([[0.6, 0.1], [0.1, 0.9]])
    ref = m.denoiser(polar=(32, 80))(y, om, V)
    coarse = m.denoiser()(y, om, V, tol=1e-3)
    actual = np.abs(coarse.g_out - ref.g_out).reshape(4, -1).max(axis=1)
    assert np.all(coarse.error >= actual) and np.all(coarse.error > 0) and np.all(coarse.error <= 1e-3)
    refined = m.denoiser()(y, om, V, tol=1e-7)
    assert np.all(refined.error <= 1e-7)
    assert np.max(np.abs(refined.g_out - ref.g_out)) < 1e-7
    # error=True without a tol: the adaptive rule at ERROR_TOL
    assert np.all(m.denoiser()(y, om, V, error=True).error <= ERROR_TOL)


def test_fejer_rule_is_nested_and_exact():
    x, w = fejer2(15)
    xc, wc = fejer2(7)
    assert np.allclose(x[1::2], xc, atol=1e-15, rtol=0)
    for x_, w_, n in ((x, w, 15), (xc, wc, 7)):
        for d in range(n):  # exact for polynomials of degree n - 1
            assert abs(w_ @ x_**d - (2 / (d + 1) if d % 2 == 0 else 0.0)) < 1e-14


def test_a_coarse_wedge_rule_is_refined_until_its_part_of_the_estimate_is_small():
    """With the last layer nearly known the inner (wedge) rule sets the estimate: 5 nodes are
    refined (x1.5 per level) until the estimate meets tol, and the result matches a fine rule."""
    m = load(1.0)
    y, om, V = _regime("ridge2", 3, 11)
    out = HardmaxMixedDenoiser(m, wedge=5, tol=1e-5)(y, om, V)
    ref = HardmaxMixedDenoiser(m, wedge=16, tol=1e-7, max_regions=3000)(y, om, V)
    assert np.all(out.error <= 1e-5)
    act = difference(out.g_out, out.dg_out, ref.g_out, ref.dg_out, out.log_z_out, ref.log_z_out)
    assert np.all(act <= out.error), (act, out.error)


def test_robust_inputs_and_clear_errors():
    m = load(1.0)
    den = m.denoiser()
    y = PATTERNS[2]
    out = den(y, np.full((2, 2), 20.0) * np.array([[1, -1], [-1, 1]]), np.eye(2))
    assert np.all(np.isfinite(out.g_out)) and np.isfinite(out.log_z_out)
    # nearly known indices (|omega| = 12, V = 1e-3 I): the three outputs still sum to one
    out = den(PATTERNS, np.array([[4.0, -7.0], [12.0, -9.0]]), 1e-3 * np.eye(2))
    assert np.all(np.isfinite(out.dg_out)) and abs(np.exp(out.log_z_out).sum() - 1) < 1e-9
    for bad, fld in [
        ((np.array([[0.5, 0.5], [0.0, 1.0]]), np.zeros((2, 2)), np.eye(2)), "y"),
        ((np.array([[1.0, 0.0], [np.nan, 1.0]]), np.zeros((2, 2)), np.eye(2)), "y"),
        ((y, np.zeros((3, 2)), np.eye(2)), "omega"),
        ((y, np.full((2, 2), np.inf), np.eye(2)), "omega"),
        ((y, np.zeros((2, 2)), np.array([[1.0, 2.0], [2.0, 1.0]])), "V"),
    ]:
        with pytest.raises(ChannelError) as err:
            den(*bad)
        assert err.value.field == fld and "\n" not in str(err.value)
    for kw, fld in [({"polar": (1, 5)}, "polar"), ({"wedge": 1}, "wedge"), ({"polar": "fast"}, "polar")]:
        with pytest.raises(ChannelError) as err:
            m.denoiser(**kw)
        assert err.value.field == fld
    with pytest.raises(ChannelError) as err:
        den(y, np.zeros((2, 2)), np.eye(2), tol=-1.0)
    assert err.value.field == "tol"


# ----------------------------------------------------------------------------- error estimate


def _regime(kind, n, seed):
    """(y, omega, V) at n points: SE points (V = v I), one layer nearly known (ridge1: V_00 in
    1e-4..1e-2; ridge2: V_11 in 1e-4..1e-2), far tails (tail); the benchmark's points."""
    return regime_points(kind, n, seed)[1:]


def _actual_and_estimate(kind, n, seed, tol=1e-4):
    """The adaptive rule at tol against itself at tol / 1000 with 16 wedge nodes: (actual error,
    estimate, the reference's estimate)."""
    m = load()
    y, om, V = _regime(kind, n, seed)
    out = m.denoiser()(y, om, V, tol=tol)
    ref = HardmaxMixedDenoiser(m, wedge=16, tol=tol / 1000, max_regions=3000)(y, om, V)
    act = difference(out.g_out, out.dg_out, ref.g_out, ref.dg_out, out.log_z_out, ref.log_z_out)
    return act, out.error, ref.error


@pytest.mark.parametrize("kind", ["se", "ridge1", "ridge2"])
def test_error_estimate_covers_the_actual_error(kind):
    """The adaptive rule's estimate covers its actual error at every point: SE points, the
    first layer nearly known, and the last layer nearly known (where P(y | u) has steps of width
    ~sqrt(V_11) in u that a fixed rule misses)."""
    actual, est, ref_est = _actual_and_estimate(kind, 4, 3)
    assert np.all(ref_est <= 1e-7)
    assert np.all(actual <= est), np.max(actual / est)
    assert np.all(est <= 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["se", "ridge1", "ridge2", "tail"])
def test_error_estimate_is_honest_over_many_points(kind):
    # (a reference sample may stop at its budget, with its own estimate: counted against it)
    actual, est, ref_est = _actual_and_estimate(kind, 100, 4)
    assert np.mean(ref_est <= 1e-6) >= 0.95
    assert np.mean(actual <= est + ref_est) >= 0.99, np.sort(actual / est)[-8:]
