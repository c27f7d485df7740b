"""Weak-recovery thresholds and the grand staircase (theory section 5).

Stability operator on a block P of indices, around an SE overlap Q* supported on U = complement:

    D_ts(y, omega) = dg_out[P, t; P, s](y, omega, V),   omega = Q*^{1/2} xi, V = I - Q*
    F(M) = E[ sum_{t,s} D_ts M D_ts^T ]          (M symmetric |P| x |P|)

At Q* = 0 (omega = 0, V = I) D_ts = E[z_t z_s^T | y] - delta_ts I = G_ts of section 5. Linearising
the SE map in the P block gives delta Q_P -> alpha F(delta Q_P) (g_out vanishes on P at omega_P = 0
by the sign-flip symmetry of the links this applies to), so the block is learned where
alpha * rho(F) = 1, rho the cone spectral radius (power iteration from I / sqrt(|P|)).

F is returned as an explicit matrix on an orthonormal basis of symmetric matrices (E_aa, and
(E_ab + E_ba)/sqrt 2 for a < b), with per-entry standard errors from the QMC replicas; the standard
error of rho (and of alpha_c = 1/rho) is a jackknife over replicas.
"""

from __future__ import annotations

import time

import numpy as np
from scipy.optimize import brentq

from .errors import AimsymError
from .provenance import provenance
from .se import Channel, make_channel, state_evolution, sym


# ----------------------------------------------------------------------------- symmetric basis
def sym_basis(n: int) -> np.ndarray:
    """Orthonormal (Frobenius) basis of symmetric n x n matrices: (n (n + 1) / 2, n, n)."""
    out = []
    for a in range(n):
        for b in range(a, n):
            E = np.zeros((n, n))
            if a == b:
                E[a, a] = 1.0
            else:
                E[a, b] = E[b, a] = 1.0 / np.sqrt(2.0)
            out.append(E)
    return np.array(out)


def operator_matrix(D: np.ndarray) -> np.ndarray:
    """D: (n, T, T, k, k) blocks D_ts per sample -> mean of F in the symmetric basis (m, m)."""
    B = sym_basis(D.shape[-1])
    # F(E_j) = mean_n sum_ts D E_j D^T ; entry <E_i, F(E_j)>
    FE = np.einsum("ntsab,jbc,ntsdc->jad", D, B, D, optimize=True) / D.shape[0]
    return np.einsum("iad,jad->ij", B, FE)


def apply(F: np.ndarray, M: np.ndarray) -> np.ndarray:
    B = sym_basis(M.shape[0])
    c = np.einsum("iab,ab->i", B, M)
    return np.einsum("i,iab->ab", F @ c, B)


def cone_spectral_radius(F: np.ndarray, n: int, *, tol: float = 1e-13, max_iter: int = 20000):
    """Power iteration M <- F(M)/||F(M)||_F from I/sqrt(n): (rho, maximising M)."""
    M = np.eye(n) / np.sqrt(n)
    rho = 0.0
    for _ in range(max_iter):
        FM = sym(apply(F, M))
        nrm = float(np.linalg.norm(FM))
        if not np.isfinite(nrm):
            raise AimsymError("operator", "non-finite entries; raise samples or nodes")
        if nrm == 0.0:
            return 0.0, M
        M_new = FM / nrm
        done = np.linalg.norm(M_new - M) < tol
        M, rho = M_new, nrm
        if done:
            break
    return rho, M


# ----------------------------------------------------------------------------- evaluation
def operator_blocks(ch: Channel, Q: np.ndarray, block) -> np.ndarray:
    """D_ts on ``block`` at SE overlap Q for every point: (R, n, T, T, k, k)."""
    out, R, n = ch.denoise(Q)
    P = np.asarray(block)
    dg = out.dg_out[:, P][:, :, :, P]  # (N, k, T, k, T)
    D = np.transpose(dg, (0, 2, 4, 1, 3))  # (N, t, s, k, k')
    if not np.all(np.isfinite(D)):
        raise AimsymError("operator", "denoiser returned non-finite dg_out; raise nodes")
    return D.reshape(R, n, *D.shape[1:])


def operator(ch: Channel, Q: np.ndarray, block) -> dict:
    """F (mean, stderr per entry), rho, alpha_c = 1/rho with jackknife stderr, direction."""
    D = operator_blocks(ch, Q, block)
    R, k = D.shape[0], D.shape[-1]
    Fr = np.stack([operator_matrix(D[r]) for r in range(R)])
    F = Fr.mean(axis=0)
    rho, M = cone_spectral_radius(F, k)
    loo = np.array([cone_spectral_radius((F * R - Fr[r]) / (R - 1), k)[0] for r in range(R)])
    rho_se = float(np.sqrt((R - 1) / R * np.sum((loo - loo.mean()) ** 2)))
    return {"F": F, "F_stderr": Fr.std(axis=0, ddof=1) / np.sqrt(R), "rho": float(rho), "rho_stderr": rho_se,
            "direction": M, "block": [int(i) for i in block]}


