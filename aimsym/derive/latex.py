"""LaTeX export of a derivation, written for a theorist to read and paste into a paper.

The document opens with a front section in the paper's notation: the model as matrix formulas
per layer, its SMI form y = g(Z), the sign symmetries of g and the exact reduction of the
denoiser (inverse output map, solved block, reduced integral). One index convention throughout:
rows of Z (indices) and tokens are numbered from 1. Then (left out with ``theory=False``) the
model's learning theory: state evolution, free entropy, weak-recovery operator, counting threshold
and perfect recovery, closed forms. The appendix (left out with
``appendix=False``) has the straight-line program the code runs, the Jacobian and the reduction
entry by entry, all printed from the SymPy objects of :mod:`aimsym.derive.symbolic`, the same ones the
code generator turns into kernels.

:func:`part` returns one ``align`` block (model, link, reduction, jacobian, state-evolution,
free-entropy, operator) for pasting. The sections on the state evolution, free entropy, weak and
perfect recovery and closed forms come from :mod:`aimsym.derive.latex_theory`.
"""

from __future__ import annotations

import re

import sympy as sp

from .latexutil import align as _align
from .latexutil import block_name as _block_name
from .latexutil import broken_lines, latex_program, tex_width, z_name
from .latexutil import esc as _esc
from .latexutil import index_blocks as _blocks
from .latex_theory import free_entropy_lines, operator_lines, se_lines, theory_sections
from .spec import AttentionSpec
from .symbolic import Derivation, Program
from .symbolic import param_symbol as _param


def param_symbol(v) -> sp.Expr:
    """A spec value (number or name) or an already symbolic one as a SymPy expression."""
    return v if isinstance(v, sp.Basic) else _param(v)


_PREAMBLE = r"""\documentclass[11pt]{article}
\usepackage{amsmath,amssymb}
\usepackage[margin=2cm]{geometry}
\allowdisplaybreaks
\setlength{\parindent}{0pt}
\setlength{\parskip}{4pt}
\setlength{\emergencystretch}{2em}
\begin{document}
"""

# widths for line breaking, in units of latexutil.tex_width (~5.5 pt): the text block is
# ~500 pt (letter paper, 2 cm margins); appendix lines are printed \small
_WIDTH = 80
_WIDTH_SMALL = 88

# The derivation's reasons and notes are plain text written for the terminal; these patterns
# turn their formula fragments into mathematics (anything else is escaped as text).
_PROSE_MATH = [
    (re.compile(r"det M_\{L-1\}"), lambda m: r"$\det M_{L-1}$"),
    (re.compile(r"M_\{L-1\} z_L\^T"), lambda m: r"$M_{L-1} z_L$"),
    (re.compile(r"M_\{L-1\}"), lambda m: r"$M_{L-1}$"),
    (re.compile(r"skip <= 0"), lambda m: r"skip $c_l \le 0$"),
    (re.compile(r"noise > 0"), lambda m: r"noise $\Delta > 0$"),
    (re.compile(r"\b([A-Za-z]) = (\d+)\b"), lambda m: f"${m.group(1)} = {m.group(2)}$"),
    (re.compile(r"'(\w+)'"), lambda m: r"\texttt{" + _esc(m.group(1)) + "}"),
    (re.compile(r"\b([zuvh])_(\d+)\b"), lambda m: f"${m.group(1)}_{{{m.group(2)}}}$"),
    (re.compile(r"\bZ\b"), lambda m: "$Z$"),
]


