"""``aimsym reproduce``: the registry covers the papers' figures, bad names are one line with exit
2, and every available figure runs in quick mode, writes its files, and its data agree with the
solver called directly at one shared point."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from aimsym import reproduce
from aimsym.cli import main

# The papers' figures as mapped in docs/reproduce.md: (paper, figure) -> registry name.
PAPER_FIGURES = {
    ("SMI", "Fig. 1 (left)"): "smi-fig1-left", ("SMI", "Fig. 1 (right)"): "smi-fig1-right",
    ("SMI", "Fig. 2 (left)"): "smi-fig2-left", ("SMI", "Fig. 2 (right)"): "smi-fig2-right",
    ("SMI", "Fig. 3 (left)"): "smi-fig3-left", ("SMI", "Fig. 3 (right)"): "smi-fig3-right",
    ("SMI", "Fig. 5 (appendix)"): "smi-figA5",
    ("AIM", "Fig. 1 (left)"): "aim-fig1-left", ("AIM", "Fig. 1 (right)"): "aim-fig1-right",
    ("AIM", "Fig. 2 (left)"): "aim-fig2-left", ("AIM", "Fig. 2 (right)"): "aim-fig2-right",
    ("AIM", "Fig. 3"): "aim-fig3", ("AIM", "Fig. 4"): "aim-fig4", ("AIM", "Fig. 5"): "aim-fig5",
    ("ERM", "test and train errors"): "erm-errors", ("ERM", "factorised vs direct"): "erm-models",
    ("ERM", "spectra"): "erm-spectra", ("ERM", "rank"): "erm-rank",
    ("ERM", "temperature and tokens"): "erm-beta-T", ("ERM", "sequence-to-sequence"): "erm-seq",
}
UNAVAILABLE = {"smi-fig3-right"}  # external data (TREC)
NOT_IMPLEMENTED: set[str] = set()
AVAILABLE = [n for n in PAPER_FIGURES.values() if n not in UNAVAILABLE | NOT_IMPLEMENTED]
# full-run data committed in docs/figures/reproduce/full/NAME/ (`aimsym reproduce NAME --out ...`),
# with the number of points the quick run shares with it
FULL = Path(__file__).resolve().parent.parent / "docs" / "figures" / "reproduce" / "full"
MIN_SHARED: dict[str, int] = {"aim-fig1-right": 33, "aim-fig5": 77, "smi-fig1-left": 7, "smi-fig1-right": 9,
                              "smi-fig2-left": 42, "smi-fig2-right": 80, "smi-figA5": 4, "aim-fig1-left": 9,
                              "aim-fig2-right": 906, "aim-fig4": 608, "erm-errors": 12, "erm-models": 4,
                              "erm-spectra": 1600, "erm-rank": 6, "erm-beta-T": 10, "erm-seq": 2, "smi-fig3-left": 6}
SLOW = {"smi-fig3-left", "smi-figA5", "aim-fig2-right", "erm-errors", "erm-models", "erm-spectra", "erm-rank", "erm-beta-T", "erm-seq"}


def _list(capsys) -> list[dict]:
    assert main(["reproduce", "--list", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_list_covers_the_registry_and_the_papers(capsys):
    rows = _list(capsys)
    assert [r["name"] for r in rows] == reproduce.names()
    listed = {(r["paper"], r["figure"]): r["name"] for r in rows}
    assert listed == PAPER_FIGURES
    by_name = {r["name"]: r for r in rows}
    for name, r in by_name.items():
        want = "unavailable" if name in UNAVAILABLE else "not implemented" if name in NOT_IMPLEMENTED else "available"
        assert r["status"] == want, name
        assert r["caption"], name
        if want == "available":
            assert r["command"] == f"aimsym reproduce {name}" and reproduce.lookup(name).draw is not None
        else:
            assert r["reason"] and r["command"] is None, name
    assert "TREC" in by_name["smi-fig3-right"]["reason"]


def test_list_as_text(capsys):
    assert main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(reproduce.FIGURES)
    assert all(line.split()[0] in reproduce.names() for line in out)
    assert sum("[unavailable:" in line for line in out) == len(UNAVAILABLE)


@pytest.mark.parametrize("argv", [["reproduce", "no-such-figure"], ["reproduce"], ["reproduce", "--list", "aim-fig3"]])
def test_bad_name_is_one_line_exit_2(argv, capsys):
    assert main(argv) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("aimsym: error: ") and "Traceback" not in cap.err
    if argv[1:2] == ["no-such-figure"] or argv == ["reproduce"]:
        assert all(n in err[0] for n in reproduce.names())


@pytest.mark.parametrize("name", sorted(UNAVAILABLE | NOT_IMPLEMENTED))
def test_figures_we_cannot_draw_exit_2_with_the_reason(name, capsys, tmp_path):
    assert main(["reproduce", name, "--quick", "--out", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    entry = reproduce.lookup(name)
    assert len(err) == 1 and entry.status in err[0] and entry.reason in err[0]
    assert not (tmp_path / name).exists()  # nothing written


# ----------------------------------------------------------------------------- quick runs
def _rows(path) -> list[dict]:
    with open(path) as fh:
        out = []
        for r in csv.DictReader(fh):
            out.append({**r, "panel": int(r["panel"]), "x": float(r["x"]), "y": float(r["y"]),
                        "yerr": float(r["yerr"])})
        return out


def _series(rows, name, kind=None):
    got = [r for r in rows if r["series"] == name and (kind is None or r["kind"] == kind)]
    assert got, f"no rows of series {name!r} ({kind}) among {sorted({r['series'] for r in rows})}"
    return got


def _inner(rows, lo=0.05, hi=0.95):
    """A point of a curve away from its ends (where the comparison means something)."""
    pts = [r for r in rows if lo < r["y"] < hi]
    return pts[len(pts) // 2]


def _check_aim_softmax(rows, rec, activation):
    from aimsym.aim import se

    r = _inner(_series(rows, "rho = 0.5", "line"))
    assert se.solve(r["x"], 0.5, 2, activation).mmse == pytest.approx(r["y"], rel=1e-6, abs=1e-9)
    tick = _series(rows, "rho = 0.5", "vline")[0]["x"]
    assert tick == pytest.approx(se.perfect_recovery_counting(0.5, 2, activation))


def _check_aim_hardmax(rows, rec):
    from aimsym.aim import se

    r = _inner(_series(rows, "SE rho = 0.5", "line"))
    assert se.solve(r["x"], 0.5, 2, "hardmax").mmse == pytest.approx(r["y"], rel=1e-4)
    amp = _series(rows, f"AMP d={rec['settings']['d']}, rho=0.5", "errorbar")
    assert amp
    for p in amp:  # AMP at d = 100 near the SE (finite-size corrections of a few percent here)
        assert abs(p["y"] - se.solve(p["x"], 0.5, 2, "hardmax").mmse) < 0.2 * p["y"] + 3 * p["yerr"]


def _check_aim_small_width(rows, rec):
    from aimsym.aim import se

    r = _inner(_series(rows, "rho -> 0 (t(2 - t))", "line"))
    assert se.small_width_se(r["x"]).mmse == pytest.approx(r["y"], rel=1e-8)
    line = _series(rows, "weak recovery alpha_bar_c", "vline")[0]
    assert line["x"] == pytest.approx(se.small_width_alpha_bar_c())
    r = _inner(_series(rows, "SE rho = 0.05", "line"))
    assert se.solve(r["x"] * 0.05, 0.05, 2, "hardmax").mmse == pytest.approx(r["y"], rel=1e-4)


def _check_aim_small_width_softmax(rows, rec):
    from aimsym.aim import se

    r = _inner(_series(rows, "rho -> 0 limit", "line"))
    assert float(se.small_width_mmse(r["x"], 2, "softmax")) == pytest.approx(r["y"], abs=1e-14)
    line = _series(rows, "weak recovery alpha_bar_c = 1/4", "vline")[0]
    assert line["x"] == pytest.approx(se.small_width_alpha_bar_c(2, "softmax"))
    assert rec["summary"]["alpha_bar_c_numeric"] == pytest.approx(line["x"], rel=1e-9)
    r = _inner(_series(rows, "SE rho = 0.001", "line"))
    assert se.solve_softmax(r["x"] * 1e-3, 1e-3).mmse == pytest.approx(r["y"], rel=1e-9)
    gaps = sorted((p["x"], p["y"]) for p in rows if p["panel"] == 1 and p["series"].startswith("max |SE - limit|"))
    assert len(gaps) == 4 and all(small[1] < big[1] for small, big in zip(gaps, gaps[1:]))  # shrinks with rho


def _check_aim_tokens(rows, rec):
    from aimsym.aim import se

    for T in (2, 3):  # the x axis is alpha (T^2 + T - 2) / 4
        r = _inner(_series(rows, f"SE, T = {T}", "line"))
        c = T * T + T - 2
        assert se.solve(r["x"] * 4 / c, 0.5, T).mmse == pytest.approx(r["y"], rel=1e-6, abs=1e-9)
    amp = _series(rows, f"AMP d={rec['settings']['d']}", "errorbar")
    assert [p["x"] for p in amp] == [0.08, 0.16]
    for p in amp:
        assert abs(p["y"] - se.solve(p["x"], 0.5).mmse) < 0.2 * p["y"] + 3 * p["yerr"]


def _check_aim_many_tokens(rows, rec):
    from aimsym.aim import se

    for T in (4, 5):
        r = _inner(_series(rows, f"SE, T = {T}", "line"))
        assert se.solve(r["x"], 0.5, T).mmse == pytest.approx(r["y"], rel=1e-6, abs=1e-9)
        amp = _series(rows, f"AMP T = {T}, d = {rec['settings']['d']}", "errorbar")
        assert len(amp) == 2
        for p in amp:
            assert abs(p["y"] - se.solve(p["x"], 0.5, T).mmse) < 0.2 * p["y"] + 3 * p["yerr"]
        tick = _series(rows, f"SE, T = {T}", "vline")[0]["x"]
        assert tick == pytest.approx(se.perfect_recovery_counting(0.5, T))
    assert {x["tokens"] for x in rec["printed"][0]["data"]["amp"]} == {4, 5}


def _check_se_overlaps(model, alpha, layer, nodes):
    """The sweep's overlap at one alpha agrees with a direct SE solve there within the errors."""
    def check(rows, rec):
        from aimsym.model import load
        from aimsym.smi.se import state_evolution

        s = rec["settings"]
        pt = [r for r in _series(rows, f"$Q_{{{layer}{layer}}}$", "errorbar") if r["x"] == pytest.approx(alpha)]
        assert len(pt) == 1
        res = state_evolution(load(model, skip=1.0), alpha, samples=s["samples"], tol=s["tol"], nodes=s["nodes"])
        k = layer - 1
        err = math.hypot(pt[0]["yerr"], res.Q_stderr[k, k])
        assert abs(pt[0]["y"] - res.Q[k, k]) <= 4 * err + 2 * s["tol"], (pt[0], res.Q[k, k], err)
        th = rec["summary"]["thresholds"]["staircase"]
        lines = [r for r in rows if r["kind"] == "vline" and r["series"].startswith("threshold")]
        assert [r["x"] for r in lines] == pytest.approx([t["alpha"] for t in th])
    return check


