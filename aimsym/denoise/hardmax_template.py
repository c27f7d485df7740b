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
HM_CUT = 80.0  # a graded interval stops where its integrand is e^-HM_CUT below the largest node so far
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
    from the origin), rescaling the running maximum acc[0]. Returns the smallest log-integrand
    (without the rule weight) of its nodes."""
    half = 0.5 * (hi - lo)
    mid = 0.5 * (hi + lo)
    low = math.inf
    for i in range(gx.shape[0]):
        th = phi + mid + half * gx[i]
        c = math.cos(th)
        s = math.sin(th)
        a = mu0 * c + mu1 * s
        b = -mu0 * s + mu1 * c
        hm_radial(a, rad)
        L = -0.5 * b * b + rad[0]
        low = min(low, L)
        L += math.log(half * gw[i])
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
    return low


@njit(cache=True)
def hm_graded(mu0, mu1, R, phi, start, stop, gx, gw, acc, rad):
    """[start, stop] (either order) in doubling pieces away from ``start``, where the
    integrand is largest. The integrand (the Gaussian's mass along a ray) decreases away from
    ``start``, so once a piece's last node is e^-HM_CUT below the largest weight so far, the
    rest (at most 2 pi long) adds less than 1e-34 relative and is skipped."""
    h = hm_scale(R, start)
    sgn = 1.0 if stop >= start else -1.0
    length = abs(stop - start)
    x = 0.0
    for piece in range(HM_MAX_PIECES):
        nxt = length if (piece == HM_MAX_PIECES - 1 or x + h >= length) else x + h
        a0 = start + sgn * x
        a1 = start + sgn * nxt
        low = hm_piece(mu0, mu1, min(a0, a1), max(a0, a1), phi, gx, gw, acc, rad)
        if nxt >= length or low < acc[0] - HM_CUT:
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
def hm_inverse(V, Vi):
    """Fills Vi = V^{-1} (2 x 2) and returns det V; 0 if V is not positive definite."""
    detV = V[0, 0] * V[1, 1] - V[0, 1] * V[0, 1]
    if not (V[0, 0] > 0.0 and V[1, 1] > 0.0 and detV > 0.0):
        return 0.0
    Vi[0, 0] = V[1, 1] / detV
    Vi[1, 1] = V[0, 0] / detV
    Vi[0, 1] = -V[0, 1] / detV
    Vi[1, 0] = -V[0, 1] / detV
    return detV


@njit(cache=True)
def hm_to_g(Vi, x, g):
    """g[k, t] = sum_kk Vi[k, kk] x[2 kk + t] (x: moments of Z - omega, Z[k, t] = x[2 k + t])."""
    for k in range(2):
        for t in range(2):
            v = 0.0
            for kk in range(2):
                v += Vi[k, kk] * x[2 * kk + t]
            g[k, t] = v


@njit(cache=True)
def hm_to_dg(Vi, C, dg):
    """dg[k, t, kk, ss] = sum_ab Vi[k, a] C[2 a + t, 2 b + ss] Vi[b, kk] (C indexed as x)."""
    for k in range(2):
        for t in range(2):
            for kk in range(2):
                for ss in range(2):
                    v = 0.0
                    for a in range(2):
                        for b in range(2):
                            v += Vi[k, a] * C[2 * a + t, 2 * b + ss] * Vi[b, kk]
                    dg[k, t, kk, ss] = v


@njit(cache=True)
def hm_denoise_one(mask, omega, V, params, th, w_th, rr, w_r, gx, gw, g_out, dg_out, extra):
    """Posterior moments of Z for one sample; returns a status (0 ok, 1 bad V, 3 zero
    likelihood, 4 not finite). extra = (log_z_out, effective number of u-nodes)."""
    v00 = V[0, 0]
    v01 = V[0, 1]
    Vi = np.empty((2, 2))
    detV = hm_inverse(V, Vi)
    if detV == 0.0:
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
    for k in range(2):
        for t in range(2):
            mean[2 * k + t] -= omega[k, t]
    hm_to_g(Vi, mean, g_out)
    hm_to_dg(Vi, cov, dg_out)
    for k in range(2):
        for kk in range(2):
            for t in range(2):
                dg_out[k, t, kk, t] -= Vi[k, kk]
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


# ---- adaptive rule in u (used when a tolerance is given) ----
# Regions are rectangles in (angle, radius) of the outer polar pieces. Each carries a tensor
# Fejer-type-2 rule (open, nested: the coarse rule's nodes are the fine rule's odd nodes), so
# one set of evaluations gives the fine sums K, the coarse sums G (the region's outer error
# K - G), the coarse sums with the smaller wedge rule I (the inner error G - I), and the two
# mixed rules (fine in one direction, coarse in the other) that choose the direction of a
# split. The region with the largest contribution to the estimate is bisected until the
# estimate meets tol or the region budget is spent. Sums per region: S0, S1 (4), S2 (16),
# sum of squared weights, scaled by exp(-lm) (lm the region's largest log weight).
HM_NV = 22  # S0, S1 (4), S2 (16), sum of squared weights
# Steps of P(y | u): where the mean of v = M_1(u) w comes within a few sd of a line of the
# v-plane (v_1 = 0, v_2 = 0, v_1 = v_2), P(y | u) switches, over about one sd of that distance d.
# With the last layer nearly known the step is narrow in u and may fall between nodes (a band
# of positive P(y | u) can be missed by both rules). A region whose nodes' d for some line meet
# the band |d| < HM_BAND and span more than HM_RESOLVED sd is unresolved: its estimate is
# bounded by its prior mass (P(y | u) anywhere in [0, 1]) until bisection resolves it.
HM_BAND = 8.0
HM_RESOLVED = 8.0


@njit(cache=True)
def hm_node(al, r, omega, v00, slope, s, log_norm_u, mask, params, gx, gw, res, acc, rad, M, uu, vec, dd):
    """One u-node (angle al, radius r): returns its log weight without the rule weight (prior,
    Jacobian r and log P(y | u)); fills vec[0:21] with (1, x, x x^T | u), x = Z - omega (u and w
    about omega: no cancellation when the posterior is narrow far from the origin), dd[0:3] with
    the distances (in sd) of the mean of v = M_1(u) w from the lines v_1 = 0, v_2 = 0,
    v_1 = v_2, dd[3] with the log prior weight, dd[4:8] and dd[8:24] with the prior's E[x | u]
    and E[x x^T | u]."""
    dd[0] = math.nan
    dd[1] = math.nan
    dd[2] = math.nan
    dd[3] = -math.inf
    if r <= 0.0:
        return -math.inf
    u0 = r * math.cos(al)
    u1 = r * math.sin(al)
    d0 = u0 - omega[0, 0]
    d1 = u1 - omega[0, 1]
    lb = math.log(r) + log_norm_u - 0.5 * (d0 * d0 + d1 * d1) / v00
    e0 = slope * d0  # m(u) - omega_w: the conditional mean of w about omega_w
    e1 = slope * d1
    m0 = omega[1, 0] + e0
    m1 = omega[1, 1] + e1
    dd[3] = lb
    xp = (d0, d1, e0, e1)
    for a in range(4):
        dd[4 + a] = xp[a]
    for a in range(4):
        for b in range(4):
            dd[8 + 4 * a + b] = xp[a] * xp[b] + (s * s if (a == b and a >= 2) else 0.0)
    uu[0] = u0
    uu[1] = u1
    mixing(uu, params, M)
    det = M[0, 0] * M[1, 1] - M[0, 1] * M[1, 0]
    if not (det != 0.0 and math.isfinite(det)):
        return -math.inf
    hm_masked(m0 / s, m1 / s, M[1, 1] / det, -M[0, 1] / det, -M[1, 0] / det, M[0, 0] / det, det, mask, gx, gw,
              acc, rad)
    if not hm_moments(acc, res):  # res[1:6]: moments of (w - m) / s
        return -math.inf
    v0 = M[0, 0] * m0 + M[0, 1] * m1
    v1 = M[1, 0] * m0 + M[1, 1] * m1
    n0 = s * math.sqrt(M[0, 0] ** 2 + M[0, 1] ** 2)
    n1 = s * math.sqrt(M[1, 0] ** 2 + M[1, 1] ** 2)
    n2 = s * math.sqrt((M[0, 0] - M[1, 0]) ** 2 + (M[0, 1] - M[1, 1]) ** 2)
    dd[0] = v0 / n0 if n0 > 0.0 else math.nan
    dd[1] = v1 / n1 if n1 > 0.0 else math.nan
    dd[2] = (v0 - v1) / n2 if n2 > 0.0 else math.nan
    lb += res[0]
    # x = (u - omega_u, w - omega_w), E[w - omega_w | u, y] = e + s E[d]
    x2 = e0 + s * res[1]
    x3 = e1 + s * res[2]
    vec[0] = 1.0
    vec[1] = d0
    vec[2] = d1
    vec[3] = x2
    vec[4] = x3
    xs = (d0, d1, x2, x3)
    for a in range(2):
        for b in range(4):
            vec[5 + 4 * a + b] = xs[a] * xs[b]
            vec[5 + 4 * b + a] = xs[a] * xs[b]
    # E[(e + s d)(e + s d)^T] = e e^T + s (e E[d]^T + E[d] e^T) + s^2 E[d d^T]
    s2 = s * s
    vec[5 + 10] = e0 * e0 + 2.0 * s * e0 * res[1] + s2 * res[3]
    vec[5 + 11] = e0 * e1 + s * (e0 * res[2] + e1 * res[1]) + s2 * res[4]
    vec[5 + 14] = vec[5 + 11]
    vec[5 + 15] = e1 * e1 + 2.0 * s * e1 * res[2] + s2 * res[5]
    return lb


@njit(cache=True)
def hm_bounds(x):
    """Smallest and largest finite entry of x ((inf, -inf) if there is none)."""
    lo = math.inf
    hi = -math.inf
    for d in x:
        if math.isfinite(d):
            lo = min(lo, d)
            hi = max(hi, d)
    return lo, hi


@njit(cache=True)
def hm_eval_region(j, a0, a1, r0, r1, omega, v00, slope, s, log_norm_u, mask, params, xf, wf, wc, gx, gw,
                   gxs, gws, lm, K, G, I, P, lp, unres, split, res, acc, rad, M, uu, lbs, vals, dds, vec, dd):
    """Evaluates region j = [a0, a1] x [r0, r1] (angle, radius): fills lm[j], K[j], G[j], I[j],
    the prior's sums P[j] (scaled by exp(-lp[j])), unres[j] (an unresolved step, see HM_BAND)
    and split[j] = (angle-direction, radius-direction) score: the spans of the unresolved
    distances, else the mixed rules' errors of the mass and first moments (relative to the
    region's own mass)."""
    n = xf.shape[0]
    ha = 0.5 * (a1 - a0)
    hr = 0.5 * (r1 - r0)
    mx = -math.inf
    px = -math.inf
    for i in range(n):
        al = 0.5 * (a0 + a1) + ha * xf[i]
        for k in range(n):
            r = 0.5 * (r0 + r1) + hr * xf[k]
            lb = hm_node(al, r, omega, v00, slope, s, log_norm_u, mask, params, gx, gw, res, acc, rad, M, uu, vec,
                         dd)
            lbs[i, k] = lb
            for q in range(24):
                dds[i, k, q] = dd[q]
            if dd[3] > px:
                px = dd[3]
            if lb > -math.inf:
                for q in range(21):
                    vals[i, k, q] = vec[q]
                if lb > mx:
                    mx = lb
    lhw = math.log(ha * hr)
    lm[j] = mx + lhw
    lp[j] = px + lhw
    for q in range(HM_NV):
        K[j, q] = 0.0
        G[j, q] = 0.0
        I[j, q] = 0.0
        P[j, q] = 0.0
    # the prior's sums (what the region could hold at most) and the unresolved steps
    if px > -math.inf:
        for i in range(n):
            for k in range(n):
                if dds[i, k, 3] == -math.inf:
                    continue
                wp = wf[i] * wf[k] * math.exp(dds[i, k, 3] - px)
                P[j, 0] += wp
                for q in range(20):
                    P[j, 1 + q] += wp * dds[i, k, 4 + q]
    unres[j] = False
    span_a = 0.0
    span_r = 0.0
    for line in range(3):
        lo = math.inf
        hi = -math.inf
        for i in range(n):
            a, b = hm_bounds(dds[i, :, line])
            lo = min(lo, a)
            hi = max(hi, b)
        if lo < HM_BAND and hi > -HM_BAND and hi - lo > HM_RESOLVED:
            unres[j] = True
            # spans along each direction (max - min: a step may cross a node row twice)
            for i in range(n):
                a, b = hm_bounds(dds[i, :, line])
                if b > a:
                    span_r = max(span_r, b - a)
            for k in range(n):
                a, b = hm_bounds(dds[:, k, line])
                if b > a:
                    span_a = max(span_a, b - a)
    split[j, 0] = span_a
    split[j, 1] = span_r
    if mx == -math.inf:
        return
    mA = np.zeros(5)  # coarse in angle, fine in radius
    mR = np.zeros(5)  # fine in angle, coarse in radius
    for i in range(n):
        for k in range(n):
            if lbs[i, k] == -math.inf:
                continue
            e = math.exp(lbs[i, k] - mx)
            wk = wf[i] * wf[k] * e
            for q in range(21):
                K[j, q] += wk * vals[i, k, q]
            K[j, 21] += wk * wk
            if i % 2 == 1:
                wa = wc[i // 2] * wf[k] * e
                for q in range(5):
                    mA[q] += wa * vals[i, k, q]
            if k % 2 == 1:
                wr = wf[i] * wc[k // 2] * e
                for q in range(5):
                    mR[q] += wr * vals[i, k, q]
            if i % 2 == 1 and k % 2 == 1:
                wg = wc[i // 2] * wc[k // 2] * e
                for q in range(21):
                    G[j, q] += wg * vals[i, k, q]
                G[j, 21] += wg * wg
                # the same node with the smaller wedge rule: the inner error
                lb2 = hm_node(0.5 * (a0 + a1) + ha * xf[i], 0.5 * (r0 + r1) + hr * xf[k], omega, v00, slope, s,
                              log_norm_u, mask, params, gxs, gws, res, acc, rad, M, uu, vec, dd)
                if lb2 > -math.inf:
                    wi = wc[i // 2] * wc[k // 2] * math.exp(lb2 - mx)
                    for q in range(21):
                        I[j, q] += wi * vec[q]
    # split direction of a resolved region: the direction whose coarse rule errs more
    if not unres[j] and K[j, 0] > 0.0:
        for d in range(2):
            mm = mA if d == 0 else mR
            e0 = abs(K[j, 0] - mm[0]) / K[j, 0]
            e1 = 0.0
            for q in range(1, 5):
                e1 = max(e1, abs((K[j, q] - mm[q]) - K[j, q] / K[j, 0] * (K[j, 0] - mm[0])) / K[j, 0])
            split[j, d] = e0 + e1


@njit(cache=True)
def hm_error_terms(D, f, S0, m, M2, Vi, eg, edg, dm, dc, wg, wdg):
    """Adds to eg (4: g_out entries) and edg (16: dg_out entries) the absolute changes of g_out
    and dg_out caused by adding f * D (sums S0, S1, S2 of a region's difference) to totals
    (S0, mean m, second moments M2); returns the change of log Z. First order in D; dm (4), dc
    (4, 4), wg (2, 2), wdg (2, 2, 2, 2): work arrays."""
    d0 = f * D[0] / S0
    for a in range(4):
        dm[a] = f * D[1 + a] / S0 - m[a] * d0
    for a in range(4):
        for b in range(4):
            dc[a, b] = f * D[5 + 4 * a + b] / S0 - M2[a, b] * d0 - dm[a] * m[b] - m[a] * dm[b]
    hm_to_g(Vi, dm, wg)
    hm_to_dg(Vi, dc, wdg)
    for k in range(2):
        for t in range(2):
            eg[2 * k + t] += abs(wg[k, t])
            for kk in range(2):
                for ss in range(2):
                    edg[8 * k + 4 * t + 2 * kk + ss] += abs(wdg[k, t, kk, ss])
    return abs(d0)


@njit(cache=True)
def hm_adaptive_one(mask, omega, V, params, xf, wf, wc, gx, gw, gxs, gws, tol, max_regions, g_out, dg_out, extra):
    """Posterior moments of Z for one sample with the adaptive outer rule; returns a status as
    hm_denoise_one (2: the estimate did not reach tol, within max_regions regions, or because
    its inner part is above tol / 2).
    extra = (log_z_out, effective number of u-nodes, error estimate, regions used, the inner (wedge
    rule) part of the estimate)."""
    v00 = V[0, 0]
    Vi = np.empty((2, 2))
    detV = hm_inverse(V, Vi)
    if detV == 0.0:
        return 1
    s = math.sqrt(detV / v00)
    slope = V[0, 1] / v00
    log_norm_u = -math.log(2.0 * math.pi * v00)
    redges = np.empty(5)
    edges = hm_sectors(omega, V, redges)
    n_rad = int(redges[4])
    n0 = (edges.shape[0] - 1) * (n_rad - 1)
    R = max(max_regions, n0)
    box = np.empty((R, 4))
    lm = np.empty(R)
    K = np.empty((R, HM_NV))
    G = np.empty((R, HM_NV))
    I = np.empty((R, HM_NV))
    split = np.empty((R, 2))
    P = np.empty((R, HM_NV))
    lp = np.empty(R)
    unres = np.zeros(R, dtype=np.bool_)
    contrib = np.empty(R)
    n = xf.shape[0]
    lbs = np.empty((n, n))
    vals = np.empty((n, n, 21))
    dds = np.empty((n, n, 24))
    vec = np.empty(21)
    dd = np.empty(24)
    res = np.empty(6)
    acc = np.empty(7)
    rad = np.empty(3)
    M = np.empty((2, 2))
    uu = np.empty(2)
    nreg = 0
    for p in range(edges.shape[0] - 1):
        for q in range(n_rad - 1):
            box[nreg, 0] = edges[p]
            box[nreg, 1] = edges[p + 1]
            box[nreg, 2] = redges[q]
            box[nreg, 3] = redges[q + 1]
            hm_eval_region(nreg, edges[p], edges[p + 1], redges[q], redges[q + 1], omega, v00, slope, s, log_norm_u,
                           mask, params, xf, wf, wc, gx, gw, gxs, gws, lm, K, G, I, P, lp, unres, split, res, acc, rad,
                           M, uu, lbs, vals, dds, vec, dd)
            nreg += 1
    tot = np.empty(HM_NV)
    mean = np.empty(4)
    M2 = np.empty((4, 4))
    D = np.empty(21)
    eg = np.empty(4)
    edg = np.empty(16)
    g0 = np.empty(4)
    d0 = np.empty(16)
    g1 = np.empty(4)
    d1 = np.empty(16)
    eg_in = np.zeros(4)
    edg_in = np.zeros(16)
    est_in = 0.0
    dm = np.empty(4)
    dc = np.empty((4, 4))
    wg = np.empty((2, 2))
    wdg = np.empty((2, 2, 2, 2))
    cov = np.empty((4, 4))
    status = 0
    L = -math.inf
    est = math.inf
    while True:
        L = -math.inf
        for j in range(nreg):
            if K[j, 0] > 0.0 and lm[j] > L:
                L = lm[j]
        if L == -math.inf:
            return 3
        for q in range(HM_NV):
            tot[q] = 0.0
        for j in range(nreg):
            if K[j, 0] > 0.0:
                f = math.exp(lm[j] - L)
                for q in range(21):
                    tot[q] += f * K[j, q]
                tot[21] += f * f * K[j, 21]
        S0 = tot[0]
        for a in range(4):
            mean[a] = tot[1 + a] / S0
        for a in range(4):
            for b in range(4):
                M2[a, b] = tot[5 + 4 * a + b] / S0
        hm_to_g(Vi, mean, g_out)  # x = Z - omega
        for a in range(4):
            for b in range(4):
                cov[a, b] = M2[a, b] - mean[a] * mean[b]
        hm_to_dg(Vi, cov, dg_out)
        for k in range(2):
            for kk in range(2):
                for t in range(2):
                    dg_out[k, t, kk, t] -= Vi[k, kk]
        gs = 1.0
        ds = 1.0
        for k in range(2):
            for t in range(2):
                gs = max(gs, abs(g_out[k, t]))
                for kk in range(2):
                    for ss in range(2):
                        ds = max(ds, abs(dg_out[k, t, kk, ss]))
        # the estimate: every region's outer (K - G) and inner (G - I) differences, in absolute value
        for a in range(4):
            eg[a] = 0.0
        for a in range(16):
            edg[a] = 0.0
        elz = 0.0
        elz_in = 0.0
        eg_in[:] = 0.0
        edg_in[:] = 0.0
        worst = -1
        wmax = -1.0
        for j in range(nreg):
            f = math.exp(lm[j] - L) if lm[j] > -math.inf else 0.0
            fp = math.exp(min(lp[j] - L, 700.0)) if (unres[j] and lp[j] > -math.inf) else 0.0
            if f == 0.0 and fp == 0.0:
                contrib[j] = 0.0
                continue
            g0[:] = eg
            d0[:] = edg
            lz = 0.0
            if f > 0.0:
                for q in range(21):
                    D[q] = K[j, q] - G[j, q]
                lz += hm_error_terms(D, f, S0, mean, M2, Vi, eg, edg, dm, dc, wg, wdg)
                for q in range(21):
                    D[q] = G[j, q] - I[j, q]
                g1[:] = eg
                d1[:] = edg
                lzi = hm_error_terms(D, f, S0, mean, M2, Vi, eg, edg, dm, dc, wg, wdg)
                lz += lzi
                # the inner part alone (refining u cannot lower it: the caller refines the wedges)
                elz_in += lzi
                for a in range(4):
                    eg_in[a] += eg[a] - g1[a]
                for a in range(16):
                    edg_in[a] += edg[a] - d1[a]
            if fp > 0.0:  # an unresolved step: the region may hold anything up to its prior mass
                for q in range(21):
                    D[q] = P[j, q]
                lz += hm_error_terms(D, fp, S0, mean, M2, Vi, eg, edg, dm, dc, wg, wdg)
            elz += lz
            c = lz
            for a in range(4):
                c = max(c, (eg[a] - g0[a]) / gs)
            for a in range(16):
                c = max(c, (edg[a] - d0[a]) / ds)
            contrib[j] = c
            if c > wmax:
                wmax = c
                worst = j
        est = elz
        for a in range(4):
            est = max(est, eg[a] / gs)
        for a in range(16):
            est = max(est, edg[a] / ds)
        est_in = elz_in
        for a in range(4):
            est_in = max(est_in, eg_in[a] / gs)
        for a in range(16):
            est_in = max(est_in, edg_in[a] / ds)
        if not math.isfinite(est):
            return 4
        if est <= tol:
            break
        if est_in > tol or (est_in > 0.5 * tol and est - est_in <= 0.5 * tol):
            # the wedge rule must be refined (the caller does it) before refining u can help
            status = 2
            break
        if nreg + 1 > R or worst < 0:
            status = 2
            break
        # halve the direction whose score is larger (0: angle, 1: radius)
        d = 0 if split[worst, 0] >= split[worst, 1] else 1
        box[nreg, :] = box[worst, :]
        mid = 0.5 * (box[worst, 2 * d] + box[worst, 2 * d + 1])
        box[worst, 2 * d + 1] = mid
        box[nreg, 2 * d] = mid
        for j in (worst, nreg):
            hm_eval_region(j, box[j, 0], box[j, 1], box[j, 2], box[j, 3], omega, v00, slope, s, log_norm_u, mask,
                           params, xf, wf, wc, gx, gw, gxs, gws, lm, K, G, I, P, lp, unres, split, res, acc, rad, M,
                           uu, lbs, vals, dds, vec, dd)
        nreg += 1
    extra[0] = L + math.log(S0)
    extra[1] = S0 * S0 / tot[21]
    extra[2] = est
    extra[3] = nreg
    extra[4] = est_in
    for k in range(2):
        for t in range(2):
            if not math.isfinite(g_out[k, t]):
                return 4
    return status


@njit(cache=True, parallel=True)
def hm_adaptive_batch(mask, omega, V, params, xf, wf, wc, gx, gw, gxs, gws, tol, max_regions, g_out, dg_out, extra,
                      status):
    """Batch over samples (prange) of hm_adaptive_one; extra (n, 5)."""
    n = omega.shape[0]
    for i in prange(n):
        Vi = V[0] if V.shape[0] == 1 else V[i]
        status[i] = hm_adaptive_one(mask[i], omega[i], Vi, params, xf, wf, wc, gx, gw, gxs, gws, tol, max_regions,
                                    g_out[i], dg_out[i], extra[i])
