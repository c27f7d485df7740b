"""Results as plain data: the one JSON conversion (numpy arrays and scalars, objects with
``to_json()``) used by the command line and by the sweep store alike, and the base of the typed
result objects the solvers return."""

from __future__ import annotations

from dataclasses import fields

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


class Result:
    """Base of a ``@dataclass`` result: ``to_json()`` is its fields in declared order (the JSON
    keys; nested arrays and results are converted by :func:`to_builtin` when dumped). Fields named
    in ``OPTIONAL`` are left out while None (keys the old dicts only had sometimes).
    ``r["key"]``, ``get``, ``keys`` and ``in`` read the JSON form, for callers written against
    the dicts these objects replace."""

    OPTIONAL: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if not (f.name in self.OPTIONAL and getattr(self, f.name) is None)}

    def __getitem__(self, key):
        return self.to_json()[key]

    def get(self, key, default=None):
        return self.to_json().get(key, default)

    def keys(self):
        return self.to_json().keys()

    def items(self):
        return self.to_json().items()

    def __contains__(self, key) -> bool:
        return key in self.to_json()