def _check_against_stored_full_points(name, model, alpha, layer, nodes):
    """Where the full run is still in progress, its committed state (the SE points stored so far)
    is the full run's data: the quick run's overlaps agree with it at every shared alpha."""
    solver = _check_se_overlaps(model, alpha, layer, nodes)
    store = FULL / name / f"{name}_state" / "sweep.sqlite"

    def check(rows, rec):
        solver(rows, rec)
        if not store.is_file():
            return
        from aimsym.studies.sweep import export

        full = [r for r in export(store) if r["init"] == "uninformed"]
        shared = 0
        for k in range(3):
            for pt in _series(rows, f"$Q_{{{k + 1}{k + 1}}}$", "errorbar"):
                same = [r for r in full if r["alpha"] == pytest.approx(pt["x"])]
                if not same:
                    continue
                f = same[0]
                err = math.hypot(pt["yerr"], f[f"Q_stderr_{k}{k}"])
                assert abs(pt["y"] - f[f"Q_{k}{k}"]) <= 4 * err + 2 * rec["settings"]["tol"], (k, pt, f[f"Q_{k}{k}"])
                shared += 1
        assert shared >= 3  # (alpha = 0.4 at least, every layer)
    return check


def _check_phase_diagram(rows, rec):
    from aimsym.model import load
    from aimsym.smi.thresholds import initial_threshold

    first = [r for r in rows if r["kind"] == "errorbar" and r["series"].startswith("threshold 1")]
    assert [r["x"] for r in first] == [0.5, 1.0, 2.0]
    at1 = first[1]
    th = initial_threshold(load("attention_L2_T2", skip=1.0), samples=rec["settings"]["samples"])
    assert abs(at1["y"] - th.alpha) <= 3 * math.hypot(at1["yerr"], th.stderr) + 1e-9
    second = [r for r in rows if r["kind"] == "errorbar" and r["series"].startswith("threshold 2")]
    assert all(s["y"] > f["y"] for s, f in zip(second, first))  # the staircase: layer 1 after layer 2


