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
from ..numerics import softmax_rows
from ..provenance import provenance
from ..results import Result
from .channels import to_matrix
from .spectral import prior_second_moment, rie_mmse

_W = np.array([2.0, 1.0, 2.0])  # variance multipliers of (11, 12, 22)


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

    def _posterior(self, e, omega1, omega2, V1, V2):
        """The H_1 rule's posterior weights and the per-node Gaussian H_2 step, shared by
        ``scores`` and ``denoise``. The 2 x 3 algebra is written out elementwise (much faster than
        batched einsum on tiny matrices). Returns log Z (n,), weights p (n, K), s1 = sqrt(w V1),
        the rows La, Lb of L(H_1) per node (3 arrays (n, K) each), u = C^-1 (e - L omega2) and
        the inverse covariance C^-1 = (Cbb, Caa, -Cab) / det per node."""
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
        # M singular (both rows of softmax saturated) makes C singular: floor det relative to Caa Cbb
        det = np.maximum(Caa * Cbb - Cab * Cab, 1e-12 * Caa * Cbb + 1e-300)
        ua = (Cbb * ra - Cab * rb) / det
        ub = (Caa * rb - Cab * ra) / det
        loglik = -0.5 * (ra * ua + rb * ub) - 0.5 * np.log(det) - np.log(2 * np.pi)
        logp = self.log_w[None] + loglik
        logZ = logsumexp(logp, axis=1)
        p = np.exp(logp - logZ[:, None])
        return logZ, p, s1, La, Lb, ua, ub, (Cbb / det, Caa / det, -Cab / det)

    def scores(self, e, omega1, omega2, V1, V2):
        """log Z, g1, g2 for a batch: e (n, 2), omega_l (n, 3)."""
        logZ, p, s1, La, Lb, ua, ub, _ = self._posterior(e, omega1, omega2, V1, V2)
        g1 = (p @ self.xi) / s1
        g2 = np.stack([np.sum(p * (La[j] * ua + Lb[j] * ub), axis=1) for j in range(3)], -1)
        return logZ, g1, g2

    def denoise(self, e, omega1, omega2, V1, V2):
        """GAMP output step: g_l = d log Z / d omega_l and the diagonal of d g_l / d omega_l
        (entries (11, 12, 22)); the cross-layer block d g_1 / d omega_2 is not used (one overlap
        per layer, as in the SE). With H_1 = omega_1 + s1 xi on the rule:
        g1 = E_p[xi] / s1, dg1 = (Var_p[xi] - 1) / s1^2; per node the H_2 step is Gaussian,
        v = L^T u, so g2 = E_p[v], dg2 = E_p[v^2] - g2^2 - E_p[(L^T C^-1 L)_kk]."""
        _, p, s1, La, Lb, ua, ub, (Iaa, Ibb, Iab) = self._posterior(e, omega1, omega2, V1, V2)
        m1 = p @ self.xi
        g1 = m1 / s1
        dg1 = (p @ self.xi**2 - m1**2 - 1.0) / s1**2
        g2 = np.empty_like(g1)
        dg2 = np.empty_like(g1)
        for j in range(3):
            v = La[j] * ua + Lb[j] * ub
            prec = La[j] ** 2 * Iaa + 2 * La[j] * Lb[j] * Iab + Lb[j] ** 2 * Ibb
            g2[:, j] = np.sum(p * v, axis=1)
            dg2[:, j] = np.sum(p * (v * v - prec), axis=1) - g2[:, j] ** 2
        return g1, g2, dg1, dg2


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


# --- GAMP at finite d -------------------------------------------------------------------------


@dataclass
class TwoLayerData:
    """Two-layer AIM data at finite d: tokens X (n, d, 2), labels y (n, 2, 2), teachers S_1, S_2
    (widths r_l = rho_l d; ``rho1``, ``rho2`` are the ratios actually used)."""

    X: np.ndarray
    y: np.ndarray
    S1: np.ndarray
    S2: np.ndarray
    rho1: float
    rho2: float
    alpha: float
    skip: float
    beta: float
    seed: int | None
    sensing: str = "rank1"  # the sensing matrices are the tokens' (amp.effective_observation)


