"""Small-width (rho -> 0) limit of the AIM state evolution for softmax (and linear) outputs:
the prior-side limit of the RIE mmse, the limiting SE against the finite-rho SE (and the
distance shrinking with rho), the threshold closed form against bisection and against the
finite-rho spectrum, and the command line."""

import json

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from aimsym.aim import se
from aimsym.aim.channels import counting_constant
from aimsym.aim.spectral import rie_mmse, support_edges
from aimsym.cli import main
from aimsym.errors import AimsymError


def _limit_m(t):
    """Prior-side limit: a spike of strength 1 in GOE noise t (BBP at t = 1)."""
    return 1.0 - max(1.0 - t, 0.0) ** 2


@settings(max_examples=25, deadline=None)
@given(st.floats(0.05, 3.0))
@example(2.4322143038585398)  # (a node next to the support edge, where unguarded Newton threw G to Im 2e8)
def test_rie_mmse_small_width_limit(t):
    """m(t / rho, rho) -> 1 - [max(1 - t, 0)]^2, the reduction that gives q = [max(1 - t, 0)]^2,
    and the error shrinks with rho."""
    errs = [abs(rie_mmse(t / rho, rho) - _limit_m(t)) for rho in (1e-3, 1e-5)]
    assert errs[1] < 2e-3
    assert errs[1] < errs[0]


@settings(max_examples=30, deadline=None)
@given(st.floats(0.005, 0.8), st.sampled_from([2, 3]))
def test_limit_equation_is_finite_rho_se_at_small_rho(ab_scaled, T):
    """The closed-form limit against the finite-rho softmax SE at alpha = rho alpha_bar."""
    c = counting_constant(T, "softmax")
    ab = ab_scaled * 4.0 / c  # the same place relative to the thresholds 1/c and 2/c for every T
    lim = se.small_width_se(ab, tokens=T, activation="softmax")
    rho = 1e-5
    fin = se.solve_softmax(ab * rho, rho, T)
    assert fin.mmse == pytest.approx(lim.mmse, abs=2e-3)
    # and the limit satisfies its own equations: q = [max(1 - t, 0)]^2, t = (1 - q) / (c alpha_bar)
    assert lim.q == pytest.approx(max(1.0 - lim.t, 0.0) ** 2, abs=1e-14)
    if lim.q < 1.0:
        assert lim.t == pytest.approx((1.0 - lim.q) / (c * ab), rel=1e-12)
    assert lim.mmse == pytest.approx(float(se.small_width_mmse(ab, T, "softmax")), abs=1e-14)


def test_finite_rho_curves_approach_the_limit():
    """The largest distance over an alpha_bar grid shrinks by a factor > 3 per decade of rho,
    at the rate rho^(2/3) set by the smeared threshold (measured slope 0.6-0.8)."""
    ab = np.linspace(0.01, 0.7, 70)
    rhos = np.array([1e-1, 1e-2, 1e-3, 1e-4])
    sup = np.array([np.max(np.abs(se.small_width_gap(r, ab))) for r in rhos])
    assert np.all(sup[1:] < sup[:-1] / 3.0), sup
    slope = np.polyfit(np.log(rhos[1:]), np.log(sup[1:]), 1)[0]
    assert 0.55 < slope < 0.85, slope
    assert sup[-1] < 5e-3


@settings(max_examples=20, deadline=None)
@given(st.floats(0.02, 0.7).filter(lambda a: abs(a - 0.5) > 0.02), st.sampled_from(["uninformed", "informed"]))
def test_closed_form_is_the_iterated_small_width_se(ab, init):
    """The explicit solution is the attracting fixed point of q -> [max(1 - (1 - q)/(c ab), 0)]^2
    from both starts (away from c ab = 2, where the iteration slows down to sublinear)."""
    cf = se.small_width_se(ab, activation="softmax")
    it = se.small_width_se(ab, activation="softmax", method="iterate", init=init, max_iter=200000, tol=1e-14)
    assert cf.method == "closed_form" and it.method == "iterate" and it.converged
    assert it.mmse == pytest.approx(cf.mmse, abs=1e-8)


@pytest.mark.parametrize("T", [2, 3, 4])
@pytest.mark.parametrize("activation", ["softmax", "linear"])
def test_threshold_closed_form_equals_bisection(T, activation):
    """alpha_bar_c = 1 / c_T against the bisection on the iterated limit SE whose information is
    computed through the link itself (softmax(beta h), recovery, posterior on the shift line)."""
    ab_c = se.small_width_alpha_bar_c(T, activation)
    assert ab_c == pytest.approx(1.0 / (T * T + T - (2 if activation == "softmax" else 0)), rel=1e-15)
    assert se.small_width_alpha_bar_c_numeric(tokens=T, activation=activation) == pytest.approx(ab_c, rel=1e-9)
    below = se.small_width_se(0.999 * ab_c, tokens=T, activation=activation)
    above = se.small_width_se(1.001 * ab_c, tokens=T, activation=activation)
    assert below.q == 0.0 and below.mmse == 1.0 and above.q > 0.0 and above.mmse < 1.0
    # perfect recovery of the limit at 2 / c: the rho -> 0 limit of the counting threshold / rho
    ab_pr = se.small_width_perfect_recovery(T, activation)
    assert ab_pr == pytest.approx(2.0 * ab_c, rel=1e-15)
    assert se.perfect_recovery_counting(1e-9, T, activation) / 1e-9 == pytest.approx(ab_pr, rel=1e-8)
    assert se.small_width_se(ab_pr, tokens=T, activation=activation).mmse == 0.0
    assert se.small_width_se(0.999 * ab_pr, tokens=T, activation=activation).mmse > 0.0


