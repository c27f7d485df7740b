"""Two-layer (deep) AIM: forward model and state evolution with one overlap per layer.

Model (tied, T tokens, skip c, inverse temperature beta). Base index matrices of the ORIGINAL
tokens, one per layer, H_l = (X^T S_l X - Tr S_l I) / sqrt(d), S_l = W_l W_l^T / sqrt(r_l d)
(r_l = rho_l d). Layer 1 mixes the tokens, x^(1) = x M^T with M = c I + softmax_rows(beta H_1);
layer 2 reads the mixed tokens, h^(2) = (x^(1)T S_2 x^(1) - Tr S_2 M M^T) / sqrt(d) = M H_2 M^T,
and the label is y = softmax_rows(beta M H_2 M^T).

State evolution (docs/aim.md): the two matrices are estimated from the same sensing vectors;
each has its own rotation-invariant prior and its own scalar overlap q_l, conjugate q_hat_l:

    q_l     = Q0_l - m_{rho_l}(1 / q_hat_l)
    q_hat_l = 2 alpha E[ sum_{a<=b} w_ab g_{l,ab}^2 ],   g_l = d log Z / d omega_l

with Z(y; omega_1, omega_2, V_1, V_2) = E_{H_1 ~ N(omega_1, V_1)} N(e; L(H_1) omega_2, L Sigma_2 L^T),
e = (K_12 - K_11, K_12 - K_22) the part of K = M H_2 M^T that softmax reveals (T = 2), L(H_1) the
2 x 3 linear map H_2 -> e. The inner integral over H_1 is a 3-d Gauss-Hermite rule; the outer
expectation over (omega, H) (12-d) is randomised quasi-Monte Carlo (scrambled Sobol) with a
standard error from independent scramblings. Cross-layer overlaps (Tr S_1_hat S_2 / d) are
set to zero ("one overlap per layer"); the cross term E[g_1 g_2] that this drops is returned
as a diagnostic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import logsumexp
from scipy.stats import norm, qmc

from ..errors import AimsymError
from ..provenance import provenance
from ..results import Result
from .channels import to_matrix
from .spectral import prior_second_moment, rie_mmse

_W = np.array([2.0, 1.0, 2.0])  # variance multipliers of (11, 12, 22)


def softmax_rows(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def mixing(H1, skip, beta):
    """M = c I + softmax_rows(beta H_1), batched (..., T, T)."""
    T = H1.shape[-1]
    return skip * np.eye(T) + softmax_rows(beta * H1)


def forward_indices(H1, H2, skip, beta):
    """Label of the two-layer model from the base index matrices: softmax_rows(beta M H2 M^T)."""
    M = mixing(H1, skip, beta)
    return softmax_rows(beta * M @ H2 @ np.swapaxes(M, -1, -2))


def forward_network(X, S1, S2, skip, beta):
    """Plain forward pass of the network on tokens X (n, d, T) at finite d (for checking)."""
    d = X.shape[1]
    T = X.shape[2]
    H1 = (np.einsum("nia,ij,njb->nab", X, S1, X) - np.trace(S1) * np.eye(T)) / np.sqrt(d)
    M = mixing(H1, skip, beta)
    X1 = np.einsum("nia,nba->nib", X, M)  # x^(1)_b = sum_a M_ba x_a
    h2 = (np.einsum("nia,ij,njb->nab", X1, S2, X1) - np.trace(S2) * M @ np.swapaxes(M, 1, 2)) / np.sqrt(d)
    return softmax_rows(beta * h2)


def _L_matrix(M):
    """e = L vec(H2) with vec = (H_11, H_12, H_22), e = (K12 - K11, K12 - K22), K = M H M^T."""
    def coef(i, j):
        return np.stack([M[..., i, 0] * M[..., j, 0],
                         M[..., i, 0] * M[..., j, 1] + M[..., i, 1] * M[..., j, 0],
                         M[..., i, 1] * M[..., j, 1]], axis=-1)

    return np.stack([coef(0, 1) - coef(0, 0), coef(0, 1) - coef(1, 1)], axis=-2)  # (..., 2, 3)


def _reveal(y, beta):
    """e from the label: log(y_ab / y_aa) = beta (K_ab - K_aa)."""
    logy = np.log(y)
    return np.stack([(logy[..., 0, 1] - logy[..., 0, 0]) / beta,
                     (logy[..., 1, 0] - logy[..., 1, 1]) / beta], axis=-1)


class TwoLayerChannel:
    """Scores of the two-layer softmax model (T = 2) with a Gauss-Hermite rule over H_1."""

    def __init__(self, skip=1.0, beta=1.0, n_inner=10):
        if not np.isfinite(skip) or skip <= 0:
            raise AimsymError("skip", f"must be > 0, got {skip}")
        if not np.isfinite(beta) or beta <= 0:
            raise AimsymError("beta", f"must be > 0, got {beta}")
        self.skip, self.beta, self.n_inner = float(skip), float(beta), int(n_inner)
        x, w = np.polynomial.hermite_e.hermegauss(self.n_inner)
        grid = np.stack(np.meshgrid(x, x, x, indexing="ij"), -1).reshape(-1, 3)
        self.xi = grid
        self.log_w = np.log(np.prod(np.stack(np.meshgrid(w, w, w, indexing="ij"), -1).reshape(-1, 3), -1) / (2 * np.pi) ** 1.5)

    def scores(self, e, omega1, omega2, V1, V2):
        """log Z, g1, g2 for a batch: e (n, 2), omega_l (n, 3). The 2 x 3 algebra is written out
        elementwise (much faster than batched einsum on tiny matrices)."""
        s1 = np.sqrt(_W * V1)
        H1 = omega1[:, None, :] + s1 * self.xi[None]  # (n, K, 3)
        z = self.beta * H1
        # row softmax of [[h11, h12], [h12, h22]]: p0 = P(row 0 -> token 0), p1 = P(row 1 -> token 1)
        p0 = 1.0 / (1.0 + np.exp(z[..., 1] - z[..., 0]))
        p1 = 1.0 / (1.0 + np.exp(z[..., 1] - z[..., 2]))
        c = self.skip
        m00, m01, m10, m11 = c + p0, 1.0 - p0, 1.0 - p1, c + p1
        k01 = (m00 * m10, m00 * m11 + m01 * m10, m01 * m11)
        k00 = (m00 * m00, 2 * m00 * m01, m01 * m01)
        k11 = (m10 * m10, 2 * m10 * m11, m11 * m11)
        La = [k01[j] - k00[j] for j in range(3)]
        Lb = [k01[j] - k11[j] for j in range(3)]
        wv = _W * V2
        Caa = sum(La[j] ** 2 * wv[j] for j in range(3))
        Cbb = sum(Lb[j] ** 2 * wv[j] for j in range(3))
        Cab = sum(La[j] * Lb[j] * wv[j] for j in range(3))
        ra = e[:, 0:1] - sum(La[j] * omega2[:, j : j + 1] for j in range(3))
        rb = e[:, 1:2] - sum(Lb[j] * omega2[:, j : j + 1] for j in range(3))
        det = Caa * Cbb - Cab * Cab
        ua = (Cbb * ra - Cab * rb) / det
        ub = (Caa * rb - Cab * ra) / det
        loglik = -0.5 * (ra * ua + rb * ub) - 0.5 * np.log(det) - np.log(2 * np.pi)
        logp = self.log_w[None] + loglik
        logZ = logsumexp(logp, axis=1)
        p = np.exp(logp - logZ[:, None])
        g1 = (p @ self.xi) / s1
        g2 = np.stack([np.sum(p * (La[j] * ua + Lb[j] * ub), axis=1) for j in range(3)], -1)
        return logZ, g1, g2


def information(q1, q2, rho1, rho2, channel: TwoLayerChannel, *, n_outer=2048, n_scrambles=4, seed=0):
    """(I_1, I_2, their standard errors, cross term) with q_hat_l = alpha I_l, by randomised QMC."""
    V1 = prior_second_moment(rho1) - q1
    V2 = prior_second_moment(rho2) - q2
    if V1 <= 0 or V2 <= 0:
        raise AimsymError("q", "overlaps must stay below Q0 (perfect recovery not supported here)")
    est = []
    for k in range(n_scrambles):
        u = qmc.Sobol(12, scramble=True, seed=np.random.default_rng([seed, k])).random(n_outer)
        z = norm.ppf(np.clip(u, 1e-15, 1 - 1e-15))
        om1 = np.sqrt(_W * q1) * z[:, 0:3]
        om2 = np.sqrt(_W * q2) * z[:, 3:6]
        H1 = om1 + np.sqrt(_W * V1) * z[:, 6:9]
        H2 = om2 + np.sqrt(_W * V2) * z[:, 9:12]
        L = _L_matrix(mixing(to_matrix(H1, 2), channel.skip, channel.beta))
        e = np.einsum("nij,nj->ni", L, H2)
        _, g1, g2 = channel.scores(e, om1, om2, V1, V2)
        est.append([2 * np.mean(np.sum(_W * g1**2, 1)), 2 * np.mean(np.sum(_W * g2**2, 1)),
                    2 * np.mean(np.sum(_W * g1 * g2, 1))])
    est = np.array(est)
    sem = est.std(axis=0, ddof=1) / np.sqrt(n_scrambles)
    return est.mean(0), sem


@dataclass
class TwoLayerSEPoint(Result):
    """Two-layer AIM state evolution at one alpha: overlaps, mmse and conjugates per layer, the
    QMC errors of the information, the iteration history."""

    alpha: float
    rho1: float
    rho2: float
    skip: float
    beta: float
    q1: float
    q2: float
    mmse1: float
    mmse2: float
    q_hat1: float
    q_hat2: float
    information_sem: list
    cross_information: float
    cross_information_sem: float
    iterations: int
    history: list
    provenance: dict


def state_evolution(alpha, rho1=0.5, rho2=0.5, skip=1.0, beta=1.0, *, damping=0.3, tol=1e-4,
                    max_iter=200, n_inner=10, n_outer=2048, n_scrambles=4, seed=0):
    """Two-layer SE from the uninformed start (q_l = rho_l). Returns q, mmse per layer."""
    alpha = float(alpha)
    if not np.isfinite(alpha) or alpha <= 0:
        raise AimsymError("alpha", f"must be > 0, got {alpha}")
    ch = TwoLayerChannel(skip, beta, n_inner)
    Q01, Q02 = prior_second_moment(rho1), prior_second_moment(rho2)
    q = np.array([rho1, rho2], dtype=float)
    hist = []
    info = sem = None
    for it in range(1, max_iter + 1):
        info, sem = information(q[0], q[1], rho1, rho2, ch, n_outer=n_outer, n_scrambles=n_scrambles, seed=seed)
        q_hat = alpha * info[:2]
        q_new = np.array([Q01 - rie_mmse(1 / q_hat[0], rho1), Q02 - rie_mmse(1 / q_hat[1], rho2)])
        q_new = np.minimum(q_new, [Q01 * (1 - 1e-6), Q02 * (1 - 1e-6)])
        q_next = (1 - damping) * q_new + damping * q
        hist.append(q_next.tolist())
        if np.max(np.abs(q_next - q)) < tol:
            q = q_next
            break
        q = q_next
    return TwoLayerSEPoint(
        alpha=alpha, rho1=rho1, rho2=rho2, skip=skip, beta=beta,
        q1=q[0], q2=q[1], mmse1=Q01 - q[0], mmse2=Q02 - q[1],
        q_hat1=alpha * info[0], q_hat2=alpha * info[1],
        information_sem=sem[:2].tolist(), cross_information=info[2], cross_information_sem=sem[2],
        iterations=it, history=hist,
        provenance=provenance(seed=seed, accuracy={"n_inner": n_inner, "n_outer": n_outer,
                                                   "n_scrambles": n_scrambles, "tol": tol}),
    )
