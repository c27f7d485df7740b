"""Importance-sampled randomised quasi-Monte Carlo on the modal partition of unity (k >= 6).

Each partition-of-unity term E_{phi_j}[a_j f / q] of ``aimsym.denoise.modal`` is integrated by
points of a Student-t proposal t_j around the component (u = m_j + L_j x, x multivariate t with
``NU`` degrees of freedom) with weights phi(x) / t(x): the integrand a_j f phi_j / (q t_j) is at most
f / t_j, bounded where f has the prior's Gaussian tails, so no weight can dominate. The points are
scrambled Sobol, ``REPS`` independent scramblings. Every replicate gives g_out, dg_out and
log Z_out; their spread is a statistical error, and the estimate is ``SAFETY`` times the largest
standard error of the mean over the entries (relative to their size, at least 1, as the other
stages). The points double until the estimate meets tol or ``max_points`` per replicate.

A spread measures the error only where the weights have a finite variance. Where the posterior
has mass the modes' Gaussians do not cover (a plateau between and around them, two untied layers
at T = 3), a rare point far out in a component's proposal carries a large weight, the replicates
agree until one meets it, and the spread understated the actual error by up to 3x
(docs/denoiser.md). So the tail of the first pass's per-point weights is fitted by a generalised
Pareto law (``aimsym.numerics.pareto_tail_index``); a sample whose shape is at least ``TAIL_MAX``
runs again with a wide component per branch in its proposal (``defensive``), and if still heavy-
tailed, with components centred on its heaviest points (``discover``). One that stays heavy-
tailed gets the estimate inf: its error is not controlled, and a warning counts it.

Where the cascade's cubature needs 14 s for an estimate of 0.36 (four layers, k = 6), this stage
reaches ~1e-3 in about two seconds (docs/performance.md); its error falls as about N^-2/3, so it
is the rule for moderate accuracy at large k, not for 1e-8.
"""

from __future__ import annotations

import warnings

import numpy as np
from scipy.special import gammaln
from scipy.stats import chi2, norm, qmc

from ..numerics import pareto_tail_index, tail_size
from . import chamber

NU = 4.0
REPS = 8
# a replicate mean's standard error times SAFETY is the estimate: a t quantile with REPS - 1 = 7
# degrees of freedom (3.5 at 99.5 %, two-sided), raised for the maximum over the entries
SAFETY = 4.0
START = 4096
MAX_POINTS = 2**17
# the scramblings' seed (fixed: a result is reproducible; a check of the stage against itself
# must change it, or the two runs share their first points)
SEED = 0
MIN_DIM = 6
# a sample whose sums overflow has its components' log masses raised by SHIFT (up to SHIFT_TRIES
# times): exp overflows above 709, and the rescaled earlier sums may underflow to 0 (negligible then)
SHIFT = 700.0
SHIFT_TRIES = 6
# population Monte Carlo steps before the replicates, each with REFIT_POINTS points
REFITS = 2
REFIT_POINTS = 4096
# the defensive component per branch (``defensive``), for the samples whose first pass is heavy-
# tailed: the moment-matched Gaussian of the branch's components, DEFENSIVE_WIDTH times wider, with
# DEFENSIVE_SHARE of their mass. At two untied layers, T = 3, it took 17 of the 24 samples with
# heavy-tailed weights below TAIL_MAX (width 5: 15); on every sample of four layers at T = 2 it
# cost 36 % more time for the same estimates, hence only where needed (docs/denoiser.md)
DEFENSIVE_WIDTH = 3.0
DEFENSIVE_SHARE = 0.1
# the Pareto shape of the weights' tail from which the spread is not an estimate: 1/2 is where
# the variance becomes infinite; at two untied layers, T = 3, every sample whose spread understated
# the actual error had a shape >= 0.81, none of the shapes in [1/2, 0.7) did (docs/denoiser.md)
TAIL_MAX = 0.7
# rounds of components centred on the heaviest points (``discover``) for a sample still heavy-
# tailed with the defensive component; DISCOVER_NEW components per round, from DISCOVER_POINTS points
DISCOVER_ROUNDS = 2
DISCOVER_NEW = 4
DISCOVER_POINTS = 16384


