"""Figures of the AIM docs page (matplotlib, Agg). ``aimsym aim plot --which NAME``."""

from __future__ import annotations

import json
import os

import numpy as np

from .se import save_figure

FIGURES = ("softmax", "tokens", "hardmax", "small_width", "small_width_softmax", "amp", "deep")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "figure.dpi": 100})
    return plt


def _steps(items, desc):
    """Progress over the points of a figure (tqdm on stderr)."""
    from tqdm.auto import tqdm

    return tqdm(list(items), desc=desc, unit="pt", leave=False)


def _save(fig, out, name, meta):
    path = os.path.join(out, f"aim_{name}.png")
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    # the numbers behind the points go to stdout (the docs quote them), not next to the PNG
    print(json.dumps({"figure": path, "data": meta}, default=float))
    return path


def fig_softmax(out, activation="softmax"):
    """Softmax (or the linear-output baseline) T = 2: mmse vs alpha for several rho, counting
    thresholds as ticks."""
    from ..aim import se

    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    meta = {}
    for rho in (0.1, 0.25, 0.5, 0.75, 1.0, 2.0):
        Delta = np.geomspace(1e-7, 1e3, 300)
        alpha, m = se.softmax_parametric(Delta, rho, 2, activation)
        a_pr = se.perfect_recovery_counting(rho, 2, activation)
        alpha = np.concatenate([[a_pr, 0.3], alpha])
        m = np.concatenate([[0.0, 0.0], m])
        order = np.argsort(alpha)
        line, = ax.plot(alpha[order], m[order], label=f"rho = {rho}")
        ax.axvline(a_pr, ymax=0.06, color=line.get_color(), lw=2)
        meta[str(rho)] = {"alpha_PR": a_pr}
    ax.set_xlim(0, 0.3)
    ax.set_xlabel("alpha = n / d^2")
    ax.set_ylabel("Bayes-optimal mmse (Q0 - q)")
    ax.set_title(f"AIM, {activation}" + (" (any beta)" if activation == "softmax" else " output")
                 + ", T = 2: ticks = counting thresholds", fontsize=8)
    ax.legend(fontsize=7)
    return _save(fig, out, activation, meta)


def fig_tokens(out, d=100, n_seeds=4, with_points=True, points=(0.04, 0.08, 0.12, 0.16), gd_steps=1500):
    """mmse vs alpha (T^2 + T - 2) / 4 for T = 2, 3, 4 at rho = 0.5 (curves coincide), with AMP,
    GD and averaged GD (AGD) points for T = 2 at alpha in ``points``."""
    from ..aim import se

    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    rho = 0.5
    meta = {"rho": rho, "d": d, "seeds": n_seeds, "points": []}
    styles = {2: "-", 3: "--", 4: ":"}
    for T in (2, 3, 4):
        c = T * T + T - 2
        Delta = np.geomspace(1e-7, 1e3, 300)
        alpha, m = se.softmax_parametric(Delta, rho, T)
        ax.plot(alpha * c / 4, m, styles[T], label=f"SE, T = {T}", lw=1.5 if T == 2 else 2.2)
    if with_points:
        from ..aim import amp, gd

        seeds = list(range(n_seeds))
        pts = list(points)
        a_res = [amp.run_many(a, rho, d, 2, "softmax", seeds=seeds, iterations=100) for a in _steps(pts, "AMP")]
        ax.errorbar(pts, [r.mmse for r in a_res], yerr=[r.mmse_sem or 0 for r in a_res], fmt="o",
                    ms=4, label=f"AMP d={d}")
        d_gd = min(d, 60)
        g_res = [gd.run_many(a, rho, d_gd, 2, "softmax", seeds=seeds[:2], steps=gd_steps, lr=0.01, runs=3)
                 for a in _steps(pts, "GD")]
        ax.errorbar(pts, [r.mmse_gd for r in g_res], yerr=[r.mmse_gd_sem or 0 for r in g_res],
                    fmt="s", ms=4, label=f"GD d={d_gd}")
        ax.errorbar(pts, [r.mmse_agd for r in g_res], yerr=[r.mmse_agd_sem or 0 for r in g_res],
                    fmt="^", ms=4, label=f"AGD (3 runs) d={d_gd}")
        meta["points"] = {"amp": [{k: r[k] for k in ("alpha", "mmse", "mmse_sem", "mmse_se")} for r in a_res],
                          "gd": [{k: r[k] for k in ("alpha", "mmse_gd", "mmse_agd", "mmse_se")} for r in g_res]}
    ax.set_xlim(0, 0.25)
    ax.set_ylim(0, 1.25)
    ax.set_xlabel("alpha (T^2 + T - 2) / 4")
    ax.set_ylabel("mmse")
    ax.set_title("softmax, rho = 0.5: T-rescaled curves coincide", fontsize=8)
    ax.legend(fontsize=7)
    return _save(fig, out, "tokens", meta)


