"""Module paths of the flat layout (before the stage subpackages) -> their new homes, so code
written against the old paths keeps importing while it is updated (``import aimsym.se`` gives
``aimsym.smi.se`` itself, with a DeprecationWarning). Nothing inside the package uses them."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "aimsym.spec": "aimsym.derive.spec", "aimsym.parse": "aimsym.derive.parse",
    "aimsym.symbolic": "aimsym.derive.symbolic", "aimsym.latex": "aimsym.derive.latex",
    "aimsym.latexutil": "aimsym.derive.latexutil", "aimsym.codegen": "aimsym.derive.codegen",
    "aimsym.channel": "aimsym.denoise.channel", "aimsym.hardmax_channel": "aimsym.denoise.hardmax_channel",
    "aimsym.modal": "aimsym.denoise.modal",
    "aimsym.data": "aimsym.smi.data", "aimsym.se": "aimsym.smi.se", "aimsym.thresholds": "aimsym.smi.thresholds",
    "aimsym.perfect": "aimsym.smi.perfect", "aimsym.amp": "aimsym.smi.amp", "aimsym.gd": "aimsym.smi.gd",
    "aimsym.sweep": "aimsym.studies.sweep",
    "aimsym.cli_smi": "aimsym.cli.derive", "aimsym.cli_se": "aimsym.cli.se", "aimsym.cli_amp": "aimsym.cli.amp",
    "aimsym.aim.cli": "aimsym.cli.aim", "aimsym.erm.cli": "aimsym.cli.erm",
    "aimsym.aim.plots": "aimsym.plot.aim", "aimsym.erm.plot": "aimsym.plot.erm",
    "aimsym.bench_amp": "aimsym.bench.amp", "aimsym.bench_se": "aimsym.bench.se",
    "aimsym.bench_denoiser": "aimsym.bench.denoiser", "aimsym.aim.bench": "aimsym.bench.aim",
    "aimsym.erm.bench": "aimsym.bench.erm",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return importlib.import_module(self.new)  # the very module: one object under two names

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        new = MOVED.get(name)
        if new is None:
            return None
        warnings.warn(f"{name} moved to {new}", DeprecationWarning, stacklevel=3)
        return importlib.util.spec_from_loader(name, _Alias(new))


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
