"""SMI mapping: the derived link equals a plain forward pass of the network; Jacobian,
symmetries and exact reduction hold numerically. Architectures drawn by hypothesis."""

import numpy as np
import pytest
import sympy as sp
from forward import draw_weights, forward, indices, last_h
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aimsym.derive import spec as S
from aimsym.derive.symbolic import derive


@st.composite
def architectures(draw, max_tokens=4, max_layers=3):
    T = draw(st.integers(1, max_tokens))
    L = draw(st.integers(1, max_layers))
    ranks = draw(st.lists(st.integers(1, 2), min_size=L, max_size=L))
    heads = draw(st.lists(st.integers(1, 2), min_size=L, max_size=L))
    if sum(r * h for r, h in zip(ranks, heads)) > 5:  # keep SymPy's trees small
        ranks, heads = [1] * L, [1] * L
    acts = draw(st.lists(st.sampled_from(S.ACTIVATIONS), min_size=L, max_size=L))
    if T == 1:  # a softmax/hardmax over one token is constant: such specs are refused
        acts = ["linear"] * L
    skip = draw(st.lists(st.floats(0.3, 2.0), min_size=L, max_size=L))
    beta = draw(st.lists(st.floats(0.3, 1.5), min_size=L, max_size=L))
    tied = draw(st.lists(st.booleans(), min_size=L, max_size=L))
    return S.make_attention(
        tokens=T, layers=L, rank=ranks, heads=heads, activation=acts, skip=skip, beta=beta,
        tied=tied, output=draw(st.sampled_from(S.OUTPUTS)), head_mode=draw(st.sampled_from(S.HEAD_MODES)),
    )


def _relclose(a, b, tol):
    scale = max(1.0, float(np.max(np.abs(b))))
    return float(np.max(np.abs(a - b))) <= tol * scale


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=architectures(), seed=st.integers(0, 2**32 - 1))
def test_link_equals_forward_pass(spec, seed):
    rng = np.random.default_rng(seed)
    d = 64
    x = rng.standard_normal((d, spec.tokens))
    weights = draw_weights(spec, d, rng)
    Z = indices(spec, x, weights)
    d_ = derive(spec)
    assert Z.shape == (d_.p, d_.tokens)
    y_net = forward(spec, x, weights)
    y_smi = d_.numeric_link(Z)
    assert _relclose(y_smi, y_net, 1e-10), np.max(np.abs(y_smi - y_net))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=architectures(max_tokens=3), seed=st.integers(0, 2**32 - 1))
def test_declared_symmetries_hold(spec, seed):
    rng = np.random.default_rng(seed)
    d_ = derive(spec)
    f = d_.numeric_link
    # every tied layer's index enters through z z^T: its flip must have been detected
    for l, layer in enumerate(spec.layers, start=1):
        names = {s["name"] for s in d_.symmetries}
        assert f"layer {l}: z_{l} -> -z_{l}" in names
    for sym in d_.symmetries:
        for _ in range(3):
            Z = rng.standard_normal((d_.p, d_.tokens))
            Zf = Z.copy()
            Zf[sym["rows"]] *= -1
            assert np.allclose(f(Zf), f(Z), rtol=1e-12, atol=1e-12)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=architectures(max_tokens=3), seed=st.integers(0, 2**32 - 1))
def test_jacobian_matches_finite_differences(spec, seed):
    if any(layer.activation == "hardmax" for layer in spec.layers):
        spec = S.make_attention(tokens=spec.tokens, layers=len(spec.layers), activation="softmax",
                                rank=[ly.rank for ly in spec.layers], heads=[ly.heads for ly in spec.layers],
                                tied=[ly.tied for ly in spec.layers], output=spec.output)
    rng = np.random.default_rng(seed)
    d_ = derive(spec)
    Z = rng.standard_normal((d_.p, d_.tokens))
    Jv = d_.numeric_jacobian(Z)
    eps = 1e-6
    for k in range(d_.p):
        for t in range(d_.tokens):
            Zp, Zm = Z.copy(), Z.copy()
            Zp[k, t] += eps
            Zm[k, t] -= eps
            fd = (d_.numeric_link(Zp) - d_.numeric_link(Zm)) / (2 * eps)
            assert _relclose(Jv[..., k, t], fd, 1e-6)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(2, 4), L=st.integers(1, 3), act=st.sampled_from(["softmax", "linear"]),
       skip=st.floats(0.5, 2.0), beta=st.floats(0.5, 1.5), seed=st.integers(0, 2**32 - 1))
def test_reduction_reconstructs_h_and_last_index(T, L, act, skip, beta, seed, h_from_y):
    spec = S.make_attention(tokens=T, layers=L, activation=act, skip=skip, beta=beta)
    d_ = derive(spec)
    red = d_.reduction
    assert red is not None and red.integral_dim == (d_.p - 1) * T
    rng = np.random.default_rng(seed)
    Z = rng.standard_normal((d_.p, T))
    y = d_.numeric_link(Z)
    h = np.empty(T)
    status = h_from_y[act](y, beta, h)
    assert status == 0
    h_true = last_h(spec, Z)
    sign = np.sign(h @ h_true)
    assert np.allclose(sign * h, h_true, rtol=1e-9, atol=1e-9)
    # the branch with the right sign returns z_L from u = earlier indices
    vals = {d_.Z[k, t]: sp.Float(Z[k, t]) for k, t in red.free}
    vals.update({s: sp.Float(sign * hv) for s, hv in zip(red.obs, h)})
    for sym, e in d_.program.closure(red.branches[0]):  # evaluate the program numerically
        vals[sym] = sp.Float(float(e.xreplace(vals)))
    zl = np.array([float(e.xreplace(vals)) for e in red.branches[0]])
    assert np.allclose(zl, Z[-1], rtol=1e-9, atol=1e-9)


