"""AIM data at finite d, and matrix GAMP with the RIE denoiser (GAMP-RIE).

Data: W in R^{d x r} Gaussian, S = W W^T / sqrt(r d); n = round(alpha d^2) sequences X^mu in
R^{d x T} (tokens as columns, N(0,1) entries); H^mu = (X^T S X - Tr S I) / sqrt(d); y = sigma(beta H).

The unique entries h_ab = <X_ab, S> (Frobenius) with X_ab = (x_a x_b^T + x_b x_a^T)/(2 sqrt d) for
a < b and X_aa = (x_a x_a^T - I)/sqrt d: a GLM on the symmetric matrix S. GAMP (isotropic
variances, theory.md section 6 specialised to a rotation-invariant prior):

    omega_k = <X_k, S_hat> - w_k V g_k^prev                   (Onsager; w = 2 diag, 1 off)
    g, dg   = channel.denoise(y, omega, V)
    A       = -(1/d) sum_mu sum_k w_k dg_k                      (precision, per d/2 entries)
    R       = S_hat + (1/A) sum_mu sum_k g_k X_k                (effective observation)
    Delta   = d / (2 A)                                         (its semicircle variance)
    S_hat   = RIE(R; rho, Delta) (eigenvalues mapped by f),  V = m(Delta)

The "exact" form (``run(..., onsager="exact")``) replaces the isotropic w_k V by per-sample
matrices: Sigma_mu = tau_r [<X_k, J[X_l]>]_{kl} (J the Jacobian of the RIE map, computed in its
eigenbasis), a joint output step per sample, and A = -(1/N) sum_mu Tr(G_mu dg_mu) with the exact
Gram G_mu = [<X_k, X_l>] and N = d(d+1)/2.

Tracked per iteration: the true error ||S_hat - S||_F^2 / d and the predicted V = m(Delta).
At finite d both forms sit above the SE mmse by b/d; the d -> infinity extrapolation equals the
SE (``aimsym.studies.aim_finite_size``; measured b: docs/aim.md section 4). Part of b is the Bayes error's own (d(d+1)/2 coordinates: with a
Gaussian prior GAMP equals the exact finite-d Bayes estimator, ``gaussian_posterior_mean``), part
is the non-semicircular law of GAMP's effective noise under rank-one sensing, which the RIE
(built for GOE noise) does not model (``prior_step_finite_size``). ``run(..., noise_law="compound")``
uses an RIE built for that law (the compound free-Poisson law of the measured jumps,
``compound``); it gains only a 1/d^2 term (the law deviates from the semicircle by O(1/d) and the
RIE is stationary in it), so it does not remove that part.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..blas import limit_blas_threads
from ..errors import AimsymError
from ..provenance import provenance
from ..results import Result
from .channels import entry_weights, make_channel, pairs, to_vector
from .compound import compound_noise, rie_map_compound
from .data import AIMData, check_size, generate, index_matrices, sensed_index, teacher  # noqa: F401 (re-exported)
from .spectral import prior_second_moment, rie_map, rie_mmse


def _adjoint(data, G_vec, tokens):
    if data.sensing == "rank1":
        return adjoint(data.X, G_vec, tokens)
    return np.einsum("nk,nkij->ij", G_vec, data.X, optimize=True)


def effective_observation(data, S_hat, g, A, tokens, Q0):
    """GAMP's input-side step for one matrix: R = S_hat + (1/A) sum_mu g_mu . X_mu, its noise
    variance Delta = d / (2 A), and the measured noise power Tr(R^2)/d - (Q0 + 1/d) (which should
    match Delta up to O(1/d); the safeguards compare the two). ``data`` supplies the sensing
    matrices (``X``, ``sensing``)."""
    d = S_hat.shape[0]
    R = S_hat + _adjoint(data, g, tokens) / A
    return R, d / (2.0 * A), float(np.sum(R * R) / d) - (Q0 + 1.0 / d)


def gaussian_denoise(R, rho, Delta, with_variance=False):
    """Exact posterior mean for the prior S = sqrt(rho) I + GOE observed as R = S + sqrt(Delta) GOE
    (linear shrinkage), with the variance 2 Delta div / d^2 = Delta (d + 1) / (d (1 + Delta))."""
    d = R.shape[0]
    mu = np.sqrt(rho) * np.eye(d)
    S_hat = mu + (R - mu) / (1.0 + Delta)
    return (S_hat, Delta * (d + 1) / (d * (1.0 + Delta))) if with_variance else S_hat


def gaussian_posterior_mean(data, beta=1.0):
    """Exact finite-d Bayes estimator for ``prior="gaussian"``, rank-one sensing, softmax T = 2: the
    labels reveal u = (h11 - h12, h22 - h12) exactly, i.e. 2n linear functionals <B, S> with
    B1 = X11 - X12, B2 = X22 - X12; the prior is isotropic in the Frobenius metric, so the posterior
    mean is the projection sqrt(rho) I + sum c B with Gram c = u - <B, sqrt(rho) I> (Gram from the
    token inner products across samples, 2n x 2n). Its expected error is exactly
    (d(d+1)/2 - 2n) * 2 / d^2 = 1 + 1/d - 4 alpha (for 2n <= d(d+1)/2)."""
    if data.prior != "gaussian" or data.sensing != "rank1" or data.X.shape[2] != 2:
        raise AimsymError("data", "needs prior='gaussian', rank-one sensing and tokens = 2")
    X = data.X
    n, d, _ = X.shape
    x1, x2 = X[:, :, 0], X[:, :, 1]
    K11, K22, K12, K21 = x1 @ x1.T, x2 @ x2.T, x1 @ x2.T, x2 @ x1.T  # K12[m, l] = x1^m . x2^l
    n1, n2, c12 = np.diag(K11), np.diag(K22), np.einsum("ni,ni->n", x1, x2)
    # <X_aa^m, X_bb^l> = ((x_a^m . x_b^l)^2 - |x_a^m|^2 - |x_b^l|^2 + d) / d
    D11 = (K11 ** 2 - n1[:, None] - n1[None, :] + d) / d
    D22 = (K22 ** 2 - n2[:, None] - n2[None, :] + d) / d
    D12 = (K12 ** 2 - n1[:, None] - n2[None, :] + d) / d
    # <X_aa^m, X_12^l> = ((x_a^m . x1^l)(x_a^m . x2^l) - x1^l . x2^l) / d
    A1 = (K11 * K12 - c12[None, :]) / d
    A2 = (K21 * K22 - c12[None, :]) / d
    O = (K11 * K22 + K12 * K21) / (2 * d)  # <X_12^m, X_12^l>
    G = np.block([[D11 - A1 - A1.T + O, D12 - A1 - A2.T + O], [(D12 - A1 - A2.T + O).T, D22 - A2 - A2.T + O]])
    h0, _ = make_channel("softmax", 2, beta).recover(data.y)  # unique entries (h11, h12, h22) up to a shift
    u = np.concatenate([h0[:, 0] - h0[:, 1], h0[:, 2] - h0[:, 1]])
    mu = np.sqrt(data.rho)
    uI = np.concatenate([n1 - d - c12, n2 - d - c12]) / np.sqrt(d)
    c = np.linalg.solve(G, u - mu * uI)
    return mu * np.eye(d) + adjoint(X, np.stack([c[:n], -(c[:n] + c[n:]), c[n:]], axis=1), 2)


def _weight_matrices(G_vec, tokens):
    """(..., L) entry weights -> (..., T, T) symmetric matrices with the off-diagonal entries halved
    (X_ab contains both x_a x_b^T and x_b x_a^T)."""
    G = np.zeros(G_vec.shape[:-1] + (tokens, tokens))
    for k, (a, b) in enumerate(pairs(tokens)):
        if a == b:
            G[..., a, a] = G_vec[..., k]
        else:
            G[..., a, b] = G[..., b, a] = 0.5 * G_vec[..., k]
    return G


def adjoint(X, G_vec, tokens):
    """sum_mu sum_k G_k X_k (d x d): (1/sqrt d) [sum_mu X G X^T - (sum diag G) I], with the
    off-diagonal weights halved (X_ab contains both x_a x_b^T and x_b x_a^T)."""
    d = X.shape[1]
    G = _weight_matrices(G_vec, tokens)
    XG = np.einsum("nia,nab->nib", X, G, optimize=True)
    M = np.einsum("nia,nja->ij", XG, X, optimize=True)
    diag_sum = sum(G_vec[..., k].sum() for k, (a, b) in enumerate(pairs(tokens)) if a == b)
    M = M - diag_sum * np.eye(d)
    return (M + M.T) / (2.0 * np.sqrt(d))


def rie_spectral(R, rho, Delta, noise=None):
    """Eigen-decomposition of R and the RIE map with its Jacobian data: returns
    (S_hat, U, fprime, DD) with DD_ij = (f_i - f_j)/(lam_i - lam_j) (i != j), DD_ii = f'(lam_i).
    The Jacobian J of the matrix map R -> U f(Lam) U^T acts in the eigenbasis as
    (U^T J[E] U)_ij = DD_ij (U^T E U)_ij; its divergence (orthonormal coordinates of symmetric
    matrices) is sum_i f'_i + sum_{i<j} DD_ij.
    ``noise``: None for semicircle noise of variance Delta (``spectral.rie_map``), or a
    ``compound.CompoundNoise`` (``compound.rie_map_compound``)."""
    lam, U = np.linalg.eigh(R)
    if noise is None:
        fmap = lambda x: rie_map(x, rho, Delta)  # noqa: E731
    else:
        fmap = lambda x: rie_map_compound(x, rho, noise)  # noqa: E731
    f = fmap(lam)
    eps = 1e-6 * (1.0 + np.abs(lam))
    fprime = (fmap(lam + eps) - fmap(lam - eps)) / (2 * eps)
    dl = lam[:, None] - lam[None, :]
    close = np.abs(dl) < 1e-10
    DD = np.where(close, 0.5 * (fprime[:, None] + fprime[None, :]), (f[:, None] - f[None, :]) / np.where(close, 1.0, dl))
    np.fill_diagonal(DD, fprime)
    return (U * f) @ U.T, U, fprime, DD


def rie_denoise(R, rho, Delta, with_variance=False, noise=None):
    """RIE of R = S + sqrt(Delta) GOE (or S + B with B ~ ``noise``, a ``compound.CompoundNoise`` of
    variance Delta). With ``with_variance`` also returns the variance implied by the exact
    divergence of the matrix map (eigenvalue and eigenvector terms):
    div = sum_i f'(lam_i) + sum_{i<j} (f_i - f_j)/(lam_i - lam_j),  V = 2 Delta div / d^2."""
    S_hat, U, fprime, DD = rie_spectral(R, rho, Delta, noise)
    if not with_variance:
        return S_hat
    d = len(fprime)
    div = fprime.sum() + DD[np.triu_indices(d, 1)].sum()
    return S_hat, 2.0 * Delta * div / d**2