def fig_many_tokens(out, tokens=(4, 5), rho=0.5, d=120, n_seeds=16, fractions=(0.4, 0.55, 0.7, 0.85)):
    """Softmax at T = 4, 5 (rho = 0.5): SE mmse vs alpha, with GAMP-RIE points (d, ``n_seeds``
    seeds, mean and standard error) at the given fractions of each T's counting threshold
    alpha_PR (ticks)."""
    from ..aim import amp, se

    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    meta = {"rho": rho, "d": d, "seeds": n_seeds, "amp": []}
    Delta = np.geomspace(1e-7, 1e3, 300)
    for T in tokens:
        alpha, m = se.softmax_parametric(Delta, rho, T)
        a_pr = se.perfect_recovery_counting(rho, T)
        line, = ax.plot(np.r_[a_pr, alpha], np.r_[0.0, m], label=f"SE, T = {T}")
        ax.axvline(a_pr, ymax=0.06, color=line.get_color(), lw=2)
        pts = [f * a_pr for f in fractions]
        res = [amp.run_many(a, rho, d, T, "softmax", seeds=list(range(n_seeds)), iterations=100)
               for a in _steps(pts, f"AMP T = {T}")]
        ax.errorbar(pts, [r.mmse for r in res], yerr=[r.mmse_sem or 0 for r in res], fmt="o", ms=4,
                    color=line.get_color(), label=f"AMP T = {T}, d = {d}")
        meta["amp"] += [{k: r[k] for k in ("tokens", "alpha", "mmse", "mmse_sem", "mmse_se")} for r in res]
        meta[f"alpha_PR_T{T}"] = a_pr
    ax.set_xlim(0, 1.3 * max(se.perfect_recovery_counting(rho, T) for T in tokens))
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("alpha = n / d^2")
    ax.set_ylabel("mmse")
    ax.set_title(f"softmax, rho = {rho}: T = {', '.join(map(str, tokens))}; ticks = counting thresholds",
                 fontsize=8)
    ax.legend(fontsize=7)
    return _save(fig, out, "many_tokens", meta)


