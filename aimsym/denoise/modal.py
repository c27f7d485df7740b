"""Mode-centred, error-controlled integration of reduced posteriors of any dimension k.

The reduced posterior of an exact path (theory section 3) lives on k free entries u and two or
more branches; for k >= 3 it is smooth but often multimodal (the sign images of each earlier
layer's index, branches of the attention) and sharply anisotropic where one layer is nearly known.
This module integrates it as follows (kernels in ``modal_template.py``, compiled per model):

1. *Modes.* log f_b(u) is screened on a tensor grid over the prior of u (``SCREEN`` points per
   axis, in prior-whitened coordinates); damped Newton with finite-difference derivatives runs
   from the best ``N_START`` distinct grid points per branch and from the sign images of every
   mode found. Each distinct mode j gives a Laplace Gaussian phi_j (covariance the inverse
   -Hessian, times ``INFLATE``^2) and a Laplace mass a_j.
2. *Partition of unity.* int f_b = sum_j int f_b a_j phi_j / q_b with q_b = sum_i a_i phi_i
   over the branch's components; each term is E_{phi_j}[a_j f_b / q_b], smooth where phi_j
   matters, integrated by a standard-normal rule mapped onto phi_j. No region is counted twice.
3. *Cubature and error.* Each term is written over (-1, 1)^k (u = m_j + L_j x,
   x_i = y_i / (1 - y_i^2): no truncation) and integrated by globally adaptive subdivision with
   the Genz-Malik degree-7 rule (the region with the largest |I7 - I5| is halved along its axis
   of largest fourth difference). The error estimate is the change of all the moment sums since
   the region count was half of the current one, propagated to first order to g_out and dg_out
   (relative to their size, at least 1) and log Z_out (absolute); it stops when that is <= tol,
   or at ``max_regions`` regions (the budget), where the estimate is reported as it stands and
   a RuntimeWarning counts the samples above tol. At k >= 6 (``rqmc.MIN_DIM``) randomised QMC on
   the same partition of unity replaces it (``aimsym.denoise.rqmc``: its regions' 2^k points cost
   more than they resolve there).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
from scipy.stats import norm, qmc

from . import chamber, rqmc
from .output import difference, mean_target_met

TEMPLATE = Path(__file__).with_name("modal_template.py")
# the chamber rule's driver (aimsym.denoise.chamber), appended with this one
CHAMBER_TEMPLATE = Path(__file__).with_name("chamber_template.py")
MARKER = "# ---- template begins ----"
# screening grid: points per axis of the tensor Gauss-Hermite grid over the prior of u, spread
# by SCREEN_SPREAD (so the grid reaches about 3 prior sd)
SCREEN = {1: 15, 2: 9, 3: 5, 4: 4, 5: 3, 6: 3}
SCREEN_SPREAD = 1.0
# node budgets of the tensor rules, whose size grows as n^D (3^13 screening nodes and a 5^13-node
# fast rule, 127 GB, for three untied layers at T = 3): a larger screen takes SCREEN_MAX
# scrambled Sobol points (and the prior mean), and the fast path runs only the rules that fit
SCREEN_MAX = 3**9
FAST_MAX_NODES = 400_000
# Newton starts per branch: with one layer nearly known the posterior splits into narrow modes of
# similar height, and the three best grid points all led to the largest one (docs/denoiser.md,
# "Narrow modes": two layers at T = 3, V = diag(0.5, 1e-3)); against a 17^3-grid, 128-start
# search, 24 starts missed up to 1.6 % of the Laplace mass at 6 of 250 such samples (two layers,
# T = 3), 48 starts at most 5e-6 (far tails: 7 misses up to 35 % against 2 up to 2 %, where the
# chamber rule goes first); about 1 ms more per sample
N_START = 48
INFLATE = 1.0
MAX_COMP = 64
# the largest estimate of a stage that stopped above tol whose result still counts as evidence
# against another's (``cross_checked``): three digits
EVIDENCE = 1e-3
# default budget: regions of the adaptive cubature per sample (each costs one Genz-Malik rule,
# 2^D + 2 D^2 + 1 evaluations; memory (1 + pT + pT (pT + 1) / 2) doubles per region)
MAX_REGIONS = 100_000
# the adaptive cubature's claims within tol are checked by the same cubature at tol / VERIFY
# (verify_adaptive; VERIFY_RUNS > 1 checks a disagreeing finer run again)
VERIFY = 100.0
VERIFY_RUNS = 1
# fast path: tensor Gauss-Hermite sizes per axis, per dimension (successive pairs give the estimate)
FAST = True
# floor of the fast path's estimate: two rules agreeing to rounding still differ from the exact
# value by the rounding of the moment sums (4.6e-12 against an estimate of 2.2e-12 seen, k = 2)
FAST_ROUNDING = 1e-11
FAST_SIZES = {1: (12, 18, 27, 40), 2: (8, 12, 18, 27), 3: (6, 9, 13, 19), 4: (5, 7, 10, 14), 5: (4, 6, 8), 6: (3, 5, 7)}


def _source(kernels) -> str:
    text = Path(kernels.__file__).read_text()
    for path in (TEMPLATE, CHAMBER_TEMPLATE):
        tmpl = path.read_text()
        text += "\n\n" + tmpl[tmpl.index(MARKER) + len(MARKER):]
    return text


def module_path(kernels, text: str | None = None) -> Path:
    """Where ``load`` keeps the model's assembled module (named by its content)."""
    from ..derive.files import cache_dir

    key = hashlib.sha1((_source(kernels) if text is None else text).encode()).hexdigest()[:16]
    return cache_dir() / "modal" / f"{kernels.NAME}_{key}.py"


