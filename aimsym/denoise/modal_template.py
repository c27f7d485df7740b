"""Mode-centred integration driver for reduced posteriors of any dimension (``aimsym.denoise.modal``).

Appended, as source text, to a model's generated module (model kernels + the polar/Gauss-Hermite
driver) and written to a content-keyed file in the cache directory, so that numba caches it with
the model's ``branch`` kernel (a jitted function passed as an argument would be recompiled in every
process). It relies on the generated names ``branch``, ``P``, ``T``, ``INTEGRAL_DIM``,
``N_BRANCHES``, ``FREE_K``, ``FREE_T``, ``HAS_MARGINAL``, ``_marginal`` and on the driver's ``_cholesky``, ``_precision``,
``_log_prior``, ``_finish`` and ``STATUS_*``. This file is not imported by the package.

The reduced posterior on each branch b is f_b(u) = exp(branch(b, u)) prod_t N(z_t; omega_t, V).
``modal_modes`` finds its modes (screening on a prior grid, Newton from the best distinct nodes
and from the sign images of every mode found) and their Laplace Gaussians phi_j with masses
a_j; ``modal_adaptive`` integrates f_b with the partition of unity pi_j = a_j phi_j / q_b,
q_b = sum over the branch's components a_i phi_i: int f_b = sum_j int a_j f_b phi_j / q_b,
each term by globally adaptive cubature in coordinates centred and scaled on phi_j.
"""

import math  # noqa: F401  (names below are resolved in the assembled module)

import numpy as np  # noqa: F401
from numba import njit, prange  # noqa: F401

# ---- template begins ----
# ============================================================================
# Mode-centred partition-of-unity driver (aimsym/denoise/modal_template.py)
# ============================================================================

# components whose Laplace mass is below e^-MODAL_DROP of the largest are dropped (their share of
# the integral is then < e^-MODAL_DROP times the Laplace approximation's error factor)
MODAL_DROP = 46.0
# the estimate is this factor times the change of the results since half the regions: where one
# layer is nearly known (V_kk ~ 1e-3) the change underestimated the actual error by up to 2x at
# k = 3 (24 points over four regimes, tests/test_denoiser_certified.py), elsewhere it was 5-100x
# pessimistic
MODAL_SAFETY = 4.0


@njit(cache=True)
def _mlogf(b, u, obs, params, z, omega, Vinv, logdet_V):
    """log f_b(u): the branch's log weight factor plus the log prior of the filled z."""
    lj = branch(b, u, obs, params, z)
    if not (-math.inf < lj < math.inf):
        return -math.inf
    if HAS_MARGINAL:  # a Gaussian block marginalised analytically: its conditional mean, its log factor
        lj += _marginal(z, omega, Vinv)
    return lj + _log_prior(z, omega, Vinv, logdet_V)


@njit(cache=True)
def _phi_x(b, x, m0, L0, obs, params, z, omega, Vinv, logdet_V, u):
    """log f_b at u = m0 + L0 x (x: prior-whitened coordinates)."""
    D = x.shape[0]
    for i in range(D):
        s = m0[i]
        for k in range(i + 1):
            s += L0[i, k] * x[k]
        u[i] = s
    return _mlogf(b, u, obs, params, z, omega, Vinv, logdet_V)


@njit(cache=True)
def _grad_hess(b, x, f0, hstep, m0, L0, obs, params, z, omega, Vinv, logdet_V, u, g, H):
    """Central finite differences of log f_b in x: gradient g and the Hessian of -log f_b, H.
    Returns False when a probe point has zero weight."""
    D = x.shape[0]
    xp = x.copy()
    fp = np.empty(D)
    fm = np.empty(D)
    for i in range(D):
        xp[i] = x[i] + hstep
        fp[i] = _phi_x(b, xp, m0, L0, obs, params, z, omega, Vinv, logdet_V, u)
        xp[i] = x[i] - hstep
        fm[i] = _phi_x(b, xp, m0, L0, obs, params, z, omega, Vinv, logdet_V, u)
        xp[i] = x[i]
        if not (-math.inf < fp[i] < math.inf and -math.inf < fm[i] < math.inf):
            return False
        g[i] = (fp[i] - fm[i]) / (2.0 * hstep)
        H[i, i] = -(fp[i] - 2.0 * f0 + fm[i]) / (hstep * hstep)
    for i in range(D):
        for j in range(i):
            xp[i] = x[i] + hstep
            xp[j] = x[j] + hstep
            fpp = _phi_x(b, xp, m0, L0, obs, params, z, omega, Vinv, logdet_V, u)
            xp[j] = x[j] - hstep
            fpm = _phi_x(b, xp, m0, L0, obs, params, z, omega, Vinv, logdet_V, u)
            xp[i] = x[i] - hstep
            fmm = _phi_x(b, xp, m0, L0, obs, params, z, omega, Vinv, logdet_V, u)
            xp[j] = x[j] + hstep
            fmp = _phi_x(b, xp, m0, L0, obs, params, z, omega, Vinv, logdet_V, u)
            xp[i] = x[i]
            xp[j] = x[j]
            if not (-math.inf < fpp < math.inf and -math.inf < fpm < math.inf
                    and -math.inf < fmm < math.inf and -math.inf < fmp < math.inf):
                return False
            c = -(fpp - fpm - fmp + fmm) / (4.0 * hstep * hstep)
            H[i, j] = c
            H[j, i] = c
    return True