def t_points(engine, D: int, n: int, nu: float = NU):
    """n further points of a scrambled Sobol engine (dimension D + 1) mapped to the multivariate
    Student t in D dimensions, with the weights phi(x) / t_nu(x) (unnormalised)."""
    s = np.clip(engine.random(n), 1e-300, 1 - 1e-16)
    x = norm.ppf(s[:, :D]) / np.sqrt(chi2.ppf(s[:, D], nu) / nu)[:, None]
    r2 = np.einsum("ij,ij->i", x, x)
    log_t = gammaln((nu + D) / 2) - gammaln(nu / 2) - D / 2 * np.log(nu * np.pi) - (nu + D) / 2 * np.log1p(r2 / nu)
    log_phi = -D / 2 * np.log(2 * np.pi) - r2 / 2
    return np.ascontiguousarray(x), np.exp(log_phi - log_t)


def run(K, obs, omega, V, params, nc, cb, cm, cL, cla, active, tol: float, *, max_points: int = MAX_POINTS,
        seed: int | None = None):
    """The stage for the samples ``active`` of a batch (components from ``modal_modes``).
    Returns g_out, dg_out and extra [log Z_out, evaluations, estimate, budget hit, Pareto shape of
    the weights' tail], indexed like active, and a status array. A sample whose first pass is
    heavy-tailed (``TAIL_MAX``) stops there and runs again with a defensive component per branch;
    if still heavy-tailed, up to ``DISCOVER_ROUNDS`` times more with components centred on its
    heaviest points (``discover``); warns with the count left heavy-tailed (estimate inf)."""
    seed = SEED if seed is None else seed
    n = active.size
    p, T = omega.shape[1:]
    g, dg = np.empty((n, p, T)), np.empty((n, p, T, p, T))
    extra = np.zeros((n, 5))
    extra[:, 2] = np.inf
    extra[:, 4] = np.nan
    status = np.zeros(n, np.int64)
    # (a sample whose mode search found no component has no proposal: zero likelihood, as elsewhere)
    empty = nc[active] <= 0
    status[empty] = np.where(nc[active[empty]] < 0, -nc[active[empty]], int(K.STATUS_ZERO_LIKELIHOOD))
    rows = np.flatnonzero(~empty)
    retry = DEFENSIVE_WIDTH > 0 and DEFENSIVE_SHARE > 0
    comps = proposal(K, obs, omega, V, params, nc, cb, cm, cL, cla, active[rows], seed)
    data, sub = (obs, omega, V), active[rows]
    for attempt in range(2 + DISCOVER_ROUNDS if retry else 1):
        if attempt == 1:
            # the heavy-tailed samples alone, with room for the components added to them: the same
            # modes with a defensive component per branch
            sub = active[rows]
            data = (obs[sub], omega[sub], V if V.shape[0] == 1 else V[sub])
            more = int(K.N_BRANCHES) + DISCOVER_ROUNDS * DISCOVER_NEW
            comps = _with_room(more, nc[sub], cb[sub], cm[sub], cL[sub], cla[sub])
            comps = proposal(K, *data, params, *comps, np.arange(sub.size), seed, wide=True)
            sub = np.arange(sub.size)
        elif attempt > 1:  # and components on the heaviest points the last proposal met
            discover(K, *data, params, *comps, sub, seed, attempt - 2)
            for _ in range(REFITS):
                refit(K, *data, params, *comps, sub, _pilot(seed, int(K.INTEGRAL_DIM)))
        last = not retry or attempt == 1 + DISCOVER_ROUNDS
        out = _stage(K, *data, params, *comps, sub, tol, max_points, seed, stop_heavy=not last)
        if attempt:
            out[2][:, 1] += extra[rows, 1]  # (the evaluations of the earlier attempts count)
        g[rows], dg[rows], extra[rows], status[rows] = out
        again = (extra[rows, 4] >= TAIL_MAX) & (status[rows] == 0)
        rows, sub = rows[again], sub[again]
        if rows.size == 0:
            break
    lost = int(np.sum((extra[:, 4] >= TAIL_MAX) & (status == 0)))
    if lost:
        warnings.warn(f"denoiser: {lost} of {n} samples have heavy-tailed importance "
                      f"weights (Pareto shape >= {TAIL_MAX}"
                      f"{', also with defensive and discovered components' if retry else ''}): "
                      "their error is not controlled (estimate inf)", RuntimeWarning, stacklevel=2)
    return g, dg, extra, status


