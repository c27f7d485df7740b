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