@njit(cache=True)
def _solve_chol(L, g, dx):
    """dx = (L L^T)^{-1} g."""
    D = g.shape[0]
    y = np.empty(D)
    for i in range(D):
        s = g[i]
        for k in range(i):
            s -= L[i, k] * y[k]
        y[i] = s / L[i, i]
    for i in range(D - 1, -1, -1):
        s = y[i]
        for k in range(i + 1, D):
            s -= L[k, i] * dx[k]
        dx[i] = s / L[i, i]


@njit(cache=True)
def _newton(b, x, m0, L0, obs, params, z, omega, Vinv, logdet_V, u, H, max_iter):
    """Maximise log f_b from x (in place) by damped Newton with finite-difference derivatives
    (a Levenberg shift where -Hessian is not positive definite; backtracking on log f).
    Returns log f_b at the end (H: -Hessian there), or -inf on failure."""
    D = x.shape[0]
    g = np.empty(D)
    dx = np.empty(D)
    xt = np.empty(D)
    Lh = np.empty((D, D))
    Hs = np.empty((D, D))
    f0 = _phi_x(b, x, m0, L0, obs, params, z, omega, Vinv, logdet_V, u)
    if not (-math.inf < f0 < math.inf):
        return -math.inf
    hstep = 1e-4
    for it in range(max_iter):
        if not _grad_hess(b, x, f0, hstep, m0, L0, obs, params, z, omega, Vinv, logdet_V, u, g, H):
            return -math.inf
        lam = 0.0
        for tries in range(60):
            for i in range(D):
                for k in range(D):
                    Hs[i, k] = H[i, k]
                Hs[i, i] += lam
            if _cholesky(Hs, Lh):
                break
            lam = 1e-3 if lam == 0.0 else 4.0 * lam
        _solve_chol(Lh, g, dx)
        dec = 0.0
        for i in range(D):
            dec += g[i] * dx[i]
        if dec < 1e-14 and lam == 0.0:
            # converged: refresh the Hessian with a step on the posterior's own scale
            sc = 1e30
            for i in range(D):
                if H[i, i] > 0.0:
                    sc = min(sc, 1.0 / math.sqrt(H[i, i]))
            hs = min(1e-3, 1e-3 * sc) if sc < 1e30 else 1e-3
            _grad_hess(b, x, f0, hs, m0, L0, obs, params, z, omega, Vinv, logdet_V, u, g, H)
            return f0
        # step, with backtracking while log f does not increase
        t = 1.0
        ok = False
        for ls in range(40):
            for i in range(D):
                xt[i] = x[i] + t * dx[i]
            ft = _phi_x(b, xt, m0, L0, obs, params, z, omega, Vinv, logdet_V, u)
            if ft >= f0 - 1e-12 * abs(f0) and ft == ft:
                ok = True
                break
            t *= 0.5
        if not ok:
            _grad_hess(b, x, f0, hstep, m0, L0, obs, params, z, omega, Vinv, logdet_V, u, g, H)
            return f0
        for i in range(D):
            x[i] = xt[i]
        f0 = ft
        if t * math.sqrt(dec) < 1e-10:
            hstep = 1e-5
    _grad_hess(b, x, f0, hstep, m0, L0, obs, params, z, omega, Vinv, logdet_V, u, g, H)
    return f0


@njit(cache=True)
def _add_mode(b, x, f, H, cb, cx, cH, cf, nc):
    """Add the mode (b, x, f, H) unless a known mode of the branch lies within 0.1 of it in
    the metric of its -Hessian. Returns the new number of modes."""
    D = x.shape[0]
    for j in range(nc):
        if cb[j] != b:
            continue
        d2 = 0.0
        for i in range(D):
            for k in range(D):
                d2 += (x[i] - cx[j, i]) * cH[j, i, k] * (x[k] - cx[j, k])
        if d2 < 0.01:
            if f > cf[j]:  # keep the better converged copy
                for i in range(D):
                    cx[j, i] = x[i]
                cf[j] = f
            return nc
    if nc >= cx.shape[0]:
        return nc
    cb[nc] = b
    for i in range(D):
        cx[nc, i] = x[i]
        for k in range(D):
            cH[nc, i, k] = H[i, k]
    cf[nc] = f
    return nc + 1


