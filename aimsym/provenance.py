"""Provenance recorded with every result: versions, seed, spec hash, accuracy."""

from __future__ import annotations

import platform
from datetime import datetime, timezone
from importlib import metadata

# the package version (also aimsym.__version__; generated modules record it in their header)
__version__ = "0.1.0"


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("aimsym", "numpy", "scipy", "sympy", "numba", "mpmath"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def provenance(*, seed=None, model_hash=None, accuracy=None, **extra) -> dict:
    """A JSON-able record to attach to any result."""
    rec = {
        "seed": seed,
        "model_hash": model_hash,
        "accuracy": accuracy or {},
        "versions": versions(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    rec.update(extra)
    return rec
