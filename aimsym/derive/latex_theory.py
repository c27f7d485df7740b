"""LaTeX of the declared model's learning theory (theory sections 4, 5 and 9): Bayes-optimal state
evolution, replica free entropy, the weak-recovery stability operator at Q = 0 (and the staircase),
the counting threshold with the local stability of perfect recovery, and the closed forms of the
simple channels.

Every section is specialised to the derivation: its p, T and index blocks, its output noise, the
sign symmetries found for its link (which entries of the operator vanish), its counting rank m, its
reduction (what log Z_out is normalised by). The conventions are those of :mod:`aimsym.smi.se`,
:mod:`aimsym.smi.thresholds` and :mod:`aimsym.smi.perfect`: n = alpha d samples, Q_hat summed over
the T tokens, omega = Q^{1/2} xi, V = I - Q, Gaussian prior N(0, I_p) on each weight column.
"""

from __future__ import annotations

import sympy as sp

from .latexutil import align, index_blocks
from .spec import AttentionSpec
from .symbolic import Derivation, param_symbol

_G = r"g_{\rm out}"


def _g(sub: str) -> str:
    """g_out with a subscript (a token, or a token column): g_{{\rm out}, t}."""
    return rf"g_{{{{\rm out}}, {sub}}}"


# ----------------------------------------------------------------------------- facts about the model


def flip_classes(d: Derivation) -> list[list[int]]:
    """Rows of Z grouped by the sign symmetries of the link: rows k, k' share a class iff every
    symmetry flips both or neither. Across classes the posterior under N(0, I) is odd in one row
    and even in the other, so E[z_k z_k' | y] = 0 (the operator is block diagonal by class)."""
    sig: dict[tuple, list[int]] = {}
    for k in range(d.p):
        sig.setdefault(tuple(k in s["rows"] for s in d.symmetries), []).append(k)
    return list(sig.values())


def even_link(d: Derivation) -> bool:
    """True when some symmetry flips every row (Z -> -Z): then E[Z | y] = 0 under N(0, I), so
    g_out(y, 0, I) = 0 and Q = 0 is a fixed point of the state evolution."""
    return any(set(s["rows"]) == set(range(d.p)) for s in d.symmetries)


def noise(d: Derivation) -> sp.Expr:
    return param_symbol(d.spec.noise)


def closed_form_kind(d: Derivation) -> str | None:
    """Which closed form of theory section 9 the model has: ``gaussian`` (y = Z + noise),
    ``phase-retrieval`` (|z| or z^2), ``sign``, ``two-point`` (one tied rank-one softmax or
    linear layer: y fixes z up to sign), ``product`` (y = z_1 z_2), ``published`` (the two-layer
    T = 2 softmax model with its known values), or None."""
    spec = d.spec
    if isinstance(spec, AttentionSpec):
        if spec.shared_flow or noise(d) != 0 or spec.output != "attention":
            return None
        lys = spec.layers
        simple = all(ly.tied and ly.heads == 1 and ly.rank == 1 for ly in lys)
        if simple and len(lys) == 1 and lys[0].activation in ("softmax", "linear"):
            return "two-point"
        if (simple and len(lys) == 2 and spec.tokens == 2 and all(ly.activation == "softmax" for ly in lys)
                and all(param_symbol(ly.beta) == 1 for ly in lys)):
            return "published"
        return None
    g = list(d.link)
    Z = list(d.Z)
    if len(g) == len(Z) and all(sp.simplify(a - b) == 0 for a, b in zip(g, Z)):
        return "gaussian"
    if d.p != 1 or d.tokens != 1 or noise(d) != 0:
        if d.p == 2 and d.tokens == 1 and noise(d) == 0 and len(g) == 1 and sp.simplify(g[0] - Z[0] * Z[1]) == 0:
            return "product"
        return None
    z = Z[0]
    if sp.simplify(g[0] - sp.Abs(z)) == 0 or sp.simplify(g[0] - z**2) == 0:
        return "phase-retrieval"
    if g[0] == sp.sign(z):
        return "sign"
    return None


# ----------------------------------------------------------------------------- notation


class _Notation:
    """Scalar (p = 1) or matrix names of the order parameters and sums over tokens."""

    def __init__(self, d: Derivation):
        self.p, self.T = d.p, d.tokens
        scalar = self.p == 1
        self.scalar = scalar
        self.Q, self.Qh = ("q", r"\hat q") if scalar else ("Q", r"\hat Q")
        self.I = "1" if scalar else f"I_{{{self.p}}}"
        self.V = "v" if scalar else "V"
        self.sqrtQ = r"\sqrt{q}" if scalar else "Q^{1/2}"
        self.sqrtV = r"\sqrt{v}" if scalar else "V^{1/2}"
        self.sum_t = "" if self.T == 1 else rf"\sum_{{t=1}}^{{{self.T}}}"
        self.sum_ts = "" if self.T == 1 else rf"\sum_{{t,s=1}}^{{{self.T}}}"

    def gg(self) -> str:
        """The summand of Q_hat: sum over tokens of g_out g_out^T (a square for p = 1)."""
        if self.T == 1:
            return f"{_G}^2" if self.scalar else rf"{_G}\, {_G}^\top"
        if self.scalar:
            return rf"{self.sum_t} {_g('t')}^2"
        col = _g(r"\cdot t")
        return rf"{self.sum_t} {col}\, {col}^\top"

    def dg(self) -> str:
        """The diagonal token blocks of dg_out summed over tokens."""
        if self.T == 1:
            return rf"\partial_\omega {_G}"
        col = "t" if self.scalar else r"\cdot t"
        return rf"{self.sum_t} \frac{{\partial {_g(col)}}}{{\partial \omega_{{{col}}}}}"

    def col(self, M: str, t: str) -> str:
        """Token column t of a p x T matrix (an entry for p = 1; the matrix itself for T = 1)."""
        if self.T == 1:
            return M
        return f"{M}_{{{t}}}" if self.scalar else f"{M}_{{\\cdot {t}}}"