def generate(d, alpha, rho1=0.5, rho2=0.5, skip=1.0, beta=1.0, seed=0) -> TwoLayerData:
    """Teachers S_l = W_l W_l^T / sqrt(r_l d), tokens and labels y = softmax_rows(beta M H_2 M^T)
    from an explicit seed (T = 2)."""
    from .data import check_size, index_matrices, teacher

    d, n = check_size(d, alpha, min(rho1, rho2))
    if not np.isfinite(skip) or skip <= 0:
        raise AimsymError("skip", f"must be > 0, got {skip}")
    if not np.isfinite(beta) or beta <= 0:
        raise AimsymError("beta", f"must be > 0, got {beta}")
    rng = np.random.default_rng(seed)
    S1, r1 = teacher(d, rho1, rng)
    S2, r2 = teacher(d, rho2, rng)
    X = rng.standard_normal((n, d, 2))
    y = forward_indices(index_matrices(S1, X), index_matrices(S2, X), skip, beta)
    return TwoLayerData(X, y, S1, S2, r1, r2, float(alpha), float(skip), float(beta), seed)


@dataclass
class TwoLayerGAMPRun(Result):
    """One two-layer GAMP run: per layer the final error ||S_hat_l - S_l||^2 / d, the overlap
    Tr(S_hat_l S_l) / d and the predicted V_l; iteration count, flags, per-iteration history."""

    mmse1: float
    mmse2: float
    overlap1: float
    overlap2: float
    V1: float
    V2: float
    iterations: int
    rejected_steps: int
    unstable: bool
    final_damping: float
    seconds_per_iteration: float
    history: list
    S_hat1: np.ndarray
    S_hat2: np.ndarray