def load(kernels):
    """The model's generated module with the modal driver appended, imported from a file in the
    cache directory keyed by its content (so numba's on-disk cache serves it)."""
    from ..derive.files import import_module

    text = _source(kernels)
    path = module_path(kernels, text)
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # (per process: concurrent writers)
        tmp.write_text(text)
        tmp.replace(path)
    return import_module(path)


@lru_cache(maxsize=64)
def _gh1(n: int):
    x, w = np.polynomial.hermite_e.hermegauss(n)
    return x, w / np.sqrt(2 * np.pi)


@lru_cache(maxsize=64)
def tensor(D: int, n: int):
    """Tensor Gauss-Hermite rule for the standard normal: (nodes, log weights, signs)."""
    x, w = _gh1(n)
    grids = np.meshgrid(*([x] * D), indexing="ij")
    nodes = np.stack([g.reshape(-1) for g in grids], axis=1)
    lw = sum(np.log(w)[i.reshape(-1)] for i in np.meshgrid(*([np.arange(n)] * D), indexing="ij"))
    return np.ascontiguousarray(nodes), np.ascontiguousarray(lw), np.ones(len(lw))


def fast_rules(D: int):
    """The fast path's rules on the standard normal in D dimensions: [(nodes, weights)], those
    within FAST_MAX_NODES; none where fewer than two fit (the estimate compares successive rules)."""
    sizes = [m for m in FAST_SIZES.get(D, (3, 5)) if m**D <= FAST_MAX_NODES]
    if len(sizes) < 2:
        return []
    out = []
    for m in sizes:
        nodes, lw, _ = tensor(D, m)
        out.append((nodes, np.exp(lw)))
    return out


@lru_cache(maxsize=16)
def screen_nodes(D: int) -> np.ndarray:
    """The mode search's screening points in prior-whitened coordinates: the tensor grid of
    SCREEN points per axis where it has at most SCREEN_MAX nodes, otherwise the prior mean and
    scrambled Sobol points mapped to the standard normal (fixed seed: a result is reproducible)."""
    n = SCREEN.get(D, 3)
    if n**D <= SCREEN_MAX:
        return np.ascontiguousarray(tensor(D, n)[0] * SCREEN_SPREAD)
    # (the largest power of two within the budget keeps the Sobol points balanced)
    u = qmc.Sobol(D, scramble=True, seed=np.random.default_rng([D, 0])).random_base2(SCREEN_MAX.bit_length() - 1)
    x = norm.ppf(np.clip(u, 1e-12, 1 - 1e-12))
    return np.ascontiguousarray(np.vstack([np.zeros((1, D)), x]) * SCREEN_SPREAD)


