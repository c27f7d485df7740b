"""Asymptotic fixed point of ERM in a tied attention layer (theory.md §8).

Output side: the Moreau (proximal) step of the softmax square loss, expectations by a
deterministic Gauss-Hermite tensor rule (T = 2) or randomised QMC with a standard error.
Prior side: ``prior.prior_step`` (J(delta, eps) and its analytic derivatives).

Conjugates use f = (h - z) / Sigma.  With (y*, z) the noisy-teacher and student fields,
Gaussian integration by parts turns the §8 expressions into

    q_hat     = 2 alpha E||f||^2
    Sigma_hat = -2 alpha E[f . (Q0 z - m z*)] / (Q0 q - m^2)           (= -2 alpha E div_z f)
    m_hat     =  2 alpha E[f . (q z* - m z)] / (Q0 q - m^2)            (= 2 alpha E div_y* f)

used as written when Q0 q - m^2 is not small.  At the zero estimator (q = m = 0, Sigma = 0) both
ratios are 0/0: there f = -grad l(z) and we use the equivalent forms
Sigma_hat = 2 alpha E Tr hess l, m_hat = (2 alpha E[f . y*] + m Sigma_hat) / (Q0 + Delta/2).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import AimsymError
from ..blas import limit_blas_threads
from ..numerics import softmax_rows
from .geometry import isometric_to_matrix, learned_basis
from .loss import loss, loss_grad_hess
from .params import ERMParams
from .prior import prior_step
from .prox import prox
from .quadrature import Rule, expect, gauss_hermite, rqmc


@dataclass(frozen=True)
class Accuracy:
    """Quadrature and iteration settings (recorded with every result)."""

    gh_nodes: int = 16          # Gauss-Hermite nodes per dimension in the iteration (T = 2)
    gh_test_nodes: int = 32     # finer rule for the final (prox-free) test error
    gh_final_nodes: int = 20    # finer rule for the final conjugates and training error
    qmc_log2: int = 12          # 2^k Sobol points per replicate (T >= 3)
    qmc_replicates: int = 4
    qmc_seed: int = 0
    tol: float = 1e-5           # relative change of (q, m, Sigma) between iterations
    max_iter: int = 400
    damping: float = 0.3        # weight of the old iterate
    prior_nodes: int = 160
    free_nodes: int = 48        # per u-panel, generic free convolution (non-Wishart targets)
    rule_kind: str = "auto"     # auto | gauss-hermite | rqmc
    anderson: int = 3           # Anderson acceleration depth of the outer iteration (0: off)

    def rule(self, T: int, final: str | None = None) -> Rule:
        """Rule for the iteration, or final='prox' / 'test' for the finer final evaluations."""
        D = T * (T + 1) // 2 - 1
        if self.rule_kind == "gauss-hermite" or (self.rule_kind == "auto" and T == 2):
            n = {None: self.gh_nodes, "prox": self.gh_final_nodes, "test": self.gh_test_nodes}[final]
            return gauss_hermite(D, n, 1e-6 if final is None else 1e-8)
        if final:
            return rqmc(D, self.qmc_log2 + (1 if final == "prox" else 2), self.qmc_replicates,
                        self.qmc_seed + 1)
        return rqmc(D, self.qmc_log2, self.qmc_replicates, self.qmc_seed)


@dataclass
class FixedPoint:
    alpha: float
    params: ERMParams
    q: float
    m: float
    Sigma: float
    q_hat: float
    m_hat: float
    Sigma_hat: float
    train: float
    test: float
    test_clean: float
    matrix_error: float
    rank: float
    delta: float
    eps: float
    iterations: int
    converged: bool
    stderr: dict = field(default_factory=dict)
    seconds: float = 0.0

    def asdict(self) -> dict:
        out = {k: getattr(self, k) for k in (
            "alpha", "q", "m", "Sigma", "q_hat", "m_hat", "Sigma_hat", "train", "test",
            "test_clean", "matrix_error", "rank", "delta", "eps", "iterations", "converged",
            "stderr", "seconds")}
        out["alpha_bar"] = self.params.alpha_bar(self.alpha)
        out["delta_peak"] = 1.0 - self.rank
        out.update({k: v for k, v in self.params.asdict().items()})
        return out

    def to_json(self) -> dict:
        return self.asdict()


def fields(params: ERMParams, q: float, m: float, rule: Rule):
    """Noisy teacher field y*, student field z, and E[z* | y*, z] at the rule's nodes, (R, N, L)."""
    Q0, Qy = params.Q0, params.Q0 + params.Delta / 2
    a = m / Qy
    b = np.sqrt(max(q - a * m, 0.0))
    B = learned_basis(params.tokens)
    gy, gz = rule.g[..., 0, :] @ B.T, rule.g[..., 1, :] @ B.T
    ystar = np.sqrt(Qy) * gy
    z = a * ystar + b * gz
    # z* = (Q0/Qy) y* + r, r independent of y*, Cov(r, z) = m (1 - Q0/Qy)
    c = m * (1.0 - Q0 / Qy) / b if b > 0 else 0.0
    zstar = (Q0 / Qy) * ystar + c * gz
    return ystar, z, zstar, a, b


