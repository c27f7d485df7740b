"""Finite-size scaling of the AIM's GAMP-RIE error (docs/aim.md section 4): series of runs at
several d (JSON lines, resumable), fits in 1/d, and the finite-d corrections of the SE.

    python -m aimsym.studies.aim_finite_size --alpha 0.1 --plan 60x48,100x32 --out FILE
"""

from __future__ import annotations

import time

import numpy as np

from ..aim.amp import adjoint, noise_jumps, rie_denoise, run
from ..aim.channels import entry_weights, make_channel, to_matrix
from ..aim.compound import compound_noise
from ..aim.data import check_size, generate, teacher
from ..aim.spectral import rie_mmse
from ..errors import AimsymError
from ..provenance import provenance
from . import read_records


def finite_size_fit(d, mean, sem, order=1):
    """Weighted least squares of mean(d) = sum_{k=0..order} c_k d^-k with the given standard
    errors as known sigmas. Returns a dict with ``coef`` (c_0 = the d -> infinity intercept, c_1 the
    1/d slope, ...), their standard errors ``coef_se`` (from (A^T W A)^-1, not rescaled),
    ``chi2``, ``dof``, the goodness-of-fit p-value ``p_value`` and ``coef_se_scaled`` (the errors
    inflated by sqrt(chi2/dof) when that exceeds 1, the conservative choice for a poor fit)."""
    from scipy.stats import chi2 as chi2_dist

    d, mean, sem = (np.asarray(v, dtype=float) for v in (d, mean, sem))
    if d.ndim != 1 or not (d.shape == mean.shape == sem.shape):
        raise AimsymError("d", "d, mean and sem must be 1-d arrays of one length")
    if order < 0 or len(d) < order + 1:
        raise AimsymError("order", f"need at least order + 1 = {order + 1} sizes, got {len(d)}")
    if np.any(sem <= 0) or not np.all(np.isfinite(sem)):
        raise AimsymError("sem", "standard errors must be finite and > 0")
    A = np.stack([d ** (-k) for k in range(order + 1)], axis=1)
    Wt = 1.0 / sem ** 2
    cov = np.linalg.inv(A.T @ (A * Wt[:, None]))
    coef = cov @ (A.T @ (Wt * mean))
    resid = (mean - A @ coef) / sem
    chi2 = float(resid @ resid)
    dof = len(d) - (order + 1)
    se_c = np.sqrt(np.diag(cov))
    scale = np.sqrt(max(1.0, chi2 / dof)) if dof > 0 else 1.0
    return {"order": int(order), "coef": coef.tolist(), "coef_se": se_c.tolist(), "cov": cov.tolist(),
            "chi2": chi2, "dof": int(dof), "p_value": float(chi2_dist.sf(chi2, dof)) if dof > 0 else None,
            "coef_se_scaled": (se_c * scale).tolist(), "residuals": resid.tolist()}


def finite_size_table(records):
    """Group per-seed records (dicts with 'd' and 'mmse') by d: rows with d, seeds, mean, sem."""
    by_d = {}
    for r in records:
        by_d.setdefault(int(r["d"]), []).append(float(r["mmse"]))
    rows = []
    for d in sorted(by_d):
        e = np.array(by_d[d])
        rows.append({"d": d, "seeds": len(e), "mmse": float(e.mean()),
                     "mmse_sem": float(e.std(ddof=1) / np.sqrt(len(e))) if len(e) > 1 else None})
    return rows


def finite_size_analysis(records, alpha, rho=0.5, tokens=2, activation="softmax", beta=1.0, prior="mp"):
    """Table per d, fits a + b/d and a + b/d + c/d^2, the SE value and z = (a - SE)/se(a).
    ``prior="gaussian"`` (softmax): the SE is max(0, 1 - c_T alpha) (Gaussian prior, m = Delta/(1 + Delta))."""
    from ..aim import se
    from ..aim.channels import counting_constant

    rows = finite_size_table(records)
    fit_rows = [r for r in rows if r["mmse_sem"]]  # sizes with >= 2 seeds
    d = [r["d"] for r in fit_rows]
    m = [r["mmse"] for r in fit_rows]
    s = [r["mmse_sem"] for r in fit_rows]
    if prior == "gaussian":
        m_se = max(0.0, 1.0 - counting_constant(tokens, activation) * alpha)
    else:
        m_se = se.solve(alpha, rho, tokens, activation, beta).mmse
    fits = {}
    for order in (1, 2):
        if len(fit_rows) >= order + 2:
            f = finite_size_fit(d, m, s, order)
            f["z_intercept"] = (f["coef"][0] - m_se) / f["coef_se"][0]
            f["slope_relative"] = f["coef"][1] / m_se  # b / SE: relative excess = slope_relative / d
            fits[f"order{order}"] = f
    return {"alpha": float(alpha), "rho": float(rho), "tokens": int(tokens), "activation": activation,
            "beta": float(beta), "mmse_se": m_se, "table": rows, "fits": fits}