def _with_room(more: int, nc, cb, cm, cL, cla):
    """Copies of the components with ``more`` free slots per sample."""
    pad = ((0, 0), (0, more))
    return (nc.copy(), np.pad(cb, pad), np.pad(cm, pad + ((0, 0),)), np.pad(cL, pad + ((0, 0), (0, 0))),
            np.pad(cla, pad))


def _stage(K, obs, omega, V, params, nc, cb, cm, cL, cla, active, tol, max_points, seed, stop_heavy):
    """One run of the replicates on the proposal (nc, cb, cm, cL, cla) for the samples ``active``
    (all with components): (g, dg, extra, status) as ``run``. A heavy-tailed sample stops after
    its first pass where ``stop_heavy`` (it is run again on another proposal), else gets inf."""
    D = int(K.INTEGRAL_DIM)
    n = active.size
    p, T = omega.shape[1:]
    pt = p * T
    nq = 1 + pt + pt * (pt + 1) // 2
    g, dg = np.empty((n, p, T)), np.empty((n, p, T, p, T))
    extra = np.zeros((n, 5))
    extra[:, 2] = np.inf
    status = np.zeros(n, np.int64)
    engines = scramblings(seed, D)
    sums = np.zeros((REPS, n, nq))
    fshift = np.empty(n)
    res = chamber.residual_covariance(K, V)
    left = np.arange(n)  # positions in active still refining
    count, step = 0, START
    # the largest per-point weights of the replicates' first passes (their tail: ``TAIL_MAX``)
    keep = tail_size(REPS * START) + 1
    top = np.zeros((n, keep))
    heavy = np.zeros(n, bool)
    while left.size and count < max_points:
        idx = active[left]
        for r, eng in enumerate(engines):
            x, w = t_points(eng, D, step)
            tot, fs = np.zeros((left.size, nq)), np.empty(left.size)
            tail = np.zeros((left.size, keep if count == 0 else 0))
            K.modal_rule(obs, omega, V, params, nc, cb, cm, cL, cla, x, w, idx, tot, fs, tail)
            if not np.isfinite(tot).all():
                rows, up = _rescale_overflow(K, obs, omega, V, params, nc, cb, cm, cL, cla, x, w, idx, tot, fs, tail)
                sums[:, left[rows]] *= np.exp(-up)[None, :, None]  # (the sums so far, in the raised scale)
                top[left[rows]] *= np.exp(-up)[:, None]
            if count == 0:
                both = np.concatenate([top[left], tail], axis=1)
                top[left] = np.partition(both, both.shape[1] - keep, axis=1)[:, -keep:]
            sums[r, left] += tot
            fshift[left] = fs
        if count == 0:
            extra[:, 4] = [pareto_tail_index(top[a], REPS * START) for a in range(n)]
            heavy = extra[:, 4] >= TAIL_MAX
        count += step
        extra[left, 1] += REPS * step * nc[idx]
        reps = [_finish(K, omega, V, idx, sums[r, left] / count, fshift[left]) for r in range(REPS)]
        gm, dgm, lzm, st = _finish(K, omega, V, idx, sums[:, left].mean(axis=0) / count, fshift[left])
        # a point whose term overflowed leaves no usable mean: said by the status, not as NaN
        finite = np.isfinite(lzm) & np.isfinite(gm).all(axis=(1, 2)) & np.isfinite(dgm).all(axis=(1, 2, 3, 4))
        st = np.where((st == 0) & ~finite, int(K.STATUS_NOT_FINITE), st)
        fine = (st == 0) & np.all([rp[3] == 0 for rp in reps], axis=0)
        est = SAFETY * _spread(reps, gm, dgm) * chamber.final_scale(dgm, chamber.residual_rows(res, idx))
        est = np.where(fine & np.isfinite(est) & ~heavy[left], est, np.inf)
        g[left], dg[left], extra[left, 0] = gm, dgm, lzm
        extra[left, 2] = est
        status[left] = np.where(fine, 0, st)
        left = left[~(est <= tol) & (st == 0) & ~(stop_heavy & heavy[left])]
        step = count  # (doubling: the next points of each sequence)
    extra[left, 3] = 1.0
    return g, dg, extra, status


