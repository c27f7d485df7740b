"""Large-depth limit with separate weights per layer (aimsym.derive.depth, kind =
"attention_depth_limit"): the mean-field mixing, the O(1/L) approach of the finite-L network,
the generated link, and the limit's learning problem (docs/models.md, "Large-depth limit")."""

import numpy as np
import pytest
from forward import activation
from hypothesis import given, settings
from hypothesis import strategies as st

import aimsym
from aimsym.derive import depth
from aimsym.derive import spec as S
from aimsym.derive.symbolic import derive
from aimsym.studies.depth_limit import convergence


def _line_slope(L, y):
    return np.polyfit(np.log(L), np.log(y), 1)[0]


@pytest.mark.parametrize("T", [2, 3])
def test_polar_rule_integrates_gaussian_moments(T):
    rule = depth.Rule.make(T, depth.ANGLES[T] // 4)
    w = rule.direction_weights[:, None] * rule.radial_weights[None, :]
    u, r2 = rule.directions, rule.r2
    assert abs(w.sum() - 1) < 1e-13
    second = np.einsum("dr,r,da,db->ab", w, r2, u, u)
    assert np.abs(second - np.eye(T)).max() < 1e-13  # E[z z^T] = I
    assert abs(np.einsum("dr,r->", w, r2 ** 2) - T * (T + 2)) < 1e-11  # E|z|^4


@settings(max_examples=6, deadline=None)
@given(beta=st.floats(0.2, 2.0), frac=st.floats(0.05, 0.9), T=st.sampled_from([2, 3]))
def test_linear_attention_flow_closed_form(beta, frac, T):
    """Linear attention: Sbar(M) = beta M M^T, so M(t) = (1 - 2 beta t)^{-1/2} I."""
    tau = frac / (2 * beta)
    M = depth.mean_field_mixing(tau, beta, T, "linear").matrix
    assert np.abs(M - np.eye(T) / np.sqrt(1 - 2 * beta * tau)).max() < 1e-9 * np.abs(M).max()


@pytest.mark.parametrize("T,tau,beta", [(2, 1.0, 1.0), (2, 0.4, 2.0), (3, 0.7, 1.0)])
def test_mean_field_mixing_is_token_symmetric_and_its_error_estimate_holds(T, tau, beta):
    mf = depth.mean_field_mixing(tau, beta, T)
    M = mf.matrix
    P = np.roll(np.eye(T), 1, axis=0)
    assert np.abs(P @ M @ P.T - M).max() <= mf.error  # the flow commutes with token permutations
    if T == 2:  # the estimate (difference to half the angles) bounds the error of the rule
        finer = depth._flow(tau, beta, T, "softmax", depth.Rule.make(T, 2 * depth.ANGLES[T]))
        assert np.abs(M - finer).max() <= mf.error
    assert mf.error < (1e-7 if T == 2 else 1e-4)


def test_small_tau_is_one_step_of_the_mean_attention():
    """Mbar(tau) = I + tau Sbar(I) + O(tau^2)."""
    T, beta = 2, 1.3
    rule = depth.Rule.make(T, depth.ANGLES[T])
    s0 = depth.mean_attention(np.eye(T), beta, "softmax", rule)
    gaps = [np.abs((depth.mean_field_mixing(t, beta, T).matrix - np.eye(T)) / t - s0).max() for t in (0.02, 0.01)]
    assert 1.8 < gaps[0] / gaps[1] < 2.2  # linear in tau


def test_index_recursion_is_the_network_with_separate_weights():
    """The finite-L recursion on indices == a plain forward pass of L layers with their own
    weights, skip c = L / tau and each layer divided by c."""
    rng = np.random.default_rng(5)
    d, T, L, tau, beta = 400, 2, 6, 1.2, 0.9
    x = rng.standard_normal((d, T))
    W = rng.standard_normal((d, L))
    c = L / tau
    X = x
    for l in range(L):
        Sl = activation("softmax", beta * (X.T @ W[:, l:l + 1]) @ (W[:, l:l + 1].T @ X) / d)
        X = X @ (c * np.eye(T) + Sl).T / c
    y_net = Sl
    Z = (W.T @ x / np.sqrt(d))  # (L, T)
    M = depth.finite_depth_mixing(Z[None, :-1], tau, beta)
    y = depth.attention_output(M, Z[None, -1], beta)[0]
    assert np.abs(y - y_net).max() < 1e-12


def test_declared_finite_depth_model_is_the_recursion():
    """A declared L-layer model (skip 1, attention weighted tau / L) has the recursion's link."""
    L, tau, beta = 3, 0.9, 1.1
    spec = S.make_attention(tokens=2, layers=L, skip=1.0, beta=beta, readout=[[tau / L]] * (L - 1) + [[1.0]])
    rng = np.random.default_rng(6)
    Z = rng.standard_normal((5, L, 2))
    link = np.stack([derive(spec).numeric_link(z) for z in Z])
    M = depth.finite_depth_mixing(Z[:, :-1], tau, beta)
    assert np.abs(link - depth.attention_output(M, Z[:, -1], beta)).max() < 1e-12


def test_generated_link_is_the_limit_network():
    model = aimsym.load("attention_depth_limit_T2")
    mf = depth.mean_field_mixing(1.0, 1.0, 2)
    Z = np.random.default_rng(7).standard_normal((50, 1, 2))
    assert np.abs(model.link(Z) - depth.attention_output(mf.matrix, Z[:, 0], 1.0)).max() < 1e-6


def test_finite_depth_approaches_the_limit_as_one_over_L():
    """The first layers' mixing M_{L-1} -> Mbar(tau): its mean with a bias O(1/L), and the
    output's mean square distance to the limit link O(1/L) (the O(1/sqrt(L)) fluctuations: the
    committee of the first layers). Common random numbers across L; slopes from three depths."""
    tau, beta, T, n = 1.0, 1.0, 2, 120_000
    Mbar = depth.mean_field_mixing(tau, beta, T).matrix
    Ls = np.array([8, 16, 32])
    bias, msq, bias_se = [], [], []
    for L in Ls:
        rng = np.random.default_rng(100 + L)
        M = depth.finite_depth_mixing(rng.standard_normal((n, L - 1, T)), tau, beta)
        diff = M - Mbar
        bias.append(np.abs(diff.mean(axis=0)).max())
        bias_se.append((diff.std(axis=0) / np.sqrt(n)).max())
        z = rng.standard_normal((n, T))
        dy = depth.attention_output(M, z, beta) - depth.attention_output(Mbar, z, beta)
        msq.append((dy[:, 0, 0] ** 2).mean())
    assert max(b / s for b, s in zip(bias, bias_se)) > 10  # the bias is resolved at every L
    assert -1.2 < _line_slope(Ls, bias) < -0.8
    assert -1.15 < _line_slope(Ls, msq) < -0.85


def test_first_layers_sensitivity_is_order_one_over_L():
    """d y / d z_l = O(1/L) for a first layer l: its Fisher information per sample is O(1/L^2),
    so at alpha = O(1) the first layers stay unlearnable and only the last layer's overlap
    remains in the limit (docs/models.md)."""
    tau, beta, T, n, eps = 1.0, 1.0, 2, 8000, 1e-5
    sens = []
    Ls = np.array([32, 64, 128])  # L^2 x sensitivity settles from L ~ 32 (0.10, 0.15, 0.19 at 8, 16, 32)
    for L in Ls:
        rng = np.random.default_rng(L)
        zf, zl = rng.standard_normal((n, L - 1, T)), rng.standard_normal((n, T))
        l = (L - 1) // 2
        up, dn = zf.copy(), zf.copy()
        up[:, l, 0] += eps
        dn[:, l, 0] -= eps
        dy = (depth.attention_output(depth.finite_depth_mixing(up, tau, beta), zl, beta)
              - depth.attention_output(depth.finite_depth_mixing(dn, tau, beta), zl, beta)) / (2 * eps)
        sens.append((dy ** 2).sum(axis=(1, 2)).mean())
    assert -2.3 < _line_slope(Ls, sens) < -1.7


def test_noiseless_limit_learns_its_last_layer_like_one_attention_layer():
    """y <-> +-z is a bijection for both the limit (z = Mbar^{-1} h) and one attention layer, so
    their posteriors, g_out and state evolutions coincide (whatever tau)."""
    from aimsym.smi.se import state_evolution

    limit = aimsym.load("attention_depth_limit_T2")
    one = aimsym.load("attention_L1_T2", beta=1.0)
    a = state_evolution(limit, 0.6, samples=512, replicas=4, seed=3)
    b = state_evolution(one, 0.6, samples=512, replicas=4, seed=3)
    assert np.abs(np.asarray(a.Q) - np.asarray(b.Q)).max() < 1e-9


def test_depth_limit_declaration_errors():
    with pytest.raises(S.SpecError) as err:
        S.loads('[model]\nkind = "attention"\ntokens = 2\ndepth_limit = true\n')
    assert err.value.field == "depth_limit" and "shared_flow" in str(err.value)
    bad = [('tau = "tau"', "tau"), ('tau = 1.0\nactivation = "hardmax"', "activation"),
           ("tau = 1.0\ntokens = 4", "tokens"), ("tau = 1.0\nlayers = 2", "layers"), ("", "tau"),
           ('tau = 0.6\nactivation = "linear"', "tau")]
    for extra, field in bad:
        text = '[model]\nkind = "attention_depth_limit"\n' + ("" if "tokens" in extra else "tokens = 2\n") + extra + "\n"
        with pytest.raises(S.SpecError) as err:
            S.loads(text)
        assert err.value.field == field, (extra, err.value)


def test_depth_limit_toml_round_trip():
    spec = S.load(__import__("aimsym.derive.files", fromlist=["resolve"]).resolve("attention_depth_limit_T2"))
    assert spec.depth_limit_tau == 1.0 and S.loads(S.to_toml(spec)).hash() == spec.hash()


def test_state_evolution_of_finite_depth_approaches_the_limit():
    """SE level: Qhat(q) of the last layer with the first layers uninformed (marginalised by
    Monte Carlo over their prior) -> the limit's Qhat as O(1/L)."""
    out = convergence(depths=(8, 16, 32), samples=2000, se_samples=20_000, draws=512, seed=1)
    vals = np.array([r["q_hat_difference_times_L"][0] for r in out["rows"]])
    ses = np.array([r["q_hat_difference_times_L"][1] for r in out["rows"]])
    assert np.all(vals + 3 * ses < 0)  # the first layers' uncertainty costs information
    assert np.ptp(vals) < 3 * np.sqrt((ses ** 2).sum()) + 0.1  # L x difference is constant in L


@pytest.mark.parametrize("kind_keys", ['kind = "attention_depth_limit"\ntau = 0.5', 'kind = "attention"\nlayers = 1'])
def test_output_noise_takes_the_noisy_channel(kind_keys):
    """With output noise y is not a softmax: no exact reduction; the generic path integrates the
    noisy channel, and its denoiser runs on noisy samples (it used to refuse them)."""
    spec = S.loads(f"[model]\n{kind_keys}\ntokens = 2\nnoise = \"Delta\"\n")
    assert derive(spec).reduction is None and "noisy" in derive(spec).reduction_reason
    model = aimsym.load(spec, Delta=0.1)
    Z, y = model.sample(64, np.random.default_rng(0))
    out = model.denoiser()(y, 0.5 * Z, 0.75 * np.eye(1))
    assert np.all(np.isfinite(out.g_out)) and np.all(np.isfinite(out.dg_out))
