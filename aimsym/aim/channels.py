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
    if activation == "hardmax" and T != 2:
        raise AimsymError("tokens", "hardmax is implemented for tokens = 2 only (T = 3 orthant rule missing)")
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

    def information_numeric(self, V, omega=None, n_nodes=6):
        """I = 2 E[sum w g^2] by Gauss-Hermite over h - omega, with y computed through the actual
        softmax(beta h) and the recovery above (checks the counting constant and beta
        independence; exact for polynomials of degree < 2 n_nodes)."""
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


def make_channel(activation: str, tokens: int, beta: float = 1.0):
    T = check_tokens(tokens, activation)
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
