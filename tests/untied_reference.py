"""Independent reference for the untied two-layer T = 2 denoiser (plain numpy/scipy, no generated
code, no aimsym): the posterior of Z = (z1Q, z1K, z2Q, z2K) given y = softmax(beta q k^T),
q = A1 z2Q, k = A1 z2K, A1 = softmax(beta1 z1Q z1K^T) + c I, written from the mixing matrix.

Two forms of the same posterior:

* ``full_weight``: over (u, z2K) (u = (z1Q, z1K), 6-D), z2Q solved from qhat = q delta
  (delta = k_2 - k_1): prod_t N(z_t; omega_t, V) / (|det A1| delta^2). No Gaussian algebra:
  the key is integrated as it is.
* ``reduced``: over (u, delta) (5-D), z2K marginalised by hand: the prior of (u, z2Q) times
  N(delta; L mu, sigma^2 L L^T), L = (e_2 - e_1)^T A1, mu the conditional mean of z2K;
  the moments of z2K from its conditional mean and covariance given delta.

The observation is qhat = (q_1 delta, q_2 delta), taken from the true indices.
"""

import numpy as np
from scipy import integrate

from reference import softmax_rows

ROW_K = 3  # z2K
ROWS_O = [0, 1, 2]  # everything else


def mixing(U, c, beta1=1.0):
    """A1(u) for a batch U (n, 4) = (z1Q_1, z1Q_2, z1K_1, z1K_2)."""
    zq, zk = U[:, :2], U[:, 2:]
    return softmax_rows(beta1 * zq[:, :, None] * zk[:, None, :]) + c * np.eye(2)[None]


def qhat_of(Z, c, beta1=1.0):
    A = mixing(Z[:2].reshape(1, 4), c, beta1)[0]
    q, k = A @ Z[2], A @ Z[3]
    return q * (k[1] - k[0])


def _log_gauss_cols(Zc, omega, V):
    """sum_t log N(z_t; omega_t, V) for a batch Zc (n, p, T)."""
    p, T = omega.shape
    Vinv = np.linalg.inv(V)
    d = Zc - omega
    q = np.einsum("nkt,kj,njt->n", d, Vinv, d)
    return -0.5 * q - 0.5 * T * (np.linalg.slogdet(V)[1] + p * np.log(2 * np.pi))


def full_weight(U, z2K, qhat, omega, V, c):
    """Log weight and Z (n, 4, 2) of the posterior over (u, z2K), z2Q solved."""
    A = mixing(U, c)
    k = np.einsum("nab,nb->na", A, z2K)
    delta = k[:, 1] - k[:, 0]
    z2Q = np.linalg.solve(A, qhat[None, :, None] / delta[:, None, None])[:, :, 0]
    Z = np.stack([U[:, :2], U[:, 2:], z2Q, z2K], axis=1)
    lw = _log_gauss_cols(Z, omega, V) - np.log(np.abs(np.linalg.det(A))) - 2 * np.log(np.abs(delta))
    return lw, Z


def reduced(U, delta, qhat, omega, V, c):
    """Log weight, E[Z | u, delta] (n, 4, 2) and the residual covariance of z2K (n, 2, 2)."""
    A = mixing(U, c)
    z2Q = np.linalg.solve(A, qhat[None, :, None] / delta[:, None, None])[:, :, 0]
    Zo = np.stack([U[:, :2], U[:, 2:], z2Q], axis=1)  # (n, 3, 2)
    lw = _log_gauss_cols(Zo, omega[ROWS_O], V[np.ix_(ROWS_O, ROWS_O)])
    # z2K | others, per token: N(mu_t, sigma^2)
    P = np.linalg.inv(V)
    s2 = 1.0 / P[ROW_K, ROW_K]
    mu = omega[ROW_K][None] - s2 * np.einsum("j,njt->nt", P[ROW_K, ROWS_O], Zo - omega[ROWS_O][None])
    Lf = A[:, 1, :] - A[:, 0, :]  # (n, 2): delta = Lf . z2K
    LL = np.sum(Lf * Lf, axis=1)
    m = np.sum(Lf * mu, axis=1)
    lw = lw - 0.5 * (delta - m) ** 2 / (s2 * LL) - 0.5 * np.log(2 * np.pi * s2 * LL)
    lw = lw - np.log(np.abs(np.linalg.det(A))) - 2 * np.log(np.abs(delta))
    mv = mu + Lf * ((delta - m) / LL)[:, None]
    C = s2 * (np.eye(2)[None] - Lf[:, :, None] * Lf[:, None, :] / LL[:, None, None])
    Z = np.concatenate([Zo, mv[:, None, :]], axis=1)
    return lw, Z, C


