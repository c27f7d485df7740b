"""Batch driver of the hardmax-last-layer denoiser (reduction kind ``hardmax-wedge-mixed``)
and of one hardmax layer (kind ``hardmax-wedge``: ``hm_one_layer_batch``, no mixing),
hand-written once and appended verbatim (below the marker) to the generated module of such
models, after the common driver, so that numba caches it with the model's ``mixing`` kernel.

It relies on the generated ``mixing(u, params, M)`` (the first layer's mixing matrix
M_1(u) = c I + S_1(u) at u = z_1). This file is not imported by the package; it only has to be
valid Python so that linters and the generator can read it. The Python side (input checks,
rules, output) is :mod:`aimsym.denoise.hardmax_channel`.
"""

import math  # noqa: F401  (names below are resolved in the generated module)

import numpy as np  # noqa: F401
from numba import njit, prange  # noqa: F401


def mixing(u, params, M):  # placeholder: the generated kernel of the same name is used
    raise NotImplementedError


# ---- template begins ----
# ============================================================================
# Hardmax last layer after a tied rank-one first layer, T = 2
# (aimsym/denoise/hardmax_template.py, appended to modules of kinds hardmax-wedge-mixed and
# hardmax-wedge; the latter use only the wedge integrals, without mixing)
# ============================================================================
#
# Z = [[u_1, u_2], [w_1, w_2]]: u = z_1 (first layer), w = z_2 (last layer). The last layer sees
# v = M_1(u) w and y = hardmax(beta v v^T) says which of the six wedges of the v-plane cut by
# v_1 = 0, v_2 = 0, v_1 = v_2 contains v. Given u, w ~ N(m(u), s^2 I) (the conditional of the
# prior per token, isotropic since tokens are independent), and w must lie in the wedges
# M_1(u)^{-1} W_y. On a wedge, in polar coordinates w = s rho e(theta), the radial integrals
# of rho^k N are closed forms (erfc, or a continued fraction in the far tail); the angle is
# integrated by Gauss-Legendre on pieces graded geometrically away from the angle where the
# integrand peaks (its width is 1/|m/s|). The outer integral over u is a polar rule around
# the origin, split on the lines u_1 = 0, u_2 = 0, u_1 = u_2 where the first layer's attention
# switches, Gauss-Legendre in angle and radius on the disk (or annular sector) holding the
# prior of u to HM_K standard deviations. Sums are streamed with a running maximum.

HM_K = 9.0  # half-width of the u-domain in prior standard deviations
HM_BUMP = 3.0  # the outer rule is also cut this many prior sd around an off-centre prior bump
HM_TAIL = -3.0  # below this a = m.e/s the radial moments use a continued fraction
HM_MAX_PIECES = 48  # per graded half-interval (doubling pieces: never reached in practice)
HM_LOG_2PI = math.log(2.0 * math.pi)
# edges of the six wedges of the v-plane cut by v_1 = 0, v_2 = 0, v_1 = v_2
HM_EDGES = np.array([0.0, 1.0, 2.0, 4.0, 5.0, 6.0, 8.0]) * (0.25 * math.pi)


