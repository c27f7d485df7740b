"""The LaTeX export: the model in the paper's notation, a clean printer, pasteable parts, and
documents that compile (pdflatex, where installed) without errors or lines off the page."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import sympy as sp

import aimsym
from aimsym.derive import spec as S
from aimsym.derive.latex import PARTS, document, front, part
from aimsym.derive.latexutil import broken_lines, tex_width
from aimsym.derive.symbolic import derive
from aimsym.derive import setups
from aimsym.derive.files import derivations_dir

def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "aimsym.cli", *args], capture_output=True, text=True)


BUNDLED = sorted(p.stem for p in derivations_dir().glob("*.toml") if setups.kind_of(p) not in setups.KINDS)


def _derivation(name: str):
    return aimsym.load(derivations_dir() / f"{name}.toml").derivation


@functools.lru_cache(maxsize=None)
def _document(name: str) -> str:
    """The full document of a bundled model (rendered once: two tests read it)."""
    return document(_derivation(name))


def _fresh():
    """A model declared here, not bundled: three untied layers, two heads each, T = 3."""
    return derive(S.make_attention(tokens=3, layers=3, tied=False, heads=2, skip="c", beta="beta",
                                   name="fresh_L3_T3_untied_heads2"))


def test_two_layer_model_is_stated_as_in_the_paper():
    """A(z_1) = softmax(z_1 z_1^T) + c I, h = A(z_1) z_2, y = softmax(h h^T) (theory section 2)."""
    text = front(_derivation("attention_L2_T2"))
    assert r"A_{1}(z_{1}) &= \operatorname{softmax}\big(z_{1} z_{1}^\top\big) + c\, I" in text
    assert r"h &= A_{1}\, z_{2}" in text
    assert r"y &= \operatorname{softmax}\big(h h^\top\big)" in text
    # the reduction: z_2 solved as +-A_1(u)^{-1} h, a 2-dimensional integral over u = z_1
    assert r"z_{2} &= s\, A_{1}(u)^{-1} h" in text and r"\int_{\mathbb R^{2}}" in text
    assert r"z_{1} \mapsto -z_{1}" in text and r"z_{2} \mapsto -z_{2}" in text


def test_three_layers_and_parameters_follow_the_spec():
    """Three layers: B = A_2 A_1 (the paper's A(A(z_1) z_2) A(z_1)), y = softmax((B z_3)(B z_3)^T);
    a symbolic beta and numeric skips print as factors, a unit one does not."""
    text = front(_derivation("attention_L3_T2"))
    assert r"M_{2} &= A_{2}\, A_{1}" in text and r"h &= M_{2}\, z_{3}" in text
    assert r"A_{2}(z_{1}, z_{2}) &= \operatorname{softmax}\big(h^{(2)} {h^{(2)}}^\top\big) + c\, I" in text
    d = derive(S.make_attention(tokens=2, layers=2, skip=[0.5, 1.0], beta="beta", activation=["linear", "softmax"]))
    text = front(d)
    assert r"A_{1}(z_{1}) &= \beta\, z_{1} z_{1}^\top + \frac{1}{2}\, I" in text
    assert r"y &= \operatorname{softmax}\big(\beta\, h h^\top\big)" in text
    text = front(_fresh())
    assert r"q^{(3,2)} &= M_{2}\, z_{3}^{Q(2)}, \quad k^{(3,2)} = M_{2}\, z_{3}^{K(2)}" in text
    assert r"\frac{1}{2}\Big(" in text and "No exact reduction" in text


@pytest.mark.parametrize("name", BUNDLED)
def test_printer_leaves_no_artefacts(name):
    """No /1 or 1\\, from a unit beta, no escaped code in prose, one index convention (1-based)."""
    text = _document(name)
    body = text.split(r"\end{center}", 1)[1]  # past the title, which names the file
    assert "/1 " not in body and "/1$" not in body and not re.search(r"(?<![0-9.{])1\\,", body)
    for code in (r"\_", r"\textasciicircum", r"\textbackslash", "->", "<="):
        assert code not in body, code
    assert not re.search(r"[\x00-\x08\x0b-\x1f]", text)  # e.g. "\f" of a non-raw "\frac"
    for zero_based in ("z_{0", "h_{0", "y_{0", r"\partial_{0}", "V_{00}", r"\ell_{0"):
        assert zero_based not in body, zero_based


def test_symbolic_beta_is_printed_where_it_acts():
    text = front(_derivation("attention_L1_T2"))
    assert r"y &= \operatorname{softmax}\big(\beta\, z_{1} z_{1}^\top\big)" in text
    assert r"\beta\, h_a (h_b - h_a)" in text and r"N_{ab} = \frac{\ell_{1a} - \ell_{a1} + \ell_{ab}}{\beta}" in text


def test_appendix_holds_the_program_and_can_be_left_out(tmp_path):
    d = _derivation("attention_L2_T2")
    full, short = document(d), document(d, appendix=False)
    assert "Appendix A" in full and r"\partial_{z_{1,1}}" in full and r"S^{(2)}_{11}" in full
    assert "Appendix" not in short and r"\partial_{z" not in short
    assert full.startswith(short[:short.index(r"\end{document}")])  # the appendix only is left out
    # the Jacobian section does not repeat the link's program
    jac = full[full.index("Appendix B"):full.index("Appendix C")]
    assert jac.count(r"\frac{\partial y_") == 1  # one line with generic indices, not one per entry
    assert r"\frac{\partial y_{ab}}{\partial z_{k,t}} &= \partial_{z_{k,t}} S^{(2)}_{ab}" in jac
    assert "\nS^{(1)}_{11} &=" not in jac and "\nS^{(1)}_{11} &=" in full and r"\partial_{z_{1,1}}S^{(1)}_{11} &=" in jac
    tex = tmp_path / "L2.tex"
    r = run_cli("derive", str(derivations_dir() / "attention_L2_T2.toml"), "--latex", str(tex),
                "--no-appendix")
    assert r.returncode == 0, r.stderr
    assert tex.read_text() == short


def test_latex_part_writes_one_align_block(tmp_path):
    path = str(derivations_dir() / "attention_L2_T2.toml")
    r = run_cli("derive", path, "--latex-part", "reduction")
    assert r.returncode == 0, r.stderr
    block = r.stdout
    assert block.startswith("\\begin{align}\n") and block.endswith("\\end{align}\n")
    assert block.count("\\begin{align}") == 1 and r"Z_{\rm out}(y;\omega,V)" in block
    assert block == part(_derivation("attention_L2_T2"), "reduction")
    tex = tmp_path / "model.tex"
    assert run_cli("derive", path, "--latex-part", "model", "--latex", str(tex)).returncode == 0
    assert tex.read_text() == part(_derivation("attention_L2_T2"), "model")
    # the CLI offers exactly the parts the module has
    from aimsym.cli.derive import LATEX_PARTS

    assert LATEX_PARTS == tuple(PARTS)
    r = run_cli("derive", path, "--latex-part", "nope")
    assert r.returncode == 2 and all(name in r.stderr for name in PARTS)


def test_long_sums_are_broken_between_terms():
    x = sp.symbols("x0:40", real=True)
    e = sp.Add(*[sp.exp(x[i]) * x[i + 1] for i in range(0, 40, 2)])
    lines = broken_lines("y", e, {}, 60)
    assert len(lines) > 2 and lines[0].startswith("y &= ") and all(ln.startswith(r"&\quad") for ln in lines[1:])
    assert all(tex_width(ln) <= 60 for ln in lines)
    assert sum(ln.count("e^{") for ln in lines) == 20  # every term once
    # a quotient with a long numerator keeps the denominator as a prefactor
    q = broken_lines("z", e / (x[0] + x[1]), {}, 60)
    assert q[0].startswith(r"z &= \frac{1}{x_{0} + x_{1}}\Big(") and q[-1].endswith(r"\Big)")
    assert tex_width(r"\frac{a}{bbbb}") == pytest.approx(4.4)


# ----------------------------------------------------------------------------- pdflatex

_PDFLATEX = shutil.which("pdflatex")
# geometry margin=2cm: a box sticking out by more than the margin runs off the paper
_MARGIN_PT = 56.9


def _compile(tex_text: str, tmp_path, stem: str) -> str:
    (tmp_path / f"{stem}.tex").write_text(tex_text)
    r = subprocess.run([_PDFLATEX, "-interaction=nonstopmode", "-halt-on-error", f"{stem}.tex"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    log = (tmp_path / f"{stem}.log").read_text(errors="replace")
    errors = [ln for ln in log.splitlines() if ln.startswith("!")]
    assert r.returncode == 0 and not errors, "\n".join(errors) or r.stdout[-2000:]
    return log


def _overfull(log: str) -> list[float]:
    return [float(w) for w in re.findall(r"Overfull \\hbox \(([0-9.]+)pt too wide\)", log)]


@pytest.mark.skipif(_PDFLATEX is None, reason="no pdflatex on this machine")
@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_derivation_compiles(name, tmp_path):
    log = _compile(_document(name), tmp_path, name)
    assert all(w < _MARGIN_PT for w in _overfull(log)), _overfull(log)


@pytest.mark.skipif(_PDFLATEX is None, reason="no pdflatex on this machine")
def test_two_layer_front_fits_one_page_and_fresh_model_compiles(tmp_path):
    log = _compile(document(_derivation("attention_L2_T2"), appendix=False, theory=False), tmp_path, "L2")
    assert re.search(r"Output written on L2\.pdf \(1 page", log) and not _overfull(log)
    log = _compile(document(_fresh(), appendix=False), tmp_path, "fresh")  # (with the theory sections)
    assert not _overfull(log)
    # the pasteable parts compile inside a bare document
    d = _derivation("attention_L2_T2")
    body = "".join(part(d, name) for name in PARTS)
    log = _compile("\\documentclass{article}\n\\usepackage{amsmath,amssymb}\n\\usepackage[margin=2cm]{geometry}\n"
                   "\\allowdisplaybreaks\n\\begin{document}\n" + body + "\\end{document}\n", tmp_path, "parts")
    assert all(w < _MARGIN_PT for w in _overfull(log))


_CORNERS = {
    "tokens_noise": dict(tokens=2, layers=2, output="tokens", skip="c", noise="Delta"),
    "rank2": dict(tokens=3, layers=2, rank=[2, 1], skip=0.5),
    "split_readout": dict(tokens=2, layers=2, heads=[2, 1], head_mode="split", readout=[[0.3, 0.7], [1.0]]),
    "linear": dict(tokens=2, layers=2, activation="linear", beta="beta"),
}


@pytest.mark.skipif(_PDFLATEX is None, reason="no pdflatex on this machine")
@pytest.mark.parametrize("corner", sorted(_CORNERS))
def test_front_of_declared_corner_cases_compiles(corner, tmp_path):
    """Spec features no bundled model has (sequence output with noise, rank two, head readout
    weights, linear attention) print and compile."""
    d = derive(S.make_attention(name=corner, **_CORNERS[corner]))
    text = document(d, appendix=False)
    assert r"\_" not in text.split(r"\end{center}", 1)[1]
    log = _compile(text, tmp_path, corner)
    assert not _overfull(log)
    expect = {"tokens_noise": r"y &= M_{2}", "rank2": r"\mathbb R^{T\times r_l}",
              "split_readout": r"\frac{3}{10}\, \operatorname{softmax}", "linear": r"y &= \beta\, h h^\top"}
    assert expect[corner] in text


@pytest.mark.parametrize("name, text", [
    ("attention_L2_T2", r"\alpha_{\rm PR} = p/m = 1$"),
    ("attention_L2_T3", r"\alpha_{\rm PR} = p/m = \frac{2}{3}$"),
    ("glm_sign", "never recovered perfectly"),
])
def test_front_states_the_counting_bound(name, text):
    """The SMI-form section states m and alpha_PR = p/m from the derivation's counting rank."""
    doc = document(_derivation(name), appendix=False)
    assert "Counting: $m = " in doc and text in doc


# ----------------------------------------------------------------------------- theory sections

from aimsym.derive import latex_theory as LT  # noqa: E402
from aimsym.smi import se as SE  # noqa: E402

_THEORY = ("Bayes-optimal state evolution", "Free entropy", "Weak recovery", "Counting threshold and perfect recovery")


def _sections(text: str) -> dict[str, str]:
    """Section title -> body, for the starred sections of a document."""
    out = {}
    for chunk in text.split(r"\section*{")[1:]:
        depth, i = 1, 0
        while depth:  # the title's closing brace
            depth += {"{": 1, "}": -1}.get(chunk[i], 0)
            i += 1
        out[chunk[:i - 1].split("$")[0].split(":")[0].strip()] = chunk[i:]
    return out


@pytest.mark.parametrize("name", BUNDLED)
def test_theory_sections_are_those_of_the_declared_model(name):
    """SE, free entropy, weak recovery and counting sections name the model's p, T, noise, m and
    alpha_PR = p/m (or why there is none), and say whether Q = 0 is a fixed point."""
    d = _derivation(name)
    sec = _sections(_document(name))
    assert all(t in sec for t in _THEORY), sorted(sec)
    p, T, m = d.p, d.tokens, d.counting["m"]
    se_text, pr = sec["Bayes-optimal state evolution"], sec["Counting threshold and perfect recovery"]
    if p > 1:
        assert rf"Q \in \mathbb R^{{{p}\times {p}}}" in se_text and rf"V = I_{{{p}}} - Q" in se_text
    else:
        assert r"\hat q &= \alpha" in se_text and "v = 1 - q" in se_text
    assert (rf"\sum_{{t=1}}^{{{T}}}" in se_text) == (T > 1)
    assert f"The expectation is over ${2 * p * T + (d.output_shape and int(sp.prod(d.output_shape)) or 1) * (d.spec.noise != 0)}$" \
        in se_text
    noisy = param_symbol_nonzero(d.spec.noise)
    assert (r"\, \zeta" in se_text) == noisy
    assert f"= {m}$ independent numbers" in pr
    if m == 0:
        assert "no perfect recovery, no counting threshold" in pr and r"\alpha_{\rm PR}" not in pr
    else:
        a_pr = sp.latex(sp.Rational(p, m))
        assert rf"\alpha_{{\rm PR}} = p/m = {a_pr}" in pr
        assert ("no perfect recovery at any" in pr) == noisy
    weak = sec["Weak recovery"]
    assert ("is a fixed point" in weak) == LT.even_link(d) and ("is not a fixed point" in weak) != LT.even_link(d)


def param_symbol_nonzero(v) -> bool:
    return isinstance(v, str) or float(v) != 0.0


@pytest.mark.parametrize("name, classes, text", [
    ("attention_L2_T2", [[0], [1]], r"$G_{ts}$ is diagonal"),
    ("attention_L2_T2_heads2", [[0], [1], [2]], r"\max_{k \le 3} B_k"),
    ("attention_L2_T2_untied", [[0, 1], [2, 3]], r"classes $\{z_{1}^{Q}, z_{1}^{K}\}$; $\{z_{2}^{Q}, z_{2}^{K}\}$"),
    ("mim_product", [[0, 1]], r"$G$ is a full $2\times 2$ matrix"),
])
def test_operator_structure_follows_the_sign_symmetries(name, classes, text):
    """Rows flipped apart by a symmetry have (G_ts)_kk' = 0: diagonal, block-diagonal or full F."""
    d = _derivation(name)
    assert LT.flip_classes(d) == classes
    weak = _sections(_document(name))["Weak recovery"]
    assert text in weak
    assert ("Grand staircase" in weak) == (len(classes) > 1)


def test_jensen_bound_is_the_moment_of_a_revealed_index():
    """B_k <= E sum_ts (z_t z_s - delta_ts)^2 = T (T + 1) for z ~ N(0, I_T) (Monte Carlo check)."""
    rng = np.random.default_rng(0)
    for T in (1, 2, 3):
        z = rng.standard_normal((200_000, T))
        val = np.mean(np.sum((z[:, :, None] * z[:, None, :] - np.eye(T)) ** 2, axis=(1, 2)))
        assert val == pytest.approx(LT._jensen(T), rel=0.02)


@pytest.mark.parametrize("name, alpha_c", [("glm_phase_retrieval", "1/2"), ("attention_L1_T2", "1/6")])
def test_two_point_posteriors_give_exact_alpha_c(name, alpha_c):
    weak = _sections(_document(name))["Weak recovery"]
    assert rf"$\alpha_c = {alpha_c}$ exactly" in weak
    assert "exactly" not in _sections(_document("attention_hardmax_L1_T2"))["Weak recovery"]


@pytest.mark.parametrize("alpha, Delta", [(0.3, 0.5), (1.3, 0.5), (2.0, 0.1), (0.7, 0.0), (1.5, 0.0)])
def test_gaussian_fixed_point_in_the_document_is_the_solvers(alpha, Delta):
    """The closed form the document prints (q^* root of q^2 - b q + alpha T) against the SE module's,
    and for T = 2 tokens against the iterated SE map q <- qhat/(1 + qhat), qhat = 2 alpha/(1 - q + Delta)."""
    q = float(LT.gaussian_fixed_point(alpha, Delta))
    assert q == pytest.approx(SE.gaussian_channel_fixed_point(alpha, Delta), abs=1e-12)
    if Delta == 0:  # the noiseless linear channel: q = min(alpha T, 1)
        assert q == pytest.approx(min(alpha, 1.0), abs=1e-12)
        assert float(LT.gaussian_fixed_point(alpha, Delta, T=2)) == pytest.approx(min(2 * alpha, 1.0), abs=1e-12)
    else:
        q2 = 0.0
        for _ in range(5000):
            qh = 2 * alpha / (1 - q2 + Delta)
            q2 = qh / (1 + qh)
        assert float(LT.gaussian_fixed_point(alpha, Delta, T=2)) == pytest.approx(q2, abs=1e-6)
    text = _document("gaussian_channel")
    assert r"b = 1 + \Delta + \alpha" in text and r"\hat q &= \frac{\alpha}{1 - q + \Delta}" in text


def test_closed_forms_of_sign_product_and_published_model():
    sign = _document("glm_sign")
    assert r"g_{\rm out}}(y, 0, 1) = y \sqrt{2/\pi}" in sign and r"\hat q = 2\alpha/\pi" in sign
    a = LT.product_a()
    assert 0.684 < a < 0.6845  # tests/test_thresholds_operator.py checks a by independent integrals
    prod = _sections(_document("mim_product"))["Closed forms"]
    assert f"a = \\mathbb E(\\mu(y) - 1)^2 = {a:.4f}" in prod and f"= {1 / (1 + a):.4f}" in prod
    assert "0.187 \\pm 0.003" in _sections(_document("attention_L2_T2"))["Known values"]
    for other in ("attention_L2_T3", "attention_L2_T2_untied", "hardmax_L2_T2", "attention_hardmax_L1_T2"):
        assert LT.closed_form_kind(_derivation(other)) is None
        assert "Known values" not in _document(other) and "Closed forms" not in _document(other)
    kinds = {n: LT.closed_form_kind(_derivation(n)) for n in ("gaussian_channel", "glm_phase_retrieval", "glm_sign",
                                                              "mim_product", "attention_L1_T2", "attention_L2_T2")}
    assert kinds == {"gaussian_channel": "gaussian", "glm_phase_retrieval": "phase-retrieval", "glm_sign": "sign",
                     "mim_product": "product", "attention_L1_T2": "two-point", "attention_L2_T2": "published"}


def test_noisy_model_has_no_perfect_recovery_but_states_the_noiseless_bound():
    pr = _sections(_document("attention_shared_flow_T2"))["Counting threshold and perfect recovery"]
    assert r"With output noise $\Delta > 0$" in pr and "no perfect recovery at any" in pr
    assert r"At $\Delta = 0$ the counting threshold is $\alpha_{\rm PR} = p/m = \frac{1}{2}$" in pr


def test_theory_sections_can_be_left_out():
    d = _derivation("glm_phase_retrieval")
    assert "Free entropy" not in document(d, theory=False) and "Free entropy" in document(d)


@pytest.mark.skipif(_PDFLATEX is None, reason="no pdflatex on this machine")
def test_compile_check_fails_on_a_latex_error(tmp_path):
    """The compile helper the document tests rely on does fail on an error."""
    broken = _document("glm_sign").replace(r"\section*{Free entropy}", r"\section*{Free entropy} $\frac{1}$")
    with pytest.raises(AssertionError):
        _compile(broken, tmp_path, "broken")


def test_theory_parts_paste_the_declared_models_formulas():
    d = _derivation("attention_L2_T3")
    se_block = part(d, "state-evolution")
    assert se_block.startswith("\\begin{align}\n") and r"\sum_{t=1}^{3}" in se_block and "I_{2}" in se_block
    op = part(d, "operator")
    assert r"t, s = 1, 2, 3" in op and r"\alpha_c &= 1/\rho(F)" in op
    assert r"\log\det(I_{2} + \hat Q)" in part(d, "free-entropy")


_SMI_CORNERS = {
    "linear_noiseless": (dict(indices=1, tokens=1, link="z[0, 0]"), r"q^* &= \min(\alpha, 1)"),
    "gaussian_p2_T2": (dict(indices=2, tokens=2, link=[["z[0, 0]", "z[0, 1]"], ["z[1, 0]", "z[1, 1]"]], noise=0.5),
                       r"for $\Delta = \frac{1}{2} > 0$"),
}


@pytest.mark.parametrize("corner", sorted(_SMI_CORNERS))
def test_closed_forms_of_declared_linear_channels(corner, tmp_path):
    """A noiseless linear link and a numeric-noise Gaussian channel with p = T = 2 (not bundled):
    the closed form follows the declared noise and shape, and the document compiles."""
    kw, expect = _SMI_CORNERS[corner]
    d = derive(S.make_smi(name=corner, **kw))
    assert LT.closed_form_kind(d) == "gaussian"
    text = document(d, appendix=False)
    assert expect in text and "+ 0" not in text and "0 > 0" not in text
    if _PDFLATEX is not None:
        assert not _overfull(_compile(text, tmp_path, corner))


def test_published_values_name_a_numeric_skip():
    d = derive(S.make_attention(tokens=2, layers=2, skip=2.0))
    text = LT.closed_form_section(d)
    assert "(this model: $c = 2$)" in text and r"\alpha_c(c = 1)" in text


@pytest.mark.parametrize("name, params", [("glm_phase_retrieval", {}), ("attention_L1_T2", {"beta": 1.0})])
def test_printed_exact_alpha_c_is_what_the_threshold_code_computes(name, params):
    """The alpha_c the document states for a two-point posterior against aimsym.smi.thresholds
    (the operator at Q = 0 from the generated denoiser)."""
    from aimsym.smi import thresholds

    weak = _sections(_document(name))["Weak recovery"]
    printed = 1 / int(re.search(r"\$\\alpha_c = 1/(\d+)\$ exactly", weak).group(1))
    r = thresholds.initial_threshold(aimsym.load(derivations_dir() / f"{name}.toml", **params), samples=1 << 12, seed=0)
    assert abs(r.alpha - printed) < 4 * r.stderr + 1e-3