@njit(cache=True)
def modal_modes_one(obs, omega, V, params, xs, flips, n_start, inflate, cb, cm, cL, cla):
    """Modes of the reduced posterior of one sample and their Laplace Gaussians.

    xs (Ns, D): screening nodes in prior-whitened coordinates; flips (F, D): sign patterns of
    the symmetry images (each layer's free index can flip sign without changing the link);
    n_start: Newton starts from the best distinct screening nodes per branch. Fills
    cb (branch), cm (mean), cL (Cholesky factor of inflate^2 times the Laplace covariance) and
    cla (log Laplace mass) of each component; returns their number (0: none found, < 0: a
    STATUS code)."""
    p = P
    D = INTEGRAL_DIM
    Vinv = np.empty((p, p))
    logdet_V = _precision(V, Vinv)
    if logdet_V != logdet_V:
        return -STATUS_BAD_V
    C0 = np.empty((D, D))
    for i in range(D):
        for j in range(D):
            C0[i, j] = V[FREE_K[i], FREE_K[j]] if FREE_T[i] == FREE_T[j] else 0.0
    for i in range(D):  # auxiliary slots (not entries of Z): the branch scales them to O(1) around 0
        if FREE_K[i] < 0:
            for j in range(D):
                C0[i, j] = 0.0
                C0[j, i] = 0.0
            C0[i, i] = 1.0
    L0 = np.empty((D, D))
    if not _cholesky(C0, L0):
        return -STATUS_BAD_V
    m0 = np.empty(D)
    for i in range(D):
        m0[i] = omega[FREE_K[i], FREE_T[i]] if FREE_K[i] >= 0 else 0.0
    z = np.zeros((p, T))
    u = np.empty(D)
    Ns = xs.shape[0]
    NB = N_BRANCHES
    fs = np.empty((NB, Ns))
    for b in range(NB):
        for k in range(Ns):
            fs[b, k] = _phi_x(b, xs[k], m0, L0, obs, params, z, omega, Vinv, logdet_V, u)
    maxc = cb.shape[0]
    cx = np.empty((maxc, D))
    cH = np.empty((maxc, D, D))
    cf = np.empty(maxc)
    cbb = np.empty(maxc, dtype=np.int64)
    nc = 0
    x = np.empty(D)
    H = np.empty((D, D))
    chosen = np.empty(n_start, dtype=np.int64)
    for b in range(NB):
        # best distinct screening nodes (at least 1 apart in whitened units)
        nch = 0
        used = np.zeros(Ns, dtype=np.bool_)
        for s in range(n_start):
            best = -1
            for k in range(Ns):
                if used[k] or not (fs[b, k] > -math.inf):
                    continue
                far = True
                for q in range(nch):
                    d2 = 0.0
                    for i in range(D):
                        d2 += (xs[k, i] - xs[chosen[q], i]) ** 2
                    if d2 < 1.0:
                        far = False
                        break
                if far and (best < 0 or fs[b, k] > fs[b, best]):
                    best = k
            if best < 0:
                break
            used[best] = True
            chosen[nch] = best
            nch += 1
        for q in range(nch):
            for i in range(D):
                x[i] = xs[chosen[q], i]
            f = _newton(b, x, m0, L0, obs, params, z, omega, Vinv, logdet_V, u, H, 60)
            if f > -math.inf:
                nc = _add_mode(b, x, f, H, cbb, cx, cH, cf, nc)
    # symmetry images of every mode found (mirrored in u, mapped back to whitened x)
    n_found = nc
    xt = np.empty(D)
    for j in range(n_found):
        for fl in range(flips.shape[0]):
            for bb in range(NB):
                # u of mode j, mirrored
                for i in range(D):
                    s = m0[i]
                    for k in range(i + 1):
                        s += L0[i, k] * cx[j, k]
                    u[i] = flips[fl, i] * s
                # x = L0^{-1} (u - m0)
                for i in range(D):
                    s = u[i] - m0[i]
                    for k in range(i):
                        s -= L0[i, k] * xt[k]
                    xt[i] = s / L0[i, i]
                f = _newton(bb, xt, m0, L0, obs, params, z, omega, Vinv, logdet_V, u, H, 60)
                if f > -math.inf:
                    nc = _add_mode(bb, xt, f, H, cbb, cx, cH, cf, nc)
    if nc == 0:
        return 0
    fmax = -math.inf
    for j in range(nc):
        fmax = max(fmax, cf[j])
    # Laplace components in u: mean m0 + L0 x, covariance L0 H^{-1} L0^T (inflated)
    Lh = np.empty((D, D))
    Hinv = np.empty((D, D))
    Cu = np.empty((D, D))
    out = 0
    for j in range(nc):
        if cf[j] < fmax - MODAL_DROP:
            continue
        for i in range(D):
            for k in range(D):
                Hinv[i, k] = cH[j, i, k]
        if _cholesky(Hinv, Lh):
            _chol_inverse(Lh, Hinv)
        else:  # not a proper maximum (a ridge): the prior's scale
            for i in range(D):
                for k in range(D):
                    Hinv[i, k] = 1.0 if i == k else 0.0
        for i in range(D):
            for k in range(D):
                s = 0.0
                for a in range(D):
                    for c in range(D):
                        s += L0[i, a] * Hinv[a, c] * L0[k, c]
                Cu[i, k] = inflate * inflate * s
        if not _cholesky(Cu, Lh):
            continue
        cb[out] = cbb[j]
        logdet = 0.0
        for i in range(D):
            s = m0[i]
            for k in range(i + 1):
                s += L0[i, k] * cx[j, k]
            cm[out, i] = s
            for k in range(D):
                cL[out, i, k] = Lh[i, k]
            logdet += math.log(Lh[i, i])
        # Laplace mass of the (uninflated) mode: f(mode) (2 pi)^{D/2} |Cov|^{1/2}
        cla[out] = cf[j] + 0.5 * D * math.log(2.0 * math.pi) + logdet - D * math.log(inflate)
        out += 1
    return out


@njit(cache=True, parallel=True)
def modal_modes(obs, omega, V, params, xs, flips, n_start, inflate, cb, cm, cL, cla, nc):
    """``modal_modes_one`` over a batch (V with leading size 1: shared). nc[i] < 0: STATUS."""
    n = omega.shape[0]
    shared = V.shape[0] == 1
    for i in prange(n):
        Vi = V[0] if shared else V[i]
        nc[i] = modal_modes_one(obs[i], omega[i], Vi, params, xs, flips, n_start, inflate, cb[i], cm[i], cL[i],
                                cla[i])


@njit(cache=True)
def _log_mix(b, u, nc, cb, cm, cLinv, cln, dxi):
    """log q_b(u) = log sum over the components of branch b of a_i phi_i(u)."""
    D = u.shape[0]
    mx = -math.inf
    s = 0.0
    for i in range(nc):
        if cb[i] != b:
            continue
        q = 0.0
        for a in range(D):
            t = 0.0
            for k in range(a + 1):
                t += cLinv[i, a, k] * (u[k] - cm[i, k])
            q += t * t
        lv = cln[i] - 0.5 * q
        if lv > mx:
            s = s * math.exp(mx - lv) + 1.0 if mx > -math.inf else 1.0
            mx = lv
        else:
            s += math.exp(lv - mx)
    return mx + math.log(s)


