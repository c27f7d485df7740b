"""RIE for the AIM prior observed through *compound free-Poisson* noise.

Why: with the model's rank-one sensing, GAMP's effective observation R = S_hat + (1/A) sum g.X is
S plus a weighted sum of rank-one matrices. Per sample, sum_ab G_ab x_a x_b^T = sum_k gamma_k z_k z_k^T
(gamma_k the eigenvalues of the sample's weight matrix G, z_k = X v_k ~ N(0, I_d)), and the trace
term centres each one. So the noise is B = sum_j s_j (z_j z_j^T - I) over m = n T terms, whose law is
the centred free compound Poisson law with jumps t_j = d s_j, R-transform

    R_B(g) = (1/d) sum_j t_j^2 g / (1 - t_j g)        (variance sum_j t_j^2 / d).

It tends to the semicircle as m/d -> infinity, but at finite d its deviation is of relative order
d/m = 1/(T alpha d): at fixed alpha a 1/d effect, which the semicircle RIE pays for
(docs/aim.md section 4). Here the RIE uses the actual law; it gains only a 1/d^2 term, as the
optimum is stationary in the law, whose deviation is O(1/d) (docs/aim.md section 4).

Stieltjes transform of Y = S + B (S, B free): its inverse is the sum of the inverses,

    z(G) = G_S^{-1}(G) + R_B(G),   G_S^{-1}(G) = ((1 - rho) G - sqrt(rho)) / (G^2 - sqrt(rho) G)

(the prior sqrt(rho) MP(1/rho), from its quadratic). We solve z(G) = lambda - i eta by Newton,
continued from eta = 2 (where G ~ 1/z and the semicircle cubic gives a start on the physical
branch) down to eta = 0: the physical root is the unique one with Im G > 0 for eta > 0, and the
continuation tracks it onto the real axis, inside the bulk and outside it.

RIE map (subordination E[(z - Y)^{-1}] = (omega(z) - S)^{-1}, omega = z - R_B(G)):

    f(lambda) = lambda - Im[G R_B(G)] / Im G                 (inside the bulk),
    f(lambda) = lambda - Re[R_B(G) + G R_B'(G)]              (outside: the limit Im G -> 0).

For a semicircle, R_B = Delta g, this is lambda - 2 Delta Re G (``spectral.rie_map``).

The m jumps are compressed to a Gauss rule for the measure nu = (1/d) sum_j t_j^2 delta_{t_j}
(Lanczos on diag(t)): R_B(g) = g int dnu(t) / (1 - t g) is a Stieltjes function of nu, and a K-node
Gauss rule reproduces its Taylor series to order g^{2K} (Pade); tests check the map against the
full sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import AimsymError
from .spectral import stieltjes

GAUSS_NODES = 24  # Gauss nodes for the jump measure (tests: 1e-10 against all m jumps)
ETA_START, ETA_STEPS = 2.0, 28  # continuation eta = 2 ... 1e-12, geometric
NEWTON_STEPS, POLISH_STEPS = 4, 30
RESIDUAL_TOL = 1e-9  # |z(G) - lambda| accepted after polishing (relative to 1 + |lambda|)


@dataclass(frozen=True)
class CompoundNoise:
    """Centred free compound Poisson law: R(g) = g sum_k w_k / (1 - t_k g)."""

    t: np.ndarray  # jump sizes (Gauss nodes)
    w: np.ndarray  # weights of nu at the nodes (sum = variance)

    @property
    def variance(self) -> float:
        return float(np.sum(self.w))

    def r_transform(self, g):
        """R(g) and R'(g) (vectorised over g)."""
        g = np.asarray(g)
        den = 1.0 - self.t * g[..., None]
        R = g * np.sum(self.w / den, axis=-1)
        dR = np.sum(self.w / den**2, axis=-1)
        return R, dR


