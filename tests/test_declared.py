"""AIM and ERM as declared models: the common verbs on a kind = "aim" / "erm" file give exactly
what the aim / erm sub-commands give with the same values."""

import json
import subprocess
import sys

import pytest

import aimsym
from aimsym.derive import setups
from aimsym.derive import spec as S
from aimsym.derive.files import derivations_dir
from aimsym.errors import SpecError


def run(*args):
    r = subprocess.run([sys.executable, "-m", "aimsym.cli", *args], capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def _strip(obj):
    """Drop what legitimately differs between two runs (time stamps, durations)."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in ("created", "seconds")}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


@pytest.mark.parametrize("declared,direct", [
    (["se", "aim_softmax_T2", "--alpha", "0.05,0.1", "--json"],
     ["aim", "se", "--tokens", "2", "--rho", "0.5", "--activation", "softmax", "--alpha", "0.05,0.1", "--json"]),
    (["thresholds", "aim_softmax_T3", "--json"],
     ["aim", "thresholds", "--tokens", "3", "--rho", "0.5", "--activation", "softmax", "--json"]),
    (["se", "aim_softmax_T2", "--set", "rho=0.25", "--alpha", "0.1", "--json"],
     ["aim", "se", "--rho", "0.25", "--alpha", "0.1", "--json"]),
    (["thresholds", "erm_tied_T2", "--json"], ["erm", "thresholds", "--kappa0", "0.5", "--noise", "0.5", "--json"]),
])
def test_common_verbs_equal_the_sub_commands(declared, direct):
    a, b = run(*declared), run(*direct)
    assert a[0] == 0 and b[0] == 0, (a[2], b[2])
    assert _strip(json.loads(a[1])) == _strip(json.loads(b[1]))


def test_a_verb_that_does_not_apply_is_one_line_exit_2():
    code, out, err = run("amp", "erm_tied_T2", "--alpha", "0.1")
    assert code == 2 and err.count("\n") == 1 and "erm model" in err


def test_bad_key_names_the_field(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text('[model]\nkind = "aim"\nrho = 0.5\nwidth = 3\n')
    code, _, err = run("se", str(f), "--alpha", "0.1")
    assert code == 2 and err.startswith("aimsym: error: width:")


def test_load_returns_the_setup_and_spec_refuses_it():
    s = aimsym.load("aim_hardmax_T2", rho=0.3)
    assert s.kind == "aim" and s.parameters["rho"] == 0.3 and s.parameters["activation"] == "hardmax"
    with pytest.raises(SpecError) as err:
        S.load(derivations_dir() / "erm_tied_T2.toml")
    assert err.value.field == "kind"


def test_every_bundled_setup_loads():
    names = [p.stem for p in derivations_dir().glob("*.toml") if setups.kind_of(p) in setups.KINDS]
    assert {"aim_softmax_T2", "aim_softmax_T3", "aim_hardmax_T2", "erm_tied_T2"} <= set(names)
    for n in names:
        assert aimsym.load(n).name == n