def labels(params: ERMParams, ystar: np.ndarray) -> np.ndarray:
    return softmax_rows(params.beta0 * isometric_to_matrix(ystar, params.tokens))


def test_errors(params: ERMParams, q: float, m: float, rule: Rule) -> dict:
    """Test error against noisy labels ('test') and against the clean teacher ('test_clean')."""
    ystar, z, zstar, a, b = fields(params, q, m, rule)
    P = softmax_rows(params.beta * isometric_to_matrix(z, params.tokens))
    Y = labels(params, ystar)
    zc, zs = clean_fields(params, q, m, rule)
    Pc = softmax_rows(params.beta * isometric_to_matrix(zs, params.tokens))
    Yc = softmax_rows(params.beta0 * isometric_to_matrix(zc, params.tokens))
    return {"test": np.asarray(expect(((P - Y) ** 2).sum((-1, -2)), rule)),
            "test_clean": np.asarray(expect(((Pc - Yc) ** 2).sum((-1, -2)), rule))}


def output_step(params: ERMParams, alpha: float, q: float, m: float, Sigma: float, rule: Rule,
                sigma_min: float = 1e-9, with_test: bool = False, cache: dict | None = None) -> dict:
    """Conjugates and training loss from (q, m, Sigma).

    ``cache`` (a dict kept across fixed-point iterations) warm-starts the prox from the previous
    solution shifted by the change of z; every 5th call re-runs the two cold starts."""
    ystar, z, zstar, a, b = fields(params, q, m, rule)
    R, N, L = z.shape
    Y = labels(params, ystar)
    zf, Yf = z.reshape(-1, L), Y.reshape(-1, params.tokens, params.tokens)
    if Sigma > sigma_min:
        warm = None
        if cache is not None and "h" in cache and cache.get("calls", 0) % 5 != 0:
            warm = cache["h"] - cache["z"] + zf
        h = prox(zf, Yf, Sigma, params.beta, warm=warm)
        if cache is not None:
            cache.update(h=h, z=zf, calls=cache.get("calls", 0) + 1)
        f = (h - zf) / Sigma
    else:  # Sigma -> 0 limit of the prox: h = z - Sigma grad l(z)
        h = zf
        f = -loss_grad_hess(zf, Yf, params.beta)[1]
    f = f.reshape(R, N, L)
    Q0, Qy = params.Q0, params.Q0 + params.Delta / 2
    det = Q0 * q - m * m
    out = {}
    out["q_hat"] = 2 * alpha * np.asarray(expect((f * f).sum(-1), rule))
    if det > 1e-10 * Q0 * max(q, 1e-300) and b > 1e-8:
        out["Sigma_hat"] = -2 * alpha * np.asarray(expect((f * (Q0 * z - m * zstar)).sum(-1), rule)) / det * [1, -1]
        out["m_hat"] = 2 * alpha * np.asarray(expect((f * (q * zstar - m * z)).sum(-1), rule)) / det
    else:
        H = loss_grad_hess(h, Yf, params.beta)[2]
        if Sigma > sigma_min:
            eye = np.eye(L)
            H = np.linalg.solve(eye + Sigma * H, H)
        trH = np.trace(H, axis1=-2, axis2=-1).reshape(R, N)
        sh = 2 * alpha * np.asarray(expect(trH, rule))
        fy = 2 * alpha * np.asarray(expect((f * ystar).sum(-1), rule))
        out["Sigma_hat"] = sh
        out["m_hat"] = (fy + m * sh) / Qy
    out["train"] = np.asarray(expect(loss(h, Yf, params.beta).reshape(R, N), rule))
    if with_test:
        out.update(test_errors(params, q, m, rule))
    return out


