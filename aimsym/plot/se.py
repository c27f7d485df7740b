"""Figures (matplotlib, Agg): overlaps vs alpha with thresholds and shaded phases; thresholds vs skip."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np



def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_COLLECTORS: list[list] = []


@contextmanager
def collecting_figures():
    """Within the block, every figure saved by :func:`save_figure` is also appended (as
    ``(figure, path)``) to the yielded list: how ``aimsym reproduce`` takes the figure an existing
    figure function draws, to write it again as PDF and to tabulate what it shows."""
    got: list = []
    _COLLECTORS.append(got)
    try:
        yield got
    finally:
        _COLLECTORS.remove(got)


def save_figure(fig, out, dpi: int = 130):
    """Save (creating the parent folders, so an --out in a new folder does not lose the run)."""
    from pathlib import Path

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    for got in _COLLECTORS:
        got.append((fig, str(out)))


def _group_label(model_hash: str, several_models: bool) -> str:
    """'skip = 0.5, beta = 2' from a model hash 'SPEC[skip=0.5,beta=2.0]' (spec hash if needed)."""
    spec_hash, _, vals = model_hash.partition("[")
    parts = [f"{k} = {float(v):g}" for k, _, v in (kv.partition("=") for kv in vals.rstrip("]").split(",") if kv)]
    if several_models or not parts:
        parts.insert(0, f"model {spec_hash[:8]}")
    return ", ".join(parts)


def _layer_label(k: int) -> str:
    return rf"$Q_{{{k + 1}{k + 1}}}$"


OPEN_LABEL = "open marker: SE not converged"


def overlaps(rows: list[dict], out, thresholds: list[dict] | None = None, title: str = "",
             perfect: dict | None = None) -> list[str]:
    """Diagonal overlaps Q_kk (layer k + 1) vs alpha with error bars: one labelled curve per layer
    and per parameter set (a store with several sets is never drawn as one curve); threshold
    lines and the learning phases between them are named in the legend; ``perfect`` (the
    thresholds report's ``perfect_recovery``): the counting bound alpha_PR and the alpha where the
    uninformed SE reaches Q = I. Returns the legend."""
    plt = _plt()
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["model_hash"], []).append(r)
    several_models = len({h.partition("[")[0] for h in groups}) > 1
    p = sum(1 for k in rows[0] if k.startswith("Q_") and len(k) == 4 and k[2] == k[3])
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    styles = ["-", "--", ":", "-."]
    for g, (h, grp) in enumerate(sorted(groups.items(), key=lambda kv: _group_label(kv[0], several_models))):
        grp = sorted(grp, key=lambda r: r["alpha"])
        a = np.array([r["alpha"] for r in grp])
        stopped = np.array([not r.get("converged", True) for r in grp])
        tag = _group_label(h, several_models) if len(groups) > 1 or several_models else ""
        for k in range(p):
            q = np.array([r[f"Q_{k}{k}"] for r in grp])
            s = np.array([r[f"Q_stderr_{k}{k}"] for r in grp])
            colour = f"C{(g * p + k) % 10}" if len(groups) > 1 else f"C{k}"
            ax.errorbar(a, q, yerr=s, marker="o", ms=3, ls=styles[k % len(styles)], color=colour,
                        label=_layer_label(k) + (f" ({tag})" if tag else ""))
            # a point whose SE stopped at its map budget is drawn open: its value is not a fixed point
            if stopped.any():
                ax.plot(a[stopped], q[stopped], "o", ms=6, mfc="white", mec=colour, ls="none", zorder=3)
    a_all = np.array([r["alpha"] for r in rows])
    ths = sorted(thresholds or [], key=lambda t: t["alpha"])
    # (without the thresholds the phases are unknown: nothing is shaded)
    edges = [a_all.min()] + [t["alpha"] for t in ths] + [a_all.max()] if ths else []
    learned: list[int] = []
    for i in range(len(edges) - 1):
        name = "no layer learnable" if not learned else \
            "layer" + ("s " if len(learned) > 1 else " ") + ", ".join(str(j + 1) for j in sorted(learned)) + " learnable"
        if edges[i + 1] > edges[i]:
            ax.axvspan(edges[i], edges[i + 1], color=f"C{(i + 5) % 10}", alpha=0.08, label=f"phase: {name}")
        if i < len(ths):
            learned += [j for j in ths[i].get("subspace", []) if j not in learned]
    for i, t in enumerate(ths):
        sub = t.get("subspace") or []
        which = (" (layer" + ("s " if len(sub) > 1 else " ") + ", ".join(str(j + 1) for j in sub) + ")") if sub else ""
        err = t.get("stderr", 0) or 0
        ax.axvline(t["alpha"], color="k", ls="--", lw=0.8,
                   label=rf"threshold {i + 1}{which}: $\alpha$ = {t['alpha']:.3f} ± {err:.3f}")
        ax.axvspan(t["alpha"] - err, t["alpha"] + err, color="k", alpha=0.15)
    if any(not r.get("converged", True) for r in rows):
        ax.plot([], [], "o", ms=6, mfc="white", mec="k", ls="none", label=OPEN_LABEL)
    _perfect_lines(ax, perfect)
    ax.set_xlabel(r"sample complexity $\alpha = n / d$")
    ax.set_ylabel(r"overlap $Q_{kk}$ (layer $k$)")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="best")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    fig.tight_layout()
    save_figure(fig, out)
    plt.close(fig)
    return labels


def _perfect_lines(ax, perfect: dict | None) -> None:
    if not perfect:
        return
    if perfect.get("counting_alpha") is not None:
        ax.axvline(perfect["counting_alpha"], color="C3", ls=":", lw=1.2,
                   label=rf"counting bound $\alpha_{{PR}} = p/m$ = {perfect['counting_alpha']:.3g}")
    if perfect.get("alpha") is not None and np.isfinite(perfect["alpha"]):
        ax.axvline(perfect["alpha"], color="C3", ls="-.", lw=1.0,
                   label=rf"SE reaches $Q = I$ ({perfect.get('kind')}): $\alpha$ = {perfect['alpha']:.3f}")
    elif perfect.get("local_alpha") is not None and np.isfinite(perfect["local_alpha"]):
        ax.axvline(perfect["local_alpha"], color="C3", ls="-.", lw=1.0,
                   label=rf"$Q = I$ locally stable: $\alpha$ = {perfect['local_alpha']:.3f}")


def phase_diagram(points: list[dict], out, title: str = "", labels: dict | None = None):
    """points: {"skip", "alpha", "stderr", "step"[, "subspace", "jump", "perfect", "counting"]}; thresholds
    vs skip with the 1/6 bound, learning phases shaded (nothing / last layer / all layers for two
    layers, then Q = I), the counting bound p/m where the rows carry it; roots at a jump of the
    restricted branch are circled. The legend sits right of the axes (it would hide the curves)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.0, 3.6))
    steps = sorted({p["step"] for p in points})
    curves = []
    for step in steps:
        pts = sorted((p for p in points if p["step"] == step), key=lambda p: p["skip"])
        sub = pts[0].get("subspace")
        lab = (labels or {}).get(step) or (f"threshold {step + 1}" + (
            f": layer{'s' if len(sub) > 1 else ''} {', '.join(str(i + 1) for i in sub)}" if sub else ""))
        if pts[0].get("perfect"):  # the perfect-recovery transition (thresholds.phase_rows)
            lab = (labels or {}).get(step) or ("$Q = I$ locally stable" if pts[0]["perfect"] == "local"
                                               else "uninformed SE reaches $Q = I$")
        x = np.array([p["skip"] for p in pts])
        y = np.array([p["alpha"] for p in pts])
        line = ax.errorbar(x, y, yerr=[p["stderr"] for p in pts], marker="o", ms=3, capsize=2, label=lab)
        jumps = [p for p in pts if p.get("jump") and not p.get("perfect")]
        if jumps:  # root at a first-order jump of the restricted branch, not a linear-stability root
            ax.plot([p["skip"] for p in jumps], [p["alpha"] for p in jumps], "o", ms=7, mfc="none",
                    color=line[0].get_color(), label=f"{lab}: at a jump of the branch")
        curves.append((x, y))
    if curves:
        top = max(c[1].max() for c in curves) * 1.15
        x0, y0 = curves[0]
        ax.fill_between(x0, 0, y0, color="C7", alpha=0.08, label="phase: nothing learnable")
        for i, (x, y) in enumerate(curves):
            upper = curves[i + 1][1] if i + 1 < len(curves) and len(curves[i + 1][1]) == len(y) else np.full_like(y, top)
            perfect = next((p["perfect"] for p in points if p.get("perfect") and p["step"] == steps[i]), None)
            ax.fill_between(x, y, upper, color=f"C{i + 4}", alpha=0.08,
                            label={"local": "phase: $Q = I$ locally stable", None: f"phase: past threshold {steps[i] + 1}"}
                            .get(perfect, "phase: perfect recovery"))
        ax.set_ylim(0, top)
    counting = {p["counting"] for p in points if p.get("perfect") and p.get("counting") is not None}
    for a_pr in counting:  # the counting bound p/m (no perfect recovery below it)
        ax.axhline(a_pr, color="C3", ls=":", lw=1.0, label=rf"counting bound $\alpha_{{PR}} = p/m$ = {a_pr:.3g}")
    ax.axhline(1 / 6, color="k", ls=":", lw=0.8, label=r"$\alpha = 1/6$ (large-skip limit)")
    ax.set_xlabel(r"skip $c$")
    ax.set_ylabel(r"threshold $\alpha$")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)
    fig.tight_layout()
    save_figure(fig, out)
    plt.close(fig)
