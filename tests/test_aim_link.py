"""AIM output link through the symbolic pipeline (aimsym.aim.link): generated link and
Jacobian against the hand-written channels and finite differences, counting constants derived
from the generated Jacobian against the closed forms T^2 + T - 2 (softmax) and T^2 + T (linear).

Kernels are generated into $AIMSYM_CACHE and cached by numba: one module per (T, activation),
beta is a run-time parameter. T = 5 (the slowest kernels to compile) is in the slow test.
"""

import numpy as np
import pytest
import sympy as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from aimsym.derive import setups
from aimsym.derive import spec as S
from aimsym.aim.channels import (
    Hardmax3Channel,
    HardmaxChannel,
    LinearChannel,
    SoftmaxChannel,
    entry_weights,
    pairs,
    to_matrix,
    to_vector,
)
from aimsym.aim.link import (
    aim_link,
    aim_link_spec,
    counting_constant_from_link,
    identifiable_subspace,
    unique_index,
)
from aimsym.errors import AimsymError, SpecError
from aimsym.derive.symbolic import derive, softmax_rows

BETAS = (0.3, 1.0, 4.0)


def _h(rng, T, n, scale=1.0):
    """n draws of the unique entries from the channel law (V = scale^2)."""
    return scale * rng.standard_normal((n, len(pairs(T)))) * np.sqrt(entry_weights(T))


# ----------------------------------------------------------------------------- the link


@settings(max_examples=25, deadline=None)
@given(T=st.integers(2, 4), beta=st.sampled_from(BETAS + (2.5,)), seed=st.integers(0, 2**32 - 1),
       scale=st.floats(0.1, 3.0))
def test_softmax_link_equals_channel_forward(T, beta, seed, scale):
    h = _h(np.random.default_rng(seed), T, 7, scale)
    y = aim_link(T, "softmax", beta).link(h)
    ref = SoftmaxChannel(T, beta).sample(to_matrix(h, T))
    assert y.shape == (7, T, T)
    assert np.max(np.abs(y - ref)) < 1e-12
    assert np.allclose(y.sum(-1), 1.0, atol=1e-12)