def _plus_noise(d: Derivation) -> str:
    """' + Delta' (the output noise as a summand), empty for a noiseless link."""
    return "" if noise(d) == 0 else f" + {sp.latex(noise(d))}"


def _noise_positive(d: Derivation) -> str:
    """The noise as prose math: 'Delta > 0', or 'Delta = 1/2 > 0' for a number (LaTeX)."""
    D = noise(d)
    return f"{sp.latex(D)} > 0" if D.is_Symbol else rf"\Delta = {sp.latex(D)} > 0"


def _noise_name(d: Derivation) -> str:
    D = noise(d)
    return sp.latex(D) if D.is_Symbol else r"\Delta"


def _half(T: int) -> str:
    """T/2 as a prefactor in LaTeX: 1/2, (nothing), 3/2, 2, ..."""
    r = sp.Rational(T, 2)
    return "" if r == 1 else (str(r) if r.q == 1 else rf"\tfrac{{{r.p}}}{{{r.q}}}")


def _frac(x) -> str:
    return sp.latex(sp.nsimplify(x))


def _shape(p: int, T: int) -> str:
    return r"\mathbb R" if p * T == 1 else (rf"\mathbb R^{{{p}}}" if T == 1 else rf"\mathbb R^{{{p}\times {T}}}")


def _row_list(d: Derivation) -> str:
    """Which row of Q belongs to which index block, e.g. 'row 1: $z_{1}$, row 2: $z_{2}$'."""
    parts = []
    for name, rows in index_blocks(d):
        r = f"row {rows[0] + 1}" if len(rows) == 1 else f"rows {rows[0] + 1}--{rows[-1] + 1}"
        parts.append(f"{r}: ${name}$")
    return ", ".join(parts)


def _row_errors(d: Derivation) -> str:
    """'$1 - Q_{11}$ for $z_{1}$, ...': the error of every row, named by its block."""
    def q(k):
        return f"Q_{{{k + 1}{k + 1}}}" if d.p < 10 else f"Q_{{{k + 1},{k + 1}}}"
    return ", ".join(", ".join(f"$1 - {q(k)}$" for k in rows) + f" for ${name}$" for name, rows in index_blocks(d))


def _layer_of(d: Derivation, rows: list[int]) -> str:
    names = [n for n, r in index_blocks(d) if set(r) <= set(rows)]
    return ", ".join(f"${n}$" for n in names)


# ----------------------------------------------------------------------------- state evolution


def se_lines(d: Derivation) -> list[str]:
    n = _Notation(d)
    out = [rf"{n.Qh} &= \alpha\, \mathbb E_{{\xi,\eta}}\Big[{n.gg()}\Big]"
           + rf" = -\alpha\, \mathbb E_{{\xi,\eta}}\Big[{n.dg()}\Big]"]
    y = "y = g(Z)" + (r" + \sqrt{" + sp.latex(noise(d)) + r"}\, \zeta" if noise(d) != 0 else "")
    out.append(rf"\omega &= {n.sqrtQ}\, \xi, \qquad {n.V} = {n.I} - {n.Q}, \qquad Z = \omega + {n.sqrtV}\, \eta, "
               rf"\qquad {y}")
    if n.scalar:
        out.append(rf"{n.Q}^{{\rm new}} &= \frac{{\hat q + \lambda}}{{1 + \hat q + \lambda}}")
    else:
        out.append(rf"Q^{{\rm new}} &= (\hat Q + \lambda {n.I})\,({n.I} + \hat Q + \lambda {n.I})^{{-1}}")
    return out


def se_section(d: Derivation) -> str:
    n = _Notation(d)
    p, T = d.p, d.tokens
    dims = 2 * p * T
    noisy = noise(d) != 0
    n_out = max(1, len(list(d.link)))
    shape_y = "" if not d.output_shape else r"\times".join(map(str, d.output_shape))
    over = (rf"$Q \in \mathbb R^{{{p}\times {p}}}$, $0 \preceq Q \preceq I_{{{p}}}$, "
            rf"$Q_{{kk'}} = \lim \hat w_k \cdot w^*_{{k'}}/d$ for rows $k, k'$ of $W$ ({_row_list(d)})"
            if not n.scalar else
            r"$q = \lim \hat w \cdot w^*/d \in [0, 1]$ (the overlap of the posterior-mean estimate with the teacher)")
    text = [r"\section*{Bayes-optimal state evolution}",
            f"Data: $n = \\alpha d$ samples, Gaussian prior $\\mathcal N(0, I_{{{p}}})$ on each of the $d$ columns of "
            f"$W \\in \\mathbb R^{{{p}\\times d}}$. Order parameter {over}. One step of the state evolution "
            f"(theory \\S4), with $\\xi, \\eta \\in {_shape(p, T)}$ i.i.d.\\ $\\mathcal N(0, 1)$"
            + (f" and $\\zeta \\in {_shape(1, 1) if not shape_y else chr(92) + 'mathbb R^{' + shape_y + '}'}$ "
               f"i.i.d.\\ $\\mathcal N(0, 1)$ (the output noise)" if noisy else "")
            + f", the denoiser ${_G}(y, \\omega, {n.V})$ of the reduction section"
            + ("" if T == 1 else f" summed over the ${T}$ tokens") + ":",
            align(se_lines(d)),
            f"The second form of ${n.Qh}$ is the Nishimori identity (a check of the denoiser at every ${n.Q}$); "
            f"$\\lambda \\ge 0$ is the strength of side information (0 by default). The expectation is over "
            f"${dims + (n_out if noisy else 0)}$ Gaussian variables, computed by randomised quasi-Monte Carlo "
            f"with replica standard errors. Iterate from ${n.Q} \\approx 0$ (uninformed) and from "
            f"${n.Q} \\approx {n.I}$ (informed); two different fixed points signal a computational-to-statistical "
            f"gap and the free entropy below chooses the Bayes-optimal one. "
            + (f"Estimation error per row: $1 - Q_{{kk}}$ ({_row_errors(d)})." if not n.scalar else
               "Estimation error: $1 - q$.")]
    return "\n".join(t for t in text if t) + "\n"


