"""Figures of docs/erm.md (matplotlib, Agg).  ``aimsym erm plot <figure>``."""

from __future__ import annotations

import os

import numpy as np

from .se import save_figure
from ..erm.params import ERMParams
from ..erm.se import Accuracy, curve, fixed_point
from ..erm.spectrum import ks_distance, spectrum
from ..erm.train import train

FIGURES = ("lam", "models", "spectra", "rank", "beta_T", "seq", "powerlaw")
ACC = Accuracy(gh_nodes=14, gh_final_nodes=18, gh_test_nodes=24, tol=1e-5, qmc_log2=10)
BASE = dict(tokens=2, kappa0=0.5, Delta=0.5)


def _grid(quick, lo=0.02, hi=2.0, n=12):
    return np.geomspace(lo, hi, 4 if quick else n)


def _adam(params, alphas, d, seeds):
    pts = []
    for a in alphas:
        runs = [train(params, a, d, seed=s) for s in range(seeds)]
        t = np.array([r.test for r in runs])
        k = np.array([r.rank for r in runs])
        pts.append((a, t.mean(), t.std(ddof=1) / np.sqrt(len(t)) if len(t) > 1 else 0.0, k.mean()))
    return np.array(pts)


def _theory(params, alphas):
    fps = curve(params, alphas, ACC)
    return np.array([[f.alpha, f.test, f.train, f.rank, f.converged] for f in fps])


def _steps(items, desc):
    """Progress over the curves / panels of a figure (tqdm on stderr)."""
    from tqdm.auto import tqdm

    return tqdm(list(items), desc=desc, leave=False)


def _line(ax, x, y, ok, fmt, **kw):
    """Curve through converged fixed points; non-converged ones marked 'x' (not joined)."""
    ok = ok.astype(bool)
    ax.plot(x[ok], y[ok], fmt, **kw)
    if (~ok).any():
        ax.plot(x[~ok], y[~ok], "x", color=kw.get("color"), ms=6)


# (target, gamma, groups, lam_scale): lam_scale None = fixed lam 0.01; else lam = lam_scale sqrt(alpha)
POWER_CASES = (("wishart", None, None, None), ("power", 1.0, 40, None), ("power", 2.0, 40, None),
               ("wishart", None, None, 0.4), ("power", 1.5, 120, 0.4), ("power", 2.0, 120, 0.4))
POWER_BASE = dict(tokens=2, kappa0=0.5, Delta=0.5, lam=0.01)
POWER_KEYS = ("excess_test", "alignment_error")


def power_grid(quick: bool, tuned: bool):
    if quick:
        return np.geomspace(10.0, 1000.0, 5)
    return np.geomspace(1.0, 1e4, 13) if tuned else np.geomspace(0.01, 1e4, 19)


def power_curves(quick: bool = False, accuracy: Accuracy = ACC, cases=POWER_CASES) -> list[dict]:
    """Excess test error and alignment error on a log grid of alpha, their exponent fitted on the
    last decade and their local exponents decade by decade (aimsym.erm.scaling)."""
    from ..erm.scaling import decade_exponents, fit_exponent, learning_curve
    rows = []
    for target, gamma, groups, lam_scale in cases:
        p = ERMParams(target=target, gamma=gamma, groups=groups, **POWER_BASE)
        lc = learning_curve(p, power_grid(quick, lam_scale is not None), accuracy, lam_scale=lam_scale)
        row = {"target": target, "gamma": gamma, "groups": p.groups, "lam_scale": lam_scale,
               **{k: lc[k].tolist() for k in ("alpha", "test", "test_clean", "matrix_error", "rank",
                                               "delta", "eps", "lam", "converged") + POWER_KEYS},
               "limit": lc["limit"].__dict__}
        for key in POWER_KEYS:
            row[f"exponent_{key}"] = fit_exponent(lc["alpha"], lc[key]).__dict__
            row[f"decade_exponents_{key}"] = [e.__dict__ for e in decade_exponents(lc["alpha"], lc[key])]
        rows.append(row)
    return rows