def _prose(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        best = None
        for pat, fn in _PROSE_MATH:
            m = pat.search(text, i)
            if m and (best is None or m.start() < best[0].start()):
                best = (m, fn)
        if best is None:
            out.append(_esc(text[i:]))
            break
        m, fn = best
        out.append(_esc(text[i:m.start()]) + fn(m))
        i = m.end()
    return "".join(out)


def _tex(v) -> str:
    return sp.latex(param_symbol(v))


def _times(v) -> str:
    """A factor in front of a product: empty for 1, ``\\beta\\,`` otherwise."""
    s = param_symbol(v)
    if s == 1:
        return ""
    return sp.latex(s) + r"\, "


def _plus_skip(c) -> str:
    s = param_symbol(c)
    if s == 0:
        return ""
    if s == 1:
        return " + I"
    return f" + {sp.latex(s)}\\, I"


def _activation(act: str, beta, inner: str) -> str:
    if act == "linear":
        return _times(beta) + inner
    return rf"\operatorname{{{act}}}\big({_times(beta)}{inner}\big)"


# ----------------------------------------------------------------------------- front: the model


def _heads_term(spec: AttentionSpec, l: int, layer, mix: str | None) -> tuple[list[str], str]:
    """Query definitions of layer l and its attention matrix S_l as LaTeX.

    ``mix`` is the mixing product the layer's tokens have gone through (None: the input)."""
    L = len(spec.layers)
    lines, terms = [], []
    for j in range(layer.heads):
        # layer (and head) upstairs: h_a is an entry of h in the reduction section
        sup = f"({l})" if layer.heads == 1 else f"({l},{j + 1})"
        if layer.tied:
            z = _block_name(spec, l, j, "w")
            if mix is None:
                q = k = z
            else:
                q = k = "h" if (l == L and layer.heads == 1) else f"h^{{{sup}}}"
                lines.append(f"{q}{'(M)' if spec.shared_flow else ''} &= {mix}\\, {z}")
        else:
            zq, zk = _block_name(spec, l, j, "q"), _block_name(spec, l, j, "k")
            if mix is None:
                q, k = zq, zk
            else:
                q, k = f"q^{{{sup}}}", f"k^{{{sup}}}"
                arg = "(M)" if spec.shared_flow else ""
                lines.append(f"{q}{arg} &= {mix}\\, {zq}, \\quad {k}{arg} = {mix}\\, {zk}")
        kt = f"{{{k}}}^\\top" if "^" in k else f"{k}^\\top"  # (z^K)^T without a double superscript
        terms.append(_activation(layer.activation, layer.beta, f"{q} {kt}"))
    weights = [param_symbol(a) for a in layer.head_weights()]
    H = layer.heads
    if H == 1:
        S = terms[0]
    elif all(w == sp.Rational(1, H) for w in weights):
        S = rf"\frac{{1}}{{{H}}}\Big(" + " + ".join(terms) + r"\Big)"
    else:
        S = " + ".join(f"{sp.latex(w)}\\, {t}" for w, t in zip(weights, terms))
    return lines, S


def _limit_mixing(d: Derivation) -> tuple[str, str]:
    """The coefficients of I and 11^T in the large-depth limit's mixing Mbar (8 digits in prose)."""
    M = d.reduction.mixing if d.reduction is not None else None
    if M is None:
        from .symbolic import initial_mixing

        M = initial_mixing(d.spec)
    return f"{float(M[0, 0] - M[0, 1]):.8f}", f"{float(M[0, 1]):.8f}"  # Mbar = (a - b) I + b 11^T


def _limit_error(d: Derivation) -> str:
    from .depth import mean_field_mixing

    layer = d.spec.layers[0]
    err = mean_field_mixing(d.spec.depth_limit_tau, float(layer.beta), d.spec.tokens, layer.activation).error
    mant, exp = f"{err:.1e}".split("e")
    return f"error at most ${mant} \\times 10^{{{int(exp)}}}$"


def _mix(l: int) -> str:
    """The mixing product after l layers as the model section names it (M_1 is A_1)."""
    return "A_{1}" if l == 1 else f"M_{{{l}}}"


def model_lines(d: Derivation) -> list[str]:
    """The model as aligned formulas, one layer after the other (the paper's notation)."""
    spec = d.spec
    if not isinstance(spec, AttentionSpec):
        return _smi_model_lines(d)
    if spec.shared_flow:
        lines, S = _heads_term(spec, 1, spec.layers[0], "M")
        lines.append(f"S(M) &= {S}")
        lines.append(r"\frac{dM}{dt} &= S(M)\, M, \qquad M(0) = I, \quad 0 \le t \le " + _tex(spec.tau))
        lines.append(f"y &= {'S(M(' + _tex(spec.tau) + '))' if spec.output == 'attention' else 'M(' + _tex(spec.tau) + ')'}")
        return lines + _noise_lines(d)
    if spec.depth_limit_tau is not None:
        layer = spec.layers[0]
        z = _block_name(spec, 1, 0, "w")
        a, b = _limit_mixing(d)
        hh = r"h h^\top"
        return [rf"h &= \bar M\, {z}, \qquad \bar M = {a}\, I + {b}\, \mathbf 1 \mathbf 1^\top",
                "y &= " + _activation(layer.activation, layer.beta, hh)] + _noise_lines(d)
    L = len(spec.layers)
    simple = all(ly.tied and ly.heads == 1 for ly in spec.layers)
    lines, mix = [], None
    for l, layer in enumerate(spec.layers, start=1):
        q_lines, S = _heads_term(spec, l, layer, mix)
        lines += q_lines
        if l == L and spec.output == "attention":
            lines.append(f"y &= {S}")
            break
        args = ""
        if simple:
            args = "(" + (", ".join(f"z_{{{i}}}" for i in range(1, l + 1)) if l <= 3 else f"z_1, \\dots, z_{{{l}}}") + ")"
        lines.append(f"A_{{{l}}}{args} &= {S}{_plus_skip(layer.skip)}")
        if l == 1:
            mix = "A_{1}"
        else:
            lines.append(f"M_{{{l}}} &= A_{{{l}}}\\, {mix}")
            mix = f"M_{{{l}}}"
    if spec.output == "tokens":
        lines.append(f"y &= {mix}")
    return lines + _noise_lines(d)


def _noise_lines(d: Derivation) -> list[str]:
    if param_symbol(d.spec.noise) == 0:
        return []
    return [rf"y_{{\rm obs}} &= y + \sqrt{{{_tex(d.spec.noise)}}}\, \xi, \qquad \xi \sim \mathcal N(0, I)"]


def _smi_model_lines(d: Derivation) -> list[str]:
    from dataclasses import replace

    from .parse import parse_link

    spec = d.spec
    names = _names(d)
    act = getattr(spec, "activation", "linear")
    g = d.link
    if act != "linear":  # print the logits, then the row activation
        g = sp.Matrix(parse_link(replace(spec, activation="linear")))
    rows, cols = g.shape
    out_name = "y" if act == "linear" else "H"
    lines = []
    if rows * cols == 1:
        lines += broken_lines(out_name, g[0, 0], names, _WIDTH)
    else:
        one = min(rows, cols) == 1
        for a in range(rows):
            for b in range(cols):
                sub = f"{a + b + 1}" if one else f"{a + 1}{b + 1}"
                lines += broken_lines(f"{out_name}_{{{sub}}}", g[a, b], names, _WIDTH)
    if act != "linear":
        lines.append(rf"y &= \operatorname{{{act}}}(H)")
    return lines + _noise_lines(d)


def _names(d: Derivation) -> dict:
    from .latexutil import symbol_names

    exprs = list(d.link) + [e for _, e in d.program.defs]
    return symbol_names(exprs, _program_names(d), True, d.p, d.tokens)


def _program_names(d: Derivation) -> dict:
    """The program's LaTeX names, with the logits renamed Lambda (A_l is the mixing matrix in
    the model section, as in the paper)."""
    names = {s: re.sub(r"^A\^", r"\\Lambda^", n) for s, n in d.program.latex_names.items()}
    if isinstance(d.spec, AttentionSpec) and d.spec.shared_flow:
        # the flow's per-stage names carry (0-based step, stage): number steps from 1 like M^{(n)}
        names = {s: re.sub(r"\^\{\((\d+),(\d+)\)\}", lambda m: f"^{{({int(m.group(1)) + 1},{m.group(2)})}}", n)
                 for s, n in names.items()}
    return names


def model_section(d: Derivation) -> str:
    spec = d.spec
    out = [r"\section*{Model}"]
    if isinstance(spec, AttentionSpec):
        out.append(_attention_intro(d))
        out.append(_align(model_lines(d)))
        acts = {ly.activation for ly in spec.layers}
        defs = []
        if "softmax" in acts:
            defs.append(r"$\operatorname{softmax}(X)_{ab} = e^{X_{ab}} / \sum_{b'} e^{X_{ab'}}$")
        if "hardmax" in acts:
            defs.append(r"$\operatorname{hardmax}(X)_{ab} = \mathbf 1[b = \arg\max_{b'} X_{ab'}]$")
        if defs:
            out.append(" and ".join(defs) + (" act" if len(defs) > 1 else " acts") + " on rows.")
        if spec.depth_limit_tau is not None:
            tau = _tex(spec.depth_limit_tau)
            act = spec.layers[0].activation
            out.append(
                f"Large-depth limit with separate weights per layer: $L$ layers, skip $c = L/\\tau$, each layer divided "
                f"by $c$ ($M_l = (I + \\tfrac{{\\tau}}{{L}} S_l) M_{{l-1}}$), here $\\tau = {tau}$. As $L \\to \\infty$ "
                f"the first layers' mixing $M_{{L-1}}$ converges (bias $O(1/L)$, fluctuations $O(L^{{-1/2}})$) to the "
                f"solution $\\bar M = M(\\tau)$ of the mean-field flow "
                f"$\\dot M = \\mathbb E_{{z\\sim\\mathcal N(0, I_T)}}[\\operatorname{{{act}}}(\\beta\\, (Mz)(Mz)^\\top)]\\, M$, "
                f"$M(0) = I$ (here $\\beta = {_tex(spec.layers[0].beta)}$), computed numerically ({_limit_error(d)}); "
                f"$z_1$ is the last layer's index.")
        if spec.shared_flow:
            out.append(
                f"Weight-shared flow (not the large-depth limit with separate weights): one layer's weights are shared across $L$ layers with skip $L/{_tex(spec.tau)}$ "
                f"and attention scaled by ${_tex(spec.tau)}/L$; as $L\\to\\infty$ the mixing product solves the flow "
                f"above. The link integrates it with {spec.depth_steps} classical Runge--Kutta steps "
                f"(error $O(({_tex(spec.tau)}/{spec.depth_steps})^4)$).")
    else:
        T = d.tokens
        out.append(("A sequence multi-index model" if T > 1 else "A multi-index model")
                   + f" with $p = {d.p}$ ind{'ices' if d.p > 1 else 'ex'} and $T = {T}$ token{'s' if T > 1 else ''}, "
                   + (r"$Z \in \mathbb R^{p\times T}$, entries $z_{k,t}$ (row $k$, token $t$):"
                      if T > 1 else ("$z \\in \\mathbb R$:" if d.p == 1 else r"$z \in \mathbb R^{p}$:")))
        out.append(_align(model_lines(d)))
    return "\n".join(out) + "\n"


def _attention_intro(d: Derivation) -> str:
    spec = d.spec
    T = spec.tokens
    L = 1 if spec.shared_flow else len(spec.layers)
    blocks = [name for name, _ in _blocks(d)]
    ranks = {ly.rank for ly in spec.layers}
    shape = r"\mathbb R^{T}" if ranks == {1} else r"\mathbb R^{T\times r_l}"
    w_shape = r"\mathbb R^{d}" if ranks == {1} else r"\mathbb R^{d\times r_l}"
    text = (f"Input $x \\in \\mathbb R^{{d\\times T}}$, $T = {T}$ tokens as columns; "
            f"one weight matrix $W \\in {w_shape}$ per index block, "
            f"$z = x^\\top W/\\sqrt d \\in {shape}$: "
            + ", ".join(f"${b}$" for b in blocks) + ". ")
    if spec.shared_flow or spec.depth_limit_tau is not None:
        return text
    if ranks != {1}:
        text += "Ranks " + ", ".join(f"$r_{{{l}}} = {ly.rank}$" for l, ly in enumerate(spec.layers, 1)) + ". "
    if any(ly.heads > 1 for ly in spec.layers):
        text += ("Heads: " + ("each reads a disjoint $d/H$-coordinate chunk of $x$ (same link). "
                              if spec.head_mode == "split" else "each reads all of $x$. "))
    if L == 1 and spec.output == "attention":  # no mixing matrix: the output is the attention itself
        return text + "The model reads:"
    text += (r"Layer $l$ updates the tokens as $x^{(l)} = x^{(l-1)} A_l^\top$ with mixing matrix "
             r"$A_l = S_l + c_l I$ (attention $S_l$)")
    if L > 1:
        text += "; in the indices of the input tokens ($M_l = A_l \\cdots A_1$) the model reads"
    return text + ":"


# ----------------------------------------------------------------------------- front: SMI form


def counting_lines(d: Derivation) -> list[str]:
    """The counting bound of perfect recovery (theory section 4), one sentence: m = generic rank
    of dy/dZ and alpha_PR = p/m, or why there is none."""
    c = d.counting
    m = c["m"]
    if m is None:
        return [r"Counting: the generic rank of $\partial y/\partial Z$ was not determined."]
    head = rf"Counting: $m = \operatorname{{rank}} \partial y/\partial Z = {m}$"
    if m == 0:
        return [head + r" (discrete output): never recovered perfectly."]
    if c["alpha_pr"] is None:
        return [head + r"; with output noise there is no perfect recovery."]
    tail = rf"; perfect recovery needs $\alpha \ge \alpha_{{\rm PR}} = p/m = {sp.latex(sp.Rational(d.p, m))}$"
    if isinstance(d.spec.noise, str):
        tail += rf" (at ${sp.latex(sp.Symbol(d.spec.noise))} = 0$)"
    return [head + tail + "."]


def smi_section(d: Derivation) -> str:
    spec = d.spec
    out = [r"\section*{SMI form}"]
    if isinstance(spec, AttentionSpec):
        blocks = r" \;\allowbreak ".join(name for name, _ in _blocks(d))
        inter = _intermediates(d)
        out.append(
            f"A sequence multi-index model $y = g(Z)$ with $p = {d.p}$, $T = {d.tokens}$: "
            f"$Z^\\top = ({blocks}) \\in \\mathbb R^{{T\\times p}}$ stacks the index blocks, "
            f"so row $k$ of $Z \\in \\mathbb R^{{p\\times T}}$ is one index and $z_{{k,t}} = Z_{{kt}}$. "
            f"$g$ is the composition above"
            + (f", with named intermediates {inter}" if inter else "")
            + f"; $y \\in \\mathbb R^{{{d.tokens}\\times {d.tokens}}}$.")
    else:
        shape = "\\times".join(map(str, d.output_shape))
        out.append(f"$y = g(Z)$ with $Z \\in \\mathbb R^{{{d.p}\\times {d.tokens}}}$, "
                   + (f"$y \\in \\mathbb R^{{{shape}}}$." if shape else "$y \\in \\mathbb R$."))
    out += counting_lines(d)  # the counting result (m, alpha_PR) joins the SMI form here
    return "\n".join(out) + "\n"


def _intermediates(d: Derivation) -> str:
    """The names the model section defines (A_1, h, M_2, ...), in order."""
    names = []
    for ln in model_lines(d):
        for eq in ln.split(r"\quad "):  # "q^{(2)} &= A_1 z_2^Q, \quad k^{(2)} = A_1 z_2^K"
            lhs = re.sub(r"\(.*\)$", "", eq.split("=")[0].replace("&", "").strip())
            if lhs and lhs not in ("y", r"y_{\rm obs}") and "=" in eq and not lhs.startswith("\\"):
                names.append(f"${lhs}$")
    return ", ".join(dict.fromkeys(names))


# ----------------------------------------------------------------------------- front: symmetries


def symmetry_section(d: Derivation) -> str:
    out = [r"\section*{Symmetries}"]
    if not d.symmetries:
        out.append("No sign flip of an index block leaves $g$ invariant.")
        return "\n".join(out) + "\n"
    blocks = _blocks(d)
    flips = []
    for s in d.symmetries:
        rows = set(s["rows"])
        if rows == set(range(d.p)) and len(blocks) > 1:
            flips.append(r"Z \mapsto -Z")
            continue
        names = [n for n, r in blocks if set(r) <= rows]
        if len(names) == 1:
            flips.append(f"{names[0]} \\mapsto -{names[0]}")
        else:  # (\allowbreak: a flip of many blocks may run over a line)
            flips.append("(" + r",\allowbreak " .join(names) + r") \mapsto \allowbreak ("
                         + r",\allowbreak ".join("-" + n for n in names) + ")")
    out.append("$g$ is invariant under " + ", ".join(f"${f}$" for f in dict.fromkeys(flips))
               + " (each checked at random points).")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- front: reduction

_GOUT = (r"g_{\rm out} = V^{-1}\big(\mathbb E[Z \mid y] - \omega\big)",
         r"\partial_\omega g_{\rm out} = V^{-1}{\rm Cov}(Z_{\cdot t}, Z_{\cdot s} \mid y)\, V^{-1} - \delta_{ts} V^{-1}")
_GAUSS_T = (r"$\mathcal N(Z;\omega,V) = \prod_{t=1}^{T} \mathcal N(Z_{\cdot t};\omega_{\cdot t},V)$ "
            r"(tokens independent, $V \in \mathbb R^{p\times p}$)")
_GAUSS_1 = r"$\mathcal N(Z;\omega,V)$ the Gaussian density of $Z$ with mean $\omega$ and covariance $V$"


def _inverse_map_lines(red) -> list[str]:
    beta = red.beta
    b = "" if beta == 1 else sp.latex(beta)
    if red.activation == "softmax":
        ll = r"\ell_{ab} + \ell_{ba}"
        n = r"\ell_{1a} - \ell_{a1} + \ell_{ab}"
        gap = f"({ll})" if beta == 1 else rf"\frac{{{ll}}}{{{b}}}"
        nab = n if beta == 1 else rf"\frac{{{n}}}{{{b}}}"
        return [
            rf"\ell_{{ab}} &= \log\frac{{y_{{ab}}}}{{y_{{aa}}}} = {_times(beta)}h_a (h_b - h_a), \qquad "
            rf"(h_a - h_b)^2 = -{gap}",
            rf"G &= h h^\top = h_1^2\, \mathbf 1 \mathbf 1^\top + N, \qquad N_{{ab}} = {nab}, \qquad "
            r"h_1^2 = \frac{N_{ab}^2 - N_{aa} N_{bb}}{(h_a - h_b)^2} \quad (a \ne b)",
            r"h &= \pm\, G_{\cdot 1} / \sqrt{G_{11}}",
        ]
    g = "y" if beta == 1 else rf"y / {b}"
    return [rf"G &= h h^\top = {g}, \qquad h = \pm\, G_{{\cdot 1}} / \sqrt{{G_{{11}}}}"]


def reduction_lines(d: Derivation) -> list[str]:
    """The reduction as aligned formulas (inverse output map, solved block, reduced integral)."""
    red = d.reduction
    if red is None:
        return [r"Z_{\rm out}(y;\omega,V) &= \int \mathcal N(Z;\omega,V)\, "
                r"\mathcal N\big(y; g(Z), \Delta I\big)\, dZ"]
    if red.kind == "attention-rank1":
        lines = _inverse_map_lines(red)
        if len(d.spec.layers) == 1 and d.spec.depth_limit_tau is not None:
            lines.append(r"Z_{\rm out}(y;\omega,V) &= \frac{1}{|\det \bar M|} \sum_{s=\pm 1} "
                         r"\mathcal N\big(s\, (\bar M^{-1} h)^\top;\omega,V\big)")
            return lines
        if len(d.spec.layers) == 1:
            lines.append(r"Z_{\rm out}(y;\omega,V) &= \sum_{s=\pm 1} \mathcal N(s\, h^\top;\omega,V)")
            return lines
        L = len(d.spec.layers)
        last = _blocks(d)[-1][0]
        lines.append(f"{last} &= s\\, {_mix(L - 1)}(u)^{{-1}} h, \\qquad s = \\pm 1")
        lines.append(r"Z_{\rm out}(y;\omega,V) &= \sum_{s=\pm 1} \int_{\mathbb R^{" + str(red.integral_dim)
                     + r"}} \mathcal N\big(Z_s(u);\omega,V\big)\, \frac{du}{|\det " + _mix(L - 1) + r"(u)|}")
        return lines
    if red.kind == "attention-untied":
        return _untied_lines(d)
    if red.kind == "hardmax-wedge":
        return [r"Z_{\rm out}(y;\omega,V) &= \int_{W_y} \mathcal N(Z;\omega,V)\, dZ"]
    if red.kind == "hardmax-wedge-mixed":
        return [r"Z_{\rm out}(y;\omega,V) &= \int_{\mathbb R^2} \prod_t \mathcal N(u_t;\omega_{1t},V_{11})\, "
                r"\Pr\big[z_2 \in M_1(u)^{-1} W_y \,\big|\, u\big]\, du"]
    if red.kind == "halfspace":
        return [r"Z_{\rm out}(y;\omega,V) &= \Phi\big(y\,\omega / \sqrt V\big)"]
    # "solve": branches of an explicit inverse
    zs = [z_name(k, t, d.p, d.tokens) for k, t in red.solved]
    du = (r"\, ds" if red.log_free else r"\, du") if red.integral_dim else ""
    integral = r"\int " if red.integral_dim else ""
    out = _short_branches(d)
    if not out:  # too long for the front: named here, written out in Appendix C
        out = [f"{', '.join(zs)} &= {', '.join(z + '^{(i)}' for z in zs)}(y{', u' if red.integral_dim else ''}), "
               r"\qquad i = 1, \dots, " + str(len(red.branches))]
    return out + [r"Z_{\rm out}(y;\omega,V) &= \sum_{i} " + integral
                  + r"\mathcal N\big(Z^{(i)};\omega,V\big)\, J^{(i)}" + du]


def _untied_lines(d: Derivation) -> list[str]:
    """Generalised reduction of an untied last layer (symbolic._untied_reduction)."""
    red = d.reduction
    L = len(d.spec.layers)
    names = {tuple(rows): n for n, rows in _blocks(d)}
    zq = names[(red.solved[0][0],)]
    zk = names[(red.marginal[0][0],)]
    M = _mix(L - 1) + "(u)" if L > 1 else "I"
    b = _times(red.beta)
    return [
        rf"\ell_{{ab}} &= \log\frac{{y_{{ab}}}}{{y_{{aa}}}} = {b}q_a (k_b - k_a), \qquad q = {M} {{{zq}}}^\top, \quad "
        rf"k = {M} {{{zk}}}^\top",
        rf"R_{{ab}} &= \ell_{{ab}} - \ell_{{a1}} = {b}q_a d_b, \quad d = D k = (k_b - k_1)_{{b \ge 2}}, \qquad "
        r"R = \hat q\, \hat e^\top \ (|\hat e| = 1,\ \hat e_1 > 0)",
        r"q &= \hat q / \lambda, \quad d = \lambda \hat e, \qquad \lambda = \pm e^{s + s_0}, \quad "
        r"s_0 = \tfrac14 \log\big(|\hat q|^2 / T\big)",
        rf"{{{zq}}}^\top &= {M}^{{-1}} \hat q / \lambda, \qquad F(u)\, {{{zk}}}^\top = \lambda \hat e, \quad F = D {M}",
        r"Z_{\rm out}(y;\omega,V) &= \sum_{\pm} \int_{\mathbb R^{" + str(red.integral_dim) + r"}} "
        rf"\mathcal N\big(Z_{{\setminus {zk}}};\omega,V\big)\, \mathcal N\big(\lambda \hat e; F \mu_K, "
        rf"\sigma_K^2 F F^\top\big)\, \frac{{du\, ds}}{{|\lambda|\, |\det {M}|}}",
    ]


def _short_branches(d: Derivation) -> list[str]:
    """The branches of a solved scalar inverse written out, when they are short enough for the
    front section (y = |z|: z = -y, y); [] otherwise."""
    red = d.reduction
    if len(red.solved) != 1:
        return []
    from .latexutil import symbol_names

    names = symbol_names([e for br in red.branches for e in br], _names(d), True, d.p, d.tokens)
    for i in red.log_free:  # the slot of a log-integrated entry carries s = log|u|
        names[d.Z[red.free[i]]] = "s"
    z = z_name(*red.solved[0], d.p, d.tokens)
    sols = [sp.latex(br[0], symbol_names=names) for br in red.branches]
    jac = [sp.latex(sp.exp(lj), symbol_names=names) for lj in red.log_jacobian]
    if sum(tex_width(x) for x in sols + jac) > 40:
        return []
    line = r", \quad ".join(f"{z}^{{({i + 1})}} = {x}" for i, x in enumerate(sols))
    js = (f"J^{{(i)}} = {jac[0]}" if len(set(jac)) == 1 else
          r", \quad ".join(f"J^{{({i + 1})}} = {x}" for i, x in enumerate(jac)))
    first, rest = line.split(" = ", 1)
    return [f"{first} &= {rest}, \\qquad {js}"]


def reduction_section(d: Derivation) -> str:
    red = d.reduction
    out = [r"\section*{Reduction of the denoiser}"]
    gout = f"${_GOUT[0]}$ and ${_GOUT[1]}$"
    _GAUSS = _GAUSS_T if d.tokens > 1 else _GAUSS_1
    if red is None:
        reason = d.reduction_reason
        reason = reason[len("no exact reduction: "):] if reason.startswith("no exact reduction: ") else reason
        if reason.startswith("noisy channel"):  # a noisy output is integrated as it is: no reason to give
            out.append(f"The output is observed with noise of variance $\\Delta$; the denoiser integrates "
                       f"the noisy channel over all of $Z$, with {_GAUSS}:")
        else:
            out.append(f"No exact reduction: {_prose(reason)}. The denoiser integrates the noisy channel "
                       f"(output noise of variance $\\Delta > 0$) over all of $Z$, with {_GAUSS}:")
        out.append(_align(reduction_lines(d)))
        out.append(f"and {gout}.")
        return "\n".join(out) + "\n"
    if red.kind == "attention-rank1":
        L = len(d.spec.layers)
        last = _blocks(d)[-1][0]
        limit = d.spec.depth_limit_tau is not None
        h_is = (f"$h = \\bar M {last}$" if limit else f"$h = {last}$") if L == 1 else f"$h = {_mix(L - 1)} {last}$"
        out.append(f"The last layer is tied, single-head and rank one with {red.activation} activation, so "
                   f"$y = {'S_{' + str(L) + '}' if L > 1 else 'S_1'}$ determines {h_is} up to a global sign "
                   f"(inverse output map; $\\ell$, $N$, $G$ are $T\\times T$):")
        lines = reduction_lines(d)
        if L == 1:
            out.append(_align(lines[:-1]))
            out.append(f"Hence the posterior of $Z = {last}^\\top$ is two points and, with {_GAUSS},")
            out.append(_align(lines[-1:]))
        else:
            free = [n for n, _ in _blocks(d)[:-1]]
            out.append(_align(lines[:-2]))
            u = free[0] if len(free) == 1 else "(" + ", ".join(free) + ")"
            out.append(f"The last block enters linearly and is solved given the earlier layers' indices "
                       f"$u = {u} \\in \\mathbb R^{{{red.integral_dim}}}$:")
            out.append(_align(lines[-2:-1]))
            out.append(f"With $Z_s(u)$ the index matrix with these blocks and {_GAUSS}, the denoiser is the "
                       f"{red.integral_dim}-dimensional integral")
            out.append(_align(lines[-1:]))
            prod = f"$\\det M_{{{L - 1}}} = \\prod_{{l<{L}}} \\det A_l$; " if L > 2 else ""
            out.append(f"({prod}the Jacobian of $y\\mapsto h$, "
                       r"independent of $\omega$ and $V$, is left out), and " + gout + ".")
        notes = [n for n in red.notes if not n.startswith("large-depth limit")]  # said in the model section
        if notes:
            out.append("Note: " + "; ".join(_prose(n) for n in notes) + ".")
        return "\n".join(out) + "\n"
    if red.kind == "attention-untied":
        lines = reduction_lines(d)
        names = {tuple(rows): n for n, rows in _blocks(d)}
        zq, zk = names[(red.solved[0][0],)], names[(red.marginal[0][0],)]
        free = [n for n, rows in _blocks(d) if rows[0] not in (red.solved[0][0], red.marginal[0][0])]
        u = ("(" + ", ".join(free) + ")") if free else ""
        out.append(rf"The last layer is untied, single-head and rank one with softmax activation. $y$ fixes the "
                   rf"log-ratios $\ell$ and hence the rank-one matrix $R$ of queries times key differences, up to "
                   rf"the scale $\lambda$:")
        out.append(_align(lines[:3]))
        out.append(rf"Given the earlier layers' indices $u = {u} \in \mathbb R^{{{red.integral_dim - 1}}}$ and "
                   rf"$\lambda$, the query ${zq}$ enters linearly through the square, invertible coefficient and is "
                   rf"integrated exactly; the key ${zk}$ is Gaussian given the rest and seen only through the "
                   rf"{d.tokens - 1} differences $F {{{zk}}}^\top$ ($D$: the differences $k_b - k_1$; $F\mathbf 1 = 0$), "
                   rf"so it is marginalised analytically:")
        out.append(_align(lines[3:4]))
        out.append(rf"With $\mu_K$, $\sigma_K^2$ the conditional mean (per token) and variance of ${zk}$ given the "
                   rf"other rows under $\mathcal N(\omega, V)$, the denoiser is the {red.integral_dim}-dimensional "
                   rf"integral over $(u, s)$")
        out.append(_align(lines[4:]))
        out.append(rf"(the Jacobian of $y \mapsto (\hat q, \hat e)$, independent of $\omega$ and $V$, is left out); "
                   rf"{gout}, where the posterior moments of ${zk}$ add to its conditional mean given "
                   rf"$F {{{zk}}}^\top = \lambda\hat e$ the residual covariance "
                   r"$\sigma_K^2 (I - F^\top (F F^\top)^{-1} F) = \sigma_K^2\, \mathbf 1 \mathbf 1^\top / T$.")
        return "\n".join(out) + "\n"
    if red.kind == "hardmax-wedge":
        z = _blocks(d)[0][0]
        out.append(
            f"$y = \\operatorname{{hardmax}}({_times(d.spec.layers[-1].beta)}{z} {z}^\\top)$ reveals the signs of $z_{{1,1}}(z_{{1,1}} - z_{{1,2}})$ "
            f"and $z_{{1,2}}(z_{{1,2}} - z_{{1,1}})$: $Z$ lies in the union $W_y$ of the wedges of the plane cut by "
            f"$z_{{1,1}} = 0$, $z_{{1,2}} = 0$, $z_{{1,1}} = z_{{1,2}}$ whose pattern is $y$. With {_GAUSS},")
        out.append(_align(reduction_lines(d)))
        out.append(f"in closed form in the radius and by Gauss--Legendre quadrature in the angle; {gout}.")
        return "\n".join(out) + "\n"
    if red.kind == "hardmax-wedge-mixed":
        return hardmax_mixed_section(d)
    if red.kind == "halfspace":
        z = z_name(*red.solved[0], d.p, d.tokens)
        out.append(f"$y = \\operatorname{{sign}}({z})$ confines ${z}$ to the half-space $y\\,{z} > 0$; "
                   f"with ${z} \\sim \\mathcal N(\\omega, V)$ the denoiser is in closed form:")
        out.append(_align(reduction_lines(d)))
        out.append(f"and {gout}.")
        return "\n".join(out) + "\n"
    # "solve"
    zs = [z_name(k, t, d.p, d.tokens) for k, t in red.solved]
    free = [z_name(k, t, d.p, d.tokens) for k, t in red.free]
    text = f"$y = g(Z)$ is solved for ${', '.join(zs)}$ on {len(red.branches)} branches"
    if free:
        text += f" given the free entries $u = ({', '.join(free)})$"
    text += (r"; $J^{(i)} = |\partial g/\partial " + zs[0] + r"|^{-1}$ at the branch "
             r"(entries in Appendix~C). With " + _GAUSS + ",")
    out.append(text)
    out.append(_align(reduction_lines(d)))
    if red.log_free:
        us = [free[i] for i in red.log_free]
        half = len(red.branches) // 2
        out.append(f"The integral over ${us[0]}$ is taken in $s = \\log|{us[0]}|$ on each sign "
                   f"(${us[0]} = e^s$ on branches $i \\le {half}$, $-e^s$ on the others; "
                   f"$d{us[0]} = |{us[0]}|\\, ds$): the solved entry has a pole at ${us[0]} = 0$.")
    out.append(f"Then {gout}.")
    return "\n".join(out) + "\n"


def hardmax_mixed_section(d: Derivation) -> str:
    """Region constraint of a hardmax last layer after a tied rank-one first layer, T = 2."""
    red = d.reduction
    beta = _times(red.beta)
    lines = [r"\section*{Reduction of the denoiser}",
             r"Write $u = z_1 = (z_{1,1}, z_{1,2})$ (first layer, integrated over) and $z_2$ (last layer). "
             r"The last layer sees $h = M_1(u)\, z_2$ with $M_1 = A_1$, and "
             r"$y = \operatorname{hardmax}(" + beta + r"h h^\top)$ reveals the signs of "
             r"$h_1(h_1 - h_2)$ and $h_2(h_2 - h_1)$: $h$ lies in the union $W_y$ of the wedges of the "
             r"$h$-plane cut by $h_1 = 0$, $h_2 = 0$, $h_1 = h_2$ whose hardmax pattern is $y$ "
             r"($y_{11} = y_{21} = 1$: $0 < \arg h < \pi/4$ or $\pi < \arg h < 5\pi/4$; "
             r"$y_{12} = y_{22} = 1$: $\pi/4 < \arg h < \pi/2$ or $5\pi/4 < \arg h < 3\pi/2$; "
             r"$y = I$: $h_1 h_2 < 0$; the pattern $y_{12} = y_{21} = 1$ has probability zero). "
             r"Hence $z_2 \in M_1(u)^{-1} W_y$, again a union of wedges through the origin "
             r"($\det M_1 > 0$ for $c > 0$; entries of $M_1$ in Appendix~C).",
             r"Given $u$, $z_2 \sim \mathcal N(m(u), s^2 I)$ with $m_t = \omega_{2t} + (V_{12}/V_{11})(u_t - \omega_{1t})$ "
             r"and $s^2 = V_{22} - V_{12}^2/V_{11}$ (tokens are independent), so",
             _align(reduction_lines(d)),
             r"and on a wedge $\{z_2 = s\rho\,e(\theta),\ \theta_0<\theta<\theta_1\}$, with $a = m\cdot e(\theta)/s$, "
             r"$b = m\cdot e(\theta)^\perp/s$ and $K_k(a) = \int_0^\infty \rho^k e^{-\rho^2/2 + a\rho}\,d\rho$ "
             r"($K_0 = \sqrt{2\pi}\,\Phi(a)\,e^{a^2/2}$, $K_1 = 1 + a K_0$, $K_2 = a K_1 + K_0$, $K_3 = a K_2 + 2K_1$),",
             r"\[ \mathbb E\big[\rho^{k-1} e^{\otimes(k-1)} \mathbf 1_{\rm wedge}\big] = \frac{1}{2\pi}\int_{\theta_0}^{\theta_1} "
             r"e^{-(a^2+b^2)/2} K_k(a)\, e(\theta)^{\otimes (k-1)}\,d\theta, \quad k = 1, 2, 3 . \]",
             r"The posterior mean and covariance of $Z$ give "
             f"${_GOUT[0]}$ and ${_GOUT[1]}$; "
             r"$\log Z_{\rm out}$ is the log probability of $y$."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- appendix


def link_program_lines(d: Derivation, width: float = _WIDTH_SMALL) -> list[str]:
    rows, cols = d.link.shape
    one = min(rows, cols) == 1
    named = [(f"y_{{{a + b + 1 if one else f'{a + 1}{b + 1}'}}}" if rows * cols > 1 else "y", d.link[a, b])
             for a in range(rows) for b in range(cols)]
    prog = _renamed(d.program, _program_names(d))
    return latex_program(prog, named, one_based=True, p=d.p, tokens=d.tokens, width=width)


def jacobian_lines(d: Derivation, width: float = _WIDTH_SMALL) -> list[str]:
    defs, J = d.jacobian_program
    rows, cols = d.link.shape
    named = []
    for a in range(rows):
        for b in range(cols):
            for i in range(d.p * d.tokens):
                e = J[a * cols + b][i]
                if e != 0:
                    k, t = divmod(i, d.tokens)
                    y = "y" if rows * cols == 1 else (f"y_{{{a + b + 1}}}" if min(rows, cols) == 1 else f"y_{{{a + 1}{b + 1}}}")
                    named.append((f"\\frac{{\\partial {y}}}{{\\partial {z_name(k, t, d.p, d.tokens)}}}", e))
    prog = _renamed(d.program, _program_names(d))
    prog.defs = d.program.defs + defs
    skip = {s for s, _ in d.program.defs}
    # attention links: y_ab is the intermediate S^{(L)}_ab, so its derivatives are those of the
    # intermediate; one line with generic indices says so instead of one alias line per entry
    link = list(d.link)
    alias = all(isinstance(g, sp.Symbol) and g.name.startswith("_") for g in link) and all(
        e == 0 or (isinstance(e, sp.Symbol) and e.name == f"_d{link[j // (d.p * d.tokens)].name}__{j % (d.p * d.tokens)}")
        for j, e in enumerate(x for row in J for x in row))
    lines = latex_program(prog, named, 30000, one_based=True, p=d.p, tokens=d.tokens, width=width, skip=skip)
    generic = re.sub(r"_\{11\}$", "_{ab}", _program_names(d).get(link[0], ""))
    if alias and rows * cols > 1 and generic.endswith("_{ab}"):
        lines = [ln for ln in lines if not ln.startswith(r"\frac{\partial y_")]
        lines.append(rf"\frac{{\partial y_{{ab}}}}{{\partial z_{{k,t}}}} &= \partial_{{z_{{k,t}}}} {generic}")
    return lines


def reduction_detail_lines(d: Derivation, width: float = _WIDTH_SMALL) -> list[str]:
    red = d.reduction
    if red is None or not (red.branches or red.mixing is not None):
        return []
    prog = _renamed(d.program, _program_names(d))
    named = []
    L = len(d.spec.layers) if isinstance(d.spec, AttentionSpec) else 0
    det = None
    if red.mixing is not None and L > 1:
        mix = red.mixing
        T = mix.shape[0]
        named += [(f"(M_{{{L - 1}}})_{{{a + 1}{b + 1}}}", mix[a, b]) for a in range(T) for b in range(T)]
        det = sp.Symbol("_detM", real=True)
        prog.latex_names[det] = "D"
        named.append((f"D = \\det M_{{{L - 1}}}", red.det_mixing))
    sub = {red.det_mixing: det} if det is not None else {}
    if red.kind == "attention-rank1":
        for i, br in enumerate(red.branches):
            for (k, t), e in zip(red.solved, br):
                named.append((f"{z_name(k, t, d.p, d.tokens)}^{{({'+-'[i]})}}", e.xreplace(sub)))
        if det is not None:  # log J = -log|det M_{L-1}| on both branches (symbolic._attention_reduction)
            named.append((r"\log J", -sp.log(sp.Abs(det))))
    elif red.kind == "attention-untied":
        for i, br in enumerate(red.branches):
            for (k, t), e in zip(list(red.solved) + list(red.marginal), br):
                named.append((f"{z_name(k, t, d.p, d.tokens)}^{{({'+-'[i]})}}", e.xreplace(sub)))
            named.append((f"\\log J^{{({'+-'[i]})}}", red.log_jacobian[i].xreplace(sub)))
        for a in red.aux:
            prog.latex_names[a] = "s"
        for o in red.obs:
            stem, i = o.name.split("_")
            prog.latex_names[o] = f"\\hat {stem[0]}_{{{int(i) + 1}}}"
    elif red.branches:
        for i, br in enumerate(red.branches):
            for (k, t), e in zip(red.solved, br):
                named.append((f"{z_name(k, t, d.p, d.tokens)}^{{({i + 1})}}", e))
            named.append((f"\\log J^{{({i + 1})}}", red.log_jacobian[i]))
        for i in red.log_free:  # the slot of a log-integrated entry carries s = log|u|
            k, t = red.free[i]
            prog.latex_names[d.Z[k, t]] = "s"
    if det is not None:
        prog.defs = prog.defs + [(det, red.det_mixing)]
    # the link's intermediates are printed in Appendix A already
    skip = {s for s, _ in d.program.closure(list(d.link))} | ({det} if det is not None else set())
    return latex_program(prog, named, one_based=True, p=d.p, tokens=d.tokens, width=width, skip=skip)


def _renamed(program, names: dict) -> Program:
    prog = Program()
    prog.defs = list(program.defs)
    prog.latex_names = dict(names)
    return prog


def appendix_section(d: Derivation) -> str:
    out = [r"\clearpage", r"\section*{Appendix A. The link as a straight-line program}"]
    if isinstance(d.spec, AttentionSpec):
        out.append(r"The code evaluates $g$ through these named intermediates; $X^{(l)}_{ab}$ is entry $(a, b)$ of "
                   r"the matrix $X_l$ of layer $l$: queries $q$ (and keys $k$), logits $\Lambda_l$, attention "
                   r"$S_l$ and mixing products $M_l$ (a second superscript index is the head).")
    else:
        out.append(r"The link as the code evaluates it:")
    if isinstance(d.spec, AttentionSpec) and d.spec.shared_flow:
        out.append(r"In the flow, a superscript $(n, k)$ is stage $k$ of Runge--Kutta step $n$ "
                   r"($\mathrm{Y}$ the stage's argument, $\mathrm{F} = S\,\mathrm{Y}$ its slope), "
                   r"$M^{(n)}$ the mixing product after step $n$ and $(\tau)$ the output layer.")
    out.append(_align(link_program_lines(d), small=True))
    out.append(r"\section*{Appendix B. The Jacobian $\partial g/\partial Z$}")
    out.append(r"Forward-mode chain rule through the program of Appendix A: $\partial_{z_{k,t}} X$ is the "
               r"derivative of the intermediate $X$ with respect to $z_{k,t}$; entries not listed vanish."
               if d.tokens > 1 else
               r"Forward-mode chain rule through the program of Appendix A; entries not listed vanish.")
    out.append(_align(jacobian_lines(d), small=True))
    detail = reduction_detail_lines(d)
    if detail:
        out.append(r"\section*{Appendix C. The reduction entry by entry}")
        out.append(r"Solved entries on each branch (superscript) and the log of the weight factor, in terms "
                   r"of the intermediates of Appendix A.")
        out.append(_align(detail, small=True))
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- document, parts


def _title(d: Derivation) -> str:
    spec = d.spec
    if isinstance(spec, AttentionSpec):
        what = (f"Large-depth limit of attention, $T = {spec.tokens}$" if spec.shared_flow else
                f"Deep attention: $L = {len(spec.layers)}$ layer{'s' if len(spec.layers) > 1 else ''}, "
                f"$T = {spec.tokens}$ tokens")
    else:
        what = "Sequence multi-index model" if d.tokens > 1 else "Multi-index model" if d.p > 1 else "Generalised linear model"
    return (r"\begin{center}{\Large " + what + r"}\\[3pt]"
            + f"{{\\small aimsym derivation \\texttt{{{_esc(spec.name)}}}, spec hash {spec.hash()}}}"
            + r"\end{center}" + "\n")


def front(d: Derivation) -> str:
    """The front section: model, SMI form, symmetries, reduction (the paper's notation)."""
    return "\n".join([model_section(d), smi_section(d), symmetry_section(d), reduction_section(d)])


def document(d: Derivation, appendix: bool = True, theory: bool = True) -> str:
    """The self-contained LaTeX document: front section, then (unless ``theory=False``) the
    model's state evolution, free entropy, weak-recovery operator, counting threshold and closed
    forms (:mod:`aimsym.derive.latex_theory`), then (unless ``appendix=False``) the program, the
    Jacobian and the reduction entry by entry."""
    parts = [_PREAMBLE, _title(d), front(d)]
    if theory:
        parts.append(theory_sections(d))
    if appendix:
        parts.append(appendix_section(d))
    parts.append("\\end{document}\n")
    return "\n".join(parts)


PARTS = {
    "model": model_lines,
    "link": link_program_lines,
    "reduction": reduction_lines,
    "jacobian": jacobian_lines,
    "state-evolution": se_lines,
    "free-entropy": free_entropy_lines,
    "operator": operator_lines,
}


def part(d: Derivation, name: str) -> str:
    """One numbered ``align`` block for pasting: ``model``, ``link``, ``reduction``, ``jacobian``,
    ``state-evolution``, ``free-entropy``, ``operator`` (the weak-recovery operator at Q = 0).

    Continuation lines of a broken formula carry ``\\nonumber``."""
    from ..errors import SpecError

    if name not in PARTS:
        raise SpecError("latex-part", f"must be one of {', '.join(PARTS)}; got {name!r}")
    lines = [ln + r" \nonumber" if ln.startswith(r"&\quad") else ln for ln in PARTS[name](d)]
    return _align(lines, star=False)