@pytest.mark.parametrize("T", [2, 3, 4])
def test_linear_link_is_beta_h(T):
    h = _h(np.random.default_rng(T), T, 5)
    assert np.max(np.abs(aim_link(T, "linear", 1.0).link(h) - to_matrix(h, T))) < 1e-12
    # the channel's own forward (unique entries) at beta = 1, and beta scales it
    assert np.max(np.abs(to_vector(aim_link(T, "linear", 1.0).link(h), T) - LinearChannel(T).sample(to_matrix(h, T)))) < 1e-12
    assert np.allclose(aim_link(T, "linear", 2.5).link(h), 2.5 * to_matrix(h, T), rtol=0, atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(T=st.integers(2, 3), beta=st.sampled_from(BETAS), seed=st.integers(0, 2**32 - 1))
def test_hardmax_link_is_row_argmax(T, beta, seed):
    H = to_matrix(_h(np.random.default_rng(seed), T, 9), T)
    y = aim_link(T, "hardmax", beta).link(to_vector(H, T))
    onehot = np.eye(T)[np.argmax(H, axis=-1)]
    assert np.array_equal(y, onehot)
    # the channels' own data: argmax rows (T = 3), the two signs (T = 2)
    if T == 3:
        assert np.array_equal(np.argmax(y, -1), Hardmax3Channel().sample(H))
    else:
        s = HardmaxChannel().sample(H)
        assert np.array_equal(np.where(y[:, 0, 0] == 1, 1.0, -1.0), s[:, 0])
        assert np.array_equal(np.where(y[:, 1, 1] == 1, 1.0, -1.0), s[:, 1])


@settings(max_examples=15, deadline=None)
@given(T=st.integers(2, 4), beta=st.sampled_from(BETAS), act=st.sampled_from(["softmax", "linear"]),
       seed=st.integers(0, 2**32 - 1))
def test_jacobian_equals_finite_differences(T, beta, act, seed):
    lk = aim_link(T, act, beta)
    h = _h(np.random.default_rng(seed), T, 1)[0]
    J = lk.jacobian(h)
    L = len(h)
    eps = 1e-6
    fd = np.stack([(lk.link(h + eps * e) - lk.link(h - eps * e)) / (2 * eps) for e in np.eye(L)], axis=-1)
    assert J.shape == (T, T, L)
    assert np.max(np.abs(J - fd)) < 1e-7 * max(1.0, beta)
    # batch shape: (..., L) -> (..., T, T, L), each slice the single-point Jacobian
    hb = np.stack([h, 2 * h, -h]).reshape(3, 1, L)
    Jb = lk.jacobian(hb)
    assert Jb.shape == (3, 1, T, T, L)
    assert np.allclose(Jb[0, 0], J, rtol=0, atol=1e-15)


def test_link_is_built_by_the_symbolic_softmax_and_runs_from_the_cache():
    """The derived link is softmax_rows(beta H) of aimsym.symbolic itself (the row-activation
    hook of SMISpec), and the kernels are a generated module keyed by the spec hash."""
    T = 3
    spec = aim_link_spec(T, "softmax")
    d = derive(spec)
    K = unique_index(T)
    beta = sp.Symbol("beta", real=True)
    H = sp.Matrix(T, T, lambda a, b: sp.Symbol(f"z_{K[a, b]}_0", real=True))
    assert d.link == softmax_rows(beta * H)
    mod = aim_link(T, "softmax").kernels
    assert mod.SPEC_HASH == spec.hash() and mod.PARAM_NAMES == ("beta",)
    assert mod.LINK_SHAPE == (T, T) and mod.P == len(pairs(T))


# ----------------------------------------------------------------------------- counting constants


@pytest.mark.parametrize("T", [2, 3, 4])
@pytest.mark.parametrize("beta", BETAS)
def test_counting_constants_derived_from_the_link(T, beta):
    assert counting_constant_from_link(T, "softmax", beta) == pytest.approx(T * T + T - 2, abs=1e-9)
    assert counting_constant_from_link(T, "linear", beta) == pytest.approx(T * T + T, abs=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("T", [2, 3, 4, 5])
def test_counting_constants_up_to_five_tokens(T):
    for beta in BETAS:
        for seed in (0, 1):
            assert counting_constant_from_link(T, "softmax", beta, seed=seed) == pytest.approx(T * T + T - 2, abs=1e-9)
            assert counting_constant_from_link(T, "linear", beta, seed=seed) == pytest.approx(T * T + T, abs=1e-9)


@pytest.mark.parametrize("T", [2, 4])
def test_softmax_null_space_is_the_global_shift_with_a_clear_rank_gap(T):
    sub = identifiable_subspace(T, "softmax", 4.0)
    L = len(pairs(T))
    assert sub.rank == L - 1 and sub.null_space.shape == (L, 1)
    n = sub.null_space[:, 0]
    assert np.allclose(np.abs(n), 1 / np.sqrt(L), atol=1e-12) and abs(n.sum()) > 0.99 * np.sqrt(L)
    s = sub.singular_values
    assert s[sub.rank - 1] > 1e-2 and s[sub.rank] < 1e-14  # kept vs discarded, tol 1e-8
    # c = 2 tr P = 2 rank J (P is an idempotent, W^-1-self-adjoint projector)
    W = np.diag(entry_weights(T))
    P = sub.projector
    assert np.allclose(P @ P, P, atol=1e-13)
    assert np.allclose(P.T @ np.linalg.inv(W), np.linalg.inv(W) @ P, atol=1e-13)
    assert sub.constant == pytest.approx(2 * sub.rank, abs=1e-12)


@settings(max_examples=15, deadline=None)
@given(T=st.integers(2, 4), beta=st.sampled_from(BETAS), V=st.floats(0.05, 3.0), seed=st.integers(0, 2**32 - 1))
def test_projector_score_equals_softmax_channel_denoiser(T, beta, V, seed):
    """The posterior used in the derivation is the channel's: g = W^-1 P xi / V equals
    SoftmaxChannel.denoise(softmax(beta (omega + xi)), omega, V)."""
    rng = np.random.default_rng(seed)
    W = entry_weights(T)
    omega = _h(rng, T, 4)
    xi = _h(rng, T, 4, np.sqrt(V))
    P = identifiable_subspace(T, "softmax", beta).projector
    g_proj = (xi @ P.T) / (W * V)
    ch = SoftmaxChannel(T, beta)
    g_ch, _ = ch.denoise(ch.sample(to_matrix(omega + xi, T)), omega, V)
    assert np.allclose(g_proj, g_ch, rtol=1e-7, atol=1e-7 / V)


def test_hardmax_has_no_counting_constant():
    with pytest.raises(AimsymError) as err:
        counting_constant_from_link(2, "hardmax")
    assert err.value.field == "activation" and "rank 0" in str(err.value)


# ----------------------------------------------------------------------------- errors and the spec hook


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: aim_link(6, "softmax"), "tokens"),
        (lambda: aim_link(1, "softmax"), "tokens"),
        (lambda: aim_link(2.0, "softmax"), "tokens"),
        (lambda: aim_link(2, "relu"), "activation"),
        (lambda: aim_link(2, "softmax", beta=0.0), "beta"),
        (lambda: aim_link(2, "softmax", beta=float("nan")), "beta"),
        (lambda: aim_link(2, "softmax", beta="x"), "beta"),
        (lambda: aim_link(2, "softmax").link(np.zeros(4)), "h_unique"),
        (lambda: aim_link(2, "softmax").jacobian(np.array([0.0, np.inf, 1.0])), "h_unique"),
        (lambda: counting_constant_from_link(3, "softmax", points=0), "points"),
        (lambda: counting_constant_from_link(3, "softmax", rtol=0.5), "rtol"),
    ],
)
def test_bad_input_names_the_field(call, field):
    with pytest.raises(AimsymError) as err:
        call()
    assert err.value.field == field
    assert "\n" not in str(err.value)


