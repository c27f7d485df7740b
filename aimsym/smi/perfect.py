"""Perfect recovery (theory section 4): the counting bound, the local stability of Q = I, and the
algorithmic perfect-recovery threshold of the uninformed state evolution.

Near Q = I write V = I - Q -> 0. The SE output step then has the limit

    V^{1/2} Q_hat V^{1/2} -> alpha Pi(shape of V),   tr Pi = m  (the rank identity),

so one step maps V -> (1/alpha) V^{1/2} Pi^{-1} V^{1/2} (Q_hat >> I). The map is homogeneous of
degree one in V: its long-run behaviour is set by the shape V/tr V that the map reproduces
(found here by iterating the normalised map), where det V shrinks by alpha^p det Pi per step.
Q = I attracts iff alpha^p det Pi > 1, i.e. above

    local_alpha = det(Pi)^{-1/p}  >=  p / tr(Pi) = p / m = counting_alpha   (AM-GM).

At a shape fixed point Pi is proportional to I, so local_alpha equals the counting bound for a
correct denoiser; a rule that manufactures information (tr Pi > m) shows up as local_alpha below it.

The algorithmic threshold is the smallest alpha at which the uninformed SE reaches Q = I (1 - Q_kk
below the SE's resolution for every k), located by bisection with warm starts (the SE is
monotone in alpha: the fixed point at a smaller alpha lies below the uninformed trajectory at a
larger one). ``kind`` says how Q = I is reached: "jump" (the error just below the threshold is
still above JUMP_GAP) or "continuous".
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import numpy as np

from ..errors import AimsymError
from ..results import Result
from .se import Channel, make_channel, mean_and_stderr, sqrt_psd, state_evolution, sym

# the V -> 0 limit is taken at tr V / p = PI_SCALE, with the shape's eigenvalues kept above
# PI_MIN_RATIO times the largest (so V stays above the SE's clipping of 1 - Q at 1e-9); the
# finite-V correction to tr Pi = m is O(sqrt V) (e.g. the sign of a small |z| in phase retrieval)
PI_SCALE = 1e-5
PI_MIN_RATIO = 1e-4
# the error just below the algorithmic threshold: above JUMP_GAP the approach is a jump
JUMP_GAP = 1e-2
# relative width of the final bisection bracket
BISECT_REL = 5e-3
# independent groups of replicas whose bisections give the threshold's standard error (each to
# GROUP_REL: their spread is ~sqrt(GROUPS) times the standard error, far above that)
GROUPS = 4
GROUP_REL = 1e-2
# the SE runs only decide "reaches Q = I or not": a loose relative tol suffices
PR_SE_TOL = 1e-3


@dataclass
class LocalStability(Result):
    """Pi at the shape V the V -> 0 map reproduces, and local_alpha (see :func:`local_stability`)."""

    local_alpha: float
    local_alpha_stderr: float
    Pi: list
    Pi_stderr: list
    trace_Pi: float
    trace_Pi_stderr: float
    shape: list
    shape_iterations: int
    shape_converged: bool
    shape_at_floor: bool
    scale: float
    # the Nishimori form of Pi, -V^{1/2} E[sum_t dg_out[:, t; :, t]] V^{1/2}: equal to Pi for a
    # correct denoiser (theory section 4) and far less noisy near V = 0 (per sample it is
    # p T - tr(V^-1 Cov(Z | y)), close to m at every y); its local_alpha from the same points
    local_alpha_nishimori: float | None = None
    local_alpha_nishimori_stderr: float | None = None
    trace_Pi_nishimori: float | None = None
    trace_Pi_nishimori_stderr: float | None = None


@dataclass
class AlgorithmicThreshold(Result):
    """Where the uninformed SE reaches Q = I (see :func:`algorithmic_threshold`)."""

    alpha: float
    kind: str
    bracket: list
    error_below: float | None
    runs: int
    unconverged_runs: int | None = None
    OPTIONAL = ("unconverged_runs",)


@dataclass
class PerfectRecovery(Result):
    """The perfect-recovery transition: counting bound, local stability of Q = I and the
    algorithmic threshold. ``local`` None: no perfect recovery to locate (noisy link or no
    counting bound); ``algorithmic`` None: not located."""

    counting_alpha: float | None
    m: int | None
    note: str | None
    local: LocalStability | None = None
    algorithmic: AlgorithmicThreshold | None = None
    stderr: float | None = None
    group_alphas: list | None = None
    accuracy: dict | None = None
    seconds: float | None = None

    @property
    def alpha(self):
        return self.algorithmic.alpha if self.algorithmic is not None else None

    def to_json(self) -> dict:
        out = {"counting_alpha": self.counting_alpha, "m": self.m, "note": self.note}
        if self.local is None:
            return {**out, "alpha": None, "stderr": None, "kind": None, "local_alpha": None}
        out.update(self.local.to_json())
        a = self.algorithmic
        if a is not None:
            out.update({"alpha": a.alpha, "stderr": self.stderr, "kind": a.kind, "bracket": a.bracket,
                        "error_below": a.error_below, "group_alphas": self.group_alphas, "se_runs": a.runs,
                        "unconverged_runs": a.unconverged_runs or 0})
        return {**out, "accuracy": self.accuracy, "seconds": self.seconds}


def pi_replicas(ch: Channel, V: np.ndarray, nishimori: bool = False):
    """Replica values (R, p, p) of Pi = V^{1/2} E[sum_t g_out g_out^T] V^{1/2} at Q = I - V; with
    ``nishimori`` also those of its Nishimori form -V^{1/2} E[sum_t dg_out[:, t; :, t]] V^{1/2}."""
    out, R, n = ch.denoise(np.eye(ch.p) - V)
    g = out.g_out.reshape(R, n, ch.p, ch.T)
    gg = np.einsum("rnkt,rnlt->rkl", g, g) / n
    if not np.all(np.isfinite(gg)):
        raise AimsymError("Pi", "non-finite denoiser output near V = 0; raise the denoiser accuracy")
    S = sqrt_psd(V)
    if not nishimori:
        return sym(S @ gg @ S)
    dg = -np.einsum("rnktlt->rkl", out.dg_out.reshape(R, n, ch.p, ch.T, ch.p, ch.T)) / n
    return sym(S @ gg @ S), sym(S @ dg @ S)


def _normalised(V: np.ndarray, p: int) -> np.ndarray:
    w, U = np.linalg.eigh(sym(V))
    w = np.maximum(w, PI_MIN_RATIO * w.max())
    w *= p * PI_SCALE / w.sum()
    return sym((U * w) @ U.T)


def local_stability(ch: Channel, *, max_iter: int = 60, shape_tol: float = 2e-3) -> LocalStability:
    """Pi at the shape V reproduced by the V -> 0 limit of the SE map, and local_alpha."""
    p = ch.p
    V = PI_SCALE * np.eye(p)
    shape_change = np.inf
    for it in range(1, max_iter + 1):
        Pi_r = pi_replicas(ch, V)
        Pi = Pi_r.mean(axis=0)
        S = sqrt_psd(V)
        V_new = _normalised(S @ np.linalg.inv(Pi) @ S, p)
        # relative change of the shape in every direction (small entries matter as much as large)
        shape_change = float(np.max(np.abs(np.log(np.linalg.eigvals(np.linalg.solve(V, V_new)).real))))
        V = V_new
        if shape_change < shape_tol:
            break
    Pi_r, Pn_r = pi_replicas(ch, V, nishimori=True)
    R = Pi_r.shape[0]
    Pi, Pi_se = mean_and_stderr(Pi_r)
    tr, tr_se = mean_and_stderr(np.trace(Pi_r, axis1=1, axis2=2))
    trn, trn_se = mean_and_stderr(np.trace(Pn_r, axis1=1, axis2=2))

    # at a shape the map reproduces Pi is proportional to I and every direction shrinks by alpha
    # det(Pi)^{1/p} per step; a shape pushed to the floor of the ratio is not such a point: there
    # the slowest direction decides (alpha times the smallest eigenvalue of Pi)
    w = np.linalg.eigvalsh(V)
    at_floor = bool(w.min() <= PI_MIN_RATIO * w.max() * (1 + 1e-9))

    def alpha_of(P):
        rate = float(np.linalg.eigvalsh(sym(P)).min()) if at_floor else float(np.linalg.det(P)) ** (1.0 / p) \
            if np.linalg.det(P) > 0 else 0.0
        return 1.0 / rate if rate > 0 else float("inf")

    def jackknife(Pr):
        M = Pr.mean(axis=0)
        loo = np.array([alpha_of((M * R - Pr[r]) / (R - 1)) for r in range(R)])
        return alpha_of(M), float(np.sqrt((R - 1) / R * np.sum((loo - loo.mean()) ** 2)))

    la, la_se = jackknife(Pi_r)
    ln, ln_se = jackknife(Pn_r)
    return LocalStability(local_alpha=la, local_alpha_stderr=la_se,
                          Pi=Pi.tolist(), Pi_stderr=Pi_se.tolist(), trace_Pi=float(tr), trace_Pi_stderr=float(tr_se),
                          shape=(V / np.trace(V)).tolist(), shape_iterations=it,
                          shape_converged=bool(shape_change < shape_tol), shape_at_floor=at_floor, scale=PI_SCALE,
                          local_alpha_nishimori=ln, local_alpha_nishimori_stderr=ln_se,
                          trace_Pi_nishimori=float(trn), trace_Pi_nishimori_stderr=float(trn_se))


def _reaches(model, ch, alpha, Q0, se_kw):
    # (an unconverged run is counted in the result rather than warned about once per bisection step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = state_evolution(model, alpha, init=Q0 if Q0 is not None else "uninformed", channel=ch,
                              errors=False, **se_kw)
    return res.perfect_recovery, res


def algorithmic_threshold(model, ch: Channel, *, lo: float, hi: float, rel: float = BISECT_REL,
                          se_kw=None, grow: float = 1.25, hi_max: float | None = None) -> AlgorithmicThreshold:
    """Smallest alpha in [lo, hi_max] where the uninformed SE (points of ``ch``) reaches Q = I."""
    se_kw = dict(se_kw or {})
    hi_max = hi_max if hi_max is not None else 8.0 * hi
    warm = None  # the fixed point at the largest alpha that did not reach Q = I
    ok, res = _reaches(model, ch, lo, None, se_kw)
    unconverged = [0]

    def step(alpha, Q0):
        ok, res = _reaches(model, ch, alpha, Q0, se_kw)
        unconverged[0] += int(not (ok or res.converged))
        return ok, res

    if ok:
        return AlgorithmicThreshold(alpha=lo, kind="below-bracket", bracket=[lo, lo], error_below=None, runs=1)
    warm, runs, res_lo = res.Q, 1, res
    while True:
        ok, res = step(hi, warm)
        runs += 1
        if ok:
            break
        lo, warm, res_lo = hi, res.Q, res
        hi *= grow
        if hi > hi_max:
            return AlgorithmicThreshold(alpha=float("inf"), kind="not-reached", bracket=[lo, hi_max],
                                        error_below=float(np.max(res_lo.errors["layers"])), runs=runs)
    while (hi - lo) > rel * hi:
        mid = 0.5 * (lo + hi)
        ok, res = step(mid, warm)
        runs += 1
        if ok:
            hi = mid
        else:
            lo, warm, res_lo = mid, res.Q, res
    err_below = float(np.max(res_lo.errors["layers"]))
    return AlgorithmicThreshold(alpha=0.5 * (lo + hi), kind="jump" if err_below > JUMP_GAP else "continuous",
                                bracket=[lo, hi], error_below=err_below, runs=runs, unconverged_runs=unconverged[0])


def perfect_recovery(model, *, samples: int = 1024, replicas: int = 8, seed=0, nodes=None, groups: int = GROUPS,
                     algorithmic: bool = True, se_tol: float = PR_SE_TOL, max_iter: int = 1000,
                     checkpoint=None) -> PerfectRecovery:
    """The ``perfect_recovery`` entry of the thresholds report: counting, local and algorithmic
    alpha with standard errors (local: jackknife over replicas; algorithmic: the spread of
    independent bisections on ``groups`` disjoint groups of replicas). ``checkpoint``: a folder
    keeping the denoiser passes (a stopped run resumes)."""
    t0 = time.perf_counter()
    counting = model.counting
    if counting["alpha_pr"] is None or model.noise > 0:
        return PerfectRecovery(counting_alpha=counting["alpha_pr"], m=counting["m"],
                               note=counting["note"] if model.noise == 0 else "noisy link: no perfect recovery")
    out = PerfectRecovery(counting_alpha=counting["alpha_pr"], m=counting["m"], note=counting["note"])
    if replicas % groups:
        raise AimsymError("replicas", f"must be a multiple of {groups} (independent groups for the standard error)")
    ch = make_channel(model, samples=samples, replicas=replicas, seed=seed, nodes=nodes, checkpoint=checkpoint)
    out.local = local_stability(ch)
    if algorithmic:
        a_pr = counting["alpha_pr"]
        se_kw = {"tol": se_tol, "max_iter": max_iter}
        full = algorithmic_threshold(model, ch, lo=0.98 * a_pr, hi=1.1 * a_pr, se_kw=se_kw)
        per = replicas // groups
        parts = []
        a0 = full.alpha if np.isfinite(full.alpha) else a_pr
        for g in range(groups):
            # the groups' thresholds scatter around the full set's: a narrow bracket, coarser steps
            sub = ch.with_points(ch.points[g * per:(g + 1) * per])
            parts.append(algorithmic_threshold(model, sub, lo=max(0.98 * a_pr, 0.92 * a0), hi=1.06 * a0,
                                               rel=GROUP_REL, se_kw=se_kw).alpha)
        parts = np.array(parts)
        # each group holds 1/groups of the points: its variance is groups times the full set's
        se = float(parts.std(ddof=1) / np.sqrt(groups)) if np.all(np.isfinite(parts)) else float("inf")
        out.stderr = float(np.hypot(se, 0.5 * (full.bracket[1] - full.bracket[0])))
        out.algorithmic, out.group_alphas = full, parts.tolist()
    out.accuracy = {**ch.den.accuracy, "samples": samples, "replicas": replicas, "groups": groups,
                       "se_tol": se_tol, "bisection_rel": BISECT_REL, "pi_scale": PI_SCALE}
    out.seconds = time.perf_counter() - t0
    return out
