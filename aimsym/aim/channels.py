"""Output channels of the AIM: y = sigma(beta h) for a symmetric T x T index matrix h.

Conventions (theory.md section 7). Unique entries of h are ordered as ``pairs(T)`` = [(a, b) for
a <= b]. Given the current estimate, h_ab ~ N(omega_ab, V) for a != b and h_aa ~ N(omega_aa, 2 V),
independently; in state evolution omega has the same law with V replaced by q.

Every channel exposes
- ``information(q, V)``: I(q, V) such that q_hat = alpha * I, with
  I = 2 E[ sum_{a<b} g_ab^2 + 2 sum_a g_aa^2 ],  g = d log Z_out / d omega (unique entries);
- ``denoise(y, omega, V)``: (g, dg) per sample, arrays of shape (n, L), dg = d g_ab / d omega_ab;
- ``sample(h)``: y from h (used to generate data).

Softmax (any beta > 0) and linear outputs reveal h on a subspace (softmax: up to the global shift
h + c 11^T), so I = c_T / V with the counting constants c_T = T^2 + T - 2 (softmax), T^2 + T
(linear). Hardmax (T = 2) reveals two signs: Gaussian orthant probabilities.
"""

from __future__ import annotations

import functools

import numpy as np
from scipy.special import log_ndtr, logsumexp, roots_genlaguerre

from ..errors import AimsymError, ChannelError

ACTIVATIONS = ("softmax", "linear", "hardmax")
_LOG_SQRT_2PI = 0.5 * np.log(2.0 * np.pi)


def pairs(tokens: int):
    return [(a, b) for a in range(tokens) for b in range(a, tokens)]


def entry_weights(tokens: int) -> np.ndarray:
    """Variance multiplier of each unique entry: 2 on the diagonal, 1 off it."""
    return np.array([2.0 if a == b else 1.0 for a, b in pairs(tokens)])


def counting_constant(tokens: int, activation: str) -> float:
    """c with q_hat = c alpha / (Q0 - q): T^2 + T - 2 (softmax), T^2 + T (linear)."""
    T = int(tokens)
    if activation == "softmax":
        return float(T * T + T - 2)
    if activation == "linear":
        return float(T * T + T)
    raise AimsymError("activation", f"no counting constant for {activation!r}; use softmax or linear")


def to_matrix(vec: np.ndarray, tokens: int) -> np.ndarray:
    """(..., L) unique entries -> (..., T, T) symmetric matrices."""
    out = np.zeros(vec.shape[:-1] + (tokens, tokens))
    for k, (a, b) in enumerate(pairs(tokens)):
        out[..., a, b] = vec[..., k]
        out[..., b, a] = vec[..., k]
    return out


def to_vector(mat: np.ndarray, tokens: int) -> np.ndarray:
    return np.stack([mat[..., a, b] for a, b in pairs(tokens)], axis=-1)


