"""Batch denoiser driver, hand-written once and appended verbatim to every generated module
(below the marker) so that numba caches it together with the model's scalar kernels.

It relies on the generated names ``branch``, ``polar_rows``, ``POLAR_ROWS``, ``polar_beta``,
``HAS_POLAR``, ``last_beta``, ``P``, ``T``, ``INTEGRAL_DIM``, ``FREE_K``, ``FREE_T``, ``POLAR_ANGLES``,
``N_BRANCHES``, ``OBS_KIND`` and ``LAST_ACTIVATION``. This file is not imported by the
package; it only has to be valid Python so that linters and the generator can read it.
"""

import math  # noqa: F401  (names below are resolved in the generated module)

import numpy as np  # noqa: F401
from llvmlite import ir as llvm_ir  # noqa: F401
from numba import njit, prange, types  # noqa: F401
from numba.extending import intrinsic  # noqa: F401

# ---- template begins ----
# ============================================================================
# Batch denoiser driver (aimsym/denoise/driver_template.py, appended to every module)
# ============================================================================
#
# Posterior over Z given y and the Gaussian prior prod_t N(z_t; omega_t, V), reduced to the
# free entries u on each branch b: weight prod_t N(z_t; omega_t, V) * exp(branch(b, u, ...)).
# The integral over u is a tensor Gauss-Hermite (or any given) rule in the standard normal
# variable xi, mapped by u = m_b + L_b xi. The first pass uses the prior marginal of u; each
# further pass re-centres the rule on the branch posterior's mean and covariance (adaptive
# Gauss-Hermite). Sums are streamed with a running maximum (log-sum-exp), so no weight
# under- or overflows.

STATUS_OK = 0
STATUS_BAD_V = 1
STATUS_OFF_MANIFOLD = 2
STATUS_ZERO_LIKELIHOOD = 3
STATUS_NOT_FINITE = 4


@njit(cache=True)
def _cholesky(A, L):
    """Lower Cholesky factor of a small SPD matrix; returns False if A is not SPD."""
    n = A.shape[0]
    for i in range(n):
        for j in range(i + 1):
            s = A[i, j]
            for k in range(j):
                s -= L[i, k] * L[j, k]
            if i == j:
                if not (s > 0.0):
                    return False
                L[i, i] = math.sqrt(s)
            else:
                L[i, j] = s / L[j, j]
        for j in range(i + 1, n):
            L[i, j] = 0.0
    return True


@njit(cache=True)
def _chol_inverse(L, Ainv):
    """A^{-1} from the Cholesky factor L of A (A = L L^T)."""
    n = L.shape[0]
    Linv = np.zeros((n, n))
    for i in range(n):
        Linv[i, i] = 1.0 / L[i, i]
        for j in range(i):
            s = 0.0
            for k in range(j, i):
                s -= L[i, k] * Linv[k, j]
            Linv[i, j] = s / L[i, i]
    for i in range(n):
        for j in range(n):
            s = 0.0
            for k in range(max(i, j), n):
                s += Linv[k, i] * Linv[k, j]
            Ainv[i, j] = s


@njit(cache=True)
def _precision(V, Vinv):
    """V^{-1} into Vinv; returns log det V, or NaN if V is not symmetric positive definite."""
    p = V.shape[0]
    Lv = np.empty((p, p))
    if not _cholesky(V, Lv):
        return math.nan
    _chol_inverse(Lv, Vinv)
    logdet = 0.0
    for k in range(p):
        logdet += 2.0 * math.log(Lv[k, k])
    return logdet


@njit(cache=True)
def h_from_y(y, beta, h):
    """Inverse output map of the last attention layer: y = sigma(beta h h^T) -> h (up to sign).

    softmax: log y_ab = beta G_ab - c_a with G = h h^T. With l_ab = log y_ab - log y_aa,
    G = t + N where N_ab = (l_0a - l_a0)/beta + l_ab/beta (symmetrised) and t = h_0^2 solves
    the rank-one condition G_ab^2 = G_aa G_bb, linear in t:
    t = (N_ab^2 - N_aa N_bb) / D_ab with D_ab = (h_a - h_b)^2 = -(l_ab + l_ba)/beta
    (least squares over all pairs). linear: G = y / beta.
    Returns a STATUS code; h is filled with the root whose largest entry is positive.
    """
    n = y.shape[0]
    G = np.empty((n, n))
    if LAST_ACTIVATION == "linear":
        for a in range(n):
            for b in range(n):
                G[a, b] = 0.5 * (y[a, b] + y[b, a]) / beta
    else:
        ly = np.empty((n, n))
        for a in range(n):
            for b in range(n):
                if not (y[a, b] > 0.0):
                    return STATUS_OFF_MANIFOLD
                ly[a, b] = math.log(y[a, b])
        N = np.empty((n, n))
        for a in range(n):
            da = ((ly[0, a] - ly[0, 0]) - (ly[a, 0] - ly[a, a])) / beta
            for b in range(n):
                N[a, b] = da + (ly[a, b] - ly[a, a]) / beta
        num = 0.0
        den = 0.0
        for a in range(n):
            for b in range(a + 1, n):
                nab = 0.5 * (N[a, b] + N[b, a])
                D = -((ly[a, b] - ly[a, a]) + (ly[b, a] - ly[b, b])) / beta
                num += D * (nab * nab - N[a, a] * N[b, b])
                den += D * D
        if not (den > 0.0):
            return STATUS_OFF_MANIFOLD  # all h_a equal: y is uniform and h is not identifiable
        t = num / den
        for a in range(n):
            for b in range(n):
                G[a, b] = t + 0.5 * (N[a, b] + N[b, a])
    astar = 0
    for a in range(n):
        if G[a, a] > G[astar, astar]:
            astar = a
    if not (G[astar, astar] > 0.0):
        return STATUS_OFF_MANIFOLD
    ha = math.sqrt(G[astar, astar])
    for b in range(n):
        h[b] = G[astar, b] / ha
    # the reconstruction must reproduce y (otherwise y is off the model's output manifold)
    worst = 0.0
    for a in range(n):
        if LAST_ACTIVATION == "linear":
            for b in range(n):
                worst = max(worst, abs(beta * h[a] * h[b] - y[a, b]) / (1.0 + abs(y[a, b])))
        else:
            m = -math.inf
            for b in range(n):
                m = max(m, beta * h[a] * h[b])
            s = 0.0
            for b in range(n):
                s += math.exp(beta * h[a] * h[b] - m)
            for b in range(n):
                lhat = beta * h[a] * h[b] - m - math.log(s)
                worst = max(worst, abs(lhat - math.log(y[a, b])) / (1.0 + abs(lhat)))
    if not (worst < 1e-6):
        return STATUS_OFF_MANIFOLD
    return STATUS_OK


@njit(cache=True)
def _log_prior(z, omega, Vinv, logdet_V):
    """sum_t log N(z_t; omega_t, V)."""
    p = z.shape[0]
    acc = 0.0
    for t in range(z.shape[1]):
        for k in range(p):
            dk = z[k, t] - omega[k, t]
            s = 0.0
            for j in range(p):
                s += Vinv[k, j] * (z[j, t] - omega[j, t])
            acc += dk * s
    return -0.5 * acc - 0.5 * z.shape[1] * (logdet_V + p * math.log(2.0 * math.pi))