@njit(cache=True)
def hm_radial(a, out):
    """Radial moments of the unit-variance Gaussian along a ray: with
    K_k(a) = int_0^inf rho^k exp(-rho^2/2 + a rho) d rho, writes out[0] = log(e^{-a^2/2} K_1)
    and the moments of t = rho - a under rho K_1^{-1} e^{-rho^2/2 + a rho}: out[1] = E[t],
    out[2] = E[t^2] (centred on the ray's peak: no cancellation when a is large; stable for
    any a)."""
    if a >= 0.0:
        # int_{-a}^inf (t + a) t^k e^{-t^2/2} dt: E + a Pn, Pn, 2 E + a Pn (k = 0, 1, 2)
        E = math.exp(-0.5 * a * a)
        Pn = math.sqrt(2.0 * math.pi) * 0.5 * math.erfc(-a / math.sqrt(2.0))  # sqrt(2 pi) Phi(a)
        J1 = E + a * Pn
        out[0] = math.log(J1)
        out[1] = Pn / J1
        out[2] = (2.0 * E + a * Pn) / J1
        return
    if a >= HM_TAIL:
        m = math.sqrt(0.5 * math.pi) * math.erfc(-a / math.sqrt(2.0)) * math.exp(0.5 * a * a)  # K_0
        K1 = 1.0 + a * m
        K2 = a + (1.0 + a * a) * m
        K3 = a * a + 2.0 + (a * a * a + 3.0 * a) * m
    else:
        # x = -a > 3: the recurrences K_1 = 1 + a K_0, K_2 = a K_1 + K_0, K_3 = a K_2 + 2 K_1
        # cancel; with the continued fraction C_n = n / (x + C_{n+1}) of the Mills ratio
        # K_0 = 1 / (x + C_1) they read K_k = K_0 C_1 ... C_k (no cancellation; depth 80 gives
        # 1e-16 for x >= 3, 40 for x >= 5)
        x = -a
        c = 0.0
        c1 = 0.0
        c2 = 0.0
        c3 = 0.0
        depth = 80 if x < 5.0 else 40
        for n in range(depth, 0, -1):
            c = n / (x + c)
            if n == 3:
                c3 = c
            elif n == 2:
                c2 = c
            elif n == 1:
                c1 = c
        K0 = 1.0 / (x + c1)
        K1 = K0 * c1
        K2 = K1 * c2
        K3 = K2 * c3
    out[0] = -0.5 * a * a + math.log(K1)
    # a < 0: every term below is positive
    out[1] = K2 / K1 - a
    out[2] = K3 / K1 - 2.0 * a * (K2 / K1) + a * a


@njit(cache=True)
def hm_scale(R, psi):
    """Angular width of the wedge integrand near psi (angle from the direction of m): the
    log-integrand behaves like -R^2 sin^2(psi) / 2 on the near side (width 1 / R at the peak,
    1 / (R^2 sin cos) on its flanks); the radial factor K_1(a), a = R cos(psi), switches from
    Gaussian growth to a^{-2} decay on the scale |da| ~ 1 + |a|, i.e. 1 / R in angle at a = 0."""
    c = math.cos(psi)
    a = R * c
    lam = max(1.0, R / (1.0 + abs(a)))
    if c > 0.0:
        lam = max(lam, a, R * R * abs(math.sin(psi)) * c)
    return 1.0 / lam


@njit(cache=True)
def hm_piece(mu0, mu1, lo, hi, phi, gx, gw, acc, rad):
    """Gauss-Legendre on the angle piece [lo, hi] (angles relative to phi, the direction of
    mu): adds exp(log-integrand - acc[0]) times (1, E[d], E[d d^T]) to acc[1:7], d = x - mu
    the offset from the Gaussian's centre (small where the weight is: no cancellation far
    from the origin), rescaling the running maximum acc[0]."""
    half = 0.5 * (hi - lo)
    mid = 0.5 * (hi + lo)
    for i in range(gx.shape[0]):
        th = phi + mid + half * gx[i]
        c = math.cos(th)
        s = math.sin(th)
        a = mu0 * c + mu1 * s
        b = -mu0 * s + mu1 * c
        hm_radial(a, rad)
        L = -0.5 * b * b + rad[0] + math.log(half * gw[i])
        if L > acc[0]:
            if acc[0] > -math.inf:
                f = math.exp(acc[0] - L)
                for k in range(1, 7):
                    acc[k] *= f
            acc[0] = L
        wt = math.exp(L - acc[0])
        # d = x - mu = t e - b e_perp, e = (c, s), e_perp = (-s, c), t = rho - a
        t1 = rad[1]
        t2 = rad[2]
        acc[1] += wt
        acc[2] += wt * (t1 * c + b * s)
        acc[3] += wt * (t1 * s - b * c)
        acc[4] += wt * (t2 * c * c + 2.0 * b * t1 * c * s + b * b * s * s)
        acc[5] += wt * (t2 * c * s + b * t1 * (s * s - c * c) - b * b * c * s)
        acc[6] += wt * (t2 * s * s - 2.0 * b * t1 * c * s + b * b * c * c)


