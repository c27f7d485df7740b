"""Plain numpy forward pass of a deep attention network (theory section 2), written
independently of aimsym's symbolic link, for the SMI-mapping tests."""

import numpy as np


def activation(name, A):
    if name == "softmax":
        A = A - A.max(axis=-1, keepdims=True)
        E = np.exp(A)
        return E / E.sum(axis=-1, keepdims=True)
    if name == "hardmax":
        out = np.zeros_like(A)
        out[np.arange(A.shape[0]), A.argmax(axis=-1)] = 1.0
        return out
    return A


def draw_weights(spec, d, rng):
    """weights[l][h] = (W_Q, W_K), each (d_h, r_l); tied layers share one matrix."""
    out = []
    for layer in spec.layers:
        dh = d // layer.heads if spec.head_mode == "split" else d
        heads = []
        for _ in range(layer.heads):
            WQ = rng.standard_normal((dh, layer.rank))
            WK = WQ if layer.tied else rng.standard_normal((dh, layer.rank))
            heads.append((WQ, WK))
        out.append(heads)
    return out


def _chunk(spec, layer, h, d):
    if spec.head_mode != "split":
        return slice(0, d), d
    dh = d // layer.heads
    return slice(h * dh, (h + 1) * dh), dh


def forward(spec, x, weights):
    """Network output for tokens x (d, T): the last attention matrix or M_L (from x^(L))."""
    d, T = x.shape
    xl = x
    last = None
    for layer, heads in zip(spec.layers, weights):
        S = np.zeros((T, T))
        for h, ((WQ, WK), a) in enumerate(zip(heads, layer.head_weights())):
            sl, dh = _chunk(spec, layer, h, d)
            xs = xl[sl]
            logits = layer.beta * (xs.T @ WQ) @ (WK.T @ xs) / dh
            S += a * activation(layer.activation, logits)
        xl = xl @ (layer.skip * np.eye(T) + S).T
        last = S
    if spec.output == "attention":
        return last
    # x^(L) = x M_L^T: recover M_L by least squares (x has full column rank for d >= T)
    return np.linalg.lstsq(x, xl, rcond=None)[0].T


def indices(spec, x, weights):
    """Z stacked in aimsym's row layout: per layer, per head, (W) or (W_Q, W_K) columns."""
    d = x.shape[0]
    rows = []
    for layer, heads in zip(spec.layers, weights):
        for h, (WQ, WK) in enumerate(heads):
            sl, dh = _chunk(spec, layer, h, d)
            rows.append(WQ.T @ x[sl] / np.sqrt(dh))
            if not layer.tied:
                rows.append(WK.T @ x[sl] / np.sqrt(dh))
    return np.concatenate(rows, axis=0)


def last_h(spec, Z):
    """h = M_{L-1} z_L^T computed by the forward recursion on the indices (rank-one last layer)."""
    T = Z.shape[1]
    M = np.eye(T)
    k = 0
    for layer in spec.layers[:-1]:
        S = np.zeros((T, T))
        for a in layer.head_weights():
            zq = Z[k:k + layer.rank]
            k += layer.rank
            zk = zq
            if not layer.tied:
                zk = Z[k:k + layer.rank]
                k += layer.rank
            S += a * activation(layer.activation, layer.beta * (M @ zq.T) @ (M @ zk.T).T)
        M = (layer.skip * np.eye(T) + S) @ M
    return M @ Z[-1]