def test_threshold_is_where_the_finite_rho_spike_bulk_detaches():
    """An independent route from the finite-rho spectrum: the noise level t = rho Delta at which the
    bulk of the rho d large eigenvalues merges with the noise bulk (support_edges: two bulks -> one),
    mapped to alpha_bar = m(Delta) / (c rho Delta), tends to 1/c as rho -> 0 (slowly, ~ rho^(1/3))."""
    c = counting_constant(2, "softmax")
    out = []
    for rho in (1e-3, 1e-4, 1e-5):
        def bulks(t):
            return len(support_edges(rho, t / rho))
        lo, hi = 0.05, 3.0
        assert bulks(lo) == 2 and bulks(hi) == 1
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if bulks(mid) == 2 else (lo, mid)
        out.append(rie_mmse(lo / rho, rho) / (c * lo))
    dist = np.array(out) - se.small_width_alpha_bar_c(2, "softmax")
    assert np.all(dist > 0) and np.all(np.diff(dist) < 0), dist
    assert dist[-1] < 0.03


def test_hardmax_small_width_unchanged():
    """The hardmax path (iteration) is what it was: closed form arcsin(1/3), t = 1/(ab I)."""
    r = se.small_width_se(1.0)
    assert r.activation == "hardmax" and r.method == "iterate" and r.converged
    assert se.small_width_alpha_bar_c() == se.small_width_alpha_bar_c(2, "hardmax")
    assert se.small_width_perfect_recovery(2, "hardmax") is None
    with pytest.raises(AimsymError, match="method"):
        se.small_width_se(1.0, method="closed_form")


def test_small_width_bad_input():
    with pytest.raises(AimsymError, match="alpha_bar"):
        se.small_width_se(0.0, activation="softmax")
    with pytest.raises(AimsymError, match="method"):
        se.small_width_se(0.3, activation="softmax", method="root")
    with pytest.raises(AimsymError, match="activation"):
        se.small_width_mmse(0.3, 2, "hardmax")
    with pytest.raises(AimsymError, match="tokens"):
        se.small_width_alpha_bar_c(1, "softmax")


def test_thresholds_report_softmax_weak_recovery():
    t = se.thresholds(3, 0.5, "softmax")
    assert t["weak_recovery"]["alpha_bar"] == pytest.approx(0.1)
    assert t["weak_recovery"]["alpha"] == pytest.approx(0.05)
    assert t["weak_recovery"]["alpha_bar_numeric"] == pytest.approx(0.1, rel=1e-9)


# ----------------------------------------------------------------------------- command line
def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_small_width_softmax(capsys):
    out = _json(capsys, ["aim", "se", "--small-width", "--activation", "softmax", "--alpha", "0.2,0.3,0.6", "--json"])
    assert [r["q"] for r in out] == pytest.approx([0.0, (4 * 0.3 - 1) ** 2, 1.0])
    assert [r["mmse"] for r in out] == pytest.approx([1.0, 1 - (4 * 0.3 - 1) ** 2, 0.0])
    assert all(r["activation"] == "softmax" and r["method"] == "closed_form" and "provenance" in r for r in out)
    out = _json(capsys, ["aim", "se", "--small-width", "--activation", "softmax", "--tokens", "3",
                         "--method", "iterate", "--alpha", "0.15", "--json"])
    assert out["tokens"] == 3 and out["method"] == "iterate"
    assert out["mmse"] == pytest.approx(1 - (10 * 0.15 - 1) ** 2, abs=1e-8)
    assert main(["aim", "se", "--small-width", "--activation", "softmax", "--alpha", "0.3"]) == 0
    text = capsys.readouterr().out.split()
    assert "alpha_bar" in text and "mmse" in text


@pytest.mark.parametrize("argv,field", [
    (["--activation", "relu"], "--activation"),
    (["--activation", "hardmax", "--tokens", "4"], "--tokens"),
    (["--activation", "softmax", "--method", "root"], "--method"),
    (["--activation", "softmax", "--alpha", "0"], "--alpha"),
    (["--activation", "softmax", "--tokens", "1"], "tokens"),
])
def test_cli_small_width_bad_input_exit_2(capsys, argv, field):
    assert main(["aim", "se", "--small-width", "--alpha", "0.3", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"aimsym: error: {field}:") and "Traceback" not in err[0]