@njit(cache=True)
def hm_graded(mu0, mu1, R, phi, start, stop, gx, gw, acc, rad):
    """[start, stop] (either order) in doubling pieces away from ``start``, where the
    integrand is largest."""
    h = hm_scale(R, start)
    sgn = 1.0 if stop >= start else -1.0
    length = abs(stop - start)
    x = 0.0
    for piece in range(HM_MAX_PIECES):
        nxt = length if (piece == HM_MAX_PIECES - 1 or x + h >= length) else x + h
        a0 = start + sgn * x
        a1 = start + sgn * nxt
        hm_piece(mu0, mu1, min(a0, a1), max(a0, a1), phi, gx, gw, acc, rad)
        if nxt >= length:
            break
        x = nxt
        h *= 2.0


@njit(cache=True)
def hm_wedge(mu0, mu1, th0, th1, gx, gw, acc, rad):
    """Integral of N(x; mu, I) (times 1, x, x x^T) over the wedge of angles [th0, th1]
    (th0 < th1 < th0 + pi), accumulated into acc (see hm_piece; the log of 2 pi is left out)."""
    R = math.sqrt(mu0 * mu0 + mu1 * mu1)
    phi = math.atan2(mu1, mu0)
    # angles relative to phi, with the start in (-pi, pi]
    p0 = th0 - phi
    p0 = p0 - 2.0 * math.pi * math.floor((p0 + math.pi) / (2.0 * math.pi))
    p1 = p0 + (th1 - th0)
    if p0 < 0.0 < p1:  # the peak (psi = 0) inside: graded outwards from it
        hm_graded(mu0, mu1, R, phi, 0.0, p0, gx, gw, acc, rad)
        hm_graded(mu0, mu1, R, phi, 0.0, p1, gx, gw, acc, rad)
    elif p0 < math.pi < p1:  # the minimum (psi = pi) inside: graded from both ends
        hm_graded(mu0, mu1, R, phi, p0, math.pi, gx, gw, acc, rad)
        hm_graded(mu0, mu1, R, phi, p1, math.pi, gx, gw, acc, rad)
    elif p1 <= 0.0 or p0 >= math.pi:  # increasing on [p0, p1] (towards 0 or 2 pi): graded from p1
        hm_graded(mu0, mu1, R, phi, p1, p0, gx, gw, acc, rad)
    else:  # decreasing on [p0, p1] (within [0, pi])
        hm_graded(mu0, mu1, R, phi, p0, p1, gx, gw, acc, rad)


@njit(cache=True)
def hm_masked(mu0, mu1, i00, i01, i10, i11, det, mask, gx, gw, acc, rad):
    """Accumulates into acc (see hm_piece) the wedges of the v-plane selected by mask, mapped
    back to the w-plane by the inverse (i00, i01; i10, i11) of the mixing matrix (of
    determinant det), for w ~ N(mu, I)."""
    acc[0] = -math.inf
    for k in range(1, 7):
        acc[k] = 0.0
    for k in range(6):
        if not mask[k]:
            continue
        a0 = HM_EDGES[k]
        a1 = HM_EDGES[k + 1]
        # the v-rays mapped back to the w-plane
        c0 = math.cos(a0)
        s0 = math.sin(a0)
        c1 = math.cos(a1)
        s1 = math.sin(a1)
        t0 = math.atan2(i10 * c0 + i11 * s0, i00 * c0 + i01 * s0)
        t1 = math.atan2(i10 * c1 + i11 * s1, i00 * c1 + i01 * s1)
        if det < 0.0:  # orientation reversed
            t0, t1 = t1, t0
        span = t1 - t0
        span = span - 2.0 * math.pi * math.floor(span / (2.0 * math.pi))
        if span <= 0.0:
            continue
        hm_wedge(mu0, mu1, t0, t0 + span, gx, gw, acc, rad)