# ----------------------------------------------------------------------------- free entropy


def free_entropy_lines(d: Derivation) -> list[str]:
    n = _Notation(d)
    if n.scalar:
        phi = (r"\Phi(q, \hat q) &= -\tfrac12 q \hat q + \tfrac12 \hat q - \tfrac12 \log(1 + \hat q) "
               r"+ \alpha\, \Psi_{\rm out}(q)")
        arg = r"\sqrt q\, \xi, 1 - q"
    else:
        phi = (rf"\Phi(Q, \hat Q) &= -\tfrac12 \operatorname{{Tr}}(Q \hat Q) + \tfrac12 \operatorname{{Tr}} \hat Q "
               rf"- \tfrac12 \log\det({n.I} + \hat Q) + \alpha\, \Psi_{{\rm out}}(Q)")
        arg = rf"Q^{{1/2}} \xi, {n.I} - Q"
    pout = (rf"\mathcal N\big(y; g(Z), {sp.latex(noise(d))}\, I\big)" if noise(d) != 0 else r"\delta\big(y - g(Z)\big)")
    zcol = n.col("Z", "t")
    wcol = n.col(r"\omega", "t")
    prod = rf"\prod_{{t=1}}^{{{n.T}}} " if n.T > 1 else ""
    return [
        phi,
        rf"\Psi_{{\rm out}}({n.Q}) &= \mathbb E_{{\xi}} \int dy\, Z_{{\rm out}}(y; {arg}) \log Z_{{\rm out}}(y; {arg})",
        rf"&= \mathbb E_{{\xi,\eta}} \log Z_{{\rm out}}(y; \omega, {n.V}), \qquad \omega = {n.sqrtQ}\, \xi, "
        rf"\quad {n.V} = {n.I} - {n.Q}",
        rf"Z_{{\rm out}}(y; \omega, {n.V}) &= \int {prod}\mathcal N({zcol}; {wcol}, {n.V})\, P_{{\rm out}}(y \mid Z)\, dZ, "
        rf"\qquad P_{{\rm out}}(y \mid Z) = {pout}",
    ]


def free_entropy_section(d: Derivation) -> str:
    n = _Notation(d)
    Q, Qh, I = n.Q, n.Qh, n.I
    inv = rf"\hat q / (1 + \hat q)" if n.scalar else rf"\hat Q ({I} + \hat Q)^{{-1}}"
    dQ = r"\partial_q" if n.scalar else r"\partial_Q"
    out = [r"\section*{Free entropy}",
           f"The replica free entropy (sign: larger is better) at side information $\\lambda = 0$:",
           align(free_entropy_lines(d)),
           f"Its stationary points are the fixed points of the state evolution: "
           f"$\\partial_{{{Qh}}} \\Phi = 0 \\iff {Q} = {inv}$ (the prior step) and "
           f"$\\partial_{{{Q}}} \\Phi = 0 \\iff {Qh} = 2\\alpha\\, {dQ} \\Psi_{{\\rm out}}({Q}) = "
           f"\\alpha\\, \\mathbb E[{n.gg()}]$ (the output step). The Bayes-optimal fixed point is the "
           f"global maximiser."]
    red = d.reduction
    if noise(d) != 0:
        out.append(f"With output noise ${_noise_positive(d)}$, $\\log Z_{{\\rm out}}$ is the log density of $y$ and "
                   f"$\\Phi$ is absolute.")
    elif red is not None and red.kind in ("attention-rank1", "attention-untied"):
        out.append(r"For this deterministic link $\log Z_{\rm out}$ is computed from the reduced integral of the "
                   r"reduction section, which leaves out the Jacobian of the inverse output map; its expectation "
                   r"does not depend on the overlap ($y$ has its prior law), so $\Phi$ is defined up to a constant: "
                   r"compare free-entropy differences (e.g.\ uninformed against informed fixed point at one $\alpha$).")
    elif red is not None:
        what = "probability" if red.kind in ("hardmax-wedge", "hardmax-wedge-mixed", "halfspace") else "density"
        out.append(f"For this link $Z_{{\\rm out}}$ is the {what} of $y$ (reduction section) and $\\Phi$ is absolute.")
    else:
        out.append(r"Without an exact reduction the denoiser integrates a noisy channel ($\Delta > 0$); compare "
                   r"free-entropy differences at one $\Delta$.")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- weak recovery


