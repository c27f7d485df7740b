"""The one-layer hardmax denoiser (attention_hardmax_L1_T2, kind hardmax-wedge): its error
estimate is honest and meets tol over 1000 random points in each regime (SE points, one
nearly known z with V down to 1e-8, far tails where y is improbable under omega, V), against
the same integrand on 96 angle nodes per graded piece (converged to rounding: 23 nodes already
agree to 1e-12)."""

import warnings

import numpy as np
import pytest

import aimsym
from aimsym.denoise.hardmax_channel import one_layer_wedges, output_mask, wedge_patterns
from aimsym.denoise.output import difference
from aimsym.derive.files import derivations_dir


def _points(kind, n, rng):
    if kind == "se":  # omega ~ N(0, q), z | omega ~ N(omega, 1 - q)
        q = rng.uniform(0.01, 0.99, n)
        v = 1 - q
        om = np.sqrt(q)[:, None] * rng.standard_normal((n, 2))
        z = om + np.sqrt(v)[:, None] * rng.standard_normal((n, 2))
    elif kind == "ridge":  # z nearly known
        v = 10 ** rng.uniform(-8, -2, n)
        om = rng.standard_normal((n, 2))
        z = om + np.sqrt(v)[:, None] * rng.standard_normal((n, 2))
    else:  # far tails: y drawn independently of omega
        v = 10 ** rng.uniform(-3, 0, n)
        om = 5 * rng.standard_normal((n, 2))
        z = rng.standard_normal((n, 2))
    return z, om, v


@pytest.mark.parametrize("kind", ["se", "ridge", "tail"])
def test_error_estimate_is_honest_and_meets_tol(kind):
    m = aimsym.load(derivations_dir() / "attention_hardmax_L1_T2.toml")
    den = m.denoiser()
    assert den.tol == 1e-8
    z, om, v = _points(kind, 1000, np.random.default_rng({"se": 0, "ridge": 1, "tail": 2}[kind]))
    y = np.asarray(m.link(z[:, None, :]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (no sample may miss tol)
        out = den(y, om[:, None, :], v[:, None, None], error=True)
    g, dg, lz = one_layer_wedges(m.kernels, output_mask(y, wedge_patterns(1.0)), om, v, 96)
    actual = difference(out.g_out[:, 0], out.dg_out[:, 0, :, 0, :], g, dg, out.log_z_out, lz,
                        np.maximum(1.0, v**-0.5), np.maximum(1.0, 1.0 / v))
    assert np.all(np.isfinite(out.error)) and np.all(out.error <= den.tol)
    assert np.mean(actual <= out.error) >= 0.99, np.sort(actual / out.error)[-12:]
    assert actual.max() <= den.tol


def test_tol_refines_a_coarse_rule(monkeypatch):
    """Started at 4 angle nodes per piece, the far-tail points miss 1e-8; with max_refine=0 the
    estimate says so (and warns), and the default loop refines them to within tol."""
    import aimsym.denoise.channel as channel

    m = aimsym.load(derivations_dir() / "attention_hardmax_L1_T2.toml")
    z, om, v = _points("tail", 200, np.random.default_rng(5))
    y = np.asarray(m.link(z[:, None, :]))
    _, _, lz = one_layer_wedges(m.kernels, output_mask(y, wedge_patterns(1.0)), om, v, 96)
    monkeypatch.setattr(channel, "DEFAULT_WEDGE", 4)
    den = m.denoiser()
    with pytest.warns(RuntimeWarning, match="did not reach tol"):
        coarse = den(y, om[:, None, :], v[:, None, None], max_refine=0)
    assert np.max(np.abs(coarse.log_z_out - lz)) > 1e-8
    bad = np.abs(coarse.log_z_out - lz) > 1e-8
    assert np.all(coarse.error[bad] >= np.abs(coarse.log_z_out - lz)[bad])
    out = den(y, om[:, None, :], v[:, None, None])
    assert np.all(out.error <= 1e-8) and np.max(np.abs(out.log_z_out - lz)) < 1e-8


def test_negative_beta_wedges_give_the_link_probabilities(tmp_path):
    """A declared one-layer hardmax model with beta = -2 (the sign decides which wedge gives which
    output; the reduction used to drop beta and refused the model's own outputs): the three output
    probabilities sum to one at random omega, V, and match a Monte Carlo of the link."""
    text = (derivations_dir() / "attention_hardmax_L1_T2.toml").read_text().replace("beta = 1.0", "beta = -2.0")
    assert "beta = -2.0" in text
    (tmp_path / "hm_neg.toml").write_text(text)
    m = aimsym.load(tmp_path / "hm_neg.toml")
    assert float(m.kernels.last_beta(m.params_array())) == -2.0
    from aimsym.smi import outputs

    Y = outputs.output_set(m)
    den = m.denoiser()
    rng = np.random.default_rng(3)
    om = 2 * rng.standard_normal((200, 1, 2))
    v = rng.uniform(0.05, 1.0, 200)[:, None, None]
    total = sum(np.exp(den(np.broadcast_to(y, (200,) + y.shape).copy(), om, v).log_z_out) for y in Y)
    assert np.allclose(total, 1.0, atol=1e-10)
    om1, v1, n = np.array([[0.4, -0.3]]), 0.5, 400_000
    y_mc = np.asarray(m.link(om1 + np.sqrt(v1) * rng.standard_normal((n, 1, 2)))).reshape(n, -1)
    for y in Y:
        p_mc = np.mean(np.all(y_mc == y.reshape(-1), axis=1))
        p = np.exp(den(y[None], om1[None], v1 * np.eye(1)).log_z_out[0])
        assert abs(p - p_mc) < 4 * np.sqrt(p * (1 - p) / n), (y, p, p_mc)


def test_a_sample_held_above_tol_by_rounding_alone_is_not_refined(monkeypatch):
    """v = 1e-6 and an output ~1500 sd away from omega (log Z ~ -1e6): the rounding term of the
    estimate (64 eps |log Z|) is above 1e-8 while the rule's part is below it, so refining cannot
    help: the sample keeps its rule (one main and one check pass), and the warning says so."""
    m = aimsym.load(derivations_dir() / "attention_hardmax_L1_T2.toml")
    den = m.denoiser()
    calls = []
    kernel = m.kernels.hm_one_layer_batch

    def counted(*args):
        calls.append(len(args[0]))
        return kernel(*args)

    monkeypatch.setattr(m.kernels, "hm_one_layer_batch", counted)
    y = np.array([[0.0, 1.0], [0.0, 1.0]])
    with pytest.warns(RuntimeWarning, match="did not reach tol"):
        out = den(y, np.array([[1.5, -1.0]]), np.array([[1e-6]]))
    # the rounding term: 64 eps v |g_out|^2, v |g_out|^2 = (1500 sd)^2
    assert out.log_z_out < -1e6 and 1e-8 < out.error <= 64 * np.finfo(float).eps * 2.3e6
    assert len(calls) == 2, calls
