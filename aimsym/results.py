"""Results as plain data: the one JSON conversion (numpy arrays and scalars, objects with
``to_json()``) used by the command line and by the sweep store alike."""

from __future__ import annotations

import numpy as np


def to_builtin(obj):
    """``json.dumps`` default: numpy arrays and scalars, and result objects with ``to_json()``."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if hasattr(obj, "to_json"):
        return obj.to_json()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