def noise_jumps(g_vec, A, d, tokens):
    """Jumps t_j = d s_j of GAMP's effective noise (1/A) sum_mu g_mu . X_mu under rank-one sensing:
    per sample, X G X^T = sum_k gamma_k z_k z_k^T with gamma_k the eigenvalues of the weight matrix
    G (off-diagonal entries halved, as in ``adjoint``) and z_k ~ N(0, I_d); the term carries
    s = gamma / (A sqrt d). Shape (n T,)."""
    G = _weight_matrices(g_vec, tokens)
    return (np.linalg.eigvalsh(G) * (np.sqrt(d) / A)).ravel()


def _token_products(P, tokens):
    """q_ab = p_a * p_b (elementwise) for the unique pairs: (n, L, d) from P (n, T, d)."""
    return np.stack([P[:, a] * P[:, b] for a, b in pairs(tokens)], axis=1)


def _pair_forms(Q, M, diag_vec, diag_sum, d, tokens):
    """<X_k, M X_l>-type contractions per sample for the sensing matrices
    X_ab = (x_a x_b^T + x_b x_a^T)/(2 sqrt d) - delta_ab I / sqrt d, written in a basis where
    x_a -> p_a: for a weight matrix M acting entrywise (sum_ij M_ij (Y_k)_ij (Y_l)_ij),

        F_{ab,ce} = [ (q_ac.M q_be + q_ae.M q_bc)/2 - delta_ce diag.q_ab - delta_ab diag.q_ce
                      + delta_ab delta_ce sum(diag) ] / d,

    with q_ab = p_a * p_b, diag = diag(M). M = all-ones gives the Gram <X_k, X_l>;
    M = DD gives <X_k, J[X_l]> for the spectral map."""
    pr = pairs(tokens)
    idx = {pq: k for k, pq in enumerate(pr)}
    key = lambda a, b: idx[(a, b) if a <= b else (b, a)]  # noqa: E731
    MQ = Q @ M  # (n, L, d)
    dq = Q @ diag_vec  # (n, L)
    n, L = Q.shape[0], len(pr)
    F = np.empty((n, L, L))
    for k, (a, b) in enumerate(pr):
        for l, (c, e) in enumerate(pr):
            if l < k:
                F[:, k, l] = F[:, l, k]
                continue
            v = 0.5 * (np.einsum("nd,nd->n", Q[:, key(a, c)], MQ[:, key(b, e)])
                       + np.einsum("nd,nd->n", Q[:, key(a, e)], MQ[:, key(b, c)]))
            if c == e:
                v = v - dq[:, k]
            if a == b:
                v = v - dq[:, l]
            if a == b and c == e:
                v = v + diag_sum
            F[:, k, l] = v
    return F / d


