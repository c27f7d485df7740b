"""Two-layer AIM: network <-> index mapping, scores, SE limits."""

import numpy as np
import pytest

from aimsym.aim import amp, deep


@pytest.mark.parametrize("skip,beta", [(1.0, 1.0), (0.5, 2.0)])
def test_network_equals_index_link(skip, beta):
    """Forward pass of the two-layer network == softmax(beta M H2 M^T) of the base indices."""
    rng = np.random.default_rng(0)
    d = 30
    S1, _ = amp.teacher(d, 0.5, rng)
    S2, _ = amp.teacher(d, 0.3, rng)
    X = rng.standard_normal((7, d, 2))
    y_net = deep.forward_network(X, S1, S2, skip, beta)
    y_idx = deep.forward_indices(amp.index_matrices(S1, X), amp.index_matrices(S2, X), skip, beta)
    assert np.allclose(y_net, y_idx, atol=1e-12)


def test_L_matrix_reveals_label():
    rng = np.random.default_rng(1)
    H1 = rng.standard_normal((5, 2, 2)); H1 = H1 + np.swapaxes(H1, 1, 2)
    H2 = rng.standard_normal((5, 2, 2)); H2 = H2 + np.swapaxes(H2, 1, 2)
    y = deep.forward_indices(H1, H2, 1.0, 1.5)
    L = deep._L_matrix(deep.mixing(H1, 1.0, 1.5))
    e = np.einsum("nij,nj->ni", L, np.stack([H2[:, 0, 0], H2[:, 0, 1], H2[:, 1, 1]], -1))
    assert np.allclose(deep._reveal(y, 1.5), e, atol=1e-10)


def test_layer2_score_is_derivative():
    ch = deep.TwoLayerChannel(1.0, 1.0, 8)
    rng = np.random.default_rng(2)
    om1, om2, e = rng.standard_normal((4, 3)) * 0.5, rng.standard_normal((4, 3)), rng.standard_normal((4, 2))
    _, _, g2 = ch.scores(e, om1, om2, 0.5, 0.4)
    for k in range(3):
        E = np.zeros(3); E[k] = 1e-6
        fd = (ch.scores(e, om1, om2 + E, 0.5, 0.4)[0] - ch.scores(e, om1, om2 - E, 0.5, 0.4)[0]) / 2e-6
        assert np.allclose(fd, g2[:, k], rtol=1e-6, atol=1e-8)


def test_large_skip_reduces_to_single_layer():
    """c -> infinity: layer 1 is invisible (I_1 -> 0) and layer 2 is the single-layer softmax
    channel, I_2 = (T^2 + T - 2) / V_2 = 4 / V_2."""
    ch = deep.TwoLayerChannel(50.0, 1.0, 6)
    info, sem = deep.information(0.8, 0.9, 0.5, 0.5, ch, n_outer=512, n_scrambles=4)
    assert info[1] == pytest.approx(4 / (1.5 - 0.9), rel=0.01)
    assert abs(info[0]) < 0.02 * info[1]


def test_cross_term_small():
    ch = deep.TwoLayerChannel(1.0, 1.0, 6)
    info, sem = deep.information(0.8, 0.8, 0.5, 0.5, ch, n_outer=512, n_scrambles=4)
    assert abs(info[2]) < 0.05 * min(info[0], info[1])  # justifies one overlap per layer