def moments_from(lw, Z, w_rule, C=None, shift=None):
    """(log S0, E[vec Z], E[vec Z vec Z^T]) of nodes with log weights lw + log w_rule."""
    n = lw.shape[0]
    Zf = Z.reshape(n, -1)
    lt = lw + np.log(w_rule)
    sh = np.max(lt) if shift is None else shift
    w = np.exp(lt - sh)
    S0 = w.sum()
    mean = (w[:, None] * Zf).sum(0) / S0
    second = np.einsum("n,na,nb->ab", w, Zf, Zf) / S0
    if C is not None:  # residual covariance of z2K (row 3: vec indices 6, 7)
        second[6:8, 6:8] += np.einsum("n,nab->ab", w, C) / S0
    return np.log(S0) + sh, mean, second


def reference(qhat, omega, V, c, *, rtol=1e-10, box=9.0, max_subdivisions=400000):
    """log Z_out, E[Z] (4, 2), E[vec Z vec Z^T] of the reduced posterior by adaptive Genz-Malik
    cubature (scipy) over (u, t), delta = +-exp(t), on a box: u in omega_u +- box prior sd,
    t over the range where |delta| is plausible under the prior. log Z_out is the log of
    int prod_t N(z_t; omega_t, V) J du ddelta with J as in ``reduced``."""
    sd = np.sqrt(np.diag(V))
    lo_u = np.concatenate([omega[0] - box * sd[0], omega[1] - box * sd[1]])
    hi_u = np.concatenate([omega[0] + box * sd[0], omega[1] + box * sd[1]])
    # delta = L z2K; |L| <= sqrt(2) (1 + c) row-wise; |q| <= (1 + c) |z2Q|
    kmax = np.sqrt(2) * (1 + c) * (np.abs(omega[3]).max() + box * sd[3]) * 2
    qmax = (1 + c) * (np.abs(omega[2]).max() + box * sd[2]) * 2
    t_hi = np.log(kmax)
    t_lo = np.log(np.max(np.abs(qhat)) / qmax)
    lo = np.concatenate([lo_u, [t_lo]])
    hi = np.concatenate([hi_u, [t_hi]])
    shift = [None]
    pt = 8

    def f(X):
        X = np.atleast_2d(X)
        U, t = X[:, :4], X[:, 4]
        res = 0.0
        outs = []
        for sg in (1.0, -1.0):
            delta = sg * np.exp(t)
            lw, Z, C = reduced(U, delta, qhat, omega, V, c)
            outs.append((lw + t, Z, C))  # d delta = |delta| dt
        if shift[0] is None:
            shift[0] = max(np.max(o[0]) for o in outs)
        for lw, Z, C in outs:
            w = np.exp(lw - shift[0])
            w = np.where(np.isfinite(w), w, 0.0)
            n = w.shape[0]
            Zf = Z.reshape(n, -1)
            sec = Zf[:, :, None] * Zf[:, None, :]
            sec[:, 6:8, 6:8] += C
            res = res + np.concatenate([w[:, None], w[:, None] * Zf, (w[:, None, None] * sec).reshape(n, -1)], axis=1)
        return res

    # the shift from the best of a coarse scan (values stay O(1) near the modes)
    rng = np.random.default_rng(0)
    Xs = lo + (hi - lo) * rng.random((20000, 5))
    best = -np.inf
    for sg in (1.0, -1.0):
        lw = reduced(Xs[:, :4], sg * np.exp(Xs[:, 4]), qhat, omega, V, c)[0] + Xs[:, 4]
        best = max(best, np.nanmax(lw))
    shift[0] = best
    r = integrate.cubature(f, lo, hi, rule="genz-malik", rtol=rtol, atol=0.0, max_subdivisions=max_subdivisions)
    est = r.estimate
    S0 = est[0]
    mean = est[1:1 + pt] / S0
    second = est[1 + pt:].reshape(pt, pt) / S0
    return np.log(S0) + shift[0], mean.reshape(4, 2), second, r