def test_smi_row_activation_hook_roundtrips_and_keeps_old_hashes():
    spec = aim_link_spec(2, "softmax")
    assert S.loads(S.to_toml(spec)) == spec
    assert 'activation = "softmax"' in S.to_toml(spec)
    plain = S.make_smi(indices=2, tokens=1, link=[["z[0]", "z[1]"]])
    assert "activation" not in S.canonical(plain) and "activation" not in S.to_toml(plain)
    assert S.canonical(spec)["activation"] == "softmax"
    with pytest.raises(SpecError) as err:
        S.make_smi(indices=2, tokens=1, link=["z[0]", "z[1]"], activation="softmax")
    assert err.value.field == "activation"
    with pytest.raises(SpecError) as err:
        S.loads('[model]\nkind = "smi"\nindices = 1\ntokens = 1\nlink = [["z[0]"]]\nactivation = "gelu"\n')
    assert err.value.field == "activation"


def test_bundled_smi_models_keep_their_committed_hashes(derivations):
    """Adding the row activation to SMISpec leaves every earlier SMI spec's hash unchanged."""
    root = derivations.parent
    checked = 0
    for f in sorted(derivations.glob("*.toml")):
        if setups.kind_of(f) != "smi":
            continue
        spec = S.load(f)
        head = (root / "generated" / f"{spec.name}.py").read_text()[:4096]
        assert f"SPEC_HASH = {spec.hash()!r}" in head, f.name
        checked += 1
    assert checked >= 3