@njit(cache=True)
def denoise_one(obs, omega, V, params, nodes, log_w, nodes_c, log_w_c, n_adapt, inflate, g_out, dg_out, extra):
    """One sample. nodes (Nn, D) standard-normal rule, log_w (Nn) its log weights (final
    pass); nodes_c, log_w_c a coarser rule for the adaptation passes.

    Fills g_out (P, T), dg_out (P, T, P, T); extra[0] = log Z_out, extra[1] = effective number
    of nodes of the final pass (a resolution diagnostic). Returns a STATUS code.
    """
    p = P
    nt = T
    D = INTEGRAL_DIM
    pt = p * nt
    Vinv = np.empty((p, p))
    logdet_V = _precision(V, Vinv)
    if logdet_V != logdet_V:
        return STATUS_BAD_V
    # proposal per branch: mean m (D), Cholesky factor Lb (D, D); start at the prior marginal
    m = np.empty((N_BRANCHES, D))
    Lb = np.zeros((N_BRANCHES, D, D))
    C0 = np.empty((D, D))
    for i in range(D):
        ki, ti = FREE_K[i], FREE_T[i]
        for j in range(D):
            kj, tj = FREE_K[j], FREE_T[j]
            C0[i, j] = V[ki, kj] if ti == tj else 0.0
    L0 = np.empty((D, D))
    if D > 0 and not _cholesky(C0, L0):
        return STATUS_BAD_V
    m0 = np.empty(D)
    for i in range(D):
        m0[i] = omega[FREE_K[i], FREE_T[i]]
        if FREE_LOG[i]:  # slot integrated in s = log|u|: start at the prior's scale of |u|
            m0[i] = 0.5 * math.log(m0[i] * m0[i] + C0[i, i])
            for j in range(D):
                L0[i, j] = 0.0
                L0[j, i] = 0.0
            L0[i, i] = 1.0
    for b in range(N_BRANCHES):
        for i in range(D):
            m[b, i] = m0[i]
            for j in range(D):
                Lb[b, i, j] = L0[i, j]
    z = np.zeros((p, nt))
    u = np.empty(D)
    # branch accumulators (u moments, for adaptation) and global z moments
    bmax = np.empty(N_BRANCHES)
    bS0 = np.empty(N_BRANCHES)
    bS1 = np.empty((N_BRANCHES, D))
    bS2 = np.empty((N_BRANCHES, D, D))
    S1 = np.empty(pt)
    S2 = np.empty((pt, pt))
    dz = np.empty(pt)
    Cb = np.empty((D, D))
    st = np.array([-math.inf, 0.0, 0.0])  # streamed [max log weight, S0, sum w^2]
    for it in range(n_adapt + 1):
        final = it == n_adapt
        rule = nodes if final else nodes_c
        rule_w = log_w if final else log_w_c
        n_nodes = rule.shape[0] if D > 0 else 1
        for b in range(N_BRANCHES):
            bmax[b] = -math.inf
            bS0[b] = 0.0
            bS1[b, :] = 0.0
            bS2[b, :, :] = 0.0
        if final:
            st[0] = -math.inf
            st[1] = 0.0
            st[2] = 0.0
            S1[:] = 0.0
            S2[:, :] = 0.0
        for b in range(N_BRANCHES):
            logdet_L = 0.0
            for i in range(D):
                logdet_L += math.log(Lb[b, i, i])
            for j in range(n_nodes):
                xi2 = 0.0
                for i in range(D):
                    s = m[b, i]
                    for k in range(i + 1):
                        s += Lb[b, i, k] * rule[j, k]
                    u[i] = s
                    xi2 += rule[j, i] * rule[j, i]
                lj = branch(b, u, obs, params, z)
                if not (-math.inf < lj < math.inf):  # zero weight (or det M = 0: a null set)
                    continue
                lw = lj + _log_prior(z, omega, Vinv, logdet_V)
                if D > 0:
                    lw += rule_w[j] + logdet_L + 0.5 * xi2 + 0.5 * D * math.log(2.0 * math.pi)
                if lw != lw:
                    return STATUS_NOT_FINITE
                # branch u-moments (streamed log-sum-exp)
                if lw > bmax[b]:
                    sc = math.exp(bmax[b] - lw) if bmax[b] > -math.inf else 0.0
                    bS0[b] *= sc
                    for i in range(D):
                        bS1[b, i] *= sc
                        for k in range(D):
                            bS2[b, i, k] *= sc
                    bmax[b] = lw
                w = math.exp(lw - bmax[b])
                bS0[b] += w
                for i in range(D):
                    di = u[i] - m[b, i]
                    bS1[b, i] += w * di
                    for k in range(i + 1):
                        bS2[b, i, k] += w * di * (u[k] - m[b, k])
                if final:
                    _accumulate(lw, z, omega, st, S1, S2, dz)
        if not final:
            # re-centre each branch's rule on its posterior mean and covariance
            for b in range(N_BRANCHES):
                if not (bS0[b] > 0.0):
                    continue
                for i in range(D):
                    bS1[b, i] /= bS0[b]
                for i in range(D):
                    for k in range(i + 1):
                        c = inflate * (bS2[b, i, k] / bS0[b] - bS1[b, i] * bS1[b, k])
                        Cb[i, k] = c
                        Cb[k, i] = c
                for i in range(D):
                    m[b, i] += bS1[b, i]
                for i in range(D):  # keep the rule non-degenerate
                    Cb[i, i] += 1e-13 * (1.0 + C0[i, i])
                L1 = np.empty((D, D))
                if _cholesky(Cb, L1):
                    for i in range(D):
                        for k in range(D):
                            Lb[b, i, k] = L1[i, k]
    return _finish(st[0], st[1], st[2], S1, S2, Vinv, g_out, dg_out, extra)


@njit(cache=True)
def _finish(gmax, S0, Sw2, S1, S2, Vinv, g_out, dg_out, extra):
    """Posterior moments of z - omega (streamed sums S0, S1, S2 scaled by exp(-gmax)) ->
    log Z_out, effective number of nodes, g_out and dg_out."""
    p = P
    nt = T
    pt = p * nt
    if not (S0 > 0.0):
        return STATUS_ZERO_LIKELIHOOD
    extra[0] = gmax + math.log(S0)
    extra[1] = S0 * S0 / Sw2
    # posterior moments of z - omega -> g_out, dg_out
    mean = np.empty(pt)
    for i in range(pt):
        mean[i] = S1[i] / S0
    cov = np.empty((pt, pt))
    for i in range(pt):
        for k in range(i + 1):
            c = S2[i, k] / S0 - mean[i] * mean[k]
            cov[i, k] = c
            cov[k, i] = c
    for tt in range(nt):
        for kk in range(p):
            s = 0.0
            for j in range(p):
                s += Vinv[kk, j] * mean[j * nt + tt]
            g_out[kk, tt] = s
    for tt in range(nt):
        for ss in range(nt):
            for kk in range(p):
                for k2 in range(p):
                    s = 0.0
                    for a in range(p):
                        for c in range(p):
                            s += Vinv[kk, a] * cov[a * nt + tt, c * nt + ss] * Vinv[c, k2]
                    if tt == ss:
                        s -= Vinv[kk, k2]
                    dg_out[kk, tt, k2, ss] = s
    return STATUS_OK


@njit(cache=True)
def _finish_acc(gmax, acc, Vinv, g_out, dg_out, extra):
    """``_finish`` from the 16 sums of the polar kernels (S0, sum w^2, S1 (4), the lower
    triangle of S2 row by row)."""
    S1 = np.empty(4)
    for q in range(4):
        S1[q] = acc[2 + q]
    S2 = np.zeros((4, 4))
    q = 6
    for i in range(4):
        for k in range(i + 1):
            S2[i, k] = acc[q]
            q += 1
    return _finish(gmax, acc[0], acc[1], S1, S2, Vinv, g_out, dg_out, extra)


@njit(cache=True)
def _accumulate(lw, z, omega, st, S1, S2, dz):
    """Add weight exp(lw) at z to the streamed sums; st = [gmax, S0, Sw2] (log-sum-exp)."""
    p = P
    nt = T
    pt = p * nt
    if lw > st[0]:
        sc = math.exp(st[0] - lw) if st[0] > -math.inf else 0.0
        st[1] *= sc
        st[2] *= sc * sc
        for i in range(pt):
            S1[i] *= sc
            for k in range(pt):
                S2[i, k] *= sc
        st[0] = lw
    w = math.exp(lw - st[0])
    st[1] += w
    st[2] += w * w
    for kk in range(p):
        for tt in range(nt):
            dz[kk * nt + tt] = z[kk, tt] - omega[kk, tt]
    for i in range(pt):
        S1[i] += w * dz[i]
        for k in range(i + 1):
            S2[i, k] += w * dz[i] * dz[k]


@njit(cache=True)
def _quad_prior(z, omega, Vinv):
    """sum_t (z_t - omega_t)^T V^{-1} (z_t - omega_t)."""
    p = z.shape[0]
    acc = 0.0
    for t in range(z.shape[1]):
        for k in range(p):
            s = 0.0
            for j in range(p):
                s += Vinv[k, j] * (z[j, t] - omega[j, t])
            acc += (z[k, t] - omega[k, t]) * s
    return acc


# the polar rules' domain per sample, dom = (c_0, c_1, s, kr): a disk |u| <= |c| + kr s (u = the
# free first-layer indices), or an annular sector around c (``_polar_pieces``); c = omega_u and
# s = the prior sd of u by default, or fitted to the posterior of u when the likelihood pulls it
# off the prior (the driver, ``Denoiser._sized_run``)
@njit(cache=True)
def polar_radius(dom):
    """Outer radius of the polar domain: |c| + kr s."""
    return math.sqrt(dom[0] * dom[0] + dom[1] * dom[1]) + dom[3] * dom[2]


@njit(cache=True)
def denoise_one_polar(obs, omega, V, params, pc, ps, plw, rr, w_r, dom, g_out, dg_out, extra):
    """Two free indices u = z_1 (layer 1 tied, rank one, T = 2): polar product rule on the disk
    |u| <= R = polar_radius(dom), with Gauss-Legendre angles in the sectors cut by the
    lines u_1 = 0, u_2 = 0, u_1 = u_2 (POLAR_ANGLES), where the first layer's attention switches,
    so that every sector's integrand is smooth: spectral convergence.

    pc, ps, plw: cos, sin and log weight of every angle node (all sectors; fixed per rule);
    rr, w_r: Gauss-Legendre on [-1, 1] for the radius. The two branches are z_L = +-M^{-1} h with
    the same Jacobian, so one ``branch`` call serves both. extra[3]: the share of the weight on
    the outermost radial ring (the domain's edge)."""
    p = P
    nt = T
    pt = p * nt
    Vinv = np.empty((p, p))
    logdet_V = _precision(V, Vinv)
    if logdet_V != logdet_V:
        return STATUS_BAD_V
    R = polar_radius(dom)
    n_r = rr.shape[0]
    rad = np.empty(n_r)
    lwr = np.empty(n_r)
    for j in range(n_r):
        rad[j] = 0.5 * R * (rr[j] + 1.0)
        lwr[j] = math.log(0.5 * R * w_r[j] * rad[j])
    const = -0.5 * nt * (logdet_V + p * math.log(2.0 * math.pi))
    z = np.zeros((p, nt))
    u = np.empty(2)
    st = np.array([-math.inf, 0.0, 0.0])
    S1 = np.zeros(pt)
    S2 = np.zeros((pt, pt))
    dz = np.empty(pt)
    edge = -math.inf  # log of the weight on the outermost radial ring (the domain's edge)
    for k in range(pc.shape[0]):
        for j in range(n_r):
            u[0] = rad[j] * pc[k]
            u[1] = rad[j] * ps[k]
            lj = branch(0, u, obs, params, z)
            if not (-math.inf < lj < math.inf):  # det M = 0: a null set (skip c = 0)
                continue
            base = lj + plw[k] + lwr[j] + const
            for sgn in range(2):
                if sgn == 1:  # the solved entries are the last layer's row (attention-rank1)
                    for t in range(nt):
                        z[p - 1, t] = -z[p - 1, t]
                lw = base - 0.5 * _quad_prior(z, omega, Vinv)
                if lw != lw:
                    return STATUS_NOT_FINITE
                _accumulate(lw, z, omega, st, S1, S2, dz)
                if j == n_r - 1:
                    hi = max(edge, lw)
                    edge = hi + math.log(math.exp(edge - hi) + math.exp(lw - hi))
    status = _finish(st[0], st[1], st[2], S1, S2, Vinv, g_out, dg_out, extra)
    extra[3] = math.exp(edge - extra[0]) if status == STATUS_OK else 0.0
    return status