@njit(cache=True)
def _log_mix_inv(nc, cL, cla, cLinv, cln):
    """Inverse Cholesky factors and log normalised masses (log a_i - log |L_i| - D/2 log 2 pi)
    of the components; returns fshift = the largest log mass."""
    D = cL.shape[1]
    fshift = -math.inf
    for i in range(nc):
        ld = 0.0
        for a in range(D):
            cLinv[i, a, a] = 1.0 / cL[i, a, a]
            ld += math.log(cL[i, a, a])
            for k in range(a):
                s = 0.0
                for q in range(k, a):
                    s -= cL[i, a, q] * cLinv[i, q, k]
                cLinv[i, a, k] = s / cL[i, a, a]
        cln[i] = cla[i] - ld - 0.5 * D * math.log(2.0 * math.pi)
        fshift = max(fshift, cla[i])
    return fshift


# ---------------------------------------------------------------------------- adaptive cubature
# Each component's term E_{phi_j}[a_j f_b / q_b] is written over y in (-1, 1)^D by
# u = m_j + L_j x, x_i = y_i / (1 - y_i^2) (no truncation), and integrated by globally adaptive
# subdivision with the Genz-Malik degree-7 rule and its embedded degree-5 rule (the error of a
# region: |I7 - I5| per moment, a pessimistic estimate of the I7 error); the region with the
# largest weighted error is halved along the axis of largest fourth difference.


@njit(cache=True)
def _log_term(j, x, obs, params, z, omega, Vinv, logdet_V, nc, cb, cm, cL, cLinv, cln, cla, fshift, u):
    """log(a_j f / q) - fshift at u = m_j + L_j x (u and z filled); -inf where f is 0."""
    D = u.shape[0]
    for a in range(D):
        s = cm[j, a]
        for q in range(a + 1):
            s += cL[j, a, q] * x[q]
        u[a] = s
    b = cb[j]
    lf = _mlogf(b, u, obs, params, z, omega, Vinv, logdet_V)
    if not (lf > -math.inf):
        return -math.inf
    return lf - fshift + cla[j] - _log_mix(b, u, nc, cb, cm, cLinv, cln, None)


@njit(cache=True)
def _moment_point(j, y, obs, params, z, omega, Vinv, logdet_V, nc, cb, cm, cL, cLinv, cln, cla, fshift, u, x, dz):
    """Log value of component j's integrand at y (in the moment units exp(. - fshift)); fills
    dz = z - omega. Returns -inf where the weight is zero."""
    D = y.shape[0]
    lj = 0.0
    xx = 0.0
    for i in range(D):
        a = 1.0 - y[i] * y[i]
        if not (a > 0.0):
            return -math.inf
        x[i] = y[i] / a
        lj += math.log((1.0 + y[i] * y[i]) / (a * a))
        xx += x[i] * x[i]
    lv = _log_term(j, x, obs, params, z, omega, Vinv, logdet_V, nc, cb, cm, cL, cLinv, cln, cla, fshift, u)
    if not (lv > -math.inf):
        return -math.inf
    lv += -0.5 * xx - 0.5 * D * math.log(2.0 * math.pi) + lj
    p = z.shape[0]
    nt = z.shape[1]
    for kk in range(p):
        for tt in range(nt):
            dz[kk * nt + tt] = z[kk, tt] - omega[kk, tt]
    return lv


@njit(cache=True)
def _apply_rule(j, c, h, gp, w7, w5, obs, params, z, omega, Vinv, logdet_V, nc, cb, cm, cL, cLinv, cln, cla,
                fshift, wq, I, E, u, x, dz, y, fv):
    """Genz-Malik rule on the box c +- h: moment sums into I, |I7 - I5| into E; returns
    (weighted error, split axis)."""
    D = c.shape[0]
    nq = I.shape[0]
    pt = dz.shape[0]
    vol = 1.0
    for i in range(D):
        vol *= 2.0 * h[i]
    for q in range(nq):
        I[q] = 0.0
        E[q] = 0.0
    for k in range(gp.shape[0]):
        for i in range(D):
            y[i] = c[i] + h[i] * gp[k, i]
        lv = _moment_point(j, y, obs, params, z, omega, Vinv, logdet_V, nc, cb, cm, cL, cLinv, cln, cla, fshift,
                           u, x, dz)
        f = math.exp(lv) if lv > -math.inf else 0.0
        if f != f:
            f = 0.0
        fv[k] = f
        a7 = vol * w7[k] * f
        a5 = vol * w5[k] * f
        I[0] += a7
        E[0] += a7 - a5
        q = 1
        for a in range(pt):
            I[q] += a7 * dz[a]
            E[q] += (a7 - a5) * dz[a]
            q += 1
        for a in range(pt):
            for cc in range(a + 1):
                t = dz[a] * dz[cc]
                I[q] += a7 * t
                E[q] += (a7 - a5) * t
                q += 1
    err = 0.0
    for q in range(nq):
        E[q] = abs(E[q])
        err += wq[q] * E[q]
    # fourth differences along each axis (points 1..2D at lambda2, 2D+1..4D at lambda3)
    r = gp[1, 0] ** 2 / gp[2 * D + 1, 0] ** 2
    best = 0
    bd = -1.0
    for i in range(D):
        d = abs(fv[1 + 2 * i] + fv[2 + 2 * i] - 2.0 * fv[0] - r * (fv[1 + 2 * D + 2 * i] + fv[2 + 2 * D + 2 * i]
                                                                      - 2.0 * fv[0]))
        if d > bd * (1.0 + 1e-12):
            bd = d
            best = i
    return err, best


