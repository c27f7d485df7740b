"""docs/tutorial.ipynb runs from top to bottom at its small settings (its code cells, in order, in one
namespace, in a fresh folder) and produces what it says: the LaTeX file, the SE overlaps with
error bars, the staircase and the figure."""

import json
import os
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def test_tutorial_notebook_runs(tmp_path, monkeypatch):
    nb = json.loads((ROOT / "docs" / "tutorial.ipynb").read_text())
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert cells and all(not c.lstrip().startswith(("!", "%")) for c in cells)  # plain Python only
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    ns: dict = {}
    for i, src in enumerate(cells):
        exec(compile(src, f"tutorial cell {i}", "exec"), ns)  # noqa: S102 (our own notebook)
    assert ns["SMALL"] is True
    assert "\\begin{document}" in (tmp_path / "tutorial_model.tex").read_text()
    assert (tmp_path / "tutorial_overlaps.png").stat().st_size > 10_000
    res = ns["res"]
    assert res.converged and np.all(np.isfinite(res.Q_stderr))
    assert ns["rep"].staircase and ns["rep"].staircase[0].alpha > 0
    assert len(ns["rows"]) == len(ns["ALPHAS"])
    out = ns["out"]
    assert np.all(np.isfinite(out.g_out)) and float(np.max(out.error)) < 1e-6