def operator_lines(d: Derivation) -> list[str]:
    n = _Notation(d)
    zt, zs = n.col("Z", "t"), n.col("Z", "s")
    if n.scalar:
        G = (rf"G_{{ts}}(y) &= \mathbb E[{zt} {zs} \mid y] - \delta_{{ts}}" if n.T > 1 else
             r"G(y) &= \mathbb E[z^2 \mid y] - 1")
        F = (rf"F &= \mathbb E_y\Big[{n.sum_ts} G_{{ts}}(y)^2\Big], \qquad \alpha_c = 1/F" if n.T > 1 else
             r"F &= \mathbb E_y\big[G(y)^2\big], \qquad \alpha_c = 1/F")
        return [G, F]
    I = n.I
    if n.T == 1:
        G = rf"G(y) &= \mathbb E[Z Z^\top \mid y] - {I} \qquad ({d.p}\times {d.p})"
        F = r"F(M) &= \mathbb E_y\big[G(y)\, M\, G(y)^\top\big]"
    else:
        G = (rf"G_{{ts}}(y) &= \mathbb E[{zt} {zs}^\top \mid y] - \delta_{{ts}} {I} \qquad "
             rf"({d.p}\times {d.p},\ t, s = {_tokens(n.T)})")
        F = rf"F(M) &= \mathbb E_y\Big[{n.sum_ts} G_{{ts}}(y)\, M\, G_{{ts}}(y)^\top\Big]"
    return [G, F, r"\alpha_c &= 1/\rho(F), \qquad \rho(F) = \sup\big\{\|F(M)\|_F : M \succeq 0,\ \|M\|_F = 1\big\}"]


def _tokens(T: int) -> str:
    """The token range as printed: 1, 2 / 1, 2, 3 / 1, ..., T."""
    return ", ".join(map(str, range(1, T + 1))) if T <= 3 else rf"1, \dots, {T}"


def _jensen(T: int) -> int:
    """E sum_{t,s} (z_t z_s - delta_ts)^2 for z ~ N(0, I_T): 2 T + T (T - 1) = T (T + 1)."""
    return T * (T + 1)


def weak_recovery_section(d: Derivation) -> str:
    n = _Notation(d)
    p, T = d.p, d.tokens
    out = [rf"\section*{{Weak recovery: stability of ${n.Q} = 0$}}"]
    if not even_link(d):
        out.append(_no_zero_fixed_point(d))
        return "\n".join(out) + "\n"
    out.append(f"$g$ is invariant under $Z \\mapsto -Z$, so the posterior under the prior $\\mathcal N(0, {n.I})$ is even: "
               f"$\\mathbb E[Z \\mid y] = 0$, ${_G}(y, 0, {n.I}) = 0$ and ${n.Q} = 0$ is a fixed point of the state "
               f"evolution (an uninformed start learns nothing without side information). Linearised at "
               f"${n.Q} = 0$ the map is $\\delta {n.Q} \\mapsto \\alpha F(\\delta {n.Q})$ with (theory \\S5)")
    out.append(align(operator_lines(d)))
    J = _jensen(T)
    if n.scalar:
        out.append(f"By Jensen's inequality $F \\le \\mathbb E{n.sum_ts}"
                   + (f"({n.col('Z', 't')} {n.col('Z', 's')} - \\delta_{{ts}})^2" if T > 1 else "(z^2 - 1)^2")
                   + f" = {J}$, so $\\alpha_c \\ge 1/{J}$, with equality when $y$ determines $z$ up to its sign.")
        return "\n".join(out) + "\n" + _two_point_operator(d)
    out.append(r"$F$ is self-adjoint for the Frobenius product ($G_{ts}^\top = G_{st}$) and maps the positive "
               r"semidefinite cone into itself, so the supremum is its spectral radius, reached by power iteration "
               rf"$M \leftarrow F(M)/\|F(M)\|_F$ from $M = I_{{{p}}}/\sqrt{{{p}}}$; the maximising $M$ names the "
               r"rows learned first.".replace("G_{ts}^\\top = G_{st}", "G_{ts}^\\top = G_{st}" if T > 1 else "G^\\top = G"))
    out.append(_operator_structure(d))
    if len(flip_classes(d)) > 1:
        out.append(_staircase(d))
    return "\n".join(out) + "\n"


def _no_zero_fixed_point(d: Derivation) -> str:
    n = _Notation(d)
    kind = closed_form_kind(d)
    text = (f"No symmetry flips every row of $Z$, so nothing forces $\\mathbb E[Z \\mid y] = 0$ under the prior: "
            f"${_G}(y, 0, {n.I}) = \\mathbb E[Z \\mid y]$ is generically non-zero, ${n.Q} = 0$ is not a fixed point "
            f"and the state evolution leaves it at every $\\alpha > 0$ (no weak-recovery threshold).")
    if kind == "sign":
        text += (r" Here $\mathbb E[z \mid y] = y\sqrt{2/\pi}$, so ${g_{\rm out}}(y, 0, 1) = y \sqrt{2/\pi}$ and "
                 r"the first step gives $\hat q = 2\alpha/\pi$.")
    elif kind == "gaussian":
        D = sp.latex(noise(d))
        aT = sp.latex(sp.Symbol("alpha") * d.tokens)
        if noise(d) == 0:
            text += (rf" Here ${_G}(y, 0, {n.I}) = y$ per token, so the first step gives "
                     rf"${n.Qh} = {aT}" + ("" if n.scalar else f"\\, {n.I}") + "$.")
        else:
            text += (rf" Here ${_G}(y, 0, {n.I}) = y/(1 + {D})$ per token, so the first step gives "
                     rf"${n.Qh} = {aT}/(1 + {D})" + ("" if n.scalar else f"\\, {n.I}") + "$.")
    return text


