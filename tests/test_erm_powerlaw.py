"""Generic target laws: free convolution vs the Wishart cubic, limiting cases, the SE with a
power-law target, parameter errors, exponent fits."""

import subprocess
import sys

import numpy as np
import pytest
from scipy.integrate import quad

from aimsym.erm import freeconv as fc
from aimsym.erm.params import ERMParams
from aimsym.erm.prior import integrals as cubic_integrals
from aimsym.erm.prior import prior_step
from aimsym.erm.scaling import fit_exponent
from aimsym.erm.se import Accuracy, fixed_point, output_step
from aimsym.erm.target import WishartLaw, power_law
from aimsym.errors import AimsymError

FAST = Accuracy(gh_nodes=8, gh_final_nodes=10, gh_test_nodes=16, tol=1e-6)


@pytest.mark.parametrize("penalty,kappa0,delta,eps,kappa", [
    ("pnn", 0.5, 0.3, 0.2, None), ("pnn", 0.2, 0.1, 0.05, None), ("pnn", 1.5, 0.7, -0.1, None),
    pytest.param("pnn", 0.5, 0.5, 0.1, 0.3, marks=pytest.mark.slow), ("snn", 0.5, 1.0, 0.5, None), ("snn", 0.3, 0.4, 0.1, None),
    ("pnn", 0.5, 0.4, -10.0, None), ("pnn", 1.0, 0.2, 0.3, None)])
def test_generic_convolution_reproduces_the_wishart_cubic(penalty, kappa0, delta, eps, kappa):
    a = fc.integrals(WishartLaw(kappa0), penalty, delta, eps, kappa, n=96)
    b = cubic_integrals(penalty, kappa0, delta, eps, kappa, n=320)
    for k in ("J", "dJ_ddelta", "dJ_deps", "rank", "threshold"):
        x, y = getattr(a, k), getattr(b, k)
        assert abs(x - y) < 1e-9 * (1 + abs(y)), (k, x, y)


def test_power_law_normalisation_and_moments():
    law = power_law(0.5, 1.5, 30)
    assert abs(law.Q0 - 1.5) < 1e-12
    delta, eps = 0.2, -5.0  # eps below the support: J is a moment of rho_delta
    I = fc.integrals(law, "pnn", delta, eps)
    J = law.Q0 + delta**2 - 2 * eps * law.mean + eps**2
    assert abs(I.J - J) < 1e-9 * J
    assert abs(I.dJ_ddelta - 2 * delta) < 1e-8 and abs(I.rank - 1) < 1e-10


@pytest.mark.parametrize("delta,eps", [(0.05, 0.01), (0.3, 0.4), (0.02, 0.5)])
def test_power_law_derivatives_match_finite_differences(delta, eps):
    law = power_law(0.5, 1.0, 20)
    I = fc.integrals(law, "pnn", delta, eps)
    h = 1e-6 * delta
    dd = (fc.integrals(law, "pnn", delta + h, eps).J - fc.integrals(law, "pnn", delta - h, eps).J) / (2 * h)
    de = (fc.integrals(law, "pnn", delta, eps + h).J - fc.integrals(law, "pnn", delta, eps - h).J) / (2 * h)
    assert abs(I.dJ_ddelta - dd) < 1e-5 * (1 + abs(dd)), (I.dJ_ddelta, dd)
    assert abs(I.dJ_deps - de) < 1e-5 * (1 + abs(de)), (I.dJ_deps, de)


def test_gamma_zero_full_rank_is_a_shifted_semicircle():
    # gamma = 0, kappa0 = 1: S* = c I with c^2 = Q0 = 2, so rho_delta = semicircle(c, radius 2 delta)
    delta, eps = 0.3, 1.5
    law = power_law(1.0, 0.0, 5)
    c = np.sqrt(2.0)
    sc = lambda y: np.sqrt(max(4 * delta**2 - (y - c) ** 2, 0.0)) / (2 * np.pi * delta**2)  # noqa: E731
    J = quad(lambda y: sc(y) * (y - eps) ** 2, eps, c + 2 * delta, epsabs=1e-13)[0]
    rank = quad(sc, eps, c + 2 * delta, epsabs=1e-13)[0]
    I = fc.integrals(law, "pnn", delta, eps)
    assert abs(I.J - J) < 1e-9 and abs(I.rank - rank) < 1e-9
    assert np.allclose(fc.support(law, delta), [[c - 2 * delta, c + 2 * delta]], atol=1e-10)


def test_many_groups_separate_at_small_delta_and_merge_at_large():
    law = power_law(0.5, 1.0, 10)
    assert len(fc.u_intervals(law, 1e-3)) == 11  # every group and the atom at 0 resolved
    assert len(fc.u_intervals(law, 2.0)) == 2  # the top group stays an outlier
    assert len(fc.u_intervals(law, 5.0)) == 1