def flips(kernels) -> np.ndarray:
    """Sign patterns on u of the link's symmetries: every combination of the sign flips of the
    row groups in EVEN_ROWS that touch free entries only (a solved row's flip is a branch)."""
    free_k = list(np.asarray(kernels.FREE_K))
    solved = {k for k, _ in kernels.SOLVED}
    gens = []
    for rows in kernels.EVEN_ROWS:
        if any(r in solved for r in rows):
            continue
        v = np.array([-1.0 if k in rows else 1.0 for k in free_k])
        if np.any(v < 0):
            gens.append(v)
    pats = {tuple(np.ones(len(free_k)))}
    for g in gens:
        pats |= {tuple(np.array(p) * g) for p in pats}
    pats.discard(tuple(np.ones(len(free_k))))
    out = np.array(sorted(pats), dtype=float).reshape(-1, len(free_k))
    return np.ascontiguousarray(out)


@lru_cache(maxsize=16)
def genz_malik(D: int):
    """Genz-Malik degree-7 rule on [-1, 1]^D with its embedded degree-5 rule, weights
    normalised to the mean (multiply by the volume): (points, w7, w5). Points are ordered
    centre, +-lambda2 e_i, +-lambda3 e_i, +-lambda4 (e_i +- e_j), (+-lambda5)^D."""
    l2, l3, l4, l5 = math.sqrt(9 / 70), math.sqrt(9 / 10), math.sqrt(9 / 10), math.sqrt(9 / 19)
    W7 = [(12824 - 9120 * D + 400 * D * D) / 19683, 980 / 6561, (1820 - 400 * D) / 19683, 200 / 19683,
          6859 / 19683 / 2**D]
    W5 = [(729 - 950 * D + 50 * D * D) / 729, 245 / 486, (265 - 100 * D) / 1458, 25 / 729, 0.0]
    pts, w7, w5 = [np.zeros(D)], [W7[0]], [W5[0]]
    for lam, k in ((l2, 1), (l3, 2)):
        for i in range(D):
            for s in (1.0, -1.0):
                x = np.zeros(D)
                x[i] = s * lam
                pts.append(x)
                w7.append(W7[k])
                w5.append(W5[k])
    for i in range(D):
        for j in range(i + 1, D):
            for s in (1.0, -1.0):
                for t in (1.0, -1.0):
                    x = np.zeros(D)
                    x[i], x[j] = s * l4, t * l4
                    pts.append(x)
                    w7.append(W7[3])
                    w5.append(W5[3])
    for sg in itertools.product((1.0, -1.0), repeat=D):
        pts.append(l5 * np.array(sg))
        w7.append(W7[4])
        w5.append(0.0)
    return np.ascontiguousarray(np.array(pts)), np.array(w7), np.array(w5)