def _operator_structure(d: Derivation) -> str:
    """What the link's sign symmetries make of F (p > 1)."""
    classes = flip_classes(d)
    p, T = d.p, d.tokens
    J = _jensen(T)
    GG = "G_{ts}" if T > 1 else "G"
    if len(classes) == 1:
        return (f"No sign flip separates the rows: ${GG}$ is a full ${p}\\times {p}$ matrix and $F$ acts on all "
                f"{p * (p + 1) // 2} entries of $M$.")
    if all(len(c) == 1 for c in classes):
        names = ", ".join(f"${nm}$" for nm, _ in index_blocks(d))
        B = (f"\\mathbb E{_Notation(d).sum_ts} ({GG})_{{kk}}^2")
        return (f"Each row is flipped alone by a symmetry ({names}), so $({GG})_{{kk'}} = 0$ for $k \\ne k'$: "
                f"${GG}$ is diagonal, $F$ acts entrywise, $F(M)_{{kk'}} = C_{{kk'}} M_{{kk'}}$ with "
                f"$C_{{kk'}} = \\mathbb E{_Notation(d).sum_ts} ({GG})_{{kk}} ({GG})_{{k'k'}}$, and "
                f"\\[ \\alpha_c = 1 \\big/ \\max_{{k \\le {p}}} B_k, \\qquad B_k = {B} \\le {J} \\]"
                f"(Jensen: $\\mathbb E[(\\mathbb E[X \\mid y] - c)^2] \\le \\mathbb E[(X - c)^2]$), hence "
                f"$\\alpha_c \\ge 1/{J}$; $B_k = {J}$ when $y$ reveals row $k$ up to its sign.")
    parts = "; ".join("$\\{" + ", ".join(nm for nm, r in index_blocks(d) if set(r) <= set(c)) + "\\}$"
                      for c in classes)
    return (f"The sign symmetries split the rows into the classes {parts}: $({GG})_{{kk'}} = 0$ across classes, "
            f"${GG}$ is block diagonal, $F$ maps block-diagonal $M$ to block-diagonal $M$ and "
            f"$\\alpha_c = 1/\\max_b \\rho(F_b)$ over the operators $F_b$ of the classes.")


def _staircase(d: Derivation) -> str:
    T = d.tokens
    D = "D_{ts}" if T > 1 else "D"
    dg = (r"\partial g_{{\rm out}}[P, t; P, s]" if T > 1 else r"\partial g_{{\rm out}}[P; P]").replace("{{", "{").replace("}}", "}")
    classes = [_layer_of(d, c) for c in flip_classes(d)]
    text = (r"\paragraph{Grand staircase.} Once a set $U$ of rows is learned, the state evolution sits at a fixed "
            r"point $Q^*(\alpha)$ supported on $U$ (the SE restricted to $U$). The remaining rows $P$ are learned "
            r"at the smallest $\alpha$ where $\alpha\, \rho(F_P) = 1$, with the operator built as above from "
            rf"${D} = {dg}(y, \omega, V)$ at $\omega = Q^{{*1/2}}\xi$, $V = I - Q^*$ instead of $\omega = 0$, "
            rf"$V = I$; for this model $U$ and $P$ are unions of the classes " + ", ".join("\\{" + c + "\\}" for c in classes)
            + r". The threshold has to be taken along the branch $Q^*(\alpha)$: taking $U$ perfectly learned "
            r"($Q^*_U = I$) is degenerate.")
    return text


def _two_point_operator(d: Derivation) -> str:
    """The exact alpha_c of a p = 1 link that fixes z up to its sign (theory section 9)."""
    kind = closed_form_kind(d)
    if kind not in ("two-point", "phase-retrieval"):
        return ""
    J = _jensen(d.tokens)
    r = "h" if kind == "two-point" else r"r"
    return (f"Here $y$ fixes $z = \\pm {r}$: $G{'_{ts}' if d.tokens > 1 else ''} = "
            + (f"{r}_t {r}_s - \\delta_{{ts}}$" if d.tokens > 1 else f"{r}^2 - 1$")
            + f", the bound is attained: $F = {J}$ and $\\alpha_c = 1/{J}$ exactly.\n")


# ----------------------------------------------------------------------------- perfect recovery


def perfect_lines(d: Derivation) -> list[str]:
    n = _Notation(d)
    p, T = d.p, d.tokens
    m = d.counting["m"]
    gt = _G if T == 1 else _g("t" if n.scalar else r"\cdot t")
    if n.scalar:
        rank = (rf"\mathbb E\Big[{n.sum_t} v\, {gt}^2\Big] &= {p * T} - \mathbb E\big[v^{{-1}} "
                + (r"\textstyle\sum_t \operatorname{Var}(z_t \mid y)" if T > 1 else r"\operatorname{Var}(z \mid y)")
                + rf"\big] \;\to\; m = {m} \quad (v \to 0)")
        return [rank,
                rf"v \hat q &\to \alpha \Pi, \quad \Pi = {m}, \qquad v^{{\rm new}} = \frac{{v}}{{\alpha \Pi}} "
                rf"\quad\Rightarrow\quad q = 1 \text{{ attracts iff }} \alpha > 1/\Pi = p/m = {_frac(sp.Rational(p, m))}"]
    gT = rf"{gt}^\top V {gt}"
    return [
        rf"\mathbb E\Big[{n.sum_t} {gT}\Big] &= {p * T} - \mathbb E\operatorname{{tr}}\big(V^{{-1}} "
        rf"\operatorname{{Cov}}(Z \mid y)\big) \;\to\; m = {m} \quad (V \to 0)",
        r"V^{1/2} \hat Q V^{1/2} &\to \alpha\, \Pi, \qquad \operatorname{tr} \Pi = m",
        rf"\Pi &= V^{{1/2}}\, \mathbb E\Big[{n.gg()}\Big] V^{{1/2}} = -V^{{1/2}}\, \mathbb E\Big[{n.dg()}\Big] V^{{1/2}}",
        rf"V^{{\rm new}} &= (I_{{{p}}} + \hat Q)^{{-1}} \approx \alpha^{{-1}} V^{{1/2}} \Pi^{{-1}} V^{{1/2}}, \qquad "
        rf"\det V^{{\rm new}} = \frac{{\det V}}{{\alpha^{{{p}}} \det \Pi}}",
        rf"\alpha_{{\rm loc}} &= (\det \Pi)^{{-1/{p}}} \;\ge\; \frac{{{p}}}{{\operatorname{{tr}} \Pi}} = \frac{{p}}{{m}} "
        rf"= {_frac(sp.Rational(p, m))} = \alpha_{{\rm PR}} \qquad (\text{{AM--GM}})",
    ]


