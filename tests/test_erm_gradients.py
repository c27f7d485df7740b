"""Analytic derivatives of the ERM code against finite differences."""

import numpy as np
import pytest

from aimsym.erm.geometry import flat, isometric_to_matrix, isometric_to_vector, learned_basis
from aimsym.numerics import softmax_rows
from aimsym.erm.loss import loss, loss_grad_hess
from aimsym.erm.params import ERMParams
from aimsym.erm.prox import _objective, interpolating_point, prox
from aimsym.erm.train import objective_and_grad, sample, teacher


@pytest.mark.parametrize("T", [2, 3, 4])
def test_loss_gradient_and_hessian_match_finite_differences(T):
    rng = np.random.default_rng(T)
    L = T * (T + 1) // 2
    h = rng.normal(size=(6, L))
    Y = softmax_rows(rng.normal(size=(6, T, T)))
    beta = 1.3
    _, g, H = loss_grad_hess(h, Y, beta)
    e = 1e-6
    for k in range(L):
        dk = np.zeros(L)
        dk[k] = e
        gk = (loss(h + dk, Y, beta) - loss(h - dk, Y, beta)) / (2 * e)
        Hk = (loss_grad_hess(h + dk, Y, beta)[1] - loss_grad_hess(h - dk, Y, beta)[1]) / (2 * e)
        np.testing.assert_allclose(g[:, k], gk, atol=1e-7)
        np.testing.assert_allclose(H[:, :, k], Hk, atol=1e-7)


@pytest.mark.parametrize("T", [2, 3])
def test_geometry_flat_direction_and_roundtrip(T):
    rng = np.random.default_rng(0)
    L = T * (T + 1) // 2
    h = rng.normal(size=(4, L))
    np.testing.assert_allclose(isometric_to_vector(isometric_to_matrix(h, T)), h, atol=1e-14)
    Y = softmax_rows(rng.normal(size=(4, T, T)))
    np.testing.assert_allclose(loss(h + 0.9 * flat(T), Y, 1.0), loss(h, Y, 1.0), atol=1e-13)
    B = learned_basis(T)
    np.testing.assert_allclose(B.T @ B, np.eye(L - 1), atol=1e-13)
    np.testing.assert_allclose(B.T @ flat(T), 0.0, atol=1e-13)
    # variance convention: entries of H(h) for h ~ N(0, I): Var H_aa = 2, Var H_ab = 1
    Hs = isometric_to_matrix(rng.normal(size=(200000, L)), T)
    assert abs(Hs[:, 0, 0].var() - 2.0) < 0.03 and abs(Hs[:, 0, 1].var() - 1.0) < 0.02


@pytest.mark.parametrize("T", [2, 3])
def test_prox_is_stationary_and_beats_its_starts(T):
    rng = np.random.default_rng(1)
    L = T * (T + 1) // 2
    z = rng.normal(size=(500, L))
    Y = softmax_rows(isometric_to_matrix(1.5 * rng.normal(size=(500, L)), T))
    Sigma, beta = 3.0, 1.2
    h = prox(z, Y, Sigma, beta)
    g = (h - z) / Sigma + loss_grad_hess(h, Y, beta)[1]
    assert np.abs(g).max() < 1e-7
    f = _objective(h, z, Y, Sigma, beta)
    for start in (z, interpolating_point(z, Y, beta)):
        assert np.all(f <= _objective(start, z, Y, Sigma, beta) + 1e-12)
    np.testing.assert_allclose((h - z) @ flat(T), 0.0, atol=1e-12)


@pytest.mark.parametrize("model,output", [("factorised", "label"), ("direct", "label"),
                                          ("factorised", "sequence"), ("direct", "sequence")])
def test_adam_objective_gradient_matches_finite_differences(model, output):
    rng = np.random.default_rng(2)
    p = ERMParams(tokens=3, kappa0=0.5, lam=0.1, Delta=0.3, beta=1.3, beta0=0.8, model=model,
                  output=output)
    d, r = 8, 4
    data = sample(p, teacher(d, 0.5, rng), 20, rng)
    if model == "factorised":
        th, D = rng.normal(size=(d, r)), rng.normal(size=(d, r))
    else:
        A, D = rng.normal(size=(d, d)), rng.normal(size=(d, d))
        th, D = (A + A.T) / 2, (D + D.T) / 2
    _, g, _, _ = objective_and_grad(th, p, data, r)
    e = 1e-6
    fd = (objective_and_grad(th + e * D, p, data, r)[0] - objective_and_grad(th - e * D, p, data, r)[0]) / (2 * e)
    assert abs(fd - (g * D).sum()) < 1e-6 * (1 + abs(fd))
