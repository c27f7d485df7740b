"""Independent reference for the hardmax-last-layer denoiser (two layers, T = 2): no angular
quadrature and no polar rule.

Given u = z_1, v = M_1(u) z_2 ~ N(M m, s^2 M M^T). On each wedge of the v-plane that matches y,
{e0_perp . v > 0, -e1_perp . v > 0}, the probability is a bivariate normal orthant
probability (Owen's T, scipy.special.owens_t) and the first moment follows from Stein's
identity: E[(v - mu) 1_C] = -Sigma sum over the two boundary rays of n_out int_0^inf N(r e) dr,
a one-dimensional Gaussian integral. The integral over u is scipy's adaptive cubature.
"""

import numpy as np
from scipy.integrate import cubature
from scipy.special import ndtr, owens_t

EDGES = np.array([0.0, 1.0, 2.0, 4.0, 5.0, 6.0, 8.0]) * np.pi / 4


def _phi2_upper(m1, m2, s1, s2, c12):
    """P(X1 > 0, X2 > 0) for a bivariate normal with means m, sds s, covariance c12 (vectorised)."""
    h, k = m1 / s1, m2 / s2
    rho = np.clip(c12 / (s1 * s2), -1 + 1e-15, 1 - 1e-15)
    h = np.where(h == 0, 1e-300, h)
    k = np.where(k == 0, 1e-300, k)
    sq = np.sqrt(1 - rho**2)
    beta = np.where(h * k > 0, 0.0, 0.5)
    return 0.5 * (ndtr(h) + ndtr(k)) - owens_t(h, (k - rho * h) / (h * sq)) - owens_t(k, (h - rho * k) / (k * sq)) - beta


def _ray_integral(e, mu, Si, detS):
    """int_0^inf N(r e; mu_n, Sigma_n) dr for one unit vector e, vectorised over n."""
    A = np.einsum("i,nij,j->n", e, Si, e)
    B = np.einsum("i,nij,nj->n", e, Si, mu)
    C = np.einsum("ni,nij,nj->n", mu, Si, mu)
    return np.exp(-0.5 * (C - B**2 / A)) * np.sqrt(2 * np.pi / A) * ndtr(B / np.sqrt(A)) / (2 * np.pi * np.sqrt(detS))


def region_moments(u, omega, V, mixing, wedges):
    """For u (n, 2): P(y | u) and E[z_2 1_region | u] (n, 2). ``mixing(u) -> (n, 2, 2)``."""
    s2 = V[1, 1] - V[0, 1] ** 2 / V[0, 0]
    m = omega[1][None, :] + V[0, 1] / V[0, 0] * (u - omega[0][None, :])
    M = mixing(u)
    mu = np.einsum("nij,nj->ni", M, m)
    S = s2 * np.einsum("nij,nkj->nik", M, M)
    detS = np.linalg.det(S)
    Si = np.linalg.inv(S)
    P = np.zeros(len(u))
    Ev = np.zeros((len(u), 2))
    for k in wedges:
        a0, a1 = EDGES[k], EDGES[k + 1]
        n0 = np.array([-np.sin(a0), np.cos(a0)])  # inner normal of the ray at a0
        n1 = np.array([np.sin(a1), -np.cos(a1)])  # inner normal of the ray at a1
        m1, m2 = mu @ n0, mu @ n1
        v1 = np.einsum("i,nij,j->n", n0, S, n0)
        v2 = np.einsum("i,nij,j->n", n1, S, n1)
        c12 = np.einsum("i,nij,j->n", n0, S, n1)
        Pk = _phi2_upper(m1, m2, np.sqrt(v1), np.sqrt(v2), c12)
        # Stein: E[(v - mu) 1_C] = Sigma * sum over the two rays of (inner normal) * int N dr
        I0 = _ray_integral(np.array([np.cos(a0), np.sin(a0)]), mu, Si, detS)
        I1 = _ray_integral(np.array([np.cos(a1), np.sin(a1)]), mu, Si, detS)
        Ev += mu * Pk[:, None] + np.einsum("nij,j->ni", S, n0) * I0[:, None] + np.einsum("nij,j->ni", S, n1) * I1[:, None]
        P += Pk
    Ew = np.einsum("nij,nj->ni", np.linalg.inv(M), Ev)
    return P, Ew


def reference(omega, V, mixing, wedges, rtol=1e-10):
    """(P(y), E[Z | y]) by adaptive cubature over u of the closed-form inner moments."""
    sd = np.sqrt(V[0, 0])

    def f(x):
        d = x - omega[0][None, :]
        prior = np.exp(-0.5 * (d**2).sum(axis=1) / V[0, 0]) / (2 * np.pi * V[0, 0])
        P, Ew = region_moments(x, omega, V, mixing, wedges)
        return np.stack([prior * P, prior * P * x[:, 0], prior * P * x[:, 1], prior * Ew[:, 0], prior * Ew[:, 1]], axis=1)

    lo = omega[0] - 9 * sd
    hi = omega[0] + 9 * sd
    res = cubature(f, lo, hi, rtol=rtol, atol=1e-16, max_subdivisions=20000)
    v = res.estimate
    Z = v[0]
    mean = np.array([[v[1], v[2]], [v[3], v[4]]]) / Z
    return Z, mean, res.status