def gamp(data: TwoLayerData, *, iterations=60, damping=0.5, n_inner=8, tol=1e-6, noise_ratio_max=2.5,
         max_damping=0.95, callback=None) -> TwoLayerGAMPRun:
    """Isotropic GAMP-RIE for the two-layer model, one matrix estimate per layer (the algorithm
    whose state evolution is :func:`state_evolution`). Per iteration, for l = 1, 2:

        omega_l = <X_k, S_hat_l> - w_k V_l g_l^prev           (Onsager, w = 2 diagonal, 1 off)
        g_l, dg_l = TwoLayerChannel.denoise(e, omega_1, omega_2, V_1, V_2)   (joint output step)
        A_l = -(1/d) sum_mu sum_k w_k dg_{l,k}
        R_l, Delta_l = amp.effective_observation(...)          (R_l = S_hat_l + (1/A_l) sum g_l . X)
        S_hat_l, V_l = RIE(R_l; rho_l, Delta_l), V_l from the divergence (amp.rie_denoise)

    Both layers are sensed by the same X; the cross-layer Jacobian d g_1 / d omega_2 (and the
    cross precision it would give) is dropped, as the SE drops the cross overlap. Damping and the
    noise-power safeguard are those of the one-layer ``amp.run`` (isotropic form): a step whose
    noise power exceeds ``noise_ratio_max`` Delta_l in either layer after iteration 3 is redone with
    more damping (1 - damping halves); at ``max_damping`` the last accepted estimate is returned,
    flagged ``unstable``. ``callback(iteration, record)`` is called after each accepted step."""
    import time

    from .amp import effective_observation, rie_denoise
    from .channels import entry_weights, to_vector
    from .data import index_matrices

    if not 0.0 <= damping < 1.0:
        raise AimsymError("damping", f"must lie in [0, 1), got {damping}")
    ch = TwoLayerChannel(data.skip, data.beta, n_inner)
    X, d = data.X, data.S1.shape[0]
    w = entry_weights(2)
    e = _reveal(data.y, data.beta)
    rho = (data.rho1, data.rho2)
    teachers = (data.S1, data.S2)
    Q0 = [prior_second_moment(r) for r in rho]
    S_hat = [np.sqrt(r) * np.eye(d) for r in rho]
    V = [Q0[l] - rho[l] for l in range(2)]  # = m(inf) = 1
    g_prev = [np.zeros((X.shape[0], 3)), np.zeros((X.shape[0], 3))]
    last = None  # (S_before, V_before, S_proposed, V_proposed, g) of the last accepted step
    history, rejected, unstable, it, it_last = [], 0, False, 0, None
    t0 = time.perf_counter()
    while it < iterations:
        it += 1
        omega = [to_vector(index_matrices(S_hat[l], X), 2) - w * V[l] * g_prev[l] for l in range(2)]
        g1, g2, dg1, dg2 = ch.denoise(e, omega[0], omega[1], V[0], V[1])
        g = [g1, g2]
        A = [-np.sum(dg * w) / d for dg in (dg1, dg2)]
        ok = all(np.isfinite(a) and a > 0 for a in A) and np.all(np.isfinite(g1)) and np.all(np.isfinite(g2))
        obs = []
        if ok:
            obs = [effective_observation(data, S_hat[l], g[l], A[l], 2, Q0[l]) for l in range(2)]
            ok = all(np.isfinite(p) and (p <= noise_ratio_max * D or it <= 3) for _, D, p in obs)
        if not ok:
            if last is None:
                raise AimsymError("damping", f"two-layer AMP unstable at its first iteration (alpha={data.alpha})")
            if damping >= max_damping:
                S_hat, V = last[0], last[1]
                unstable = True
                break
            damping = 1.0 - 0.5 * (1.0 - damping)
            S_b, V_b, S_p, V_p, g_p = last
            S_hat = [(1.0 - damping) * S_p[l] + damping * S_b[l] for l in range(2)]
            V = [(1.0 - damping) * V_p[l] + damping * V_b[l] for l in range(2)]
            g_prev = g_p
            rejected += 1
            if history and history[-1]["iteration"] == it_last:
                history.pop()  # that step is being redone
            continue
        new = [rie_denoise(R, rho[l], D, with_variance=True) for l, (R, D, _) in enumerate(obs)]
        last = (S_hat, V, [s for s, _ in new], [v for _, v in new], g)
        it_last = it
        V_old = V
        S_hat = [(1.0 - damping) * new[l][0] + damping * S_hat[l] for l in range(2)]
        V = [(1.0 - damping) * new[l][1] + damping * V[l] for l in range(2)]
        g_prev = g
        rec = {"iteration": it, "damping": damping}
        for l in range(2):
            rec[f"mmse{l + 1}"] = float(np.sum((S_hat[l] - teachers[l]) ** 2) / d)
            rec[f"overlap{l + 1}"] = float(np.sum(S_hat[l] * teachers[l]) / d)
            rec[f"V{l + 1}"] = float(V[l])
            rec[f"Delta{l + 1}"] = float(obs[l][1])
            rec[f"noise_ratio{l + 1}"] = obs[l][2] / obs[l][1]
        history.append(rec)
        if callback is not None:
            callback(it, rec)
        if max(abs(V[l] - V_old[l]) / max(V[l], 1e-12) for l in range(2)) < tol:
            break
    elapsed = time.perf_counter() - t0
    err = [float(np.sum((S_hat[l] - teachers[l]) ** 2) / d) for l in range(2)]
    ov = [float(np.sum(S_hat[l] * teachers[l]) / d) for l in range(2)]
    return TwoLayerGAMPRun(
        mmse1=err[0], mmse2=err[1], overlap1=ov[0], overlap2=ov[1], V1=float(V[0]), V2=float(V[1]),
        iterations=len(history), rejected_steps=rejected, unstable=unstable, final_damping=damping,
        seconds_per_iteration=elapsed / max(1, len(history) + rejected), history=history,
        S_hat1=S_hat[0], S_hat2=S_hat[1],
    )


