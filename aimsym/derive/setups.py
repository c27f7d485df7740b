"""Declared extensive-width setups: model files with ``kind = "aim"`` (attention-indexed model,
Bayes-optimal) or ``kind = "erm"`` (empirical risk minimisation in a tied attention layer).

They have no SMI derivation (their channels are closed forms at extensive width), so they are
plain validated data: the common verbs (``aimsym se|thresholds|amp|gd FILE``) read them and run
the aim and erm solvers with exactly the options of ``aimsym aim ...`` / ``aimsym erm ...``.

    [model]
    kind = "aim"            # tokens, rho, activation, beta
    tokens = 2
    rho = 0.5
    activation = "softmax"

    [model]
    kind = "erm"            # tokens, kappa0, lam, noise, beta, beta0, model, penalty, kappa, output
    kappa0 = 0.5
    lam = 0.01
    noise = 0.5
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecError

KINDS = ("aim", "erm")

# key -> (type, default); the defaults are those of the aim and erm sub-commands
_KEYS = {
    "aim": {"tokens": (int, 2), "rho": (float, 0.5), "activation": (str, "softmax"), "beta": (float, 1.0)},
    "erm": {"tokens": (int, 2), "kappa0": (float, 0.5), "lam": (float, 0.01), "noise": (float, 0.0),
            "beta": (float, 1.0), "beta0": (float, 1.0), "model": (str, "factorised"), "penalty": (str, None),
            "kappa": (float, None), "output": (str, "label")},
}
# which keys each solver verb takes (erm thresholds is a closed form in kappa0, tokens, noise)
_VERB_KEYS = {("erm", "thresholds"): ("kappa0", "tokens", "noise")}


@dataclass(frozen=True)
class Setup:
    kind: str
    name: str
    description: str
    values: tuple[tuple[str, object], ...]

    @property
    def parameters(self) -> dict:
        return dict(self.values)

    def with_values(self, **values) -> "Setup":
        merged = dict(self.values)
        for k, v in values.items():
            merged[k] = _check(self.kind, k, v)
        return Setup(self.kind, self.name, self.description, tuple(sorted(merged.items())))

    def options(self, verb: str) -> list[str]:
        """Command-line options of ``aimsym KIND VERB`` carrying these values (unset ones omitted)."""
        keys = _VERB_KEYS.get((self.kind, verb), tuple(_KEYS[self.kind]))
        out = []
        for k in keys:
            v = dict(self.values).get(k)
            if v is not None:
                out += [f"--{k}", repr(v) if isinstance(v, float) else str(v)]
        return out

    def to_json(self) -> dict:
        return {"kind": self.kind, "name": self.name, "description": self.description, **dict(self.values)}


def _check(kind: str, key: str, value):
    if key not in _KEYS[kind]:
        raise SpecError(key, f"not a key of a {kind} model (allowed: {', '.join(sorted(_KEYS[kind]))})")
    typ, _ = _KEYS[kind][key]
    if typ is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise SpecError(key, f"must be an integer, got {value!r}")
        return int(value)
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise SpecError(key, f"must be a finite number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise SpecError(key, f"must be a string, got {value!r}")
    return value


def _table(path: Path) -> dict:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError("model", f"cannot read {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError("model", f"{path} is not valid TOML: {exc}") from None
    if not isinstance(data.get("model"), dict):
        raise SpecError("model", "the file needs a [model] table")
    return data["model"]


def kind_of(path) -> str:
    """The ``kind`` of a model file (``attention`` when absent)."""
    return str(_table(Path(path)).get("kind", "attention"))


def load(path) -> Setup:
    path = Path(path)
    m = dict(_table(path))
    kind = m.pop("kind", None)
    if kind not in KINDS:
        raise SpecError("kind", f"expected one of {', '.join(KINDS)} here, got {kind!r}")
    name = str(m.pop("name", re.sub(r"[^A-Za-z0-9_.-]", "_", path.stem)))
    description = str(m.pop("description", ""))
    values = {k: d for k, (_, d) in _KEYS[kind].items()}
    for k, v in m.items():
        values[k] = _check(kind, k, v)
    return Setup(kind, name, description, tuple(sorted(values.items())))
