"""Large-depth limit of tied rank-one attention with separate weights per layer (numerics).

The network (theory section 2, the SMI paper's Appendix A.4): L layers with their own weights,
skip c = L / tau, each layer divided by c so that depth does not blow the tokens up,

    M_l = (I + (tau / L) S_l) M_{l-1},    S_l = sigma(beta (M_{l-1} z_l)(M_{l-1} z_l)^T),

and the output is the last layer's attention y = sigma(beta h h^T), h = M_{L-1} z_L. The
first layers' indices z_1 .. z_{L-1} are i.i.d. N(0, I_T) (one input, independent weights), so
M_{L-1} is a product of L - 1 independent small steps: as L -> infinity it converges to the
deterministic solution of the mean-field flow

    dM/dt = Sbar(M) M,  M(0) = I,  t in [0, tau],    Sbar(M) = E_{z ~ N(0, I_T)} sigma(beta (M z)(M z)^T)

with fluctuations O(1/sqrt(L)) and a bias O(1/L) (docs/models.md, "Large-depth limit").
The limit model is one attention layer after the fixed mixing Mbar = M(tau):
y = sigma(beta (Mbar z)(Mbar z)^T).

Sbar is a Gaussian average over R^T, taken in polar form: h = M z = r M u with u on the unit
sphere and s = r^2 / 2 = e^v. In v the radial integrand is analytic in a strip of half-width
pi/2 whatever beta |M|^2 (the poles of the logistic sit at arg s = pi/2), so the trapezoid rule
in v converges geometrically; the angular rule (trapezoid on the circle, Gauss-Legendre x
trapezoid on the sphere) converges algebraically (about n^-4), and the error estimate is the
difference to the rule with half the angles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numpy.polynomial.legendre import leggauss
from scipy.integrate import solve_ivp
from scipy.special import gammaln

from ..errors import SpecError
from ..numerics import softmax_rows

# angles per dimension of the sphere rule (T = 2: points on the circle; T = 3: cos-theta nodes)
ANGLES = {2: 256, 3: 32}
# radial rule: trapezoid in v = log(r^2 / 2) on [V_MIN / (T/2), V_MAX] with step V_STEP (the
# radial weight decays like e^{(T/2) v} below and like exp(-e^v) above: both tails < 1e-16)
V_MIN, V_MAX, V_STEP = -37.0, 4.0, 0.25
ODE_RTOL = 1e-12
ACTIVATIONS = ("softmax", "linear")


def activate(activation: str, A: np.ndarray) -> np.ndarray:
    return softmax_rows(A) if activation == "softmax" else A


def sphere_rule(T: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Directions u (D, T) on the unit sphere and weights summing to 1 (uniform measure)."""
    if T == 2:
        th = 2 * np.pi * (np.arange(n) + 0.5) / n
        return np.stack([np.cos(th), np.sin(th)], axis=1), np.full(n, 1.0 / n)
    if T == 3:
        x, w = leggauss(n)
        m = 2 * n
        ph = 2 * np.pi * (np.arange(m) + 0.5) / m
        ct = np.repeat(x, m)
        st = np.sqrt(1 - ct ** 2)
        p = np.tile(ph, n)
        u = np.stack([st * np.cos(p), st * np.sin(p), ct], axis=1)
        return u, np.repeat(w, m) / (2 * m)
    raise SpecError("tokens", f"the large-depth limit's mean-field mixing is computed for T = 2 or 3, got {T}")


