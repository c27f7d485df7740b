"""Spectral prior of the AIM: cubic roots, density, edges, RIE mmse and map (theory.md section 7)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aimsym.aim.spectral import (
    _integral_mu_cubed,
    _panels_cached,
    density,
    prior_density,
    rie_map,
    rie_mmse,
    rie_mmse_inverse,
    stieltjes,
    support_edges,
)
from aimsym.errors import AimsymError

CASES = [(0.5, 0.01), (0.5, 0.05), (0.5, 0.3), (0.1, 0.02), (0.9, 1e-4), (1.0, 0.01), (2.0, 0.5), (0.3, 1e-5)]


def _moments(rho, Delta, n=64):
    """integral x^k mu(x) dx for k = 0, 1, 2, cos substitution on the graded panels."""
    t, w = np.polynomial.legendre.leggauss(n)
    th, wt = 0.5 * np.pi * (t + 1), 0.5 * np.pi * w
    out = np.zeros(3)
    for cuts in _panels_cached(float(rho), float(Delta)):
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            x = 0.5 * (lo + hi) + 0.5 * (hi - lo) * np.cos(th)
            mu = density(x, rho, Delta)
            jac = 0.5 * (hi - lo) * np.sin(th)
            out += [np.sum(wt * jac * mu * x**k) for k in range(3)]
    return out


@pytest.mark.parametrize("rho,Delta", CASES)
def test_cubic_root_and_moments(rho, Delta):
    """G solves the cubic; the density has mass 1, mean sqrt(rho), second moment Q0 + Delta."""
    x = np.linspace(-1, 5, 301)
    G = stieltjes(x, rho, Delta)
    s = np.sqrt(rho)
    res = Delta * G**3 - (x + s * Delta) * G**2 + (s * x + 1 - rho) * G - s
    assert np.max(np.abs(res)) < 1e-9
    assert np.all(np.imag(G) >= 0)
    m0, m1, m2 = _moments(rho, Delta)
    assert m0 == pytest.approx(1.0, abs=1e-9)
    assert m1 == pytest.approx(np.sqrt(rho), abs=1e-9)
    assert m2 == pytest.approx(1 + rho + Delta, abs=1e-8)


@settings(max_examples=15, deadline=None)
@given(rho=st.floats(0.05, 3.0), Delta=st.floats(1e-3, 3.0), re=st.floats(-3, 6), im=st.floats(0.3, 3))
def test_herglotz_branch_complex(rho, Delta, re, im):
    """Away from the axis G(z) must equal the Stieltjes integral of the density (Herglotz branch)."""
    z = np.array([re - 1j * im])
    G = stieltjes(z, rho, Delta)[0]
    t, w = np.polynomial.legendre.leggauss(256)  # the pole at z is within 0.3 of the support
    th, wt = 0.5 * np.pi * (t + 1), 0.5 * np.pi * w
    ref = 0j
    for cuts in _panels_cached(float(rho), float(Delta)):
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            x = 0.5 * (lo + hi) + 0.5 * (hi - lo) * np.cos(th)
            ref += np.sum(wt * 0.5 * (hi - lo) * np.sin(th) * density(x, rho, Delta) / (z[0] - x))
    assert abs(G - ref) < 1e-6 * (1 + abs(ref))  # a wrong branch is off by O(1)
    assert np.imag(stieltjes(np.conj(z), rho, Delta)[0]) < 0


@pytest.mark.parametrize("rho,Delta", CASES)
def test_edges_are_where_density_vanishes(rho, Delta):
    edges = support_edges(rho, Delta)
    width = edges.max() - edges.min()
    for lo, hi in edges:
        inside = np.linspace(lo, hi, 50)[1:-1]
        assert np.all(density(inside, rho, Delta) > 0)
        out = np.array([lo - 1e-6 * width, hi + 1e-6 * width])
        assert np.all(density(out, rho, Delta) < 1e-2 * density(inside, rho, Delta).max())
    if len(edges) == 2:  # gap between the bulks is empty
        gap = np.linspace(edges[0, 1], edges[1, 0], 7)[1:-1]
        assert np.all(density(gap, rho, Delta) < 1e-12)


def test_two_bulks_only_below_merging():
    assert len(support_edges(0.5, 0.01)) == 2
    assert len(support_edges(0.5, 0.3)) == 1
    assert len(support_edges(2.0, 0.01)) == 1  # rho >= 1: no atom, one bulk


def test_no_atom_for_rho_at_least_one():
    """Delta = 0: the continuous part has mass 1 for rho >= 1 and rho (atom 1 - rho at 0) below."""
    for rho, mass in [(0.4, 0.4), (0.8, 0.8), (1.5, 1.0), (3.0, 1.0)]:
        lo, hi = support_edges(rho, 0.0)[0]
        t, w = np.polynomial.legendre.leggauss(400)
        th, wt = 0.5 * np.pi * (t + 1), 0.5 * np.pi * w
        x = 0.5 * (lo + hi) + 0.5 * (hi - lo) * np.cos(th)
        val = np.sum(wt * 0.5 * (hi - lo) * np.sin(th) * prior_density(x, rho))
        assert val == pytest.approx(mass, abs=1e-6)


@pytest.mark.parametrize("rho,Delta", CASES + [(0.5, 3.0), (0.5, 0.04), (1.0, 1e-4), (0.01, 1e-3)])
def test_rie_mmse_quadrature_converged(rho, Delta):
    """The default fixed rule agrees with 8x the nodes to ~1e-12 relative."""
    m = rie_mmse(Delta, rho)
    ref = Delta - (4 * np.pi**2 / 3) * Delta**2 * _integral_mu_cubed(rho, Delta, 8 * 48)
    assert abs(m - ref) <= 2e-12 * Delta + 1e-14


def test_rie_mmse_limits_and_monotone():
    for rho in (0.2, 0.5, 0.9, 2.0):
        slope0 = 2 * rho - rho**2 if rho <= 1 else 1.0
        assert rie_mmse(1e-7, rho) / 1e-7 == pytest.approx(slope0, rel=1e-5)
        assert rie_mmse(1e4, rho) == pytest.approx(1.0, abs=1e-3)
        D = np.geomspace(1e-4, 1e2, 40)
        m = rie_mmse(D, rho)
        assert np.all(np.diff(m) > 0) and np.all(np.diff(m / D) < 0) and np.all(m < D)
    assert rie_mmse_inverse(rie_mmse(0.37, 0.5), 0.5) == pytest.approx(0.37, rel=1e-9)


def test_bad_input_names_field():
    with pytest.raises(AimsymError, match="rho"):
        density([0.0], -1.0, 0.1)
    with pytest.raises(AimsymError, match="Delta"):
        rie_map([0.0], 0.5, -0.1)


@pytest.fixture(scope="module")
def sampled():
    """One sampled problem, d = 2000: S (rho = 0.5) + sqrt(Delta) GOE, Delta = 0.05."""
    rng = np.random.default_rng(2024)
    d, rho, Delta = 1500, 0.5, 0.05
    r = int(rho * d)
    W = rng.standard_normal((d, r))
    S = W @ W.T / np.sqrt(r * d)
    A = rng.standard_normal((d, d))
    Y = S + np.sqrt(Delta) * (A + A.T) / np.sqrt(2 * d)
    lam, O = np.linalg.eigh(Y)
    return d, rho, Delta, S, lam, O


def test_sampled_spectrum_matches_density(sampled):
    d, rho, Delta, S, lam, O = sampled
    edges = support_edges(rho, Delta)
    # empirical CDF vs predicted CDF (Kolmogorov distance ~ 1/d)
    x = np.sort(lam)
    grid = np.linspace(edges.min(), edges.max(), 4001)
    cdf = np.concatenate([[0], np.cumsum(0.5 * (density(grid[1:], rho, Delta) + density(grid[:-1], rho, Delta)) * np.diff(grid))])
    emp = np.searchsorted(x, grid) / d
    assert np.max(np.abs(emp - cdf)) < 5e-3
    # extreme eigenvalues at the predicted edges (Tracy-Widom scale ~ d^(-2/3))
    assert abs(x[0] - edges.min()) < 0.03 and abs(x[-1] - edges.max()) < 0.15


def test_sampled_rie_error_matches_mmse(sampled):
    d, rho, Delta, S, lam, O = sampled
    S_hat = (O * rie_map(lam, rho, Delta)) @ O.T
    err = np.sum((S_hat - S) ** 2) / d
    assert err == pytest.approx(rie_mmse(Delta, rho), abs=3e-4)
    # and the RIE beats the naive estimator Y (error Delta)
    assert err < 0.8 * Delta


@pytest.mark.slow
@pytest.mark.parametrize("rho,Delta", [(0.2, 0.01), (1.5, 0.3), (0.5, 0.5)])
def test_sampled_rie_error_large(rho, Delta):
    rng = np.random.default_rng(7)
    d = 3000
    r = int(rho * d)
    W = rng.standard_normal((d, r))
    S = W @ W.T / np.sqrt(r * d)
    A = rng.standard_normal((d, d))
    lam, O = np.linalg.eigh(S + np.sqrt(Delta) * (A + A.T) / np.sqrt(2 * d))
    err = np.sum(((O * rie_map(lam, rho, Delta)) @ O.T - S) ** 2) / d
    # finite-d fluctuations of the error grow with Delta (measured 3e-4 at Delta = 0.5, d = 3000)
    assert err == pytest.approx(rie_mmse(Delta, rho), rel=2e-3)