def run(kernels, obs, omega, V, params, *, tol: float, max_regions: int = MAX_REGIONS,
        max_combinations: int | None = None, mean_tol: float | None = None):
    """Error-controlled integration of a flattened batch (V leading size 1 or n): the chamber
    rule (``aimsym.denoise.chamber``, where the model has attention blocks) first for samples
    whose prior is broad next to the attention's switching layers, the fast path on the Laplace
    mixture first for the others; then the other of the two, then the adaptive cubature.
    ``mean_tol``: refinement also ends once the batch's mean estimate is at most this (a caller
    that needs the mean error of the batch, as the state evolution does, leaves the costly
    far-tail samples at a coarser level; each keeps its own honest estimate).
    Returns g_out, dg_out, log Z_out, error estimate, function evaluations, budget-hit flags
    and a STATUS array."""
    K = load(kernels)
    D = int(K.INTEGRAL_DIM)
    n = omega.shape[0]
    p, T = omega.shape[1:]
    g = np.empty((n, p, T))
    dg = np.empty((n, p, T, p, T))
    extra = np.zeros((n, 4))
    extra[:, 2] = np.inf
    status = np.zeros(n, np.int64)
    done = np.zeros(n, bool)
    use_chamber = chamber.applies(K)
    tried = np.zeros(n, bool)
    others = []  # every stage's result (idx, g, dg, log Z, estimate): cross-checked at the end

    def spare(idx):
        """What the samples idx may sum to under mean_tol, given the others' estimates (None: no
        batch target; -inf while another sample has none yet)."""
        if mean_tol is None:
            return None
        outside = np.ones(n, bool)
        outside[idx] = False
        return mean_tol * n - float(np.sum(extra[outside, 2]))

    def settled():
        return mean_target_met(extra[:, 2], mean_tol)

    def chamber_stage(idx):
        if not use_chamber or idx.size == 0:
            return
        ok, cg, cdg, clz, cest, cev, cst = chamber.run(K, obs, omega, V, params, tol=tol, idx=idx,
                                                       max_level=chamber.max_level(K, max_combinations),
                                                       sum_budget=spare(idx))
        tried[idx] = True
        others.append((idx[cst == 0], cg[cst == 0], cdg[cst == 0], clz[cst == 0], cest[cst == 0]))
        better = (cst == 0) & (cest < extra[idx, 2])
        sel = idx[better]
        g[sel], dg[sel] = cg[better], cdg[better]
        extra[sel, 0], extra[sel, 2] = clz[better], cest[better]
        extra[idx, 1] += cev
        done[idx[ok]] = True

    if use_chamber:
        chamber_stage(np.flatnonzero(chamber.broad(K, omega, V, params)))
    rest = np.flatnonzero(~done) if not settled() else np.zeros(0, np.int64)
    if rest.size:
        m = rest.size
        sub = (lambda a: a[rest]) if V.shape[0] != 1 else (lambda a: a)
        ob, om, Vr = np.ascontiguousarray(obs[rest]), np.ascontiguousarray(omega[rest]), np.ascontiguousarray(sub(V))
        nc, (cb, cm, cL, cla) = modes(K, ob, om, Vr, params)
        st = np.zeros(m, np.int64)
        st[nc < 0] = -nc[nc < 0]
        gf, dgf, exf = np.empty((m, p, T)), np.empty((m, p, T, p, T)), np.zeros((m, 4))
        exf[:, 2] = np.inf
        fast = np.zeros(m, bool)
        if FAST:
            fast = _fast_path(K, ob, om, Vr, params, nc, cb, cm, cL, cla, tol, gf, dgf, exf, st)
        tested = np.isfinite(exf[:, 2])
        others.append((rest[tested], gf[tested], dgf[tested], exf[tested, 0], exf[tested, 2]))
        sel = rest[fast]
        g[sel], dg[sel], extra[sel] = gf[fast], dgf[fast], exf[fast]
        done[sel] = True
        # the fast path's best result where it missed tol, if its estimate beats the chamber rule's
        # (the later stages keep whichever estimate is the smaller)
        kept = ~fast & (exf[:, 2] < extra[rest, 2])
        sel = rest[kept]
        g[sel], dg[sel], extra[sel] = gf[kept], dgf[kept], exf[kept]
        # a failure of the mode search counts only where the chamber rule has no result either
        bad = (st != 0) & ~np.isfinite(extra[rest, 2])
        status[rest[bad]] = st[bad]
        # the chamber rule for samples the fast path did not settle and it has not tried
        chamber_stage(rest[~fast & (st == 0) & ~tried[rest]])
        left = np.flatnonzero(~done[rest] & (st == 0))
        if left.size and not settled() and D >= rqmc.MIN_DIM:
            # (the adaptive cubature's regions grow as 2^k: at k >= 6 randomised QMC replaces it)
            g3, dg3, ex3, st3 = rqmc.run(K, ob, om, Vr, params, nc, cb, cm, cL, cla, left, tol)
            idx = rest[left]
            ok3 = st3 == 0
            others.append((idx[ok3], g3[ok3], dg3[ok3], ex3[ok3, 0], ex3[ok3, 2]))
            # heavy-tailed weights (``rqmc.TAIL_MAX``): posterior mass the rules converge without
            # seeing; no stage's estimate holds there (two untied layers, T = 3: the fast path's 0.62
            # for a difference of 1.9 to a run with 32x the points, whose own spread was 0.58), so the
            # sample gets this stage's values, from the most points, and the estimate inf
            heavy = ex3[:, 4] >= rqmc.TAIL_MAX
            better = ok3 & (~(extra[idx, 2] <= ex3[:, 2]) | ~np.isfinite(extra[idx, 2]) | heavy)
            ex3[:, 1] += extra[idx, 1]
            g[idx[better]], dg[idx[better]], extra[idx[better]] = g3[better], dg3[better], ex3[better, :4]
            extra[idx[~better], 1] = ex3[~better, 1]
            done[idx[ok3 & (ex3[:, 2] <= tol)]] = True
            lost = ~ok3 & ~np.isfinite(extra[idx, 2])  # (a failure counts where no stage has a result)
            status[idx[lost]] = st3[lost]
            left = left[:0]  # (the adaptive cubature's 2^k-point regions cost more and gain less there)
        if left.size and not settled():
            gp, w7, w5 = genz_malik(D)

            def adaptive(sel, t):
                """The adaptive cubature at tol t for the samples rest[sel] (estimates relative to
                the dg_out finally returned, as the chamber rule's)."""
                Vs = Vr[sel] if Vr.shape[0] != 1 else Vr
                ga, dga = np.empty((sel.size, p, T)), np.empty((sel.size, p, T, p, T))
                exa, sta = np.empty((sel.size, 4)), np.zeros(sel.size, np.int64)
                K.modal_adaptive(ob[sel], om[sel], Vs, params, nc[sel], cb[sel], cm[sel], cL[sel], cla[sel],
                                 gp, w7, w5, float(t), int(max_regions), ga, dga, exa, sta)
                exa[:, 2] *= chamber.final_scale(dga, chamber.residual_covariance(K, Vs))
                return ga, dga, exa, sta

            g2, dg2, ex2, st2 = adaptive(left, tol)
            verify_adaptive(adaptive, left, tol, g2, dg2, ex2, st2)
            # keep the chamber rule's result where its estimate is the smaller
            idx = rest[left]
            others.append((idx[st2 == 0], g2[st2 == 0], dg2[st2 == 0], ex2[st2 == 0, 0], ex2[st2 == 0, 2]))
            better = (st2 == 0) & ~(extra[idx, 2] <= ex2[:, 2])
            ex2[:, 1] += extra[idx, 1]
            g[idx[better]], dg[idx[better]], extra[idx[better]] = g2[better], dg2[better], ex2[better]
            status[idx[(st2 != 0) & ~np.isfinite(extra[idx, 2])]] = st2[(st2 != 0) & ~np.isfinite(extra[idx, 2])]
    extra[:, 2] = cross_checked(g, dg, extra[:, 0], extra[:, 2], others, tol)
    if getattr(K, "HAS_MARGINAL", False):
        add_residual_covariance(K, V, dg)
    return g, dg, extra[:, 0], extra[:, 2], extra[:, 1], extra[:, 3] > 0, status


