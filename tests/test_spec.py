"""Architecture declarations: validation, hashing, TOML round trip, safe link parsing."""

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aimsym
from aimsym.derive import spec as S
from aimsym.errors import SpecError

BASE = """
[model]
kind = "attention"
tokens = 2
layers = 2
rank = 1
heads = 1
tied = true
skip = 1.0
activation = "softmax"
beta = 1.0
output = "attention"
"""


def with_line(key, value):
    lines = [ln for ln in BASE.strip().splitlines() if not ln.startswith(f"{key} =")]
    return "\n".join(lines + [f"{key} = {value}"]) + "\n"


@pytest.mark.parametrize(
    "key,value,field",
    [
        ("activation", '"relu"', "activation"),
        ("tokens", "0", "tokens"),
        ("rank", "0", "rank"),
        ("heads", "-1", "heads"),
        ("skip", '"abc def"', "skip"),
        ("skip", '"1.5x"', "skip"),
        ("output", '"logits"', "output"),
        ("tied", '"yes"', "tied"),
        ("rank", "[1, 1, 1]", "rank"),
        ("bogus", "1", "bogus"),
    ],
)
def test_bad_fields_name_the_field(key, value, field):
    with pytest.raises(SpecError) as err:
        S.loads(with_line(key, value))
    assert err.value.field == field
    assert "\n" not in str(err.value)


def test_malformed_toml():
    with pytest.raises(SpecError) as err:
        S.loads("[model\ntokens = 2")
    assert err.value.field == "toml"


def test_symbolic_skip_is_kept_and_bound():
    spec = S.loads(with_line("skip", '"c"'))
    assert spec.parameters() == ("c",)
    m = aimsym.load(spec, skip=0.5)
    assert m.parameters == {"c": 0.5}
    assert aimsym.load(spec, c=0.5).parameters == {"c": 0.5}
    with pytest.raises(SpecError) as err:
        aimsym.load(spec, gamma=1.0)
    assert err.value.field == "gamma"


def test_spec_is_frozen_and_hashable():
    a = S.loads(BASE)
    b = S.loads(BASE)
    assert a == b and hash(a) == hash(b) and a.hash() == b.hash()
    assert S.loads(with_line("skip", "2.0")).hash() != a.hash()
    with pytest.raises(Exception):
        a.tokens = 3


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(1, 4),
    L=st.integers(1, 3),
    data=st.data(),
)
def test_toml_round_trip(T, L, data):
    ranks = data.draw(st.lists(st.integers(1, 3), min_size=L, max_size=L))
    heads = data.draw(st.lists(st.integers(1, 3), min_size=L, max_size=L))
    acts = data.draw(st.lists(st.sampled_from(S.ACTIVATIONS), min_size=L, max_size=L))
    if T == 1:  # a softmax/hardmax over one token is constant: such specs are refused
        acts = ["linear"] * L
    skip = data.draw(st.one_of(st.floats(0.1, 5), st.just("c")))
    spec = S.make_attention(tokens=T, layers=L, rank=ranks, heads=heads, activation=acts,
                            skip=skip, tied=data.draw(st.booleans()),
                            output=data.draw(st.sampled_from(S.OUTPUTS)))
    assert S.loads(S.to_toml(spec)) == spec


def test_free_form_link_parses_without_eval(tmp_path):
    spec = S.make_smi(indices=2, tokens=1, link="z[0, 0] * z[1, 0] + abs(z[0, 0]) ** 2")
    from aimsym.derive.parse import parse_link

    expr = parse_link(spec)
    assert {s.name for s in expr.free_symbols} == {"z_0_0", "z_1_0"}


@pytest.mark.parametrize(
    "link",
    [
        "__import__('os').system('touch PWNED')",
        "z[0, 0].__class__",
        "eval('1')",
        "lambda: 1",
        "foo(z[0, 0])",
        "unknown + z[0, 0]",
        "z[5, 0]",
        "[c for c in ()]",
    ],
)
def test_free_form_link_refuses_code(link, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    toml = f'[model]\nkind = "smi"\nindices = 1\ntokens = 1\nlink = "{link}"\n'.replace("'", "'")
    with pytest.raises(SpecError) as err:
        S.loads(toml)
    assert err.value.field == "link"
    assert not (tmp_path / "PWNED").exists()


def test_cli_refuses_malicious_file_and_runs_nothing(tmp_path):
    f = tmp_path / "evil.toml"
    f.write_text('[model]\nkind = "smi"\nindices = 1\ntokens = 1\n'
                 "link = \"__import__('os').system('touch PWNED')\"\n")
    r = subprocess.run([sys.executable, "-m", "aimsym.cli", "derive", str(f)], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "link" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "PWNED").exists() and not os.path.exists("PWNED")


@pytest.mark.parametrize(
    "key,value,field",
    [("activation", '"relu"', "activation"), ("tokens", "0", "tokens"), ("rank", "0", "rank"),
     ("heads", "-1", "heads"), ("skip", '"abc def"', "skip")],
)
def test_cli_bad_input_one_line_exit_2(tmp_path, key, value, field):
    f = tmp_path / "bad.toml"
    f.write_text(with_line(key, value))
    r = subprocess.run([sys.executable, "-m", "aimsym.cli", "derive", str(f), "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and field in r.stderr and "Traceback" not in r.stderr


def test_cli_malformed_toml_and_bad_set(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[model\n")
    r = subprocess.run([sys.executable, "-m", "aimsym.cli", "derive", str(f)], capture_output=True, text=True)
    assert r.returncode == 2 and "toml" in r.stderr and r.stderr.count("\n") == 1
    g = tmp_path / "ok.toml"
    g.write_text(with_line("skip", '"c"'))
    r = subprocess.run([sys.executable, "-m", "aimsym.cli", "derive", str(g), "--set", "c=abc"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "c:" in r.stderr and r.stderr.count("\n") == 1