@njit(cache=True)
def _region_total(rI, nr, tot):
    """tot = the sum of the moment sums of the first nr regions."""
    for q in range(tot.shape[0]):
        tot[q] = 0.0
    for r in range(nr):
        for q in range(tot.shape[0]):
            tot[q] += rI[r, q]


@njit(cache=True)
def _heap_push(heap, hn, key, r):
    """Push region r on the max-heap (by key); returns the new size."""
    i = hn
    heap[i] = r
    while i > 0:
        par = (i - 1) // 2
        if key[heap[par]] >= key[heap[i]]:
            break
        heap[par], heap[i] = heap[i], heap[par]
        i = par
    return hn + 1


@njit(cache=True)
def _heap_pop(heap, hn, key):
    """Remove the top of the max-heap; returns the new size."""
    hn -= 1
    heap[0] = heap[hn]
    i = 0
    while True:
        l = 2 * i + 1
        if l >= hn:
            break
        c = l
        if l + 1 < hn and key[heap[l + 1]] > key[heap[l]]:
            c = l + 1
        if key[heap[i]] >= key[heap[c]]:
            break
        heap[c], heap[i] = heap[i], heap[c]
        i = c
    return hn


@njit(cache=True)
def _propagated_error(tot, etot, Vinv, pt, p, nt):
    """First-order propagation of the moment sums' error estimates (etot, absolute, same units
    as tot = [S0, S1, lower S2]) to g_out, dg_out (relative to their size, at least 1) and log
    Z_out (absolute); returns the largest of the three."""
    S0 = tot[0]
    if not (S0 > 0.0):
        return math.inf
    e0 = etot[0] / S0
    mean = np.empty(pt)
    dmean = np.empty(pt)
    q = 1
    for a in range(pt):
        mean[a] = tot[q] / S0
        dmean[a] = etot[q] / S0 + abs(mean[a]) * e0
        q += 1
    cov = np.empty((pt, pt))
    dcov = np.empty((pt, pt))
    for a in range(pt):
        for cc in range(a + 1):
            s2 = tot[q] / S0
            d = etot[q] / S0 + abs(s2) * e0 + abs(mean[a]) * dmean[cc] + abs(mean[cc]) * dmean[a]
            cov[a, cc] = s2 - mean[a] * mean[cc]
            cov[cc, a] = cov[a, cc]
            dcov[a, cc] = d
            dcov[cc, a] = d
            q += 1
    gmx = 1.0
    dgmx = 1.0
    eg = 0.0
    edg = 0.0
    for tt in range(nt):
        for kk in range(p):
            s = 0.0
            sg = 0.0
            for a in range(p):
                s += abs(Vinv[kk, a]) * dmean[a * nt + tt]
                sg += Vinv[kk, a] * mean[a * nt + tt]
            eg = max(eg, s)
            gmx = max(gmx, abs(sg))
            for ss in range(nt):
                for k2 in range(p):
                    s = 0.0
                    sd = 0.0
                    for a in range(p):
                        for cc in range(p):
                            s += abs(Vinv[kk, a]) * dcov[a * nt + tt, cc * nt + ss] * abs(Vinv[cc, k2])
                            sd += Vinv[kk, a] * cov[a * nt + tt, cc * nt + ss] * Vinv[cc, k2]
                    if tt == ss:
                        sd -= Vinv[kk, k2]
                    edg = max(edg, s)
                    dgmx = max(dgmx, abs(sd))
    return max(eg / gmx, edg / dgmx, e0)


