"""Independent reference for the reduced integrals of k = 3 and 4 (plain numpy/scipy, no
generated code): the reduced posterior written from the mixing matrices of theory section 2,
integrated by ``scipy.integrate.cubature`` (tensor Gauss-Kronrod 21, adaptive) over a box of
the prior of u (no mode search, no partition of unity, no map of R^k)."""

import numpy as np
from scipy import integrate

from reference import softmax_rows


def _softmax_gram(v, beta=1.0):
    """Row softmax of beta v v^T for a batch of vectors v (n, T)."""
    return softmax_rows(beta * v[:, :, None] * v[:, None, :])


def mixing(model_name, U, c, T):
    """M_{L-1}(u) for a batch of free entries U (n, k), and the layout of u in Z (rows)."""
    n = U.shape[0]
    eye = np.eye(T)[None]
    if model_name == "attention_L2_T3":
        return c * eye + _softmax_gram(U)
    if model_name == "attention_L3_T2":
        z1, z2 = U[:, :T], U[:, T:]
        M1 = c * eye + _softmax_gram(z1)
        q2 = np.einsum("nab,nb->na", M1, z2)
        return np.einsum("nab,nbc->nac", c * eye + _softmax_gram(q2), M1)
    if model_name == "attention_L2_T2_heads2":
        return c * eye + 0.5 * (_softmax_gram(U[:, :T]) + _softmax_gram(U[:, T:]))
    raise ValueError(model_name)


def h_of(model_name, Ztrue, c):
    """The observed h = M_{L-1}(u) z_L of the true indices."""
    p, T = Ztrue.shape
    u = Ztrue[:-1].reshape(1, -1)
    return mixing(model_name, u, c, T)[0] @ Ztrue[-1]


def reference(model_name, h, omega, V, c, *, rtol=1e-11, box=11.0, rule="gk21"):
    """log Z_out, E[Z] (p, T) and E[vec Z vec Z^T] (row-major) of the reduced posterior
    sum over the signs of z_L = +-M^{-1} h, weight prod_t N(z_t; omega_t, V) / |det M|.
    The box is omega_u +- box prior sd per entry."""
    p, T = omega.shape
    k = (p - 1) * T
    Vinv = np.linalg.inv(V)
    logdet = np.linalg.slogdet(V)[1]
    sd = np.sqrt(np.diag(V))[:-1]
    lo = np.concatenate([omega[r] - box * sd[r] for r in range(p - 1)])
    hi = np.concatenate([omega[r] + box * sd[r] for r in range(p - 1)])
    # the integrand's scale: log weight at the true-ish centre, so that values stay O(1)
    shift = [None]

    def f(U):
        U = np.atleast_2d(U)
        n = U.shape[0]
        M = mixing(model_name, U, c, T)
        zl = np.linalg.solve(M, np.broadcast_to(h, (n, T))[:, :, None])[:, :, 0]
        det = np.abs(np.linalg.det(M))
        out = []
        for s in (1.0, -1.0):
            Z = np.concatenate([U.reshape(n, p - 1, T), s * zl[:, None, :]], axis=1)
            d = Z - omega
            q = np.einsum("nkt,kj,njt->n", d, Vinv, d)
            lw = -0.5 * q - np.log(det)
            out.append((lw, Z.reshape(n, -1)))
        if shift[0] is None:
            shift[0] = max(np.max(out[0][0]), np.max(out[1][0]))
        res = 0.0
        for lw, Zf in out:
            w = np.exp(lw - shift[0])
            res = res + np.concatenate([w[:, None], w[:, None] * Zf,
                                        (w[:, None, None] * Zf[:, :, None] * Zf[:, None, :]).reshape(n, -1)], axis=1)
        return res

    f(0.5 * (lo + hi)[None])  # fix the shift
    r = integrate.cubature(f, lo, hi, rule=rule, rtol=rtol, atol=0.0, max_subdivisions=200000)
    est = r.estimate
    pt = p * T
    S0 = est[0]
    mean = est[1:1 + pt] / S0
    second = est[1 + pt:].reshape(pt, pt) / S0
    log_z = np.log(S0) + shift[0] - 0.5 * T * (logdet + p * np.log(2 * np.pi))
    return log_z, mean.reshape(p, T), second, r.status