def _check_gamp(rows, rec):
    amp2 = _series(rows, "AMP layer 2 (d=300, 2 seeds)", "errorbar")
    se2 = _series(rows, "SE layer 2", "errorbar")
    assert len(amp2) == rec["settings"]["iters"] + 1 and np.all(np.isfinite([r["y"] for r in se2]))
    # GAMP tracks the SE: the learned second layer's final overlap within 0.1 of the SE's
    assert abs(amp2[-1]["y"] - se2[-1]["y"]) < 0.1 + 3 * amp2[-1]["yerr"]
    assert rec["summary"]["L2_T2_final_M"][1] == pytest.approx(amp2[-1]["y"])


def _check_held_layer(rows, rec):
    """Layer 1's final overlap vs the held overlap q of layer 2: near zero at q = 0, clearly
    learned at q = 0.99; the curve is the summary's numbers."""
    pts = sorted(_series(rows, f"layer 1, layer 2 held at q, d={rec['settings']['d']}", "errorbar"), key=lambda r: r["x"])
    s = rec["summary"]
    assert [r["x"] for r in pts] == pytest.approx(s["held_overlaps"])
    assert [r["y"] for r in pts] == pytest.approx([m[0] for m in s["final_M_diag"]])
    assert abs(pts[0]["y"]) < 0.1 + 3 * pts[0]["yerr"] and pts[-1]["y"] > 0.3