def _raise_masses(cla, nc, idx, nonfinite, resum, shift: float = SHIFT, tries: int = SHIFT_TRIES):
    """Where a sample's sums overflowed (a point whose term exceeds e^709 times the largest Laplace
    mass: a mode or peak of the density the search did not see; met at k = 13 with an untied first
    layer whose mixing c I + S can be singular), raise all its components' log masses by ``shift``
    (the terms a_j f phi_j / q are unchanged, only the scale exp(-fshift) of the sums) and sum its
    points again, up to ``tries`` times. nonfinite() gives the rows of idx whose sums are not
    finite, resum(rows) sums those rows again. A sample still not finite (not a matter of scale)
    gets its masses back and its sums in their former scale (summed once more), and the caller's
    status says so. Returns (rows that were not finite, how far each stays raised)."""
    bad = nonfinite()
    up = np.zeros(bad.size)
    for _ in range(tries):
        rows = np.intersect1d(bad, nonfinite())
        if rows.size == 0:
            break
        for r in rows:
            cla[idx[r], : nc[idx[r]]] += shift
        up[np.searchsorted(bad, rows)] += shift
        resum(rows)
    still = np.isin(bad, nonfinite())
    if still.any():
        for r, u in zip(bad[still], up[still]):
            cla[idx[r], : nc[idx[r]]] -= u
        up[still] = 0.0
        resum(bad[still])
    return bad, up


def _rescale_overflow(K, obs, omega, V, params, nc, cb, cm, cL, cla, x, w, idx, tot, fs, tail):
    """``_raise_masses`` for the moment sums tot (fshift fs, largest weights tail) of one chunk of
    ``run``."""

    def resum(rows):
        t2, f2, w2 = np.zeros((rows.size, tot.shape[1])), np.empty(rows.size), np.zeros((rows.size, tail.shape[1]))
        K.modal_rule(obs, omega, V, params, nc, cb, cm, cL, cla, x, w, idx[rows], t2, f2, w2)
        tot[rows], fs[rows], tail[rows] = t2, f2, w2

    return _raise_masses(cla, nc, idx, lambda: np.flatnonzero(~np.isfinite(tot).all(axis=1)), resum)


def proposal(K, obs, omega, V, params, nc, cb, cm, cL, cla, active, seed: int, wide: bool = False):
    """Copies of the components (nc, cb, cm, cL, cla) of the samples ``active`` (``wide``: with a
    defensive component per branch, ``defensive``) after ``REFITS`` steps of population Monte Carlo
    on the pilot sequence of ``seed``: the proposal the replicates use."""
    D = int(K.INTEGRAL_DIM)
    nc, cb, cm, cL, cla = nc.copy(), cb.copy(), cm.copy(), cL.copy(), cla.copy()
    if wide:
        defensive(nc, cb, cm, cL, cla, active)
    pilot = _pilot(seed, D)
    for _ in range(REFITS):
        refit(K, obs, omega, V, params, nc, cb, cm, cL, cla, active, pilot)
    return nc, cb, cm, cL, cla