def direction_support(M: np.ndarray, block, rel: float = 0.05) -> list[int]:
    """Indices of ``block`` where the maximising direction has weight (diagonal > rel * max)."""
    d = np.abs(np.diag(M))
    return [int(block[i]) for i in np.flatnonzero(d > rel * d.max())]


def initial_threshold(model, *, samples: int = 1 << 16, replicas: int = 8, nodes=None, seed=0,
                      channel: Channel | None = None) -> dict:
    """alpha_c = 1/rho(F) at Q = 0 (omega = 0, V = I) on all indices."""
    ch = channel or make_channel(model, samples=samples, replicas=replicas, seed=seed, nodes=nodes)
    p = model.p
    op = operator(ch, np.zeros((p, p)), list(range(p)))
    return _as_threshold(op, alpha_factor=1.0)


def _as_threshold(op: dict, alpha_factor: float) -> dict:
    rho, se = op["rho"], op["rho_stderr"]
    alpha = 1.0 / rho if rho > 0 else float("inf")
    return {"alpha": alpha, "stderr": se / rho**2 if rho > 0 else float("inf"), "rho": rho, "rho_stderr": se,
            "direction": op["direction"], "subspace": direction_support(op["direction"], op["block"]),
            "F": op["F"], "F_stderr": op["F_stderr"]}


# ----------------------------------------------------------------------------- staircase
def next_threshold(model, learned, alpha_start: float, *, ch_op: Channel, ch_se: Channel,
                   alpha_max: float = 20.0, xtol: float = 1e-4) -> dict:
    """Smallest alpha > alpha_start with alpha * rho(F_P(Q*_U(alpha))) = 1, U = learned, P = rest.

    Q*_U(alpha) is the SE fixed point restricted to U (uninformed start, warm-started along alpha).
    """
    p = model.p
    P = [i for i in range(p) if i not in learned]
    cache: dict[float, dict] = {}

    def evaluate(alpha):
        if alpha in cache:
            return cache[alpha]
        # warm start from the branch *below* alpha only (the uninformed branch continued upwards);
        # a start from a larger alpha could land on an informed branch (e.g. Q*_U -> I)
        below = [a for a in cache if a < alpha]
        if below:
            init = cache[max(below)]["Q"] + 1e-4 * np.diag(np.isin(np.arange(p), learned))  # keep it alive
        else:
            init = "uninformed"
        se = state_evolution(model, alpha, init=init, restrict=learned, channel=ch_se, errors=False,
                             tol=1e-5, init_eps=1e-3)
        op = operator(ch_op, se.Q, P)
        cache[alpha] = {"op": op, "Q": se.Q, "f": alpha * op["rho"] - 1.0}
        return cache[alpha]

    # Bracket upwards in steps of 15 %. The point right after the previous threshold is evaluated
    # only when the first step is already unstable: there the restricted SE is critically slow
    # (hundreds of iterations), and it is needed only to tell "unstable at once" from a root
    # inside the first step.
    lo, hi = alpha_start * 1.0001, None
    a_first = lo * 1.15
    if a_first > alpha_max:
        raise AimsymError("alpha", f"no further threshold below alpha_max = {alpha_max} for block {P}")
    if evaluate(a_first)["f"] >= 0:
        hi = lo if evaluate(lo)["f"] >= 0 else a_first  # already unstable right after the previous threshold
    a = a_first
    while hi is None:
        a_next = a * 1.15
        if a_next > alpha_max:
            raise AimsymError("alpha", f"no further threshold below alpha_max = {alpha_max} for block {P}")
        if evaluate(a_next)["f"] >= 0:
            lo, hi = a, a_next
        a = a_next
    root = lo if hi == lo else brentq(lambda x: evaluate(x)["f"], lo, hi, xtol=xtol)
    ev = evaluate(root)
    # stderr: QMC error of rho propagated through the slope of alpha * rho(alpha)
    a2 = root * 1.01
    slope = (evaluate(a2)["f"] - ev["f"]) / (a2 - root)
    stderr = root * ev["op"]["rho_stderr"] / max(slope, 1e-12)
    th = _as_threshold(ev["op"], 1.0)
    th.update(alpha=float(root), stderr=float(stderr), Q_branch=ev["Q"], jump=False)
    # The branch Q*_U(alpha) can jump to perfect recovery of U (Q*_U -> I, a first-order
    # transition of the restricted SE). Across the jump alpha * rho jumps from < 1 to > 1 (the
    # degenerate "U perfectly learned" operator of theory section 5), so the root sits at the
    # jump: the linear-stability direction there is meaningless and every index of P becomes
    # learnable at once. Flag it; subspace = P; stderr = the bracket of the jump.
    a1 = root * 0.99
    q_lo = float(np.max(np.diag(evaluate(a1)["Q"])[list(learned)]))
    q_hi = float(np.max(np.diag(evaluate(a2)["Q"])[list(learned)]))
    if q_hi > 1 - 1e-6 and q_lo < 1 - 1e-3:
        th.update(jump=True, subspace=list(P), stderr=float(a2 - a1) / 2,
                  direction=np.eye(len(P)) / np.sqrt(len(P)))
    return th


