"""Chamber-rule driver for reduced posteriors of tied attention models (``aimsym.denoise.chamber``).

Appended, as source text, with the modal driver to a model's generated module (see
``aimsym.denoise.modal.load``). It relies on the generated names ``P``, ``T``, ``CHAMBER_BLOCKS``,
``CHAMBER_LAYERS``, ``block_activation``, ``layer_skip`` and on the driver's ``_precision``,
``_finish`` and ``STATUS_*``. This file is not imported by the package.

The free rows of Z are attention blocks (one tied rank-one head of an earlier layer each). In the
coordinates q_b = M_{l-1} z_b^T of its layer's input, block b's attention sigma(beta q_b q_b^T)
switches only across the hyperplanes q_a = 0 and q_a = q_c: the walls of the (T + 1)! chambers
of the braid arrangement of (q, 0). So the reduced integral is written over the blocks' q
(Jacobian 1 / |det M_{l-1}| per block of layer l), each q over a rule that follows its chambers
(nodes from ``chamber_block_nodes``), and the mixing matrices are composed from the blocks' terms:
M_l = (c_l I + sum_{b in l} S_b(q_b)) M_{l-1}, z_b = M_{l-1}^{-1} q_b, z_L = M_{L-1}^{-1} (+-h).
The sign of every block and of h is a symmetry (S_b is even in q_b): each node stands for the
2^P sign patterns of the rows of Z, which share the composition and the Jacobian.
"""

import math  # noqa: F401  (names below are resolved in the assembled module)

import numpy as np  # noqa: F401
from numba import njit, prange  # noqa: F401

# ---- template begins ----
# ============================================================================
# Chamber rule for tied attention blocks (aimsym/denoise/chamber_template.py)
# ============================================================================

_CH_NB = len(CHAMBER_BLOCKS)
_CH_ROW = np.array([r for r, _ in CHAMBER_BLOCKS], dtype=np.int64)
_CH_LAYER = np.array([ly for _, ly in CHAMBER_BLOCKS], dtype=np.int64)
# sign patterns of the P rows of Z: _CH_SIGN[m, k] = -1 where bit k of m is set
_CH_SIGN = np.array([[-1.0 if (m >> k) & 1 else 1.0 for k in range(P)] for m in range(2 ** P)])
# headroom of the streamed log-sum-exp shift (rescaling is rare, no weight overflows)
_CH_HEADROOM = 30.0


@njit(cache=True)
def _raise_shift(acc, shift, top):
    """Streamed log-sum-exp: where a log weight ``top`` exceeds the shift, the shift becomes
    top + _CH_HEADROOM and the sums so far are rescaled. Returns (shift, the factor applied)."""
    if not (top > shift):
        return shift, 1.0
    new = top + _CH_HEADROOM
    sc = math.exp(shift - new)  # (0 at the first weight: the sums are still 0)
    for i in range(acc.shape[0]):
        acc[i] *= sc
    return new, sc


@njit(cache=True)
def _small_inverse(M, Minv):
    """Minv = M^{-1} for a small square M; returns det M (0: Minv is left undefined)."""
    n = M.shape[0]
    if n == 2:
        det = M[0, 0] * M[1, 1] - M[0, 1] * M[1, 0]
        if det == 0.0:
            return 0.0
        r = 1.0 / det
        Minv[0, 0] = M[1, 1] * r
        Minv[0, 1] = -M[0, 1] * r
        Minv[1, 0] = -M[1, 0] * r
        Minv[1, 1] = M[0, 0] * r
        return det
    if n == 3:
        c00 = M[1, 1] * M[2, 2] - M[1, 2] * M[2, 1]
        c01 = M[1, 2] * M[2, 0] - M[1, 0] * M[2, 2]
        c02 = M[1, 0] * M[2, 1] - M[1, 1] * M[2, 0]
        det = M[0, 0] * c00 + M[0, 1] * c01 + M[0, 2] * c02
        if det == 0.0:
            return 0.0
        r = 1.0 / det
        Minv[0, 0] = c00 * r
        Minv[1, 0] = c01 * r
        Minv[2, 0] = c02 * r
        Minv[0, 1] = (M[0, 2] * M[2, 1] - M[0, 1] * M[2, 2]) * r
        Minv[1, 1] = (M[0, 0] * M[2, 2] - M[0, 2] * M[2, 0]) * r
        Minv[2, 1] = (M[0, 1] * M[2, 0] - M[0, 0] * M[2, 1]) * r
        Minv[0, 2] = (M[0, 1] * M[1, 2] - M[0, 2] * M[1, 1]) * r
        Minv[1, 2] = (M[0, 2] * M[1, 0] - M[0, 0] * M[1, 2]) * r
        Minv[2, 2] = (M[0, 0] * M[1, 1] - M[0, 1] * M[1, 0]) * r
        return det
    # Gauss-Jordan with partial pivoting
    A = M.copy()
    for i in range(n):
        for j in range(n):
            Minv[i, j] = 1.0 if i == j else 0.0
    det = 1.0
    for c in range(n):
        piv = c
        for r in range(c + 1, n):
            if abs(A[r, c]) > abs(A[piv, c]):
                piv = r
        if A[piv, c] == 0.0:
            return 0.0
        if piv != c:
            det = -det
            for j in range(n):
                A[c, j], A[piv, j] = A[piv, j], A[c, j]
                Minv[c, j], Minv[piv, j] = Minv[piv, j], Minv[c, j]
        d = A[c, c]
        det *= d
        for j in range(n):
            A[c, j] /= d
            Minv[c, j] /= d
        for r in range(n):
            if r != c and A[r, c] != 0.0:
                f = A[r, c]
                for j in range(n):
                    A[r, j] -= f * A[c, j]
                    Minv[r, j] -= f * Minv[c, j]
    return det