def outputs(V, omega, mean, second):
    """g_out, dg_out from posterior moments (theory section 3)."""
    p, T = omega.shape
    Vinv = np.linalg.inv(V)
    g = Vinv @ (mean - omega)
    cov = second - np.outer(mean.reshape(-1), mean.reshape(-1))
    C = cov.reshape(p, T, p, T)
    dg = np.einsum("ka,atbs,bl->ktls", Vinv, C, Vinv) - np.einsum("ts,kl->ktls", np.eye(T), Vinv)
    return g, dg


# ----------------------------------------------------------------------------- two T = 2 blocks
# A second independent reference for the k = 4 models (three layers, two heads): scipy's tensor
# Gauss-Kronrod cubature cannot reach 1e-10 in 4-D in reasonable time (the switching layers cross
# its boxes). Here each block's free row is integrated in its own polar coordinates, q = r (cos t,
# sin t), with the angle split at the walls of the block's attention (q_1 = 0, q_2 = 0, q_1 = q_2)
# and tanh-sinh in the angle (double-exponential clustering at the walls, where the attention
# switches over ~1/(beta r^2)), composite Gauss-Legendre in r: a tensor product over the two blocks,
# evaluated in plain numpy. Its own error: the difference to a rule with about 1.5x the nodes.

WALLS_T2 = (0.0, np.pi / 4, np.pi / 2, np.pi)  # half plane: q and -q give the same attention


def tanh_sinh(n, t_max=3.2):
    """Tanh-sinh nodes and weights on [-1, 1], 2n + 1 points."""
    t = np.linspace(-t_max, t_max, 2 * n + 1)
    s = 0.5 * np.pi * np.sinh(t)
    x = np.tanh(s)
    w = (t[1] - t[0]) * 0.5 * np.pi * np.cosh(t) / np.cosh(s) ** 2
    return x, w


def half_plane_nodes(R, n_angle, n_radius, panels=4):
    """Nodes q (n, 2) and area weights on the half disk |q| <= R, 0 <= arg q < pi."""
    xa, wa = tanh_sinh(n_angle)
    xr, wr = np.polynomial.legendre.leggauss(n_radius)
    edges = R * np.linspace(0.0, 1.0, panels + 1) ** 1.5  # finer near the origin
    r = np.concatenate([0.5 * (b + a) + 0.5 * (b - a) * xr for a, b in zip(edges[:-1], edges[1:])])
    wr_ = np.concatenate([0.5 * (b - a) * wr for a, b in zip(edges[:-1], edges[1:])])
    th, wt = [], []
    for a, b in zip(WALLS_T2[:-1], WALLS_T2[1:]):
        th.append(0.5 * (a + b) + 0.5 * (b - a) * xa)
        wt.append(0.5 * (b - a) * wa)
    th, wt = np.concatenate(th), np.concatenate(wt)
    q = np.stack([np.multiply.outer(r, np.cos(th)), np.multiply.outer(r, np.sin(th))], axis=-1).reshape(-1, 2)
    w = np.multiply.outer(wr_ * r, wt).reshape(-1)
    return q, w


def _inv2(M):
    det = M[..., 0, 0] * M[..., 1, 1] - M[..., 0, 1] * M[..., 1, 0]
    inv = np.stack([np.stack([M[..., 1, 1], -M[..., 0, 1]], -1), np.stack([-M[..., 1, 0], M[..., 0, 0]], -1)], -2)
    return inv / det[..., None, None], det


def _block_rows(model_name, q1, q2, h, c):
    """Rows z1, z2, the solved z3 = M^{-1} h (for +h), each (A, B, 2), and the log Jacobian of the
    reduction in the blocks' coordinates (A, B), for outer nodes q1 (A, 2) x inner nodes q2 (B, 2)."""
    I = np.eye(2)
    S1, S2 = _softmax_gram(q1), _softmax_gram(q2)
    A, B = len(q1), len(q2)
    if model_name == "attention_L3_T2":
        M1i, det1 = _inv2(c * I + S1)
        Ni, det2 = _inv2(c * I + S2)
        z2 = np.einsum("aij,bj->abi", M1i, q2)
        z3 = np.einsum("aij,bj->abi", M1i, Ni @ h)  # M2 = (cI + S2) M1
        # dz2 = dq2 / |det M1|, and delta(h - M2 z3) gives 1 / |det M2|
        log_jac = -2 * np.log(np.abs(det1))[:, None] - np.log(np.abs(det2))[None]
    elif model_name == "attention_L2_T2_heads2":
        M = c * I + 0.5 * (S1[:, None] + S2[None])
        Mi, det = _inv2(M)
        z2 = np.broadcast_to(q2[None], (A, B, 2))
        z3 = Mi @ h
        log_jac = -np.log(np.abs(det))
    else:
        raise ValueError(model_name)
    return np.broadcast_to(q1[:, None], (A, B, 2)), z2, z3, log_jac


