"""Adam at finite size against the asymptotic prediction of theory.md §8."""

import numpy as np
import pytest

from aimsym.erm.params import ERMParams
from aimsym.erm.se import Accuracy, fixed_point
from aimsym.erm.spectrum import ks_distance
from aimsym.erm.train import train

P = ERMParams(tokens=2, kappa0=0.5, lam=0.01, Delta=0.5)


def test_adam_small_d_matches_prediction():
    fp = fixed_point(P, 0.5, Accuracy(gh_nodes=10))
    runs = [train(P, 0.5, 40, seed=s) for s in range(2)]
    test = np.mean([r.test for r in runs])
    train_err = np.mean([r.train for r in runs])
    assert abs(test - fp.test) < 0.1 * fp.test, (test, fp.test)
    assert abs(train_err - fp.train) < 0.35 * fp.train, (train_err, fp.train)
    assert abs(np.mean([r.rank for r in runs]) - fp.rank) < 0.1
    clean = np.mean([r.test_clean for r in runs])
    assert abs(clean - fp.test_clean) < 0.15 * fp.test_clean, (clean, fp.test_clean)
    assert ks_distance(fp, runs[0].eigenvalues) < 0.2


def test_adam_direct_ridge_matches_prediction():
    p = ERMParams(tokens=2, kappa0=0.5, lam=0.01, Delta=0.5, model="direct")
    fp = fixed_point(p, 0.5, Accuracy(gh_nodes=10))
    r = train(p, 0.5, 30, seed=0)
    assert abs(r.test - fp.test) < 0.12 * fp.test, (r.test, fp.test)


def test_adam_seq2seq_close_to_seq2label():
    a = train(P, 0.5, 30, seed=3)
    b = train(ERMParams(**{**P.asdict(), "output": "sequence"}), 0.5, 30, seed=3)
    # same data; the sequence loss differs by X X^T / d = I + O(1/sqrt(d)) fluctuations
    assert abs(a.q - b.q) < 0.1 * a.q and abs(a.m - b.m) < 0.1 * a.m


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [0.1, 0.5, 1.0])
def test_adam_d100_several_seeds_within_standard_errors(alpha):
    fp = fixed_point(P, alpha, Accuracy())
    runs = [train(P, alpha, 100, seed=s) for s in range(4)]
    t = np.array([r.test for r in runs])
    se = t.std(ddof=1) / np.sqrt(t.size)
    # a few standard errors, plus the finite-size test-set noise floor
    assert abs(t.mean() - fp.test) < 4 * se + 0.02 * fp.test, (t, fp.test)


@pytest.mark.slow
def test_adam_d100_spectrum_ks():
    fp = fixed_point(P, 0.5, Accuracy())
    r = train(P, 0.5, 100, seed=0)
    assert ks_distance(fp, r.eigenvalues) < 0.1