def sensing_gram(X, tokens):
    """G_mu = [<X_k, X_l>]_{kl} per sample (n, L, L), exact (from the token inner products)."""
    n, d, T = X.shape
    K = np.einsum("nia,nib->nab", X, X, optimize=True)
    pr = pairs(T)
    G = np.empty((n, len(pr), len(pr)))
    for k, (a, b) in enumerate(pr):
        for l, (c, e) in enumerate(pr):
            v = 0.5 * (K[:, a, c] * K[:, b, e] + K[:, a, e] * K[:, b, c])
            if c == e:
                v = v - K[:, a, b]
            if a == b:
                v = v - K[:, c, e]
            if a == b and c == e:
                v = v + d
            G[:, k, l] = v / d
    return G


def jacobian_forms(X, U, fprime, DD, tokens):
    """Per-sample reaction matrices O_mu = [<X_k, J[X_l]>]_{kl} (n, L, L) of the RIE map at the
    current R (J its Jacobian): with p_a = U^T x_a, an O(n d^2 T) computation."""
    P = np.einsum("nia,ij->naj", X, U, optimize=True)  # (n, T, d)
    Q = _token_products(P, tokens)
    return _pair_forms(Q, DD, fprime, float(fprime.sum()), X.shape[1], tokens)


def joint_linear_denoise(h0, null, omega, Sigma):
    """Output step of a channel that reveals h (unique entries) exactly up to the span of
    ``null`` (softmax: the global shift, null = ones; linear: nothing, null = None), with the
    Gaussian prior h ~ N(omega, Sigma_mu) per sample (full L x L covariance).
    Returns g = Sigma^-1 (E[h|y] - omega) and dg = d g / d omega (n, L, L)."""
    Pm = np.linalg.inv(Sigma)
    if null is None:
        g = np.einsum("nkl,nl->nk", Pm, h0 - omega)
        return g, -Pm
    u = np.asarray(null, dtype=float)
    Pu = Pm @ u  # (n, L)
    prec = Pu @ u  # (n,)
    c = np.einsum("nl,nl->n", Pu, omega - h0) / prec
    g = np.einsum("nkl,nl->nk", Pm, h0 + c[:, None] * u - omega)
    dg = np.einsum("nk,nl->nkl", Pu, Pu) / prec[:, None, None] - Pm
    return g, dg


