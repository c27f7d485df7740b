"""What every verb shares: the JSON emitter, the grid parser, the table printer."""

from __future__ import annotations

import json
import math

import numpy as np

from ..errors import AimsymError
from ..results import to_builtin


def dumps(obj) -> str:
    return json.dumps(obj, indent=2, default=to_builtin)


def print_json(obj) -> None:
    """Print ``obj`` as JSON (the only JSON printer of the command line)."""
    print(dumps(obj))


def parse_grid(text: str, field: str = "--alpha", *, third: str = "num") -> list[float]:
    """A number, ``V1,V2,...`` or a range ``START:STOP:X`` -> list of finite floats.

    ``third="num"``: X is the number of points (linspace, sweeps and ``--set`` lists);
    ``third="step"``: X is the step, STOP included when it falls on the grid (aim and erm verbs,
    values rounded to 12 decimals so that 0.01:0.2:0.01 prints 0.03, not 0.030000000000000002).
    """
    text = str(text).strip()
    if third == "num":
        allowed = "START:STOP:NUM (NUM an integer >= 1) or comma-separated finite numbers"
    else:
        allowed = "a number, a list a,b,c or a grid start:stop:step"
    try:
        if ":" in text:
            parts = text.split(":")
            if len(parts) != 3:
                raise ValueError
            if third == "num":
                a, b, n = parts
                if int(n) < 1:
                    raise ValueError
                vals = np.linspace(float(a), float(b), int(n)).tolist()
            else:
                start, stop, step = (float(p) for p in parts)
                if step <= 0 or stop < start:
                    raise AimsymError(field, f"grid start:stop:step needs step > 0 and stop >= start, got {text!r}")
                n = int(np.floor((stop - start) / step + 1e-9))
                vals = [round(start + i * step, 12) for i in range(n + 1)]
        else:
            vals = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise AimsymError(field, f"expected {allowed}, got {text!r}") from None
    if not vals or not all(math.isfinite(v) for v in vals):
        raise AimsymError(field, f"expected {allowed}, got {text!r}")
    return vals


def is_list(text: str) -> bool:
    """Whether a grid text names several values (a list or a range), even if it yields one."""
    return ":" in str(text) or "," in str(text)


def parse_sets(items) -> dict[str, list[float]]:
    """``--set NAME=V1[,V2...]`` (repeatable) -> {name: values}."""
    params: dict[str, list[float]] = {}
    for item in items or ():
        k, _, v = item.partition("=")
        if not k.strip() or not v.strip():
            raise AimsymError("--set", f"expected NAME=V1[,V2...], got {item!r}")
        params[k.strip()] = parse_grid(v, f"--set {k.strip()}")
    return params


def _cell(v, width: int, fmt: str) -> str:
    if v is None:
        return f"{'-':>{width}}"
    if isinstance(v, float | int | np.floating | np.integer) and not isinstance(v, bool):
        return f"{v:>{width}{fmt}}"
    return f"{str(v):>{width}}"


def emit(obj, args, columns, *, width: int = 14, fmt: str = ".8g") -> int:
    """``--json``: the object as JSON; otherwise a table of ``columns`` (those present)."""
    if getattr(args, "json", False):
        print_json(obj)
        return 0
    rows = obj if isinstance(obj, list) else [obj]
    cols = [c for c in columns if c in rows[0]]
    print("  ".join(f"{c:>{width}}" for c in cols))
    for r in rows:
        print("  ".join(_cell(r[c], width, fmt) for c in cols))
    return 0