# SIMD exp: exp(x) = 2^k p(r), x = k ln 2 + r, |r| <= ln(2) / 2, p the polynomial below, 2^k
# written into the exponent bits (``_exp``). Inlined into plain loops over arrays, which LLVM
# vectorises (libm's exp is a scalar call): about 2x faster per exp here, and it lets the
# whole per-radius block of the polar rule run in SIMD.
_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_ROUND = 6755399441055744.0  # 1.5 * 2^52: (x + _ROUND) - _ROUND rounds x to an integer
# exp(r) = 1 + r q(r) on |r| <= ln(2)/2: q is the degree-10 Chebyshev fit of expm1(r)/r
# (mpmath.chebyfit at 40 digits: error 1.8e-17; two FMAs fewer than Taylor to the same accuracy;
# test: < 5e-16 relative to libm), lowest degree first
_EXP_Q = (1.0, 0.5000000000000006, 0.1666666666666667, 0.04166666666657314, 0.008333333333326141,
          0.0013888888932488599, 0.00019841269874800493, 2.4801504346997686e-05, 2.7557255425746435e-06,
          2.7626357241447223e-07, 2.510520637395701e-08)


@njit(cache=True, fastmath={"contract"})
def _exp_parts(x):
    """exp(x) = p * 2^k (x clipped to [-708, 709]): returns p and k + 1023 + 2^52 as a double,
    whose low mantissa bits hold k + 1023 (inlined into the SIMD loops below)."""
    xi = min(max(x, -708.0), 709.0)
    k = (xi * _LOG2E + _ROUND) - _ROUND
    r = (xi - k * _LN2_HI) - k * _LN2_LO
    p = 1.0 + r * (_EXP_Q[0] + r * (_EXP_Q[1] + r * (_EXP_Q[2] + r * (_EXP_Q[3] + r * (_EXP_Q[4] + r * (
        _EXP_Q[5] + r * (_EXP_Q[6] + r * (_EXP_Q[7] + r * (_EXP_Q[8] + r * (_EXP_Q[9] + r * _EXP_Q[10]))))))))))
    return p, k + 4503599627371519.0


@intrinsic
def _double_bits(typingctx, x):
    """The bits of a double as an int64 (an LLVM bitcast: free, and it vectorises)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], llvm_ir.IntType(64))
    return types.int64(types.float64), codegen


@intrinsic
def _bits_double(typingctx, x):
    """The double with the bits of an int64 (LLVM bitcast)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], llvm_ir.DoubleType())
    return types.float64(types.int64), codegen


@njit(cache=True, fastmath={"contract"})
def _exp(x):
    """exp(x), x clipped to [-708, 709] (relative error < 5e-16), inlined into loops that LLVM
    vectorises (libm's exp is a scalar call). 2^k: k + 1023 + 2^52 as a double holds k + 1023
    in its low mantissa bits; shifted left by 52 as an int64 that becomes the exponent field
    (bitcasts, no double -> int conversion, which AVX2 cannot vectorise)."""
    p, kb = _exp_parts(x)
    return p * _bits_double(_double_bits(kb) << 52)


@njit(cache=True, fastmath={"contract"})
def _vexp(x, n, shift):
    """x[:n] <- exp(x[:n] - shift), in place (one array: no runtime overlap check, SIMD)."""
    for i in range(n):
        x[i] = _exp(x[i] - shift)


@njit(cache=True, fastmath={"contract"})
def _vexp_to(x, out, n, shift):
    """out[:n] = exp(x[:n] - shift) for out distinct from x."""
    for i in range(n):
        out[i] = _exp(x[i] - shift)


@njit(cache=True, fastmath={"contract"})
def _sincos(x, s, c, n):
    """s, c = sin, cos of x[:n], |x| <= pi/4 (Taylor to degree 17/16: error < 2e-16)."""
    for i in range(n):
        t = x[i]
        t2 = t * t
        s[i] = t * (1.0 + t2 * (-1.0 / 6 + t2 * (1.0 / 120 + t2 * (-1.0 / 5040 + t2 * (1.0 / 362880 + t2 * (
            -1.0 / 39916800 + t2 * (1.0 / 6227020800 + t2 * (-1.0 / 1307674368000 + t2 * (1.0 / 355687428096000)))))))))
        c[i] = 1.0 + t2 * (-0.5 + t2 * (1.0 / 24 + t2 * (-1.0 / 720 + t2 * (1.0 / 40320 + t2 * (-1.0 / 3628800 + t2 * (
            1.0 / 479001600 + t2 * (-1.0 / 87178291200 + t2 * (1.0 / 20922789888000))))))))


# full-disk rule, prior of u off the origin (|omega_u| > POLAR_OFF sd): the sectors are also cut
# POLAR_CORE sd (in angle) around its direction: the narrowest core that still holds the peak
# (the comparison of values is in docs/tuning.md)
POLAR_OFF = 2.5
POLAR_CORE = 1.5
# kinds of the ends of an angular piece of the mapped rule: inside the domain (plain
# Gauss-Legendre), a switching line (the sinh map) or the domain's angular edge (plain; its
# nodes count in the edge weight, ``_mapped_sums``)
END_INNER = 0
END_SWITCH = 1
END_EDGE = 2


@njit(cache=True)
def _polar_domain(dom):
    """|c|, the scale s, arg c mod pi, the inner radius r_lo of the domain (> 0: the annular
    sector around c) and whether a full-disk bump sits off the origin (|c| > POLAR_OFF s)."""
    c0 = dom[0]
    c1 = dom[1]
    mu = math.sqrt(c0 * c0 + c1 * c1)
    su = dom[2]
    r_lo = max(0.0, mu - dom[3] * su)
    return mu, su, math.atan2(c1, c0) % math.pi, r_lo, mu > POLAR_OFF * su


@njit(cache=True)
def _disk_pieces(phi, core):
    """Full-disk angular pieces in [0, pi]: the sectors between switching lines (POLAR_ANGLES),
    also cut at phi +- core (mod pi) when core < pi / 2; ends and whether each is a switching
    line (END_SWITCH) or inner (END_INNER)."""
    pa = np.empty(16)
    pb = np.empty(16)
    pea = np.zeros(16, dtype=np.int8)
    peb = np.zeros(16, dtype=np.int8)
    n_pc = 0
    cuts = np.empty(2)
    n_cut = 0
    if core < 0.5 * math.pi:
        for c in (phi - core, phi + core):
            cuts[n_cut] = c % math.pi
            n_cut += 1
    for e in range(POLAR_ANGLES.shape[0] - 1):
        ta = POLAR_ANGLES[e]
        tb = POLAR_ANGLES[e + 1]
        if tb > math.pi + 1e-12:
            break
        lo = ta
        lo_kind = END_SWITCH
        for _ in range(2):  # the cuts inside this sector, in increasing order
            nxt = tb
            for k in range(n_cut):
                if lo < cuts[k] < nxt:
                    nxt = cuts[k]
            if nxt >= tb:
                break
            pa[n_pc] = lo
            pb[n_pc] = nxt
            pea[n_pc] = lo_kind
            peb[n_pc] = END_INNER
            n_pc += 1
            lo = nxt
            lo_kind = END_INNER
        pa[n_pc] = lo
        pb[n_pc] = tb
        pea[n_pc] = lo_kind
        peb[n_pc] = END_SWITCH
        n_pc += 1
    return pa[:n_pc], pb[:n_pc], pea[:n_pc], peb[:n_pc]


