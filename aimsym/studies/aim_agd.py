"""Averaged gradient descent (AGD) against the Bayes-optimal error of the AIM at finite d
(docs/aim.md, "Averaged GD against the Bayes error"): per data set, K Adam runs from independent
initialisations, the errors of single runs (GD), of their average (AGD) and the unbiased estimate
of the infinitely-many-runs average (``gd.train_averaged``), and GAMP-RIE on the same data (the
finite-d proxy of the Bayes error, docs/aim.md section 4). JSON lines, resumable.

    python -m aimsym.studies.aim_agd --alpha 0.08,0.12,0.16 --plan 60x6,100x6,150x4 --out FILE
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from ..aim.amp import run as amp_run
from ..aim.data import generate
from ..aim.gd import train_averaged
from ..provenance import provenance
from . import read_records
from .aim_finite_size import finite_size_fit


def agd_series(alphas, plan, rho=0.5, runs=4, steps=2000, lr=0.01, amp_iterations=120, out=None,
               progress=True):
    """For every alpha, every (d, seeds) in ``plan`` and seeds 0..k-1: one record (dict) with the
    GD / AGD / AGD-infinity errors, the final training losses and GAMP's error on the same data.
    ``out``: JSON-lines file, appended per record; records already in it are reused."""
    done = read_records(out, lambda r: (r["alpha"], r["d"], r["seed"], r["runs"], r["steps"], r["lr"]))
    jobs = [(float(a), int(d), s) for a in alphas for d, k in plan for s in range(int(k))]
    from tqdm.auto import tqdm

    records = []
    with tqdm(total=len(jobs), desc="AGD data sets", unit="set", disable=not progress, file=sys.stderr) as bar:
        for alpha, d, seed in jobs:
            key = (alpha, d, seed, int(runs), int(steps), float(lr))
            if key in done:
                records.append(done[key])
                bar.update()
                continue
            bar.set_postfix(alpha=alpha, d=d, seed=seed)
            t = time.process_time()
            data = generate(d, alpha, rho, 2, "softmax", 1.0, seed=seed)
            tr = train_averaged(data, runs, steps=steps, lr=lr, seed=seed, rho=rho)
            t_gd = time.process_time() - t
            res = amp_run(data, 2, "softmax", 1.0, iterations=amp_iterations)
            rec = {"alpha": alpha, "d": d, "seed": seed, "rho": float(rho), "runs": int(runs), "steps": int(steps),
                   "lr": float(lr), **tr, "amp": res.mmse, "amp_unstable": bool(res.unstable),
                   "cpu_seconds_gd": t_gd, "cpu_seconds": time.process_time() - t}
            records.append(rec)
            if out is not None:
                with open(out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            bar.update()
    return records


def _mean_sem(x):
    x = np.asarray(x, dtype=float)
    return float(x.mean()), (float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else None)


def agd_analysis(records, rho=0.5):
    """Per (alpha, d): mean and standard error over data sets of GD (single runs), AGD (K runs),
    AGD-infinity, GAMP, and the paired differences AGD-infinity - GAMP; the SE mmse. Per alpha:
    the fit AGD-infinity(d) = a + b/d (``finite_size_fit``, order 1) with z = (a - SE)/se(a)."""
    from ..aim import se

    out = {}
    for alpha in sorted({r["alpha"] for r in records}):
        m_se = se.solve(alpha, rho, 2, "softmax", 1.0).mmse
        rows = []
        for d in sorted({r["d"] for r in records if r["alpha"] == alpha}):
            rs = [r for r in records if r["alpha"] == alpha and r["d"] == d]
            row = {"d": d, "seeds": len(rs), "runs": rs[0]["runs"]}
            for name, vals in (("gd", [np.mean(r["gd"]) for r in rs]), ("agd", [r["agd"] for r in rs]),
                               ("agd_inf", [r["agd_inf"] for r in rs]), ("amp", [r["amp"] for r in rs]),
                               ("agd_inf_minus_amp", [r["agd_inf"] - r["amp"] for r in rs])):
                row[name], row[name + "_sem"] = _mean_sem(vals)
            row["train_loss_max"] = float(max(max(r["train_loss"]) for r in rs))
            row["amp_unstable"] = int(sum(r["amp_unstable"] for r in rs))
            rows.append(row)
        entry = {"alpha": alpha, "mmse_se": m_se, "rows": rows}
        fit_rows = [r for r in rows if r["agd_inf_sem"]]
        if len(fit_rows) >= 3:
            f = finite_size_fit([r["d"] for r in fit_rows], [r["agd_inf"] for r in fit_rows],
                                [r["agd_inf_sem"] for r in fit_rows])
            a, sa = f["coef"][0], f["coef_se_scaled"][0]
            entry["agd_inf_fit"] = {"a": a, "a_se": sa, "b": f["coef"][1], "b_se": f["coef_se_scaled"][1],
                                    "z_vs_se": (a - m_se) / sa, "chi2": f["chi2"], "dof": f["dof"]}
        out[str(alpha)] = entry
    return out


def main(argv=None):
    """``python -m aimsym.studies.aim_agd --alpha 0.08,0.12,0.16 --plan 60x6,100x6,150x4 --out FILE``:
    AGD series (JSON lines, resumable) and its analysis (JSON on stdout)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m aimsym.studies.aim_agd", description=main.__doc__)
    p.add_argument("--alpha", required=True, help="comma list of alpha")
    p.add_argument("--rho", type=float, default=0.5)
    p.add_argument("--plan", required=True, help="comma list of DxSEEDS, e.g. 60x6,100x6,150x4")
    p.add_argument("--runs", type=int, default=4, help="Adam runs per data set (K >= 2)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--out", default=None, help="JSON-lines file of per-data-set results (appended, resumable)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    try:
        alphas = [float(v) for v in a.alpha.split(",")]
        plan = [tuple(int(v) for v in item.split("x")) for item in a.plan.split(",")]
    except ValueError:
        raise SystemExit("alpha/plan: expected comma lists, e.g. --alpha 0.1,0.15 --plan 60x6,100x4")
    if a.runs < 2:
        raise SystemExit("runs: need K >= 2 runs per data set (AGD-infinity uses their spread)")
    recs = agd_series(alphas, plan, a.rho, a.runs, a.steps, a.lr, out=a.out, progress=not a.quiet)
    res = agd_analysis(recs, a.rho)
    res["provenance"] = provenance(seed="0..k-1 per d; Adam inits [seed, 7919]",
                                   accuracy={"runs": a.runs, "steps": a.steps, "lr": a.lr, "plan": a.plan})
    print(json.dumps(res, default=float))


if __name__ == "__main__":
    raise SystemExit(main())
