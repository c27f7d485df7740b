"""Validated parameters of the ERM problem (theory.md §8)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..errors import AimsymError

MODELS = ("factorised", "direct")
PENALTIES = {"factorised": ("pnn",), "direct": ("ridge", "snn")}
OUTPUTS = ("label", "sequence")


@dataclass(frozen=True)
class ERMParams:
    """tokens T; kappa0 target rank ratio; lam weight decay; Delta label noise (inside the
    softmax); beta / beta0 student / teacher inverse temperatures; model 'factorised' (W W^T,
    PSD nuclear norm 'pnn') or 'direct' (symmetric S, 'ridge' or symmetric nuclear norm 'snn');
    kappa student width r/d (None: no rank cap); output 'label' (sequence-to-label) or
    'sequence' (sequence-to-sequence; asymptotically identical)."""

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
        return asdict(self)