def finite_size_series(alpha, rho=0.5, plan=((60, 8), (100, 8)), tokens=2, activation="softmax", beta=1.0,
                       iterations=120, damping=None, out=None, prior="mp", sensing="rank1", noise_law="semicircle"):
    """Run GAMP-RIE (isotropic form) for every (d, number of seeds) in ``plan``, seeds 0..k-1, and
    return per-seed records (d, seed, final mmse, unstable flag, CPU seconds). ``out``: a path to
    append one JSON line per run (a series can then be analysed while it runs, or resumed: runs
    already in the file are skipped)."""
    import json

    done = read_records(out, lambda r: (r["activation"], r["alpha"], r.get("prior", "mp"), r.get("sensing", "rank1"),
                                        r.get("noise_law", "semicircle"), r["d"], r["seed"]))
    records = []
    for d, n_seeds in plan:
        for seed in range(int(n_seeds)):
            key = (activation, float(alpha), prior, sensing, noise_law, int(d), seed)
            if key in done:
                records.append(done[key])
                continue
            t = time.process_time()
            data = generate(d, alpha, rho, tokens, activation, beta, seed=seed, prior=prior, sensing=sensing)
            res = run(data, tokens, activation, beta, iterations=iterations, damping=damping, noise_law=noise_law)
            rec = {"activation": activation, "alpha": float(alpha), "rho": float(rho), "tokens": int(tokens),
                   "beta": float(beta), "prior": prior, "sensing": sensing, "noise_law": noise_law,
                   "d": int(d), "seed": seed,
                   "mmse": res.mmse,
                   "unstable": bool(res.unstable), "iterations": res.iterations,
                   "cpu_seconds": time.process_time() - t}
            records.append(rec)
            if out is not None:
                with open(out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
    return records


def _goe(d, rng):
    """(A + A^T) / sqrt(2 d), A standard normal: the GOE noise of unit Delta that the SE assumes."""
    A = rng.standard_normal((d, d))
    return (A + A.T) / np.sqrt(2 * d)


def gamp_noise(ch, d, n, V, rng):
    """GAMP's own effective noise of the prior step at size d: (1/A) sum_mu g_mu . X_mu over n
    fresh rank-one sensing matrices X (n, d, T), g = ch.denoise at residuals h - omega ~ N(0, w V)
    (independent of the teacher), A = -(1/d) sum w dg. Its variance is V / (c_T alpha) (A is
    deterministic here) but it is a sum of ~2n rank-one matrices, not a GOE matrix. Returns the
    noise matrix, A and its jumps (``noise_jumps``)."""
    T = ch.tokens
    w = entry_weights(T)
    X = rng.standard_normal((n, d, T))
    omega = rng.standard_normal((n, len(w))) * np.sqrt(w)
    h = omega + rng.standard_normal((n, len(w))) * np.sqrt(w * V)
    g, dg = ch.denoise(ch.sample(to_matrix(h, T)), omega, V)
    A = -np.sum(dg * w) / d
    return adjoint(X, g, T) / A, A, noise_jumps(g, A, d, T)


def rie_finite_size(Delta, rho, d, samples, seed=0):
    """Finite-d error of the prior (RIE) step alone: R = S + sqrt(Delta) GOE at size d (S the
    finite-d teacher), E ||RIE(R) - S||^2 / d over ``samples`` draws, against m(Delta).
    Returns mean, sem and kappa = d (mean / m - 1) with its standard error: the prior step's relative
    finite-size excess is kappa / d (for a Gaussian prior kappa = 1 exactly, from the d diagonal
    coordinates of variance 2/d: d(d+1)/2 parameters instead of d^2/2)."""
    rng = np.random.default_rng(seed)
    m = rie_mmse(Delta, rho)
    e = np.empty(int(samples))
    for i in range(len(e)):
        S, _ = teacher(d, rho, rng)
        e[i] = np.sum((rie_denoise(S + np.sqrt(Delta) * _goe(d, rng), rho, Delta) - S) ** 2) / d
    sem = float(e.std(ddof=1) / np.sqrt(len(e)))
    return {"d": int(d), "samples": len(e), "Delta": float(Delta), "m": m, "mmse": float(e.mean()),
            "mmse_sem": sem, "kappa": float((e.mean() / m - 1) * d), "kappa_sem": sem / m * d}


def prior_step_finite_size(alpha, rho, d, samples, seed=0, tokens=2):
    """The prior (RIE) step alone at size d, at the softmax SE fixed point (V = SE mmse,
    Delta* = V / (c_T alpha)), fed with two noises on the same teacher draws:

    * "goe": R = S + sqrt(Delta*) GOE (what the SE assumes);
    * "amp": R = S + (1/A) sum_mu g_mu . X_mu, GAMP's own effective noise: rank-one sensing matrices
      of n = alpha d^2 fresh token pairs, g = channel.denoise at the residuals h - omega ~ N(0, w V)
      (independent of S), A = -(1/d) sum w dg; its variance is Delta* (A is deterministic here) but
      it is a sum of ~2n rank-one matrices, not a GOE matrix.

    * "compound": the "amp" noise again, denoised by the RIE built for its actual law, the
      compound free-Poisson law of its jumps (``compound``; variance d / (2 A), as in
      ``run(..., noise_law="compound")``).

    Returns kappa (relative excess times d over m(Delta*)) for each, the paired differences to
    "goe", the paired gain amp - compound and the predicted AMP slope
    b / SE = kappa_amp / (1 - f') (``se_amplification``)."""
    from ..aim import se
    from ..aim.channels import counting_constant

    ch = make_channel("softmax", tokens, 1.0)
    T = ch.tokens
    V = se.solve(alpha, rho, T, "softmax").mmse
    Delta = V / (counting_constant(T, "softmax") * alpha)
    m = rie_mmse(Delta, rho)
    d, n = check_size(d, alpha, rho)
    rng = np.random.default_rng(seed)
    e_goe, e_amp, e_cp = (np.empty(int(samples)) for _ in range(3))
    for i in range(len(e_goe)):
        S, _ = teacher(d, rho, rng)
        e_goe[i] = np.sum((rie_denoise(S + np.sqrt(Delta) * _goe(d, rng), rho, Delta) - S) ** 2) / d
        N, A, jumps = gamp_noise(ch, d, n, V, rng)
        e_amp[i] = np.sum((rie_denoise(S + N, rho, d / (2 * A)) - S) ** 2) / d
        law = compound_noise(jumps, d, variance=d / (2 * A))
        e_cp[i] = np.sum((rie_denoise(S + N, rho, d / (2 * A), noise=law) - S) ** 2) / d
    amp_factor = se_amplification(alpha, rho, T)[2]
    sq = np.sqrt(len(e_goe))
    out = {"alpha": float(alpha), "rho": float(rho), "d": int(d), "samples": len(e_goe), "Delta": Delta, "m": m,
           "amplification": amp_factor}
    pairs_ = (("goe", e_goe), ("amp", e_amp), ("compound", e_cp), ("diff", e_amp - e_goe),
              ("compound_diff", e_cp - e_goe), ("compound_gain", e_amp - e_cp))
    for name, e in pairs_:
        base = m if name in ("goe", "amp", "compound") else 0.0
        out[f"kappa_{name}"] = float((e.mean() - base) / m * d)
        out[f"kappa_{name}_sem"] = float(e.std(ddof=1) / sq / m * d)
    out["predicted_slope_relative"] = out["kappa_amp"] * amp_factor
    return out


def finite_d_se(alpha, rho, d, samples, noise="amp", seed=0, batches=4, tokens=2):
    """A finite-d state evolution for softmax T: the SE fixed point V = F(V) with the prior step
    replaced by its Monte Carlo value at size d,

        F(V) = E ||RIE(S + sqrt(V) N_1; rho, V / (c_T alpha)) - S||^2 / d,

    S the finite-d teacher and N_1 the unit-V noise: "goe" (sqrt(1/(c_T alpha)) GOE) or "amp"
    (GAMP's own noise (1/A) sum g.X, ``gamp_noise`` at V = 1; for softmax it
    scales exactly as sqrt(V) and Delta = V / (c_T alpha)). Common random numbers make F smooth in
    V; the root is found by Brent per batch of draws. Returns the mean fixed point over ``batches``
    and its standard error (spread of the batches): the nonlinear prediction of the AMP error at d,
    with no parameter taken from AMP runs."""
    from scipy.optimize import brentq

    from ..aim import se
    from ..aim.channels import counting_constant

    if noise not in ("amp", "goe"):
        raise AimsymError("noise", f"must be 'amp' or 'goe', got {noise!r}")
    ch = make_channel("softmax", tokens, 1.0)
    T = ch.tokens
    c = counting_constant(T, "softmax")
    d, n = check_size(d, alpha, rho)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(int(samples)):
        S, _ = teacher(d, rho, rng)
        N1 = np.sqrt(1.0 / (c * alpha)) * _goe(d, rng) if noise == "goe" else gamp_noise(ch, d, n, 1.0, rng)[0]
        draws.append((S, N1))

    def F(V, batch):
        return float(np.mean([np.sum((rie_denoise(S + np.sqrt(V) * N1, rho, V / (c * alpha)) - S) ** 2) / d
                              for S, N1 in batch]))

    V_se = se.solve(alpha, rho, T, "softmax").mmse
    roots = []
    for b in range(int(batches)):
        batch = draws[b::int(batches)]
        roots.append(brentq(lambda V: F(V, batch) - V, 0.5 * V_se, 1.6 * V_se, xtol=1e-6 * V_se))
    roots = np.array(roots)
    return {"alpha": float(alpha), "rho": float(rho), "d": int(d), "samples": int(samples), "noise": noise,
            "mmse": float(roots.mean()), "mmse_sem": float(roots.std(ddof=1) / np.sqrt(len(roots))),
            "mmse_se": V_se, "batches": roots.tolist()}


def se_amplification(alpha, rho=0.5, tokens=2):
    """Softmax/linear SE: a relative perturbation eps of the prior step, mmse = (1 + eps) m(Delta),
    Delta = mmse / (c alpha), moves the fixed point by the relative amount eps / (1 - f'),
    f' = d log m / d log Delta at the fixed point. Returns (Delta*, f', 1 / (1 - f')). So a prior
    step with relative finite-size excess kappa / d predicts an AMP slope b / SE = kappa / (1 - f')."""
    from ..aim import se
    from ..aim.channels import counting_constant

    M = se.solve(alpha, rho, tokens, "softmax").mmse
    Delta = M / (counting_constant(tokens, "softmax") * alpha)
    h = 1e-4
    fp = (np.log(rie_mmse(Delta * np.exp(h), rho)) - np.log(rie_mmse(Delta * np.exp(-h), rho))) / (2 * h)
    return float(Delta), float(fp), float(1.0 / (1.0 - fp))


def main(argv=None):
    """``python -m aimsym.studies.aim_finite_size --alpha 0.1 --plan 60x48,100x32 --out FILE``: a finite-size series
    (JSON lines, resumable) and its analysis (JSON on stdout)."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m aimsym.studies.aim_finite_size", description=main.__doc__)
    p.add_argument("--alpha", type=float, required=True)
    p.add_argument("--rho", type=float, default=0.5)
    p.add_argument("--tokens", type=int, default=2)
    p.add_argument("--activation", default="softmax")
    p.add_argument("--beta", type=float, default=1.0)
    p.add_argument("--plan", required=True, help="comma list of DxSEEDS, e.g. 60x48,100x32,150x24")
    p.add_argument("--iterations", type=int, default=120)
    p.add_argument("--out", default=None, help="JSON-lines file of per-seed results (appended, resumable)")
    p.add_argument("--prior", default="mp", choices=("mp", "gaussian"), help="gaussian: S = sqrt(rho) I + GOE (check)")
    p.add_argument("--sensing", default="rank1", choices=("rank1", "goe"), help="goe: dense GOE sensing (check)")
    p.add_argument("--noise-law", default="semicircle", choices=("semicircle", "compound"),
                   help="law of the effective noise the RIE assumes (run(..., noise_law=...))")
    a = p.parse_args(argv)
    try:
        plan = [tuple(int(v) for v in item.split("x")) for item in a.plan.split(",")]
    except ValueError:
        raise SystemExit("plan: expected a comma list of DxSEEDS, e.g. 60x48,100x32")
    recs = finite_size_series(a.alpha, a.rho, plan, a.tokens, a.activation, a.beta, a.iterations, out=a.out,
                              prior=a.prior, sensing=a.sensing, noise_law=a.noise_law)
    res = finite_size_analysis(recs, a.alpha, a.rho, a.tokens, a.activation, a.beta, prior=a.prior)
    res["prior"], res["sensing"], res["noise_law"] = a.prior, a.sensing, a.noise_law
    res["provenance"] = provenance(seed="0..k-1 per d", accuracy={"iterations": a.iterations, "plan": a.plan})
    print(json.dumps(res, default=float))


if __name__ == "__main__":
    raise SystemExit(main())