def _scaled_identity(m: int, p: int) -> str:
    """(m/p) I_p as printed: I_2, 2 I_3, (2/3) I_3."""
    r = sp.Rational(m, p)
    if r == 1:
        return f"I_{{{p}}}"
    c = str(r) if r.q == 1 else rf"\tfrac{{{r.p}}}{{{r.q}}}"
    return rf"{c}\, I_{{{p}}}"


def perfect_recovery_section(d: Derivation) -> str:
    c = d.counting
    m, p, T = c["m"], d.p, d.tokens
    out = [r"\section*{Counting threshold and perfect recovery}"]
    if m is None:
        out.append(r"The generic rank of $\partial y/\partial Z$ was not determined (the Jacobian was not finite at "
                   r"the random points tried), so no counting threshold is given.")
        return "\n".join(out) + "\n"
    head = ((f"The teacher has ${p}\\,d$ unknown weights ($p = {p}$ rows of $W$)" if p > 1 else
             "The teacher has $d$ unknown weights ($p = 1$ row of $W$)") + " and one sample carries "
            f"$m = \\operatorname{{rank}} \\partial y/\\partial Z = {m}$ independent numbers "
            f"(the generic rank of the Jacobian of $g$ at random $Z$).")
    if m == 0:
        out.append(head + r" $y$ takes finitely many values ($\partial y/\partial Z = 0$ almost everywhere): it carries "
                   r"no continuous information, $\operatorname{tr}\Pi = m = 0$, and the Bayes-optimal error stays "
                   r"positive at every $\alpha$: no perfect recovery, no counting threshold.")
        return "\n".join(out) + "\n"
    a_pr = _frac(sp.Rational(p, m))
    D = noise(d)
    if D != 0:
        n = _Notation(d)
        lim = r"v \hat q \to 0" if n.scalar else r"V^{1/2} \hat Q V^{1/2} \to 0"
        tail = (f" With output noise ${_noise_positive(d)}$, ${_G}$ stays bounded as ${n.V} \\to 0$ "
                f"(${lim}$): ${n.Q} = {n.I}$ is never reached and there is no perfect recovery "
                f"at any $\\alpha$.")
        if D.is_Symbol:
            tail += (f" At ${sp.latex(D)} = 0$ the counting threshold is "
                     f"$\\alpha_{{\\rm PR}} = p/m = {a_pr}$"
                     + " and the analysis below applies.")
        out.append(head + tail)
        if not D.is_Symbol:
            return "\n".join(out) + "\n"
    else:
        out.append(head + f" The Bayes-optimal error is positive for $\\alpha < \\alpha_{{\\rm PR}} = p/m = {a_pr}$.")
    red = d.reduction
    if red is not None and red.integral_dim == p * T - m:
        out.append(f"Consistently, $y$ leaves $pT - m = {p * T - m}$ directions of $Z$ free: the dimension of the "
                   f"reduced integral of the denoiser." if p * T > m else
                   "Consistently, $pT = m$: $y$ fixes $Z$ up to finitely many branches (no integral is left in the "
                   "denoiser).")
    n = _Notation(d)
    out.append(f"Near ${n.Q} = {n.I}$ the state evolution has a homogeneous limit (theory \\S4; the rank identity in "
               f"the first line" + ("" if n.scalar else ", at any shape of $V$") + "):")
    out.append(align(perfect_lines(d)))
    if p > 1:
        out.append(r"so $Q = I$ attracts only where $\alpha^{" + str(p) + r"} \det \Pi \ge 1$, i.e.\ above "
                   r"$\alpha_{\rm loc}$ at the shape of $V$ the map reproduces; there $\Pi \propto I$ and "
                   rf"$\alpha_{{\rm loc}} = \alpha_{{\rm PR}}$ for a correct denoiser ($\Pi = {_scaled_identity(m, p)}$). "
                   r"The algorithmic threshold, the smallest $\alpha$ at which the uninformed state evolution reaches "
                   r"$Q = I$, lies at or above it; measure convergence there by $1 - Q_{kk}$.")
    else:
        out.append(r"The algorithmic threshold, the smallest $\alpha$ at which the uninformed state evolution reaches "
                   r"$q = 1$, lies at or above $\alpha_{\rm PR}$; measure convergence there by $1 - q$.")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- closed forms


def gaussian_fixed_point(alpha, Delta, T: int = 1) -> sp.Expr:
    """Fixed point q of the Gaussian channel y = Z + sqrt(Delta) noise at isotropic Q = q I:
    Q_hat = alpha T (1 - q + Delta)^{-1}, q = Q_hat / (1 + Q_hat), so
    q^2 - (1 + Delta + alpha T) q + alpha T = 0, the root in [0, 1]."""
    b = 1 + Delta + alpha * T
    return (b - sp.sqrt(b**2 - 4 * alpha * T)) / 2