def _pilot(seed: int, D: int):
    """The population Monte Carlo steps' sequence (not one of the replicates')."""
    return qmc.Sobol(D + 1, scramble=True, seed=np.random.default_rng([seed, REPS]))


def discover(K, obs, omega, V, params, nc, cb, cm, cL, cla, active, seed: int, round_: int = 0):
    """In place, for the samples ``active``: up to ``DISCOVER_NEW`` more components each, centred on
    the heaviest points of ``DISCOVER_POINTS`` points of the current proposal (at least one sd of
    their generating component apart), with that component's covariance and the mass of a
    Gaussian of this covariance with the height f there. Where the weights stay heavy-tailed with
    a defensive component, the mass the modes' Gaussians miss lies where these points are; the
    population Monte Carlo steps that follow move the new components onto it (incremental mixture
    importance sampling, Raftery and Bao 2010)."""
    D = int(K.INTEGRAL_DIM)
    eng = qmc.Sobol(D + 1, scramble=True, seed=np.random.default_rng([seed, REPS + 1, round_]))
    x, w = t_points(eng, D, DISCOVER_POINTS)
    m = 4 * DISCOVER_NEW
    hu, hj = np.zeros((active.size, m, D)), np.zeros((active.size, m), np.int64)
    hv, hf = np.zeros((active.size, m)), np.full((active.size, m), -np.inf)
    K.modal_heaviest(obs, omega, V, params, nc, cb, cm, cL, cla, x, w / DISCOVER_POINTS, active, hu, hj, hv, hf)
    room = cm.shape[1]
    for r, i in enumerate(active):
        added = []
        for a in range(m):
            j = int(hj[r, a])
            if j < 0 or nc[i] >= room or len(added) == DISCOVER_NEW:
                break
            if not np.isfinite(hf[r, a]):
                continue
            L = cL[i, j].copy()
            if any(np.sum(np.linalg.solve(L, hu[r, a] - c) ** 2) < 1.0 for c in added):
                continue
            q = int(nc[i])
            cb[i, q], cm[i, q], cL[i, q] = cb[i, j], hu[r, a], L
            cla[i, q] = hf[r, a] + 0.5 * D * np.log(2 * np.pi) + np.sum(np.log(np.diag(L)))
            nc[i] += 1
            added.append(hu[r, a])


def defensive(nc, cb, cm, cL, cla, active, widen: float | None = None, share: float | None = None):
    """In place, for the samples ``active``: one more component per branch, at the branch's mixture
    mean with its moment-matched covariance widened ``widen`` times (in sd) and ``share`` of its
    mass (while there is room). The modes' Laplace Gaussians are narrower than the posterior's
    plateau between and around them; points the t proposal sends there rarely, with a large
    weight each, made the weights heavy-tailed (a defensive mixture, Hesterberg 1995). widen and
    share default to ``DEFENSIVE_WIDTH``, ``DEFENSIVE_SHARE``; 0: none."""
    widen = DEFENSIVE_WIDTH if widen is None else widen
    share = DEFENSIVE_SHARE if share is None else share
    if not (widen > 0 and share > 0):
        return
    room = cm.shape[1]
    for i in active:
        k = int(nc[i])
        for b in np.unique(cb[i, :k]):
            if nc[i] >= room:
                break
            js = np.flatnonzero(cb[i, :k] == b)
            top = cla[i, js].max()
            a = np.exp(cla[i, js] - top)
            mu = a @ cm[i, js] / a.sum()
            dev = cm[i, js] - mu
            C = (np.einsum("j,jab,jcb->ac", a, cL[i, js], cL[i, js]) + np.einsum("j,ja,jb->ab", a, dev, dev)) / a.sum()
            try:
                L = np.linalg.cholesky(C)
            except np.linalg.LinAlgError:
                continue
            q = int(nc[i])
            cb[i, q], cm[i, q], cL[i, q], cla[i, q] = b, mu, widen * L, np.log(share * a.sum()) + top
            nc[i] += 1