@njit(cache=True)
def modal_adaptive_one(obs, omega, V, params, nc, cb, cm, cL, cla, gp, w7, w5, tol, max_regions, g_out, dg_out,
                       extra):
    """Adaptive partition-of-unity integral of one sample to ``tol`` (see the section note).
    extra[0] = log Z_out, extra[1] = function evaluations, extra[2] = error estimate (relative
    to the size of g_out and dg_out, at least 1, and absolute in log Z_out), extra[3] = 1 if
    the region budget stopped it above tol."""
    p = P
    nt = T
    pt = p * nt
    D = INTEGRAL_DIM
    nq = 1 + pt + pt * (pt + 1) // 2
    Vinv = np.empty((p, p))
    logdet_V = _precision(V, Vinv)
    if logdet_V != logdet_V:
        return STATUS_BAD_V
    cLinv = np.zeros((nc, D, D))
    cln = np.empty(nc)
    # moments are scaled by exp(-fshift): the largest Laplace mass sets the unit
    fshift = _log_mix_inv(nc, cL, cla, cLinv, cln)
    # error weights: how an error in each moment moves g_out = V^-1 E[z - omega] and dg_out
    cv = np.zeros(pt)
    for a in range(pt):
        kk = a // nt
        for k2 in range(p):
            cv[a] = max(cv[a], abs(Vinv[k2, kk]))
    wq = np.empty(nq)
    wq[0] = 1.0
    q = 1
    for a in range(pt):
        wq[q] = cv[a]
        q += 1
    for a in range(pt):
        for cc in range(a + 1):
            wq[q] = cv[a] * cv[cc]
            q += 1
    z = np.zeros((p, nt))
    u = np.empty(D)
    x = np.empty(D)
    y = np.empty(D)
    dz = np.empty(pt)
    fv = np.empty(gp.shape[0])
    R = max_regions
    rc = np.empty((R, D))
    rh = np.empty((R, D))
    rI = np.empty((R, nq))
    Escr = np.empty(nq)
    re = np.empty(R)
    ra = np.empty(R, dtype=np.int64)
    rj = np.empty(R, dtype=np.int64)
    nr = 0
    n_eval = 0
    # one region (-1, 1)^D per component
    for j in range(nc):
        if nr >= R:
            break
        for i in range(D):
            rc[nr, i] = 0.0
            rh[nr, i] = 1.0
        re[nr], ra[nr] = _apply_rule(j, rc[nr], rh[nr], gp, w7, w5, obs, params, z, omega, Vinv, logdet_V, nc, cb,
                                     cm, cL, cLinv, cln, cla, fshift, wq, rI[nr], Escr, u, x, dz, y, fv)
        rj[nr] = j
        n_eval += gp.shape[0]
        nr += 1
    tot = np.zeros(nq)
    etot = np.zeros(nq)
    budget_hit = 0.0
    heap = np.empty(R, dtype=np.int64)  # max-heap of regions by weighted error
    hn = 0
    for r in range(nr):
        hn = _heap_push(heap, hn, re, r)
        for q in range(nq):
            tot[q] += rI[r, q]
    # the estimate is the change of the totals since the region count was half of today's
    # (the error of the earlier result: pessimistic where the rule converges, and blind, like
    # every cubature estimate, only to a feature no region has yet seen)
    prev = np.zeros(nq)
    prev2 = np.zeros(nq)  # the checkpoint before prev (for a stop at the budget)
    diff = np.empty(nq)
    have_prev = False
    have_prev2 = False
    check_at = 2 * nr
    est = math.inf
    while True:
        if nr >= check_at:
            check_at = 2 * nr
            _region_total(rI, nr, tot)  # refresh the running totals (rounding drift)
            if have_prev:
                for q in range(nq):
                    diff[q] = abs(tot[q] - prev[q])
                est = MODAL_SAFETY * _propagated_error(tot, diff, Vinv, pt, p, nt)
                if est <= tol:
                    break
            for q in range(nq):
                prev2[q] = prev[q]
                prev[q] = tot[q]
            have_prev2 = have_prev
            have_prev = True
        if nr + 1 > R:
            budget_hit = 1.0
            break
        imax = heap[0]
        hn = _heap_pop(heap, hn, re)
        for q in range(nq):
            tot[q] -= rI[imax, q]
        # halve region imax along its axis; the second half goes to slot nr
        ax = ra[imax]
        j = rj[imax]
        rh[imax, ax] *= 0.5
        for i in range(D):
            rc[nr, i] = rc[imax, i]
            rh[nr, i] = rh[imax, i]
        rc[imax, ax] -= rh[imax, ax]
        rc[nr, ax] += rh[imax, ax]
        re[imax], ra[imax] = _apply_rule(j, rc[imax], rh[imax], gp, w7, w5, obs, params, z, omega, Vinv, logdet_V,
                                         nc, cb, cm, cL, cLinv, cln, cla, fshift, wq, rI[imax], Escr, u, x, dz, y,
                                         fv)
        re[nr], ra[nr] = _apply_rule(j, rc[nr], rh[nr], gp, w7, w5, obs, params, z, omega, Vinv, logdet_V, nc, cb,
                                     cm, cL, cLinv, cln, cla, fshift, wq, rI[nr], Escr, u, x, dz, y, fv)
        rj[nr] = j
        for q in range(nq):
            tot[q] += rI[imax, q] + rI[nr, q]
        hn = _heap_push(heap, hn, re, imax)
        hn = _heap_push(heap, hn, re, nr)
        nr += 1
        n_eval += 2 * gp.shape[0]
    _region_total(rI, nr, tot)
    if have_prev:
        for q in range(nq):
            etot[q] = abs(tot[q] - prev[q])
    else:
        for q in range(nq):
            etot[q] = math.inf
    S0 = tot[0]
    if not (S0 > 0.0):
        return STATUS_ZERO_LIKELIHOOD
    S1 = np.empty(pt)
    S2 = np.zeros((pt, pt))
    q = 1
    for a in range(pt):
        S1[a] = tot[q]
        q += 1
    for a in range(pt):
        for cc in range(a + 1):
            S2[a, cc] = tot[q]
            q += 1
    # (the effective-size slot of _finish is overwritten below; S0 * S0 there underflowed to 0 where
    # the integral is far below the Laplace mass, S0 < 1e-162, and raised ZeroDivisionError)
    st = _finish(fshift, S0, 1.0, S1, S2, Vinv, g_out, dg_out, extra)
    if st != STATUS_OK:
        return st
    extra[1] = n_eval
    extra[2] = MODAL_SAFETY * _propagated_error(tot, etot, Vinv, pt, p, nt)
    if budget_hit > 0.0 and have_prev2:
        # stopped by the budget, not by convergence: the last change can be small by chance
        # while the subdivision is still finding structure, so the previous one counts too
        for q in range(nq):
            diff[q] = abs(prev[q] - prev2[q])
        extra[2] = max(extra[2], MODAL_SAFETY * _propagated_error(prev, diff, Vinv, pt, p, nt))
    extra[3] = budget_hit
    return STATUS_OK


