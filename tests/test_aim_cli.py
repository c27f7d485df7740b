"""``aimsym aim ...`` command line."""

import json

import pytest

from aimsym.cli.aim import parse_grid
from aimsym.cli import main


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_se_single(capsys):
    out = _json(capsys, ["aim", "se", "--tokens", "2", "--rho", "0.5", "--activation", "softmax",
                         "--alpha", "0.1", "--json"])
    assert {"alpha", "q", "mmse", "provenance"} <= set(out)
    assert out["mmse"] == pytest.approx(out["rho"] + 1 - out["q"])
    assert "versions" in out["provenance"]


def test_se_grid_and_perfect_recovery_null(capsys):
    out = _json(capsys, ["aim", "se", "--alpha", "0.01:0.2:0.01", "--json"])
    assert isinstance(out, list) and len(out) == 20
    assert out[-1]["alpha"] == pytest.approx(0.2) and out[-1]["mmse"] == 0.0 and out[-1]["q_hat"] is None
    m = [r["mmse"] for r in out]
    assert all(a >= b for a, b in zip(m, m[1:]))


def test_thresholds_json(capsys):
    out = _json(capsys, ["aim", "thresholds", "--tokens", "3", "--rho", "0.5", "--activation", "softmax", "--json"])
    assert out["perfect_recovery"] == pytest.approx(0.75 / 10)
    assert out["weak_recovery"]["alpha_bar"] == pytest.approx(1 / 10)  # small width: 1 / (T^2 + T - 2)
    out = _json(capsys, ["aim", "thresholds", "--activation", "hardmax", "--json"])
    assert out["perfect_recovery"] is None and out["weak_recovery"]["alpha_bar"] > 0


def test_small_width_cli(capsys):
    out = _json(capsys, ["aim", "se", "--activation", "hardmax", "--small-width", "--alpha", "0.3,2", "--json"])
    assert out[0]["q"] == 0.0 and out[1]["q"] > 0


def test_amp_and_gd_cli_small(capsys):
    out = _json(capsys, ["aim", "amp", "--d", "24", "--alpha", "0.5", "--activation", "hardmax",
                         "--iterations", "15", "--json"])
    assert {"mmse", "mmse_se", "provenance"} <= set(out) and out["provenance"]["seed"] == [0]
    out = _json(capsys, ["aim", "gd", "--d", "16", "--alpha", "0.3", "--steps", "50", "--runs", "2",
                         "--seeds", "0,1", "--json"])
    assert {"mmse_gd", "mmse_agd", "mmse_gd_sem"} <= set(out)


@pytest.mark.parametrize("argv,field", [
    (["aim", "se", "--activation", "relu"], "activation"),
    (["aim", "se", "--alpha", "0.2:0.1:0.01"], "--alpha"),
    (["aim", "se", "--alpha", "abc"], "--alpha"),
    (["aim", "se", "--tokens", "4", "--activation", "hardmax"], "tokens"),
    (["aim", "gd", "--activation", "hardmax"], "activation"),
])
def test_bad_input_exit_2(capsys, argv, field):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert field in err and len(err.strip().splitlines()) == 1


def test_parse_grid():
    v, is_list = parse_grid("0.01:0.2:0.01")
    assert is_list and len(v) == 20 and v[-1] == pytest.approx(0.2)
    v, _ = parse_grid("0:1:0.3")
    assert list(v) == pytest.approx([0, 0.3, 0.6, 0.9])
