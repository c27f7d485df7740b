"""Denoiser passes of the state evolution kept on disk, so that a stopped run resumes.

A state-evolution run is a deterministic sequence of denoiser passes: the expectation points
are fixed, so each pass is a function of the overlap Q alone, and every later step (Anderson
mixing, the Newton polish, the re-seeding) is a function of the passes before it. Keeping each
pass under a key of its whole input lets a rerun of the same command replay the passes already
made bit for bit (a cache hit per step) and continue with the first one it has not made: a run
stopped by a cluster's wall time, a crash or Ctrl-C loses at most the pass in progress. Where
one pass of the three-layer model costs minutes, that is the difference between resuming and
starting over.

The key covers everything the pass depends on: the model (spec hash, parameters, generated
kernels' version), the denoiser (its accuracy settings), the package's own code (a change to
the denoiser or the SE invalidates every pass), the expectation points and Q itself (its exact
bytes). A pass is written to a temporary file and renamed, so a stopped write leaves no
damaged pass; a file that cannot be read is computed again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
import zipfile
from pathlib import Path

import numpy as np

from ..denoise.output import DenoiserOutput
from ..errors import AimsymError

_FIELDS = ("g_out", "dg_out", "log_z_out", "ess", "error")


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of the package sources a pass depends on (the denoisers, the SE, the derivation)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for sub in ("denoise", "derive", "smi"):
        for f in sorted((root / sub).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _setup(model, den) -> dict:
    """The model (hash, parameters) and the denoiser's settings: what every result depends on."""
    return {"model": model.hash(),
            "parameters": {k: float(v) for k, v in dict(getattr(model, "parameters", {})).items()},
            "denoiser": type(den).__name__, "accuracy": getattr(den, "accuracy", None)}


def channel_key(model, den, points: np.ndarray) -> str:
    """What a pass depends on besides Q: model, denoiser settings, code, expectation points."""
    desc = {**_setup(model, den), "generator": getattr(getattr(model, "kernels", None), "GENERATOR_VERSION", None),
            "tol": getattr(den, "tol", None), "rule": getattr(den, "rule", None), "code": code_version()}
    h = hashlib.sha256(json.dumps(desc, sort_keys=True, default=repr).encode())
    h.update(str(points.shape).encode())
    h.update(np.ascontiguousarray(points, dtype=float).tobytes())
    return h.hexdigest()


class Passes:
    """A folder of denoiser passes (one ``.npz`` per pass, named by the hash of its input)."""

    def __init__(self, folder):
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise AimsymError("checkpoint", f"cannot create the folder {self.folder}: {exc.strerror or exc}") from None
        self.hits = 0
        self.writes = 0
        self._broken = False

    def _path(self, ch_key: str, Q: np.ndarray) -> Path:
        h = hashlib.sha256(ch_key.encode())
        h.update(np.ascontiguousarray(Q, dtype=float).tobytes())
        return self.folder / f"{h.hexdigest()[:32]}.npz"

    def load(self, ch_key: str, Q: np.ndarray) -> DenoiserOutput | None:
        path = self._path(ch_key, Q)
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as f:
                arrays = {k: (f[k] if k in f.files else None) for k in _FIELDS}
                path_name = str(f["path"]) if "path" in f.files else ""
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            return None  # damaged: computed again (and overwritten)
        self.hits += 1
        return DenoiserOutput(**arrays, path=path_name)

    def save(self, ch_key: str, Q: np.ndarray, out: DenoiserOutput) -> None:
        if self._broken:
            return
        path = self._path(ch_key, Q)
        arrays = {k: np.asarray(getattr(out, k)) for k in _FIELDS if getattr(out, k, None) is not None}
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as fh:
                np.savez(fh, path=np.asarray(out.path), **arrays)
            os.replace(tmp, path)
            self.writes += 1
        except OSError as exc:  # a full disk must not stop the run it was meant to protect
            self._broken = True
            tmp.unlink(missing_ok=True)
            warnings.warn(f"checkpoint folder {self.folder}: cannot write ({exc.strerror or exc}); "
                          "the run continues without keeping its passes", RuntimeWarning, stacklevel=3)


def clear(folder, pattern: str = "*.npz") -> None:
    """Remove the passes kept in ``folder`` (``pattern``: the files of :class:`Kept`, ``*.json``) and
    the folder, if nothing else is in it."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for f in folder.glob(pattern):
        f.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass  # other files (not ours)


def as_passes(checkpoint) -> Passes | None:
    if checkpoint is None or isinstance(checkpoint, Passes):
        return checkpoint
    return Passes(checkpoint)


def points_id(ch) -> dict:
    """What a channel's results depend on, without the code version: model (hash, parameters), the
    denoiser's settings and a hash of the expectation points. (The key of :class:`Kept`: finished
    results are data, like a sweep's stored points, and outlive a change of the code.)"""
    return {**_setup(ch.model, ch.den),
            "points": hashlib.sha256(np.ascontiguousarray(ch.points, dtype=float).tobytes()).hexdigest()[:20]}


class Kept:
    """Finished results of one long computation (e.g. the restricted SE runs of a staircase step:
    an hour each for three layers), one small JSON file per computation ``key`` in ``folder``, so
    that a stopped run replays them and a later job (another checkout, another code version) goes
    on from there. Values must be JSON (floats round-trip exactly)."""

    def __init__(self, folder, key: dict):
        self.folder = Path(folder)
        self.key = json.loads(json.dumps(key, sort_keys=True, default=repr))
        name = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:20]
        self.path = self.folder / f"{name}.json"
        self.items = {}
        try:
            rec = json.loads(self.path.read_text())
            if rec.get("key") == self.key:
                self.items = dict(rec["items"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none yet, or damaged: computed again
        self.hits = 0

    def get(self, name: str):
        out = self.items.get(name)
        self.hits += out is not None
        return out

    def put(self, name: str, value) -> None:
        self.items[name] = value
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": self.key, "items": self.items}))
            os.replace(tmp, self.path)
        except OSError as exc:  # (the run goes on: only the resumption is lost)
            warnings.warn(f"cannot keep results in {self.folder} ({exc.strerror or exc})", RuntimeWarning,
                          stacklevel=2)