@njit(cache=True, parallel=True)
def modal_adaptive(obs, omega, V, params, nc, cb, cm, cL, cla, gp, w7, w5, tol, max_regions, g_out, dg_out, extra,
                   status):
    """``modal_adaptive_one`` over a batch."""
    n = omega.shape[0]
    shared = V.shape[0] == 1
    for i in prange(n):
        Vi = V[0] if shared else V[i]
        if nc[i] <= 0:
            status[i] = -nc[i] if nc[i] < 0 else STATUS_ZERO_LIKELIHOOD
            continue
        status[i] = modal_adaptive_one(obs[i], omega[i], Vi, params, nc[i], cb[i], cm[i], cL[i], cla[i], gp, w7, w5,
                                       tol, max_regions, g_out[i], dg_out[i], extra[i])


# ---------------------------------------------------------------------------- fast path
# Before the adaptive cubature, each component's term E_{phi_j}[a_j f_b / q_b] is taken with a
# fixed standard-normal rule in phi_j's own coordinates (u = m_j + L_j x): where the posterior is
# close to its Laplace mixture this converges fast, and two rules of increasing size give the
# estimate (``aimsym.modal.run`` compares them and sends what does not settle to the adaptive
# driver).


@njit(cache=True)
def _terms_setup(V, nc, cL, cla):
    """V^-1, log det V, the components' inverse Cholesky factors and log normalised masses, and
    fshift (nan where V is not positive definite)."""
    Vinv = np.empty((P, P))
    logdet_V = _precision(V, Vinv)
    cLinv = np.zeros((nc, INTEGRAL_DIM, INTEGRAL_DIM))
    cln = np.empty(nc)
    fshift = _log_mix_inv(nc, cL, cla, cLinv, cln) if logdet_V == logdet_V else math.nan
    return Vinv, logdet_V, cLinv, cln, fshift


@njit(cache=True)
def _term_point(j, x, wk, obs, params, z, omega, Vinv, logdet_V, nc, cb, cm, cL, cLinv, cln, cla, fshift, u):
    """The weighted partition-of-unity integrand of component j at the standard-normal node x:
    wk a_j f / q (``_log_term``); nan where f is 0 or not finite."""
    lv = _log_term(j, x, obs, params, z, omega, Vinv, logdet_V, nc, cb, cm, cL, cLinv, cln, cla, fshift, u)
    if not (lv > -math.inf):
        return math.nan
    return wk * math.exp(lv)


@njit(cache=True)
def modal_rule_one(obs, omega, V, params, nc, cb, cm, cL, cla, nodes, w, tot, tail):
    """Moment sums [S0, S1, lower S2] of z - omega (scaled by exp(-fshift), fshift = the largest
    log Laplace mass) of the partition-of-unity terms, each by the standard-normal rule
    (nodes, w) mapped onto its component; tail (size m, may be 0) gets the m largest per-node
    weights sum_j f_j (1 + |z - omega|^2), in decreasing order (the tail diagnostic of
    ``aimsym.denoise.rqmc``). Returns fshift (nan: V not positive definite)."""
    p = P
    nt = T
    pt = p * nt
    D = INTEGRAL_DIM
    Vinv, logdet_V, cLinv, cln, fshift = _terms_setup(V, nc, cL, cla)
    if fshift != fshift:
        return math.nan
    z = np.zeros((p, nt))
    u = np.empty(D)
    dz = np.empty(pt)
    keep = tail.shape[0]
    node_w = np.zeros(nodes.shape[0] if keep else 0)
    for q in range(tot.shape[0]):
        tot[q] = 0.0
    for j in range(nc):
        for k in range(nodes.shape[0]):
            f = _term_point(j, nodes[k], w[k], obs, params, z, omega, Vinv, logdet_V, nc, cb, cm, cL, cLinv, cln,
                            cla, fshift, u)
            if not (f == f):
                continue
            for kk in range(p):
                for tt in range(nt):
                    dz[kk * nt + tt] = z[kk, tt] - omega[kk, tt]
            if keep:  # (only the QMC stage's first pass asks for the tail)
                r2 = 0.0
                for a in range(pt):
                    r2 += dz[a] * dz[a]
                node_w[k] += f * (1.0 + r2)
            tot[0] += f
            q = 1
            for a in range(pt):
                tot[q] += f * dz[a]
                q += 1
            for a in range(pt):
                fa = f * dz[a]
                for c in range(a + 1):
                    tot[q] += fa * dz[c]
                    q += 1
    if keep:
        srt = np.sort(node_w)
        for a in range(keep):
            tail[a] = srt[srt.shape[0] - 1 - a] if a < srt.shape[0] else 0.0
    return fshift


@njit(cache=True)
def modal_refit_one(obs, omega, V, params, nc, cb, cm, cL, cla, nodes, w, S0, S1, S2):
    """Per component j, the moments of u under its partition-of-unity term a_j f phi_j / q (nodes
    and weights as in ``modal_rule_one``): S0[j] (scaled by exp(-fshift)), S1[j] = sum f u,
    S2[j] = sum f u u^T. The mean and covariance of each term re-centre its component (one
    step of population Monte Carlo)."""
    Vinv, logdet_V, cLinv, cln, fshift = _terms_setup(V, nc, cL, cla)
    if fshift != fshift:
        return math.nan
    D = INTEGRAL_DIM
    u = np.empty(D)
    z = np.zeros((P, T))
    for j in range(nc):
        S0[j] = 0.0
        for a in range(D):
            S1[j, a] = 0.0
            for c in range(D):
                S2[j, a, c] = 0.0
        for k in range(nodes.shape[0]):
            f = _term_point(j, nodes[k], w[k], obs, params, z, omega, Vinv, logdet_V, nc, cb, cm, cL, cLinv, cln,
                            cla, fshift, u)
            if not (f == f):
                continue
            S0[j] += f
            for a in range(D):
                S1[j, a] += f * u[a]
                for c in range(a + 1):
                    S2[j, a, c] += f * u[a] * u[c]
    return fshift