def modes(K, obs, omega, V, params):
    """Step 1 for a batch (V leading size 1 or n): the components of each sample's partition of
    unity, (cb, cm, cL, cla) = branch, mean, Cholesky factor and log Laplace mass, and their
    count nc (negative: a failure status of the search)."""
    D = int(K.INTEGRAL_DIM)
    n = obs.shape[0]
    xs = screen_nodes(D)
    fl = flips(K)
    if fl.shape[0] == 0:
        fl = np.zeros((0, D))
    comp = (np.zeros((n, MAX_COMP), np.int64), np.zeros((n, MAX_COMP, D)), np.zeros((n, MAX_COMP, D, D)),
            np.zeros((n, MAX_COMP)))
    nc = np.zeros(n, np.int64)
    K.modal_modes(obs, omega, V, params, xs, fl, N_START, INFLATE, *comp, nc)
    return nc, comp


def budget_name(kernels, max_regions: int) -> str:
    """The last stage's budget, as a warning names it."""
    if int(kernels.INTEGRAL_DIM) >= rqmc.MIN_DIM:
        return f"randomised QMC ({rqmc.MAX_POINTS} points x {rqmc.REPS} scramblings)"
    return f"max_regions={max_regions}"


def verify_adaptive(adaptive, sel, tol, g, dg, ex, st, runs: int = VERIFY_RUNS):
    """The adaptive cubature's claim checked by itself at a VERIFY times smaller tol, in place.

    Its regional estimate (degree 7 against degree 5) cannot see a narrow feature that neither rule
    resolves: with one layer nearly known a run can stop at tol while a finer one finds more mass
    (docs/denoiser.md, "Narrow modes"). A claim within tol is rerun at tol / VERIFY; where the two
    agree within their estimates the finer values are kept with the coarser estimate (the claim,
    verified); where they disagree the distance plus the finer run's own estimate is the estimate
    (and with ``runs`` > 1 the finer run is checked the same way)."""
    todo = np.flatnonzero((st == 0) & (ex[:, 2] <= tol))
    claim = ex[:, 2].copy()  # each sample's last run's own estimate
    t = tol
    for _ in range(runs):
        if todo.size == 0:
            return
        t /= VERIFY
        g2, dg2, ex2, st2 = adaptive(sel[todo], t)
        ex[todo, 1] += ex2[:, 1]
        fine = st2 == 0
        i, j = todo[fine], np.flatnonzero(fine)
        d = difference(g2[j], dg2[j], g[i], dg[i], ex2[j, 0], ex[i, 0])
        agree = d <= claim[i] + ex2[j, 2]
        ex[i, 2] = np.where(agree, np.maximum(claim[i], ex2[j, 2]), d + ex2[j, 2])
        claim[i] = ex2[j, 2]
        g[i], dg[i], ex[i, 0] = g2[j], dg2[j], ex2[j, 0]
        ex[i, 3] = np.where(agree, ex[i, 3], ex2[j, 3])  # (a verified claim did not stop at the budget)
        todo = i[~agree & (ex2[j, 2] <= t)]