@njit(cache=True)
def _polar_pieces(dom, crad):
    """Angular pieces in [0, pi] of the mapped polar rule (u and -u are visited together) and
    the radial range: each sector between switching lines (POLAR_ANGLES), intersected with the
    arc around arg(c) (mod pi) when the bump of u (dom: c, s) lies far from the origin (r_lo > 0;
    the arc is cut 3 sd around that direction so that the bump's core gets its own pieces).
    On the full disk (r_lo = 0) a bump off the origin (|omega_u| > POLAR_OFF sd) is narrow in
    angle (width sd / |omega_u|): the sectors are also cut POLAR_CORE sd around its direction,
    else the nodes graded towards the switching lines leave it under-resolved when it sits
    inside a sector (errors up to 5e-5 at the default size, V = 0.3 I), and its radial grading
    starts from the scale of its inner side. The full disk's radius is rounded up to the grid of
    ``_grid_radius`` (node tables). Returns R, r_lo, the radial scale c_eff of
    r^2 = r_lo^2 + c_eff (e^s - 1), and per piece its ends and their kinds (END_SWITCH: a
    switching line, which gets the sinh map; END_INNER, END_EDGE: inside the domain or on its
    angular edge, plain Gauss-Legendre)."""
    mu, su, phi, r_lo, off = _polar_domain(dom)
    R = polar_radius(dom)
    kr = dom[3]
    if r_lo <= 0.0:
        core = POLAR_CORE * su / mu if off else math.pi  # (>= pi/2: no cut)
        # logarithmic from the origin; a bump off it: from its inner side's scale, so that fewer
        # nodes sit near the origin (halves the points above 1e-8 at (9, 24), V = 0.1 I)
        c_eff = max(crad, (mu - 2.0 * su) ** 2) if off else crad
        pa, pb, pea, peb = _disk_pieces(phi, core)
        return _grid_radius(R), r_lo, c_eff, pa, pb, pea, peb
    pa = np.empty(16)
    pb = np.empty(16)
    pea = np.zeros(16, dtype=np.int8)
    peb = np.zeros(16, dtype=np.int8)
    n_pc = 0
    dlt = math.asin(min(1.0, kr * su / mu))
    core = min(dlt, 3.0 * su / mu)
    for e in range(POLAR_ANGLES.shape[0] - 1):
        ta = POLAR_ANGLES[e]
        tb = POLAR_ANGLES[e + 1]
        if tb > math.pi + 1e-12:
            break
        for shift in (-math.pi, 0.0, math.pi):
            for part in range(3):
                lo = phi + shift + (-dlt, -core, core)[part]
                hi = phi + shift + (-core, core, dlt)[part]
                lo = max(ta, lo)
                hi = min(tb, hi)
                if hi > lo and n_pc < pa.shape[0]:
                    pa[n_pc] = lo
                    pb[n_pc] = hi
                    pea[n_pc] = END_SWITCH if lo == ta else (END_EDGE if part == 0 else END_INNER)
                    peb[n_pc] = END_SWITCH if hi == tb else (END_EDGE if part == 2 else END_INNER)
                    n_pc += 1
    return R, r_lo, max(crad, r_lo * r_lo), pa[:n_pc], pb[:n_pc], pea[:n_pc], peb[:n_pc]  # (about uniform in r^2)


@njit(cache=True, fastmath={"contract", "reassoc"})
def _polar_moments(wt, U, W, o00, o01, o10, o11, n, acc):
    """acc += the sums of the four sign pairs at nodes i < n (weights wt, rows: the sign pairs
    (+u, +w), (+u, -w), (-u, +w), (-u, -w); ``_sign_pair_weights``): S0, sum W^2, first moments of z - omega (index
    k * T + t: 0, 1 = u; 2, 3 = w) and second moments (lower triangle). Reassociation lets the
    sums vectorise (order only: ~1e-16)."""
    s0 = 0.0
    sw2 = 0.0
    m0 = 0.0
    m1 = 0.0
    m2 = 0.0
    m3 = 0.0
    c00 = 0.0
    c10 = 0.0
    c11 = 0.0
    c20 = 0.0
    c21 = 0.0
    c22 = 0.0
    c30 = 0.0
    c31 = 0.0
    c32 = 0.0
    c33 = 0.0
    for i in range(n):
        wpp = wt[0, i]
        wpm = wt[1, i]
        wmp = wt[2, i]
        wmm = wt[3, i]
        dp0 = U[0, i] - o00
        dp1 = U[1, i] - o01
        dm0 = -U[0, i] - o00
        dm1 = -U[1, i] - o01
        ep0 = W[0, i] - o10
        ep1 = W[1, i] - o11
        em0 = -W[0, i] - o10
        em1 = -W[1, i] - o11
        wp_ = wpp + wpm  # u-sign +, both w-signs
        wm_ = wmp + wmm
        w_p = wpp + wmp  # w-sign +, both u-signs
        w_m = wpm + wmm
        s0 += wp_ + wm_
        sw2 += wpp * wpp + wpm * wpm + wmp * wmp + wmm * wmm
        m0 += wp_ * dp0 + wm_ * dm0
        m1 += wp_ * dp1 + wm_ * dm1
        m2 += w_p * ep0 + w_m * em0
        m3 += w_p * ep1 + w_m * em1
        c00 += wp_ * dp0 * dp0 + wm_ * dm0 * dm0
        c10 += wp_ * dp1 * dp0 + wm_ * dm1 * dm0
        c11 += wp_ * dp1 * dp1 + wm_ * dm1 * dm1
        c22 += w_p * ep0 * ep0 + w_m * em0 * em0
        c32 += w_p * ep1 * ep0 + w_m * em1 * em0
        c33 += w_p * ep1 * ep1 + w_m * em1 * em1
        fp0 = wpp * ep0 + wpm * em0  # sum over w-signs, u-sign +
        fp1 = wpp * ep1 + wpm * em1
        fm0 = wmp * ep0 + wmm * em0
        fm1 = wmp * ep1 + wmm * em1
        c20 += fp0 * dp0 + fm0 * dm0
        c21 += fp0 * dp1 + fm0 * dm1
        c30 += fp1 * dp0 + fm1 * dm0
        c31 += fp1 * dp1 + fm1 * dm1
    acc[0] += s0
    acc[1] += sw2
    acc[2] += m0
    acc[3] += m1
    acc[4] += m2
    acc[5] += m3
    acc[6] += c00
    acc[7] += c10
    acc[8] += c11
    acc[9] += c20
    acc[10] += c21
    acc[11] += c22
    acc[12] += c30
    acc[13] += c31
    acc[14] += c32
    acc[15] += c33


@njit(cache=True, fastmath={"contract", "reassoc"})
def _table_moments(wt, U, W, o00, o01, o10, o11, n, acc):
    """``_polar_moments`` on the plain full disk (node tables), with fewer operations: the
    u-moments (sums of u and u u^T over both u-signs) are taken about the origin and moved to
    omega_u at the end (the plain disk's bump lies within 2.5 sd of the origin; the shift
    costs ~1e-16 |omega_u|^2 absolute in the second moments), and the cross moments reuse the
    w sums. ~40 % fewer operations per node; the
    table path equals the per-sample kernel (``_polar_moments``) to rounding (tests)."""
    s0 = 0.0
    sw2 = 0.0
    mu0 = 0.0
    mu1 = 0.0
    mw0 = 0.0
    mw1 = 0.0
    c22 = 0.0
    c32 = 0.0
    c33 = 0.0
    r20 = 0.0
    r21 = 0.0
    r30 = 0.0
    r31 = 0.0
    a00 = 0.0
    a10 = 0.0
    a11 = 0.0
    for i in range(n):
        wpp = wt[0, i]
        wpm = wt[1, i]
        wmp = wt[2, i]
        wmm = wt[3, i]
        u0 = U[0, i]
        u1 = U[1, i]
        wp_ = wpp + wpm  # u-sign +, both w-signs
        wm_ = wmp + wmm
        s = wp_ + wm_
        bu = wp_ - wm_  # odd in the u-sign
        w_p = wpp + wmp  # w-sign +, both u-signs
        w_m = wpm + wmm
        dp = wpp - wmp  # odd in the u-sign, per w-sign
        dm = wpm - wmm
        ep0 = W[0, i] - o10
        em0 = -W[0, i] - o10
        ep1 = W[1, i] - o11
        em1 = -W[1, i] - o11
        s0 += s
        sw2 += wpp * wpp + wpm * wpm + wmp * wmp + wmm * wmm
        mu0 += bu * u0
        mu1 += bu * u1
        tp0 = w_p * ep0
        tm0 = w_m * em0
        tp1 = w_p * ep1
        tm1 = w_m * em1
        mw0 += tp0 + tm0
        mw1 += tp1 + tm1
        c22 += tp0 * ep0 + tm0 * em0
        c32 += tp1 * ep0 + tm1 * em0
        c33 += tp1 * ep1 + tm1 * em1
        x0 = dp * ep0 + dm * em0
        x1 = dp * ep1 + dm * em1
        r20 += x0 * u0
        r21 += x0 * u1
        r30 += x1 * u0
        r31 += x1 * u1
        su0 = s * u0
        su1 = s * u1
        a00 += su0 * u0
        a10 += su0 * u1
        a11 += su1 * u1
    # about omega: sum w (s u - o)(s u - o)^T = sum s uu^T - (sum bu u) o^T - o (sum bu u)^T + S0 oo^T,
    # sum w (e_w)(s u - o)^T = sum (dp e_+ + dm e_-) u^T - (sum w e_w) o^T
    acc[0] += s0
    acc[1] += sw2
    acc[2] += mu0 - s0 * o00
    acc[3] += mu1 - s0 * o01
    acc[4] += mw0
    acc[5] += mw1
    acc[6] += a00 - 2.0 * o00 * mu0 + s0 * o00 * o00
    acc[7] += a10 - o00 * mu1 - o01 * mu0 + s0 * o00 * o01
    acc[8] += a11 - 2.0 * o01 * mu1 + s0 * o01 * o01
    acc[9] += r20 - mw0 * o00
    acc[10] += r21 - mw0 * o01
    acc[11] += c22
    acc[12] += r30 - mw1 * o00
    acc[13] += r31 - mw1 * o01
    acc[14] += c32
    acc[15] += c33


@njit(cache=True, error_model="numpy")
def _polar_node_weights(W, J, wpsi, n):
    """J <- the node weight wpsi J, and 0 with w = 0 where det M = 0 (J = inf: a null set, skip
    c = 0). A loop of its own: few arrays, so LLVM's overlap checks stay few and it vectorises
    (every load unconditional: a load under the condition would need a masked load, and the
    cost model then keeps the loop scalar)."""
    for i in range(n):
        j = J[i]
        w0 = W[0, i]
        w1 = W[1, i]
        wj = wpsi[i] * j
        ok = (j >= 0.0) & (j < math.inf)
        W[0, i] = w0 if ok else 0.0
        W[1, i] = w1 if ok else 0.0
        J[i] = wj if ok else 0.0