@njit(cache=True)
def modal_heaviest_one(obs, omega, V, params, nc, cb, cm, cL, cla, nodes, w, hu, hj, hv, hf):
    """The m = hj.shape[0] heaviest points of the partition-of-unity terms (nodes and weights as
    in ``modal_rule_one``): their u (hu), component (hj, -1 where fewer), log weight (hv, in the
    units exp(. - fshift)) and log f at u (hf), heaviest first. Where the weights are heavy-
    tailed these are the points in posterior mass the components miss (``aimsym.denoise.rqmc``
    centres new components on them)."""
    Vinv, logdet_V, cLinv, cln, fshift = _terms_setup(V, nc, cL, cla)
    m = hj.shape[0]
    for a in range(m):
        hj[a] = -1
        hv[a] = -math.inf
    if fshift != fshift:
        return
    D = INTEGRAL_DIM
    u = np.empty(D)
    z = np.zeros((P, T))
    for j in range(nc):
        for k in range(nodes.shape[0]):
            lv = _log_term(j, nodes[k], obs, params, z, omega, Vinv, logdet_V, nc, cb, cm, cL, cLinv, cln, cla,
                           fshift, u)
            if not (lv > -math.inf) or not (w[k] > 0.0):
                continue
            lv += math.log(w[k])
            if not (lv > hv[m - 1]):
                continue
            a = m - 1  # insertion into the sorted list
            while a > 0 and hv[a - 1] < lv:
                hv[a] = hv[a - 1]
                hj[a] = hj[a - 1]
                for c in range(D):
                    hu[a, c] = hu[a - 1, c]
                a -= 1
            hv[a] = lv
            hj[a] = j
            for c in range(D):
                hu[a, c] = u[c]
    for a in range(m):
        if hj[a] >= 0:
            for c in range(D):
                u[c] = hu[a, c]
            hf[a] = _mlogf(cb[hj[a]], u, obs, params, z, omega, Vinv, logdet_V)


@njit(cache=True, parallel=True)
def modal_heaviest(obs, omega, V, params, nc, cb, cm, cL, cla, nodes, w, idx, hu, hj, hv, hf):
    """``modal_heaviest_one`` for the samples idx of a batch (hu, hj, hv, hf indexed like idx)."""
    shared = V.shape[0] == 1
    for r in prange(idx.shape[0]):
        i = idx[r]
        Vi = V[0] if shared else V[i]
        modal_heaviest_one(obs[i], omega[i], Vi, params, nc[i], cb[i], cm[i], cL[i], cla[i], nodes, w, hu[r], hj[r],
                           hv[r], hf[r])


@njit(cache=True, parallel=True)
def modal_refit(obs, omega, V, params, nc, cb, cm, cL, cla, nodes, w, idx, S0, S1, S2):
    """``modal_refit_one`` for the samples idx of a batch (S0, S1, S2 indexed like idx)."""
    shared = V.shape[0] == 1
    for r in prange(idx.shape[0]):
        i = idx[r]
        Vi = V[0] if shared else V[i]
        modal_refit_one(obs[i], omega[i], Vi, params, nc[i], cb[i], cm[i], cL[i], cla[i], nodes, w, S0[r], S1[r],
                        S2[r])


@njit(cache=True, parallel=True)
def modal_rule(obs, omega, V, params, nc, cb, cm, cL, cla, nodes, w, idx, tot, fshift, tail):
    """``modal_rule_one`` for the samples idx of a batch (tot, fshift, tail indexed like idx;
    tail of shape (idx.size, 0) where no tail is wanted)."""
    shared = V.shape[0] == 1
    for r in prange(idx.shape[0]):
        i = idx[r]
        Vi = V[0] if shared else V[i]
        fshift[r] = modal_rule_one(obs[i], omega[i], Vi, params, nc[i], cb[i], cm[i], cL[i], cla[i], nodes, w,
                                   tot[r], tail[r])


@njit(cache=True, parallel=True)
def modal_finish(omega, V, idx, tot, etot, fshift, g_out, dg_out, extra, status):
    """g_out, dg_out, log Z_out and the propagated error estimate (x MODAL_SAFETY) from moment
    sums tot with absolute errors etot, for the samples idx (outputs indexed like idx)."""
    p = P
    nt = T
    pt = p * nt
    shared = V.shape[0] == 1
    for r in prange(idx.shape[0]):
        i = idx[r]
        Vi = V[0] if shared else V[i]
        Vinv = np.empty((p, p))
        ld = _precision(Vi, Vinv)
        if ld != ld:
            status[r] = STATUS_BAD_V
            continue
        if not (tot[r, 0] > 0.0) or fshift[r] != fshift[r]:
            status[r] = STATUS_ZERO_LIKELIHOOD
            continue
        S1 = np.empty(pt)
        S2 = np.zeros((pt, pt))
        q = 1
        for a in range(pt):
            S1[a] = tot[r, q]
            q += 1
        for a in range(pt):
            for c in range(a + 1):
                S2[a, c] = tot[r, q]
                q += 1
        # (Sw2 = 1: the effective node count is not used here; S0^2 underflowed to 0 for y = z1 z2)
        status[r] = _finish(fshift[r], tot[r, 0], 1.0, S1, S2, Vinv, g_out[r], dg_out[r], extra[r])
        extra[r, 2] = MODAL_SAFETY * _propagated_error(tot[r], etot[r], Vinv, pt, p, nt)