def hardmax_joint_denoise(y, omega, Sigma):
    """Hardmax T = 2 with a full per-sample covariance of h = (h11, h12, h22): the signs of
    u = B h, B = [[1, -1, 0], [0, -1, 1]], with u ~ N(B omega, C), C = B Sigma B^T:
    Z = Phi_2(s1 m1 / sigma1, s2 m2 / sigma2; s1 s2 C12 / (sigma1 sigma2)); g = B^T grad_m log Z,
    dg = B^T Hess_m log Z B (the isotropic case Sigma = diag(2V, V, 2V) is the closed form of
    channels.HardmaxChannel)."""
    from .channels import bvn_log_derivatives

    B = np.array([[1.0, -1.0, 0.0], [0.0, -1.0, 1.0]])
    m = omega @ B.T
    C = np.einsum("ik,nkl,jl->nij", B, Sigma, B)
    s1, s2 = y[:, 0], y[:, 1]
    sig1, sig2 = np.sqrt(C[:, 0, 0]), np.sqrt(C[:, 1, 1])
    r = s1 * s2 * C[:, 0, 1] / (sig1 * sig2)
    a, b = s1 * m[:, 0] / sig1, s2 * m[:, 1] / sig2
    # channels.bvn_log_derivatives takes one correlation per call: loop over the samples
    out = np.array([bvn_log_derivatives(a[i:i + 1], b[i:i + 1], r[i]) for i in range(len(a))])[..., 0]
    _, Ra, Rb, Haa, Hab, Hbb = out.T
    c1, c2 = s1 / sig1, s2 / sig2
    gm = np.stack([c1 * Ra, c2 * Rb], axis=1)
    Hm = np.empty((len(m), 2, 2))
    Hm[:, 0, 0] = c1 * c1 * Haa
    Hm[:, 1, 1] = c2 * c2 * Hbb
    Hm[:, 0, 1] = Hm[:, 1, 0] = c1 * c2 * Hab
    return gm @ B, np.einsum("ki,nkl,lj->nij", B, Hm, B)


