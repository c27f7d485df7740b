"""Gradient-descent baselines: exact gradients, determinism, order of learning."""

import numpy as np
import pytest

import aimsym
from aimsym.smi.data import attention_network, teacher_student
from aimsym.smi.gd import loss_and_grad, run_gd


@pytest.fixture(scope="module")
def l2():
    return aimsym.load("attention_L2_T2", skip=1.0)


def test_gradient_equals_finite_differences_of_network(l2):
    D = teacher_student(l2, 30, alpha=2, seed=0)
    rng = np.random.default_rng(1)
    W = 0.8 * rng.standard_normal((2, 30))
    wd = 0.3
    _, grad = loss_and_grad(l2, W, D.X_rows, D.y, wd)

    def loss(Wv):  # independent path: the network's forward pass on the tokens
        r = attention_network(l2, Wv, D.X_rows) - D.y
        return 0.5 * np.mean(np.sum(r.reshape(D.n, -1) ** 2, 1)) + 0.5 * wd / 30 * np.sum(Wv**2)

    h = 1e-6
    for k, i in [(0, 0), (0, 7), (1, 3), (1, 29)]:
        E = np.zeros_like(W)
        E[k, i] = h
        fd = (loss(W + E) - loss(W - E)) / (2 * h)
        assert fd == pytest.approx(grad[k, i], rel=1e-5, abs=1e-9)


def test_same_seed_identical_different_seeds_differ(l2):
    kw = dict(d=40, alpha=2, epochs=5, optimizer="sgd", batch_size=16)
    a, b = run_gd(l2, seed=3, **kw), run_gd(l2, seed=3, **kw)
    c = run_gd(l2, seed=4, **kw)
    assert np.array_equal(a["overlaps"]["M"], b["overlaps"]["M"])
    assert not np.allclose(a["overlaps"]["M"], c["overlaps"]["M"])


@pytest.mark.parametrize("optimizer,lr,epochs", [("adam", 0.03, 150), ("gd", 0.5, 60)])
def test_last_layer_learned_first(l2, optimizer, lr, epochs):
    res = run_gd(l2, d=100, alpha=8, seed=1, optimizer=optimizer, lr=lr, epochs=epochs)
    ov = res["overlaps"]["layer"]
    t2 = int(np.argmax(ov[:, 1] > 0.8))
    assert ov[t2, 1] > 0.8 and ov[t2, 0] < 0.5
    assert res["train_loss"]["mean"][-1] < 0.5 * res["train_loss"]["mean"][0]


def test_averaged_estimator_not_worse(l2):
    kw = dict(d=60, alpha=4, seed=2, optimizer="adam", lr=0.03, epochs=60)
    one, avg = run_gd(l2, average=1, **kw), run_gd(l2, average=3, **kw)
    assert avg["final"]["test_error"] <= one["final"]["test_error"] * 1.1


@pytest.mark.slow
def test_adam_learns_first_layer_after_last(l2):
    """Per seed: the last layer is learned (overlap > 0.9) before the first layer passes 0.5, and with
    enough samples (alpha = 16) some seeds learn the first layer fully. Other seeds stall with the
    first layer near 0.5 (a local minimum of the square loss; docs/amp.md), so not every seed is asked to."""
    finals = []
    for s in (1, 2, 3):
        res = run_gd(l2, d=100, alpha=16, seeds=1, seed=s, optimizer="adam", lr=0.03, epochs=400)
        ov, e = res["overlaps"]["layer"], np.asarray(res["epochs_logged"])
        t2 = int(np.argmax(ov[:, 1] > 0.9))
        assert ov[t2, 1] > 0.9
        if np.any(ov[:, 0] > 0.5):
            t1 = int(np.argmax(ov[:, 0] > 0.5))
            assert e[t2] < e[t1], (s, e[t2], e[t1])
        finals.append(ov[-1])
    finals = np.array(finals)
    assert np.all(finals[:, 1] > 0.99), finals
    assert np.max(finals[:, 0]) > 0.99, finals