def _powerlaw_figure(out, quick):
    import json

    import matplotlib.pyplot as plt

    from ..provenance import provenance
    rows = power_curves(quick)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for r, tuned in enumerate((False, True)):
        sel = [row for row in rows if (row["lam_scale"] is not None) == tuned]
        for i, row in enumerate(sel):
            name = ("Wishart" if row["target"] == "wishart"
                    else f"power gamma={row['gamma']:g}, K={row['groups']}")
            for ax, key in zip(axes[r], POWER_KEYS):
                e = row[f"exponent_{key}"]
                ax.loglog(row["alpha"], row[key], "o-", ms=3, color=f"C{i}",
                          label=f"{name}: last-decade slope -{e['exponent']:.3f} +- {e['stderr']:.3f}")
                if tuned and row["gamma"]:
                    a = np.array(row["alpha"])
                    k = 1 - 1 / (2 * row["gamma"])
                    ax.loglog(a, row[key][0] * (a / a[0]) ** -k, ":", color=f"C{i}", lw=1,
                              label=f"alpha^-{k:.3g} (window heuristic, gamma={row['gamma']:g})")
        a = np.array(sel[0]["alpha"])
        for ax, key in zip(axes[r], POWER_KEYS):
            ax.loglog(a, sel[0][key][-1] * (a / a[-1]) ** -1.0, "--", color="0.6", lw=1,
                      label="alpha^-1 (parametric rate)")
            ax.set_xlabel("alpha = n / d^2")
            ax.legend(fontsize=6)
        axes[r][0].set_ylabel(("lam = 0.4 sqrt(alpha)" if tuned else "lam = 0.01")
                              + "\nexcess test error  test - test(alpha = inf)", fontsize=8)
        axes[r][1].set_ylabel("alignment error  1 - m^2 / (Q0 q)", fontsize=8)
    fig.suptitle("ERM learning curves, T=2, kappa0=0.5, Delta=0.5 (slopes: least squares on the "
                 "last decade)", fontsize=9)
    fig.tight_layout()
    with open(os.path.splitext(out)[0] + ".json", "w") as fh:
        json.dump({"curves": rows, "params": POWER_BASE, "accuracy": ACC.__dict__,
                   "provenance": provenance(accuracy=ACC.__dict__)}, fh, indent=1, default=str)
    return fig