def radial_rule(T: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes r^2 and weights of the chi^2_T law of |z|^2 (trapezoid in v = log(r^2 / 2))."""
    v = np.arange(V_MAX, V_MIN / (0.5 * T) - V_STEP / 2, -V_STEP)[::-1]
    s = np.exp(v)
    w = V_STEP * np.exp(0.5 * T * v - s - gammaln(0.5 * T))
    return 2 * s, w


@dataclass(frozen=True)
class Rule:
    """Tensor rule for E_{z ~ N(0, I_T)} f(z): z = r u, u on the sphere, r^2 on its radial rule."""

    directions: np.ndarray
    direction_weights: np.ndarray
    r2: np.ndarray
    radial_weights: np.ndarray

    @classmethod
    def make(cls, T: int, angles: int) -> "Rule":
        u, wu = sphere_rule(T, angles)
        r2, wr = radial_rule(T)
        return cls(u, wu, r2, wr)


def mean_attention(M: np.ndarray, beta: float, activation: str, rule: Rule) -> np.ndarray:
    """Sbar(M) = E_z sigma(beta (M z)(M z)^T), z ~ N(0, I_T)."""
    if activation == "linear":  # E[z z^T] = I: exact, no rule needed
        return beta * M @ M.T
    v = rule.directions @ M.T  # (D, T): M u per direction
    B = beta * v[:, :, None] * v[:, None, :]  # logits at r = 1
    S = softmax_rows(rule.r2[None, :, None, None] * B[:, None])  # (D, R, T, T)
    return np.einsum("d,r,drab->ab", rule.direction_weights, rule.radial_weights, S)


def _flow(tau: float, beta: float, T: int, activation: str, rule: Rule) -> np.ndarray:
    def rhs(_t, m):
        M = m.reshape(T, T)
        return (mean_attention(M, beta, activation, rule) @ M).ravel()

    sol = solve_ivp(rhs, (0.0, tau), np.eye(T).ravel(), method="DOP853", rtol=ODE_RTOL, atol=ODE_RTOL * 1e-2)
    if not sol.success:  # pragma: no cover - the flow is smooth for the allowed tau
        raise SpecError("tau", f"the mean-field flow did not integrate to tau = {tau}: {sol.message}")
    return sol.y[:, -1].reshape(T, T)


@dataclass(frozen=True)
class MeanFieldMixing:
    """Mbar = M(tau) of the mean-field flow, with its numerical error estimate (max abs entry)."""

    matrix: np.ndarray
    error: float
    angles: int
    tau: float
    beta: float
    activation: str

    def to_json(self) -> dict:
        return {"matrix": self.matrix.tolist(), "error": self.error, "angles": self.angles,
                "tau": self.tau, "beta": self.beta, "activation": self.activation,
                "rule": f"polar: {self.angles} angles, trapezoid in log(r^2/2) step {V_STEP}; "
                        f"DOP853 rtol {ODE_RTOL:g}; error = difference to the rule with half the angles"}


def check_limit(tau: float, beta: float, tokens: int, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise SpecError("activation", f"the large-depth limit is derived for {' or '.join(ACTIVATIONS)}, "
                                      f"got {activation!r} (hardmax attention has no mean-field flow here)")
    if tokens not in ANGLES:
        raise SpecError("tokens", f"the large-depth limit's mean-field mixing is computed for T = 2 or 3, got {tokens}")
    if activation == "linear" and 2 * beta * tau >= 1:
        raise SpecError("tau", f"with linear attention the flow dM/dt = beta M M^T M blows up at tau = 1/(2 beta) "
                               f"= {1 / (2 * beta):g}; got tau = {tau:g}")


def mean_field_mixing(tau: float, beta: float, tokens: int, activation: str = "softmax") -> MeanFieldMixing:
    """Mbar(tau) for the declared limit (numbers only: tau and beta must be known)."""
    return _mean_field_mixing(float(tau), float(beta), int(tokens), activation)


@functools.lru_cache(maxsize=32)
def _mean_field_mixing(tau: float, beta: float, tokens: int, activation: str) -> MeanFieldMixing:
    check_limit(tau, beta, tokens, activation)
    n = ANGLES[tokens]
    M = _flow(tau, beta, tokens, activation, Rule.make(tokens, n))
    if activation == "linear":
        err = 0.0  # Sbar is exact; only the ODE's tolerance remains
    else:
        err = float(np.abs(M - _flow(tau, beta, tokens, activation, Rule.make(tokens, n // 2))).max())
    # 12 significant digits: far below the error (~1e-9), above the last-digit noise of the ODE
    # solve across BLAS builds, so the generated modules are the same text on every machine
    M = np.vectorize(lambda x: float(f"{x:.12g}"))(M)
    return MeanFieldMixing(M, max(err, ODE_RTOL * float(np.abs(M).max())), n, tau, beta, activation)


# ----------------------------------------------------------------------------- finite depth


def finite_depth_mixing(z_first: np.ndarray, tau: float, beta: float, activation: str = "softmax") -> np.ndarray:
    """M_{L-1} of the finite-L network for first-layer indices z_first (n, L - 1, T); L is
    z_first.shape[1] + 1 and each layer's step is tau / L. Returns (n, T, T)."""
    n, Lm1, T = z_first.shape
    L = Lm1 + 1
    M = np.broadcast_to(np.eye(T), (n, T, T)).copy()
    for l in range(Lm1):
        h = np.einsum("nab,nb->na", M, z_first[:, l])
        S = activate(activation, beta * h[:, :, None] * h[:, None, :])
        M = M + (tau / L) * S @ M
    return M


def attention_output(M: np.ndarray, z_last: np.ndarray, beta: float, activation: str = "softmax") -> np.ndarray:
    """y = sigma(beta h h^T), h = M z_last: M (n, T, T) or (T, T), z_last (n, T) -> (n, T, T)."""
    h = np.einsum("ab,nb->na" if M.ndim == 2 else "nab,nb->na", M, z_last)
    return activate(activation, beta * h[:, :, None] * h[:, None, :])