@njit(cache=True)
def _sign_pair_log_weights(u0, u1, w0, w1, o00, o01, o10, o11, p00, p01, p11):
    """Log prior weights (up to the constant) of the sign pairs (+u, +w), (+u, -w), (-u, +w),
    (-u, -w) at one node (inlined into the SIMD loops)."""
    dp0 = u0 - o00
    dp1 = u1 - o01
    dm0 = -u0 - o00
    dm1 = -u1 - o01
    ep0 = w0 - o10
    ep1 = w1 - o11
    em0 = -w0 - o10
    em1 = -w1 - o11
    qup = p00 * (dp0 * dp0 + dp1 * dp1)
    qum = p00 * (dm0 * dm0 + dm1 * dm1)
    qwp = p11 * (ep0 * ep0 + ep1 * ep1)
    qwm = p11 * (em0 * em0 + em1 * em1)
    return (-0.5 * (qup + qwp) - p01 * (dp0 * ep0 + dp1 * ep1), -0.5 * (qup + qwm) - p01 * (dp0 * em0 + dp1 * em1),
            -0.5 * (qum + qwp) - p01 * (dm0 * ep0 + dm1 * ep1), -0.5 * (qum + qwm) - p01 * (dm0 * em0 + dm1 * em1))


@njit(cache=True, error_model="numpy")
def _polar_log_weights(U, W, o00, o01, o10, o11, p00, p01, p11, n, L):
    """L[s, i]: log prior weight of the sign pair s = (+u, +w), (+u, -w), (-u, +w), (-u, -w) at
    node i < n (up to the constant). No reduction, one output array: the loop vectorises."""
    for i in range(n):
        L[0, i], L[1, i], L[2, i], L[3, i] = _sign_pair_log_weights(U[0, i], U[1, i], W[0, i], W[1, i], o00, o01,
                                                                    o10, o11, p00, p01, p11)


@njit(cache=True, fastmath={"reassoc"})
def _nan_sum(L, n):
    """Sum of L[:, :n]: NaN iff an entry is NaN (reassociation lets it vectorise)."""
    s = 0.0
    for i in range(n):
        s += (L[0, i] + L[1, i]) + (L[2, i] + L[3, i])
    return s


@njit(cache=True, fastmath={"nnan", "ninf", "nsz", "reassoc"})
def _running_max(x, n):
    """max of x[:n] (finite; -1e308 if n = 0). LLVM does not vectorise a floating-point max
    reduction here, so four interleaved running maxima (no dependency chain)."""
    m0 = m1 = m2 = m3 = -1e308
    k = 0
    while k + 4 <= n:
        a = x[k]
        b = x[k + 1]
        c = x[k + 2]
        d = x[k + 3]
        m0 = a if a > m0 else m0
        m1 = b if b > m1 else m1
        m2 = c if c > m2 else m2
        m3 = d if d > m3 else m3
        k += 4
    while k < n:
        a = x[k]
        m0 = a if a > m0 else m0
        k += 1
    m0 = m0 if m0 > m1 else m1
    m2 = m2 if m2 > m3 else m3
    return m0 if m0 > m2 else m2


@njit(cache=True)
def _max4(a, b, c, d):
    """max of four finite numbers as selects (inlined; vectorises in the node loops)."""
    x = a if a > b else b
    y = c if c > d else d
    return x if x > y else y


@njit(cache=True, fastmath={"nnan", "ninf", "nsz", "reassoc"})
def _max_log_weight(L, J, tmp, n):
    """max of L[:, i] over the nodes i < n with J[i] > 0; -1e308 if none (L is finite, checked
    by _nan_sum first): the max over the four rows in a vectorised pass into tmp, then
    ``_running_max``."""
    for i in range(n):
        m = _max4(L[0, i], L[1, i], L[2, i], L[3, i])
        tmp[i] = m if J[i] > 0.0 else -1e308
    return _running_max(tmp, n)


@njit(cache=True, error_model="numpy")  # IEEE division: the node loops have no exception branch
def denoise_one_polar_mapped(obs, omega, V, params, xa, wa, xr, wr, dom, kappa, crad, g_out, dg_out, extra):
    """Two free indices u = z_1 (layer 1 tied, rank one, T = 2): mapped polar rule (default).

    Symmetry: the first layer's logits beta u_a u_b are even in u, so u and -u give the same
    mixing matrix, the same solved row w and the same Jacobian: one node of ``polar_rows``
    serves the four points (+-u, +-w), and only the half plane 0 <= theta <= pi is visited.

    Radius: rho = r^2 = crad (e^s - 1), Gauss-Legendre in s on [0, log(1 + R^2 / crad)] (xr, wr
    on [-1, 1]), R = polar_radius(dom) (on the full disk rounded up to the grid of
    ``_grid_radius``): summed over +-u the integrand is analytic in rho, and the logits grow
    like rho, so a logarithmic grading resolves every scale.
    Angle: sectors cut on the lines where the attention switches (POLAR_ANGLES in [0, pi]),
    each split in halves; from each edge psi = eps sinh(tau) with eps = kappa / (beta r^2),
    Gauss-Legendre in tau on [0, asinh(half width / eps)] (xa, wa on [-1, 1]): the logit of
    the switching row is about beta r^2 psi, so its layer (width ~1/(beta r^2)) is resolved by
    the same nodes at every radius (Elliott-Johnston sinh map). A prior of u off the origin
    (``_polar_pieces``) gets its own angular pieces, and on the full disk the radial grading
    starts from the scale of its inner side, crad -> max(crad, (|omega_u| - 2 sd)^2).

    All nodes are processed at once, stage by stage, in loops that LLVM vectorises (``_vexp``,
    ``_sincos``, the generated ``polar_rows``); the log-sum-exp shift is 0, or the exact maximum
    where the weights leave the double range (``_mapped_sums``).
    ``denoise_one_polar_table`` is the same rule from a node table shared by a batch."""
    Vinv = np.empty((2, 2))
    logdet_V = _precision(V, Vinv)
    if logdet_V != logdet_V:
        return STATUS_BAD_V
    R, r_lo, c_eff, pa, pb, pea, peb = _polar_pieces(dom, crad)
    U, wpsi, aedge = _mapped_nodes(R, r_lo, c_eff, pa, pb, pea, peb, abs(polar_beta(params)), xa, wa, xr, wr, kappa)
    NT = U.shape[1]
    W = np.empty((2, NT))
    J = np.empty(NT)
    E = np.empty((POLAR_ROWS, NT))
    polar_rows(U, NT, obs, params, W, J, E)
    _polar_node_weights(W, J, wpsi, NT)
    L = np.empty((4, NT))
    _polar_log_weights(U, W, omega[0, 0], omega[0, 1], omega[1, 0], omega[1, 1], Vinv[0, 0], Vinv[0, 1], Vinv[1, 1],
                       NT, L)
    nan = _nan_sum(L, NT)
    if nan != nan:
        return STATUS_NOT_FINITE
    return _mapped_sums(U, W, J, L, NT, omega, Vinv, logdet_V, False, NT // xr.shape[0], r_lo > 0.0, aedge,
                        g_out, dg_out, extra)