def _check_gd(rows, rec):
    last = _series(rows, f"layer 2, alpha=16, d={rec['settings']['d']}", "errorbar")[-1]
    assert rec["summary"]["alpha_16"]["final_overlap"][1] == pytest.approx(last["y"])
    assert 0 <= last["y"] <= 1


def _check_erm_theory(label, figure):
    def check(rows, rec):
        from aimsym.erm.params import ERMParams
        from aimsym.erm.se import fixed_point
        from aimsym.plot.erm import ACC, BASE

        kw = {"lam": 0.01, **BASE}
        if label.startswith("direct"):
            kw["model"] = "direct"
        r = _inner(_series(rows, f"{label} (theory)", "line"), 0.0, 10.0)
        fp = fixed_point(ERMParams(**kw), r["x"], ACC)
        want = fp.rank if figure == "rank" else fp.test
        assert want == pytest.approx(r["y"], rel=1e-3)
        if figure == "lam":  # the dotted train-error curve
            t = [p for p in _series(rows, f"{label} train (theory)", "line") if p["x"] == r["x"]]
            assert len(t) == 1 and fp.train == pytest.approx(t[0]["y"], rel=1e-3)
    return check


def _check_erm_spectra(rows, rec):
    """Four panels, each with the theory density (>= 0) and a histogram of Adam's eigenvalues."""
    for panel in range(4):
        theory = [r for r in rows if r["panel"] == panel and r["series"] == "theory"]
        bars = [r for r in rows if r["panel"] == panel and r["kind"] == "bar"]
        assert theory and min(r["y"] for r in theory) >= 0
        assert bars and all(r["series"].startswith("Adam d=") for r in bars)