def _joint_output(ch, y, h0, null, omega, Sigma):
    if ch.activation == "hardmax":
        if ch.tokens != 2:
            raise AimsymError("onsager", "the exact (per-sample covariance) form has a hardmax output step for "
                                         "tokens = 2 only; use onsager='isotropic' for tokens = 3")
        return hardmax_joint_denoise(y, omega, Sigma)
    return joint_linear_denoise(h0, null, omega, Sigma)


@limit_blas_threads(param="blas_threads")
def run(data: AIMData, tokens=2, activation="softmax", beta=1.0, *, iterations=80, damping=None,
        tol=1e-7, rho=None, onsager=None, variance="divergence", max_damping=0.95,
        noise_ratio_max=2.5, blas_threads=1, noise_law="semicircle"):
    """GAMP-RIE on ``data``: a :class:`GAMPRun` with the per-iteration history and final errors.

    ``onsager`` (None = "isotropic"): both forms reach the same fixed point (docs/aim.md section 4);
    the isotropic one is cheaper per iteration (docs/tuning.md). For hardmax the exact form's output step loops
    over samples (channels.bvn_log_derivatives takes one correlation per call).
    ``onsager="exact"``: per-sample reaction and variance matrices
    Sigma_mu = tau_r [<X_k, J[X_l]>]_{kl} from the Jacobian J of the RIE map at the last R, and a
    joint output step per sample (the T(T+1)/2 entries of one sample share the tokens x_a);
    the first step uses the prior, Sigma_mu = tau_x G_mu with the exact Gram G_mu = [<X_k, X_l>].
    Default damping 0: it converges undamped where the isotropic form diverges; at small d it can
    limit-cycle, and some damping helps (docs/tuning.md).
    ``onsager="isotropic"``: the textbook form Sigma = diag(w V) for every sample; needs damping
    (default 0.5) and the safeguard below with the model's rank-one sensing matrices.

    Both: A = 1/tau_r = -(1/N) sum_mu Tr(G_mu dg_mu) (N = d(d+1)/2 coordinates),
    R = S_hat + tau_r sum_mu g_mu . X_mu, Delta = d tau_r / 2, S_hat = RIE(R; rho, Delta).
    Damping mixes S_hat and the variances with their previous values. Safeguard: the noise power
    of R, measured as Tr(R^2)/d - E Tr(S^2)/d with E Tr(S^2)/d = 1 + rho + 1/d, should match
    Delta up to O(1/d); when it exceeds ``noise_ratio_max`` Delta after iteration 3 the step is
    rejected, the last accepted state restored and the damping raised (1 - damping halves).
    ``variance``: "divergence" (exact divergence of the RIE map) or "theory" (V = m(Delta));
    isotropic mode only (the exact mode uses the Jacobian itself).
    ``noise_law``: the law of the effective noise R - S the RIE assumes. "semicircle" (GOE noise of
    variance Delta, what the SE assumes); "compound": the centred free compound Poisson law of the
    rank-one terms (1/A) sum g.X actually present at finite d (``compound``), with the measured
    jumps (``noise_jumps``) rescaled to variance Delta; rank-one sensing only. Both laws tend to the
    same semicircle as d -> infinity; at finite d "compound" lowers the error by a 1/d^2 term only
    and can be unstable (docs/tuning.md, docs/aim.md section 4): an opt-in diagnostic.
    ``blas_threads``: OpenBLAS threads during the run (None leaves the setting alone); one thread,
    because small products on shared cores only contend (docs/tuning.md).
    """
    if onsager not in ("exact", "isotropic", None):
        raise AimsymError("onsager", f"must be 'exact' or 'isotropic', got {onsager!r}")
    if onsager is None:
        onsager = "isotropic"
    if noise_law not in ("semicircle", "compound"):
        raise AimsymError("noise_law", f"must be 'semicircle' or 'compound', got {noise_law!r}")
    if noise_law == "compound" and (data.sensing != "rank1" or data.prior != "mp"):
        raise AimsymError("noise_law", "'compound' models rank-one sensing of the MP prior (prior='mp', sensing='rank1')")
    if damping is None:
        damping = 0.0 if onsager == "exact" else 0.5
    if not 0.0 <= damping < 1.0:
        raise AimsymError("damping", f"must lie in [0, 1), got {damping}")
    ch = make_channel(activation, tokens, beta)
    T = ch.tokens
    if onsager == "exact" and (data.prior != "mp" or data.sensing != "rank1"):
        raise AimsymError("onsager", "the exact form needs the model's data (prior='mp', sensing='rank1')")
    rho = data.rho if rho is None else float(rho)
    X, y, S = data.X, data.y, data.S
    d = S.shape[0]
    N = d * (d + 1) / 2.0
    w = entry_weights(T)
    Q0 = prior_second_moment(rho)
    exact = onsager == "exact"
    S_hat = np.sqrt(rho) * np.eye(d)
    V = Q0 - rho  # = m(inf) = 1
    n = X.shape[0]
    if exact:
        G = sensing_gram(X, T)
        h0 = null = None
        if ch.activation != "hardmax":
            h0, null = ch.recover(y)
        Sigma = (d * V / N) * G  # prior: per-coordinate variance d V / N
        g_prev = np.zeros((n, len(w)))
    else:
        g_prev = np.zeros((n, len(w)))
    last_iteration = None
    unstable = False
    last = None  # (S_before, var_before, g_before, S_proposed, var_proposed, g) of the last accepted step
    history, rejected = [], 0
    t0 = time.perf_counter()
    it = 0
    while it < iterations:
        it += 1
        if exact:
            omega = to_vector(index_matrices(S_hat, X), T) - np.einsum("nkl,nl->nk", Sigma, g_prev)
            g, dg = _joint_output(ch, y, h0, null, omega, Sigma)
            A = -np.einsum("nkl,nkl->", G, dg) / N if np.all(np.isfinite(dg)) else np.nan
        else:
            omega = to_vector(sensed_index(data, S_hat, T), T) - w * V * g_prev
            g, dg = ch.denoise(y, omega, V)
            A = -np.sum(dg * w) / d if np.all(np.isfinite(dg)) else np.nan
        ok = np.isfinite(A) and A > 0 and np.all(np.isfinite(g))
        if ok:
            R, Delta, power = effective_observation(data, S_hat, g, A, T, Q0)
            # the first steps from the prior mean overshoot transiently (ratio up to ~2)
            ok = np.isfinite(power) and (power <= noise_ratio_max * Delta or it <= 3)
        if not ok:
            # the last step let an unstable mode grow: redo it with more damping
            if last is None:
                raise AimsymError("damping", f"AMP unstable at its first iteration (alpha={data.alpha})")
            if damping >= max_damping:
                # give up: return the last accepted estimate, flagged as not converged
                S_hat, g_prev = last[0], last[2]
                V, Sigma = last[1] if exact else (last[1], None)
                unstable = True
                break
            damping = 1.0 - 0.5 * (1.0 - damping)
            S_b, var_b, g_b, S_p, var_p, g_p = last
            S_hat = (1.0 - damping) * S_p + damping * S_b
            if exact:
                V = (1.0 - damping) * var_p[0] + damping * var_b[0]
                Sigma = (1.0 - damping) * var_p[1] + damping * var_b[1]
            else:
                V = (1.0 - damping) * var_p + damping * var_b
            g_prev = g_p
            rejected += 1
            if history and history[-1]["iteration"] == last_iteration:
                history.pop()  # that step is being redone
            continue
        tau_r = 1.0 / A
        noise = None
        if noise_law == "compound":
            noise = compound_noise(noise_jumps(g, A, d, T), d, variance=Delta)
        if exact:
            S_new, U, fprime, DD = rie_spectral(R, rho, Delta, noise)
            div = fprime.sum() + DD[np.triu_indices(d, 1)].sum()
            V_new = tau_r * div / d  # predicted ||S_hat - S||^2 / d
            Sigma_new = tau_r * jacobian_forms(X, U, fprime, DD, T)
            last = (S_hat, (V, Sigma), g_prev, S_new, (V_new, Sigma_new), g)
            Sigma = (1.0 - damping) * Sigma_new + damping * Sigma
        else:
            if data.prior == "gaussian":
                S_new, V_new = gaussian_denoise(R, rho, Delta, with_variance=True)
            elif variance == "divergence":
                S_new, V_new = rie_denoise(R, rho, Delta, with_variance=True, noise=noise)
            else:
                S_new, V_new = rie_denoise(R, rho, Delta, noise=noise), rie_mmse(Delta, rho)
            last = (S_hat, V, g_prev, S_new, V_new, g)
        last_iteration = it
        V_old = V
        S_hat = (1.0 - damping) * S_new + damping * S_hat
        V = (1.0 - damping) * V_new + damping * V
        g_prev = g
        err = float(np.sum((S_hat - S) ** 2) / d)
        history.append({"iteration": it, "mmse": err, "V": V, "Delta": Delta,
                        "noise_ratio": power / Delta, "damping": damping})
        if V < 1e-10 or abs(V - V_old) < tol * max(V, 1e-12):
            break
    elapsed = time.perf_counter() - t0
    return GAMPRun(
        mmse=float(np.sum((S_hat - S) ** 2) / d),
        V=float(V),
        iterations=len(history),
        rejected_steps=rejected,
        unstable=unstable,
        final_damping=damping,
        onsager=onsager,
        noise_law=noise_law,
        seconds_per_iteration=elapsed / max(1, len(history) + rejected),
        history=history,
        S_hat=S_hat,
    )