@njit(cache=True)
def chamber_block_nodes(b, R, params, chE, xs, wx, ss, ws, kappa, crad, Q, W, S, edge):
    """Nodes of block b's rule over one chamber of each pair {C, -C} (the sign pattern adds
    -C): q = t E_C (e_i + sum_{j != i} x_j e_j), t the largest gap of the sorted (q, 0) (piece i),
    t <= R; x_j = eps sinh(tau), eps = kappa / (beta t^2) (the switching layer's width),
    Gauss-Legendre in tau; t by Gauss-Legendre in s with t^2 = crad (e^s - 1) (even T: the
    symmetrised integrand is analytic in t^2) or t = sqrt(crad) sinh(s) (odd T). Fills Q (N, T),
    weights W (N), the block's terms S (N, T, T) and edge (N: 1 on the outermost radial node)."""
    nt = T
    nx = xs.shape[0]
    nr = ss.shape[0]
    beta = block_beta(b, params)
    n_ang = 1
    for j in range(nt - 1):
        n_ang *= nx
    a = math.sqrt(crad)
    even = nt % 2 == 0
    smax = math.log1p(R * R / crad) if even else math.asinh(R / a)
    g = np.empty(nt)
    xg = np.empty(nx)
    wg = np.empty(nx)
    q = np.empty(nt)
    Sb = np.empty((nt, nt))
    n = 0
    for ci in range(chE.shape[0]):
        for i in range(nt):
            for ir in range(nr):
                s = 0.5 * smax * (ss[ir] + 1.0)
                if even:
                    t2 = crad * math.expm1(s)
                    t = math.sqrt(t2)
                    wr = 0.5 * smax * ws[ir] * 0.5 * crad * math.exp(s) * t ** (nt - 2)
                else:
                    t = a * math.sinh(s)
                    wr = 0.5 * smax * ws[ir] * a * math.cosh(s) * t ** (nt - 1)
                # the grading of the gaps x_j towards the walls x_j = 0
                if beta > 0.0:
                    eps = kappa / (beta * t * t)
                    tmax = math.asinh(1.0 / eps)
                    for k in range(nx):
                        tau = 0.5 * tmax * (xs[k] + 1.0)
                        xg[k] = eps * math.sinh(tau)
                        wg[k] = 0.5 * tmax * wx[k] * eps * math.cosh(tau)
                else:
                    for k in range(nx):
                        xg[k] = 0.5 * (xs[k] + 1.0)
                        wg[k] = 0.5 * wx[k]
                for m in range(n_ang):
                    w = wr
                    rem = m
                    for j in range(nt):
                        if j == i:
                            g[j] = t
                        else:
                            k = rem % nx
                            rem //= nx
                            g[j] = t * xg[k]
                            w *= wg[k]
                    for r in range(nt):
                        acc = 0.0
                        for j in range(nt):
                            acc += chE[ci, r, j] * g[j]
                        q[r] = acc
                        Q[r, n] = acc
                    block_activation(b, q, params, Sb)
                    for r in range(nt):
                        for c in range(nt):
                            S[r * nt + c, n] = Sb[r, c]
                    W[n] = math.log(w) if w > 0.0 else -math.inf
                    edge[n] = 1.0 if ir == nr - 1 else 0.0
                    n += 1
    return n


@njit(cache=True)
def _chamber_domain(omega, V, params, radius, growth, R):
    """Radial extent of each block's rule: |q_b| <= prod_{j < l} (|c_j| + sum_{b' in j} bound_b')
    (|omega_row| + radius sd_row), the prior of its row to ``radius`` standard deviations,
    times ``growth`` (a domain grown where the outermost nodes carried weight)."""
    nt = T
    amp = 1.0
    layer = 1
    acc = 0.0
    for b in range(_CH_NB):
        ly = _CH_LAYER[b]
        while layer < ly:  # close the earlier layers: their norm bound multiplies the later ones
            amp *= abs(layer_skip(layer, params)) + acc
            acc = 0.0
            layer += 1
        k = _CH_ROW[b]
        nrm = 0.0
        for t in range(nt):
            nrm += omega[k, t] * omega[k, t]
        R[b] = growth * amp * (math.sqrt(nrm) + radius * math.sqrt(V[k, k]))
        acc += block_bound(b, R[b], params)


_CH_CHUNK = 256


