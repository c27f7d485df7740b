"""Teacher-student data: shapes, seeding, chunk independence, forward pass == SMI link."""

import numpy as np
import pytest

import aimsym
from aimsym.smi.data import attention_network, teacher_student


@pytest.fixture(scope="module")
def l2():
    return aimsym.load("attention_L2_T2", skip=1.0)


def test_shapes_and_link(l2):
    D = teacher_student(l2, 64, alpha=1.5, seed=0)
    assert D.X.shape == (96, 64, 2) and D.W_star.shape == (2, 64) and D.y.shape == (96, 2, 2)
    Z = np.einsum("kd,ndt->nkt", D.W_star, D.X) / np.sqrt(64)
    assert np.allclose(Z, D.Z) and np.allclose(l2.link(Z), D.y)


def test_same_seed_identical_different_independent(l2):
    a = teacher_student(l2, 50, alpha=2, seed=1)
    b = teacher_student(l2, 50, alpha=2, seed=1, chunk=1)
    c = teacher_student(l2, 50, alpha=2, seed=2)
    assert np.array_equal(a.X_rows, b.X_rows) and np.array_equal(a.y, b.y)
    r = np.corrcoef(a.X_rows.ravel(), c.X_rows.ravel())[0, 1]
    assert abs(r) < 5 / np.sqrt(a.X_rows.size)
    assert abs(np.corrcoef(a.W_star.ravel(), c.W_star.ravel())[0, 1]) < 5 / np.sqrt(a.W_star.size)


def test_noise_variance():
    model = aimsym.load("gaussian_channel", Delta=0.5)
    D = teacher_student(model, 100, n=20000, seed=3)
    resid = (D.y - model.link(D.Z)).ravel()
    assert abs(resid.var() - 0.5) < 5 * 0.5 * np.sqrt(2 / resid.size)


def test_requires_seed(l2):
    with pytest.raises(aimsym.AimsymError):
        teacher_student(l2, 10, alpha=1, seed=None)


@pytest.mark.parametrize("name", ["attention_L1_T2", "attention_L2_T2", "attention_L2_T2_untied",
                                  "attention_L2_T2_heads2", "attention_L2_T3",
                                  "attention_L3_T2"])
def test_network_forward_equals_link(name):
    spec_params = aimsym.load(name).spec.parameters()
    model = aimsym.load(name, **{k: 0.7 for k in spec_params})
    D = teacher_student(model, 80, alpha=0.5, seed=4)
    assert np.allclose(attention_network(model, D.W_star, D.X_rows), D.y, atol=1e-12)
