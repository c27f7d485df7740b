"""Architecture declarations: frozen, hashable, validated specs and their TOML form.

Two kinds of model are declared:

* :class:`AttentionSpec` -- a deep attention network (theory section 2): ``tokens`` T,
  one :class:`LayerSpec` per layer (rank, heads, tied or untied query/key, skip, activation,
  beta), and ``output`` (``"attention"``: the last attention matrix, or ``"tokens"``: the
  mixing product M_L, sequence to sequence);
* :class:`SMISpec` -- a free-form sequence multi-index link, a SymPy expression (or a
  matrix of them) in the indices ``z[k, t]``, parsed without ``eval``; optionally a matrix
  link is passed through ``activation`` along its rows (the same symbolic softmax / hardmax
  as attention layers), e.g. ``y = softmax_rows(beta h)`` for a free-form logit matrix h.

Numeric parameters (``skip``, ``beta``) are either numbers or identifiers; an identifier
keeps the parameter symbolic so one generated kernel serves a whole sweep.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..errors import SpecError

ACTIVATIONS = ("softmax", "hardmax", "linear")
OUTPUTS = ("attention", "tokens")
HEAD_MODES = ("mean", "split")
_IDENT = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
# names that would clash with the generated code or SymPy's namespace
_RESERVED = {"z", "Z", "pi", "E", "I", "N", "S", "O", "Q", "beta_", "math", "np", "lambda"}
# words that read as numbers: "nan" would otherwise become a parameter named nan
_NOT_NAMES = {"nan", "inf", "infinity"}
# |beta| above this is the hardmax limit in all but name, and overflows the kernels' constants
BETA_MAX = 1e4

Param = float | str  # a number, or the name of a symbolic parameter


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer. ``rank`` is r_l; each head has its own rank-r_l weights."""

    rank: int = 1
    heads: int = 1
    tied: bool = True
    skip: Param = 1.0
    activation: str = "softmax"
    beta: Param = 1.0
    # readout weights combining the heads (default 1/H each: the mean of the heads)
    readout: tuple[Param, ...] | None = None

    def indices(self) -> int:
        """Number of SMI indices (rows of Z) this layer contributes."""
        return self.heads * self.rank * (1 if self.tied else 2)

    def head_weights(self) -> tuple[Param, ...]:
        return self.readout if self.readout is not None else (1.0 / self.heads,) * self.heads


@dataclass(frozen=True)
class AttentionSpec:
    tokens: int
    layers: tuple[LayerSpec, ...]
    output: str = "attention"
    head_mode: str = "mean"  # "mean": heads see the full embedding; "split": d/H chunks each
    noise: Param = 0.0  # Gaussian output noise variance Delta (0: deterministic link)
    name: str = "model"
    description: str = ""
    # weight-shared flow: one layer's weights shared across L layers with skip c = L / tau and
    # the attention rescaled by 1 / c; as L -> infinity the mixing product solves the ODE
    # dM/dt = S(M) M on [0, tau], integrated by depth_steps classical Runge-Kutta steps
    shared_flow: bool = False
    tau: Param = 1.0
    depth_steps: int = 8
    # large-depth limit with separate weights per layer (kind = "attention_depth_limit"): the
    # declared layer is the last one, after the mean-field mixing Mbar(tau) of the first layers
    # (aimsym.derive.depth); tau is a number, since Mbar is computed when the model is derived
    depth_limit_tau: float | None = None
    kind: str = field(default="attention", init=False)

    @property
    def p(self) -> int:
        return sum(layer.indices() for layer in self.layers)

    @property
    def output_shape(self) -> tuple[int, int]:
        return (self.tokens, self.tokens)

    def parameters(self) -> tuple[str, ...]:
        return _symbols_of(self)

    def hash(self) -> str:
        return spec_hash(self)


