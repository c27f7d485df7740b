"""Spectral laws of the ERM target S* (theory.md §8) as Stieltjes transforms.

A law mu is described by its singular set (atoms and bulk intervals) and its Stieltjes
transform G(w) = int mu(s) / (w - s) ds with derivative G'(w), both vectorised over complex w
off the support (and real w outside the support).  ``aimsym.erm.freeconv`` convolves any such
law with a semicircle.

- ``WishartLaw(kappa0)``: S* = W* W*^T / sqrt(r* d), the law sqrt(kappa0) MP(1/kappa0) of
  theory.md §7 (atom 1 - kappa0 at 0 when kappa0 < 1), second moment Q0 = 1 + kappa0.
- ``PowerLaw(kappa0, gamma, groups)``: rank kappa0 d, the non-zero eigenvalues split into
  ``groups`` equal groups (each of kappa0 d / groups eigenvalues) at s_k = c k^(-gamma),
  k = 1..groups, with c fixed by the same normalisation Q0 = int s^2 dmu = 1 + kappa0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import AimsymError

TARGETS = ("wishart", "power")
DEFAULT_GROUPS = 40


@dataclass(frozen=True)
class WishartLaw:
    """sqrt(kappa0) MP(1/kappa0): G = 2 sqrt(k) / (P + sqrt(k) R), P = sqrt(k) w + 1 - k,
    R = sqrt(w - a) sqrt(w - b) (principal roots: analytic off [a, b], R ~ w at infinity)."""

    kappa0: float

    @property
    def edges(self) -> tuple[float, float]:
        s = np.sqrt(self.kappa0)
        return (s - 1.0) ** 2 / s, (s + 1.0) ** 2 / s

    @property
    def atoms(self) -> tuple[tuple[float, float], ...]:
        return ((0.0, 1.0 - self.kappa0),) if self.kappa0 < 1.0 else ()

    @property
    def bulks(self) -> tuple[tuple[float, float], ...]:
        return (self.edges,)

    @property
    def Q0(self) -> float:
        return 1.0 + self.kappa0

    @property
    def mean(self) -> float:
        return float(np.sqrt(self.kappa0))

    def _GR(self, w):
        w = np.asarray(w, dtype=complex)
        a, b = self.edges
        s = np.sqrt(self.kappa0)
        R = np.sqrt(w - a) * np.sqrt(w - b)
        return 2.0 * s / (s * w + 1.0 - self.kappa0 + s * R), R, w

    def G(self, w):
        return self._GR(w)[0]

    def dG(self, w):
        # differentiating the quadratic: G' = -G^2 (1 + R') / 2, R' = (2w - a - b) / (2R)
        G, R, w = self._GR(w)
        a, b = self.edges
        return -0.5 * G * G * (1.0 + (2.0 * w - a - b) / (2.0 * R))


@dataclass(frozen=True)
class AtomicLaw:
    """A finite mixture of point masses sum_k p_k delta_{s_k}."""

    locations: tuple[float, ...]
    masses: tuple[float, ...]
    _s: np.ndarray = field(init=False, repr=False, compare=False)
    _p: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        s = np.asarray(self.locations, float)
        p = np.asarray(self.masses, float)
        if s.shape != p.shape or s.ndim != 1 or not np.all(p > 0) or abs(p.sum() - 1) > 1e-12:
            raise ValueError("AtomicLaw needs matching locations and positive masses summing to 1")
        order = np.argsort(s)
        object.__setattr__(self, "_s", s[order])
        object.__setattr__(self, "_p", p[order])

    @property
    def atoms(self):
        return tuple(zip(self._s.tolist(), self._p.tolist()))

    @property
    def bulks(self):
        return ()

    @property
    def Q0(self) -> float:
        return float(np.sum(self._p * self._s**2))

    @property
    def mean(self) -> float:
        return float(np.sum(self._p * self._s))

    def G(self, w):
        w = np.asarray(w, dtype=complex)
        return np.sum(self._p / (w[..., None] - self._s), axis=-1)

    def dG(self, w):
        w = np.asarray(w, dtype=complex)
        return -np.sum(self._p / (w[..., None] - self._s) ** 2, axis=-1)


def power_law(kappa0: float, gamma: float, groups: int = DEFAULT_GROUPS) -> AtomicLaw:
    """Rank kappa0 (<= 1), equal groups at s_k = c k^(-gamma), k = 1..groups, atom 1 - kappa0 at 0,
    c such that int s^2 dmu = 1 + kappa0."""
    k = np.arange(1, groups + 1, dtype=float)
    shape = k ** (-gamma)
    c = np.sqrt((1.0 + kappa0) / (kappa0 / groups * np.sum(shape**2)))
    locs = list(c * shape)
    masses = [kappa0 / groups] * groups
    if kappa0 < 1.0:
        locs.append(0.0)
        masses.append(1.0 - kappa0)
    p = np.asarray(masses)
    return AtomicLaw(tuple(locs), tuple((p / p.sum()).tolist()))


def make_law(target: str, kappa0: float, gamma: float | None = None, groups: int | None = None):
    """The target law from the ERMParams fields."""
    if target == "wishart":
        return WishartLaw(float(kappa0))
    if target == "power":
        return power_law(float(kappa0), float(gamma), int(groups or DEFAULT_GROUPS))
    raise AimsymError("target", f"must be one of {', '.join(TARGETS)}, got {target!r}")