@njit(cache=True)
def hm_moments(acc, res):
    """res[0] = log P(region) (with the 2 pi restored), res[1:6] = the truncated moments of
    d = x - mu: E[d] (2) and E[d d^T] (00, 01, 11); False if the region has no weight."""
    if not (acc[1] > 0.0):
        return False
    res[0] = acc[0] + math.log(acc[1]) - HM_LOG_2PI
    for k in range(5):
        res[1 + k] = acc[2 + k] / acc[1]
    return True


@njit(cache=True)
def hm_region(u0, u1, mu0, mu1, mask, params, gx, gw, res, acc, rad, M, uu):
    """Given u: log P(w in the region of y | u) (res[0]) and, in units of s, the truncated
    moments E[rho e | u, y] (res[1:3]) and E[rho^2 e e^T | u, y] (res[3:6]: 00, 01, 11).
    Returns False if M_1(u) is singular or not finite (zero weight). uu, M: work arrays."""
    uu[0] = u0
    uu[1] = u1
    mixing(uu, params, M)
    det = M[0, 0] * M[1, 1] - M[0, 1] * M[1, 0]
    if not (det != 0.0 and math.isfinite(det)):
        return False
    hm_masked(mu0, mu1, M[1, 1] / det, -M[0, 1] / det, -M[1, 0] / det, M[0, 0] / det, det, mask, gx, gw, acc, rad)
    if not hm_moments(acc, res):
        return False
    # moments about the origin: x = mu + d
    d0 = res[1]
    d1 = res[2]
    res[1] = mu0 + d0
    res[2] = mu1 + d1
    res[3] += 2.0 * mu0 * d0 + mu0 * mu0
    res[4] += mu0 * d1 + mu1 * d0 + mu0 * mu1
    res[5] += 2.0 * mu1 * d1 + mu1 * mu1
    return True


@njit(cache=True, parallel=True)
def hm_one_layer_batch(mu, mask, gx, gw, res, status):
    """One hardmax layer (kind hardmax-wedge, no mixing): per sample, w ~ N(mu, I) restricted to
    the wedges in mask; res as in hm_moments (moments of x - mu), status 3 where the region has
    no weight."""
    for i in prange(mu.shape[0]):
        acc = np.empty(7)
        rad = np.empty(3)
        hm_masked(mu[i, 0], mu[i, 1], 1.0, 0.0, 0.0, 1.0, 1.0, mask[i], gx, gw, acc, rad)
        status[i] = 0 if hm_moments(acc, res[i]) else 3