def staircase(model, alpha_c: float, first: list[int], *, samples: int = 1 << 14, replicas: int = 8,
              se_samples: int = 2048, nodes=None, seed=0) -> list[dict]:
    """Ordered list of the next thresholds after ``first`` is learned at alpha_c."""
    ch_op = make_channel(model, samples=samples, replicas=replicas, seed=seed + 1, nodes=nodes)
    ch_se = make_channel(model, samples=se_samples, replicas=replicas, seed=seed + 2, nodes=nodes)
    learned, alpha, steps = list(first), alpha_c, []
    while len(learned) < model.p:
        th = next_threshold(model, learned, alpha, ch_op=ch_op, ch_se=ch_se)
        sub = th["subspace"] or [i for i in range(model.p) if i not in learned]
        steps.append({"subspace": sub, "alpha": th["alpha"], "stderr": th["stderr"], "jump": th["jump"],
                      "direction": th["direction"], "rho": th["rho"], "Q_branch": th["Q_branch"]})
        learned, alpha = sorted(set(learned) | set(sub)), th["alpha"]
    return steps


# ----------------------------------------------------------------------------- second method
def threshold_by_side_information(model, *, lo: float, hi: float, block=None, learned=None, lam: float = 1e-8,
                                  level: float = 1e-4, samples: int = 8192, replicas: int = 8, nodes=None,
                                  seed=0, xtol: float = 2e-4) -> dict:
    """Bisection in alpha for where the SE overlap on ``block`` (tiny side information lam there)
    leaves zero: max diag Q_block > level. ``learned``: indices started informed-ish (1e-3),
    the others at 0. Returns alpha, bracket and the QMC stderr of the SE's own operator."""
    p = model.p
    block = list(range(p)) if block is None else list(block)
    ch = make_channel(model, samples=samples, replicas=replicas, seed=seed, nodes=nodes)
    init = np.diag([1e-3 if learned and i in learned else 0.0 for i in range(p)])

    def learned_at(alpha):
        r = state_evolution(model, alpha, init=init, side_info=lam, side_block=block, channel=ch,
                            errors=False, tol=1e-6, max_iter=2000,
                            stop=lambda Q: float(np.max(np.diag(Q)[block])) > level)
        return float(np.max(np.diag(r.Q)[block])) > level

    if learned_at(lo) or not learned_at(hi):
        raise AimsymError("alpha", f"bracket [{lo}, {hi}] does not contain the threshold")
    while hi - lo > xtol:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if learned_at(mid) else (mid, hi)
    return {"alpha": 0.5 * (lo + hi), "bracket": [lo, hi], "lam": lam, "level": level,
            "samples": samples}


