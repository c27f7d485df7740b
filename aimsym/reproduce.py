"""The papers' figures, one command each: ``aimsym reproduce NAME [--quick] [--out DIR]``.

A registry (:data:`FIGURES`) maps every figure of the three papers to the code that draws it:
the figure functions of :mod:`aimsym.plot` (AIM, ERM, SE overlaps and phase diagram), the AMP
and gradient-descent figures of :mod:`aimsym.bench.amp`, and the SE sweep and thresholds behind
them. Each entry has two settings: ``quick`` (small grids, seconds to a minute on one core: for
tests and a first look) and full (the settings of the docs' figures, or the paper's where we can
afford them). Figures that need data we cannot ship, or that aimsym cannot compute yet, are
listed with their status and the reason.

A run writes into its folder (default ``reproduce/NAME``):

- ``NAME.png``, ``NAME.pdf``: the figure;
- ``NAME.csv``: the numbers the figure shows (``panel, series, kind, x, y, yerr``), read from its
  drawn artists (:mod:`aimsym.plot.table`), so the table is exactly the figure;
- ``NAME.json``: what was run (paper, figure, caption, settings, the panels' titles and axis
  labels, the solvers' summaries, provenance: seed, model hash, versions, accuracy, time);
- ``NAME_<table>.csv`` where a figure has a finer table (every SE point with its standard error
  and provenance columns; the phase-diagram thresholds);
- ``NAME_state/``: what the figure's code keeps between runs (``STATE_FILES``: the SE sweep's
  store, the thresholds), so a rerun into the same folder resumes.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import AimsymError
from .results import to_builtin

AVAILABLE, UNAVAILABLE, NOT_IMPLEMENTED = "available", "unavailable", "not implemented"

PAPERS = {
    "SMI": "Troiani, Cui, Dandi, Krzakala, Zdeborová: Fundamental limits of learning in sequence multi-index "
           "models and deep attention networks: high-dimensional asymptotics and sharp thresholds",
    "AIM": "Boncoraglio, Troiani, Erba, Zdeborová: Bayes optimal learning of attention-indexed models "
           "(arXiv 2506.01582)",
    "ERM": "Empirical risk minimization in a single-head tied-attention layer on attention-indexed data "
           "(train/test errors, thresholds, spectra, factorised vs direct)",
}

L2, L3 = "attention_L2_T2", "attention_L3_T2"


@dataclass(frozen=True)
class PaperFigure:
    """One figure of a paper: its name on the command line, where it is in the paper, what it
    shows, and ``draw(work, quick) -> dict`` (draws through :func:`aimsym.plot.se.save_figure`
    into the folder ``work``; returns settings, summaries, finer tables, seed and model hash)."""

    name: str
    paper: str
    figure: str
    caption: str
    status: str = AVAILABLE
    reason: str = ""
    draw: Callable[[Path, bool], dict] | None = field(default=None, repr=False, compare=False)
    # relative tolerance for curves without error bars when a quick run is compared with the full
    # one (compare_runs): set where those curves are deterministic (closed forms, solvers at a fixed
    # tolerance); None: Monte Carlo curves drawn without error bars are not compared
    line_rtol: float | None = None

    def command(self, quick: bool = False) -> str | None:
        return f"aimsym reproduce {self.name}" + (" --quick" if quick else "") if self.status == AVAILABLE else None

    def to_json(self) -> dict:
        return {"name": self.name, "paper": self.paper, "figure": self.figure, "caption": self.caption,
                "status": self.status, "reason": self.reason or None, "command": self.command()}


# ----------------------------------------------------------------------------- SMI paper
def _resume_json(path: Path, key: dict):
    """The value stored at path by an earlier run with the same key (model hash and settings), or None."""
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec["value"] if rec.get("key") == json.loads(json.dumps(key)) else None


def se_overlaps(work: Path, model: str, *, title: str, alphas, samples: int, tol: float, nodes: int | None,
                th_samples: int, th_se_samples: int, pr_samples: int, seed: int = 0,
                max_iter: int | None = None) -> dict:
    """Per-layer SE overlaps vs alpha (skip 1, uninformed start, warm starts along alpha) with the
    staircase thresholds and the perfect-recovery marks (counting bound p/m, local stability of
    Q = I): ``aimsym thresholds`` + ``aimsym sweep`` + ``aimsym plot``."""
    from .model import load
    from .plot.se import overlaps
    from .smi.passes import clear as clear_passes
    from .smi.thresholds import threshold_report
    from .studies.sweep import export, run_sweep

    m = load(model, skip=1.0)
    # the sweep first: its points are stored one by one (the staircase's later steps can take hours)
    store = work / "sweep.sqlite"
    run_sweep(model, alphas, params={"skip": [1.0]}, store=store, samples=samples, tol=tol, nodes=nodes, seed=seed,
              workers=1, progress=True, max_iter=max_iter)
    th_key = {"model_hash": m.hash(), "samples": th_samples, "se_samples": th_se_samples, "nodes": nodes, "seed": seed,
              "pr_samples": pr_samples}
    th = _resume_json(work / "thresholds.json", th_key)
    if th is None:
        # (its passes are per code version and too large for git; the staircase's finished restricted
        # SE points, small, are kept in the state folder for any later job: threshold_points)
        rep = threshold_report(m, samples=th_samples, se_samples=th_se_samples, nodes=nodes, seed=seed,
                               pr_samples=pr_samples, pr_algorithmic=False, checkpoint=work / "threshold_passes",
                               kept=work / "threshold_points")
        th = json.loads(json.dumps(rep, default=to_builtin))
        (work / "thresholds.json").write_text(json.dumps({"key": th_key, "value": th}))
        if not rep.failed:
            clear_passes(work / "threshold_passes")
    rows = [r for r in export(store) if r["init"] == "uninformed"]
    overlaps(rows, work / "overlaps.png", th["staircase"], title, perfect=th["perfect_recovery"])
    settings = {"model": model, "skip": 1.0, "alphas": [float(a) for a in alphas], "samples": samples, "tol": tol,
                "nodes": nodes, "threshold_samples": th_samples, "threshold_se_samples": th_se_samples,
                "perfect_recovery_samples": pr_samples, "perfect_recovery": "local stability of Q = I",
                "max_maps_per_point": max_iter}
    return {"settings": settings, "summary": {"thresholds": th}, "tables": {"points": rows}, "seed": seed,
            "model_hash": m.hash()}


def _smi_fig1_left(work: Path, quick: bool) -> dict:
    if quick:
        return se_overlaps(work, L2, title="two layers, T = 2, skip 1 (quick)", alphas=[0.3, 0.6, 0.9], samples=256,
                           tol=1e-3, nodes=None, th_samples=4096, th_se_samples=256, pr_samples=256)
    return se_overlaps(work, L2, title="two layers, T = 2, skip 1", alphas=np.linspace(0.1, 1.1, 41), samples=1024,
                       tol=1e-3, nodes=None, th_samples=32768, th_se_samples=2048, pr_samples=1024)


FIG3_MAPS = 60


def _smi_fig3_left(work: Path, quick: bool) -> dict:
    if quick:
        return se_overlaps(work, L3, title="three layers, T = 2, skip 1 (quick)", alphas=[0.4, 1.0], samples=64,
                           tol=1e-3, nodes=6, th_samples=1024, th_se_samples=64, pr_samples=64)
    # a map budget per point: above the local stability of Q = I (1.56 +- 0.04) the approach to I is
    # steady at ~0.98 per map, 4-5 min each, and the SE's verdict "Q = I" (an Aitken limit within 1 %
    # of 1 - Q) can take hundreds of maps there; a point at the budget is stored as not converged
    return se_overlaps(work, L3, title="three layers, T = 2, skip 1", alphas=np.linspace(0.1, 1.6, 16), samples=512,
                       tol=1e-3, nodes=None, th_samples=2048, th_se_samples=256, pr_samples=512, max_iter=FIG3_MAPS)


def _smi_fig1_right(work: Path, quick: bool) -> dict:
    """Thresholds vs skip (``aimsym thresholds --over skip=... --pr-local --figure``)."""
    from .model import load
    from .plot.se import phase_diagram as draw
    from .smi.thresholds import phase_diagram, phase_rows

    if quick:
        values, kw, workers = [0.5, 1.0, 2.0], dict(samples=4096, stair_samples=2048, se_samples=256,
                                                     pr_samples=256), 1
    else:
        values, kw, workers = np.linspace(0.25, 4, 16).tolist(), dict(samples=16384, stair_samples=8192,
                                                                      se_samples=1024, pr_samples=1024), None
    pd = phase_diagram(L2, "skip", values, workers=workers, progress=True, perfect=True, pr_algorithmic=False, **kw)
    rows = phase_rows(pd)
    draw(rows, work / "phase_diagram.png", title=f"{L2}: thresholds vs skip")
    return {"settings": {"model": L2, "skip": values, **kw, "perfect_recovery": "local stability of Q = I"},
            "tables": {"thresholds": rows}, "seed": 0, "model_hash": load(L2).hash()}


def _smi_fig2_left(work: Path, quick: bool) -> dict:
    """GAMP per-layer overlaps per iteration on the SE trajectory (``python -m aimsym.bench.amp
    --figures DIR --only iterations``)."""
    from .bench.amp import iterations_figure
    from .model import load

    m = load(L2, skip=1.0)
    kw = dict(d=300, seeds=2, iters=20, se_samples=512) if quick else dict(d=1000, seeds=4, iters=40, se_samples=4096)
    summary = iterations_figure(m, work, **kw)
    return {"settings": {"model": L2, "skip": 1.0, "alpha": 1.2, "lambda": 1e-2, **kw}, "summary": summary,
            "seed": 1, "model_hash": m.hash()}


def _smi_fig_a5(work: Path, quick: bool) -> dict:
    """GAMP with the last layer held at a fixed overlap (SMI appendix E, Fig. 5)."""
    from .bench.amp import held_layer_figure
    from .model import load

    m = load(L2, skip=1.0)
    # quick: the full run's d and iterations, two of its seeds and four of its held overlaps
    kw = (dict(d=1000, seeds=2, iters=60, overlaps=(0.0, 0.6, 0.9, 0.99)) if quick
          else dict(d=1000, seeds=4, iters=60, overlaps=(0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 0.99)))
    summary = held_layer_figure(m, work, **kw)
    return {"settings": {"model": L2, "skip": 1.0, "alpha": 1.2, "lambda": 1e-2, **kw}, "summary": summary,
            "seed": 1, "model_hash": m.hash()}


def _smi_fig2_right(work: Path, quick: bool) -> dict:
    """Adam per-layer overlaps per epoch (``python -m aimsym.bench.amp --figures DIR --only gd``)."""
    from .bench.amp import gd_figure
    from .model import load

    m = load(L2, skip=1.0)
    # quick: the full run's d, two of its seeds, its first 150 epochs
    kw = dict(d=200, seeds=2, epochs=150, alphas=(16, 8)) if quick else dict(d=200, seeds=3, epochs=1000, alphas=(16, 8))
    summary = gd_figure(m, work, **kw)
    return {"settings": {"model": L2, "skip": 1.0, "optimizer": "adam", "lr": 0.03, "batch": "full", **kw},
            "summary": summary, "seed": 1, "model_hash": m.hash()}


# ----------------------------------------------------------------------------- AIM paper
def _aim_fig1_left(work: Path, quick: bool) -> dict:
    from .plot.aim import fig_hardmax

    # quick: the full run's d, two of its seeds, two of its AMP points
    kw = (dict(d=100, n_seeds=2, n_alpha=8, points=(0.3, 1.0), t3=False) if quick
          else dict(d=100, n_seeds=16, n_alpha=40, points=(0.1, 0.3, 1.0, 3.0), t3=True))
    fig_hardmax(work, **kw)
    return {"settings": {"rho": [0.25, 0.5, 1.0], "tokens": 2, "activation": "hardmax", "amp_rho": 0.5, **kw},
            "seed": list(range(kw["n_seeds"]))}


def _aim_fig1_right(work: Path, quick: bool) -> dict:
    from .plot.aim import fig_small_width

    n = 8 if quick else 78  # quick: every 11th point of the full grid
    fig_small_width(work, n_points=n)
    return {"settings": {"rho": [0.01, 0.05, 0.2], "alpha_bar": [0.05, 4.0], "n_points": n, "tokens": 2,
                         "activation": "hardmax"}}


def _aim_fig2_left(work: Path, quick: bool) -> dict:
    from .plot.aim import fig_softmax

    fig_softmax(work, "softmax")
    return {"settings": {"rho": [0.1, 0.25, 0.5, 0.75, 1.0, 2.0], "tokens": 2, "activation": "softmax",
                         "curve": "parametric in Delta (300 points, exact)"}}


def _aim_fig2_right(work: Path, quick: bool) -> dict:
    from .plot.aim import fig_tokens

    kw = dict(d=100, n_seeds=2, points=(0.08, 0.16)) if quick else dict(d=100, n_seeds=16)  # (quick: as aim-fig1-left)
    fig_tokens(work, **kw)
    return {"settings": {"rho": 0.5, "tokens": [2, 3, 4], "gd_d": min(kw["d"], 60), "gd_seeds": 2, "gd_runs": 3,
                         **kw}, "seed": list(range(kw["n_seeds"]))}


def _aim_fig3(work: Path, quick: bool) -> dict:
    from .plot.aim import fig_softmax

    fig_softmax(work, "linear")
    return {"settings": {"rho": [0.1, 0.25, 0.5, 0.75, 1.0, 2.0], "tokens": 2, "activation": "linear",
                         "curve": "parametric in Delta (300 points, exact)"}}


def _aim_fig4(work: Path, quick: bool) -> dict:
    from .plot.aim import fig_many_tokens

    kw = dict(d=120, n_seeds=2, fractions=(0.55, 0.85)) if quick else dict(d=120, n_seeds=16)  # (as aim-fig1-left)
    fig_many_tokens(work, **kw)
    return {"settings": {"rho": 0.5, "tokens": [4, 5], **kw}, "seed": list(range(kw["n_seeds"]))}


def _aim_fig5(work: Path, quick: bool) -> dict:
    """Softmax T = 2 at low width: finite-rho SE in alpha_bar = alpha / rho, the rho -> 0 limit and
    the weak-recovery threshold 1 / c_T (``aimsym aim se --small-width --activation softmax``)."""
    from .plot.aim import GAP_RHOS, fig_small_width_softmax

    rhos = (0.1, 0.01, 1e-3, 1e-4)
    # quick: every 10th point of the full grid (alpha_bar_k = k * 1.4 alpha_bar_PR / n_points)
    kw = dict(n_points=15, rhos=rhos, gap_rhos=rhos) if quick else dict(n_points=150, rhos=rhos, gap_rhos=GAP_RHOS)
    points: list[dict] = []
    _, meta = fig_small_width_softmax(work, tokens=2, table=points, **kw)
    return {"settings": {"tokens": 2, "activation": "softmax", "beta": "any (the SE does not depend on it)",
                         "rho": list(rhos), "gap_rho": list(kw["gap_rhos"]), "n_points": kw["n_points"],
                         "alpha_bar": [points[0]["alpha_bar"], points[-1]["alpha_bar"]],
                         "finite_rho": "parametric softmax SE, Brent in log Delta (xtol 1e-13)",
                         "limit": "closed form t = 2 - c alpha_bar"},
            "summary": meta, "tables": {"points": points}}


# ----------------------------------------------------------------------------- ERM paper
# the ERM theory curves are fixed points iterated to a step of 1e-5 (plot.erm.ACC), each
# warm-started from its neighbour on the alpha grid, so at an alpha the quick and full grids share
# they differ by the remaining distance to the fixed point: up to 1.5e-4 relative in the test
# error (erm-errors, measured), compared within ERM_LINE_RTOL
ERM_LINE_RTOL = 1e-3


def _erm(which: str):
    def draw(work: Path, quick: bool) -> dict:
        from .plot.erm import make

        d = 30 if quick else (60 if which == "spectra" else 50)
        seeds = 2 if quick else 3
        make(which, str(work / f"erm_{which}.png"), d=d, seeds=seeds, quick=quick)
        return {"settings": {"figure": which, "adam_d": d, "adam_seeds": seeds, "alpha_points": 4 if quick else 12,
                             "tokens": 2, "kappa0": 0.5, "Delta": 0.5}, "seed": list(range(seeds))}
    return draw


# ----------------------------------------------------------------------------- the registry
FIGURES: tuple[PaperFigure, ...] = (
    PaperFigure("smi-fig1-left", "SMI", "Fig. 1 (left)",
                "two-layer attention (T = 2, skip 1): per-layer Bayes-optimal overlaps vs alpha; the last layer "
                "is learned first, then the first; the phases between the weak-recovery thresholds are shaded",
                draw=_smi_fig1_left),
    PaperFigure("smi-fig1-right", "SMI", "Fig. 1 (right)",
                "phase diagram of the two-layer model: the staircase thresholds (and where Q = I becomes "
                "stable) vs the skip strength c", draw=_smi_fig1_right),
    PaperFigure("smi-fig2-left", "SMI", "Fig. 2 (left)",
                "GAMP per-layer overlaps over iterations at fixed alpha (d finite, several seeds) against the "
                "state evolution: the second layer is learned within a few iterations, the first later",
                draw=_smi_fig2_left),
    PaperFigure("smi-fig2-right", "SMI", "Fig. 2 (right)",
                "gradient descent on the same two-layer model: per-layer overlaps over epochs; the layers are "
                "learned one after the other (here Adam, full batch)", draw=_smi_fig2_right),
    PaperFigure("smi-fig3-left", "SMI", "Fig. 3 (left)",
                "three-layer attention (T = 2, skip 1): per-layer overlaps vs alpha; the last layer first, the "
                "first two together", draw=_smi_fig3_left),
    PaperFigure("smi-fig3-right", "SMI", "Fig. 3 (right)",
                "a two-attention-layer transformer trained with AdamW on TREC question classification (BERT "
                "embeddings): similarity of each layer's weights to their final value over training",
                status=UNAVAILABLE,
                reason="needs the TREC data set and BERT embeddings, which aimsym does not ship (a real-data "
                       "experiment, outside the SMI theory)"),
    PaperFigure("smi-figA5", "SMI", "Fig. 5 (appendix)",
                "AMP with the second layer's overlap held fixed: the first layer's final overlap depends "
                "strongly on it; blocking the second layer prevents learning the first (here: final overlap "
                "of layer 1 vs the held overlap of layer 2, alpha = 1.2)", draw=_smi_fig_a5),
    PaperFigure("aim-fig1-left", "AIM", "Fig. 1 (left)",
                "hardmax, T = 2: Bayes-optimal error vs alpha (log-log) for several width ratios rho; power-law "
                "decay at large alpha; AMP points (d = 100, 16 data sets in the paper)", draw=_aim_fig1_left,
                line_rtol=1e-6),
    PaperFigure("aim-fig1-right", "AIM", "Fig. 1 (right)",
                "hardmax, T = 2 at small width: error vs alpha_bar = alpha / rho, the rho -> 0 limit and the "
                "weak-recovery threshold alpha_bar_c (grey line)", draw=_aim_fig1_right, line_rtol=1e-6),
    PaperFigure("aim-fig2-left", "AIM", "Fig. 2 (left)",
                "softmax (any beta), T = 2: Bayes-optimal error vs alpha for several rho; zero error at a finite "
                "alpha (the counting threshold, ticks)", draw=_aim_fig2_left, line_rtol=1e-6),
    PaperFigure("aim-fig2-right", "AIM", "Fig. 2 (right)",
                "softmax, rho = 0.5: the error vs alpha rescaled by (T^2 + T - 2) is the same curve for every T; "
                "AMP, Adam (GD) and averaged GD (AGD) points", draw=_aim_fig2_right, line_rtol=1e-6),
    PaperFigure("aim-fig3", "AIM", "Fig. 3",
                "linear-output baseline, T = 2: Bayes-optimal error vs alpha for several rho; recovery at the "
                "counting threshold (ticks)", draw=_aim_fig3, line_rtol=1e-6),
    PaperFigure("aim-fig4", "AIM", "Fig. 4",
                "softmax, T = 4 and 5: state-evolution error vs alpha with AMP points (d = 120, 16 data sets in "
                "the paper)", draw=_aim_fig4, line_rtol=1e-6),
    PaperFigure("aim-fig5", "AIM", "Fig. 5",
                "softmax, T = 2 at low width: error vs alpha_bar = n / (d r) for several rho, the rho -> 0 limit "
                "and the predicted weak-recovery threshold alpha_bar_c = 1 / (T^2 + T - 2) (grey line)",
                draw=_aim_fig5, line_rtol=1e-6),
    PaperFigure("erm-errors", "ERM", "test and train errors",
                "factorised tied attention (PSD nuclear norm): test error (solid) and train error (dotted) vs "
                "alpha for weight decay lambda = 0.001, 0.01, 0.1, with Adam points", draw=_erm("lam"),
                line_rtol=ERM_LINE_RTOL),
    PaperFigure("erm-models", "ERM", "factorised vs direct",
                "test error vs alpha: factorised W W^T (implicit nuclear norm) against the direct ridge "
                "parametrisation of S, with Adam points", draw=_erm("models"), line_rtol=ERM_LINE_RTOL),
    PaperFigure("erm-spectra", "ERM", "spectra",
                "spectrum of the learned S at alpha = 0.05, 0.5, 4, 40: theory (delta peak at 0 plus bulk) "
                "against the eigenvalues of Adam solutions", draw=_erm("spectra"), line_rtol=1e-6),
    PaperFigure("erm-rank", "ERM", "rank",
                "predicted rank of the learned S (1 - delta peak) vs alpha for three lambda, with Adam",
                draw=_erm("rank"), line_rtol=ERM_LINE_RTOL),
    PaperFigure("erm-beta-T", "ERM", "temperature and tokens",
                "test error vs alpha_bar = alpha (T^2 + T - 2) / 2 for several beta = beta0 and T = 3",
                draw=_erm("beta_T"), line_rtol=ERM_LINE_RTOL),
    PaperFigure("erm-seq", "ERM", "sequence-to-sequence",
                "sequence-to-sequence vs sequence-to-label outputs: the same asymptotic test error, Adam "
                "points for both", draw=_erm("seq"), line_rtol=ERM_LINE_RTOL),
)


def names() -> list[str]:
    return [f.name for f in FIGURES]


def lookup(name: str) -> PaperFigure:
    """The registry entry; an unknown name is one line listing the allowed ones."""
    for f in FIGURES:
        if f.name == name:
            return f
    raise AimsymError("NAME", f"unknown figure {name!r}; choose from {', '.join(names())} "
                              "(aimsym reproduce --list)")


def listing() -> list[dict]:
    return [f.to_json() for f in FIGURES]


# ----------------------------------------------------------------------------- running one
def _read_rows(path: Path) -> dict[tuple, tuple[float, float]]:
    """(panel, series, kind, x) -> (y, yerr) of a figure CSV (x rounded to 10 significant digits)."""
    out = {}
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            try:
                x, y = float(r["x"]), float(r["y"])
            except (KeyError, TypeError, ValueError):
                continue
            err = float(r.get("yerr") or "nan")
            out[(r["panel"], r["series"], r["kind"], float(f"{x:.10g}"))] = (y, err)
    return out


def compare_runs(quick_csv, full_csv, *, z: float = 4.0, line_rtol: float | None = None) -> dict:
    """A quick run's data against a full run's at their shared points: rows with the same panel,
    series, kind and x. Where both carry an error bar the values must agree within ``z`` combined
    standard errors; where either has none, within ``line_rtol`` relative (deterministic curves),
    or not at all if it is None (counted in ``unchecked``). Returns the counts and the
    disagreements (``ok`` False if any point fails)."""
    rtol = 1e-9 if line_rtol is None else line_rtol
    q, f = _read_rows(Path(quick_csv)), _read_rows(Path(full_csv))
    shared = sorted(set(q) & set(f), key=str)
    fails, worst, unchecked = [], 0.0, 0
    for key in shared:
        (yq, eq), (yf, ef) = q[key], f[key]
        if not (np.isfinite(yq) and np.isfinite(yf)):
            if np.isfinite(yq) != np.isfinite(yf):
                fails.append({"point": list(key), "quick": yq, "full": yf, "why": "finite in one run only"})
            continue
        if np.isfinite(eq) and np.isfinite(ef):
            scale = z * float(np.hypot(eq, ef)) + rtol * max(1.0, abs(yf))
            what = f"{z:g} combined standard errors"
        elif line_rtol is None:
            unchecked += 1
            continue
        else:
            scale = rtol * max(1.0, abs(yf))
            what = f"relative {rtol:g} (no error bar)"
        ratio = abs(yq - yf) / scale if scale > 0 else (0.0 if yq == yf else np.inf)
        worst = max(worst, ratio)
        if ratio > 1:
            fails.append({"point": list(key), "quick": yq, "full": yf, "allowed": scale, "rule": what})
    return {"shared_points": len(shared), "unchecked": unchecked, "quick_points": len(q), "full_points": len(f),
            "worst_ratio": worst, "failures": fails, "ok": not fails}


def _write_csv(path: Path, rows: list[dict]) -> None:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows([{k: (json.dumps(v, default=to_builtin) if isinstance(v, list | dict) else v)
                      for k, v in r.items()} for r in rows])


def _printed_json(text: str) -> list:
    """The JSON lines a figure function printed (its numbers), kept for the sidecar."""
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
            if isinstance(rec, dict):  # (the figure function's own file is a temporary one)
                rec.pop("figure", None)
                rec.pop("bytes", None)
            if rec:
                out.append(rec)
        except ValueError:
            if line.strip():
                out.append(line)
    return out


def _out_folder(out, name: str) -> Path:
    path = Path(out) if out is not None else Path("reproduce") / name
    if path.exists() and not path.is_dir():
        raise AimsymError("--out", f"{path} is a file; give a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AimsymError("--out", f"cannot create {path} ({exc.strerror})") from None
    return path


# what a figure's code keeps between runs in OUT/NAME_state/ (the SE points of its sweep, its
# thresholds, the denoiser passes of the SE runs in progress): a rerun with the same --out reuses
# what matches its settings and model hash. The figure's code works in that folder itself, so a
# run killed outright (cluster wall time, SIGKILL) keeps every point it stored and every pass.
STATE_FILES = ("sweep.sqlite", "sweep.sqlite.passes", "thresholds.json", "threshold_passes", "threshold_points")


def _tidy_state(state: Path, before: set) -> None:
    """Remove what the figure's code wrote into ``state`` besides its state (its own drawings);
    the folder itself if nothing is left."""
    import shutil

    for f in state.iterdir():
        if f.name in STATE_FILES or f in before:
            continue
        shutil.rmtree(f) if f.is_dir() and not f.is_symlink() else f.unlink(missing_ok=True)
    try:
        state.rmdir()
    except OSError:
        pass  # (state kept)


def run(name: str, out=None, *, quick: bool = False, dpi: int = 100) -> dict:
    """Draw one figure (see the module docstring for the files); returns the sidecar record."""
    from .plot.se import collecting_figures
    from .plot.table import figure_axes, figure_rows
    from .provenance import provenance

    entry = lookup(name)
    if entry.status != AVAILABLE:
        raise AimsymError(name, f"{entry.status}: {entry.reason}")
    folder = _out_folder(out, name)
    t0 = time.perf_counter()
    printed = io.StringIO()
    state = folder / f"{name}_state"
    try:
        state.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AimsymError("--out", f"cannot create {state} ({exc.strerror})") from None
    before = set(state.iterdir())
    with collecting_figures() as figs, contextlib.redirect_stdout(printed):
        try:
            result = entry.draw(state, quick) or {}
        finally:  # (also when interrupted: a rerun with the same --out resumes from the state)
            _tidy_state(state, before)
    if not figs:
        raise RuntimeError(f"{name}: the figure code saved no figure")
    fig = figs[-1][0]
    files = {"png": folder / f"{name}.png", "pdf": folder / f"{name}.pdf", "csv": folder / f"{name}.csv",
             "json": folder / f"{name}.json"}
    fig.savefig(files["png"], dpi=dpi)
    fig.savefig(files["pdf"])
    rows = figure_rows(fig)
    _write_csv(files["csv"], rows)
    for key, table in (result.get("tables") or {}).items():
        files[key] = folder / f"{name}_{key}.csv"
        _write_csv(files[key], table)
    if state.is_dir():
        files["state"] = state
    import matplotlib.pyplot as plt

    plt.close(fig)
    settings = result.get("settings", {})
    record = {
        **entry.to_json(), "paper_reference": PAPERS[entry.paper], "quick": quick,
        "command": entry.command(quick) + f" --out {folder}",
        "files": {k: str(v) for k, v in files.items()}, "rows": len(rows), "axes": figure_axes(fig),
        "settings": settings, "summary": result.get("summary"), "printed": _printed_json(printed.getvalue()),
        "seconds": time.perf_counter() - t0,
        "provenance": provenance(seed=result.get("seed"), model_hash=result.get("model_hash"), accuracy=settings),
    }
    files["json"].write_text(json.dumps(record, indent=1, default=to_builtin))
    return record