@njit(cache=True, error_model="numpy")
def _mapped_nodes(R, r_lo, c_eff, pa, pb, pea, peb, beta, xa, wa, xr, wr, kappa):
    """Nodes U (2, NT) and weights (NT) of the mapped polar rule on the domain of
    ``_polar_pieces`` (radius-major: node j * N + i, N angle nodes per radius), and the angle
    nodes i next to an angular edge of the domain (END_EDGE)."""
    n_pc = pa.shape[0]
    rho_lo = r_lo * r_lo
    Slog = math.log1p((R * R - rho_lo) / c_eff)
    na = xa.shape[0]
    nr = xr.shape[0]
    N = n_pc * 2 * na  # angle nodes per radius
    NT = nr * N
    # per angle node (pieces x ends x Gauss nodes), rows of one table (few arrays per loop keep
    # LLVM's runtime overlap checks below its limit, so the loops vectorise): 0, 1 the end's
    # cos, sin; 2, 3 the same times the direction into the piece; 4 the node in [0, 1] where
    # the end is mapped (else 0), 5 half its weight; 6, 7 the plain Gauss-Legendre offset and
    # weight (an inner end, or beta = 0); 8 whether the sinh map applies (1 or 0)
    tab = np.empty((9, N))
    Tmn = np.empty(N)  # asinh(half width / eps) of each node's piece, per radius
    sinh_map = beta > 0.0  # (beta = 0: no switching layer, plain Gauss-Legendre)
    aedge = np.empty(2 * n_pc, dtype=np.int64)
    n_edge = 0
    i = 0
    for e in range(n_pc):
        for side in range(2):
            edge = pa[e] if side == 0 else pb[e]
            dirn = 1.0 if side == 0 else -1.0
            kind = pea[e] if side == 0 else peb[e]
            mapped = kind == END_SWITCH and sinh_map
            if kind == END_EDGE:  # (xa ascending: node 0 is the one next to the end)
                aedge[n_edge] = i
                n_edge += 1
            c_edge = math.cos(edge)
            s_edge = math.sin(edge)
            for k in range(na):
                tab[0, i] = c_edge
                tab[1, i] = s_edge
                tab[2, i] = dirn * c_edge
                tab[3, i] = dirn * s_edge
                tab[4, i] = 0.5 * (xa[k] + 1.0) if mapped else 0.0
                tab[5, i] = 0.5 * wa[k]
                tab[6, i] = 0.25 * (pb[e] - pa[e]) * (xa[k] + 1.0)
                tab[7, i] = 0.25 * (pb[e] - pa[e]) * wa[k]
                tab[8, i] = 1.0 if mapped else 0.0
                i += 1
    # all nodes at once (radius-major, index j * N + i): one pass per stage over ~1e3 nodes,
    # so the loops run in SIMD with little overhead
    buf = np.empty((4, NT))
    tau, ex, psi, wpsi = buf[0], buf[1], buf[2], buf[3]
    U = np.empty((2, NT))
    SC = np.empty((2, NT))  # sin, cos of psi
    rr = np.empty(nr)
    epsr = np.empty(nr)
    wradr = np.empty(nr)
    for j in range(nr):
        em1 = math.expm1(0.5 * Slog * (xr[j] + 1.0))
        rho = rho_lo + c_eff * em1
        rr[j] = math.sqrt(rho)
        wradr[j] = 0.25 * Slog * wr[j] * c_eff * (em1 + 1.0)  # d(r^2) / 2 = r dr
        epsr[j] = kappa / (beta * rho) if sinh_map else 1.0
        Tm = 0.0
        for e in range(n_pc):
            if e == 0 or pb[e] - pa[e] != pb[e - 1] - pa[e - 1]:  # (equal sectors: the same Tm)
                x = 0.5 * (pb[e] - pa[e]) / epsr[j]  # asinh(x) for x >= 0 by log (libm's asinh is slow)
                Tm = math.log(x + math.sqrt(x * x + 1.0))
            for i in range(e * 2 * na, (e + 1) * 2 * na):
                Tmn[i] = Tm
        tj = tau[j * N:(j + 1) * N]
        wj = wpsi[j * N:(j + 1) * N]
        for i in range(N):
            tj[i] = Tmn[i] * tab[4, i]
            wj[i] = Tmn[i] * tab[5, i]
    _vexp_to(tau, ex, NT, 0.0)
    for j in range(nr):
        # psi = eps sinh(tau) next to a switching line (the absolute error of (e - 1/e) / 2
        # is ~1e-16), plain Gauss-Legendre at an inner end; times the radial weight
        he = 0.5 * epsr[j]
        w_ = wradr[j]
        ej = ex[j * N:(j + 1) * N]
        pj = psi[j * N:(j + 1) * N]
        wj = wpsi[j * N:(j + 1) * N]
        for i in range(N):
            e_ = ej[i]
            ie = 1.0 / e_
            m = tab[8, i] > 0.0
            pj[i] = he * (e_ - ie) if m else tab[6, i]
            wj[i] = w_ * (he * (e_ + ie) * wj[i] if m else tab[7, i])
    _sincos(psi, SC[0], SC[1], NT)
    for j in range(nr):
        r = rr[j]
        for i in range(N):  # theta = edge +- psi
            s_ = SC[0, j * N + i]
            c_ = SC[1, j * N + i]
            U[0, j * N + i] = r * (tab[0, i] * c_ - tab[3, i] * s_)
            U[1, j * N + i] = r * (tab[1, i] * c_ + tab[2, i] * s_)
    return U, wpsi, aedge[:n_edge]


# the polar kernels' log weights are log prior densities up to their constant, so <= 0: with
# shift 0 the log-sum-exp needs no maximum pass. The weights are then exact unless they fall out
# of the double range (below e^-708 they are clipped); a sum S0 below SHIFT0_MIN_S0 (the
# largest weight <= ~1e-100, then its square, in sum W^2, would be <= 1e-200) redoes the sums
# with the exact maximum as the shift
SHIFT0_MIN_S0 = 1e-100


@njit(cache=True, fastmath={"contract"})
def _sign_pair_weights(L, J, n, shift):
    """L[s, i] <- J[i] exp(L[s, i] - shift) (J = 0: weight 0), in place and in SIMD."""
    for s in range(4):
        x = L[s]
        for i in range(n):
            x[i] = J[i] * _exp(x[i] - shift)