@dataclass(frozen=True)
class SMISpec:
    """Free-form SMI model ``y = g(Z)`` with ``Z`` of shape (indices, tokens)."""

    indices: int
    tokens: int
    link: tuple  # nested tuple of expression strings: scalar, vector or matrix
    parameters_: tuple[str, ...] = ()
    noise: Param = 0.0
    name: str = "model"
    description: str = ""
    # sigma applied along the rows of a matrix link (aimsym.derive.symbolic.activate): "linear" is
    # the identity (the default, kept out of the hash so earlier specs keep theirs)
    activation: str = "linear"
    kind: str = field(default="smi", init=False)

    @property
    def p(self) -> int:
        return self.indices

    @property
    def output_shape(self) -> tuple[int, ...]:
        return _shape_of(self.link)

    def parameters(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.parameters_) | set(_symbols_of(self))))

    def hash(self) -> str:
        return spec_hash(self)


Spec = AttentionSpec | SMISpec


# ----------------------------------------------------------------------------- hashing


def canonical(spec: Spec) -> dict:
    """JSON-able canonical form (the hash input)."""
    d = asdict(spec)
    d.pop("description", None)
    if isinstance(spec, AttentionSpec):
        # optional features at their defaults stay out, so adding one keeps earlier hashes
        if not spec.shared_flow:
            for key in ("shared_flow", "tau", "depth_steps"):
                d.pop(key)
        if spec.depth_limit_tau is None:
            d.pop("depth_limit_tau")
    if isinstance(spec, SMISpec) and spec.activation == "linear":
        d.pop("activation")
    return d