def _gauss_rule(t, mass, nodes):
    """K-node Gauss rule of the discrete measure sum_j mass_j delta_{t_j} (Lanczos with full
    reorthogonalisation on diag(t), started from sqrt(mass)); fewer nodes when the measure has
    fewer support points."""
    total = float(np.sum(mass))
    q = np.sqrt(mass / total)
    K = int(min(nodes, np.count_nonzero(mass)))
    Q = np.zeros((K, len(t)))
    a, b = np.zeros(K), np.zeros(K)
    for k in range(K):
        Q[k] = q
        v = t * q
        a[k] = q @ v
        v = v - Q[: k + 1].T @ (Q[: k + 1] @ v)  # full reorthogonalisation
        v = v - Q[: k + 1].T @ (Q[: k + 1] @ v)
        if k + 1 < K:
            b[k] = np.linalg.norm(v)
            if b[k] < 1e-14 * (1.0 + abs(a[k])):
                K = k + 1
                break
            q = v / b[k]
    J = np.diag(a[:K]) + np.diag(b[: K - 1], 1) + np.diag(b[: K - 1], -1)
    nodes_, vecs = np.linalg.eigh(J)
    return nodes_, total * vecs[0] ** 2


def compound_noise(jumps, d, nodes=GAUSS_NODES, variance=None) -> CompoundNoise:
    """The law of sum_j s_j (z_j z_j^T - I), z_j ~ N(0, I_d), from its jumps t_j = d s_j.

    ``nodes=None`` keeps every jump (the reference the Gauss rule is tested against).
    ``variance``: rescale the jumps' weights so that the law has this variance (the shape of the
    law is kept; GAMP passes its own Delta = d / (2 A))."""
    t = np.asarray(jumps, dtype=float).ravel()
    if t.size == 0 or not np.all(np.isfinite(t)):
        raise AimsymError("jumps", "must be a non-empty array of finite numbers")
    mass = t * t / float(d)
    if not np.any(mass > 0):
        raise AimsymError("jumps", "all jumps are zero: the noise has no variance")
    if nodes is None:
        keep = mass > 0
        t_n, w_n = t[keep], mass[keep]
    else:
        t_n, w_n = _gauss_rule(t, mass, int(nodes))
    if variance is not None:
        w_n = w_n * (float(variance) / np.sum(w_n))
    return CompoundNoise(t_n, w_n)


def _prior_inverse(G, rho):
    """G_S^{-1}(G) for the prior sqrt(rho) MP(1/rho) and its derivative."""
    r = np.sqrt(rho)
    num = (1.0 - rho) * G - r
    den = G * G - r * G
    return num / den, ((1.0 - rho) * den - num * (2.0 * G - r)) / den**2


def _z_of_G(G, rho, noise):
    w, dw = _prior_inverse(G, rho)
    R, dR = noise.r_transform(G)
    return w + R, dw + dR, R, dR


def _newton(z, G, rho, noise, steps):
    for _ in range(steps):
        zz, dz, _, _ = _z_of_G(G, rho, noise)
        G = G - (zz - z) / dz
    return G


def stieltjes_compound(lam, rho, noise: CompoundNoise):
    """G(lambda - i0) of S + B, S ~ sqrt(rho) MP(1/rho), B ~ ``noise``; Im G = pi density >= 0.
    Raises if the continuation does not land on a root (residual above RESIDUAL_TOL)."""
    lam = np.asarray(lam, dtype=float)
    G = stieltjes(lam - 1j * ETA_START, rho, noise.variance)
    for eta in np.geomspace(ETA_START, 1e-12, ETA_STEPS):
        G = _newton(lam - 1j * eta, G, rho, noise, NEWTON_STEPS)
    G = _newton(lam + 0j, G, rho, noise, POLISH_STEPS)
    resid = np.abs(_z_of_G(G, rho, noise)[0] - lam)
    if not np.all(np.isfinite(G)) or np.any(resid > RESIDUAL_TOL * (1.0 + np.abs(lam))):
        worst = float(np.max(np.where(np.isfinite(resid), resid, np.inf)))
        raise AimsymError("noise", f"compound-Poisson Stieltjes transform did not converge (residual {worst:.2g})")
    return np.real(G) + 1j * np.abs(np.imag(G))


def rie_map_compound(lam, rho, noise: CompoundNoise):
    """RIE eigenvalue map of S + B for compound free-Poisson noise B (module docstring)."""
    lam = np.asarray(lam, dtype=float)
    G = stieltjes_compound(lam, rho, noise)
    R, dR = noise.r_transform(G)
    im = np.imag(G)
    inside = im > 1e-7 * (1.0 + np.abs(G))
    ratio = np.imag(G * R) / np.where(inside, im, 1.0)
    return lam - np.where(inside, ratio, np.real(R + G * dR))
