"""LaTeX export of a derivation: architecture, link, Jacobian, reduction, denoiser integral.

Every formula is printed from the SymPy objects of :mod:`aimsym.symbolic`, the same ones the
code generator turns into kernels.
"""

from __future__ import annotations

import sympy as sp

from .latexutil import latex, latex_program
from .spec import AttentionSpec
from .symbolic import Derivation

_PREAMBLE = r"""\documentclass[11pt]{article}
\usepackage{amsmath,amssymb}
\usepackage[margin=2cm]{geometry}
\allowdisplaybreaks
\begin{document}
"""


def _align(lines: list[str]) -> str:
    if not lines:
        return ""
    return "\\begin{align*}\n" + " \\\\\n".join(lines) + "\n\\end{align*}\n"


_TEX_SPECIAL = {"\\": r"\textbackslash{}", "_": r"\_", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#",
                "{": r"\{", "}": r"\}", "^": r"\textasciicircum{}", "~": r"\textasciitilde{}"}


def _esc(text: str) -> str:
    """Plain text (names, reasons) made safe for LaTeX."""
    return "".join(_TEX_SPECIAL.get(ch, ch) for ch in text)


def architecture_section(d: Derivation) -> str:
    spec = d.spec
    out = [r"\section*{Architecture}", ""]
    if isinstance(spec, AttentionSpec):
        out.append(
            f"Deep attention, $T = {spec.tokens}$ tokens, $L = {len(spec.layers)}$ layers, "
            f"output \\texttt{{{spec.output}}}, heads mode \\texttt{{{spec.head_mode}}}."
        )
        out.append(r"\begin{center}\begin{tabular}{cccccc}")
        out.append(r"layer & rank & heads & tied & skip $c_l$ & activation ($\beta_l$) \\ \hline")
        for l, ly in enumerate(spec.layers, start=1):
            out.append(
                f"{l} & {ly.rank} & {ly.heads} & {'yes' if ly.tied else 'no'} & "
                f"${sp.latex(_sym(ly.skip))}$ & {ly.activation} (${sp.latex(_sym(ly.beta))}$) \\\\"
            )
        out.append(r"\end{tabular}\end{center}")
        out.append(
            r"With $z_l = W_l^\top x/\sqrt{d}$, mixing products $M_0 = I$, "
            r"$M_l = \big(c_l I + \sum_h a_h S_{l,h}\big) M_{l-1}$ (head weights $a_h$, default $1/H$), "
            r"$S_l = \sigma\big(\beta_l (M_{l-1} z_{Q,l}^\top)(M_{l-1} z_{K,l}^\top)^\top\big)$ "
            r"(tied: $z_Q = z_K$)."
        )
    else:
        out.append(f"Free-form sequence multi-index model, $p = {spec.indices}$ indices, $T = {spec.tokens}$ tokens.")
    rows = ", ".join(f"$z_{{{k},\\cdot}}$: {_esc(lbl)}" for k, lbl in enumerate(d.summary()["index_labels"]))
    out.append("")
    out.append(f"Index rows of $Z \\in \\mathbb{{R}}^{{{d.p}\\times {d.tokens}}}$: {rows}.")
    return "\n".join(out) + "\n"


def _sym(v):
    from .symbolic import param_symbol

    return param_symbol(v)


def link_section(d: Derivation) -> str:
    rows, cols = d.link.shape
    named = [(f"y_{{{a},{b}}}", d.link[a, b]) for a in range(rows) for b in range(cols)]
    text = [r"\section*{Link $y = g(Z)$}", "",
            "As the straight-line program the code runs (queries $q$, logits $A$, attention $S$, "
            "mixing products $M$ of each layer):", _align(latex_program(d.program, named))]
    if len(d.program.defs) < 40:
        full = sp.Matrix(d.link.shape[0], d.link.shape[1], [d.program.expand(e) for e in d.link])
        if sum(len(str(e)) for e in full) < 3000:
            text += ["In full:", f"\\[ y = {latex(full)} \\]"]
    return "\n".join(text) + "\n"


def jacobian_section(d: Derivation) -> str:
    from .symbolic import Program

    defs, J = d.jacobian_program
    rows, cols = d.link.shape
    named = []
    for a in range(rows):
        for b in range(cols):
            for i in range(d.p * d.tokens):
                e = J[a * cols + b][i]
                if e != 0:
                    k, t = divmod(i, d.tokens)
                    named.append((f"\\frac{{\\partial y_{{{a},{b}}}}}{{\\partial z_{{{k},{t}}}}}", e))
    prog = Program()
    prog.defs = d.program.defs + defs
    prog.latex_names = d.program.latex_names
    intro = (r"Forward-mode chain rule through the program; $\partial_i X$ is the derivative of the "
             r"intermediate $X$ with respect to the $i$-th entry of ${\rm vec}(Z)$ (row-major).")
    return "\n".join([r"\section*{Jacobian $\partial g / \partial Z$}", "", intro,
                      _align(latex_program(prog, named, 30000))]) + "\n"