def spec_hash(spec: Spec) -> str:
    blob = json.dumps(canonical(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _symbols_of(spec: Spec) -> tuple[str, ...]:
    names: set[str] = set()
    if isinstance(spec, AttentionSpec):
        for layer in spec.layers:
            vals = [layer.beta, *(layer.readout or ())]
            if not spec.shared_flow and spec.depth_limit_tau is None:
                vals.append(layer.skip)
            names.update(v for v in vals if isinstance(v, str))
        if spec.shared_flow and isinstance(spec.tau, str):
            names.add(spec.tau)
    if isinstance(spec.noise, str):
        names.add(spec.noise)
    return tuple(sorted(names))


def _shape_of(link) -> tuple[int, ...]:
    if isinstance(link, str):
        return ()
    if link and isinstance(link[0], tuple):
        return (len(link), len(link[0]))
    return (len(link),)


# ----------------------------------------------------------------------------- validation


def _param(value, fld: str, *, positive=False, nonneg=False) -> Param:
    if isinstance(value, bool):
        raise SpecError(fld, f"expected a number or a parameter name, got {value!r}")
    if isinstance(value, int | float):
        v = float(value)
        if not math.isfinite(v):
            raise SpecError(fld, f"must be finite, got {value!r}")
        if positive and v <= 0:
            raise SpecError(fld, f"must be > 0, got {value!r}")
        if nonneg and v < 0:
            raise SpecError(fld, f"must be >= 0, got {value!r}")
        return v
    if isinstance(value, str):
        if value.strip().lstrip("+-").lower() in _NOT_NAMES:
            raise SpecError(fld, f"must be a finite number or a parameter name, got {value!r}")
        if not _IDENT.match(value) or value in _RESERVED:
            raise SpecError(
                fld,
                f"expected a number or a parameter name (letters, digits, _; not "
                f"{', '.join(sorted(_RESERVED))}), got {value!r}",
            )
        return value
    raise SpecError(fld, f"expected a number or a parameter name, got {value!r}")


def _int(value, fld: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(fld, f"expected an integer >= {low}, got {value!r}")
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in {low}..{high}"
        raise SpecError(fld, f"must be an integer {rng}, got {value!r}")
    return value


def _choice(value, fld: str, allowed) -> str:
    if value not in allowed:
        raise SpecError(fld, f"must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _per_layer(value, fld: str, n_layers: int) -> list:
    if isinstance(value, list):
        if len(value) != n_layers:
            raise SpecError(fld, f"a list must have one entry per layer ({n_layers}), got {len(value)}")
        return value
    return [value] * n_layers


def make_attention(
    *,
    tokens: int,
    layers: int = 1,
    rank=1,
    heads=1,
    tied=True,
    skip=1.0,
    activation="softmax",
    beta=1.0,
    readout=None,
    output: str = "attention",
    head_mode: str = "mean",
    noise=0.0,
    name: str = "model",
    description: str = "",
    shared_flow: bool = False,
    tau=1.0,
    depth_steps: int = 8,
    depth_limit_tau=None,
    depth_limit=None,
) -> AttentionSpec:
    """Validated :class:`AttentionSpec`; scalar fields are shared, lists are per layer.

    ``shared_flow``: one layer's weights shared across depth (an ODE flow in the link);
    ``depth_limit_tau``: the large-depth limit with separate weights per layer (one declared
    layer, the last; see :mod:`aimsym.derive.depth`)."""
    if depth_limit is not None:
        raise SpecError("depth_limit", "renamed: 'shared_flow = true' is one layer's weights shared across depth "
                                       "(an ODE flow); the large-depth limit with separate weights per layer is "
                                       "kind = 'attention_depth_limit' (with tau)")
    if not isinstance(shared_flow, bool):
        raise SpecError("shared_flow", f"must be true or false, got {shared_flow!r}")
    if shared_flow and layers != 1:
        raise SpecError("layers", "the weight-shared flow shares one layer's weights across depth: "
                                  "declare layers = 1 (depth is set by tau)")
    if depth_limit_tau is not None:
        if shared_flow:
            raise SpecError("shared_flow", "the large-depth limit (separate weights) and the weight-shared flow "
                                           "are different models: declare one")
        if layers != 1 or rank != 1 or heads != 1 or tied is not True:
            raise SpecError("layers", "the large-depth limit is declared by its last layer only: layers = 1, "
                                      "rank = 1, heads = 1, tied = true (depth is set by tau)")
        if output != "attention":
            raise SpecError("output", "the large-depth limit observes the last attention matrix: output = 'attention'")
        depth_limit_tau = _param(depth_limit_tau, "tau", positive=True)
        if isinstance(depth_limit_tau, str) or isinstance(beta, str):
            raise SpecError("tau" if isinstance(depth_limit_tau, str) else "beta",
                            "must be a number in the large-depth limit: the mean-field mixing Mbar(tau) of the "
                            "first layers is computed when the model is derived")
        from .depth import check_limit

        check_limit(depth_limit_tau, float(beta), _int(tokens, "tokens", 1, 8), activation)
    T = _int(tokens, "tokens", 1, 8)
    L = _int(layers, "layers", 1, 6)
    ranks = [_int(r, "rank", 1, 8) for r in _per_layer(rank, "rank", L)]
    n_heads = [_int(h, "heads", 1, 8) for h in _per_layer(heads, "heads", L)]
    tieds = _per_layer(tied, "tied", L)
    for t in tieds:
        if not isinstance(t, bool):
            raise SpecError("tied", f"must be true or false, got {t!r}")
    skips = [_param(c, "skip") for c in _per_layer(skip, "skip", L)]
    acts = [_choice(a, "activation", ACTIVATIONS) for a in _per_layer(activation, "activation", L)]
    betas = [_param(b, "beta") for b in _per_layer(beta, "beta", L)]
    if readout is not None:
        if not isinstance(readout, list) or not readout:
            raise SpecError("readout", "must be a list of head weights (one per head)")
        if not isinstance(readout[0], list):
            readout = [readout] * L
        readouts = []
        for r, h in zip(_per_layer(readout, "readout", L), n_heads):
            if len(r) != h:
                raise SpecError("readout", f"needs one weight per head ({h}), got {len(r)}")
            readouts.append(tuple(_param(a, "readout") for a in r))
    else:
        readouts = [None] * L
    if T == 1 and any(a != "linear" for a in acts):
        raise SpecError("tokens", "a softmax or hardmax over one token is identically 1, so the weights of "
                                  "that layer carry no information; use tokens >= 2 (or activation = 'linear')")
    specs = tuple(
        LayerSpec(rank=r, heads=h, tied=t, skip=c, activation=a, beta=b, readout=ro)
        for r, h, t, c, a, b, ro in zip(ranks, n_heads, tieds, skips, acts, betas, readouts)
    )
    spec = AttentionSpec(
        tokens=T,
        layers=specs,
        output=_choice(output, "output", OUTPUTS),
        head_mode=_choice(head_mode, "head_mode", HEAD_MODES),
        noise=_param(noise, "noise", nonneg=True),
        name=_name(name),
        description=str(description),
        shared_flow=shared_flow,
        tau=_param(tau, "tau", positive=True),
        depth_limit_tau=depth_limit_tau,
        depth_steps=_int(depth_steps, "depth_steps", 1, 512),
    )
    check_values(spec, {})
    return spec


def check_values(spec: Spec, values: dict[str, float]) -> None:
    """Refuse models whose output carries no information or whose beta is out of range, once the
    numbers are known (declared in the file, or bound as ``values``: parameter name -> number).

    beta may be negative (attention then favours dissimilar tokens) but |beta| <= BETA_MAX.
    beta = 0 makes a layer's attention constant (uniform for softmax/hardmax, zero for linear),
    so that layer's weights carry no information: refused where it leaves the output constant
    (the last layer of an attention output, or every layer). Elsewhere the model is kept: the
    layer is simply not learnable (its overlap stays 0).
    """
    if not isinstance(spec, AttentionSpec):
        return
    betas = []
    for i, layer in enumerate(spec.layers):
        b = values.get(layer.beta) if isinstance(layer.beta, str) else layer.beta
        if b is not None and not abs(b) <= BETA_MAX:
            raise SpecError("beta", f"layer {i + 1}: |beta| must be <= {BETA_MAX:g}, got {b!r} (for the "
                                    "beta -> infinity limit use activation = 'hardmax')")
        betas.append(b)
    last_zero = betas[-1] == 0
    if (spec.output == "attention" and last_zero) or all(b == 0 for b in betas):
        where = "the last layer" if spec.output == "attention" and len(betas) > 1 else "every layer"
        raise SpecError("beta", f"beta = 0 in {where} makes the output y constant (uniform attention), so the "
                                "data carry no information; use beta != 0")


def make_smi(
    *,
    indices: int,
    tokens: int,
    link,
    parameters=(),
    noise=0.0,
    name: str = "model",
    description: str = "",
    activation: str = "linear",
) -> SMISpec:
    """Validated :class:`SMISpec`. ``link``: a string, or a (nested) list of strings.
    ``activation``: sigma along the rows of a matrix link (``linear``: none)."""
    p = _int(indices, "indices", 1, 16)
    T = _int(tokens, "tokens", 1, 8)
    params = tuple(_param(s, "parameters") for s in parameters)
    if any(not isinstance(s, str) for s in params):
        raise SpecError("parameters", "must be a list of parameter names")

    def as_tuple(x, depth=0):
        if isinstance(x, str):
            return x
        if isinstance(x, int | float) and not isinstance(x, bool):
            return repr(float(x))
        if isinstance(x, list | tuple) and x and depth < 2:
            return tuple(as_tuple(e, depth + 1) for e in x)
        raise SpecError("link", "must be an expression string or a list (or list of lists) of them")

    lk = as_tuple(link)
    if isinstance(lk, tuple) and isinstance(lk[0], tuple):
        if len({len(row) for row in lk}) != 1 or any(isinstance(e, tuple) for row in lk for e in row):
            raise SpecError("link", "a matrix link must be a list of equally long lists of strings")
    _choice(activation, "activation", ACTIVATIONS)
    if activation != "linear" and not (isinstance(lk, tuple) and isinstance(lk[0], tuple)):
        raise SpecError("activation", f"{activation!r} acts along the rows of a matrix link: "
                                      "write link as a list of lists")
    spec = SMISpec(
        indices=p,
        tokens=T,
        link=lk,
        parameters_=params,
        noise=_param(noise, "noise", nonneg=True),
        name=_name(name),
        description=str(description),
        activation=activation,
    )
    # parse now so that a bad link is reported at load time, naming the field
    from .parse import parse_link, index_symbol

    expr = parse_link(spec)
    # a link without any index is refused; an index absent from the link is kept (its posterior
    # is its prior, so its overlap stays 0: tests/test_reliability.py)
    if not any(index_symbol(k, t) in expr.free_symbols for k in range(p) for t in range(T)):
        raise SpecError("link", "does not depend on z[k, t]: y is constant and carries no information")
    return spec


def _name(name) -> str:
    if not isinstance(name, str) or not re.match(r"^[A-Za-z0-9_.-]+$", name):
        raise SpecError("name", f"must be letters, digits, '_', '-' or '.', got {name!r}")
    return name


# ----------------------------------------------------------------------------- TOML

_ATTENTION_KEYS = {
    "kind", "tokens", "layers", "rank", "heads", "tied", "skip", "activation", "beta",
    "readout", "output", "head_mode", "noise", "name", "description", "shared_flow", "tau", "depth_steps",
    "depth_limit",  # renamed: refused with a pointer to shared_flow and the attention_depth_limit kind
}
_DEPTH_LIMIT_KEYS = {"kind", "tokens", "activation", "beta", "tau", "noise", "name", "description"}
_SMI_KEYS = {"kind", "indices", "tokens", "link", "parameters", "noise", "name", "description", "activation"}


def from_dict(data: dict, *, default_name: str = "model") -> Spec:
    if "model" not in data or not isinstance(data["model"], dict):
        raise SpecError("model", "the file needs a [model] table")
    m = dict(data["model"])
    kind = m.get("kind", "attention")
    if kind in ("aim", "erm"):
        raise SpecError("kind", f"an {kind} model has no SMI derivation: run it with aimsym se|thresholds|amp|gd FILE "
                                "(or load it with aimsym.load)")
    _choice(kind, "kind", ("attention", "attention_depth_limit", "smi"))
    allowed = {"attention": _ATTENTION_KEYS, "attention_depth_limit": _DEPTH_LIMIT_KEYS, "smi": _SMI_KEYS}[kind]
    unknown = sorted(set(m) - allowed)
    if unknown:
        raise SpecError(unknown[0], f"unknown key for kind = {kind!r}; allowed: {', '.join(sorted(allowed))}")
    m.pop("kind", None)
    m.setdefault("name", default_name)
    try:
        if kind in ("attention", "attention_depth_limit"):
            if "tokens" not in m:
                raise SpecError("tokens", "required (an integer >= 1)")
            if kind == "attention_depth_limit":
                if "tau" not in m:
                    raise SpecError("tau", "required for kind = 'attention_depth_limit' (a number > 0)")
                m["depth_limit_tau"] = m.pop("tau")
            return make_attention(**m)
        for key in ("indices", "tokens", "link"):
            if key not in m:
                raise SpecError(key, "required for kind = 'smi'")
        return make_smi(**m)
    except TypeError as exc:  # pragma: no cover - guarded by the key check above
        raise SpecError("model", str(exc)) from None


def loads(text: str, *, default_name: str = "model") -> Spec:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError("toml", f"malformed TOML: {exc}") from None
    return from_dict(data, default_name=default_name)


def load(path: str | Path) -> Spec:
    path = Path(path)
    if not path.exists():
        bare = path.name == str(path) and path.suffix != ".toml"
        raise SpecError("model", f"no such file{' or bundled model' if bare else ''}: {path}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError("model", f"cannot read {path}: {exc}") from None
    return loads(text, default_name=re.sub(r"[^A-Za-z0-9_.-]", "_", path.stem))


def to_toml(spec: Spec) -> str:
    """TOML text that loads back to ``spec`` (per-layer lists where layers differ)."""

    def fmt(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, float):
            return repr(v)
        if isinstance(v, int):
            return str(v)
        if isinstance(v, tuple | list):
            return "[" + ", ".join(fmt(e) for e in v) + "]"
        raise TypeError(v)

    limit = isinstance(spec, AttentionSpec) and spec.depth_limit_tau is not None
    kind = "attention_depth_limit" if limit else spec.kind
    lines = ["[model]", f"kind = {fmt(kind)}", f"name = {fmt(spec.name)}"]
    if spec.description:
        lines.append(f"description = {fmt(spec.description)}")
    if limit:
        layer = spec.layers[0]
        lines += [f"tokens = {spec.tokens}", f"activation = {fmt(layer.activation)}", f"beta = {fmt(layer.beta)}",
                  f"tau = {fmt(spec.depth_limit_tau)}"]
    elif isinstance(spec, AttentionSpec):
        lines += [f"tokens = {spec.tokens}", f"layers = {len(spec.layers)}"]
        for key in ("rank", "heads", "tied", "skip", "activation", "beta"):
            vals = [getattr(layer, key) for layer in spec.layers]
            lines.append(f"{key} = {fmt(vals[0] if len(set(vals)) == 1 else vals)}")
        if any(layer.readout is not None for layer in spec.layers):
            lines.append(f"readout = {fmt([list(layer.head_weights()) for layer in spec.layers])}")
        lines += [f"output = {fmt(spec.output)}", f"head_mode = {fmt(spec.head_mode)}"]
        if spec.shared_flow:
            lines += ["shared_flow = true", f"tau = {fmt(spec.tau)}", f"depth_steps = {spec.depth_steps}"]
    else:
        lines += [f"indices = {spec.indices}", f"tokens = {spec.tokens}", f"link = {fmt(spec.link)}"]
        if spec.parameters_:
            lines.append(f"parameters = {fmt(list(spec.parameters_))}")
        if spec.activation != "linear":
            lines.append(f"activation = {fmt(spec.activation)}")
    lines.append(f"noise = {fmt(spec.noise)}")
    return "\n".join(lines) + "\n"


def resolve_values(spec: Spec, values: dict) -> dict[str, float]:
    """Map user keys (parameter names, or the field names skip/beta/noise) to parameters."""
    names = set(spec.parameters())
    fields: dict[str, set[str]] = {"skip": set(), "beta": set(), "noise": set()}
    if isinstance(spec, AttentionSpec):
        for layer in spec.layers:
            if isinstance(layer.skip, str):
                fields["skip"].add(layer.skip)
            if isinstance(layer.beta, str):
                fields["beta"].add(layer.beta)
    if isinstance(spec.noise, str):
        fields["noise"].add(spec.noise)
    out: dict[str, float] = {}
    for key, val in values.items():
        try:
            v = float(val)
        except (TypeError, ValueError):
            raise SpecError(key, f"expected a number, got {val!r}") from None
        if not math.isfinite(v):
            raise SpecError(key, f"must be finite, got {val!r}")
        if key in names:
            out[key] = v
        elif key in fields and fields[key]:
            for n in fields[key]:
                out[n] = v
        else:
            allowed = sorted(names | {k for k, s in fields.items() if s})
            raise SpecError(key, "not a symbolic parameter of this model; "
                                 f"allowed: {', '.join(allowed) if allowed else '(none: the model has no symbols)'}")
    return out


def bind(spec: Spec, values: dict[str, float]) -> Spec:
    """Replace symbolic parameters by numbers (keys as in :func:`resolve_values`)."""
    vals = resolve_values(spec, values)

    def sub(v):
        return vals.get(v, v) if isinstance(v, str) else v

    if isinstance(spec, AttentionSpec):
        layers = tuple(
            replace(layer, skip=sub(layer.skip), beta=sub(layer.beta),
                    readout=None if layer.readout is None else tuple(sub(a) for a in layer.readout))
            for layer in spec.layers
        )
        return replace(spec, layers=layers, noise=sub(spec.noise), tau=sub(spec.tau))
    return replace(spec, noise=sub(spec.noise))


def parse_assignments(items: list[str] | None) -> dict[str, float]:
    """``["skip=1", "beta=2.5"]`` -> ``{"skip": 1.0, "beta": 2.5}`` (CLI ``--set``)."""
    out: dict[str, float] = {}
    for item in items or ():
        if "=" not in item:
            raise SpecError("--set", f"expected name=value, got {item!r}")
        key, _, raw = item.partition("=")
        key = key.strip()
        try:
            val = float(raw)
        except ValueError:
            raise SpecError(key, f"expected a number, got {raw.strip()!r}") from None
        if not math.isfinite(val):
            raise SpecError(key, f"must be finite, got {raw.strip()!r}")
        out[key] = val
    return out