def make(figure: str, out: str | None = None, *, d: int = 60, seeds: int = 3, quick: bool = False) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = out or os.path.join("docs", "figures", f"erm_{figure}.png")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    alphas = _grid(quick)
    adam_alphas = [0.05, 0.2, 0.8] if not quick else [0.2]
    if figure == "powerlaw":
        fig = _powerlaw_figure(out, quick)
        save_figure(fig, out, dpi=80)
        plt.close(fig)
        return out
    if figure == "spectra":
        fig, axes = plt.subplots(1, 4, figsize=(13, 3.2))
    else:
        fig, ax = plt.subplots(figsize=(5.5, 4))
    if figure in ("lam", "models", "seq", "rank"):
        if figure == "lam":
            cases = [(f"lam={lam}", ERMParams(lam=lam, **BASE)) for lam in (0.001, 0.01, 0.1)]
        elif figure == "models":
            cases = [("factorised (PSD nuclear)", ERMParams(lam=0.01, **BASE)),
                     ("direct (ridge)", ERMParams(lam=0.01, model="direct", **BASE))]
        elif figure == "seq":
            cases = [("seq-to-label", ERMParams(lam=0.01, **BASE)),
                     ("seq-to-sequence", ERMParams(lam=0.01, output="sequence", **BASE))]
        else:
            cases = [(f"lam={lam}", ERMParams(lam=lam, **BASE)) for lam in (0.001, 0.01, 0.1)]
        for i, (label, p) in _steps(enumerate(cases), f"erm {figure}: curves"):
            color = f"C{i}"
            th = _theory(p, alphas) if not (figure == "seq" and i == 1) else None
            col = 3 if figure == "rank" else 1
            if th is not None:
                _line(ax, th[:, 0], th[:, col], th[:, 4], "-", color=color, label=f"{label} (theory)")
                if figure == "lam":
                    _line(ax, th[:, 0], th[:, 2], th[:, 4], ":", color=color, lw=1, label=f"{label} train (theory)")
            pts = _adam(p, adam_alphas, d, seeds)
            if figure == "rank":
                ax.plot(pts[:, 0], pts[:, 3], "o", color=color, label=f"Adam d={d}")
            else:
                ax.errorbar(pts[:, 0] * (1.04 if i == 1 and figure == "seq" else 1), pts[:, 1],
                            yerr=pts[:, 2], fmt="o" if i == 0 or figure != "seq" else "s",
                            color=color, ms=4, capsize=2, label=f"Adam {label}, d={d}, {seeds} seeds")
        ax.set_xscale("log")
        ax.set_xlabel("alpha = n / d^2")
        ax.set_ylabel("predicted rank of S (1 - delta peak)" if figure == "rank" else "test error")
        title = {"lam": "factorised, kappa0=0.5, Delta=0.5 (dotted: train)",
                 "models": "factorised vs direct, lam=0.01", "seq": "seq-to-seq vs seq-to-label",
                 "rank": "rank of the learned S"}[figure]
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    elif figure == "beta_T":
        cases = [("T=2, beta=beta0=1", dict(tokens=2)), ("T=2, beta=beta0=2", dict(tokens=2, beta=2.0, beta0=2.0)),
                 ("T=2, beta=beta0=0.5", dict(tokens=2, beta=0.5, beta0=0.5)), ("T=3, beta=beta0=1", dict(tokens=3))]
        for i, (label, kw) in _steps(enumerate(cases), "erm beta_T: curves"):
            p = ERMParams(kappa0=0.5, Delta=0.5, lam=0.01, **kw)
            grid = alphas if kw["tokens"] == 2 else _grid(quick, n=7)
            th = _theory(p, grid)
            # compare at equal alpha_bar = alpha (T^2+T-2)/2
            _line(ax, p.alpha_bar(th[:, 0]), th[:, 1], th[:, 4], "-", color=f"C{i}", label=label)
        ax.set_xscale("log")
        ax.set_xlabel("alpha_bar = alpha (T^2+T-2)/2")
        ax.set_ylabel("test error")
        ax.set_title("temperature and sequence length (lam=0.01; x: not converged)", fontsize=9)
        ax.legend(fontsize=7)
    elif figure == "spectra":
        p = ERMParams(lam=0.01, **BASE)
        for ax, a in _steps(zip(axes, (0.05, 0.5, 4.0, 40.0)), "erm spectra: panels"):
            fp = fixed_point(p, a, ACC)
            sp = spectrum(fp, 400)
            dd = d if a <= 0.5 else (30 if a <= 4 else 16)
            ev = np.concatenate([train(p, a, dd, seed=s).eigenvalues for s in range(1 if quick else seeds)])
            nz = ev[np.abs(ev) >= 1e-2 * np.abs(ev).max()]
            ks = ks_distance(fp, ev)
            ax.hist(nz, bins=25, density=True, weights=None, alpha=0.45, color="C1",
                    label=f"Adam d={dd} (non-zero)")
            # histogram is normalised on the non-zero part: rescale the density the same way
            ax.plot(sp.s, sp.density / max(sp.rank, 1e-12), "k-", lw=1.2, label="theory")
            ax.set_title(f"alpha={a}: peak {sp['delta_peak']:.2f} (Adam "
                         f"{np.mean(np.abs(ev) < 1e-2 * np.abs(ev).max()):.2f}), KS {ks:.2f}", fontsize=8)
            ax.set_xlabel("eigenvalue of S")
            ax.set_ylabel("density (non-zero part)")
        axes[0].legend(fontsize=7)
    else:
        raise ValueError(figure)
    fig.tight_layout()
    save_figure(fig, out, dpi=80)
    plt.close(fig)
    return out
