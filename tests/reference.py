"""Independent reference computations for tests (plain numpy/scipy, no generated code)."""

import numpy as np
from scipy import integrate


def softmax_rows(A):
    A = A - A.max(axis=-1, keepdims=True)
    E = np.exp(A)
    return E / E.sum(axis=-1, keepdims=True)


def l2t2_reference(Ztrue, omega, V, c, beta=1.0, epsabs=1e-13, epsrel=1e-11, moments=2):
    """Two-layer T = 2 tied softmax denoiser by scipy nquad over z1 in R^2 (theory section 3),
    with h taken from the true indices (independent of aimsym's inverse output map).

    Returns (log_z, mean (2, 2), second moment (4, 4) of vec(Z) row-major)."""
    z1, z2 = Ztrue[0], Ztrue[1]
    h = (c * np.eye(2) + softmax_rows(beta * np.outer(z1, z1))) @ z2
    Vinv = np.linalg.inv(V)
    logdet = np.linalg.slogdet(V)[1]

    def weight(u1, u2, s):
        M = c * np.eye(2) + softmax_rows(beta * np.outer([u1, u2], [u1, u2]))
        zl = np.linalg.solve(M, s * h)
        Z = np.array([[u1, u2], zl])
        d = Z - omega
        q = sum(d[:, t] @ Vinv @ d[:, t] for t in range(2))
        return np.exp(-0.5 * q - logdet - 2 * np.log(2 * np.pi)) / abs(np.linalg.det(M)), Z

    # integrate over a box holding all but ~1e-30 of the prior marginal of z1
    sd = np.sqrt(V[0, 0])
    lim = [[omega[0, t] - 12 * sd, omega[0, t] + 12 * sd] for t in range(2)]
    opts = {"epsabs": epsabs, "epsrel": epsrel, "limit": 200}
    out = {}
    for key, fn in {
        "Z0": lambda Z: 1.0,
        **{f"m{i}": (lambda Z, i=i: Z.reshape(-1)[i]) for i in range(4)},
        **({f"s{i}{j}": (lambda Z, i=i, j=j: Z.reshape(-1)[i] * Z.reshape(-1)[j])
            for i in range(4) for j in range(i, 4)} if moments >= 2 else {}),
    }.items():
        tot = 0.0
        for s in (1.0, -1.0):
            def f(u1, u2, s=s):
                w, Z = weight(u1, u2, s)
                return w * fn(Z)
            tot += integrate.nquad(f, lim, opts=[opts, opts])[0]
        out[key] = tot
    Z0 = out["Z0"]
    mean = np.array([out[f"m{i}"] for i in range(4)]) / Z0
    if moments < 2:
        return np.log(Z0), mean.reshape(2, 2), None
    S = np.empty((4, 4))
    for i in range(4):
        for j in range(i, 4):
            S[i, j] = S[j, i] = out[f"s{i}{j}"] / Z0
    return np.log(Z0), mean.reshape(2, 2), S