@njit(cache=True)
def hm_sectors(omega, V, redges):
    """Outer polar rule for u: returns the angular piece edges (split on the lines where the
    first layer switches) and fills the radial piece edges ``redges`` (returns their count in
    redges[-1]). The domain holds the prior N(omega_u, V_uu I) to HM_K standard deviations:
    the disk around the origin, or an annular sector when omega_u is farther than that. When
    the prior bump is off-centre (|omega_u| > HM_BUMP sd) the pieces are also cut at
    HM_BUMP sd around it, in angle and radius."""
    sd = math.sqrt(V[0, 0])
    cu = math.sqrt(omega[0, 0] ** 2 + omega[0, 1] ** 2)
    phi = math.atan2(omega[0, 1], omega[0, 0])
    if cu > HM_K * sd:
        rlo = cu - HM_K * sd
        rhi = cu + HM_K * sd
        delta = math.asin(HM_K * sd / cu)
        start = phi - delta
        stop = phi + delta
    else:
        rlo = 0.0
        rhi = cu + HM_K * sd
        start = phi - math.pi
        stop = phi + math.pi
    nr = 0
    redges[nr] = rlo
    nr += 1
    cand = np.empty(8)
    nc = 0
    if cu > HM_BUMP * sd:
        cand[0] = cu - HM_BUMP * sd
        cand[1] = cu + HM_BUMP * sd
        nc = 2
    for k in range(nc):
        if rlo + 1e-12 < cand[k] < rhi - 1e-12:
            redges[nr] = cand[k]
            nr += 1
    redges[nr] = rhi
    nr += 1
    redges[redges.shape[0] - 1] = nr
    # lines u_1 = 0, u_2 = 0, u_1 = u_2: angles j pi/4, j in {0, 1, 2, 4, 5, 6} (+ 2 pi k)
    ang = np.empty(24)
    na = 0
    base = math.floor(start / (2.0 * math.pi)) * 2.0 * math.pi
    for rep in range(2):
        for j in (0, 1, 2, 4, 5, 6):
            a = base + rep * 2.0 * math.pi + j * 0.25 * math.pi
            if start + 1e-12 < a < stop - 1e-12:
                ang[na] = a
                na += 1
    if cu > HM_BUMP * sd:
        width = math.asin(min(1.0, HM_BUMP * sd / cu))
        for a in (phi - width, phi + width):
            if start + 1e-12 < a < stop - 1e-12:
                ang[na] = a
                na += 1
    ang = np.sort(ang[:na])
    edges = np.empty(na + 2)
    edges[0] = start
    edges[1:na + 1] = ang
    edges[na + 1] = stop
    return edges


@njit(cache=True)
def hm_add(lw, u0, u1, s, res, st, S1, S2, x):
    """Adds a u-node of log weight lw (prior, rule and log P(y | u)) and its conditional moments
    to the streamed sums: st = (running max, S0, sum of squared weights)."""
    if lw > st[0]:
        if st[0] > -math.inf:
            f = math.exp(st[0] - lw)
            st[1] *= f
            st[2] *= f * f
            for a in range(4):
                S1[a] *= f
                for b in range(4):
                    S2[a, b] *= f
        st[0] = lw
    wt = math.exp(lw - st[0])
    st[1] += wt
    st[2] += wt * wt
    x[0] = u0
    x[1] = u1
    x[2] = s * res[1]
    x[3] = s * res[2]
    for a in range(4):
        S1[a] += wt * x[a]
    for a in range(2):
        for b in range(4):
            S2[a, b] += wt * x[a] * x[b]  # u u^T and u E[w]^T: u is fixed at the node
        S2[2 + a, 0] += wt * x[2 + a] * x[0]
        S2[2 + a, 1] += wt * x[2 + a] * x[1]
    s2 = s * s
    S2[2, 2] += wt * s2 * res[3]
    S2[2, 3] += wt * s2 * res[4]
    S2[3, 2] += wt * s2 * res[4]
    S2[3, 3] += wt * s2 * res[5]