def reference_gh(qhat, omega, V, c, *, n_u=16, n_t=160, t_range=None, chunk=200_000, centre=None):
    """Same posterior by a nested product rule: tensor Gauss-Hermite (n_u per axis) on the prior
    of u (the posterior of u is the prior times a likelihood factor that is smooth on the prior's
    scale) times Gauss-Legendre (n_t nodes) in t = log|delta| on both signs. Returns
    (log Z_out, E[Z] (4, 2), E[vec Z vec Z^T]); compare two sizes for its own accuracy."""
    x, w = np.polynomial.hermite_e.hermegauss(n_u)
    w = w / np.sqrt(2 * np.pi)
    grids = np.meshgrid(*([x] * 4), indexing="ij")
    X = np.stack([g.ravel() for g in grids], 1)
    W = np.prod(np.stack(np.meshgrid(*([w] * 4), indexing="ij"), 0).reshape(4, -1), axis=0)
    # prior of u = (z1Q_1, z1Q_2, z1K_1, z1K_2): per token (z1Q_t, z1K_t) ~ N(omega_{01,t}, V_01)
    C = np.zeros((4, 4))
    for t in range(2):
        idx = [t, 2 + t]
        C[np.ix_(idx, idx)] = V[:2, :2]
    m0 = np.concatenate([omega[0], omega[1]])
    if centre is not None:  # the rule's Gaussian (the weight divides it out)
        m0, C = centre
    Lc = np.linalg.cholesky(C)
    U = m0 + X @ Lc.T
    # log density of the rule's Gaussian at the nodes (divided out: the GH weights carry it)
    P = np.linalg.inv(C)
    dU = U - m0
    lp = -0.5 * np.einsum("na,ab,nb->n", dU, P, dU) - 0.5 * np.linalg.slogdet(2 * np.pi * C)[1]
    if t_range is None:
        sd = np.sqrt(np.diag(V))
        kmax = 2 * np.sqrt(2) * (1 + c) * (np.abs(omega[3]).max() + 9 * sd[3])
        qmax = 2 * (1 + c) * (np.abs(omega[2]).max() + 9 * sd[2])
        t_range = (np.log(np.max(np.abs(qhat)) / qmax), np.log(kmax))
    xt, wt = np.polynomial.legendre.leggauss(n_t)
    t = 0.5 * (t_range[0] + t_range[1]) + 0.5 * (t_range[1] - t_range[0]) * xt
    wt = wt * 0.5 * (t_range[1] - t_range[0])
    lws, Zs, Cs, ws = [], [], [], []
    for sg in (1.0, -1.0):
        for i0 in range(0, len(U), max(1, chunk // n_t)):
            Ub = U[i0:i0 + max(1, chunk // n_t)]
            nb = len(Ub)
            UU = np.repeat(Ub, n_t, 0)
            TT = np.tile(t, nb)
            lw, Z, Cr = reduced(UU, sg * np.exp(TT), qhat, omega, V, c)
            lws.append(lw + TT - np.repeat(lp[i0:i0 + nb], n_t))
            Zs.append(Z)
            Cs.append(Cr)
            ws.append(np.repeat(W[i0:i0 + nb], n_t) * np.tile(wt, nb))
    lw = np.concatenate(lws)
    ok = np.isfinite(lw)
    return moments_from(lw[ok], np.concatenate(Zs)[ok], np.concatenate(ws)[ok], np.concatenate(Cs)[ok])


def reduced_T(u_q, u_k, s, sg, qhat, ehat, omega, V, c):
    """Log weight of the reduced posterior at any T over (u, s), lambda = sg exp(s + s_ref), and
    E[Z | u, s] (4, T): theory section 3 written out with numpy (two untied layers)."""
    T = len(u_q)
    A = softmax_rows(np.outer(u_q, u_k)[None])[0] + c * np.eye(T)
    s_ref = 0.25 * np.log(np.sum(qhat ** 2) / T)
    lam = sg * np.exp(s + s_ref)
    z2Q = np.linalg.solve(A, qhat / lam)
    Zo = np.stack([u_q, u_k, z2Q])
    P = np.linalg.inv(V)
    s2 = 1.0 / P[ROW_K, ROW_K]
    mu = omega[ROW_K] - s2 * P[ROW_K, ROWS_O] @ (Zo - omega[ROWS_O])
    Dm = np.eye(T)[1:] - np.eye(T)[:1]
    F = Dm @ A
    d = lam * ehat
    FF = F @ F.T
    r = d - F @ mu
    lw = float(_log_gauss_cols(Zo[None], omega[ROWS_O], V[np.ix_(ROWS_O, ROWS_O)])[0])
    lw += -0.5 * r @ np.linalg.solve(s2 * FF, r) - 0.5 * np.linalg.slogdet(2 * np.pi * s2 * FF)[1]
    lw += -np.log(abs(np.linalg.det(A))) - np.log(abs(lam))  # |det A|^-1 |lambda|^-2, d lambda = |lambda| ds
    mv = mu + F.T @ np.linalg.solve(FF, r)
    return lw, np.vstack([Zo, mv])