def symmetry_section(d: Derivation) -> str:
    lines = [r"\section*{Symmetries}", ""]
    if not d.symmetries:
        lines.append("No sign-flip symmetry of $g$ was found.")
    else:
        lines.append("Sign flips leaving $g$ invariant (verified numerically at random points):")
        lines.append(r"\begin{itemize}")
        lines += [f"\\item {_esc(s['name'])} (rows {', '.join(map(str, s['rows']))})" for s in d.symmetries]
        lines.append(r"\end{itemize}")
    return "\n".join(lines) + "\n"


def reduction_section(d: Derivation) -> str:
    red = d.reduction
    lines = [r"\section*{Exact reduction of the denoiser}", ""]
    if red is None:
        lines.append(f"{_esc(d.reduction_reason)}.")
        lines.append(
            r"The denoiser integrates the noisy channel over all of $Z$: "
            r"\[ Z_{\rm out}(y;\omega,V) = \int \prod_t \mathcal N(z_t;\omega_t,V)\,"
            r"\mathcal N(y; g(Z), \Delta I)\,dZ . \]"
        )
        return "\n".join(lines) + "\n"
    if red.kind == "hardmax-wedge-mixed":
        return hardmax_mixed_section(d)
    free = ", ".join(f"z_{{{k},{t}}}" for k, t in red.free) or r"\varnothing"
    solved = ", ".join(f"z_{{{k},{t}}}" for k, t in red.solved)
    lines.append(f"{_esc(d.reduction_reason)}. Integral dimension {red.integral_dim}: "
                 f"free entries $u = ({free})$, solved entries ${solved}$.")
    if red.kind == "attention-rank1":
        beta = sp.latex(red.beta)
        if red.activation == "softmax":
            lines.append(
                r"Inverse output map: with $\ell_{ab} = \log(y_{ab}/y_{aa}) = " + beta
                + r"\, h_a (h_b - h_a)$, $G = h h^\top = t\,\mathbf 1\mathbf 1^\top + N$ where "
                r"$N_{ab} = (\ell_{0a} - \ell_{a0})/" + beta + r" + \ell_{ab}/" + beta + r"$ and "
                r"$t = (N_{ab}^2 - N_{aa}N_{bb})/(h_a-h_b)^2$, $(h_a-h_b)^2 = -(\ell_{ab}+\ell_{ba})/" + beta
                + r"$; $h$ is the rank-one factor of $G$, up to a global sign."
            )
        else:
            lines.append(r"Inverse output map: $h h^\top = y/" + beta + r"$, $h$ up to a global sign.")
        if red.mixing is not None and len(d.spec.layers) > 1:
            mix = red.mixing
            named = [(f"(M_{{L-1}})_{{{a},{b}}}", mix[a, b]) for a in range(mix.shape[0]) for b in range(mix.shape[1])]
            named.append((r"\det M_{L-1}", red.det_mixing))
            lines.append("Mixing matrix of the earlier layers and its determinant:")
            lines.append(_align(latex_program(d.program, named)))
    named = [(f"z_{{{k},{t}}}^{{({i})}}", e) for i, br in enumerate(red.branches) for (k, t), e in zip(red.solved, br)]
    named += [(f"\\log J^{{({i})}}", e) for i, e in enumerate(red.log_jacobian)]
    lines.append(f"Solved entries and weight factors on each of the {len(red.branches)} branches:")
    lines.append(_align(latex_program(d.program, named)))
    lines.append("Denoiser integral in the reduced variables (normalised Gaussians; the $y\\leftrightarrow h$ "
                 "Jacobian, independent of $\\omega$ and $V$, is left out):")
    du = r"\,du" if red.integral_dim else ""
    integral = r"\int" if red.integral_dim else ""
    lines.append(
        r"\[ Z_{\rm out}(y;\omega,V) = \sum_{i} " + integral
        + r" \prod_{t} \mathcal N\big(z_t;\omega_t,V\big)\Big|_{z = (u,\, z^{(i)}(u))} e^{\log J^{(i)}(u)}" + du
        + r", \qquad g_{\rm out} = V^{-1}(\mathbb E[z_t\mid y]-\omega_t),\quad "
        r"\partial_\omega g_{\rm out} = V^{-1}{\rm Cov}(z_t,z_s\mid y)V^{-1} - \delta_{ts}V^{-1}. \]"
    )
    if red.notes:
        lines.append("Notes: " + "; ".join(_esc(n) for n in red.notes) + ".")
    return "\n".join(lines) + "\n"