@njit(cache=True, fastmath={"contract"}, error_model="numpy")
def _chamber_solve(n, j0, Sb, Apart, Mprev, Mi, invdet):
    """M = (Apart + S_j) Mprev for the nodes j0 .. j0 + n of the last block: its inverse into Mi
    (T * T, chunk) and 1 / |det M| into invdet (0 where M is singular)."""
    nt = T
    M = np.empty((nt * nt, n))
    for r in range(nt):
        for c in range(nt):
            row = M[r * nt + c]
            for j in range(n):
                row[j] = 0.0
            for m in range(nt):
                a0 = Apart[r, m]
                pm = Mprev[m, c]
                src = Sb[r * nt + m]
                for j in range(n):
                    row[j] += (a0 + src[j0 + j]) * pm
    if nt == 2:
        for j in range(n):
            d = M[0, j] * M[3, j] - M[1, j] * M[2, j]
            r = 1.0 / d
            Mi[0, j] = M[3, j] * r
            Mi[1, j] = -M[1, j] * r
            Mi[2, j] = -M[2, j] * r
            Mi[3, j] = M[0, j] * r
            invdet[j] = abs(r) if d != 0.0 else 0.0
    elif nt == 3:
        for j in range(n):
            c00 = M[4, j] * M[8, j] - M[5, j] * M[7, j]
            c01 = M[5, j] * M[6, j] - M[3, j] * M[8, j]
            c02 = M[3, j] * M[7, j] - M[4, j] * M[6, j]
            d = M[0, j] * c00 + M[1, j] * c01 + M[2, j] * c02
            r = 1.0 / d
            Mi[0, j] = c00 * r
            Mi[3, j] = c01 * r
            Mi[6, j] = c02 * r
            Mi[1, j] = (M[2, j] * M[7, j] - M[1, j] * M[8, j]) * r
            Mi[4, j] = (M[0, j] * M[8, j] - M[2, j] * M[6, j]) * r
            Mi[7, j] = (M[1, j] * M[6, j] - M[0, j] * M[7, j]) * r
            Mi[2, j] = (M[1, j] * M[5, j] - M[2, j] * M[4, j]) * r
            Mi[5, j] = (M[2, j] * M[3, j] - M[0, j] * M[5, j]) * r
            Mi[8, j] = (M[0, j] * M[4, j] - M[1, j] * M[3, j]) * r
            invdet[j] = abs(r) if d != 0.0 else 0.0
    else:
        Mj = np.empty((nt, nt))
        Mij = np.empty((nt, nt))
        for j in range(n):
            for r in range(nt):
                for c in range(nt):
                    Mj[r, c] = M[r * nt + c, j]
            d = _small_inverse(Mj, Mij)
            for r in range(nt):
                for c in range(nt):
                    Mi[r * nt + c, j] = Mij[r, c] if d != 0.0 else 0.0
            invdet[j] = 1.0 / abs(d) if d != 0.0 else 0.0
    for e in range(nt * nt):  # a singular M has zero weight (and finite entries)
        row = Mi[e]
        for j in range(n):
            row[j] = row[j] if invdet[j] > 0.0 else 0.0


@njit(cache=True, fastmath={"contract"})
def _chamber_fill(n, j0, kb, Qb, Miprev, Mi, h, zfix, Z):
    """Rows of z at the chunk's nodes: fixed rows from zfix, the last block's row
    z = Miprev q_j, the solved row z_L = M^{-1} h."""
    nt = T
    p = P
    for k in range(p - 1):
        if k == kb:
            continue
        for t in range(nt):
            row = Z[k * nt + t]
            v = zfix[k, t]
            for j in range(n):
                row[j] = v
    for t in range(nt):
        row = Z[kb * nt + t]
        for j in range(n):
            row[j] = 0.0
        for c in range(nt):
            m = Miprev[t, c]
            src = Qb[c]
            for j in range(n):
                row[j] += m * src[j0 + j]
        row = Z[(p - 1) * nt + t]
        for j in range(n):
            row[j] = 0.0
        for c in range(nt):
            hc = h[c]
            src = Mi[t * nt + c]
            for j in range(n):
                row[j] += hc * src[j]


@njit(cache=True, fastmath={"contract"})
def _chamber_logw(n, j0, lWb, base, Z, Vinv, vom, LW, GB):
    """Log weights LW (2^P, chunk) of the sign patterns s of the rows: base + log node weight
    - 1/2 [sum_kl s_k s_l V^-1_kl G_kl - 2 sum_k s_k bl_k], G_kl = sum_t z_kt z_lt,
    bl_k = sum_t z_kt (V^-1 omega_t)_k (the constant parts are in base)."""
    nt = T
    p = P
    # GB rows: G_kl (k >= l, scaled by V^-1_kl, off-diagonal doubled), then bl_k (doubled)
    g = 0
    for k in range(p):
        for l in range(k + 1):
            row = GB[g]
            f = Vinv[k, l] * (1.0 if k == l else 2.0)
            for j in range(n):
                row[j] = 0.0
            for t in range(nt):
                a = Z[k * nt + t]
                b = Z[l * nt + t]
                for j in range(n):
                    row[j] += f * a[j] * b[j]
            g += 1
    for k in range(p):
        row = GB[g + k]
        for j in range(n):
            row[j] = 0.0
        for t in range(nt):
            a = Z[k * nt + t]
            v = 2.0 * vom[k, t]
            for j in range(n):
                row[j] += v * a[j]
    for m in range(2 ** p):
        out = LW[m]
        for j in range(n):
            out[j] = lWb[j0 + j] + base
        g = 0
        for k in range(p):
            sk = _CH_SIGN[m, k]
            for l in range(k + 1):
                f = -0.5 * sk * _CH_SIGN[m, l]
                src = GB[g]
                for j in range(n):
                    out[j] += f * src[j]
                g += 1
        for k in range(p):
            f = 0.5 * _CH_SIGN[m, k]
            src = GB[g + k]
            for j in range(n):
                out[j] += f * src[j]