def fig_hardmax(out, d=80, n_seeds=3, with_points=True, n_alpha=40, points=(0.1, 0.3, 1.0, 3.0), t3=True):
    """Hardmax T = 2, log-log: power-law decay mmse ~ alpha^-2, with AMP points at alpha in
    ``points``; T = 3 at rho = 0.5 (``t3``). The slopes are fitted on the last fifth of the
    ``n_alpha`` SE points (at least 2)."""
    from ..aim import se

    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    alphas = np.geomspace(0.01, 20, n_alpha)
    tail = max(2, n_alpha // 5)
    meta = {"slopes": {}}
    for rho in _steps((0.25, 0.5, 1.0), "SE curves (rho)"):
        res = se.curve(alphas, rho, 2, "hardmax")
        m = np.array([r.mmse for r in res])
        line, = ax.loglog(alphas, m, label=f"SE rho = {rho}")
        meta["slopes"][str(rho)] = float(np.polyfit(np.log(alphas[-tail:]), np.log(m[-tail:]), 1)[0])
        if with_points and rho == 0.5:
            from ..aim import amp

            pts = list(points)
            a_res = [amp.run_many(a, rho, d, 2, "hardmax", seeds=list(range(n_seeds)), iterations=60)
                     for a in _steps(pts, "AMP")]
            ax.errorbar(pts, [r.mmse for r in a_res], yerr=[r.mmse_sem or 0 for r in a_res], fmt="o",
                        ms=4, color=line.get_color(), label=f"AMP d={d}, rho=0.5")
            meta["amp"] = [{k: r[k] for k in ("alpha", "mmse", "mmse_sem", "mmse_se")} for r in a_res]
    if t3:  # T = 3 at rho = 0.5 (the channel's J(s) interpolant is built once, ~40 s, then the curve is cheap)
        res3 = se.curve(alphas, 0.5, 3, "hardmax")
        m3 = np.array([r.mmse for r in res3])
        ax.loglog(alphas, m3, "--", color="k", lw=1.2, label="SE T = 3, rho = 0.5")
        meta["slopes"]["T3_rho0.5"] = float(np.polyfit(np.log(alphas[-tail:]), np.log(m3[-tail:]), 1)[0])
        meta["T3_rho0.5"] = {str(a): float(m) for a, m in zip(alphas[::8], m3[::8])}
    big = alphas[-max(2, (3 * n_alpha) // 8):]
    ax.loglog(big, 0.1 * big ** -2.0, "k:", lw=1, label="alpha^-2")
    ax.set_xlabel("alpha")
    ax.set_ylabel("mmse")
    ax.set_title("hardmax, T = 2 (solid)" + (", T = 3 (dashed)" if t3 else "") + ": power-law decay", fontsize=8)
    ax.legend(fontsize=7)
    return _save(fig, out, "hardmax", meta)


def fig_small_width(out, n_points=80):
    """Hardmax T = 2 at small width: mmse vs alpha_bar = alpha / rho (``n_points`` values in
    [0.05, 4]); the rho -> 0 limit q = [max(1 - t, 0)]^2 and finite rho, with the weak-recovery
    threshold alpha_bar_c."""
    from ..aim import se

    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ab = np.linspace(0.05, 4, n_points)
    lim = [se.small_width_se(a).mmse for a in _steps(ab, "rho -> 0 limit")]
    ax.plot(ab, lim, "k", lw=2, label="rho -> 0 (t(2 - t))")
    for rho in _steps((0.01, 0.05, 0.2), "SE curves (rho)"):
        res = se.curve(ab * rho, rho, 2, "hardmax")
        ax.plot(ab, [r.mmse / 1.0 for r in res], "--", label=f"SE rho = {rho}")
    abc = se.small_width_alpha_bar_c()
    ax.axvline(abc, color="gray", lw=1, label="weak recovery alpha_bar_c")
    ax.text(abc * 1.05, 0.05, f"alpha_bar_c = {abc:.4f}", fontsize=7)
    ax.set_xlabel("alpha_bar = alpha / rho")
    ax.set_ylabel("mmse")
    ax.set_title("hardmax, small width: weak recovery at alpha_bar_c (arcsin(1/3))", fontsize=8)
    ax.legend(fontsize=7)
    return _save(fig, out, "small_width", {"alpha_bar_c": abc})


GAP_RHOS = (0.1, 0.03, 0.01, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5)  # the right panel of the full figure


def fig_small_width_softmax(out, n_points=140, rhos=(0.1, 0.01, 1e-3, 1e-4), gap_rhos=None, tokens=2,
                            table=None):
    """Softmax at small width (AIM paper Fig. 5): mmse vs alpha_bar = alpha / rho for several rho
    (finite-rho SE) and the rho -> 0 limit 1 - (c alpha_bar - 1)^2 on [1/c, 2/c], with the
    weak-recovery threshold alpha_bar_c = 1/c and the limit's perfect recovery 2/c (vertical
    lines). Right panel: the largest distance between the finite-rho curve and the limit over
    the alpha_bar grid, vs rho (log-log, with the fitted slope). ``gap_rhos`` (default ``rhos``)
    are the rho of the right panel; rows (rho, alpha_bar, mmse, limit, gap) go to ``table``."""
    from ..aim import se

    plt = _plt()
    c = se.counting_constant(tokens, "softmax")
    abc = se.small_width_alpha_bar_c(tokens, "softmax")
    abc_num = se.small_width_alpha_bar_c_numeric(tokens=tokens, activation="softmax")
    ab_pr = se.small_width_perfect_recovery(tokens, "softmax")
    ab = np.linspace(1.4 * ab_pr / n_points, 1.4 * ab_pr, n_points)
    lim = np.array([se.small_width_se(a, tokens=tokens, activation="softmax").mmse for a in ab])
    gap_rhos = tuple(rhos if gap_rhos is None else gap_rhos)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.6), gridspec_kw={"width_ratios": [1.35, 1]})
    sup = {}
    for rho in _steps(sorted(set(rhos) | set(gap_rhos), reverse=True), "SE curves (rho)"):
        res = se.softmax_curve(ab * rho, rho, tokens)
        m = np.array([r.mmse for r in res])
        gap = m - lim
        sup[rho] = float(np.max(np.abs(gap)))
        if rho in rhos:
            ax.plot(ab, m, "--", label=f"SE rho = {rho:g}", zorder=3)
        if table is not None:
            table.extend({"rho": rho, "tokens": tokens, "alpha_bar": float(a), "alpha": float(a * rho),
                          "mmse": float(r.mmse), "mmse_limit": float(lv), "gap": float(g),
                          "q_hat": float(r.q_hat), "method": r.method,
                          **{f"accuracy_{k}": v for k, v in r.accuracy.items()}}
                         for a, r, lv, g in zip(ab, res, lim, gap))
    ax.plot(ab, lim, "k", lw=2.5, label="rho -> 0 limit", zorder=2)
    ax.axvline(abc, color="gray", lw=1, label=f"weak recovery alpha_bar_c = 1/{c:g}")
    ax.axvline(ab_pr, color="gray", lw=1, ls=":", label=f"perfect recovery (rho -> 0) 2/{c:g} = {ab_pr:g}")
    ax.set_xlim(0, ab[-1])
    ax.set_xlabel("alpha_bar = alpha / rho = n / (d r)")
    ax.set_ylabel("Bayes-optimal mmse")
    ax.set_title(f"softmax (any beta), T = {tokens}, small width", fontsize=8)
    ax.legend(fontsize=7)
    r_arr = np.array(sorted(sup))
    s_arr = np.array([sup[r] for r in r_arr])
    slope = float(np.polyfit(np.log(r_arr[:3]), np.log(s_arr[:3]), 1)[0]) if len(r_arr) >= 3 else float("nan")
    bx.loglog(r_arr, s_arr, "o-", ms=4, label=f"max |SE - limit| (slope {slope:.2f} at the 3 smallest rho)")
    bx.set_xlabel("rho = r / d")
    bx.set_ylabel("max over alpha_bar of |mmse_rho - mmse_limit|")
    bx.set_title("approach to the rho -> 0 limit", fontsize=8)
    bx.legend(fontsize=7)
    meta = {"tokens": tokens, "alpha_bar_c": abc, "alpha_bar_c_numeric": abc_num, "alpha_bar_perfect_recovery": ab_pr,
            "max_gap": {f"{r:g}": sup[r] for r in r_arr}, "gap_slope_smallest_3": slope}
    return _save(fig, out, "small_width_softmax", meta), meta


def fig_amp(out, d=100, n_seeds=4):
    """AMP trajectories (error per iteration) against the SE fixed point, softmax T = 2."""
    from ..aim import amp, se
    from ..aim import data as aim_data

    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    meta = {}
    for alpha in (0.05, 0.1, 0.15):
        data = aim_data.generate(d, alpha, 0.5, 2, "softmax", seed=0)
        res = amp.run(data, 2, "softmax", iterations=100)
        h = res.history
        line, = ax.semilogy([x["iteration"] for x in h], [x["mmse"] for x in h], label=f"AMP alpha={alpha}")
        ax.semilogy([x["iteration"] for x in h], [x["V"] for x in h], ":", color=line.get_color())
        m_se = se.solve(alpha, data.rho).mmse
        ax.axhline(m_se, color=line.get_color(), lw=0.8, ls="--")
        meta[str(alpha)] = {"amp": res.mmse, "se": m_se}
    ax.set_xlabel("iteration")
    ax.set_ylabel("||S_hat - S||^2 / d (solid), predicted V (dotted)")
    ax.set_title(f"GAMP-RIE, softmax T = 2, rho = 0.5, d = {d}; dashed: SE", fontsize=8)
    ax.legend(fontsize=7)
    return _save(fig, out, "amp", meta)


def fig_finite_size(out, data):
    """AMP mmse vs 1/d with the weighted fits a + b/d (and a + b/d + c/d^2) and the SE value, one
    panel per (activation, alpha) found in ``data``: JSON-lines files of per-seed records written by
    ``python -m aimsym.studies.aim_finite_size --plan ... --out FILE`` (comma list of paths)."""
    from ..studies import aim_finite_size

    records = []
    for path in str(data).split(","):
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    groups = {}
    for r in records:
        groups.setdefault((r["activation"], float(r["alpha"])), []).append(r)
    plt = _plt()
    keys = sorted(groups, key=lambda k: (k[0] != "softmax", k[1]))  # softmax panels first
    fig, axes = plt.subplots(1, len(keys), figsize=(3.4 * len(keys), 3.4), squeeze=False)
    meta = []
    for ax, key in zip(axes[0], keys):
        act, alpha = key
        rec0 = groups[key][0]
        res = aim_finite_size.finite_size_analysis(groups[key], alpha, rec0.get("rho", 0.5), rec0.get("tokens", 2), act,
                                       rec0.get("beta", 1.0))
        tab = [r for r in res["table"] if r["mmse_sem"]]  # sizes with >= 2 seeds (as in the fit)
        x = np.array([1.0 / r["d"] for r in tab])
        ax.errorbar(x, [r["mmse"] for r in tab], yerr=[r["mmse_sem"] for r in tab], fmt="o", ms=4,
                    label="AMP (mean ± s.e.)")
        xx = np.linspace(0.0, x.max() * 1.05, 100)
        for name, style in (("order1", "-"), ("order2", ":")):
            if name in res["fits"]:
                f = res["fits"][name]
                c = f["coef"]
                yy = sum(ck * xx ** k for k, ck in enumerate(c))
                ax.plot(xx, yy, style, lw=1, label=f"fit order {f['order']}: a = {c[0]:.4f} ± {f['coef_se'][0]:.4f}")
        ax.plot([0.0], [res["mmse_se"]], "k*", ms=9, label=f"SE {res['mmse_se']:.4f}")
        ax.set_xlabel("1 / d")
        ax.set_ylabel("||S_hat - S||^2 / d")
        ax.set_title(f"{act}, T = {res['tokens']}, rho = {res['rho']}, alpha = {alpha}", fontsize=8)
        ax.set_xlim(left=-0.02 * x.max())
        ax.legend(fontsize=6)
        meta.append(res)
    return _save(fig, out, "finite_size", meta)


def fig_deep(out):
    """Two-layer AIM (softmax, T = 2, skip 1): per-layer mmse from the two-overlap SE."""
    from ..aim import deep

    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    alphas = [0.05, 0.1, 0.2, 0.35, 0.5]
    res = [deep.state_evolution(a, 0.5, 0.5, 1.0, n_inner=8, n_outer=1024, damping=0.3, tol=2e-3)
           for a in alphas]
    ax.plot(alphas, [r.mmse1 for r in res], "o-", label="layer 1 (S_1)")
    ax.plot(alphas, [r.mmse2 for r in res], "s-", label="layer 2 (S_2)")
    ax.set_xlabel("alpha")
    ax.set_ylabel("mmse per layer")
    ax.set_title("two-layer AIM, softmax, T = 2, rho = 0.5, skip c = 1", fontsize=8)
    ax.legend(fontsize=7)
    meta = [{k: r[k] for k in ("alpha", "mmse1", "mmse2", "information_sem", "cross_information")} for r in res]
    return _save(fig, out, "deep", meta)


def make_all(out="docs/figures", which=None, d=100, n_seeds=4):
    os.makedirs(out, exist_ok=True)
    which = list(FIGURES) if which is None else which
    bad = [w for w in which if w not in FIGURES]
    if bad:
        from ..errors import AimsymError

        raise AimsymError("--which", f"unknown figure {bad[0]!r}; choose from {', '.join(FIGURES)}")
    makers = {"softmax": lambda: fig_softmax(out), "tokens": lambda: fig_tokens(out, d, n_seeds),
              "hardmax": lambda: fig_hardmax(out, min(d, 80), max(2, n_seeds - 1)),
              "small_width": lambda: fig_small_width(out),
              "small_width_softmax": lambda: fig_small_width_softmax(out, gap_rhos=GAP_RHOS)[0],
              "amp": lambda: fig_amp(out, d),
              "deep": lambda: fig_deep(out)}
    return [makers[w]() for w in which]