def _check_erm_beta_T(rows, rec):
    from aimsym.erm.params import ERMParams
    from aimsym.erm.se import fixed_point
    from aimsym.plot.erm import ACC

    r = _inner(_series(rows, "T=2, beta=beta0=1", "line"), 0.0, 10.0)
    p = ERMParams(kappa0=0.5, Delta=0.5, lam=0.01, tokens=2)
    alpha = r["x"] / 2  # x is alpha_bar = alpha (T^2 + T - 2) / 2 = 2 alpha at T = 2
    assert fixed_point(p, alpha, ACC).test == pytest.approx(r["y"], rel=1e-3)


CHECKS = {
    "aim-fig1-left": _check_aim_hardmax,
    "aim-fig1-right": _check_aim_small_width,
    "aim-fig2-left": lambda rows, rec: _check_aim_softmax(rows, rec, "softmax"),
    "aim-fig2-right": _check_aim_tokens,
    "aim-fig3": lambda rows, rec: _check_aim_softmax(rows, rec, "linear"),
    "aim-fig4": _check_aim_many_tokens,
    "aim-fig5": _check_aim_small_width_softmax,
    "smi-fig1-left": _check_se_overlaps("attention_L2_T2", 0.6, 2, None),
    "smi-fig1-right": _check_phase_diagram,
    "smi-fig2-left": _check_gamp,
    "smi-fig2-right": _check_gd,
    "smi-figA5": _check_held_layer,
    "smi-fig3-left": _check_against_stored_full_points("smi-fig3-left", "attention_L3_T2", 1.0, 3, 6),
    "erm-errors": _check_erm_theory("lam=0.01", "lam"),
    "erm-models": _check_erm_theory("direct (ridge)", "models"),
    "erm-rank": _check_erm_theory("lam=0.01", "rank"),
    "erm-spectra": _check_erm_spectra,
    "erm-beta-T": _check_erm_beta_T,
    "erm-seq": _check_erm_theory("seq-to-label", "seq"),
}


def test_every_available_figure_has_a_check():
    assert set(CHECKS) == set(AVAILABLE)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in AVAILABLE])
def test_quick_run_writes_files_and_agrees_with_the_solver(name, tmp_path):
    out = tmp_path / name
    rec = reproduce.run(name, out, quick=True)
    for kind in ("png", "pdf", "csv", "json"):
        path = out / f"{name}.{kind}"
        assert path.is_file() and path.stat().st_size > 0, path
    assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG" and (out / f"{name}.pdf").read_bytes()[:4] == b"%PDF"
    assert json.loads((out / f"{name}.json").read_text())["name"] == name
    prov = rec["provenance"]
    assert prov["versions"]["numpy"] and prov["accuracy"] == rec["settings"] and rec["quick"] is True
    assert all(a["xlabel"] and a["ylabel"] for a in rec["axes"])  # labelled axes
    assert any(a["legend"] for a in rec["axes"])
    rows = _rows(out / f"{name}.csv")
    assert len(rows) == rec["rows"] > 0
    data = [r for r in rows if r["kind"] in ("line", "points", "errorbar", "bar")]
    assert data and all(math.isfinite(r["x"]) and math.isfinite(r["y"]) for r in data), name
    CHECKS[name](rows, rec)
    full = FULL / name / f"{name}.csv"
    if full.is_file():  # the full run's committed data: the quick run must agree at the shared points
        cmp = reproduce.compare_runs(out / f"{name}.csv", full, line_rtol=reproduce.lookup(name).line_rtol)
        assert cmp["shared_points"] >= MIN_SHARED.get(name, 1), cmp
        assert cmp["ok"], cmp["failures"][:5]