@njit(cache=True, fastmath={"reassoc"})
def _chamber_max(LW, n):
    """Largest entry of LW[:, :n] (NaN propagates: a NaN log weight is a bug, not a zero)."""
    mx = -math.inf
    for m in range(LW.shape[0]):
        row = LW[m]
        for j in range(n):
            mx = max(mx, row[j])
    return mx


@njit(cache=True, fastmath={"contract", "reassoc"})
def _chamber_accumulate(n, LW, invdet, Z, WB, acc, edge_b, j0, edge_out):
    """exp of the (shifted) log weights, the sign-pattern sums W0, W1_k = sum_m s_k w_m,
    W2_kl = sum_m s_k s_l w_m (times 1 / |det M|) and the raw moment sums
    acc = (S0, sum W1 z, lower triangle of sum W2 z z^T). Returns the chunk's weight on the
    outermost radial nodes (edge_b) or all of it (edge_out)."""
    nt = T
    p = P
    pt = p * nt
    npat = 2 ** p
    for m in range(npat):
        _vexp(LW[m], n, 0.0)
    # WB rows: W0, W1_k (k < p), W2_kl (k > l)
    nw = 1 + p + p * (p - 1) // 2
    for r in range(nw):
        row = WB[r]
        for j in range(n):
            row[j] = 0.0
    for m in range(npat):
        src = LW[m]
        row = WB[0]
        for j in range(n):
            row[j] += src[j]
        for k in range(p):
            sk = _CH_SIGN[m, k]
            row = WB[1 + k]
            for j in range(n):
                row[j] += sk * src[j]
        r = 1 + p
        for k in range(p):
            for l in range(k):
                f = _CH_SIGN[m, k] * _CH_SIGN[m, l]
                row = WB[r]
                for j in range(n):
                    row[j] += f * src[j]
                r += 1
    for r in range(nw):
        row = WB[r]
        for j in range(n):
            row[j] *= invdet[j]
    w0 = WB[0]
    s = 0.0
    for j in range(n):
        s += w0[j]
    acc[0] += s
    edge = 0.0
    if edge_out:
        edge = s
    else:
        for j in range(n):
            edge += w0[j] * edge_b[j0 + j]
    qi = 1
    for a in range(pt):
        wa = WB[1 + a // nt]
        za = Z[a]
        s = 0.0
        for j in range(n):
            s += wa[j] * za[j]
        acc[qi] += s
        qi += 1
    for a in range(pt):
        ka = a // nt
        za = Z[a]
        for c in range(a + 1):
            kc = c // nt
            if ka == kc:
                wr = WB[0]
            else:
                wr = WB[1 + p + ka * (ka - 1) // 2 + kc]
            zc = Z[c]
            s = 0.0
            for j in range(n):
                s += wr[j] * za[j] * zc[j]
            acc[qi] += s
            qi += 1
    return edge


@njit(cache=True)
def chamber_one(obs, omega, V, params, tab, Qt, Wt, St, Et, g_out, dg_out, extra):
    """g_out, dg_out, log Z_out of one sample by the chamber rule, block b on the node table
    tab[b] (``chamber_tables``); extra = (log Z, node combinations, 0, weight share of the
    outermost radial nodes). Returns a STATUS.

    The blocks before the last one are combined in an outer loop (their layers recomposed from
    the first block that changed); the last block's nodes are processed in chunks by the SIMD
    stages ``_chamber_solve`` .. ``_chamber_accumulate``."""
    p = P
    nt = T
    pt = p * nt
    nb = _CH_NB
    nl = CHAMBER_LAYERS
    npat = 2 ** p
    Vinv = np.empty((p, p))
    logdet_V = _precision(V, Vinv)
    if logdet_V != logdet_V:
        return STATUS_BAD_V
    nn = Wt.shape[1]
    # per sample constants of the log prior: sum_t omega_t^T V^-1 omega_t and V^-1 omega
    vom = np.zeros((p, nt))
    c0 = 0.0
    for t in range(nt):
        for k in range(p):
            s = 0.0
            for j in range(p):
                s += Vinv[k, j] * omega[j, t]
            vom[k, t] = s
            c0 += omega[k, t] * s
    lconst = -0.5 * c0 - 0.5 * nt * (logdet_V + p * math.log(2.0 * math.pi))
    skips = np.empty(nl + 1)
    first = np.zeros(nl + 2, np.int64)  # blocks of layer l: first[l] .. first[l + 1] - 1
    for l in range(1, nl + 1):
        skips[l] = layer_skip(l, params)
    for l in range(1, nl + 2):
        b = first[l - 1]
        while b < nb and _CH_LAYER[b] < l:
            b += 1
        first[l] = b
    # per layer state of the outer blocks: Ms[l] = M_l, Mi[l] = M_l^-1, ldet[l] = log |det M_l|,
    # cum[l] = their log node weights and Jacobians (layers 1..l), edge flags
    Ms = np.zeros((nl + 1, nt, nt))
    Mi = np.zeros((nl + 1, nt, nt))
    ldet = np.zeros(nl + 1)
    cum = np.zeros(nl + 1)
    onedge = np.zeros(nl + 1)
    for r in range(nt):
        Ms[0, r, r] = 1.0
        Mi[0, r, r] = 1.0
    A = np.empty((nt, nt))
    z = np.zeros((p, nt))
    last = nb - 1
    kb = _CH_ROW[last]
    # chunk buffers
    CH = _CH_CHUNK
    Mic = np.empty((nt * nt, CH))
    invdet = np.empty(CH)
    Z = np.empty((pt, CH))
    LW = np.empty((npat, CH))
    GB = np.empty((p * (p + 1) // 2 + p, CH))
    WB = np.empty((1 + p + p * (p - 1) // 2, CH))
    nq = 1 + pt + pt * (pt + 1) // 2
    acc = np.zeros(nq)
    shift = -math.inf
    edge_acc = 0.0
    idx = np.zeros(max(nb - 1, 1), np.int64)
    outer = 1
    for b in range(nb - 1):
        outer *= nn
    lfrom = 1
    redo = 1  # after a singular outer state: recompose from the first layer
    for combo in range(outer):
        if combo > 0:  # next outer combination: the last outer block fastest
            b = nb - 2
            while True:
                idx[b] += 1
                if idx[b] < nn or b == 0:
                    break
                idx[b] = 0
                b -= 1
            lfrom = min(_CH_LAYER[b], redo)
        redo = nl + 1
        ok = True
        for l in range(lfrom, nl + 1):
            cl = skips[l]
            for r in range(nt):
                for c in range(nt):
                    A[r, c] = cl if r == c else 0.0
            cs = cum[l - 1]
            ed = onedge[l - 1]
            for bi in range(first[l], min(first[l + 1], last)):
                j = idx[bi]
                cs += Wt[tab[bi], j] - ldet[l - 1]
                if Et[tab[bi], j] > 0.0:
                    ed = 1.0
                k = _CH_ROW[bi]
                for t in range(nt):
                    s = 0.0
                    for c in range(nt):
                        s += Mi[l - 1, t, c] * Qt[tab[bi], c, j]
                    z[k, t] = s
                    for c in range(nt):
                        A[t, c] += St[tab[bi], t * nt + c, j]
            cum[l] = cs
            onedge[l] = ed
            if l == nl:
                break  # the last layer's A (without the last block) is completed per chunk
            for r in range(nt):
                for c in range(nt):
                    s = 0.0
                    for m in range(nt):
                        s += A[r, m] * Ms[l - 1, m, c]
                    Ms[l, r, c] = s
            det = _small_inverse(Ms[l], Mi[l])
            if not (det != 0.0 and det == det):
                ok = False
                break
            ldet[l] = math.log(abs(det))
        if not ok:
            redo = 1
            continue
        # the last block (layer nl): its Jacobian 1 / |det M_{nl-1}| (nl > 1) and the log prior constant
        base = cum[nl] + lconst - (ldet[nl - 1] if nl > 1 else 0.0)
        for j0 in range(0, nn, CH):
            n = min(CH, nn - j0)
            _chamber_solve(n, j0, St[tab[last]], A, Ms[nl - 1], Mic, invdet)
            _chamber_fill(n, j0, kb, Qt[tab[last]], Mi[nl - 1], Mic, obs, z, Z)
            _chamber_logw(n, j0, Wt[tab[last]], base, Z, Vinv, vom, LW, GB)
            lmax = _chamber_max(LW, n)
            if lmax != lmax:
                return STATUS_NOT_FINITE
            if not (lmax > -math.inf):
                continue
            shift, sc = _raise_shift(acc, shift, lmax)
            edge_acc *= sc
            for m in range(npat):
                row = LW[m]
                for j in range(n):
                    row[j] -= shift
            edge_acc += _chamber_accumulate(n, LW, invdet, Z, WB, acc, Et[tab[last]], j0, onedge[nl] > 0.0)
    if not (acc[0] > 0.0):
        return STATUS_ZERO_LIKELIHOOD
    # raw moments -> moments of z - omega (per sample: the posterior is broad where this rule runs)
    S0 = acc[0]
    S1 = np.empty(pt)
    S2 = np.zeros((pt, pt))
    om = np.empty(pt)
    for a in range(pt):
        om[a] = omega[a // nt, a % nt]
        S1[a] = acc[1 + a]
    qi = 1 + pt
    for a in range(pt):
        for c in range(a + 1):
            S2[a, c] = acc[qi] - S1[a] * om[c] - om[a] * S1[c] + S0 * om[a] * om[c]
            qi += 1
    for a in range(pt):
        S1[a] -= S0 * om[a]
    st = _finish(shift, S0, 1.0, S1, S2, Vinv, g_out, dg_out, extra)
    extra[1] = outer * nn
    extra[2] = 0.0
    extra[3] = edge_acc / acc[0]
    return st


@njit(cache=True, parallel=True)
def chamber_radii(omega, V, params, radius, growth, R):
    """``_chamber_domain`` over a batch: R (n, blocks) (V leading size 1: shared)."""
    shared = V.shape[0] == 1
    for i in prange(omega.shape[0]):
        _chamber_domain(omega[i], V[0] if shared else V[i], params, radius, growth[i], R[i])


@njit(cache=True, parallel=True)
def chamber_tables(blocks, radii, params, chE, xs, wx, ss, ws, kappa, crad, Qt, Wt, St, Et):
    """Node tables of block blocks[i] on [0, radii[i]] (``chamber_block_nodes``), i in parallel."""
    for i in prange(blocks.shape[0]):
        chamber_block_nodes(blocks[i], radii[i], params, chE, xs, wx, ss, ws, kappa, crad, Qt[i], Wt[i], St[i],
                            Et[i])


@njit(cache=True, parallel=True)
def chamber_batch(obs, omega, V, params, tab, Qt, Wt, St, Et, g_out, dg_out, extra, status):
    """``chamber_one`` over a batch (V leading size 1: shared); sample i's block b uses the node
    table tab[i, b]."""
    n = omega.shape[0]
    shared = V.shape[0] == 1
    for i in prange(n):
        status[i] = chamber_one(obs[i], omega[i], V[0] if shared else V[i], params, tab[i], Qt, Wt, St, Et,
                                g_out[i], dg_out[i], extra[i])


# ============================================================================
# Untied first layer at T = 2 (UNTIED_FIRST): chambers of q_a = 0, k_1 = k_2
# ============================================================================


@njit(cache=True)
def untied_pair_nodes(Rq, Rk, beta, xs, wx, qs, wq, ks, wk, kappa, crad, U, W, E):
    """(q, k_perp) nodes of an untied first-layer head at T = 2, one of each pair +-(q, k_perp)
    (q_1 >= 0; -(q, k_perp) leaves its attention sigma(beta q k^T) unchanged): row a switches with
    q_a d, d = k_2 - k_1. Per sign of q_2 and piece i (the larger |q_a| = t_q, the other t_q x):
    t_q = sqrt(crad) sinh(s) on [0, Rq]; per sign of d, |d| = a_k sinh(s') on [0, Rk] with
    a_k = kappa / (beta t_q) (where the larger row switches); x = eps sinh(tau) with
    eps = kappa / (beta t_q |d|) (where the smaller row switches). U rows (q_1, q_2, -d/2, d/2),
    W the log weights, E 1 on the outermost radial nodes. Returns the node count."""
    nx = xs.shape[0]
    nq = qs.shape[0]
    nk = ks.shape[0]
    a = math.sqrt(crad)
    smq = math.asinh(Rq / a)
    n = 0
    for sg in (1.0, -1.0):
        for i in range(2):
            for iq in range(nq):
                sq = 0.5 * smq * (qs[iq] + 1.0)
                tq = a * math.sinh(sq)
                wtq = 0.5 * smq * wq[iq] * a * math.cosh(sq) * tq
                ak = kappa / (beta * tq) if beta > 0.0 else a
                smk = math.asinh(Rk / ak)
                for sd in (1.0, -1.0):
                    for ik in range(nk):
                        sk = 0.5 * smk * (ks[ik] + 1.0)
                        tk = ak * math.sinh(sk)
                        wtk = 0.5 * smk * wk[ik] * ak * math.cosh(sk)
                        if beta > 0.0:
                            eps = kappa / (beta * tq * tk)
                            tmax = math.asinh(1.0 / eps)
                        for ix in range(nx):
                            if beta > 0.0:
                                tau = 0.5 * tmax * (xs[ix] + 1.0)
                                x = eps * math.sinh(tau)
                                wxx = 0.5 * tmax * wx[ix] * eps * math.cosh(tau)
                            else:
                                x = 0.5 * (xs[ix] + 1.0)
                                wxx = 0.5 * wx[ix]
                            big, small = tq, tq * x
                            U[n, 0] = big if i == 0 else small
                            U[n, 1] = sg * (small if i == 0 else big)
                            U[n, 2] = -0.5 * sd * tk
                            U[n, 3] = 0.5 * sd * tk
                            w = wtq * wtk * wxx
                            W[n] = math.log(w) if w > 0.0 else -math.inf
                            E[n] = 1.0 if (iq == nq - 1 or ik == nk - 1) else 0.0
                            n += 1
    return n


@njit(cache=True)
def _untied_eval(Un, sg, b, s, kap, obs, params, omega, Vinv, logdet_V, u, z):
    """log weight at the node (Un, sign sg), branch b, s and key mean kap; fills z."""
    u[0] = sg * Un[0]
    u[1] = sg * Un[1]
    u[2] = kap + sg * Un[2]
    u[3] = kap + sg * Un[3]
    u[4] = s
    lj = branch(b, u, obs, params, z)
    if not (-math.inf < lj < math.inf):
        return -math.inf
    if HAS_MARGINAL:
        lj += _marginal(z, omega, Vinv)
    return lj + _log_prior(z, omega, Vinv, logdet_V)


@njit(cache=True)
def _untied_kappa(Un, sg, b, s, k0, dz, A, obs, params, omega, Vinv, logdet_V, u, z):
    """log of the integral over the key mean kappa at the node (Un, sign sg), branch b and s. z is
    affine in kappa with the slope dz (the key row, and the marginalised row's conditional mean),
    and the log weight is the log prior at z plus terms free of kappa, so it is exactly
    L0 + B y + A y^2 (y = kappa - k0) with A = -1/2 sum_t dz_t^T V^-1 dz_t (per sample) and
    B = -sum_t (z_t - omega_t)^T V^-1 dz_t: one evaluation (z at k0 is left in z).
    Returns (log integral, B); -inf where the point has zero weight."""
    p = P
    nt = T
    L0 = _untied_eval(Un, sg, b, s, k0, obs, params, omega, Vinv, logdet_V, u, z)
    if not (L0 > -math.inf):
        return -math.inf, 0.0
    B = 0.0
    for t in range(nt):
        for k in range(p):
            acc = 0.0
            for j in range(p):
                acc += Vinv[k, j] * dz[j, t]
            B -= (z[k, t] - omega[k, t]) * acc
    return L0 - B * B / (4.0 * A) + 0.5 * math.log(math.pi / -A), B


@njit(cache=True)
def _untied_mode(Un, sg, b, s0, k0, dz, A, obs, params, omega, Vinv, logdet_V, u, z):
    """Mode s* of F(s) = log of the kappa integral (damped Newton with finite differences from
    s0, to a tenth of the bump's scale) and its curvature: returns (s*, sigma = (-F'')^{-1/2});
    sigma = 0 if F is -inf."""
    s = s0
    hs = 1e-3
    F0 = _untied_kappa(Un, sg, b, s, k0, dz, A, obs, params, omega, Vinv, logdet_V, u, z)[0]
    if not (F0 > -math.inf):
        # search outwards for a point of positive weight
        for r in (1.0, -1.0, 3.0, -3.0, 6.0, -6.0):
            F0 = _untied_kappa(Un, sg, b, s0 + r, k0, dz, A, obs, params, omega, Vinv, logdet_V, u, z)[0]
            if F0 > -math.inf:
                s = s0 + r
                break
        if not (F0 > -math.inf):
            return s0, 0.0
    H = -1.0
    for it in range(40):
        Fp = _untied_kappa(Un, sg, b, s + hs, k0, dz, A, obs, params, omega, Vinv, logdet_V, u, z)[0]
        Fm = _untied_kappa(Un, sg, b, s - hs, k0, dz, A, obs, params, omega, Vinv, logdet_V, u, z)[0]
        g = (Fp - Fm) / (2.0 * hs)
        H = (Fp - 2.0 * F0 + Fm) / (hs * hs)
        if not (g == g and H == H):
            return s, 0.0
        step = -g / H if H < 0.0 else (1.0 if g > 0.0 else -1.0)
        step = max(-2.0, min(2.0, step))
        # the mode only centres the Gauss-Hermite rule: a tenth of its scale is close enough
        if H < 0.0 and abs(step) < 0.1 / math.sqrt(-H):
            break
        tstep = 1.0
        moved = False
        for ls in range(30):
            Ft = _untied_kappa(Un, sg, b, s + tstep * step, k0, dz, A, obs, params, omega, Vinv, logdet_V, u, z)[0]
            if Ft >= F0:
                s += tstep * step
                F0 = Ft
                moved = True
                break
            tstep *= 0.5
        if not moved or abs(tstep * step) < 1e-7:
            break
    if not (H < 0.0):
        return s, 1.0
    return s, 1.0 / math.sqrt(-H)


@njit(cache=True)
def untied_one(obs, omega, V, params, xs, wx, qs, wq, ks, wk, gx, gw, kappa, crad, radius, growth, g_out, dg_out,
               extra):
    """One sample of an untied two-layer model at T = 2 by the untied chamber rule: nodes of
    (q, k_perp) from ``untied_pair_nodes`` and both signs, both branches (signs of lambda). The
    mean kappa of the first layer's key enters only through the Gaussian prior and the
    marginalised block's conditional mean (the attention sees key differences): z is affine in
    kappa with a slope shared by every node and the log weight the log prior there, so kappa is
    integrated in closed form from one evaluation (``_untied_kappa``). s = log|lambda| - s_ref: the resulting F(s) is a narrow
    bump whose place moves with the node, so each node finds its mode (``_untied_mode``, warm
    started) and integrates by Gauss-Hermite (physicists' nodes gx, weights gw) on its curvature
    (F decays double-exponentially on both sides: Gauss-Legendre on the bump's support needs
    about twice the nodes).
    extra = (log Z, evaluations, 0, weight share on the outermost radial nodes). Returns a STATUS."""
    p = P
    nt = T
    pt = p * nt
    D = INTEGRAL_DIM
    Vinv = np.empty((p, p))
    logdet_V = _precision(V, Vinv)
    if logdet_V != logdet_V:
        return STATUS_BAD_V
    kq = UNTIED_FIRST[0]
    kk = UNTIED_FIRST[1]
    beta = untied_beta(params)
    nq0 = 0.0
    for t in range(nt):
        nq0 += omega[kq, t] * omega[kq, t]
    Rq = growth * (math.sqrt(nq0) + radius * math.sqrt(V[kq, kq]))
    Rk = growth * (abs(omega[kk, 1] - omega[kk, 0]) + radius * math.sqrt(2.0 * V[kk, kk]))
    nn = 8 * qs.shape[0] * ks.shape[0] * xs.shape[0]
    U = np.empty((nn, 4))
    W = np.empty(nn)
    E = np.empty(nn)
    untied_pair_nodes(Rq, Rk, beta, xs, wx, qs, wq, ks, wk, kappa, crad, U, W, E)
    k0 = 0.5 * (omega[kk, 0] + omega[kk, 1])
    u = np.empty(D)
    z = np.zeros((p, nt))
    z1 = np.zeros((p, nt))
    # the slope of z in the key mean (the same at every node): from two points of the first node
    # with positive weight
    dz = np.zeros((p, nt))
    A = 0.0
    for n in range(nn):
        if _untied_eval(U[n], 1.0, 0, 0.0, k0, obs, params, omega, Vinv, logdet_V, u, z) > -math.inf and \
                _untied_eval(U[n], 1.0, 0, 0.0, k0 + 1.0, obs, params, omega, Vinv, logdet_V, u, z1) > -math.inf:
            for k in range(p):
                for t in range(nt):
                    dz[k, t] = z1[k, t] - z[k, t]
            break
    for t in range(nt):
        for k in range(p):
            acc_ = 0.0
            for j in range(p):
                acc_ += Vinv[k, j] * dz[j, t]
            A -= 0.5 * dz[k, t] * acc_
    if not (A < 0.0):
        return STATUS_ZERO_LIKELIHOOD
    v = -1.0 / (2.0 * A)
    zb = np.empty(pt)
    dzf = np.empty(pt)
    for k in range(p):
        for t in range(nt):
            dzf[k * nt + t] = dz[k, t]
    nq_ = 1 + pt + pt * (pt + 1) // 2
    acc = np.zeros(nq_)
    shift = -math.inf
    edge_acc = 0.0
    ng = gx.shape[0]
    warm = np.zeros((2, N_BRANCHES))
    for n in range(nn):
        Un = U[n]
        for isg in range(2):
            sg = 1.0 if isg == 0 else -1.0
            for b in range(N_BRANCHES):
                sm, sig = _untied_mode(Un, sg, b, warm[isg, b], k0, dz, A, obs, params, omega, Vinv, logdet_V, u, z)
                if not (sig > 0.0):
                    continue
                warm[isg, b] = sm
                for i_g in range(ng):
                    x = gx[i_g]
                    sv = sm + 1.4142135623730951 * sig * x
                    F, B = _untied_kappa(Un, sg, b, sv, k0, dz, A, obs, params, omega, Vinv, logdet_V, u, z)
                    if not (F > -math.inf):
                        continue
                    lw = F + x * x + math.log(1.4142135623730951 * sig * gw[i_g]) + W[n]
                    shift, sc = _raise_shift(acc, shift, lw)
                    edge_acc *= sc
                    w = math.exp(lw - shift)
                    m = -B / (2.0 * A)
                    for k in range(p):
                        for t in range(nt):
                            zb[k * nt + t] = z[k, t] + m * dz[k, t] - omega[k, t]
                    acc[0] += w
                    if E[n] > 0.0:
                        edge_acc += w
                    q = 1
                    for a_ in range(pt):
                        acc[q] += w * zb[a_]
                        q += 1
                    for a_ in range(pt):
                        for c_ in range(a_ + 1):
                            acc[q] += w * (zb[a_] * zb[c_] + v * dzf[a_] * dzf[c_])
                            q += 1
    if not (acc[0] > 0.0):
        return STATUS_ZERO_LIKELIHOOD
    S1 = np.empty(pt)
    S2 = np.zeros((pt, pt))
    for a_ in range(pt):
        S1[a_] = acc[1 + a_]
    q = 1 + pt
    for a_ in range(pt):
        for c_ in range(a_ + 1):
            S2[a_, c_] = acc[q]
            q += 1
    st = _finish(shift, acc[0], 1.0, S1, S2, Vinv, g_out, dg_out, extra)
    extra[1] = nn * 4 * ng
    extra[2] = 0.0
    extra[3] = edge_acc / acc[0]
    return st


@njit(cache=True, parallel=True)
def untied_batch(obs, omega, V, params, xs, wx, qs, wq, ks, wk, gx, gw, kappa, crad, radius, growth, g_out, dg_out,
                 extra, status):
    """``untied_one`` over a batch (V leading size 1: shared; growth per sample)."""
    n = omega.shape[0]
    shared = V.shape[0] == 1
    for i in prange(n):
        status[i] = untied_one(obs[i], omega[i], V[0] if shared else V[i], params, xs, wx, qs, wq, ks, wk, gx, gw,
                               kappa, crad, radius, growth[i], g_out[i], dg_out[i], extra[i])
