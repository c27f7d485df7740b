"""A loaded model: symbolic spec + bound parameter values + its generated kernels.

The generated kernels are built from the *symbolic* spec (parameters such as ``skip`` stay
symbols), so one compiled module serves every value; values are passed at run time. Everything a
solver reads (observation map, index labels, symmetries, counting bound) comes from the generated
module as plain data: only ``derivation`` and ``summary`` (the derive verb) import SymPy.
"""

from __future__ import annotations

import functools
import sys
from typing import NamedTuple
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .derive import spec as spec_mod
from .errors import AimsymError, SpecError

# the one-off compilation notice (see Model.compile_notice); sweep workers turn it off
COMPILE_NOTICE = True
_NOTICED: set[str] = set()
from .derive.spec import AttentionSpec, Spec


class IndexLabel(NamedTuple):
    """What row k of Z is: layer l (1-based), head, role ('w' tied, 'q'/'k' untied), rank i."""

    layer: int
    head: int
    role: str
    rank: int

    def text(self) -> str:
        role = {"w": "W", "q": "W_Q", "k": "W_K"}[self.role]
        head = f", head {self.head + 1}" if self.head else ""
        return f"layer {self.layer}{head}: {role} column {self.rank + 1}"


@dataclass(frozen=True)
class Model:
    spec: Spec
    values: tuple[tuple[str, float], ...] = field(default=())

    # ------------------------------------------------------------------ identity
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def p(self) -> int:
        return self.spec.p

    @property
    def tokens(self) -> int:
        return self.spec.tokens

    @property
    def output_shape(self) -> tuple[int, ...]:
        return tuple(self.spec.output_shape)

    @property
    def parameters(self) -> dict[str, float]:
        return dict(self.values)

    def hash(self) -> str:
        """Spec hash plus the bound values (what a result depends on)."""
        vals = ",".join(f"{k}={v!r}" for k, v in self.values)
        return f"{self.spec.hash()}[{vals}]" if vals else self.spec.hash()

    def with_values(self, **values) -> "Model":
        merged = dict(self.values)
        merged.update(spec_mod.resolve_values(self.spec, values))
        spec_mod.check_values(self.spec, merged)
        return Model(self.spec, tuple(sorted(merged.items())))

    # ------------------------------------------------------------------ stages
    @functools.cached_property
    def derivation(self):
        from .derive.symbolic import derive

        return derive(self.spec)

    @functools.cached_property
    def kernels(self):
        from .derive.files import cache_dir

        try:
            return load_kernels(self.spec)
        except OSError as exc:  # the generated module could not be written (e.g. a read-only HOME)
            where = exc.filename or cache_dir()
            raise AimsymError("cache", f"cannot write the kernels of {self.name} to {where} ({exc.strerror}); "
                                       "set AIMSYM_CACHE to a writable folder") from None
        except RuntimeError as exc:
            if "cannot cache" not in str(exc):
                raise
            raise AimsymError("cache", f"numba finds no writable folder for the compiled kernels of {self.name}; "
                                       "set NUMBA_CACHE_DIR to a writable folder") from None

    def compile_notice(self, kernel: str = "denoise_batch") -> bool:
        """Print 'compiling kernels for NAME, once' (once per process) when numba's cache holds no
        compiled code of this model's module yet: a model's first use costs tens of seconds of
        compilation. ``kernel``: any njit function of the module (it locates the cache folder)."""
        key = self.spec.hash()
        if not COMPILE_NOTICE or key in _NOTICED:
            return False
        _NOTICED.add(key)  # (checked once per process, whatever the outcome: link() calls this often)
        fn = getattr(self.kernels, kernel, None)
        try:
            folder = Path(fn._cache._cache_path)  # where numba keeps this module's compiled code
        except AttributeError:
            return False
        stem = Path(self.kernels.__file__).stem
        if any(folder.glob(f"{stem}.*.nbi")):  # compiled before (at least in part)
            return False
        if kernel == "denoise_batch" and self._modal_compiled():
            return False
        sys.stderr.write(f"aimsym: compiling kernels for {self.name}, once (cached for later runs)\n")
        sys.stderr.flush()
        return True

    def _modal_compiled(self) -> bool:
        """Whether numba's cache holds the model's assembled mode-centred module (at k >= 6 the
        denoiser runs only that one, never the driver's ``denoise_batch``)."""
        from .denoise import modal
        from .derive.files import import_module

        path = modal.module_path(self.kernels)
        if not path.exists():
            return False
        try:
            folder = Path(import_module(path).modal_rule._cache._cache_path)
        except (AttributeError, ImportError, OSError):
            return False
        return any(folder.glob(f"{path.stem}.*.nbi"))

    def params_array(self) -> np.ndarray:
        names = self.spec.parameters()
        missing = [n for n in names if n not in dict(self.values)]
        if missing:
            raise SpecError(missing[0], f"symbolic parameter needs a value (e.g. --set {missing[0]}=1.0 or "
                                        f"aimsym.load(..., {missing[0]}=1.0))")
        vals = dict(self.values)
        return np.array([vals[n] for n in names], dtype=float)

    @property
    def noise(self) -> float:
        nz = self.spec.noise
        return dict(self.values)[nz] if isinstance(nz, str) else float(nz)

    def _flat(self, Z) -> tuple[tuple[int, ...], np.ndarray]:
        """(batch shape, contiguous (n, p, T) copy) of an index array, shape-checked."""
        Z = np.asarray(Z, dtype=float)
        if Z.shape[-2:] != (self.p, self.tokens):
            raise SpecError("Z", f"expected shape (..., {self.p}, {self.tokens}), got {Z.shape}")
        return Z.shape[:-2], np.ascontiguousarray(Z.reshape(-1, self.p, self.tokens))

    def link(self, Z) -> np.ndarray:
        """y = g(Z) for Z of shape (..., p, T), by the generated kernel."""
        batch, flat = self._flat(Z)
        self.compile_notice("link_batch")
        out = np.empty((flat.shape[0], *self.kernels.LINK_SHAPE))
        self.kernels.link_batch(flat, self.params_array(), out)
        return out.reshape(*batch, *self.output_shape)

    def link_jacobian(self, Z) -> np.ndarray:
        """dy/dZ for Z of shape (..., p, T): shape (..., *output_shape, p, T)."""
        batch, flat = self._flat(Z)
        out = np.zeros((flat.shape[0], *self.kernels.LINK_SHAPE, self.p, self.tokens))
        self.kernels.link_jacobian_batch(flat, self.params_array(), out)
        return out.reshape(*batch, *self.output_shape, self.p, self.tokens)

    # ------------------------------------------------------------------ plain data of the generated module
    @property
    def labels(self) -> tuple[IndexLabel, ...]:
        return tuple(IndexLabel(*lb) for lb in self.kernels.INDEX_LABELS)

    @property
    def symmetries(self) -> list[dict]:
        """Sign flips of groups of rows of Z leaving the link invariant: [{"name", "rows"}]."""
        return [{"name": name, "rows": list(rows)} for name, rows in self.kernels.SIGN_SYMMETRIES]

    @property
    def counting(self) -> dict:
        """The counting bound of perfect recovery (m, alpha_pr = p / m, note)."""
        return dict(self.kernels.COUNTING)

    @property
    def reduction_reason(self) -> str:
        return self.kernels.REDUCTION_REASON

    @property
    def has_observation(self) -> bool:
        """Whether the denoiser observes a quantity computed from Z (h) rather than y itself."""
        return self.kernels.observation_values is not None

    def observation(self, Z) -> np.ndarray:
        """The denoiser's observed quantity computed from the indices, shape (..., n_obs):
        h = M_{L-1} z_L^T for attention models (exact even where y = g(Z) underflows), else y."""
        batch, flat = self._flat(Z)
        if self.has_observation:
            with np.errstate(over="ignore"):
                vals = self.kernels.observation_values(flat, self.params_array())
            vals = [np.broadcast_to(np.asarray(v, dtype=float), flat.shape[:-2]) for v in vals]
            return np.stack(vals, axis=-1).reshape(*batch, len(vals))
        y = self.link(Z)
        return y.reshape(*Z.shape[:-2], -1)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Draw n (Z, y) pairs from the prior (Z entries i.i.d. N(0, 1)) and the channel."""
        Z = rng.standard_normal((n, self.p, self.tokens))
        y = self.link(Z)
        if self.noise > 0:
            y = y + np.sqrt(self.noise) * rng.standard_normal(y.shape)
        return Z, y

    def denoiser(self, **accuracy):
        self.compile_notice("denoise_batch")
        if self.kernels.PATH == "hardmax-wedge-mixed":  # hardmax last layer after a first layer
            from .denoise.hardmax_channel import HardmaxMixedDenoiser

            return HardmaxMixedDenoiser(self, **accuracy)
        from .denoise.channel import Denoiser

        return Denoiser(self, **accuracy)

    def summary(self) -> dict:
        s = self.derivation.summary()
        s["values"] = dict(self.values)
        return s


def load_kernels(spec):
    """Generated module for ``spec`` (the committed one if bundled and current, otherwise
    generated into the cache directory keyed by the spec hash: the only step needing SymPy)
    with its drivers appended, imported from a file in the user cache named by its hash."""
    from .denoise.drivers import assemble
    from .derive import files

    path = files.module_path(spec)
    if not files.header_matches(spec, path):
        path = files.module_path(spec, bundled=False)
        if not files.header_matches(spec, path):
            from .derive.codegen import write_module

            write_module(spec, path)
    return files.import_module(files.cached_file(assemble(path.read_text()), path.stem))


def load(source, **values) -> Model:
    """``source``: a path to a TOML file, the name of a bundled model (``"attention_L2_T2"``),
    a TOML string, or a spec."""
    if isinstance(source, AttentionSpec | spec_mod.SMISpec):
        spec = source
    elif isinstance(source, Path) or (isinstance(source, str) and "\n" not in source):
        from .derive import setups
        from .derive.files import resolve

        path = resolve(source)
        if path.is_file() and setups.kind_of(path) in setups.KINDS:
            return setups.load(path).with_values(**values)  # a declared aim/erm setup: plain data
        spec = spec_mod.load(path)  # a file or a bundled name
    elif isinstance(source, str):
        spec = spec_mod.loads(source)
    else:
        raise SpecError("model", f"expected a TOML path, TOML text or a spec, got {type(source).__name__}")
    model = Model(spec)
    return model.with_values(**values) if values else model