def product_a() -> float:
    """a = E (mu(y) - 1)^2 for y = z_1 z_2, mu(y) = |y| K_1(|y|)/K_0(|y|) = E[z_1^2 | y] and y of
    density K_0(|y|)/pi: the operator at Q = 0 has rho(F) = 1 + a."""
    import numpy as np
    from scipy.integrate import quad
    from scipy.special import k0e, k1e

    def f(y):
        mu = y * k1e(y) / k0e(y)
        return 2.0 * (mu - 1.0) ** 2 * k0e(y) * np.exp(-y) / np.pi

    return float(sum(quad(f, lo, hi, epsabs=1e-13, epsrel=1e-12, limit=400)[0]
                     for lo, hi in ((0, 1), (1, 10), (10, np.inf))))


def closed_form_section(d: Derivation) -> str:
    kind = closed_form_kind(d)
    if kind is None:
        return ""
    body = {"gaussian": _gaussian, "phase-retrieval": _phase_retrieval, "sign": _sign,
            "two-point": _two_point, "product": _product, "published": _published}[kind](d)
    title = "Known values" if kind == "published" else "Closed forms"
    return "\n".join([rf"\section*{{{title}}}", body]) + "\n"


def _gaussian(d: Derivation) -> str:
    D, pD = sp.latex(noise(d)), _plus_noise(d)
    T, p = d.tokens, d.p
    aT = sp.latex(sp.Symbol("alpha") * T)
    scalar = p == 1
    I = "" if scalar else f"\\, I_{{{p}}}"
    yt, wt = ("y_{t}", r"\omega_{t}") if scalar and T > 1 else (("y_{\\cdot t}", r"\omega_{\cdot t}") if T > 1 else ("y", r"\omega"))
    if scalar:
        den = f"v{pD}"
        gt = _G if T == 1 else _g("t")
        lines = [rf"{gt} &= \frac{{{yt} - {wt}}}{{{den}}}, \qquad \partial_\omega {gt} = -\frac{{1}}{{{den}}}",
                 rf"\hat q &= \frac{{{aT}}}{{1 - q{pD}}}, \qquad q = \frac{{\hat q}}{{1 + \hat q}}",
                 rf"\Psi_{{\rm out}}(q) &= -{_half(T)} \log\big(2\pi e\, (1 - q{pD})\big)"]
    else:
        inv = f"(V{pD}{I})^{{-1}}"
        gc = _g(r"\cdot t") if T > 1 else _G
        lines = [rf"{gc} &= {inv}\,({yt} - {wt}), \qquad \partial_\omega {gc} = -{inv}",
                 rf"\hat Q &= {aT}\, (I_{{{p}}} - Q{pD}{I})^{{-1}}, \qquad Q = \hat Q (I_{{{p}}} + \hat Q)^{{-1}}",
                 rf"\Psi_{{\rm out}}(Q) &= -{_half(T)} \log\det\big(2\pi e\, (I_{{{p}}} - Q{pD}{I})\big)"]
    iso = "" if scalar else f" (isotropic, $Q = q^* I_{{{p}}}$)"
    if noise(d) == 0:
        lines.append(rf"q^* &= \min({aT}, 1)")
        text = (f"The noiseless linear channel (theory \\S9, $\\Delta = 0$): per token the denoiser is linear and the "
                f"state evolution is closed; the fixed point{iso} solves $(q - 1)(q - {aT}) = 0$ in $[0, 1]$:")
        tail = (f"The error $1 - q^*$ vanishes linearly at $\\alpha = {_frac(sp.Rational(1, T))}$, the counting "
                f"threshold $p/m$.")
    else:
        lines.append(rf"q^* &= \frac{{b - \sqrt{{b^2 - 4 \cdot {aT}}}}}{{2}}, \qquad b = 1 + {D} + {aT}")
        text = (f"The Gaussian channel (theory \\S9): per token the denoiser is linear and the state evolution is "
                f"closed; the fixed point{iso} is the root in $[0, 1]$ of $q^2 - (1 + {D} + {aT})\\, q + {aT} = 0$:")
        tail = (f"The error $1 - q^*$ is positive at every $\\alpha$ for ${_noise_positive(d)}$; at "
                f"${_noise_name(d)} = 0$, "
                f"$q^* = \\min({aT}, 1)$: it vanishes linearly at $\\alpha = {_frac(sp.Rational(1, T))}$ (the "
                f"counting threshold $p/m$ of the noiseless link).")
    return text + "\n" + align(lines) + tail


def _phase_retrieval(d: Derivation) -> str:
    g = d.link[0]
    r = "y" if isinstance(g, sp.Abs) else r"\sqrt{y}"
    return (f"Phase retrieval $y = {'|z|' if isinstance(g, sp.Abs) else 'z^2'}$ (theory \\S9): the posterior is two "
            f"points $z = \\pm r$, $r = {r}$, so" + "\n"
            + align([rf"\mathbb E[z \mid y] &= r \tanh(r\omega/v), \qquad {_G} = \frac{{r \tanh(r\omega/v) - \omega}}{{v}}",
                     rf"\partial_\omega {_G} &= \frac{{r^2 \big(1 - \tanh^2(r\omega/v)\big)}}{{v^2}} - \frac{{1}}{{v}}"])
            + r"At $q = 0$, $G = r^2 - 1$, $F = \mathbb E(z^2 - 1)^2 = 2$: weak recovery at $\alpha_c = 1/2$. "
            r"The counting threshold is $\alpha_{\rm PR} = 1$; the uninformed state evolution reaches $q = 1$ above it "
            r"(no closed form: the $\hat q$ expectation is one-dimensional in $\xi$ and $\eta$ each).")