@njit(cache=True)
def hm_denoise_one(mask, omega, V, params, th, w_th, rr, w_r, gx, gw, g_out, dg_out, extra):
    """Posterior moments of Z for one sample; returns a status (0 ok, 1 bad V, 3 zero
    likelihood, 4 not finite). extra = (log_z_out, effective number of u-nodes)."""
    v00 = V[0, 0]
    v01 = V[0, 1]
    v11 = V[1, 1]
    detV = v00 * v11 - v01 * v01
    if not (v00 > 0.0 and v11 > 0.0 and detV > 0.0):
        return 1
    s2 = detV / v00  # conditional variance of w_t given u_t
    s = math.sqrt(s2)
    slope = v01 / v00
    redges = np.empty(5)
    edges = hm_sectors(omega, V, redges)
    n_rad = int(redges[4])
    res = np.empty(6)
    acc = np.empty(7)
    rad = np.empty(3)
    M = np.empty((2, 2))
    uu = np.empty(2)
    st = np.empty(3)
    st[0] = -math.inf
    st[1] = 0.0
    st[2] = 0.0
    S1 = np.zeros(4)
    S2 = np.zeros((4, 4))
    x = np.empty(4)
    log_norm_u = -math.log(2.0 * math.pi * v00)
    for p in range(edges.shape[0] - 1):
        ha = 0.5 * (edges[p + 1] - edges[p])
        ma = 0.5 * (edges[p + 1] + edges[p])
        for q in range(n_rad - 1):
            rlo = redges[q]
            rhi = redges[q + 1]
            for i in range(th.shape[0]):
                al = ma + ha * th[i]
                ca = math.cos(al)
                sa = math.sin(al)
                for j in range(rr.shape[0]):
                    r = 0.5 * (rhi + rlo) + 0.5 * (rhi - rlo) * rr[j]
                    if r <= 0.0:
                        continue
                    u0 = r * ca
                    u1 = r * sa
                    d0 = u0 - omega[0, 0]
                    d1 = u1 - omega[0, 1]
                    lw = (math.log(ha * w_th[i] * 0.5 * (rhi - rlo) * w_r[j] * r) + log_norm_u
                          - 0.5 * (d0 * d0 + d1 * d1) / v00)
                    m0 = omega[1, 0] + slope * d0
                    m1 = omega[1, 1] + slope * d1
                    if not hm_region(u0, u1, m0 / s, m1 / s, mask, params, gx, gw, res, acc, rad, M, uu):
                        continue
                    lw += res[0]
                    if lw == -math.inf:
                        continue
                    if not math.isfinite(lw):
                        return 4
                    hm_add(lw, u0, u1, s, res, st, S1, S2, x)
    gmax = st[0]
    S0 = st[1]
    Sw2 = st[2]
    if not (S0 > 0.0) or gmax == -math.inf:
        return 3
    # x = (u_1, u_2, w_1, w_2): Z[k, t] is x[2 k + t]
    mean = S1 / S0
    cov = S2 / S0
    for a in range(4):
        for b in range(4):
            cov[a, b] -= mean[a] * mean[b]
    Vi = np.empty((2, 2))
    Vi[0, 0] = v11 / detV
    Vi[1, 1] = v00 / detV
    Vi[0, 1] = -v01 / detV
    Vi[1, 0] = -v01 / detV
    for k in range(2):
        for t in range(2):
            acc_g = 0.0
            for kk in range(2):
                acc_g += Vi[k, kk] * (mean[2 * kk + t] - omega[kk, t])
            g_out[k, t] = acc_g
    for k in range(2):
        for t in range(2):
            for kk in range(2):
                for ss in range(2):
                    val = 0.0
                    for a in range(2):
                        for b in range(2):
                            val += Vi[k, a] * cov[2 * a + t, 2 * b + ss] * Vi[b, kk]
                    if t == ss:
                        val -= Vi[k, kk]
                    dg_out[k, t, kk, ss] = val
    extra[0] = gmax + math.log(S0)
    extra[1] = S0 * S0 / Sw2
    for k in range(2):
        for t in range(2):
            if not math.isfinite(g_out[k, t]):
                return 4
    return 0


@njit(cache=True, parallel=True)
def hm_denoise_batch(mask, omega, V, params, th, w_th, rr, w_r, gx, gw, g_out, dg_out, extra, status):
    """Batch over samples (prange). mask (n, 6): the v-wedges (edges 0, 1, 2, 4, 5, 6, 8 times
    pi/4) matching y; omega (n, 2, 2); V (1 or n, 2, 2)."""
    n = omega.shape[0]
    for i in prange(n):
        Vi = V[0] if V.shape[0] == 1 else V[i]
        status[i] = hm_denoise_one(mask[i], omega[i], Vi, params, th, w_th, rr, w_r, gx, gw,
                                   g_out[i], dg_out[i], extra[i])