SIGNS = np.array([[a, b, s] for a in (1, -1) for b in (1, -1) for s in (1, -1)], float)


def polar_reference(model_name, h, omega, V, c, *, n_angle=24, n_radius=24, chunk=16):
    """log Z_out, E[Z] (3, 2), E[vec Z vec Z^T] of the reduced posterior of a k = 4 model with two
    T = 2 blocks (see above), by the product of the blocks' polar rules; each node stands for the
    eight sign images (+-z1, +-z2, +-z3), which share the attention: with the Gram entries
    G_kl = z_k . z_l the prior's quadratic form of a sign image s is
    sum_k Vinv_kk G_kk + 2 sum_{k<l} s_k s_l Vinv_kl G_kl - 2 sum_k s_k Vinv_k. (z_k . omega) + const."""
    p, T = omega.shape
    Vinv = np.linalg.inv(V)
    logdet = np.linalg.slogdet(V)[1]
    sd = np.sqrt(np.diag(V))
    R1 = np.linalg.norm(omega[0]) + 12 * sd[0]
    R2 = np.linalg.norm(omega[1]) + 12 * sd[1]
    if model_name == "attention_L3_T2":
        R2 *= c + np.sqrt(2.0)  # q2 = M1 z2, |M1| <= c + |S1| <= c + sqrt(2)
    qa, wa = half_plane_nodes(R1, n_angle, n_radius)
    qb, wb = half_plane_nodes(R2, n_angle, n_radius)
    pairs = [(0, 1), (0, 2), (1, 2)]
    const = np.einsum("kt,kl,lt->", omega, Vinv, omega)
    shift, S0, S1, S2 = -np.inf, 0.0, np.zeros((p, T)), np.zeros((p, T, p, T))
    for i in range(0, len(qa), chunk):
        z1, z2, z3, log_jac = _block_rows(model_name, qa[i:i + chunk], qb, h, c)
        z = [z1.reshape(-1, T), z2.reshape(-1, T), z3.reshape(-1, T)]
        base = (log_jac + np.log(wa[i:i + chunk, None] * wb[None])).reshape(-1)
        quad = sum(Vinv[k, k] * np.einsum("nt,nt->n", z[k], z[k]) for k in range(p)) + const
        cross = {(k, l): 2 * Vinv[k, l] * np.einsum("nt,nt->n", z[k], z[l]) for k, l in pairs}
        lin = [2 * z[k] @ (Vinv[k] @ omega) for k in range(p)]
        lws = [base - 0.5 * (quad + sum(s[k] * s[l] * cross[k, l] for k, l in pairs) - sum(s[k] * lin[k] for k in range(p)))
               for s in SIGNS]
        top = max(lw.max() for lw in lws)
        if top > shift:  # rescale the running sums to the new maximum
            f = np.exp(shift - top) if np.isfinite(shift) else 0.0
            S0, S1, S2, shift = S0 * f, S1 * f, S2 * f, top
        Ws = [np.exp(lw - shift) for lw in lws]
        A0 = sum(Ws)
        S0 += A0.sum()
        for k in range(p):
            Bk = sum(s[k] * W for s, W in zip(SIGNS, Ws))
            S1[k] += Bk @ z[k]
            S2[k, :, k, :] += z[k].T @ (A0[:, None] * z[k])
        for k, l in pairs:
            C = sum(s[k] * s[l] * W for s, W in zip(SIGNS, Ws))
            blk = z[k].T @ (C[:, None] * z[l])
            S2[k, :, l, :] += blk
            S2[l, :, k, :] += blk.T
    log_z = np.log(S0) + shift - 0.5 * T * (logdet + p * np.log(2 * np.pi))
    return log_z, S1 / S0, (S2 / S0).reshape(p * T, p * T)
