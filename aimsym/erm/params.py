"""Validated parameters of the ERM problem (theory.md §8)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..errors import AimsymError

MODELS = ("factorised", "direct")
PENALTIES = {"factorised": ("pnn",), "direct": ("ridge", "snn")}
OUTPUTS = ("label", "sequence")
TARGET_FIELDS = ("target", "gamma", "groups")
MAX_GROUPS = 400


@dataclass(frozen=True)
class ERMParams:
    """tokens T; kappa0 target rank ratio; lam weight decay; Delta label noise (inside the
    softmax); beta / beta0 student / teacher inverse temperatures; model 'factorised' (W W^T,
    PSD nuclear norm 'pnn') or 'direct' (symmetric S, 'ridge' or symmetric nuclear norm 'snn');
    kappa student width r/d (None: no rank cap); output 'label' (sequence-to-label) or
    'sequence' (sequence-to-sequence; asymptotically identical); target 'wishart' (S* = W* W*^T /
    sqrt(r* d)) or 'power' (rank kappa0 <= 1, ``groups`` equal eigenvalue groups at c k^-gamma,
    same Q0 = 1 + kappa0; see aimsym.erm.target)."""

    tokens: int = 2
    kappa0: float = 0.5
    lam: float = 0.01
    Delta: float = 0.0
    beta: float = 1.0
    beta0: float = 1.0
    model: str = "factorised"
    penalty: str | None = None
    kappa: float | None = None
    output: str = "label"
    target: str = "wishart"
    gamma: float | None = None
    groups: int | None = None

    def __post_init__(self):
        def pos(name, allow_zero=False):
            v = getattr(self, name)
            ok = np.isfinite(v) and (v >= 0 if allow_zero else v > 0)
            if not ok:
                raise AimsymError(name, f"must be a finite number {'>=' if allow_zero else '>'} 0, got {v}")
        if not (isinstance(self.tokens, (int, np.integer)) and 2 <= self.tokens <= 8):
            raise AimsymError("tokens", f"must be an integer in 2..8, got {self.tokens}")
        for name in ("kappa0", "beta", "beta0"):
            pos(name)
        for name in ("lam", "Delta"):
            pos(name, allow_zero=True)
        if self.model not in MODELS:
            raise AimsymError("model", f"must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.penalty is None:
            object.__setattr__(self, "penalty", PENALTIES[self.model][0])
        if self.penalty not in PENALTIES[self.model]:
            raise AimsymError("penalty", f"for model {self.model!r} must be one of "
                              f"{', '.join(PENALTIES[self.model])}, got {self.penalty!r}")
        if self.kappa is not None:
            pos("kappa")
            if self.model != "factorised":
                raise AimsymError("kappa", "the student width applies to the factorised model only")
        if self.output not in OUTPUTS:
            raise AimsymError("output", f"must be one of {', '.join(OUTPUTS)}, got {self.output!r}")
        self._check_target()

    def _check_target(self):
        from .target import DEFAULT_GROUPS, TARGETS
        if self.target not in TARGETS:
            raise AimsymError("target", f"must be one of {', '.join(TARGETS)}, got {self.target!r}")
        if self.target == "wishart":
            for name in ("gamma", "groups"):
                if getattr(self, name) is not None:
                    raise AimsymError(name, "applies to target 'power' only")
            return
        g = self.gamma
        if g is None or not (isinstance(g, (int, float, np.floating, np.integer)) and np.isfinite(g) and g >= 0):
            raise AimsymError("gamma", f"target 'power' needs a finite exponent gamma >= 0, got {g}")
        if self.kappa0 > 1:
            raise AimsymError("kappa0", f"target 'power' has rank kappa0 d <= d: kappa0 must be <= 1, got {self.kappa0}")
        if self.groups is None:
            object.__setattr__(self, "groups", DEFAULT_GROUPS)
        if not (isinstance(self.groups, (int, np.integer)) and 1 <= self.groups <= MAX_GROUPS):
            raise AimsymError("groups", f"must be an integer in 1..{MAX_GROUPS}, got {self.groups}")
        object.__setattr__(self, "gamma", float(g))

    @property
    def law(self):
        """Spectral law of the target S* (aimsym.erm.target), None for the Wishart closed form."""
        if self.target == "wishart":
            return None
        from .target import make_law
        return make_law(self.target, self.kappa0, self.gamma, self.groups)

    @property
    def Q0(self) -> float:
        return 1.0 + self.kappa0

    @property
    def L(self) -> int:
        return self.tokens * (self.tokens + 1) // 2

    def alpha_bar(self, alpha):
        """Effective ratio alpha (T^2 + T - 2)/2 of the thresholds."""
        return alpha * (self.tokens**2 + self.tokens - 2) / 2

    def asdict(self) -> dict:
        out = asdict(self)
        if self.target == "wishart":  # the fields of the original model only (stable hashes)
            for k in TARGET_FIELDS:
                out.pop(k)
        return out