def scramblings(seed: int, D: int, skip: int = 0) -> list:
    """The ``REPS`` independently scrambled Sobol sequences of ``seed`` (dimension D + 1: the
    Student-t radius takes one), each fast-forwarded past its first ``skip`` points."""
    engines = [qmc.Sobol(D + 1, scramble=True, seed=np.random.default_rng([seed, r])) for r in range(REPS)]
    if skip:
        for e in engines:
            e.fast_forward(skip)
    return engines


def refit(K, obs, omega, V, params, nc, cb, cm, cL, cla, idx, engine, n_points: int = REFIT_POINTS):
    """One step of population Monte Carlo, in place: each component of the samples idx moves to the
    mean and covariance of its partition-of-unity term, its mass to the term's (estimated by
    n_points of the Student-t proposal). A component whose term has no mass or whose covariance
    is not positive definite stays where it is. (The Laplace Gaussians sit at the modes with the
    curvature there; the terms are skewed along the attention's ridges, and a proposal matching
    their spread carries less weight variance.)"""
    D = int(K.INTEGRAL_DIM)
    x, w = t_points(engine, D, n_points)
    m, mc = idx.size, cm.shape[1]
    S0, S1, S2 = np.zeros((m, mc)), np.zeros((m, mc, D)), np.zeros((m, mc, D, D))
    K.modal_refit(obs, omega, V, params, nc, cb, cm, cL, cla, x, w / n_points, idx, S0, S1, S2)

    def resum(rows):
        sub = (np.zeros((rows.size, mc)), np.zeros((rows.size, mc, D)), np.zeros((rows.size, mc, D, D)))
        K.modal_refit(obs, omega, V, params, nc, cb, cm, cL, cla, x, w / n_points, idx[rows], *sub)
        S0[rows], S1[rows], S2[rows] = sub

    _raise_masses(cla, nc, idx, lambda: np.flatnonzero(~np.isfinite(S2).all(axis=(1, 2, 3))), resum)
    for r, i in enumerate(idx):
        fshift = cla[i, :nc[i]].max()
        for j in range(nc[i]):
            s0 = S0[r, j]
            if not (s0 > 0 and np.isfinite(s0)):
                continue
            mu = S1[r, j] / s0
            low = np.tril(S2[r, j])
            C = (low + low.T - np.diag(np.diag(low))) / s0 - np.outer(mu, mu)
            try:
                L = np.linalg.cholesky(C)
            except np.linalg.LinAlgError:
                continue
            if not np.all(np.isfinite(L)):
                continue
            cm[i, j], cL[i, j], cla[i, j] = mu, L, np.log(s0) + fshift


def _finish(K, omega, V, idx, tot, fshift):
    m = idx.size
    p, T = omega.shape[1:]
    g, dg, ex, st = np.empty((m, p, T)), np.empty((m, p, T, p, T)), np.zeros((m, 4)), np.zeros(m, np.int64)
    K.modal_finish(omega, V, idx, np.ascontiguousarray(tot), np.zeros_like(tot), fshift, g, dg, ex, st)
    return g, dg, ex[:, 0], st


def _spread(reps, g, dg) -> np.ndarray:
    """Largest standard error of the replicates' mean over the entries of g_out, dg_out (relative
    to the mean's size, at least 1) and log Z_out (absolute)."""
    n = g.shape[0]
    R = len(reps)
    out = np.zeros(n)
    for k, ref in ((0, g), (1, dg), (2, None)):
        a = np.array([rp[k] for rp in reps]).reshape(R, n, -1)
        with np.errstate(invalid="ignore"):  # (an overflowed replicate: NaN, made inf by the caller)
            se = a.std(axis=0, ddof=1).max(axis=1) / np.sqrt(R)
        scale = 1.0 if ref is None else np.maximum(1.0, np.abs(ref).reshape(n, -1).max(axis=1))
        out = np.maximum(out, se / scale)
    return out