def _sign(d: Derivation) -> str:
    return ("The sign channel $y = \\operatorname{sign}(z)$ (theory \\S9), with $x = y\\omega/\\sqrt v$ and "
            "$\\phi$, $\\Phi$ the standard normal density and distribution function (this $\\Phi$ is not the "
            "free entropy):\n"
            + align([r"Z_{\rm out} &= \Phi(x), \qquad g_{\rm out} = \frac{y\, \phi(x)}{\sqrt v\, \Phi(x)}, "
                     r"\qquad \partial_\omega g_{\rm out} = -g_{\rm out}\big(g_{\rm out} + \omega/v\big)",
                     r"\hat q &= \alpha\, \mathbb E_\xi \sum_{y=\pm1} \frac{\phi(x_\xi)^2}{(1 - q)\, \Phi(y\, x_\xi)}, "
                     r"\qquad x_\xi = \frac{\sqrt q\, \xi}{\sqrt{1 - q}}, \qquad q = \frac{\hat q}{1 + \hat q}"])
            + r"At $q = 0$: $\hat q = 2\alpha/\pi > 0$, learning starts at any $\alpha > 0$; $q < 1$ at every $\alpha$.")


def _two_point(d: Derivation) -> str:
    T = d.tokens
    return (f"One tied rank-one layer (theory \\S9): $y$ fixes $h = z_{{1}} \\in \\mathbb R^{{{T}}}$ up to its sign "
            f"(inverse output map of the reduction section), so the posterior is the two points $\\pm h$ and, with "
            f"$h \\cdot \\omega = \\sum_t h_t \\omega_t$:\n"
            + align([rf"\mathbb E[z_{{1}} \mid y] &= h \tanh(h \cdot \omega / v), \qquad "
                     rf"{_G} = \frac{{h \tanh(h \cdot \omega/v) - \omega}}{{v}}",
                     rf"\partial_{{\omega_s}} {_g('t')} &= \frac{{h_t h_s \big(1 - \tanh^2(h \cdot \omega/v)\big)}}{{v^2}} "
                     rf"- \frac{{\delta_{{ts}}}}{{v}}"])
            + f"At $q = 0$: $G_{{ts}} = h_t h_s - \\delta_{{ts}}$, $F = {_jensen(T)}$, "
            f"$\\alpha_c = 1/{_jensen(T)}$; counting: $m = {d.counting['m']}$, "
            f"$\\alpha_{{\\rm PR}} = {_frac(sp.Rational(1, d.counting['m']))}$.")


def _product(d: Derivation) -> str:
    a = product_a()
    return (r"The product $y = z_{1} z_{2}$: at $Q = 0$ the posterior of $z_{1}$ given $y$ is proportional to "
            r"$e^{-(z_{1}^2 + y^2/z_{1}^2)/2}/|z_{1}|$ (and $z_{2} = y/z_{1}$), so with $K_0$, $K_1$ modified "
            r"Bessel functions and $y$ of density $K_0(|y|)/\pi$" + "\n"
            + align([r"\mathbb E[z_{1}^2 \mid y] &= \mathbb E[z_{2}^2 \mid y] = \mu(y) = \frac{|y|\, K_1(|y|)}{K_0(|y|)}, "
                     r"\qquad \mathbb E[z_{1} z_{2} \mid y] = y, \qquad "
                     r"G = \begin{pmatrix} \mu - 1 & y \\ y & \mu - 1 \end{pmatrix}",
                     r"F &= \begin{pmatrix} a & 0 & 1 \\ 0 & a + 1 & 0 \\ 1 & 0 & a \end{pmatrix} \quad "
                     r"\text{on } \big(E_{11}, \tfrac{E_{12} + E_{21}}{\sqrt 2}, E_{22}\big), \qquad "
                     rf"a = \mathbb E(\mu(y) - 1)^2 = {a:.4f}",
                     rf"\rho(F) &= 1 + a, \qquad \alpha_c = \frac{{1}}{{1 + a}} = {1 / (1 + a):.4f}"])
            + r"($\rho$ is reached both along $I_2$ and along $E_{12} + E_{21}$: $F$ is not diagonal, but its top "
            r"eigenvalue is degenerate.) Counting: $m = 1$, $\alpha_{\rm PR} = 2$.")


def _published(d: Derivation) -> str:
    c = param_symbol(d.spec.layers[0].skip)
    skip = sp.latex(c) if c.is_Symbol else "c"
    this = "" if c.is_Symbol else f" (this model: $c = {sp.latex(c)}$)"
    return (f"The published two-layer model ($T = 2$, tied, softmax, $\\beta = 1$; theory \\S5 and \\S9), "
            f"as functions of the skip ${skip}${this}. The operator at $Q = 0$ is diagonal, "
            f"$\\alpha_c = 1/B_{{22}}$ with $B_{{22}} = \\mathbb E\\sum_{{t,s}} (G_{{ts}})_{{22}}^2 \\le 6$: the last "
            f"layer $z_{{2}}$ is learned first, and $\\alpha_c \\to 1/6$ as ${skip} \\to \\infty$ (the last layer "
            f"alone, its index then revealed up to sign). Independent computations give "
            f"$\\alpha_c({skip} = 1) = 0.187 \\pm 0.003$; the first layer $z_{{1}}$ is learned later, between "
            f"$\\alpha = 0.7$ and $0.83$ at ${skip} = 1$; perfect recovery needs $\\alpha \\ge \\alpha_{{\\rm PR}} = 1$.")


# ----------------------------------------------------------------------------- all of it


def theory_sections(d: Derivation) -> str:
    """State evolution, free entropy, weak recovery, perfect recovery and closed forms, in order."""
    parts = [se_section(d), free_entropy_section(d), weak_recovery_section(d), perfect_recovery_section(d),
             closed_form_section(d)]
    return "\n".join(p for p in parts if p)