def clean_fields(params: ERMParams, q: float, m: float, rule: Rule):
    """Noise-free teacher field z* and student field z, jointly N(0, [[Q0, m], [m, q]])."""
    B = learned_basis(params.tokens)
    g1, g2 = rule.g[..., 0, :] @ B.T, rule.g[..., 1, :] @ B.T
    zstar = np.sqrt(params.Q0) * g1
    z = (m / params.Q0) * zstar + np.sqrt(max(q - m * m / params.Q0, 0.0)) * g2
    return zstar, z


def _zero_predictor(params: ERMParams, alpha: float, rule: Rule, **kw) -> dict:
    return output_step(params, alpha, 0.0, 0.0, 0.0, rule, **kw)


def _anderson(hist, old, new, mix, Q0, depth):
    """Anderson-accelerated update of x = (log q, m, log Sigma) from x -> g(x); falls back to the
    damped step old + mix (new - old) when the extrapolation is not admissible."""
    damped = old + mix * (new - old)
    if depth <= 0 or min(old[0], old[2], new[0], new[2]) <= 0:
        hist.clear()
        return damped
    x = np.array([np.log(old[0]), old[1], np.log(old[2])])
    gx = np.array([np.log(new[0]), new[1], np.log(new[2])])
    f = gx - x
    hist.append((x, f))
    del hist[:-(depth + 1)]
    if len(hist) < 2:
        return damped
    dX = np.array([hist[i + 1][0] - hist[i][0] for i in range(len(hist) - 1)]).T
    dF = np.array([hist[i + 1][1] - hist[i][1] for i in range(len(hist) - 1)]).T
    gamma = np.linalg.lstsq(dF, f, rcond=1e-10)[0]
    y = x + mix * f - (dX + mix * dF) @ gamma
    cand = np.array([np.exp(y[0]), y[1], np.exp(y[2])])
    if not np.all(np.isfinite(cand)) or cand[1] ** 2 > cand[0] * Q0 or np.any(np.abs(y - x) > 2.0):
        hist.clear()
        return damped
    return cand