@dataclass
class GAMPRun(Result):
    """One GAMP-RIE run: final error ||S_hat - S||^2 / d and predicted V, the iteration count
    (accepted and rejected steps), flags, the per-iteration ``history`` and the estimate S_hat."""

    mmse: float
    V: float
    iterations: int
    rejected_steps: int
    unstable: bool
    final_damping: float
    onsager: str
    noise_law: str
    seconds_per_iteration: float
    history: list
    S_hat: np.ndarray


@dataclass
class AMPPoint(Result):
    """GAMP-RIE at one alpha over seeds: mean and standard error of the final mmse, the SE value."""

    alpha: float
    rho: float
    d: int
    tokens: int
    activation: str
    beta: float
    mmse: float
    mmse_sem: float | None
    mmse_runs: list
    mmse_se: float
    seconds_per_iteration: float
    iterations_runs: list
    unstable_runs: int
    provenance: dict


def run_many(alpha, rho, d, tokens=2, activation="softmax", beta=1.0, seeds=(0,), iterations=80,
             damping=None, onsager=None):
    """AMP over several seeds; mean and standard error of the final mmse, with the SE value.
    ``damping=None``: 0 for the exact Onsager form, 0.5 for the isotropic one (see ``run``)."""
    from . import se

    errs, secs, its, flags, rho_eff = [], [], [], [], rho
    for seed in seeds:
        data = generate(d, alpha, rho, tokens, activation, beta, seed=seed)
        rho_eff = data.rho
        out = run(data, tokens, activation, beta, iterations=iterations, damping=damping, onsager=onsager)
        errs.append(out.mmse)
        secs.append(out.seconds_per_iteration)
        its.append(out.iterations)
        flags.append(bool(out.unstable))
    errs = np.array(errs)
    sem = float(errs.std(ddof=1) / np.sqrt(len(errs))) if len(errs) > 1 else None
    se_res = se.solve(alpha, rho_eff, tokens, activation, beta)
    return AMPPoint(
        alpha=float(alpha), rho=float(rho_eff), d=int(d), tokens=int(tokens), activation=activation,
        beta=float(beta), mmse=float(errs.mean()), mmse_sem=sem, mmse_runs=errs.tolist(), mmse_se=se_res.mmse,
        seconds_per_iteration=float(np.mean(secs)), iterations_runs=its, unstable_runs=int(sum(flags)),
        provenance=provenance(seed=list(seeds), accuracy={"iterations": iterations, "damping": damping,
                                                          "onsager": onsager}),
    )


def to_matrix_from_vector(y, tokens):
    """Linear-channel labels (unique entries) -> symmetric T x T matrices."""
    from .channels import to_matrix

    return to_matrix(np.asarray(y), tokens)