def cross_checked(g, dg, lz, est, others, tol: float) -> np.ndarray:
    """The estimates of the results kept, raised where another stage's result disagrees with one
    beyond both estimates: one of the two claims is then false, and the other's claim, if it
    holds, bounds the kept result's error by their difference plus the other's estimate. (A stage
    that found only some of the posterior's modes, or whose nodes never saw a thin switching
    layer, can report a small estimate for a wrong integral: its rule converges on what it saw.)
    The other stage's claim is evidence where its estimate is within tol or within
    ``EVIDENCE`` (a stage that stopped above a tight tol with a few digits: at a far-tail sample
    the cubature converged 2.7e-5 off with an estimate of 1e-9, while the chamber rule's finest
    level within budget was right to its own 3.6e-7, docs/denoiser.md); a larger estimate says
    the rule has not resolved the integral, and its last change is no evidence. Per quantity
    (g_out, dg_out: estimates relative to each result's own size, at least 1; log Z_out:
    absolute) the two claims together allow |a - b| <= est s_a + est_b s_b."""
    est = est.copy()
    for idx, go, dgo, lzo, eo in others:
        if idx.size == 0:
            continue
        n = idx.size
        real = (eo <= max(tol, EVIDENCE)) & np.isfinite(lzo) & np.isfinite(go.reshape(n, -1)).all(axis=1) \
            & np.isfinite(dgo.reshape(n, -1)).all(axis=1)
        e = est[idx]
        raised = np.zeros(n)
        for a, b, absolute in ((g[idx].reshape(n, -1), go.reshape(n, -1), False),
                               (dg[idx].reshape(n, -1), dgo.reshape(n, -1), False),
                               (lz[idx][:, None], lzo[:, None], True)):
            sa = np.ones(n) if absolute else np.maximum(1.0, np.abs(a).max(axis=1))
            sb = np.ones(n) if absolute else np.maximum(1.0, np.abs(b).max(axis=1))
            gap = np.abs(a - b).max(axis=1)
            clash = real & ~(gap <= e * sa + eo * sb)
            raised = np.where(clash, np.maximum(raised, (gap + eo * sb) / sa), raised)
        est[idx] = np.maximum(e, raised)
    return est


