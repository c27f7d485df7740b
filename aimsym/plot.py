"""Figures (matplotlib, Agg): overlaps vs alpha with thresholds and shaded phases; thresholds vs skip."""

from __future__ import annotations

import json

import numpy as np

from .errors import AimsymError


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, out, dpi: int = 130):
    """Save (creating the parent folders, so an --out in a new folder does not lose the run)."""
    from pathlib import Path

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)


def overlaps(rows: list[dict], out, thresholds: list[dict] | None = None, title: str = "",
             perfect: dict | None = None):
    """Diagonal overlaps Q_kk (layer k + 1) vs alpha, error bars, threshold lines, shaded phases;
    ``perfect`` (the thresholds report's ``perfect_recovery``): the counting bound alpha_PR and the
    alpha where the uninformed SE reaches Q = I."""
    plt = _plt()
    rows = sorted(rows, key=lambda r: r["alpha"])
    a = np.array([r["alpha"] for r in rows])
    p = sum(1 for k in rows[0] if k.startswith("Q_") and k[2] == k[3] and len(k) == 4)
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for k in range(p):
        q = np.array([r[f"Q_{k}{k}"] for r in rows])
        s = np.array([r[f"Q_stderr_{k}{k}"] for r in rows])
        ax.errorbar(a, q, yerr=s, marker="o", ms=3, label=f"layer {k + 1}")
    edges = [a.min()] + [t["alpha"] for t in thresholds or []] + [a.max()]
    for i, t in enumerate(thresholds or []):
        ax.axvline(t["alpha"], color="k", ls="--", lw=0.8)
        ax.axvspan(t["alpha"] - t.get("stderr", 0), t["alpha"] + t.get("stderr", 0), color="k", alpha=0.15)
    for i in range(len(edges) - 1):
        ax.axvspan(edges[i], edges[i + 1], color=f"C{i + 4}", alpha=0.08)
    _perfect_lines(ax, perfect)
    ax.set_xlabel("alpha")
    ax.set_ylabel("overlap Q_kk")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out)
    plt.close(fig)


def _perfect_lines(ax, perfect: dict | None) -> None:
    if not perfect:
        return
    if perfect.get("counting_alpha") is not None:
        ax.axvline(perfect["counting_alpha"], color="C3", ls=":", lw=1.2,
                   label=f"counting bound p/m = {perfect['counting_alpha']:.3g}")
    if perfect.get("alpha") is not None and np.isfinite(perfect["alpha"]):
        ax.axvline(perfect["alpha"], color="C3", ls="-.", lw=1.0,
                   label=f"SE reaches Q = I ({perfect.get('kind')}): {perfect['alpha']:.3f}")


def phase_diagram(points: list[dict], out, title: str = "", labels: dict | None = None):
    """points: {"skip", "alpha", "stderr", "step"[, "subspace", "jump"]}; thresholds vs skip with the
    1/6 bound, learning phases shaded (nothing / last layer / all layers for two layers); roots at a
    jump of the restricted branch are circled."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    steps = sorted({p["step"] for p in points})
    curves = []
    for step in steps:
        pts = sorted((p for p in points if p["step"] == step), key=lambda p: p["skip"])
        sub = pts[0].get("subspace")
        lab = (labels or {}).get(step) or (f"threshold {step + 1}" + (
            f": layer{'s' if len(sub) > 1 else ''} {', '.join(str(i + 1) for i in sub)}" if sub else ""))
        x = np.array([p["skip"] for p in pts])
        y = np.array([p["alpha"] for p in pts])
        line = ax.errorbar(x, y, yerr=[p["stderr"] for p in pts], marker="o", ms=3, capsize=2, label=lab)
        jumps = [p for p in pts if p.get("jump")]
        if jumps:  # root at a first-order jump of the restricted branch, not a linear-stability root
            ax.plot([p["skip"] for p in jumps], [p["alpha"] for p in jumps], "o", ms=7, mfc="none",
                    color=line[0].get_color(), label=f"{lab}: at a jump of the branch")
        curves.append((x, y))
    if curves:
        top = max(c[1].max() for c in curves) * 1.15
        x0, y0 = curves[0]
        ax.fill_between(x0, 0, y0, color="C7", alpha=0.08)
        for i, (x, y) in enumerate(curves):
            upper = curves[i + 1][1] if i + 1 < len(curves) and len(curves[i + 1][1]) == len(y) else np.full_like(y, top)
            ax.fill_between(x, y, upper, color=f"C{i + 4}", alpha=0.08)
        ax.set_ylim(0, top)
    ax.axhline(1 / 6, color="k", ls=":", lw=0.8, label="1/6")
    ax.set_xlabel("skip c")
    ax.set_ylabel("alpha")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out)
    plt.close(fig)


def register_cli(sub) -> None:
    p = sub.add_parser("plot", help="overlaps vs alpha from a sweep store (+ thresholds JSON)")
    p.add_argument("store", help="sweep SQLite file")
    p.add_argument("--thresholds", default=None, help="JSON written by 'aimsym thresholds --json'")
    p.add_argument("--out", default="se_overlaps.png")
    p.add_argument("--title", default="")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    from pathlib import Path

    from .sweep import table

    if not Path(args.store).is_file():
        raise AimsymError("store", f"no such file: {args.store}")
    rows = [r for r in table(args.store) if r["init"] == "uninformed"]
    if not rows:
        raise AimsymError("store", "no uninformed points stored")
    th = json.load(open(args.thresholds)) if args.thresholds else {}
    overlaps(rows, args.out, th.get("staircase"), args.title, perfect=th.get("perfect_recovery"))
    print(args.out)
    return 0
