"""Where model files and generated modules live, and how a generated module is imported.

SymPy-free on purpose: loading a model's kernels must not pay for (or need) the derivation.

Bundled models: ``derivations/*.toml`` and their ``generated/*.py`` sit at the top of the
checkout; a wheel ships the same two folders inside the package (``aimsym/derivations``,
``aimsym/generated``, mapped in pyproject.toml). Either way a bundled model is addressable by
name (``aimsym.load("attention_L2_T2")``).

Generated modules are imported from a copy in the user cache named by the hash of their text,
so numba's on-disk cache (written next to the imported file) survives a moved checkout and works
with a read-only site-packages.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

from ..provenance import __version__

_HERE = Path(__file__).resolve().parent
_PACKAGE = _HERE.parent


def _data_root() -> Path:
    """The folder holding derivations/ and generated/: the package itself in a wheel, else the checkout."""
    if (_PACKAGE / "derivations").is_dir():
        return _PACKAGE
    return _PACKAGE.parent


REPO_ROOT = _data_root()

# the generator's identity: package version + digest of the source of the whole derive stage
# (the derivation, reduction, numbers such as the depth limit's mixing, and the code writer all
# shape a module), so that a change to any of it marks every generated module stale (the
# drivers are appended at load time)
GENERATOR_VERSION = __version__ + "+" + hashlib.sha256(
    b"".join(p.read_bytes() for p in sorted(_HERE.glob("*.py")))).hexdigest()[:10]


def derivations_dir() -> Path:
    return REPO_ROOT / "derivations"


def generated_dir() -> Path:
    return REPO_ROOT / "generated"


def bundled_names() -> list[str]:
    return sorted(p.stem for p in derivations_dir().glob("*.toml"))


def resolve(source) -> Path:
    """A model file: ``source`` itself if it exists, else the bundled model of that name
    (``attention_L2_T2`` or ``attention_L2_T2.toml``); unchanged when neither exists (the
    caller reports the missing file)."""
    path = Path(source)
    if path.exists():
        return path
    name = str(source)
    if path.name == name:  # a bare name, no folder
        bundled = derivations_dir() / (name if name.endswith(".toml") else name + ".toml")
        if bundled.is_file():
            return bundled
    return path


def cache_dir() -> Path:
    root = os.environ.get("AIMSYM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "aimsym"
    )
    return Path(root)


def _pyname(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)


def module_path(spec, *, bundled: bool | None = None) -> Path:
    """Where the module for ``spec`` lives: ``generated/NAME.py`` for bundled derivations,
    otherwise a cache directory keyed by the spec hash."""
    if bundled is None:
        bundled = is_bundled(spec)
    if bundled:
        return generated_dir() / f"{spec.name}.py"
    return cache_dir() / spec.hash() / f"{_pyname(spec.name)}_{spec.hash()}.py"


def is_bundled(spec) -> bool:
    """Whether ``spec`` is the bundled model of its name (compared by spec hash)."""
    f = derivations_dir() / f"{spec.name}.toml"
    if not f.exists():
        return False
    try:
        return _load_spec(f) == spec
    except Exception:  # a broken bundled file is not this spec
        return False


def _load_spec(path):
    from .spec import load

    return load(path)


def header_matches(spec, path: Path) -> bool:
    """Cheap currency test for loading: spec hash and generator identity in the header."""
    if not path.exists():
        return False
    with path.open() as fh:
        head = fh.read(4096)
    return f"SPEC_HASH = {spec.hash()!r}" in head and f"GENERATOR_VERSION = {GENERATOR_VERSION!r}" in head


def import_module(path: Path):
    """Import a generated module from its file (cached in ``sys.modules`` by path)."""
    key = "aimsym_generated_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    mod = sys.modules.get(key)
    if mod is not None and getattr(mod, "__file__", None) == str(path):
        return mod
    spec = importlib.util.spec_from_file_location(key, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[key] = mod
    spec.loader.exec_module(mod)
    return mod


def cached_file(text: str, stem: str) -> Path:
    """``text`` written once to the user cache, in a file named by ``stem`` and its hash."""
    data = text.encode()
    digest = hashlib.sha256(data).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"{stem}_{digest}.py"
    if not out.exists() or out.read_bytes() != data:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")  # (per process: concurrent writers)
        tmp.write_bytes(data)
        tmp.replace(out)
    return out