def hardmax_mixed_section(d: Derivation) -> str:
    """Region constraint of a hardmax last layer after a tied rank-one first layer, T = 2."""
    red = d.reduction
    beta = sp.latex(red.beta)
    mix = red.mixing
    named = [(f"(M_1)_{{{a},{b}}}", mix[a, b]) for a in range(2) for b in range(2)]
    named.append((r"\det M_1", red.det_mixing))
    lines = [r"\section*{Exact reduction of the denoiser}", "",
             f"{_esc(d.reduction_reason)}.",
             r"Write $u = (z_{0,0}, z_{0,1})$ (first layer, integrated over) and $w = (z_{1,0}, z_{1,1})$ "
             r"(last layer). The last layer sees $v = M_1(u)\,w$, with the mixing matrix of the first layer",
             _align(latex_program(d.program, named)),
             r"and $y = \mathrm{hardmax}_{\rm rows}(" + beta + r"\, v v^\top)$ reveals the signs of "
             r"$v_1(v_1 - v_2)$ and $v_2(v_2 - v_1)$: $v$ lies in the union $W_y$ of the wedges of the "
             r"$v$-plane cut by $v_1 = 0$, $v_2 = 0$, $v_1 = v_2$ whose hardmax pattern is $y$ "
             r"($y_{11} = y_{21} = 1$: $0 < \arg v < \pi/4$ or $\pi < \arg v < 5\pi/4$; "
             r"$y_{12} = y_{22} = 1$: $\pi/4 < \arg v < \pi/2$ or $5\pi/4 < \arg v < 3\pi/2$; "
             r"$y = I$: $v_1 v_2 < 0$; the pattern $y_{12} = y_{21} = 1$ has probability zero). "
             r"Hence $w \in M_1(u)^{-1} W_y$, again a union of wedges through the origin.",
             r"Given $u$, $w \sim \mathcal N(m(u), s^2 I)$ with $m_t = \omega_{1,t} + (V_{01}/V_{00})(u_t - \omega_{0,t})$ "
             r"and $s^2 = V_{11} - V_{01}^2/V_{00}$ (tokens are independent), so",
             r"\[ Z_{\rm out}(y;\omega,V) = P(y) = \int_{\mathbb R^2} \prod_t \mathcal N(u_t;\omega_{0,t},V_{00})\,"
             r"\Pr\big[w \in M_1(u)^{-1} W_y \,\big|\, u\big]\,du , \]",
             r"and on a wedge $\{w = s\rho\,e(\theta),\ \theta_0<\theta<\theta_1\}$, with $a = m\cdot e(\theta)/s$, "
             r"$b = m\cdot e(\theta)^\perp/s$ and $K_k(a) = \int_0^\infty \rho^k e^{-\rho^2/2 + a\rho}\,d\rho$ "
             r"($K_0 = \sqrt{2\pi}\,\Phi(a)\,e^{a^2/2}$, $K_1 = 1 + a K_0$, $K_2 = a K_1 + K_0$, $K_3 = a K_2 + 2K_1$),",
             r"\[ \mathbb E\big[\rho^{k-1} e^{\otimes(k-1)} \mathbf 1_{\rm wedge}\big] = \frac{1}{2\pi}\int_{\theta_0}^{\theta_1} "
             r"e^{-(a^2+b^2)/2} K_k(a)\, e(\theta)^{\otimes (k-1)}\,d\theta, \quad k = 1, 2, 3 . \]",
             r"The posterior mean and covariance of $Z$ give "
             r"$g_{\rm out} = V^{-1}(\mathbb E[z_t\mid y]-\omega_t)$ and "
             r"$\partial_\omega g_{\rm out} = V^{-1}{\rm Cov}(z_t,z_s\mid y)V^{-1} - \delta_{ts}V^{-1}$; "
             r"$\log Z_{\rm out}$ is the log probability of $y$."]
    if red.notes:
        lines.append("Notes: " + "; ".join(_esc(n) for n in red.notes) + ".")
    return "\n".join(lines) + "\n"


def document(d: Derivation) -> str:
    spec = d.spec
    title = f"\\title{{aimsym derivation: \\texttt{{{_esc(spec.name)}}}}}\n\\date{{spec hash {spec.hash()}}}\n\\maketitle\n"
    parts = [_PREAMBLE, title, architecture_section(d), link_section(d), jacobian_section(d),
             symmetry_section(d), reduction_section(d), "\\end{document}\n"]
    return "\n".join(parts)
