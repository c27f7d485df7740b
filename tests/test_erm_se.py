"""Asymptotic fixed point of theory.md §8: trivial limits, equivalent forms, rules, CLI."""

import json
import subprocess
import sys

import numpy as np
import pytest

from aimsym.numerics import softmax_rows
from aimsym.erm.params import ERMParams
from aimsym.erm.quadrature import gauss_hermite
from aimsym.erm.se import Accuracy, fields, fixed_point, labels, output_step
from aimsym.erm.prox import prox
from aimsym.erm.loss import loss_grad_hess
from aimsym.erm.train import sample, teacher
from aimsym.errors import AimsymError

FAST = Accuracy(gh_nodes=8, gh_test_nodes=24, tol=1e-5)


def _zero_predictor_error(params, n=400000, seed=0):
    """Monte Carlo over sampled data (train.sample): E||Y - 1/T||^2, with its standard error."""
    rng = np.random.default_rng(seed)
    d = 60
    data = sample(params, teacher(d, params.kappa0, rng), 4000, rng)
    e = ((data.Y - 1.0 / params.tokens) ** 2).sum((-1, -2))
    return e.mean(), e.std() / np.sqrt(e.size)


@pytest.mark.parametrize("limit", ["large_lambda", "small_alpha"])
def test_trivial_limits_give_the_zero_predictor(limit):
    lam, alpha = (50.0, 0.5) if limit == "large_lambda" else (0.01, 1e-5)
    p = ERMParams(tokens=2, kappa0=0.5, lam=lam, Delta=0.5)
    fp = fixed_point(p, alpha, FAST)
    assert fp.q == 0.0 and fp.m == 0.0 and fp.rank == 0.0
    assert abs(fp.train - fp.test) < 1e-3  # nothing learned: train = test = zero predictor
    mc, se = _zero_predictor_error(p)
    assert abs(fp.test - mc) < 4 * se + 2e-3, (fp.test, mc, se)


def test_error_decreases_with_alpha_and_lambda_continuity():
    p = ERMParams(tokens=2, kappa0=0.5, lam=0.01, Delta=0.5)
    small, large = fixed_point(p, 0.05, FAST), fixed_point(p, 0.5, FAST)
    assert small.converged and large.converged
    assert large.test < small.test and large.matrix_error < small.matrix_error
    assert 0 < small.rank < large.rank < 1


def test_conjugates_stein_form_equals_derivative_form():
    # Sigma_hat = -2 alpha E[f.(Q0 z - m z*)]/(Q0 q - m^2) must equal 2 alpha E Tr[(1 + Sigma H)^-1 H]
    # when the prox is smooth (the integration by parts behind the §8 formulas)
    p = ERMParams(tokens=2, kappa0=0.5, lam=0.01, Delta=0.5)
    rule = Accuracy(rule_kind="rqmc", qmc_log2=13).rule(2)
    q, m, Sigma, alpha = 1.2, 1.0, 2.0, 0.3
    stein = output_step(p, alpha, q, m, Sigma, rule)
    ystar, z, zstar, a, b = fields(p, q, m, rule)
    zf = z.reshape(-1, 3)
    Y = labels(p, ystar).reshape(-1, 2, 2)
    h = prox(zf, Y, Sigma, p.beta)
    H = loss_grad_hess(h, Y, p.beta)[2]
    tr = np.trace(np.linalg.solve(np.eye(3) + Sigma * H, H), axis1=1, axis2=2)
    direct = 2 * alpha * (tr.reshape(rule.g.shape[0], -1) @ rule.w)
    assert abs(stein["Sigma_hat"][0] - direct.mean()) < 5 * stein["Sigma_hat"][1] + 1e-3 * direct.mean()


def test_gauss_hermite_and_rqmc_agree():
    p = ERMParams(tokens=2, kappa0=0.5, lam=0.01, Delta=0.5)
    gh = output_step(p, 0.3, 1.2, 1.0, 2.0, Accuracy().rule(2, "prox"), with_test=True)
    qm = output_step(p, 0.3, 1.2, 1.0, 2.0, Accuracy(rule_kind="rqmc", qmc_log2=11).rule(2), with_test=True)
    for k in ("q_hat", "m_hat", "Sigma_hat", "test", "train"):
        assert abs(gh[k][0] - qm[k][0]) < 5 * qm[k][1] + 3e-3 * abs(gh[k][0]), k


def test_seq2seq_and_seq2label_same_asymptotics():
    acc = Accuracy(gh_nodes=6, gh_final_nodes=8, gh_test_nodes=12, tol=1e-4)
    a = fixed_point(ERMParams(tokens=2, kappa0=0.5, lam=0.01, Delta=0.5, output="label"), 0.2, acc)
    b = fixed_point(ERMParams(tokens=2, kappa0=0.5, lam=0.01, Delta=0.5, output="sequence"), 0.2, acc)
    assert a.test == b.test and a.q == b.q


def test_three_tokens_rqmc_fixed_point_runs():
    p = ERMParams(tokens=3, kappa0=0.5, lam=0.05, Delta=0.2)
    fp = fixed_point(p, 0.1, Accuracy(qmc_log2=9, qmc_replicates=4, tol=1e-4))
    assert fp.converged and 0 < fp.rank < 1 and fp.stderr["test"] < 0.01


def test_bad_input_is_one_line_error():
    with pytest.raises(AimsymError, match="kappa0"):
        ERMParams(kappa0=-1)
    with pytest.raises(AimsymError, match="penalty"):
        ERMParams(model="factorised", penalty="ridge")
    r = subprocess.run([sys.executable, "-m", "aimsym.cli", "erm", "se", "--alpha", "0.05",
                        "--model", "nope"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "model" in r.stderr


def test_cli_se_json_single_and_grid():
    cmd = [sys.executable, "-m", "aimsym.cli", "erm", "se", "--tokens", "2", "--kappa0", "0.5",
           "--lam", "0.01", "--noise", "0.5", "--gh-nodes", "6", "--json"]
    one = json.loads(subprocess.run(cmd + ["--alpha", "0.05"], capture_output=True, text=True,
                                    check=True).stdout)
    for k in ("alpha", "q", "m", "test", "train", "rank", "provenance"):
        assert k in one
    grid = json.loads(subprocess.run(cmd + ["--alpha", "0.05:0.1:0.05"], capture_output=True,
                                     text=True, check=True).stdout)
    assert [g["alpha"] for g in grid] == [0.05, 0.1]