def check_tokens(tokens, activation):
    if activation not in ACTIVATIONS:
        raise AimsymError("activation", f"must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    try:
        T = int(tokens)
    except (TypeError, ValueError):
        raise AimsymError("tokens", f"must be an integer >= 2, got {tokens!r}") from None
    if T < 2 or T != tokens:
        raise AimsymError("tokens", f"must be an integer >= 2, got {tokens!r}")
    if activation == "hardmax" and T > 3:
        raise AimsymError("tokens", f"hardmax is implemented for tokens = 2 and 3 only, got {T}")
    return T


# ---------------------------------------------------------------------------------------
# Softmax and linear: h observed on a subspace
# ---------------------------------------------------------------------------------------


class LinearChannel:
    """y = h (all unique entries observed)."""

    activation = "linear"

    def __init__(self, tokens: int, beta: float = 1.0):
        self.tokens = check_tokens(tokens, "linear")
        self.beta = float(beta)

    def information(self, q, V):
        return counting_constant(self.tokens, "linear") / V

    def sample(self, h):
        return to_vector(h, self.tokens)

    def recover(self, y):
        """h (unique entries) from y, and the unobserved directions (none)."""
        return np.asarray(y, dtype=float), None

    def denoise(self, y, omega, V):
        w = entry_weights(self.tokens)
        g = (np.asarray(y) - omega) / (w * V)
        dg = np.broadcast_to(-1.0 / (w * V), g.shape).copy()
        return g, dg

    def information_numeric(self, V, omega=None, n_nodes=6):
        """I = 2 E[sum w g^2] by Gauss-Hermite over h - omega, with y computed through the actual
        link (softmax(beta h) and the log-ratio recovery; the identity for linear) and ``denoise``
        (checks the counting constant and beta independence; exact for polynomials of degree
        < 2 n_nodes, and g is linear in h - omega, so n_nodes = 2 is already exact)."""
        L = len(pairs(self.tokens))
        w = entry_weights(self.tokens)
        x, wx = np.polynomial.hermite_e.hermegauss(n_nodes)
        wx = wx / wx.sum()
        grids = np.meshgrid(*([x] * L), indexing="ij")
        xi = np.stack([g.ravel() for g in grids], axis=-1) * np.sqrt(w * V)
        weight = np.prod(np.meshgrid(*([wx] * L), indexing="ij"), axis=0).ravel()
        omega = np.zeros(L) if omega is None else np.asarray(omega, dtype=float)
        h = omega + xi
        y = self.sample(to_matrix(h, self.tokens))
        g, _ = self.denoise(y, omega, V)
        return 2.0 * np.sum(weight * np.sum(w * g**2, axis=-1))


class SoftmaxChannel(LinearChannel):
    """y = softmax_rows(beta h): reveals h up to the global shift h + c 1 1^T (any beta > 0)."""

    activation = "softmax"

    def __init__(self, tokens: int, beta: float = 1.0):
        self.tokens = check_tokens(tokens, "softmax")
        if not np.isfinite(beta) or beta <= 0:
            raise AimsymError("beta", f"must be a finite number > 0, got {beta}")
        self.beta = float(beta)

    def information(self, q, V):
        return counting_constant(self.tokens, "softmax") / V

    def sample(self, h):
        """Row softmax of beta h, computed stably (log-sum-exp); returns (n, T, T)."""
        z = self.beta * np.asarray(h)
        z = z - z.max(axis=-1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=-1, keepdims=True)

    def recover(self, y):
        """A representative h0 (unique entries) with h = h0 + c 11^T, from the log-ratios
        log(y_ab / y_aa) = beta (h_ab - h_aa); h0_00 is set to 0."""
        y = np.asarray(y, dtype=float)
        if np.any(y <= 0):
            raise ChannelError("y", "softmax outputs must be > 0 (underflow: lower beta or use log outputs)")
        T = self.tokens
        logy = np.log(y)
        d = (logy - np.diagonal(logy, axis1=-2, axis2=-1)[..., :, None]) / self.beta  # h_ab - h_aa
        h = np.zeros(y.shape[:-2] + (T, T))
        # row 0 relative to h_00 = 0, then h_aa = h_a0 - (h_a0 - h_aa)
        h[..., 0, :] = d[..., 0, :]
        h[..., :, 0] = d[..., 0, :]
        for a in range(1, T):
            h[..., a, a] = h[..., a, 0] - d[..., a, 0]
        for a in range(1, T):
            for b in range(a + 1, T):
                # average the two consistent determinations (rows a and b) to damp rounding
                hab = 0.5 * ((d[..., a, b] + h[..., a, a]) + (d[..., b, a] + h[..., b, b]))
                h[..., a, b] = hab
                h[..., b, a] = hab
        return to_vector(h, T), np.ones(len(pairs(T)))

    def denoise(self, y, omega, V):
        """Posterior of h is Gaussian on the line h0 + c 1 (unique entries): closed form."""
        h0, ones = self.recover(y)
        w = entry_weights(self.tokens)
        var = w * V
        precision = np.sum(ones**2 / var)  # = T^2 / (2 V)
        c = np.sum((omega - h0) / var, axis=-1) / precision
        mean = h0 + c[..., None] * ones
        g = (mean - omega) / var
        # d g_k / d omega_k = Cov(h_k, h_k | y) / var_k^2 - 1 / var_k, Cov = 1 / precision
        dg = np.broadcast_to(1.0 / (precision * var**2) - 1.0 / var, g.shape).copy()
        return g, dg


# ---------------------------------------------------------------------------------------
# Hardmax, T = 2: bivariate normal orthant probabilities
# ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _laguerre(n):
    x, w = roots_genlaguerre(n, 0.0)
    return x, np.log(w)


@functools.lru_cache(maxsize=4)
def _legendre01(n):
    x, w = np.polynomial.legendre.leggauss(n)
    return 0.5 * (x + 1.0), 0.5 * w


def log_bvn_cdf(a, b, r, n_nodes=48):
    """log Phi_2(a, b; r) for |r| < 1, vectorised and accurate deep in the lower tail.

    Two rules, each used where it is accurate:
    - min(a, b) > -2.5 (Phi_2 not small): Plackett's identity
      Phi_2 = Phi(a) Phi(b) + (1/2pi) int_0^r exp(-(a^2 - 2 s a b + b^2)/(2(1 - s^2))) / sqrt(1 - s^2) ds,
      Gauss-Legendre in s (entire integrand for |r| <= 1/3: ~1e-15);
    - min(a, b) = m <= -2.5: with X = m - t, Phi_2 = phi(m) int_0^inf exp(m t - t^2/2)
      Phi((M - r m + r t)/s) dt (M the other argument), t = tau / |m|, Gauss-Laguerre in tau,
      summed in log space (no underflow for any m).
    """
    a, b = np.broadcast_arrays(np.asarray(a, float), np.asarray(b, float))
    r = float(r)
    s = np.sqrt(1.0 - r * r)
    m = np.minimum(a, b)
    M = np.maximum(a, b)
    out = np.empty(a.shape)
    tail = m <= -2.5
    if np.any(tail):
        out[tail] = _log_bvn_lower(m[tail], M[tail], r, s, n_nodes)
    body = ~tail
    if np.any(body):
        ab, bb = a[body], b[body]
        x, w = _legendre01(24)
        sr = r * x[None, :]
        expo = -(ab[:, None] ** 2 - 2 * sr * ab[:, None] * bb[:, None] + bb[:, None] ** 2) / (2 * (1 - sr * sr))
        integral = r * np.sum(w * np.exp(expo) / np.sqrt(1 - sr * sr), axis=1) / (2 * np.pi)
        out[body] = np.log(np.exp(log_ndtr(ab) + log_ndtr(bb)) + integral)
    return out


def _log_bvn_lower(m, M, r, s, n_nodes):
    tau, logw = _laguerre(n_nodes)
    # decay rate of the integrand in t: |m| from exp(m t), plus the slope of log Phi(.) when its
    # argument is negative (r < 0 makes it fall with t); matching it keeps Laguerre accurate
    w0 = (M - r * m) / s
    scale = np.abs(m) + (abs(r) / s) * np.maximum(-w0, 0.0) * (r < 0)
    t = tau[None, :] / scale[:, None]
    # weight e^{-tau} is in logw; integrand = exp(m t - t^2/2 + tau) Phi(.) dt/dtau
    expo = m[:, None] * t - 0.5 * t * t + tau[None, :]
    arg = (M[:, None] - r * m[:, None] + r * t) / s
    terms = logw[None, :] + expo + log_ndtr(arg)
    return -0.5 * m * m - _LOG_SQRT_2PI + logsumexp(terms, axis=1) - np.log(scale)


def bvn_log_derivatives(a, b, r):
    """log Phi_2 and its first and second derivatives in (a, b), computed as ratios in log space.

    d Phi_2 / d a = phi(a) Phi((b - r a)/s); the mixed derivative is the joint density
    phi_2(a, b; r) = phi(a) phi((b - r a)/s) / s. (The joint density is NOT d log Z / d a: the
    score uses the partial derivative above.)
    """
    s = np.sqrt(1.0 - r * r)
    logZ = log_bvn_cdf(a, b, r)
    wa = (b - r * a) / s
    wb = (a - r * b) / s
    log_phi_a = -0.5 * a * a - _LOG_SQRT_2PI
    log_phi_b = -0.5 * b * b - _LOG_SQRT_2PI
    Ra = np.exp(log_phi_a + log_ndtr(wa) - logZ)
    Rb = np.exp(log_phi_b + log_ndtr(wb) - logZ)
    Pab = np.exp(log_phi_a - 0.5 * wa * wa - _LOG_SQRT_2PI - np.log(s) - logZ)
    Haa = -a * Ra - r * Pab - Ra * Ra
    Hbb = -b * Rb - r * Pab - Rb * Rb
    Hab = Pab - Ra * Rb
    return logZ, Ra, Rb, Haa, Hab, Hbb


class HardmaxChannel:
    """y = hardmax_rows(h), T = 2 (beta irrelevant). Observed: s1 = sign(h11 - h12) (row 1
    picks token 1), s2 = sign(h22 - h12). With u = (omega11 - omega12, omega22 - omega12),
    r = sqrt(3 V), k_i = s_i u_i / r: Z = Phi_2(k1, k2; s1 s2 / 3)."""

    activation = "hardmax"

    def __init__(self, tokens: int = 2, beta: float = 1.0, quad_step: float | None = None):
        self.tokens = check_tokens(tokens, "hardmax")
        if self.tokens != 2:
            raise AimsymError("tokens", f"HardmaxChannel is the T = 2 closed form; use Hardmax3Channel for T = 3, got {tokens}")
        self.beta = float(beta)
        self.step = 0.25 if quad_step is None else float(quad_step)  # trapezoid step in t: ~1e-9 relative

    # --- data -------------------------------------------------------------------------
    def sample(self, h):
        """Signs (n, 2): s1 = +1 iff row 1 picks token 1, s2 = +1 iff row 2 picks token 2."""
        h = np.asarray(h)
        s1 = np.where(h[..., 0, 0] > h[..., 0, 1], 1.0, -1.0)
        s2 = np.where(h[..., 1, 1] > h[..., 0, 1], 1.0, -1.0)
        return np.stack([s1, s2], axis=-1)

    # --- denoiser ---------------------------------------------------------------------
    def log_partition(self, y, omega, V):
        s1, s2 = y[..., 0], y[..., 1]
        r = np.sqrt(3.0 * V)
        k1 = s1 * (omega[..., 0] - omega[..., 1]) / r
        k2 = s2 * (omega[..., 2] - omega[..., 1]) / r
        out = np.empty(k1.shape)
        for c in (1.0, -1.0):
            sel = s1 * s2 == c
            out[sel] = log_bvn_cdf(k1[sel], k2[sel], c / 3.0)
        return out

    def denoise(self, y, omega, V):
        """g = d log Z / d omega (unique entries 11, 12, 22) and its diagonal Jacobian."""
        y = np.asarray(y, dtype=float)
        omega = np.asarray(omega, dtype=float)
        s1, s2 = y[..., 0], y[..., 1]
        r = np.sqrt(3.0 * V)
        k1 = s1 * (omega[..., 0] - omega[..., 1]) / r
        k2 = s2 * (omega[..., 2] - omega[..., 1]) / r
        R1, R2, H11, H12, H22 = (np.empty(k1.shape) for _ in range(5))
        for c in (1.0, -1.0):
            sel = s1 * s2 == c
            _, R1[sel], R2[sel], H11[sel], H12[sel], H22[sel] = bvn_log_derivatives(k1[sel], k2[sel], c / 3.0)
        g11, g22 = s1 * R1 / r, s2 * R2 / r
        g = np.stack([g11, -(g11 + g22), g22], axis=-1)
        dg = np.stack([H11, H11 + H22 + 2.0 * s1 * s2 * H12, H22], axis=-1) / r**2
        return g, dg

    # --- state evolution ----------------------------------------------------------------
    def information(self, q, V):
        """I(q, V) = 2 E[2 g11^2 + 2 g22^2 + g12^2], E over u ~ N(0, q [[3,1],[1,3]]) and y.

        Deterministic rule: u_i = c sinh(t_i) with c = sqrt(3 V) (the width of the strips where
        the score lives) and the trapezoid rule in t (geometric convergence for analytic
        integrands); the range covers 9 standard deviations of u.
        """
        q, V = float(q), float(V)
        if V <= 0:
            raise AimsymError("V", f"must be > 0, got {V}")
        if q <= 1e-14:
            return self._integrand(np.zeros((1, 2)), V)[0]
        c = np.sqrt(3.0 * V)
        t_max = np.arcsinh(9.0 * np.sqrt(3.0 * q) / c)
        n = max(8, int(np.ceil(t_max / self.step)))
        t = np.linspace(-t_max, t_max, 2 * n + 1)
        h = t[1] - t[0]
        u1d = c * np.sinh(t)
        du = c * np.cosh(t) * h
        U1, U2 = np.meshgrid(u1d, u1d, indexing="ij")
        W = np.outer(du, du)
        # density of u ~ N(0, q C), C = [[3, 1], [1, 3]], C^{-1} = [[3, -1], [-1, 3]] / 8
        quad = (3.0 * U1 * U1 - 2.0 * U1 * U2 + 3.0 * U2 * U2) / (8.0 * q)
        dens = np.exp(-0.5 * quad) / (2.0 * np.pi * q * np.sqrt(8.0))
        keep = quad < 2 * 60.0  # beyond e^-60 the weight is negligible
        u = np.stack([U1[keep], U2[keep]], axis=-1)
        vals = self._integrand(u, V)
        return float(np.sum(W[keep] * dens[keep] * vals))

    def _integrand(self, u, V):
        """sum_y Z(y; u) * 2 (2 g11^2 + 2 g22^2 + g12^2) at fixed u = (u1, u2)."""
        total = np.zeros(len(u))
        omega = np.stack([u[:, 0], np.zeros(len(u)), u[:, 1]], axis=-1)
        for s1 in (1.0, -1.0):
            for s2 in (1.0, -1.0):
                y = np.broadcast_to(np.array([s1, s2]), (len(u), 2))
                logZ = self.log_partition(y, omega, V)
                g, _ = self.denoise(y, omega, V)
                G2 = 2.0 * g[:, 0] ** 2 + 2.0 * g[:, 2] ** 2 + g[:, 1] ** 2
                total += np.exp(logZ) * G2
        return 2.0 * total


# ---------------------------------------------------------------------------------------
# Hardmax, T = 3: chamber decomposition and nested Gauss-Legendre panels
# ---------------------------------------------------------------------------------------
#
# Unique entries in the order 00, 01, 02, 11, 12, 22. At V = 1 (everything scales with sqrt V:
# Z(y; omega, V) = Z(y; omega / sqrt V, 1)) the off-diagonals o_e ~ N(omega_e, 1) and the diagonals
# h_aa ~ N(omega_aa, 2). Split the off-diagonal space into the 6 chambers o_p > o_m > o_s. Inside a
# chamber every row's largest off-diagonal is fixed (o_p for the two rows that contain p, o_m for the
# third row), so given the off-diagonals row a contributes one factor: Phi((omega_aa - x)/sqrt 2) if it
# picks its diagonal, Phi((x - omega_aa)/sqrt 2) if it picks its largest off-diagonal x, and 0 if it
# picks the smaller one. o_s enters only through o_s < o_m, i.e. Phi(o_m - omega_s). Hence
#
#     Z_chamber = int_{u > v} A(u) B(v) du dv,   A(u) = phi(u - omega_p) f_a(u) f_b(u),
#                                                B(v) = phi(v - omega_m) Phi(v - omega_s) f_c(v),
#
# a nested integral of two smooth (log-concave) functions: int B(v) G_A(v) dv with
# G_A(v) = int_v^inf A. Both live on the common axis of off-diagonal values; we cover
# [min omega - pad, max omega + pad] with Gauss-Legendre panels and compute the tail integrals
# G_A at the nodes exactly for the panel interpolant (spectral integration matrix). Derivatives of
# Z with respect to omega multiply A or B by explicit factors ((u - omega_p), Mills ratios, ...),
# so Z, dZ/domega and the diagonal d2Z/domega2 come from the same sums. Scaled per chamber by the
# maxima of log A and log B (log-space: finite down to log Z of about -700 relative spreads).

_H3_OFF = ((0, 1), (0, 2), (1, 2))
_H3_OFF_INDEX = (1, 2, 4)
_H3_DIAG_INDEX = (0, 3, 5)
_H3_WEIGHTS = np.array([2.0, 1.0, 1.0, 2.0, 1.0, 2.0])
_SQRT2 = np.sqrt(2.0)


def _h3_chambers():
    import itertools

    out = []
    for p, m, s in itertools.permutations(range(3)):
        ep, em, es = _H3_OFF[p], _H3_OFF[m], _H3_OFF[s]
        c = (set(em) & set(es)).pop()  # the row whose off-diagonals are o_m and o_s
        out.append((p, m, s, ep[0], ep[1], c))
    return tuple(out)


_H3_CHAMBERS = _h3_chambers()


def hardmax3_patterns():
    """All 27 patterns y = (argmax of row 0, row 1, row 2); index y0 * 9 + y1 * 3 + y2."""
    return np.array([(a, b, c) for a in range(3) for b in range(3) for c in range(3)])


@functools.lru_cache(maxsize=8)
def _panel_rule(k):
    """Gauss-Legendre nodes/weights on [-1, 1] and C[i, j] = int_{x_i}^{1} l_j(t) dt, the in-panel
    tail integral of the Lagrange interpolant through the nodes (exact for degree < k)."""
    x, w = np.polynomial.legendre.leggauss(k)
    vander = np.polynomial.legendre.legvander(x, k - 1)
    tails = np.empty((k, k))
    for n in range(k):
        c = np.zeros(k)
        c[n] = 1.0
        ic = np.polynomial.legendre.legint(c, lbnd=-1.0)
        tails[:, n] = np.polynomial.legendre.legval(1.0, ic) - np.polynomial.legendre.legval(x, ic)
    return x, w, tails @ np.linalg.inv(vander)


def _h3_block(omega, k, width, pad, second, windows=False):
    """One block of samples at V = 1. Returns logZ (n, 27), R1 = Z'/Z and R2 = Z''/Z (n, 27, 6).

    Panels: ``windows=False`` covers [min omega - pad, max omega + pad] (every pattern, also deep in
    the tails); ``windows=True`` covers only the union of [omega_e - pad, omega_e + pad] around the
    three off-diagonal means (each with ceil(2 pad / width) panels, narrower where windows overlap):
    the cost no longer grows with the spread of omega, exact for every pattern whose posterior stays
    within pad of the prior means, i.e. all patterns with non-negligible Z (used by the SE)."""
    n = omega.shape[0]
    xr, wr, C = _panel_rule(k)
    Ct = np.ascontiguousarray(C.T)
    Pw = max(1, int(np.ceil(2.0 * pad / width)))
    if windows and np.max(np.ptp(omega, axis=1) + 2.0 * pad) / width <= 3 * Pw:
        windows = False  # the plain range is shorter
    if windows:
        c = np.sort(omega[:, list(_H3_OFF_INDEX)], axis=1)
        edges = []
        prev_end = np.full(n, -np.inf)
        for i in range(3):
            start = np.maximum(c[:, i] - pad, prev_end)
            end = c[:, i] + pad
            edges.append((start, end))
            prev_end = end
        starts = np.concatenate([st[:, None] + (en - st)[:, None] * np.arange(Pw)[None, :] / Pw
                                 for st, en in edges], axis=1)
        widths = np.concatenate([np.repeat(((en - st) / Pw)[:, None], Pw, axis=1) for st, en in edges], axis=1)
        half = 0.5 * widths[:, :, None]  # (n, P, 1)
        x = starts[:, :, None] + half * (1.0 + xr[None, None, :])
    else:
        lo = omega.min(axis=1) - pad
        P = max(1, int(np.ceil(np.max(omega.max(axis=1) + pad - lo) / width)))
        half = np.full((n, P, 1), 0.5 * width)
        x = lo[:, None, None] + half * (1.0 + 2.0 * np.arange(P)[None, :, None] + xr[None, None, :])
    wq = half * wr
    col = lambda i: omega[:, i][:, None, None]  # noqa: E731

    dev, logphi, logPhi, mills = [], [], [], []
    for i in _H3_OFF_INDEX:
        d = x - col(i)
        lp = log_ndtr(d)
        dev.append(d)
        logphi.append(-0.5 * d * d)
        logPhi.append(lp)
        mills.append(np.exp(-0.5 * d * d - _LOG_SQRT_2PI - lp))  # phi(d) / Phi(d)
    # row a: choice 0 = picks its diagonal, f = Phi(z); 1 = picks its largest off-diagonal, f = Phi(-z)
    logf, r1, r2 = {}, {}, {}
    for a in range(3):
        z = (col(_H3_DIAG_INDEX[a]) - x) / _SQRT2
        for choice, sgn in ((0, 1.0), (1, -1.0)):
            lz = log_ndtr(sgn * z)
            m = np.exp(-0.5 * z * z - _LOG_SQRT_2PI - lz)
            logf[a, choice] = lz
            r1[a, choice] = sgn * m / _SQRT2  # (d f / d omega_aa) / f
            r2[a, choice] = -sgn * z * m / 2.0  # (d2 f / d omega_aa2) / f

    def tail(A):
        # A (n, l, P, k) -> int_{x_node}^{inf} A, same shape
        inside = half[:, None] * (A @ Ct)
        tot = half[:, None, :, 0] * (A @ wr)
        after = np.cumsum(tot[..., ::-1], axis=-1)[..., ::-1]
        after = np.concatenate([after[..., 1:], np.zeros(after.shape[:-1] + (1,))], axis=-1)
        return inside + after[..., None]

    nd = 2 if second else 1
    acc_scale = [[] for _ in range(27)]
    acc = [[] for _ in range(27)]
    for p, m, s, a, b, c in _H3_CHAMBERS:
        ip, im, is_ = _H3_OFF_INDEX[p], _H3_OFF_INDEX[m], _H3_OFF_INDEX[s]
        ep, em = _H3_OFF[p], _H3_OFF[m]
        for ca in (0, 1):
            for cb in (0, 1):
                lA = logphi[p] + logf[a, ca] + logf[b, cb]
                MA = lA.max(axis=(1, 2))
                A = np.exp(lA - MA[:, None, None])
                # multipliers of A: entry index -> (first, second) derivative factor
                amult = [(ip, dev[p], dev[p] ** 2 - 1.0),
                         (_H3_DIAG_INDEX[a], r1[a, ca], r2[a, ca]),
                         (_H3_DIAG_INDEX[b], r1[b, cb], r2[b, cb])]
                stack = [A] + [A * f1 for _, f1, _ in amult]
                if second:
                    stack += [A * f2 for _, _, f2 in amult]
                G = tail(np.stack(stack, axis=1))  # (n, 1 + 3 nd, P, k)
                for cc in (0, 1):
                    lB = logphi[m] + logPhi[s] + logf[c, cc]
                    MB = lB.max(axis=(1, 2))
                    B = np.exp(lB - MB[:, None, None]) * wq
                    bmult = [(im, dev[m], dev[m] ** 2 - 1.0),
                             (is_, -mills[s], -dev[s] * mills[s]),
                             (_H3_DIAG_INDEX[c], r1[c, cc], r2[c, cc])]
                    Bf = B.reshape(n, -1, 1)
                    BG = (G.reshape(n, G.shape[1], -1) @ Bf)[..., 0]
                    Z = BG[:, 0]
                    d = np.zeros((n, nd, 6))
                    for j, (idx, _, _) in enumerate(amult):
                        d[:, 0, idx] = BG[:, 1 + j]
                        if second:
                            d[:, 1, idx] = BG[:, 4 + j]
                    BG0 = (B * G[:, 0]).reshape(n, 1, -1)
                    fs = np.stack([f for _, f1, f2 in bmult for f in ((f1, f2) if second else (f1,))], axis=1)
                    vals = (BG0 * fs.reshape(n, fs.shape[1], -1)).sum(axis=-1)
                    for j, (idx, _, _) in enumerate(bmult):
                        d[:, 0, idx] = vals[:, nd * j]
                        if second:
                            d[:, 1, idx] = vals[:, nd * j + 1]
                    y0 = a if ca == 0 else ep[0] + ep[1] - a
                    y1 = b if cb == 0 else ep[0] + ep[1] - b
                    y2 = c if cc == 0 else em[0] + em[1] - c
                    y = [0, 0, 0]
                    y[a], y[b], y[c] = y0, y1, y2
                    yi = 9 * y[0] + 3 * y[1] + y[2]
                    acc_scale[yi].append(MA + MB)
                    acc[yi].append((Z, d))
    logZ = np.full((n, 27), -np.inf)
    R = np.full((n, 27, nd, 6), np.nan)
    for yi in range(27):
        if not acc[yi]:
            continue  # the two cyclic patterns (o01 > o02 > o12 > o01): impossible
        S = np.max(acc_scale[yi], axis=0)
        fac = [np.exp(sc - S) for sc in acc_scale[yi]]
        Z = sum(f * z for f, (z, _) in zip(fac, acc[yi]))
        dZ = sum(f[:, None, None] * d for f, (_, d) in zip(fac, acc[yi]))
        with np.errstate(divide="ignore", invalid="ignore"):
            logZ[:, yi] = S + np.log(Z) - np.log(2.0 * np.pi)
            R[:, yi] = dZ / Z[:, None, None]
    return logZ, R


def hardmax3_moments(omega, V=1.0, *, nodes=10, width=1.0, pad=9.0, second=True, block=256, windows=False,
                      refine=True):
    """log Z(y; omega, V) for all 27 patterns y, with g = d log Z / d omega and (if ``second``) the
    diagonal d2 log Z / d omega2, for a batch omega (n, 6).

    Returns logZ (n, 27), g (n, 27, 6), dg (n, 27, 6) (dg None without ``second``); impossible
    patterns have logZ = -inf and NaN scores. Quadrature: panels of ``width`` (in units of sqrt V)
    with ``nodes`` Gauss-Legendre nodes each over [min omega - pad, max omega + pad]; the default
    agrees with 4x finer panels to ~1e-13 in log Z and g (and sums of Z over y equal 1 to 1e-15).
    Samples are processed in blocks sorted by spread (the panel count follows the spread).

    Deep in the tails (log Z < -40) the integrands steepen (log-slope ~ sqrt(2 |log Z|) per unit of
    sqrt V) and the in-panel interpolant of a steep tail can even dip below 0 (NaN); ``refine``
    recomputes such entries on panels narrowed to 6 / sqrt(2 |log Z|) with 12 nodes (log Z and g then
    agree with much finer panels to ~1e-9 down to log Z = -700): ``True`` for every possible pattern,
    an integer array (n,) for one pattern per sample (the observed one), ``False`` not at all.
    """
    omega = np.atleast_2d(np.asarray(omega, dtype=float))
    if omega.shape[-1] != 6:
        raise ChannelError("omega", f"hardmax T = 3 needs 6 unique entries per sample, got shape {omega.shape}")
    V = float(V)
    if not np.isfinite(V) or V <= 0:
        raise ChannelError("V", f"must be a finite number > 0, got {V}")
    if not np.all(np.isfinite(omega)):
        raise ChannelError("omega", "contains non-finite values")
    w1 = omega / np.sqrt(V)
    n = len(w1)
    nd = 2 if second else 1
    logZ = np.empty((n, 27))
    R = np.empty((n, 27, nd, 6))
    order = np.argsort(np.ptp(w1, axis=1))
    for start in range(0, n, block):
        sel = order[start:start + block]
        logZ[sel], R[sel] = _h3_block(w1[sel], nodes, width, pad, second, windows)
    if refine is not False:
        _refine_tails(w1, logZ, R, nodes, width, pad, second, refine)
    g = R[:, :, 0] / np.sqrt(V)
    dg = (R[:, :, 1] - R[:, :, 0] ** 2) / V if second else None
    return logZ, g, dg


def _refine_tails(w1, logZ, R, nodes, width, pad, second, refine):
    """Recompute (in place) the deep-tail entries of ``hardmax3_moments`` on narrower panels."""
    n = len(w1)
    if refine is True:
        mask = ~(logZ >= -40.0)  # includes -inf underflow and NaN
    else:
        idx = np.asarray(refine, dtype=int)
        mask = np.zeros((n, 27), dtype=bool)
        rows = np.arange(n)
        mask[rows, idx] = ~(logZ[rows, idx] >= -40.0)
    mask[:, list(_H3_CYCLIC)] = False
    deep = np.flatnonzero(mask.any(axis=1))
    if not len(deep):
        return
    # per sample: halvings of the panel width needed to reach 6 / sqrt(2 |log Z|) for its deepest entry
    lz = np.where(mask[deep], logZ[deep], 0.0)
    est = np.where(np.isfinite(lz), np.clip(-lz, 40.0, 745.0), 745.0).max(axis=1)
    level = np.maximum(np.ceil(np.log2(np.sqrt(2.0 * est) * width / 6.0)), 0.0)
    for lev in np.unique(level):
        sub = deep[level == lev]
        lz2, R2 = _h3_block(w1[sub], max(nodes, 12), width / 2.0**lev, pad, second, False)
        m = mask[sub]
        logZ[sub] = np.where(m, lz2, logZ[sub])
        R[sub] = np.where(m[..., None, None], R2, R[sub])


def _h3_hyperplanes():
    """The 9 linear forms whose sign some row compares: h_aa - h_ab (6) and, within row a,
    h_ab - h_ac (3); all annihilate the shift direction."""
    e = np.eye(6)
    forms = []
    for a in range(3):
        for b in range(3):
            if a != b:
                forms.append(e[_H3_DIAG_INDEX[a]] - e[_off_index(a, b)])
    forms += [e[1] - e[2], e[1] - e[4], e[2] - e[4]]
    return np.array(forms)


def _off_index(a, b):
    return _H3_OFF_INDEX[_H3_OFF.index((min(a, b), max(a, b)))]


_H3_TABLES = {}
_H3_CYCLIC = (15, 19)  # y = (1, 2, 0) and (2, 0, 1): o01 > o02 > o12 > o01 (or reversed), impossible


class Hardmax3Channel:
    """y = hardmax_rows(h), T = 3 (beta irrelevant). y is the (n, 3) array of row argmaxes
    (one-hot (n, 3, 3) matrices are accepted too). Z(y; omega, V) = P(h in the region of y) from
    the chamber decomposition (``hardmax3_moments``); the SE expectation from the scaling
    I(q, V) = J(q / V) / V and a fixed quasi-Monte-Carlo rule with hyperplane importance mixture
    (see ``information``)."""

    activation = "hardmax"

    def __init__(self, tokens: int = 3, beta: float = 1.0, *, nodes: int = 10, width: float = 1.0,
                 qmc_log2: int = 9, qmc_seed: int = 0, layer_scale: float = 2.0, interpolate: bool = True,
                 table_nodes: int = 14):
        self.tokens = check_tokens(tokens, "hardmax")
        if self.tokens != 3:
            raise AimsymError("tokens", f"Hardmax3Channel needs tokens = 3, got {tokens}")
        self.beta = float(beta)
        if int(nodes) != nodes or nodes < 4:
            raise AimsymError("nodes", f"must be an integer >= 4, got {nodes}")
        if not width > 0:
            raise AimsymError("width", f"must be > 0, got {width}")
        if int(qmc_log2) != qmc_log2 or not 4 <= qmc_log2 <= 20:
            raise AimsymError("qmc_log2", f"must be an integer in [4, 20], got {qmc_log2}")
        self.nodes, self.width = int(nodes), float(width)
        # inside the SE expectation: coarser panels (log Z, g to ~1e-8) on windows around the means
        self.se_nodes, self.se_width, self.se_pad = 8, 1.25, 8.5
        self.qmc_log2, self.qmc_seed, self.layer_scale = int(qmc_log2), int(qmc_seed), float(layer_scale)
        self.step = None  # the T = 2 trapezoid knob (reported by se.solve_root)
        self.interpolate, self.table_nodes, self.s_max = bool(interpolate), int(table_nodes), 1e6
        self._J_cache = {}

    @property
    def accuracy(self):
        return {"nodes": self.nodes, "width": self.width, "se_nodes": self.se_nodes, "se_width": self.se_width,
                "se_pad": self.se_pad, "qmc_points": 10 * 2**self.qmc_log2, "interpolate": self.interpolate,
                "table_nodes": self.table_nodes, "s_max": self.s_max,
                "qmc_seed": self.qmc_seed, "layer_scale": self.layer_scale}

    # --- data -------------------------------------------------------------------------
    def sample(self, h):
        """Row argmaxes of the symmetric (n, 3, 3) matrices h: an (n, 3) integer array."""
        h = np.asarray(h, dtype=float)
        if h.shape[-2:] != (3, 3):
            raise ChannelError("h", f"expected (n, 3, 3) index matrices, got shape {h.shape}")
        return np.argmax(h, axis=-1)

    def _pattern_index(self, y):
        y = np.asarray(y)
        if y.ndim >= 2 and y.shape[-2:] == (3, 3):
            if not np.all((y == 0) | (y == 1)) or not np.all(y.sum(axis=-1) == 1):
                raise ChannelError("y", "one-hot hardmax outputs must have a single 1 per row")
            y = np.argmax(y, axis=-1)
        y = np.atleast_2d(y)
        if y.shape[-1] != 3:
            raise ChannelError("y", f"expected (n, 3) row argmaxes or (n, 3, 3) one-hot rows, got shape {y.shape}")
        if not np.all(np.isin(y, (0, 1, 2))):
            raise ChannelError("y", "row argmaxes must be 0, 1 or 2")
        y = y.astype(int)
        return 9 * y[:, 0] + 3 * y[:, 1] + y[:, 2]

    # --- denoiser ---------------------------------------------------------------------
    def log_partition_all(self, omega, V):
        return hardmax3_moments(omega, V, nodes=self.nodes, width=self.width, second=False)[0]

    def log_partition(self, y, omega, V):
        return self._observed(y, omega, V, second=False)[0]

    def denoise(self, y, omega, V):
        """g = d log Z / d omega (unique entries 00, 01, 02, 11, 12, 22) and its diagonal Jacobian.

        Computes all 27 patterns per sample and keeps the observed one (the extra patterns cost
        little: they share every factor)."""
        _, g, dg = self._observed(y, omega, V, second=True)
        return g, dg

    def _observed(self, y, omega, V, second):
        """log Z, g, dg of the observed patterns (deep-tail samples refined by ``hardmax3_moments``)."""
        idx = self._pattern_index(y)
        omega = np.atleast_2d(np.asarray(omega, dtype=float))
        if len(idx) != len(omega):
            raise ChannelError("y", f"{len(idx)} outputs for {len(omega)} omega rows")
        rows = np.arange(len(idx))
        logZ, g, dg = hardmax3_moments(omega, V, nodes=self.nodes, width=self.width, second=second, refine=idx)
        logZ, g = logZ[rows, idx], g[rows, idx]
        dg = dg[rows, idx] if second else None
        if np.any(~np.isfinite(logZ)):
            raise ChannelError("y", "pattern impossible under the model (cyclic off-diagonal order) "
                                    "or of probability below the float range at this omega")
        return logZ, g, dg

    # --- state evolution ----------------------------------------------------------------
    def information(self, q, V):
        """I(q, V) = 2 E[sum_{a<b} g_ab^2 + 2 sum_a g_aa^2] = J(q / V) / V (hardmax is scale free:
        Z(y; omega, V) = Z(y; omega / sqrt V, 1)); J(s) is computed (and cached) by ``J``."""
        q, V = float(q), float(V)
        if not np.isfinite(V) or V <= 0:
            raise AimsymError("V", f"must be > 0, got {V}")
        if not np.isfinite(q) or q < 0:
            raise AimsymError("q", f"must be >= 0, got {q}")
        if self.interpolate and q / V > 1e-14:
            return self.J_interpolated(q / V) / V
        return self.J(q / V) / V

    def J_interpolated(self, s):
        """J(s) from a Chebyshev interpolant of F(u) = J(s) sqrt(1 + s) in u = log(1 + s) on
        [0, log(1 + s_max)] (F is flat: 5.9 at s = 0.5, 6.5 at s = 5000), built on first use from
        ``table_nodes`` evaluations of the rule and cached with the accuracy settings; beyond s_max,
        J = F(u_max) / sqrt(1 + s) (the large-s law J ~ s^(-1/2))."""
        key = (self.se_nodes, self.se_width, self.se_pad, self.qmc_log2, self.qmc_seed, self.layer_scale,
               self.table_nodes, self.s_max)
        cheb = _H3_TABLES.get(key)
        if cheb is None:
            umax = np.log1p(self.s_max)
            k = np.arange(self.table_nodes)
            t = np.cos(np.pi * (k + 0.5) / self.table_nodes)
            u = 0.5 * umax * (t + 1.0)
            F = [self.J(np.expm1(ui)) * np.exp(0.5 * ui) for ui in u]
            cheb = np.polynomial.chebyshev.Chebyshev.fit(u, F, self.table_nodes - 1, domain=[0.0, umax])
            _H3_TABLES[key] = cheb
        s = float(s)
        u = min(np.log1p(max(s, 0.0)), np.log1p(self.s_max))
        return float(cheb(u)) / np.sqrt(1.0 + s)

    def _integrand(self, omega1, nishimori=False):
        """sum_y Z 2 sum_k w_k g_k^2 at V = 1 (or, with ``nishimori``, the same with g^2 -> -dg)."""
        logZ, g, dg = hardmax3_moments(omega1, 1.0, nodes=self.se_nodes, width=self.se_width, pad=self.se_pad,
                                       second=nishimori, windows=True, refine=False)
        # entries left unrefined in the deep tail (log Z < -40, possibly NaN) weigh < e^-40: dropped
        ok = logZ >= -40.0
        Z = np.exp(np.where(ok, logZ, -np.inf))
        val = -dg if nishimori else g * g
        G2 = 2.0 * np.sum(_H3_WEIGHTS * np.where(ok[..., None], val, 0.0), axis=-1)
        return np.sum(np.where(ok, Z * G2, 0.0), axis=-1)

    def _points(self, s):
        """Nodes (N, 6) at V = 1 and weights (N,) of the rule for E over omega ~ N(0, s W).

        omega is invariant along the shift h + c 11^T, so only its 5-d component W-orthogonal to
        the shift is integrated (omega = sqrt(s) W^{1/2} B z, z ~ N(0, I_5), B an orthonormal basis).
        At large s the integrand lives on layers of width ~1 around the 9 hyperplanes where a row's
        comparison flips, so the rule is an equal mixture of 10 Gaussians: N(0, I_5) and, for each
        hyperplane with unit normal nu in z, the same law with the nu-component shrunk to
        sd kappa = (1 + s / layer_scale^2)^(-1/2) (about layer_scale noise widths), each with 2^m
        scrambled Sobol points (fixed seeds); weights p / q_mix (importance sampling with the
        balance heuristic)."""
        from scipy.stats import norm, qmc

        w = np.sqrt(_H3_WEIGHTS)
        u = 1.0 / w
        u = u / np.linalg.norm(u)
        basis = np.linalg.svd(np.eye(6) - np.outer(u, u))[0][:, :5]  # orthonormal basis of u-perp
        L = w[:, None] * basis  # omega = sqrt(s) L z
        forms = _h3_hyperplanes()
        nus = forms @ L
        nus = nus / np.linalg.norm(nus, axis=1, keepdims=True)
        kappa = 1.0 / np.sqrt(1.0 + s / self.layer_scale**2)  # ~ layer_scale / sqrt(s), smooth in s
        zs = []
        for j in range(len(forms) + 1):
            base = qmc.Sobol(5, scramble=True, seed=self.qmc_seed * 1000 + j).random_base2(self.qmc_log2)
            z = norm.ppf(np.clip(base, 1e-300, 1 - 1e-16))
            if j > 0:
                nu = nus[j - 1]
                t = z @ nu
                z = z + np.outer((kappa - 1.0) * t, nu)
            zs.append(z)
        z = np.concatenate(zs)
        t = z @ nus.T  # (N, 9)
        ratio = np.exp(-0.5 * t * t * (1.0 / kappa**2 - 1.0)) / kappa  # q_j / p
        qmix_over_p = (1.0 + ratio.sum(axis=1)) / (len(forms) + 1)
        return np.sqrt(s) * z @ L.T, 1.0 / (qmix_over_p * len(z))

    def J(self, s, nishimori=False):
        """J(s) = I(q, V) V at s = q / V: 2 E[sum_k w_k g_k^2] at V = 1, omega ~ N(0, s W), with
        y summed over its 27 patterns weighted by Z (exact) and omega by the rule of ``_points``.
        Deterministic; cached per s."""
        s = float(s)
        key = (s, nishimori)
        if key not in self._J_cache:
            if s <= 1e-14:
                val = float(self._integrand(np.zeros((1, 6)), nishimori)[0])
            else:
                pts, wts = self._points(s)
                val = float(np.sum(wts * self._integrand(pts, nishimori)))
            self._J_cache[key] = val
        return self._J_cache[key]


def make_channel(activation: str, tokens: int, beta: float = 1.0):
    T = check_tokens(tokens, activation)
    if activation == "hardmax" and T == 3:
        return Hardmax3Channel(T, beta)
    return {"softmax": SoftmaxChannel, "linear": LinearChannel, "hardmax": HardmaxChannel}[activation](T, beta)


def small_width_information_closed_form() -> float:
    """E[G^2] = E[2 g11^2 + 2 g22^2 + g12^2] of the hardmax T = 2 channel at q = 0, V = 1.

    At omega = 0: Z(s) = 1/4 + s1 s2 arcsin(1/3) / (2 pi) (orthant probability of correlation
    s1 s2 / 3), g11 = s1 / (2 sqrt(6 pi) Z), g22 = s2 / (2 sqrt(6 pi) Z), g12 = -(g11 + g22), so
    E[G^2] = (2 / (3 pi)) / Z_+ + (1 / (3 pi)) / Z_-, Z_+- = 1/4 +- arcsin(1/3) / (2 pi).
    """
    z_plus = 0.25 + np.arcsin(1.0 / 3.0) / (2.0 * np.pi)
    z_minus = 0.25 - np.arcsin(1.0 / 3.0) / (2.0 * np.pi)
    return (2.0 / (3.0 * np.pi)) / z_plus + (1.0 / (3.0 * np.pi)) / z_minus
