"""The chamber rule: reduced posteriors of tied attention models integrated along the geometry
of their attention (kernels in ``chamber_template.py``, appended with the modal driver).

Where it applies (``CHAMBER_BLOCKS`` of the generated module: every free row of Z is the tied
rank-one index of one head of an earlier softmax or linear layer, the last layer solved), the
integrand is analytic but switches across the hyperplanes q_a = 0, q_a = q_b of each block's
layer input q (a braid arrangement of (q, 0)), in layers of width ~1 / (beta |q|^2). Smooth rules
on the whole space stall there (tensor Gauss-Hermite at ~1e-3); a rule whose pieces are the
arrangement's chambers, graded towards their walls at that width, converges spectrally:

* per block, one chamber of each pair {C, -C} ((T + 1)!/2 of them; the sign of a block is a
  symmetry), split into T pieces by the largest gap t of the sorted (q, 0), so that
  q = t E_C (e_i + sum_{j != i} x_j e_j) with x in [0, 1]^{T-1} and the walls at x_j = 0;
* t on [0, R] (R bounds |q| over the prior of the block's row to ``RADIUS`` sd) by Gauss-Legendre
  in a logarithmic variable, x_j = eps sinh(tau) with eps = KAPPA / (beta t^2) (the width of the
  switching layer at that radius) and Gauss-Legendre in tau;
* the blocks' rules multiply (a tensor product over blocks), the mixing matrices are composed
  per node from the blocks' terms, and each node serves the 2^P sign patterns of the rows of Z.

Error control: rules of increasing size (``LEVELS``); the difference between two successive
levels, in the measure of ``output.difference`` (g_out and dg_out relative to their size, at
least 1; log Z_out absolute), is the estimate of the finer one (convergence is spectral, so the
coarser rule's error dominates the difference). The weight on the outermost radial nodes is
added to the estimate; where it exceeds ``EDGE_TOL`` the domain grows by ``GROWTH``.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import numpy as np

from .output import difference

# rule sizes (angle nodes per gap, radial nodes) of the successive levels
# (the two finest settle far-tail samples to ~1e-9 and ~1e-12, where the cubature's estimate can be
# blind to the switching layers: docs/denoiser.md)
LEVELS = ((4, 10), (6, 14), (8, 18), (10, 24), (13, 30), (17, 38), (22, 48), (28, 60), (36, 76))
# width of the switching layers in the gap coordinate: eps = KAPPA / (beta t^2)
KAPPA = 2.0
# scale of the logarithmic radial variable
CRAD = 1.0
# radial extent in prior standard deviations of each block's row (prior mass outside < e^-36)
RADIUS = 8.5
# weight share on the outermost radial nodes above which the domain grows (by GROWTH)
EDGE_TOL = 1e-12
GROWTH = 1.5
MAX_GROWTH = 4
# typical (median) difference between levels i - 1 and i over the SE regimes (two layers at T = 3,
# three layers at T = 2, docs/denoiser.md): the first comparison is the first level expected to meet
# tol, so a loose tol does not pay for the fine levels and a tight one skips the coarse ones
MEDIAN_DIFF = (math.inf, 5e-4, 2e-5, 5e-7, 1e-8, 2e-10, 1e-12, 1e-13, 1e-14)
# node tables are shared by the samples whose radius rounds up to the same 2^(j / RADIUS_GRID)
RADIUS_GRID = 8
MAX_TABLE_BYTES = 2**29
# a sample goes to the chamber rule first when beta sd (|omega_row| + 5 sd) > BROAD for some block
BROAD = 2.0
# budget: node combinations (the product over blocks) per sample and level
MAX_COMBINATIONS = 20_000_000
# under a batch error budget (``run(sum_budget=)``): the factor by which a sample's estimate is
# expected to fall per level when choosing which samples go on (the slow far-tail samples fall
# 3-6x per level, typical ones 10-30x)
BUDGET_GAIN = 4.0


@lru_cache(maxsize=8)
def chambers(T: int) -> np.ndarray:
    """One chamber of each pair {C, -C} of the braid arrangement of (q_1..q_T, 0), as the matrix
    E (T, T) with q = E g, g >= 0 the gaps of the sorted values (E is unimodular)."""
    out, seen = [], set()
    for perm in itertools.permutations(range(T + 1)):  # ascending order; index T is the zero
        if perm in seen:
            continue
        seen.update((perm, perm[::-1]))
        j0 = perm.index(T)
        E = np.zeros((T, T))
        for pos, i in enumerate(perm):
            if i == T:
                continue
            if pos > j0:
                E[i, j0:pos] = 1.0
            else:
                E[i, pos:j0] = -1.0
        out.append(E)
    return np.ascontiguousarray(np.array(out))


@lru_cache(maxsize=32)
def rule(n_x: int, n_r: int):
    """Gauss-Legendre nodes on [-1, 1] for the gaps and the radius: (xs, wx, ss, ws)."""
    xs, wx = np.polynomial.legendre.leggauss(n_x)
    ss, ws = np.polynomial.legendre.leggauss(n_r)
    return xs, wx, ss, ws


def applies(K) -> bool:
    return len(getattr(K, "CHAMBER_BLOCKS", ())) > 0 or untied_applies(K)


def untied_applies(K) -> bool:
    return len(getattr(K, "UNTIED_FIRST", ())) > 0


def certified_default(K) -> bool:
    """Whether a model's default denoiser (and the SE's) is the certified cascade with this rule:
    attention blocks at reduced dimension >= 3, or at 2 without the polar rule (a linear or hardmax
    first layer). Tensor Gauss-Hermite stalls at ~1e-3 there, and across a hardmax layer's
    switching lines it does not converge."""
    return len(getattr(K, "CHAMBER_BLOCKS", ())) > 0 and (
        int(K.INTEGRAL_DIM) >= 3 or not len(getattr(K, "POLAR_ANGLES", ())))


def broad(K, omega, V, params) -> np.ndarray:
    if untied_applies(K):  # (no cheaper rule for the untied model: its modal fast path stalls)
        return np.ones(omega.shape[0], bool)
    return _broad(K, omega, V, params)


def _broad(K, omega, V, params) -> np.ndarray:
    """Samples for which the chamber rule goes first: the prior of some block's row is wide next
    to the switching layers (beta sd (|omega_row| + 5 sd) > 1, the criterion of the polar rule's
    Gauss-Hermite shortcut); elsewhere the posterior is close to its Laplace mixture and the
    modal fast path is cheaper."""
    rows = np.array([k for k, _ in K.CHAMBER_BLOCKS])
    Vd = np.diagonal(V, axis1=1, axis2=2)[:, rows]  # (1 or n, blocks)
    sd = np.sqrt(Vd)
    beta = np.array([K.block_beta(b, params) for b in range(len(rows))])
    width = beta * sd * (np.linalg.norm(omega[:, rows, :], axis=2) + 5.0 * sd)
    return np.any(width > BROAD, axis=1)


def max_level(K, budget: int | None = None) -> int:
    """The finest level within the budget (node combinations per sample, default
    ``MAX_COMBINATIONS``); the levels are tried in turn, so a loose tol stops early anyway."""
    if untied_applies(K):
        return len(UNTIED_LEVELS) - 1
    T, nb = int(K.T), len(K.CHAMBER_BLOCKS)
    budget = MAX_COMBINATIONS if budget is None else budget
    top = 0
    for lv in range(len(LEVELS)):
        if nodes_per_block(T, lv) ** nb <= budget:
            top = lv
    return top


def first_level(tol: float, medians=MEDIAN_DIFF) -> int:
    """The first level compared with its predecessor: the first expected to meet tol (its typical
    difference to the level before, ``medians``, is at most tol)."""
    for i in range(1, len(medians)):
        if medians[i] <= tol:
            return i
    return len(medians) - 1


def nodes_per_block(T: int, level: int) -> int:
    n_x, n_r = LEVELS[level]
    return len(chambers(T)) * T * n_r * n_x ** (T - 1)


def radius_grid(R: np.ndarray) -> np.ndarray:
    """R rounded up to the grid 2^(j / RADIUS_GRID): samples of a batch share node tables (the
    domain grows by at most 2^(1 / RADIUS_GRID); the radial rule is logarithmic)."""
    return np.exp2(np.ceil(np.log2(R) * RADIUS_GRID) / RADIUS_GRID)


def tables(K, params, level: int, blocks: np.ndarray, radii: np.ndarray):
    """Node tables (Q, log W, S, edge) of (block, radius) pairs, cached on the compiled module per
    parameter values and rule (at most ``MAX_TABLE_BYTES`` in all; beyond that the cache restarts)."""
    T = int(K.T)
    nn = nodes_per_block(T, level)
    cache = K.__dict__.setdefault("_chamber_tables", {})
    key0 = (tuple(np.asarray(params, float).tolist()), LEVELS[level], KAPPA, CRAD)  # (what the nodes depend on)
    want = [(key0, int(b), float(r)) for b, r in zip(blocks, radii)]
    missing = sorted({w for w in want if w not in cache})
    if missing:
        held = sum(a.nbytes for tab in cache.values() for a in tab)
        if held + len(missing) * nn * (T * T + T + 2) * 8 > MAX_TABLE_BYTES:
            cache.clear()
            missing = sorted(set(want))
        bl = np.array([b for _, b, _ in missing], np.int64)
        rr = np.array([r for _, _, r in missing])
        m = len(missing)
        Qt, Wt = np.empty((m, T, nn)), np.empty((m, nn))
        St, Et = np.empty((m, T * T, nn)), np.empty((m, nn))
        K.chamber_tables(bl, rr, params, chambers(T), *rule(*LEVELS[level]), KAPPA, CRAD, Qt, Wt, St, Et)
        for i, key in enumerate(missing):
            cache[key] = (Qt[i], Wt[i], St[i], Et[i])
    uniq = list(dict.fromkeys(want))
    pos = {key: i for i, key in enumerate(uniq)}
    stack = [np.ascontiguousarray(np.stack([cache[key][j] for key in uniq])) for j in range(4)]
    return [pos[w] for w in want], stack


def evaluate(K, obs, omega, V, params, level: int, growth: np.ndarray):
    """One level of the rule on a batch: g_out, dg_out, extra (log Z, node combinations, 0, edge
    share), status."""
    n, p, T = omega.shape
    nb = len(K.CHAMBER_BLOCKS)
    omega, V = np.ascontiguousarray(omega), np.ascontiguousarray(V)
    R = np.empty((n, nb))
    K.chamber_radii(omega, V, params, RADIUS, np.ascontiguousarray(growth, dtype=float), R)
    R = radius_grid(R)
    g = np.empty((n, p, T))
    dg = np.empty((n, p, T, p, T))
    extra = np.zeros((n, 4))
    status = np.zeros(n, np.int64)
    blocks = np.arange(nb)
    for sel in table_groups(R, nodes_per_block(T, level) * (T * T + T + 2) * 8):
        idx, (Qt, Wt, St, Et) = tables(K, params, level, np.tile(blocks, sel.size), R[sel].ravel())
        tab = np.asarray(idx, np.int64).reshape(sel.size, nb)
        Vs = V if V.shape[0] == 1 else np.ascontiguousarray(V[sel])
        g_s, dg_s, ex_s, st_s = g[sel], dg[sel], extra[sel], status[sel]
        K.chamber_batch(np.ascontiguousarray(obs[sel]), np.ascontiguousarray(omega[sel]), Vs, params, tab, Qt, Wt,
                        St, Et, g_s, dg_s, ex_s, st_s)
        g[sel], dg[sel], extra[sel], status[sel] = g_s, dg_s, ex_s, st_s
    return g, dg, extra, status


def table_groups(R: np.ndarray, table_bytes: int) -> list[np.ndarray]:
    """The samples (rows of R, their blocks' grid radii) in groups whose distinct node tables
    (table_bytes each, one per block and radius) fit ``MAX_TABLE_BYTES``, at least one sample per
    group: the fine levels' tables are ~10^8 bytes each, and a batch of far-tail samples has many
    radii."""
    order = np.lexsort(R.T[::-1])
    cap = max(1, MAX_TABLE_BYTES // max(table_bytes, 1))
    groups, cur, seen = [], [], set()
    for i in order:
        new = {(b, float(r)) for b, r in enumerate(R[i])} - seen
        if cur and len(seen) + len(new) > cap:
            groups.append(np.array(cur))
            cur, seen = [], set()
            new = {(b, float(r)) for b, r in enumerate(R[i])}
        cur.append(i)
        seen |= new
    if cur:
        groups.append(np.array(cur))
    return groups


def residual_covariance(K, V) -> np.ndarray | None:
    """V^-1 Cov_res V^-1 (1 or n, p, T, p, T) of a block marginalised analytically (theory section 3),
    None without one: given the reduced variables its row K keeps the conditional covariance
    sigma^2 N N^T over tokens (sigma^2 = 1 / (V^-1)_KK, N the functionals' null space), the same at
    every point of the reduced posterior, so dg_out gets it once, outside the integral."""
    rows = np.asarray(getattr(K, "MARGINAL_ROWS", ()))
    if not getattr(K, "HAS_MARGINAL", False) or rows.size == 0:
        return None
    k = int(rows[0])
    N = np.asarray(K.MARGINAL_NULL)
    Vinv = np.linalg.inv(V)  # (1 or n, p, p)
    col = Vinv[:, :, k]  # V^-1 e_K
    return np.einsum("n,nk,ts,nl->nktls", 1.0 / Vinv[:, k, k], col, N @ N.T, col)


def residual_rows(res: np.ndarray | None, sel) -> np.ndarray | None:
    """The samples sel of ``residual_covariance`` (shared: leading size 1)."""
    return res if res is None or res.shape[0] == 1 else res[sel]


def final_scale(dg: np.ndarray, res: np.ndarray | None) -> np.ndarray:
    """Per sample, max(1, |dg|) / max(1, |dg + res|) (>= 1 taken): an estimate relative to the size of
    dg_out before the residual covariance, restated (as a bound: the estimate may have come from
    g_out or log Z_out) relative to the dg_out returned. Along a nearly known marginalised row most
    of dg_out cancels against the residual term (-1/V_KK against +1/V_KK), so the returned dg_out
    is smaller and the same absolute error larger relative to it."""
    if res is None:
        return np.ones(dg.shape[0])
    n = dg.shape[0]
    before = np.maximum(1.0, np.abs(dg).reshape(n, -1).max(axis=1))
    after = np.maximum(1.0, np.abs(dg + res).reshape(n, -1).max(axis=1))
    return np.maximum(1.0, before / after)


def run(K, obs, omega, V, params, *, tol: float, start: int | None = None, max_level: int | None = None,
        idx: np.ndarray | None = None, sum_budget: float | None = None):
    """Levels of the chamber rule (or, for an untied first layer, the untied rule) until the
    estimate meets tol, for the samples idx (default all). ``sum_budget``: the levels also stop
    once the estimates of the samples idx sum to at most this (a caller controlling the mean
    error of a batch, e.g. the state evolution's average over its points).

    Returns (done, g_out, dg_out, log Z_out, estimate, evaluations, status) for idx; ``done``
    marks the samples whose estimate is <= tol (the others keep the finest level reached). dg_out
    is without a marginalised block's residual covariance (``residual_covariance``, added by the
    caller), the estimate relative to dg_out with it."""
    untied = untied_applies(K)
    levels = UNTIED_LEVELS if untied else LEVELS
    run_level = untied_evaluate if untied else evaluate
    idx = np.arange(omega.shape[0]) if idx is None else np.asarray(idx)
    m, p, T = len(idx), omega.shape[1], omega.shape[2]
    top = len(levels) - 1 if max_level is None else min(max_level, len(levels) - 1)
    start = min(first_level(tol, UNTIED_MEDIAN_DIFF if untied else MEDIAN_DIFF) if start is None else start, top)
    sub_v = (lambda a: a[idx]) if V.shape[0] != 1 else (lambda a: a)
    g = np.full((m, p, T), np.nan)
    dg = np.full((m, p, T, p, T), np.nan)
    lz = np.full(m, np.nan)
    est = np.full(m, np.inf)
    evals = np.zeros(m)
    status = np.zeros(m, np.int64)
    done = np.zeros(m, bool)
    growth = np.ones(m)
    active = np.arange(m)
    prev = None
    last_d = np.full(m, np.inf)  # each sample's previous level difference
    res = residual_covariance(K, V)  # (differences relative to the dg_out finally returned)
    for level in range(max(start - 1, 0), top + 1):
        if active.size == 0:
            break
        sel = idx[active]
        gl, dgl, ex, st = run_level(K, obs[sel], omega[sel], sub_v(V)[active] if V.shape[0] != 1 else V, params,
                                    level, growth[active])
        # a domain whose outermost nodes carry weight grows (and the level is redone)
        for _ in range(MAX_GROWTH):
            wide = np.flatnonzero((st == 0) & (ex[:, 3] > EDGE_TOL))
            if wide.size == 0:
                break
            growth[active[wide]] *= GROWTH
            s2 = idx[active[wide]]
            g2, dg2, ex2, st2 = run_level(K, obs[s2], omega[s2], V if V.shape[0] == 1 else sub_v(V)[active[wide]],
                                          params, level, growth[active[wide]])
            gl[wide], dgl[wide], ex[wide], st[wide] = g2, dg2, ex2, st2
            if prev is not None:  # the coarser level is not comparable on another domain
                prev[0][wide] = np.nan
        evals[active] += ex[:, 1]
        status[active] = st
        g[active], dg[active], lz[active] = gl, dgl, ex[:, 0]
        if prev is not None:
            r = residual_rows(res, idx[active])
            r = 0.0 if r is None else r
            d = difference(gl, dgl + r, prev[0], prev[1] + r, ex[:, 0], prev[2])
            d = np.where(np.isfinite(d), d, np.inf)
            # a difference that did not shrink from the level before: the rule is not yet in its
            # asymptotic regime (levels can then come close by chance), so the two together
            prior = last_d[active]
            grew = np.isfinite(prior) & (d >= prior)
            last_d[active] = d
            d = np.where(grew, d + prior, d)
            e = np.maximum(d, ex[:, 3])
            est[active] = e
            ok = (st == 0) & (e <= tol) & np.isfinite(gl).all(axis=(1, 2)) & np.isfinite(dgl).all(axis=(1, 2, 3, 4))
            done[active[ok]] = True
            keep = ~ok & (st == 0)
            if sum_budget is not None:  # of those, the ones the batch's budget still needs
                keep &= _within_budget(est, active, sum_budget)
            status[active[~ok & (st != 0)]] = st[~ok & (st != 0)]
            active = active[keep]
            prev = (gl[keep], dgl[keep], ex[keep, 0])
        else:
            keep = st == 0
            active = active[keep]
            prev = (gl[keep], dgl[keep], ex[keep, 0])
    return done, g, dg, lz, est, evals, status


def _within_budget(est: np.ndarray, active: np.ndarray, budget: float) -> np.ndarray:
    """Which samples of this level (``active``) the batch's budget needs at the next level, where
    the estimates of all samples (``est``) may sum to ``budget``: the largest ones, until their
    expected gain (each estimate falling by ``BUDGET_GAIN`` per level) covers the excess; none
    once the sum is within it."""
    excess = float(np.sum(est)) - budget
    go = np.zeros(active.size, bool)
    if not excess > 0:
        return go
    e = est[active]
    order = np.argsort(-e)
    gain = np.cumsum(e[order] * (1.0 - 1.0 / BUDGET_GAIN))
    need = int(np.searchsorted(gain, excess)) + 1
    go[order[:need]] = True
    return go


# ----------------------------------------------------------------------------- untied first layer
# (angle nodes, t_q nodes, |d| nodes, Gauss-Hermite nodes in s) per level
UNTIED_LEVELS = ((4, 8, 8, 8), (6, 10, 10, 12), (8, 14, 14, 16), (10, 18, 18, 24), (13, 24, 24, 32))
UNTIED_MEDIAN_DIFF = (math.inf, 4e-3, 1e-3, 1e-4, 1e-5)  # (two untied layers at T = 2, SE points)


def untied_evaluate(K, obs, omega, V, params, level: int, growth: np.ndarray):
    """One level of the untied rule (``untied_one``) on a batch: as ``evaluate``."""
    n, p, T = omega.shape
    n_x, n_q, n_k, n_s = UNTIED_LEVELS[level]
    xs, wx = np.polynomial.legendre.leggauss(n_x)
    qs, wq = np.polynomial.legendre.leggauss(n_q)
    ks, wk = np.polynomial.legendre.leggauss(n_k)
    gx, gw = np.polynomial.hermite.hermgauss(n_s)
    g = np.empty((n, p, T))
    dg = np.empty((n, p, T, p, T))
    extra = np.zeros((n, 4))
    status = np.zeros(n, np.int64)
    K.untied_batch(np.ascontiguousarray(obs), np.ascontiguousarray(omega), np.ascontiguousarray(V), params,
                   xs, wx, qs, wq, ks, wk, gx, gw, KAPPA, CRAD, RADIUS, np.ascontiguousarray(growth, dtype=float),
                   g, dg, extra, status)
    return g, dg, extra, status
