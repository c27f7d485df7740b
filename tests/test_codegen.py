"""Generated kernels: committed modules current, generated link == forward pass, generated
Jacobian == finite differences, CLI derive numbers of the bundled models."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from forward import draw_weights, forward, indices

import aimsym
from aimsym.derive import codegen
from aimsym.derive import spec as S
from aimsym.derive.files import derivations_dir

BUNDLED_ATTENTION = ["attention_L2_T2", "attention_L3_T2", "attention_L2_T3", "attention_L2_T2_untied",
                     "attention_L2_T2_heads2", "attention_L1_T2"]


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "aimsym.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_generate_check_passes_for_committed_modules():
    r = run_cli("generate", "--check")
    assert r.returncode == 0, r.stderr


def test_generate_check_detects_stale(tmp_path):
    spec = S.load(derivations_dir() / "glm_phase_retrieval.toml")
    out = tmp_path / f"{spec.name}.py"
    out.write_text(codegen.module_source(spec).replace("P = 1", "P = 2"))
    r = run_cli("generate", "--check", "--out", str(tmp_path), str(derivations_dir() / "glm_phase_retrieval.toml"))
    assert r.returncode == 1 and "stale" in r.stderr


def test_generation_is_deterministic():
    """The text is a function of the spec: this process, a fresh process (other hash seed, other
    SymPy caches) and the committed module agree."""
    spec = S.load(derivations_dir() / "attention_L2_T2.toml")
    here = codegen.module_source(spec)
    code = ("import sys; from aimsym.derive import codegen, spec; "
            "sys.stdout.write(codegen.module_source(spec.load(sys.argv[1])))")
    fresh = subprocess.run([sys.executable, "-c", code, str(derivations_dir() / "attention_L2_T2.toml")],
                           capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stdout == here
    assert (codegen.generated_dir() / "attention_L2_T2.py").read_text() == here


@pytest.mark.parametrize("name", BUNDLED_ATTENTION)
def test_generated_link_equals_forward_pass(name):
    model = aimsym.load(derivations_dir() / f"{name}.toml")
    values = {p: 0.5 + i for i, p in enumerate(model.spec.parameters())}
    model = model.with_values(**values)
    spec = S.bind(model.spec, values)
    rng = np.random.default_rng(7)
    d = 64
    for _ in range(5):
        x = rng.standard_normal((d, spec.tokens))
        w = draw_weights(spec, d, rng)
        Z = indices(spec, x, w)
        assert np.allclose(model.link(Z), forward(spec, x, w), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["attention_L2_T2", "attention_L3_T2", "mim_product"])
def test_generated_jacobian_equals_finite_differences(name):
    model = aimsym.load(derivations_dir() / f"{name}.toml")
    model = model.with_values(**{p: 1.0 for p in model.spec.parameters()})
    rng = np.random.default_rng(3)
    Z = rng.standard_normal((4, model.p, model.tokens))
    J = model.link_jacobian(Z)
    eps = 1e-6
    for k in range(model.p):
        for t in range(model.tokens):
            E = np.zeros_like(Z)
            E[:, k, t] = eps
            fd = (model.link(Z + E) - model.link(Z - E)) / (2 * eps)
            assert np.allclose(J[..., k, t], fd, rtol=1e-6, atol=1e-8)


def test_custom_model_generates_into_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AIMSYM_CACHE", str(tmp_path))
    spec = S.make_smi(indices=1, tokens=1, link="z[0, 0] ** 3", name="cubic")
    model = aimsym.load(spec)
    assert np.allclose(model.link(np.array([[[2.0]]])), 8.0)
    path = codegen.module_path(spec)
    assert path.exists() and spec.hash() in str(path) and str(tmp_path) in str(path)


@pytest.mark.parametrize("name,p,T,dim", [("attention_L2_T2", 2, 2, 2), ("attention_L3_T2", 3, 2, 4),
                                          ("attention_L2_T3", 2, 3, 3)])
def test_cli_derive_json(name, p, T, dim, tmp_path):
    tex = tmp_path / "out.tex"
    r = run_cli("derive", str(derivations_dir() / f"{name}.toml"), "--json", "--latex", str(tex))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["indices"] == p and out["tokens"] == T and out["output_shape"] == [T, T]
    assert out["reduction"] == {**out["reduction"], "found": True, "integral_dim": dim}
    assert any(s["name"].startswith("layer 1") for s in out["symmetries"])
    text = tex.read_text()
    assert text.startswith("\\documentclass") and text.rstrip().endswith("\\end{document}")
    assert "Z_{\\rm out}" in text and "Jacobian" in text


def test_softmax_rows_are_printed_stably():
    """Row softmaxes are recognised and printed with one exp per entry (T = 2: one per row via
    _softmax2) instead of T - 1 per entry; the generated link stays exact for huge logits."""
    for name, T in (("attention_L2_T2", 2), ("attention_L2_T3", 3)):
        spec = S.load(derivations_dir() / f"{name}.toml")
        src = codegen.module_source(spec)
        body = src[src.index("def branch("):src.index("def polar_beta(")]
        body = body[body.index('    """', body.index('r"""') + 4):]  # past the docstring
        if T == 2:
            assert body.count("_softmax2(") == 2 and "math.exp(" not in body.split("def polar_branch")[0]
        else:
            assert body.count("math.exp(") == T * T  # one per entry (was T (T - 1))
    model = aimsym.load(derivations_dir() / "attention_L2_T3.toml", skip=0.7)
    rng = np.random.default_rng(0)
    Z = 30.0 * rng.standard_normal((3, model.p, model.tokens))  # logits ~ 1e3: exp would overflow
    Y = model.link(Z)
    assert np.all(np.isfinite(Y)) and np.allclose(Y.sum(axis=-1), 1.0)
    spec = S.bind(model.spec, {"skip": 0.7})
    for i in range(3):
        z1 = Z[i, 0]
        A = np.outer(z1, z1)
        E = np.exp(A - A.max(axis=1, keepdims=True))
        M = 0.7 * np.eye(3) + E / E.sum(axis=1, keepdims=True)
        h = M @ Z[i, 1]
        G = np.outer(h, h)
        E = np.exp(G - G.max(axis=1, keepdims=True))
        assert np.allclose(Y[i], E / E.sum(axis=1, keepdims=True), rtol=1e-9, atol=1e-300)
    del spec


def test_polar_branch_kernel():
    """polar_branch: w = M(u)^{-1} h and 1/|det M(u)| for the two-layer T = 2 model; stubs elsewhere."""
    model = aimsym.load(derivations_dir() / "attention_L2_T2.toml", skip=0.8)
    k = model.kernels
    assert k.polar_beta(model.params_array()) == 1.0
    rng = np.random.default_rng(1)
    w = np.empty(2)
    for _ in range(5):
        u, h = rng.normal(size=2) * 2, rng.normal(size=2)
        A = np.outer(u, u)
        E = np.exp(A - A.max(axis=1, keepdims=True))
        M = 0.8 * np.eye(2) + E / E.sum(axis=1, keepdims=True)
        J = k.polar_branch(u, h, model.params_array(), w)
        assert np.allclose(w, np.linalg.solve(M, h), rtol=1e-12) and np.isclose(J, 1 / abs(np.linalg.det(M)), rtol=1e-12)
    other = aimsym.load(derivations_dir() / "attention_L3_T2.toml", skip=1.0).kernels
    assert len(other.POLAR_ANGLES) == 0 and np.isnan(other.polar_beta(np.ones(1)))


@pytest.mark.parametrize("name", ["attention_L2_T2", "attention_L2_T3", "attention_L3_T2"])
def test_counting_gap_of_an_exactly_rank_deficient_jacobian_is_not_rounding_noise(name):
    """Softmax rows sum to one, so dy/dZ is exactly rank-deficient: its dropped singular values are
    rounding noise, whose size differs between BLAS builds. The generated module records the gap
    as None (unbounded), never a number made of that noise, so it is the same text on every machine."""
    model = aimsym.load(derivations_dir() / f"{name}.toml", skip=1.0)
    c = model.counting
    assert c["m"] < c["p"] * model.tokens
    assert c["margin"] is None, c


def test_mean_field_mixing_is_cut_above_its_rounding_noise():
    """Mbar of the large-depth limit (written into the generated module) has 12 significant digits,
    far below its error estimate and above the ODE's last-digit noise across machines."""
    from aimsym.derive.depth import mean_field_mixing

    mf = mean_field_mixing(1.0, 1.0, 2)
    assert mf.error > 1e-11 * np.abs(mf.matrix).max()
    assert all(float(f"{x:.12g}") == x for x in mf.matrix.ravel())