def test_full_run_data_are_committed_where_listed():
    """docs/reproduce.md lists the figures whose full-run data are committed; the folder holds them."""
    have = sorted(p.name for p in FULL.iterdir() if (p / f"{p.name}.csv").is_file()) if FULL.is_dir() else []
    assert have == sorted(MIN_SHARED)
    for name in have:
        rec = json.loads((FULL / name / f"{name}.json").read_text())
        assert rec["quick"] is False and rec["name"] == name


def _csv(path, rows):
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["panel", "series", "kind", "x", "y", "yerr"])
        w.writerows(rows)
    return path


def test_compare_runs_uses_the_error_bars_and_only_shared_points(tmp_path):
    full = _csv(tmp_path / "f.csv", [[0, "Q", "errorbar", 0.5, 0.40, 0.01], [0, "Q", "errorbar", 0.7, 0.60, 0.01],
                                     [0, "theory", "line", 0.5, 0.25, "nan"], [0, "Q", "errorbar", 0.9, 0.8, 0.01]])
    agree = _csv(tmp_path / "a.csv", [[0, "Q", "errorbar", 0.5, 0.43, 0.02], [0, "theory", "line", 0.5, 0.25, "nan"],
                                      [0, "Q", "errorbar", 0.55, 9.0, 0.01]])  # x = 0.55 is not shared
    r = reproduce.compare_runs(agree, full, line_rtol=1e-6)
    assert r["ok"] and r["shared_points"] == 2 and r["unchecked"] == 0 and 0.3 < r["worst_ratio"] < 1
    r = reproduce.compare_runs(agree, full)  # Monte Carlo lines without error bars: not compared
    assert r["ok"] and r["unchecked"] == 1
    off = _csv(tmp_path / "o.csv", [[0, "Q", "errorbar", 0.5, 0.52, 0.01], [0, "theory", "line", 0.5, 0.2500001, "nan"]])
    r = reproduce.compare_runs(off, full, line_rtol=1e-6)  # 0.12 apart at 0.014 combined: 8.5 errors; the line 4e-7 relative
    assert not r["ok"] and [f["point"][1] for f in r["failures"]] == ["Q"]
    line = _csv(tmp_path / "l.csv", [[0, "theory", "line", 0.5, 0.26, "nan"]])
    assert not reproduce.compare_runs(line, full, line_rtol=1e-6)["ok"]  # a deterministic curve: to rtol


def test_cli_compare_exit_code(tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["reproduce", "aim-fig5", "--quick", "--out", str(out)]) == 0
    same = out / "aim-fig5.csv"
    assert main(["reproduce", "aim-fig5", "--quick", "--out", str(tmp_path / "q2"), "--compare", str(same)]) == 0
    assert "agree" in capsys.readouterr().out
    rows = _rows(same)
    bad = _csv(tmp_path / "bad.csv", [[r["panel"], r["series"], r["kind"], r["x"], r["y"] + 0.1, r["yerr"]] for r in rows])
    assert main(["reproduce", "aim-fig5", "--quick", "--out", str(tmp_path / "q3"), "--compare", str(bad)]) == 1
    assert main(["reproduce", "aim-fig5", "--quick", "--compare", str(tmp_path / "none.csv")]) == 2


def test_cli_run_prints_the_files(tmp_path, capsys):
    assert main(["reproduce", "aim-fig2-left", "--quick", "--out", str(tmp_path / "f")]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "f" / "aim-fig2-left.pdf") in out and "data rows" in out