@pytest.mark.slow  # an 800 x 800 eigendecomposition: seconds to tens of seconds on a busy machine
def test_power_law_convolution_matches_a_sampled_matrix():
    rng = np.random.default_rng(1)
    d, delta, eps = 800, 0.3, 0.1
    law = power_law(0.5, 1.0, 8)
    s = np.repeat(np.array([a for a, _ in law.atoms]), np.round(np.array([p for _, p in law.atoms]) * d).astype(int))
    A = rng.standard_normal((d, d))
    Z = (A + A.T) / np.sqrt(2 * d)
    y = np.linalg.eigvalsh(np.diag(s) + delta * Z)
    I = fc.integrals(law, "pnn", delta, eps)
    J_mc = np.mean(np.maximum(y - eps, 0) ** 2)
    assert abs(I.J - J_mc) < 0.015 * I.J, (I.J, J_mc)
    assert abs(I.rank - np.mean(y > eps)) < 0.015


def test_se_with_power_target_is_a_fixed_point_and_learns():
    p = ERMParams(kappa0=0.5, lam=0.01, Delta=0.5, target="power", gamma=1.0, groups=5)
    fp = fixed_point(p, 1.0, FAST)
    assert fp.converged
    out = output_step(p, 1.0, fp.q, fp.m, fp.Sigma, FAST.rule(2))
    pr = prior_step(p.penalty, float(out["q_hat"][0]), float(out["m_hat"][0]),
                    float(out["Sigma_hat"][0]), p.lam, p.kappa0, law=p.law)
    for new, old in ((pr.q, fp.q), (pr.m, fp.m), (pr.Sigma, fp.Sigma)):
        assert abs(new - old) < 1e-4 * abs(old), (new, old)
    later = fixed_point(p, 4.0, FAST, init=(fp.q, fp.m, fp.Sigma))
    assert later.test < fp.test and later.matrix_error < fp.matrix_error


def test_target_parameter_errors():
    with pytest.raises(AimsymError, match="target"):
        ERMParams(target="zipf")
    with pytest.raises(AimsymError, match="gamma"):
        ERMParams(target="power")
    with pytest.raises(AimsymError, match="gamma"):
        ERMParams(target="power", gamma=-1.0)
    with pytest.raises(AimsymError, match="gamma"):
        ERMParams(gamma=1.0)
    with pytest.raises(AimsymError, match="kappa0"):
        ERMParams(target="power", gamma=1.0, kappa0=1.5)
    with pytest.raises(AimsymError, match="groups"):
        ERMParams(target="power", gamma=1.0, groups=0)
    assert "target" not in ERMParams().asdict()  # wishart hashes unchanged
    r = subprocess.run([sys.executable, "-m", "aimsym.cli", "erm", "se", "--alpha", "0.5",
                        "--target", "power"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "gamma" in r.stderr


def test_fit_exponent_recovers_a_known_slope_and_its_error():
    a = np.geomspace(1, 1000, 13)
    exact = fit_exponent(a, 3 * a**-0.7)
    assert abs(exact.exponent - 0.7) < 1e-12 and exact.stderr < 1e-12 and exact.points == 5
    noisy = fit_exponent(a, 3 * a**-0.7 * np.exp(0.05 * np.sin(7 * np.arange(13))), decades=2)
    assert abs(noisy.exponent - 0.7) < 4 * noisy.stderr + 1e-3 and noisy.stderr > 1e-3


@pytest.mark.slow
def test_fitted_exponent_is_stable_under_grid_refinement():
    from aimsym.erm.scaling import learning_curve
    acc = Accuracy(gh_nodes=10, gh_final_nodes=12, gh_test_nodes=20, tol=1e-6)
    p = ERMParams(kappa0=0.5, lam=0.01, Delta=0.5, target="power", gamma=1.0, groups=20)
    coarse = learning_curve(p, np.geomspace(10, 100, 4), acc)
    fine = learning_curve(p, np.geomspace(10, 100, 7), acc)
    ec, ef = (fit_exponent(c["alpha"], c["excess_test"]) for c in (coarse, fine))
    assert abs(ec.exponent - ef.exponent) < 0.05 + 3 * (ec.stderr + ef.stderr), (ec, ef)
    assert np.all(np.diff(fine["test"]) < 0)


@pytest.mark.slow
def test_cli_powerlaw_figure_quick(tmp_path):
    import json
    out = tmp_path / "pl.png"
    subprocess.run([sys.executable, "-m", "aimsym.cli", "erm", "plot", "powerlaw", "--quick",
                    "--out", str(out)], check=True, capture_output=True, text=True)
    data = json.loads((tmp_path / "pl.json").read_text())
    assert out.stat().st_size > 10_000 and len(data["curves"]) == 6
    for row in data["curves"]:
        assert all(row["converged"]) and np.all(np.diff(row["test"]) < 0)
        e = row["exponent_excess_test"]
        # alpha = 100..1000: parametric rate ~1, except in the sequential-recovery window
        # of the power-law targets with tuned weight decay (measured 0.77, 0.82)
        window = row["target"] == "power" and row["lam_scale"] is not None
        lo, hi = (0.6, 0.9) if window else (0.9, 1.1)
        assert lo < e["exponent"] < hi and e["stderr"] < 0.05, (row["target"], row["gamma"], e)
