"""The numbers a matplotlib figure shows, as tidy rows: what ``aimsym reproduce`` writes as CSV.

Read from the drawn artists (not from the code that computed them), so the table is exactly
the figure: one row per point of each curve (``line``), marker series (``points``), error-bar
series (``errorbar``, with ``yerr`` the half-length of the bar), histogram bar (``bar``), and
one row per vertical or horizontal marker line (``vline`` at x, ``hline`` at y: thresholds and
bounds). Shaded regions and text are not data and are left out. An unlabelled artist takes the
label of the labelled one of the same colour in its panel (e.g. a threshold tick drawn in the
colour of its curve).
"""

from __future__ import annotations

import numpy as np

COLUMNS = ("panel", "series", "kind", "x", "y", "yerr")


def _floats(values) -> np.ndarray:
    return np.ma.filled(np.ma.asarray(values, dtype=float), np.nan).ravel()


def _has_line(artist) -> bool:
    return artist.get_linestyle() not in ("None", "none", "", " ")


def _colour(artist):
    from matplotlib.colors import to_rgba

    try:
        c = artist.get_color()
    except AttributeError:
        c = artist.get_facecolor()
    try:
        return tuple(np.round(to_rgba(c), 4))
    except (ValueError, TypeError):
        return None


def _labelled(label: str) -> bool:
    return bool(label) and not label.startswith("_")


def _yerr(container, n: int) -> np.ndarray:
    """Half-lengths of the vertical bars of an errorbar container (NaN where not drawn)."""
    if not container.has_yerr or not container.lines[2]:
        return np.full(n, np.nan)
    segments = container.lines[2][-1].get_segments()
    if len(segments) != n:
        return np.full(n, np.nan)
    return np.array([abs(s[1][1] - s[0][1]) / 2 for s in segments], dtype=float)


def axes_rows(ax, panel: int) -> list[dict]:
    """Rows of one axes (see the module docstring)."""
    from matplotlib.container import BarContainer, ErrorbarContainer

    rows: list[dict] = []
    seen = set()
    names: dict = {}  # colour -> label

    def add(series, kind, x, y, yerr=None, colour=None):
        x, y = _floats(x), _floats(y)
        e = np.full(len(x), np.nan) if yerr is None else _floats(yerr)
        for xi, yi, ei in zip(x, y, e):
            rows.append({"panel": panel, "series": series, "kind": kind, "x": xi, "y": yi, "yerr": ei,
                         "_colour": colour})

    for c in ax.containers:
        if isinstance(c, ErrorbarContainer):
            line = c.lines[0]
            if line is None:
                continue
            seen.update(id(a) for a in (line, *c.lines[1]))  # (the caps are lines too)
            x, y = line.get_xdata(), line.get_ydata()
            add(c.get_label(), "errorbar", x, y, _yerr(c, len(_floats(x))), _colour(line))
        elif isinstance(c, BarContainer):
            for p in c.patches:
                seen.add(id(p))
            label = c.get_label()  # (a histogram labels its first patch, not the container)
            if not _labelled(label) and c.patches:
                label = c.patches[0].get_label()
            add(label, "bar", [p.get_x() + p.get_width() / 2 for p in c.patches],
                [p.get_height() for p in c.patches], colour=_colour(c.patches[0]) if c.patches else None)
    vertical, horizontal = ax.get_xaxis_transform(which="grid"), ax.get_yaxis_transform(which="grid")
    for line in ax.lines:
        if id(line) in seen:
            continue
        x, y = _floats(line.get_xdata()), _floats(line.get_ydata())
        tr = line.get_transform()
        if tr == vertical and len(x) and np.all(x == x[0]):
            add(line.get_label(), "vline", x[:1], [np.nan], colour=_colour(line))
        elif tr == horizontal and len(y) and np.all(y == y[0]):
            add(line.get_label(), "hline", [np.nan], y[:1], colour=_colour(line))
        else:
            add(line.get_label(), "line" if _has_line(line) else "points", x, y, colour=_colour(line))
    # unlabelled artists: the label of the same-coloured labelled curve (else marker series), if any
    for r in sorted(rows, key=lambda r: r["kind"] != "line"):
        if _labelled(r["series"]) and r["_colour"] is not None:
            names.setdefault(r["_colour"], r["series"])
    for r in rows:
        if not _labelled(r["series"]):
            r["series"] = names.get(r["_colour"], "")
        del r["_colour"]
    return rows


def figure_rows(fig) -> list[dict]:
    """Rows of every axes of ``fig`` that holds data (panel = its index, from 0)."""
    out = []
    for i, ax in enumerate(a for a in fig.axes if a.lines or a.containers):
        out += axes_rows(ax, i)
    return out


def figure_axes(fig) -> list[dict]:
    """Title, axis labels and scales of every data panel (the CSV's ``panel`` indexes this list)."""
    return [{"panel": i, "title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
             "xscale": ax.get_xscale(), "yscale": ax.get_yscale(),
             "legend": [t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else []}
            for i, ax in enumerate(a for a in fig.axes if a.lines or a.containers)]