# ----------------------------------------------------------------------------- report
def threshold_report(model, *, samples: int = 1 << 16, replicas: int = 8, nodes=None, seed=0,
                     staircase_steps: bool = True, staircase: bool | None = None, se_samples: int = 2048,
                     check: bool = False) -> dict:
    t0 = time.perf_counter()
    do_stairs = staircase_steps if staircase is None else staircase
    ch = make_channel(model, samples=samples, replicas=replicas, seed=seed, nodes=nodes)
    ini = initial_threshold(model, channel=ch)
    rep = {"initial": {k: ini[k] for k in ("alpha", "stderr", "rho", "rho_stderr", "direction", "subspace",
                                            "F", "F_stderr")}}
    steps = [{"subspace": ini["subspace"], "alpha": ini["alpha"], "stderr": ini["stderr"]}]
    if do_stairs and len(ini["subspace"]) < model.p and np.isfinite(ini["alpha"]):
        steps += _staircase(model, ini["alpha"], ini["subspace"], samples=max(samples // 4, 1024),
                            replicas=replicas, se_samples=se_samples, nodes=nodes, seed=seed)
    rep["staircase"] = steps
    if check and np.isfinite(ini["alpha"]):
        a = ini["alpha"]
        rep["check"] = threshold_by_side_information(model, lo=0.8 * a, hi=1.25 * a, nodes=nodes, seed=seed + 7)
    accuracy = {**ch.den.accuracy, "samples": samples, "replicas": replicas, "se_samples": se_samples,
                "rule": "scrambled Sobol (randomised QMC)"}
    rep["accuracy"] = accuracy
    rep["seconds"] = time.perf_counter() - t0
    rep["provenance"] = provenance(seed=seed, model_hash=model.hash(), accuracy=accuracy,
                                   parameters=dict(model.parameters))
    return rep


_staircase = staircase


# ----------------------------------------------------------------------------- phase diagram
# At skip c = 0 the first-layer mixing matrix softmax(z1 z1^T) of the T = 2 model is exactly
# singular on the line z1_0 = z1_1, which the symmetric Gauss-Hermite grid of the denoiser hits
# node for node (division by zero in the generated kernel). The integrand's limit there is 0, and
# the thresholds are continuous in c -> 0+, so c = 0 is evaluated at c = SKIP_FLOOR (recorded).
SKIP_FLOOR = 1e-6


def phase_point(model_path, name: str, value: float, *, samples: int = 1 << 14, replicas: int = 8,
                stair_samples: int = 1 << 13, se_samples: int = 1024, seed: int = 0, nodes=None,
                stair_nodes=None, staircase: bool = True) -> dict:
    """alpha_c and the staircase thresholds of one model at ``name = value`` (one phase-diagram point)."""
    import aimsym

    t0 = time.perf_counter()
    used = float(value)
    note = None
    if name == "skip" and abs(used) < SKIP_FLOOR:
        used, note = SKIP_FLOOR, f"skip {value} evaluated at {SKIP_FLOOR} (mixing matrix singular on z1_0 = z1_1)"
    model = aimsym.load(model_path, **{name: used})
    n_ini = nodes
    n_st = stair_nodes if stair_nodes is not None else n_ini
    ini = initial_threshold(model, samples=samples, replicas=replicas, nodes=n_ini, seed=seed)
    steps = [{"subspace": ini["subspace"], "alpha": ini["alpha"], "stderr": ini["stderr"]}]
    if staircase and len(ini["subspace"]) < model.p and np.isfinite(ini["alpha"]):
        for s in _staircase(model, ini["alpha"], ini["subspace"], samples=stair_samples, replicas=replicas,
                            se_samples=se_samples, nodes=n_st, seed=seed):
            steps.append({k: s[k] for k in ("subspace", "alpha", "stderr", "jump")})
    accuracy = {"samples": samples, "stair_samples": stair_samples, "se_samples": se_samples,
                "replicas": replicas, "nodes_initial": n_ini, "nodes_staircase": n_st,
                "rule": "scrambled Sobol (randomised QMC)"}
    return {name: float(value), "evaluated_at": used, "note": note, "staircase": steps,
            "direction": ini["direction"].tolist(), "seconds": time.perf_counter() - t0,
            "provenance": provenance(seed=seed, model_hash=model.hash(), accuracy=accuracy,
                                     parameters=dict(model.parameters))}


def phase_diagram(model_path, name: str, values, *, workers=None, progress: bool = False, **kw) -> dict:
    """:func:`phase_point` at every value, in a local (spawned) process pool; sorted by value."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    t0 = time.perf_counter()
    values = [float(v) for v in values]
    if not values:
        raise AimsymError("--over", "needs at least one value")
    if workers == 1:
        pts = [phase_point(model_path, name, v, **kw) for v in values]
    else:
        from tqdm.auto import tqdm

        pts = []
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as ex:
            futs = [ex.submit(phase_point, str(model_path), name, v, **kw) for v in values]
            for f in tqdm(as_completed(futs), total=len(futs), desc="phase diagram", disable=not progress):
                pts.append(f.result())
    pts.sort(key=lambda d: d[name])
    return {"model": str(model_path), "parameter": name, "points": pts, "seconds": time.perf_counter() - t0}


def phase_rows(pd: dict) -> list[dict]:
    """Flatten a :func:`phase_diagram` result to plot rows {"skip", "alpha", "stderr", "step"}."""
    name = pd["parameter"]
    return [{"skip": pt[name], "alpha": s["alpha"], "stderr": s["stderr"], "step": i,
             "subspace": s["subspace"]} for pt in pd["points"] for i, s in enumerate(pt["staircase"])]