@limit_blas_threads(n=1)  # tiny batched LAPACK calls: threads only add contention
def fixed_point(params: ERMParams, alpha: float, accuracy: Accuracy = Accuracy(), *,
                init: tuple[float, float, float] | None = None) -> FixedPoint:
    """Iterate output and prior steps to the fixed point at sample ratio alpha = n / d^2."""
    if not (np.isfinite(alpha) and alpha > 0):
        raise AimsymError("alpha", f"must be a finite number > 0, got {alpha}")
    t0 = time.perf_counter()
    rule = accuracy.rule(params.tokens)
    law = params.law
    q, m, Sigma = init if init is not None else (0.5 * params.Q0, 0.5 * params.Q0, 1.0)
    damp = accuracy.damping
    converged, it = False, 0
    last, zero_ok, prev_change = None, None, None
    hist: list = []
    cache: dict = {}
    for it in range(1, accuracy.max_iter + 1):
        out = output_step(params, alpha, q, m, Sigma, rule, cache=cache)
        qh, mh, sh = (float(out[k][0]) for k in ("q_hat", "m_hat", "Sigma_hat"))
        if not all(np.isfinite([qh, mh, sh])):
            raise FloatingPointError(f"non-finite conjugates at alpha={alpha}: {qh, mh, sh}")
        if mh <= 0 or sh <= 0:
            # the student learns nothing useful: at this alpha the estimator collapses
            mh, sh = max(mh, 1e-300), max(sh, 1e-300)
        pr = prior_step(params.penalty, qh, mh, sh, params.lam, params.kappa0, params.kappa,
                        accuracy.prior_nodes, law=law, free_nodes=accuracy.free_nodes)
        new = np.array([pr.q, pr.m, pr.Sigma])
        old = np.array([q, m, Sigma])
        upd = (1 - damp) * new + damp * old
        change = np.max(np.abs(upd - old) / (np.abs(upd) + 1e-12))
        last = (out, pr, qh, mh, sh)
        if pr.rank == 0.0 and zero_ok is None:
            # eps above the whole spectrum: is S_hat = 0 itself a fixed point?
            z_out = output_step(params, alpha, 0.0, 0.0, 0.0, rule)
            zq, zm, zs = (float(z_out[k][0]) for k in ("q_hat", "m_hat", "Sigma_hat"))
            z_pr = prior_step(params.penalty, zq, zm, zs, params.lam, params.kappa0, params.kappa,
                              accuracy.prior_nodes, law=law, free_nodes=accuracy.free_nodes)
            zero_ok = z_pr.rank == 0.0
            if zero_ok:
                q, m, Sigma = 0.0, 0.0, 0.0
                last = (z_out, z_pr, zq, zm, zs)
                converged = True
                break
        # adaptive damping: an increase of the step size signals oscillation
        if it > 5 and change > prev_change:
            damp = min(0.9, 0.5 * (1.0 + damp))
            hist.clear()
        prev_change = change
        if change < accuracy.tol:
            q, m, Sigma = upd
            converged = True
            break
        q, m, Sigma = _anderson(hist, old, new, 1.0 - damp, params.Q0, accuracy.anderson)
    coarse = output_step(params, alpha, q, m, Sigma, rule, with_test=True)
    out = output_step(params, alpha, q, m, Sigma, accuracy.rule(params.tokens, "prox"))
    out.update(test_errors(params, q, m, accuracy.rule(params.tokens, "test")))
    # a-posteriori accuracy: QMC standard errors, or (Gauss-Hermite) the change between the
    # iteration rule and the finer final rules, a conservative bound for the final values
    err = {k: max(float(out[k][1]), abs(float(out[k][0]) - float(coarse[k][0])))
           for k in ("test", "test_clean", "train", "q_hat", "m_hat", "Sigma_hat")}
    _, pr, qh, mh, sh = last
    return FixedPoint(
        alpha=float(alpha), params=params, q=float(q), m=float(m), Sigma=float(Sigma),
        q_hat=qh, m_hat=mh, Sigma_hat=sh,
        train=float(out["train"][0]), test=float(out["test"][0]),
        test_clean=float(out["test_clean"][0]),
        matrix_error=float(params.Q0 + q - 2 * m), rank=float(pr.rank), delta=pr.delta, eps=pr.eps,
        iterations=it, converged=converged,
        stderr=err,
        seconds=time.perf_counter() - t0)


def curve(params: ERMParams, alphas, accuracy: Accuracy = Accuracy(), progress: bool = False):
    """Fixed points along a grid of alpha, each warm-started from its neighbour."""
    out, init = [], None
    it = alphas
    if progress:
        from tqdm import tqdm
        it = tqdm(alphas, desc="erm se", leave=False)
    for a in it:
        fp = fixed_point(params, float(a), accuracy, init=init)
        out.append(fp)
        if fp.converged and fp.q > 0:
            init = (fp.q, fp.m, fp.Sigma)
    return out