@njit(cache=True, fastmath={"contract", "reassoc"})
def _edge_weight(wt, n, N, inner, aedge):
    """Weight (rows: the sign pairs) on the domain's edge: the outermost radial ring (the last N
    nodes, radius-major), the innermost where the domain is an annulus (inner) and, per ring,
    the angle nodes aedge next to an angular edge."""
    e = 0.0
    for i in range(n - N, n):
        e += (wt[0, i] + wt[1, i]) + (wt[2, i] + wt[3, i])
    if inner:
        for i in range(N):
            e += (wt[0, i] + wt[1, i]) + (wt[2, i] + wt[3, i])
    for j in range(n // N):
        for i in aedge:
            k = j * N + i
            e += (wt[0, k] + wt[1, k]) + (wt[2, k] + wt[3, k])
    return e


@njit(cache=True, error_model="numpy")
def _mapped_sums(U, W, J, L, NT, omega, Vinv, logdet_V, table, N, inner, aedge, g_out, dg_out, extra):
    """From the log weights L (finite; overwritten) of the four sign pairs at the nodes U, W
    (node weights J, zero off the domain): log-sum-exp (shift 0, else the maximum over the
    nodes with J > 0) and the moment sums (``_table_moments`` where ``table``, else
    ``_polar_moments``) -> g_out, dg_out, log Z; extra[3] = the share of the weight on the
    domain's edge (``_edge_weight``; N angle nodes per radius)."""
    o00 = omega[0, 0]
    o01 = omega[0, 1]
    o10 = omega[1, 0]
    o11 = omega[1, 1]
    acc = np.zeros(16)
    const = -0.5 * T * (logdet_V + 2.0 * math.log(2.0 * math.pi))
    shift = 0.0
    for attempt in range(2):
        _sign_pair_weights(L, J, NT, shift)
        if table:
            _table_moments(L, U, W, o00, o01, o10, o11, NT, acc)
        else:
            _polar_moments(L, U, W, o00, o01, o10, o11, NT, acc)
        if acc[0] >= SHIFT0_MIN_S0 or attempt == 1:
            break
        # the weights fell out of the double range: the log weights again, shifted by their maximum
        _polar_log_weights(U, W, o00, o01, o10, o11, Vinv[0, 0], Vinv[0, 1], Vinv[1, 1], NT, L)
        shift = _max_log_weight(L, J, np.empty(NT), NT)
        if not shift > -1e308:  # no node has weight
            shift = -math.inf
            break
        acc[:] = 0.0
    extra[3] = _edge_weight(L, NT, N, inner, aedge) / acc[0] if acc[0] > 0.0 else 0.0
    return _finish_acc(shift + const, acc, Vinv, g_out, dg_out, extra)


# node tables: the full-disk radius is rounded up to 2^(k / POLAR_GRID), so that the samples of a
# batch share a few node sets; a table holds U (2 rows), A = M(u)^{-1} (T x T, row-major: the
# solved row is w = A h when POLAR_LINEAR_OBS) and the node weight times 1/|det M|
POLAR_GRID = 8
POLAR_TABLE_ROWS = 3 + T * T


@njit(cache=True)
def _grid_index(R):
    """k with R <= 2^(k / POLAR_GRID) < 2^(1 / POLAR_GRID) R."""
    return int(math.ceil(POLAR_GRID * math.log2(R)))


@njit(cache=True)
def _grid_value(k):
    """The grid radius 2^(k / POLAR_GRID)."""
    return 2.0 ** (k / POLAR_GRID)


@njit(cache=True)
def _grid_radius(R):
    """R rounded up to the grid 2^(k / POLAR_GRID) (at most 9 % larger: the radial rule is
    logarithmic, so this barely moves it, and samples then share node tables)."""
    return _grid_value(_grid_index(R))


@njit(cache=True)
def polar_table_nodes(na, nr):
    """Number of nodes of a node table (plain full disk) of the rule (na, nr)."""
    pa, pb, pea, peb = _disk_pieces(0.0, math.pi)
    return pa.shape[0] * 2 * na * nr


NO_TABLE = -(2**62)


@njit(cache=True)
def polar_table_keys(omega, V, dom, skip_gh, out):
    """Per sample (V leading size 1 or N; dom per sample), the grid index k of its node table (radius
    2^(k / POLAR_GRID), ``_grid_radius``) where the mapped rule's domain is the plain full disk
    (no cut around arg c, see ``_polar_pieces``), else NO_TABLE; NO_TABLE also where the
    Gauss-Hermite path is tried first (skip_gh and ``gh_plausible``)."""
    shared = V.shape[0] == 1
    for i in range(omega.shape[0]):
        Vi = V[0] if shared else V[i]
        mu, su, phi, r_lo, off = _polar_domain(dom[i])
        plain = r_lo <= 0.0 and not off and su > 0.0 and not (skip_gh and gh_plausible(omega[i], Vi))
        out[i] = _grid_index(polar_radius(dom[i])) if plain else NO_TABLE


@njit(cache=True)
def polar_table_lookup(key, cached, slot, gidx):
    """gidx[i] = the slot of key[i] among the sorted cached keys (slot: their slots), -1 for
    NO_TABLE, -2 where the key is not cached; returns the number of -2 entries."""
    missing = 0
    nc = cached.shape[0]
    for i in range(key.shape[0]):
        q = key[i]
        if q == NO_TABLE:
            gidx[i] = -1
            continue
        j = np.searchsorted(cached, q)
        if j < nc and cached[j] == q:
            gidx[i] = slot[j]
        else:
            gidx[i] = -2
            missing += 1
    return missing


@njit(cache=True, parallel=True, error_model="numpy")
def polar_tables(keys, params, xa, wa, xr, wr, kappa, crad, G):
    """G[k]: node table of the mapped rule on the plain full disk of radius 2^(keys[k] / POLAR_GRID)
    (``polar_table_keys``; rows: U (2),
    A = M(u)^{-1} at 2 + t T + j, the node weight times 1/|det M|; A and the weight are zero
    where det M = 0). A's column j is polar_rows at the observation e_j, masked as in the
    per-sample kernel (``_polar_node_weights``)."""
    beta = abs(polar_beta(params))
    pa, pb, pea, peb = _disk_pieces(0.0, math.pi)
    for k in prange(keys.shape[0]):
        U, wpsi, _ = _mapped_nodes(_grid_value(keys[k]), 0.0, crad, pa, pb, pea, peb, beta, xa, wa, xr, wr, kappa)
        NT = U.shape[1]
        W = np.empty((T, NT))
        J = np.empty(NT)
        E = np.empty((POLAR_ROWS, NT))
        e = np.zeros(T)
        Gk = G[k]
        for i in range(NT):
            Gk[0, i] = U[0, i]
            Gk[1, i] = U[1, i]
        for j in range(T):
            e[:] = 0.0
            e[j] = 1.0
            polar_rows(U, NT, e, params, W, J, E)
            _polar_node_weights(W, J, wpsi, NT)  # column zero and J <- wpsi J (0) where det M = 0
            for t in range(T):
                for i in range(NT):
                    Gk[2 + t * T + j, i] = W[t, i]
        for i in range(NT):  # (J does not depend on the observation)
            Gk[POLAR_TABLE_ROWS - 1, i] = J[i]


@njit(cache=True, error_model="numpy")
def denoise_one_polar_table(obs, omega, V, Gk, nr, g_out, dg_out, extra):
    """``denoise_one_polar_mapped`` from a node table (``polar_tables``): the solved rows are
    w = A h, so a sample costs only its weights and moment sums (the node geometry and
    ``polar_rows``, about half the work, are shared by the batch). Equal to the per-sample
    kernel up to rounding (tests)."""
    Vinv = np.empty((2, 2))
    logdet_V = _precision(V, Vinv)
    if logdet_V != logdet_V:
        return STATUS_BAD_V
    NT = Gk.shape[1]
    W = np.empty((2, NT))
    L = np.empty((4, NT))
    nan = _table_log_weights(Gk, obs[0], obs[1], omega[0, 0], omega[0, 1], omega[1, 0], omega[1, 1], Vinv[0, 0],
                             Vinv[0, 1], Vinv[1, 1], NT, W, L)
    if nan != nan:
        return STATUS_NOT_FINITE
    return _mapped_sums(Gk[0:2], W, Gk[POLAR_TABLE_ROWS - 1], L, NT, omega, Vinv, logdet_V, True, NT // nr, False,
                        np.empty(0, dtype=np.int64), g_out, dg_out, extra)  # (the plain disk: no angular edge)


@njit(cache=True, fastmath={"contract", "reassoc"})
def _table_log_weights(Gk, h0, h1, o00, o01, o10, o11, p00, p01, p11, n, W, L):
    """W = A h (T = 2) and the log weights of ``_polar_log_weights`` at the table's nodes i < n,
    in one pass. Returns the sum of L: NaN iff an entry is NaN."""
    nan = 0.0
    for i in range(n):
        u0 = Gk[0, i]
        u1 = Gk[1, i]
        w0 = Gk[2, i] * h0 + Gk[3, i] * h1
        w1 = Gk[4, i] * h0 + Gk[5, i] * h1
        W[0, i] = w0
        W[1, i] = w1
        l0, l1, l2, l3 = _sign_pair_log_weights(u0, u1, w0, w1, o00, o01, o10, o11, p00, p01, p11)
        L[0, i] = l0
        L[1, i] = l1
        L[2, i] = l2
        L[3, i] = l3
        nan += (l0 + l1) + (l2 + l3)
    return nan


@njit(cache=True, fastmath={"contract"})
def _gh_nodes(m0, m1, l00, l10, l11, X, lw_rule, logdet_L, n, U, cst):
    """Nodes u = m + L xi of a branch's Gauss-Hermite rule (X: (n, 2) standard-normal nodes)
    and the per-node constant of the log weight, log w_rule + log det L + |xi|^2 / 2."""
    for i in range(n):
        x0 = X[i, 0]
        x1 = X[i, 1]
        U[0, i] = m0 + l00 * x0
        U[1, i] = m1 + l10 * x0 + l11 * x1
        cst[i] = lw_rule[i] + logdet_L + 0.5 * (x0 * x0 + x1 * x1)


@njit(cache=True, error_model="numpy")
def _gh_log_weights(U, W, sg, o00, o01, o10, o11, p00, p01, p11, cst, J, n, L, tmp):
    """L[i]: log weight of node i < n on the branch with solved row sg * W (up to the
    constant); tmp[i] = L[i] where J[i] > 0, else -1e308 (for the maximum)."""
    for i in range(n):
        d0 = U[0, i] - o00
        d1 = U[1, i] - o01
        e0 = sg * W[0, i] - o10
        e1 = sg * W[1, i] - o11
        li = cst[i] - 0.5 * (p00 * (d0 * d0 + d1 * d1) + p11 * (e0 * e0 + e1 * e1)) - p01 * (d0 * e0 + d1 * e1)
        L[i] = li
        tmp[i] = li if J[i] > 0.0 else -1e308


@njit(cache=True, fastmath={"contract", "reassoc"})
def _gh_moments(wt, J, U, W, sg, o00, o01, o10, o11, n, acc):
    """acc = the sums of one branch (weights J * wt, solved row sg * W): S0, sum w^2, first
    moments of z - omega (index k * T + t) and second moments (lower triangle), as in
    ``_polar_moments``."""
    s0 = 0.0
    sw2 = 0.0
    m0 = 0.0
    m1 = 0.0
    m2 = 0.0
    m3 = 0.0
    c00 = 0.0
    c10 = 0.0
    c11 = 0.0
    c20 = 0.0
    c21 = 0.0
    c22 = 0.0
    c30 = 0.0
    c31 = 0.0
    c32 = 0.0
    c33 = 0.0
    for i in range(n):
        w = J[i] * wt[i]
        d0 = U[0, i] - o00
        d1 = U[1, i] - o01
        e0 = sg * W[0, i] - o10
        e1 = sg * W[1, i] - o11
        s0 += w
        sw2 += w * w
        wd0 = w * d0
        wd1 = w * d1
        we0 = w * e0
        we1 = w * e1
        m0 += wd0
        m1 += wd1
        m2 += we0
        m3 += we1
        c00 += wd0 * d0
        c10 += wd1 * d0
        c11 += wd1 * d1
        c20 += we0 * d0
        c21 += we0 * d1
        c22 += we0 * e0
        c30 += we1 * d0
        c31 += we1 * d1
        c32 += we1 * e0
        c33 += we1 * e1
    acc[0] = s0
    acc[1] = sw2
    acc[2] = m0
    acc[3] = m1
    acc[4] = m2
    acc[5] = m3
    acc[6] = c00
    acc[7] = c10
    acc[8] = c11
    acc[9] = c20
    acc[10] = c21
    acc[11] = c22
    acc[12] = c30
    acc[13] = c31
    acc[14] = c32
    acc[15] = c33


@njit(cache=True, error_model="numpy")
def _gh_branch(X, lw_rule, n, m0, m1, l00, l10, l11, sg, obs, params, o00, o01, o10, o11, p00, p01, p11,
               U, W, J, E, L, wt, tmp, cst, ones, acc):
    """One branch (solved row sg * w(u)) of the adaptive Gauss-Hermite rule for polar models,
    all nodes at once in SIMD loops: acc (16) its sums scaled by exp(-M); returns M (the
    maximum log weight; -1e308 if no node has weight, nan if a log weight is not finite)."""
    logdet_L = math.log(l00) + math.log(l11)
    _gh_nodes(m0, m1, l00, l10, l11, X, lw_rule, logdet_L, n, U, cst)
    polar_rows(U, n, obs, params, W, J, E)
    _polar_node_weights(W, J, ones, n)
    _gh_log_weights(U, W, sg, o00, o01, o10, o11, p00, p01, p11, cst, J, n, L, tmp)
    s = 0.0
    for i in range(n):
        s += L[i]
    if s != s:
        return math.nan
    M = _running_max(tmp, n)
    if M > -1e308:
        _vexp_to(L, wt, n, M)
        _gh_moments(wt, J, U, W, sg, o00, o01, o10, o11, n, acc)
    else:
        acc[:] = 0.0
    return M


@njit(cache=True, error_model="numpy")
def denoise_one_gh_polar(obs, omega, V, params, nodes, log_w, nodes_c, log_w_c, n_adapt, inflate, g_out, dg_out,
                         extra):
    """``denoise_one`` for the polar models (two free indices u = z_1, two branches +-w(u)):
    the same adaptive Gauss-Hermite rule (passes on nodes_c re-centre each branch's rule on
    its posterior mean and covariance, times inflate; the final pass on nodes), with the nodes
    of a branch processed at once through ``polar_rows`` and SIMD loops (tests: equal to
    ``denoise_one``)."""
    nt = T
    Vinv = np.empty((2, 2))
    logdet_V = _precision(V, Vinv)
    if logdet_V != logdet_V:
        return STATUS_BAD_V
    p00 = Vinv[0, 0]
    p01 = Vinv[0, 1]
    p11 = Vinv[1, 1]
    o00 = omega[0, 0]
    o01 = omega[0, 1]
    o10 = omega[1, 0]
    o11 = omega[1, 1]
    v0 = V[0, 0]
    if not (v0 > 0.0):
        return STATUS_BAD_V
    nmax = max(nodes.shape[0], nodes_c.shape[0])
    U = np.empty((2, nmax))
    W = np.empty((2, nmax))
    E = np.empty((POLAR_ROWS, nmax))
    buf = np.empty((6, nmax))
    J, L, wt, tmp, cst, ones = buf[0], buf[1], buf[2], buf[3], buf[4], buf[5]
    ones[:] = 1.0
    # proposal per branch: the prior marginal of u (independent across tokens, variance V_00)
    prop = np.empty((2, 5))  # m0, m1, l00, l10, l11
    for b in range(2):
        prop[b, 0] = o00
        prop[b, 1] = o01
        prop[b, 2] = math.sqrt(v0)
        prop[b, 3] = 0.0
        prop[b, 4] = math.sqrt(v0)
    accb = np.zeros((2, 16))
    Mb = np.empty(2)
    Cb = np.empty((2, 2))
    Lc = np.empty((2, 2))
    for it in range(n_adapt + 1):
        final = it == n_adapt
        X = nodes if final else nodes_c
        lw = log_w if final else log_w_c
        n = X.shape[0]
        for b in range(2):
            Mb[b] = _gh_branch(X, lw, n, prop[b, 0], prop[b, 1], prop[b, 2], prop[b, 3], prop[b, 4],
                               1.0 if b == 0 else -1.0, obs, params, o00, o01, o10, o11, p00, p01, p11,
                               U, W, J, E, L, wt, tmp, cst, ones, accb[b])
            if Mb[b] != Mb[b]:
                return STATUS_NOT_FINITE
        if final:
            break
        for b in range(2):  # re-centre on the branch posterior of u (moments of u - omega_u)
            a = accb[b]
            if not (a[0] > 0.0):
                continue
            mu0 = a[2] / a[0]
            mu1 = a[3] / a[0]
            Cb[0, 0] = inflate * (a[6] / a[0] - mu0 * mu0) + 1e-13 * (1.0 + v0)
            Cb[1, 0] = Cb[0, 1] = inflate * (a[7] / a[0] - mu1 * mu0)
            Cb[1, 1] = inflate * (a[8] / a[0] - mu1 * mu1) + 1e-13 * (1.0 + v0)
            prop[b, 0] = o00 + mu0
            prop[b, 1] = o01 + mu1
            if _cholesky(Cb, Lc):  # (as denoise_one: the factor is kept where Cb is not PD)
                prop[b, 2] = Lc[0, 0]
                prop[b, 3] = Lc[1, 0]
                prop[b, 4] = Lc[1, 1]
    M = max(Mb[0], Mb[1])
    acc = np.zeros(16)
    if M > -1e308:
        for b in range(2):
            if Mb[b] > -1e308:
                f = math.exp(Mb[b] - M)
                for q in range(16):
                    acc[q] += (f * f if q == 1 else f) * accb[b, q]
    else:
        M = -math.inf
    # log prior normalisation, plus the standard-normal density of the rule (D = 2)
    const = -0.5 * nt * (logdet_V + 2.0 * math.log(2.0 * math.pi)) + math.log(2.0 * math.pi)
    return _finish_acc(M + const, acc, Vinv, g_out, dg_out, extra)


@njit(cache=True)
def gh_plausible(omega, V):
    """Cheap screen for the Gauss-Hermite path of polar models: the prior of u is narrow next to
    the width ~1/|u| of the first layer's attention switch, so the reduced integrand is smooth on
    the posterior's scale (the result is still checked against a smaller rule)."""
    s = math.sqrt(max(V[FREE_K[0], FREE_K[0]], V[FREE_K[1], FREE_K[1]]))
    m = math.sqrt(omega[FREE_K[0], FREE_T[0]] ** 2 + omega[FREE_K[1], FREE_T[1]] ** 2)
    return s * (m + 5.0 * s) <= 1.0


@njit(cache=True)
def _rel_diff(g1, dg1, e1, g2, dg2, e2):
    """Largest difference of two results: g_out and dg_out relative to their size (at least 1),
    log Z absolute."""
    gs = 1.0
    for v in g1.ravel():
        gs = max(gs, abs(v))
    ds = 1.0
    for v in dg1.ravel():
        ds = max(ds, abs(v))
    d = abs(e1[0] - e2[0])
    a = g1.ravel()
    b = g2.ravel()
    for i in range(a.shape[0]):
        d = max(d, abs(a[i] - b[i]) / gs)
    a = dg1.ravel()
    b = dg2.ravel()
    for i in range(a.shape[0]):
        d = max(d, abs(a[i] - b[i]) / ds)
    return d if d == d else math.inf


@njit(cache=True, parallel=True)
def denoise_batch(obs, omega, V, params, nodes, log_w, nodes_c, log_w_c, n_adapt, inflate,
                  pc, ps, plw, rr, w_r, dom, mapped, xa, wa, kappa, crad, nodes_k, log_w_k, check_tol,
                  G, gidx, g_out, dg_out, extra, status):
    """Batch over the leading axis; V has leading size 1 (shared) or N.

    Models with POLAR_ANGLES (and a polar rule given, rr non-empty): where ``gh_plausible``,
    the adaptive Gauss-Hermite rule is tried first and kept if it agrees with the smaller rule
    (nodes_k) to check_tol (extra[i, 2] = that difference, else NaN); otherwise, and everywhere
    else, the polar rule. extra[i, 1] is the effective number of nodes, negative where the polar
    rule was used. Gauss-Hermite on polar models runs ``denoise_one_gh_polar`` (SIMD). The mapped
    rule reads the node table G[gidx[i]] (``polar_tables``) where gidx[i] >= 0. dom[i]: the polar
    domain (``polar_radius``); extra[i, 3]: the polar rule's weight share on the domain's
    edge (0 on the other paths)."""
    n = omega.shape[0]
    shared = V.shape[0] == 1
    use_polar = rr.shape[0] > 0  # a polar rule was given (HAS_POLAR: the model has one)
    for i in prange(n):
        Vi = V[0] if shared else V[i]
        extra[i, 2] = math.nan
        extra[i, 3] = 0.0
        if HAS_POLAR and use_polar:  # (HAS_POLAR is a constant: numba prunes the branch)
            if nodes_k.shape[0] > 0 and gh_plausible(omega[i], Vi):
                st = denoise_one_gh_polar(obs[i], omega[i], Vi, params, nodes, log_w, nodes_c, log_w_c, n_adapt,
                                          inflate, g_out[i], dg_out[i], extra[i])
                if st == STATUS_OK:
                    g2 = np.empty_like(g_out[i])
                    dg2 = np.empty_like(dg_out[i])
                    e2 = np.empty(3)
                    st2 = denoise_one_gh_polar(obs[i], omega[i], Vi, params, nodes_k, log_w_k, nodes_c, log_w_c,
                                               n_adapt, inflate, g2, dg2, e2)
                    if st2 == STATUS_OK:
                        d = _rel_diff(g_out[i], dg_out[i], extra[i], g2, dg2, e2)
                        if d <= check_tol:
                            extra[i, 2] = d
                            status[i] = STATUS_OK
                            continue
            if mapped and gidx[i] >= 0:
                status[i] = denoise_one_polar_table(obs[i], omega[i], Vi, G[gidx[i]], rr.shape[0], g_out[i], dg_out[i],
                                                    extra[i])
            elif mapped:
                status[i] = denoise_one_polar_mapped(obs[i], omega[i], Vi, params, xa, wa, rr, w_r, dom[i], kappa, crad,
                                                     g_out[i], dg_out[i], extra[i])
            else:
                status[i] = denoise_one_polar(obs[i], omega[i], Vi, params, pc, ps, plw, rr, w_r, dom[i],
                                              g_out[i], dg_out[i], extra[i])
            extra[i, 1] = -extra[i, 1]  # negative ess marks the polar rule
            continue
        if HAS_POLAR:  # Gauss-Hermite only (an explicit node count): the SIMD kernel, equal to denoise_one
            status[i] = denoise_one_gh_polar(obs[i], omega[i], Vi, params, nodes, log_w, nodes_c, log_w_c, n_adapt,
                                             inflate, g_out[i], dg_out[i], extra[i])
            continue
        status[i] = denoise_one(obs[i], omega[i], Vi, params, nodes, log_w, nodes_c, log_w_c, n_adapt, inflate,
                                g_out[i], dg_out[i], extra[i])


@njit(cache=True, parallel=True)
def observe_batch(y, params, obs, status):
    """Observed reduced quantity per sample: h from y (attention) or y itself (flattened)."""
    n = y.shape[0]
    beta = last_beta(params)
    for i in prange(n):
        if OBS_KIND == "h":
            status[i] = h_from_y(y[i], beta, obs[i])
        else:
            k = 0
            for a in range(y.shape[1]):
                for b in range(y.shape[2]):
                    obs[i, k] = y[i, a, b]
                    k += 1
            status[i] = STATUS_OK


@njit(cache=True, parallel=True)
def link_batch(Z, params, out):
    for i in prange(Z.shape[0]):
        link(Z[i], params, out[i])


@njit(cache=True, parallel=True)
def link_jacobian_batch(Z, params, out):
    for i in prange(Z.shape[0]):
        link_jacobian(Z[i], params, out[i])