def test_out_on_a_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("")
    assert main(["reproduce", "aim-fig2-left", "--out", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0]


def test_figure_rows_read_what_is_drawn():
    """The CSV reader of a figure: curves, error bars (half-length), vertical/horizontal lines,
    histogram bars, and an unlabelled tick named after the same-coloured curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from aimsym.plot.table import figure_axes, figure_rows

    fig, (a, b) = plt.subplots(1, 2)
    a.plot([0, 1], [2, 3], color="C0", label="curve")
    a.axvline(0.5, ymax=0.1, color="C0")
    a.errorbar([1, 2], [3, 4], yerr=[0.1, 0.3], fmt="o", capsize=2, color="C1", label="points")
    a.axhline(1 / 6, color="k", label="bound")
    b.hist([0.1, 0.2, 0.2, 0.9], bins=2, label="hist")
    b.set_xlabel("eigenvalue")
    rows = figure_rows(fig)
    by = {(r["panel"], r["series"], r["kind"]): r for r in rows}
    assert by[(0, "curve", "vline")]["x"] == 0.5 and math.isnan(by[(0, "curve", "vline")]["y"])
    assert by[(0, "bound", "hline")]["y"] == pytest.approx(1 / 6)
    err = [r for r in rows if r["kind"] == "errorbar"]
    assert [(r["x"], r["y"]) for r in err] == [(1, 3), (2, 4)] and [r["yerr"] for r in err] == pytest.approx([0.1, 0.3])
    bars = [r for r in rows if r["kind"] == "bar"]
    assert len(bars) == 2 and sum(r["y"] for r in bars) == 4 and all(r["series"] == "hist" for r in bars)
    assert len(rows) == 2 + 1 + 2 + 1 + 2  # caps are not points
    assert figure_axes(fig)[1]["xlabel"] == "eigenvalue"
    plt.close(fig)


def test_a_rerun_into_the_same_folder_resumes_from_its_state(tmp_path, monkeypatch):
    """The SE figures keep their sweep store and thresholds in OUT/NAME_state/: a rerun with the
    same --out computes neither again (nothing a user computed is lost, also when interrupted)."""
    out = tmp_path / "fig"
    first = reproduce.run("smi-fig1-left", out, quick=True)
    data = (out / "smi-fig1-left.csv").read_text()
    state = out / "smi-fig1-left_state"
    assert (state / "sweep.sqlite").is_file() and (state / "thresholds.json").is_file()
    # the finished run leaves its state only: no passes in progress, none of its own drawings
    assert sorted(f.name for f in state.iterdir()) == ["sweep.sqlite", "thresholds.json"]

    def boom(*a, **k):
        raise AssertionError("recomputed")

    import aimsym.smi.se
    import aimsym.smi.thresholds

    monkeypatch.setattr(aimsym.smi.thresholds, "threshold_report", boom)
    monkeypatch.setattr(aimsym.smi.se, "state_evolution", boom)
    second = reproduce.run("smi-fig1-left", out, quick=True)
    assert (out / "smi-fig1-left.csv").read_text() == data
    assert json.dumps(second["summary"]) == json.dumps(first["summary"])


def test_a_killed_reproduce_keeps_the_points_it_stored(tmp_path):
    """Killed outright (SIGKILL: no cleanup runs), the figure's state keeps every SE point already
    stored; the rerun computes only the rest."""
    import os
    import signal
    import sqlite3
    import subprocess
    import sys
    import time

    out = tmp_path / "fig"
    store = out / "smi-fig1-left_state" / "sweep.sqlite"
    cmd = [sys.executable, "-m", "aimsym.cli", "reproduce", "smi-fig1-left", "--quick", "--out", str(out)]

    def stored():
        try:
            with sqlite3.connect(store) as con:
                return con.execute("SELECT COUNT(*) FROM points").fetchone()[0]
        except sqlite3.Error:
            return 0

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and stored() < 1:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = stored()
    assert kept >= 1
    subprocess.run(cmd, check=True, capture_output=True)
    assert stored() == 3  # the quick run's three alphas, none twice