@dataclass
class TwoLayerAMPPoint(Result):
    """Two-layer GAMP at one alpha over seeds (mean and standard error of the final per-layer errors
    and overlaps) and the two-layer SE at the same alpha: its per-layer mmse and overlap q, as the
    mean over ``se_seeds`` QMC seeds with the spread of those values as the SE's own error."""

    alpha: float
    rho1: float
    rho2: float
    skip: float
    beta: float
    d: int
    mmse1: float
    mmse1_sem: float | None
    mmse2: float
    mmse2_sem: float | None
    overlap1: float
    overlap1_sem: float | None
    overlap2: float
    overlap2_sem: float | None
    mmse1_runs: list
    mmse2_runs: list
    se: dict | None
    seconds_per_iteration: float
    iterations_runs: list
    unstable_runs: int
    provenance: dict


def _mean_sem(x):
    x = np.asarray(x, dtype=float)
    return float(x.mean()), (float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else None)


def se_summary(alpha, rho1=0.5, rho2=0.5, skip=1.0, beta=1.0, *, se_seeds=(0, 1, 2), n_inner=8, n_outer=2048,
               tol=1e-4):
    """The two-layer SE at ``alpha`` for several QMC seeds: mean and spread (standard error over
    seeds) of mmse_l and q_l, and the largest relative QMC error of the informations."""
    pts = [state_evolution(alpha, rho1, rho2, skip, beta, n_inner=n_inner, n_outer=n_outer, tol=tol, seed=s)
           for s in se_seeds]
    out = {"se_seeds": list(se_seeds), "n_inner": n_inner, "n_outer": n_outer, "tol": tol}
    for key in ("mmse1", "mmse2", "q1", "q2"):
        out[key], out[key + "_sem"] = _mean_sem([p[key] for p in pts])
    out["information_rel_sem"] = float(max(max(p.information_sem[0] / (p.q_hat1 / p.alpha),
                                               p.information_sem[1] / (p.q_hat2 / p.alpha)) for p in pts))
    out["cross_information"] = float(np.mean([p.cross_information for p in pts]))
    return out


def run_many(alpha, d, rho1=0.5, rho2=0.5, skip=1.0, beta=1.0, seeds=(0,), iterations=60, damping=0.5,
             n_inner=8, se=True, se_seeds=(0, 1, 2), progress=False) -> TwoLayerAMPPoint:
    """Two-layer GAMP over data seeds at one alpha, with the SE (``se_summary``) when ``se``.
    ``progress``: a progress bar on stderr (seeds x iterations)."""
    import sys

    from tqdm.auto import tqdm

    runs = []
    with tqdm(total=len(seeds) * iterations, desc=f"two-layer AMP alpha={alpha:g} d={d}", unit="it",
              disable=not progress, file=sys.stderr) as bar:
        for seed in seeds:
            data = generate(d, alpha, rho1, rho2, skip, beta, seed=seed)
            start = bar.n

            def tick(it, rec, seed=seed):
                bar.update()
                bar.set_postfix(seed=seed, mmse1=f"{rec['mmse1']:.4f}", mmse2=f"{rec['mmse2']:.4f}")

            runs.append(gamp(data, iterations=iterations, damping=damping, n_inner=n_inner, callback=tick))
            bar.update(start + iterations - bar.n)
    stats = {}
    for key in ("mmse1", "mmse2", "overlap1", "overlap2"):
        stats[key], stats[key + "_sem"] = _mean_sem([r[key] for r in runs])
    se_res = se_summary(alpha, rho1, rho2, skip, beta, se_seeds=se_seeds, n_inner=n_inner) if se else None
    return TwoLayerAMPPoint(
        alpha=float(alpha), rho1=float(data.rho1), rho2=float(data.rho2), skip=float(skip),
        beta=float(beta), d=int(d), **stats, mmse1_runs=[r.mmse1 for r in runs], mmse2_runs=[r.mmse2 for r in runs],
        se=se_res, seconds_per_iteration=float(np.mean([r.seconds_per_iteration for r in runs])),
        iterations_runs=[r.iterations for r in runs], unstable_runs=int(sum(r.unstable for r in runs)),
        provenance=provenance(seed=list(seeds), accuracy={"iterations": iterations, "damping": damping,
                                                          "n_inner": n_inner}),
    )