def _fast_path(K, obs, omega, V, params, nc, cb, cm, cL, cla, tol, g, dg, extra, status):
    """Standard-normal rules of increasing size on every component (FAST_SIZES). The change d_l
    between rules l - 1 and l, propagated to g_out, dg_out and log Z_out, bounds the error of
    rule l - 1; once two successive changes decrease (the rule converges), d_l also bounds the
    error of rule l, which is reported with d_l as its estimate when that is <= tol (d_l + d_{l-1}
    where they do not decrease: both at rounding level, say). Returns the
    mask of samples done (the rest go to the adaptive driver)."""
    D = int(K.INTEGRAL_DIM)
    n, p, T = omega.shape
    nq = 1 + p * T + p * T * (p * T + 1) // 2
    done = np.zeros(n, bool)
    active = np.flatnonzero((nc > 0) & (status == 0))
    prev = prev_d = None
    evals = np.zeros(n)
    res = chamber.residual_covariance(K, V)  # (estimates relative to the dg_out finally returned)
    for nodes, w in fast_rules(D):
        if active.size == 0:
            break
        tot = np.zeros((active.size, nq))
        fshift = np.empty(active.size)
        K.modal_rule(obs, omega, V, params, nc, cb, cm, cL, cla, nodes, w, active, tot, fshift,
                     np.zeros((active.size, 0)))
        evals[active] += len(w) * nc[active]
        d = np.full(active.size, np.inf)
        if prev is not None:
            gg, dd = np.empty((active.size, p, T)), np.empty((active.size, p, T, p, T))
            ex, st = np.zeros((active.size, 4)), np.zeros(active.size, np.int64)
            K.modal_finish(omega, V, active, tot, np.abs(tot - prev), fshift, gg, dd, ex, st)
            d = ex[:, 2] / K.MODAL_SAFETY * chamber.final_scale(dd, chamber.residual_rows(res, active))
            # not decreasing (both changes at rounding level, or not yet converging): the sum
            est = np.maximum(np.where(d < prev_d, d, d + prev_d), FAST_ROUNDING)
            fine = (st == 0) & np.isfinite(gg).all(axis=(1, 2)) & np.isfinite(dd).all(axis=(1, 2, 3, 4))
            ok = fine & (est <= tol)
            # every sample keeps its best rule so far (the smallest estimate); those within tol are done
            better = fine & (est < extra[active, 2])
            sel = active[better]
            g[sel], dg[sel], extra[sel] = gg[better], dd[better], ex[better]
            extra[sel, 2] = est[better]
            extra[active, 1] = evals[active]
            done[active[ok]] = True
            active, tot, d = active[~ok], tot[~ok], d[~ok]
        prev, prev_d = tot, d
    return done


def add_residual_covariance(K, V, dg):
    """dg_out += ``chamber.residual_covariance`` (a block marginalised analytically)."""
    res = chamber.residual_covariance(K, V)
    if res is not None:
        dg += res