@pytest.fixture(scope="module")
def h_from_y():
    """The generated inverse output maps (softmax / linear last layer)."""
    import aimsym

    out = {"softmax": aimsym.load(S.make_attention(tokens=2, name="h_softmax")).kernels.h_from_y,
           "linear": aimsym.load(S.make_attention(tokens=2, activation="linear", name="h_linear")).kernels.h_from_y}
    return out


def test_reduction_reported_when_absent():
    for kw, word in [({"output": "tokens"}, "tokens"), ({"rank": 2}, "rank"), ({"heads": 2}, "heads"),
                     # (an untied softmax last layer has the generalised reduction,
                     # tests/test_reduction_untied.py; an untied linear one does not)
                     ({"tied": False, "activation": "linear"}, "untied"),
                     # (a tied rank-one first layer before a hardmax last layer is a region reduction,
                     # tests/test_hardmax_mixed.py; an untied one is not)
                     ({"activation": "hardmax", "tied": [False, True]}, "hardmax")]:
        d_ = derive(S.make_attention(tokens=2, layers=2, **kw))
        assert d_.reduction is None and word in d_.reduction_reason


def test_free_form_reductions():
    pr = derive(S.make_smi(indices=1, tokens=1, link="abs(z[0, 0])"))
    assert pr.reduction.integral_dim == 0 and len(pr.reduction.branches) == 2
    prod = derive(S.make_smi(indices=2, tokens=1, link="z[0, 0] * z[1, 0]"))
    assert prod.reduction.integral_dim == 1
    sign = derive(S.make_smi(indices=1, tokens=1, link="sign(z[0, 0])"))
    assert sign.reduction.kind == "halfspace" and "half-space" in sign.reduction_reason
    step = derive(S.make_smi(indices=2, tokens=1, link="heaviside(z[0, 0] + z[1, 0])"))
    assert step.reduction is None and "piecewise" in step.reduction_reason


# ----------------------------------------------------------------------------- large-depth limit


def _flow_reference(x, W, beta, tau, output):
    """Network form of the large-depth limit, integrated by scipy: dx/dt = x S(x)^T."""
    from scipy.integrate import solve_ivp

    from forward import activation

    d, T = x.shape

    def att(X):
        return activation("softmax", beta * (X.T @ W) @ (W.T @ X) / d)

    sol = solve_ivp(lambda t, v: (v.reshape(d, T) @ att(v.reshape(d, T)).T).ravel(), (0, tau), x.ravel(),
                    rtol=1e-12, atol=1e-12, method="DOP853")
    XL = sol.y[:, -1].reshape(d, T)
    return att(XL) if output == "attention" else np.linalg.lstsq(x, XL, rcond=None)[0].T


@pytest.mark.parametrize("output", ["attention", "tokens"])
def test_shared_flow_link_is_the_ode_flow(output):
    rng = np.random.default_rng(11)
    d, T, beta, tau = 64, 3, 0.8, 1.5
    x = rng.standard_normal((d, T))
    W = rng.standard_normal((d, 1))
    Z = W.T @ x / np.sqrt(d)
    ref = _flow_reference(x, W, beta, tau, output)
    errs = []
    for K in (8, 16, 32):
        spec = S.make_attention(tokens=T, shared_flow=True, tau=tau, depth_steps=K, beta=beta, output=output)
        errs.append(np.max(np.abs(derive(spec).numeric_link(Z) - ref)))
    assert errs[-1] < 1e-6
    assert errs[0] / errs[1] > 8 and errs[1] / errs[2] > 8  # fourth order (ratio 16 asymptotically)


def test_finite_depth_shared_network_approaches_the_flow():
    """L layers with skip c = L / tau, attention rescaled by 1/c, shared weights -> the limit link."""
    from forward import activation

    rng = np.random.default_rng(12)
    d, T, beta, tau = 48, 2, 1.0, 1.0
    x = rng.standard_normal((d, T))
    W = rng.standard_normal((d, 1))
    Z = W.T @ x / np.sqrt(d)
    limit = derive(S.make_attention(tokens=T, shared_flow=True, tau=tau, depth_steps=32)).numeric_link(Z)
    gaps = []
    for L in (100, 400):
        X = x
        for _ in range(L):
            S_ = activation("softmax", beta * (X.T @ W) @ (W.T @ X) / d)
            X = X @ ((L / tau) * np.eye(T) + S_).T / (L / tau)
        gaps.append(np.max(np.abs(activation("softmax", beta * (X.T @ W) @ (W.T @ X) / d) - limit)))
    assert gaps[1] < gaps[0] / 3 and gaps[1] < 1e-2  # O(1/L) convergence to the limit


def test_shared_flow_validation():
    with pytest.raises(S.SpecError) as err:
        S.make_attention(tokens=2, layers=2, shared_flow=True)
    assert err.value.field == "layers"
    with pytest.raises(S.SpecError) as err:
        S.make_attention(tokens=2, shared_flow=True, tau=-1.0)
    assert err.value.field == "tau"
