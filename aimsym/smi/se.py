"""Bayes-optimal state evolution (theory section 4) for any model with a denoiser.

One step, Q -> Q_hat -> Q:

    Q_hat = alpha E[ sum_t g_out[:, t] g_out[:, t]^T ],  g_out = g_out(y, Q^{1/2} xi, I - Q),
            Z = Q^{1/2} xi + (I - Q)^{1/2} eta,  y = g(Z) (+ sqrt(Delta) noise)
    Q     = (Q_hat + Lambda) (I + Q_hat + Lambda)^{-1},  Lambda = lam * diag(side-information block)

Expectations. (xi, eta[, noise]) are drawn by scrambled Sobol points mapped through the normal
quantile; ``replicas`` independently scrambled copies give standard errors (standard error of
the replica means). The same points are reused at every iteration (common random numbers), so
the iterated map is deterministic and smooth in Q and the iteration converges to the fixed
point of the sampled map. A noiseless discrete link (sign, hardmax) is not sampled in y: the map
sums over its finite output set with weights Z_out(y; omega, V) (:mod:`aimsym.smi.outputs`),
since a sampled y flips as Q moves and makes the map jump.

Free entropy (sign: larger is better, the Bayes-optimal fixed point maximises it):

    Phi(Q, Q_hat) = -1/2 Tr(Q Q_hat) + 1/2 Tr(Q_hat) - 1/2 log det(I + Q_hat) + alpha Psi_out(Q),
    Psi_out(Q)    = E_{xi, eta} log_z_out(y; Q^{1/2} xi, I - Q)

with ``log_z_out`` exactly as the denoiser normalises it (see :mod:`aimsym.denoise.channel`). For a
deterministic attention link that normalisation drops the y <-> h Jacobian; its expectation is
the same at every Q (y has the prior law), so Phi is defined up to a Q-independent constant:
compare free-entropy *differences* (e.g. uninformed vs informed fixed points at one alpha).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass, field, replace

import numpy as np
from scipy.stats import norm, qmc

from ..denoise.chamber import certified_default
from ..denoise.channel import MODAL_ONLY
from ..denoise.output import mean_target_met
from ..errors import AimsymError, ConvergenceWarning
from ..provenance import provenance
from .outputs import MASS_TOL, output_set
from .outputs import weights as output_weights
from .passes import Passes, as_passes, channel_key

# Gauss-Hermite nodes per reduced dimension used by default in SE (cheaper than the denoiser's
# own defaults). In 2-D (two layers, T = 2) the denoiser's polar sector rule is used where it
# applies, at (8, 24) instead of its default (18, 48): alpha_c agrees with (18, 48) to < 1e-4 at
# skip 1e-6, 0.01 and 1 (same QMC points) at 1/4 of the cost, whereas plain Gauss-Hermite 16
# is biased by up to 12 % at small skip (0.242 vs 0.274 at skip 1e-6; 0.1840 vs 0.1845 at skip 1).
SE_NODES = {1: 40, 2: 24, 3: 10, 4: 7}
# a fixed rule left at its default (generic noisy path) is refined up to these nodes per dimension
# while its quadrature error dominates the SE's statistical error (state_evolution)
SE_MAX_NODES = {1: 256, 2: 64}
SE_POLAR = (8, 24)
# the SE's denoiser controls its error (refining samples whose estimate exceeds SE_TOL,
# relative to the size of g_out, dg_out) where the denoiser supports it (exact path), and
# rescues the rest with the mode-centred rule: near V = 0 with anisotropic V the fixed rule
# manufactures information (E[sum_t g_t^T V g_t] = 2.39 where the rank identity allows 2),
# which moved perfect recovery below the counting bound. SE_TOL is two orders below the SE's
# relative replica errors (>= 1e-3 at the default samples)
SE_TOL = 1e-4
# exact paths served by the mode-centred rule alone (channel.MODAL_ONLY: an untied first layer):
# its tol follows the SE's statistical error, SE_STAT_SHARE / sqrt(samples), up to SE_MODAL_TOL
# (its levels differ ~10x in error and ~5x in cost: at V = I two untied layers cost 1.7 s per
# sample at 1e-3 and 0.25 s at 1e-2, docs/denoiser.md), and where the rule stops above tol the
# adaptive cubature gets SE_MODAL_REGIONS (at k = 5 more regions did not lower its estimates)
SE_MODAL_TOL = 1e-2
SE_MODAL_REGIONS = 2_000
MAX_CONTROLLED_DIM = 2
# reduced dimension >= 3 with attention blocks: the certified rule (chamber rule, modal fast path,
# adaptive cubature) at a tol set by the SE's own statistical error. A relative error eps per sample
# moves Q_hat by at most 2 eps; Q_hat's relative replica error is ~2 / sqrt(samples) (g^2 is
# heavy-tailed), so eps = SE_STAT_SHARE / sqrt(samples) keeps the quadrature error near a tenth of
# the statistical one (the result reports the actual ratio: diagnostics.quadrature_to_statistical)
SE_STAT_SHARE = 0.1
SE_TOL_MAX = 1e-3
# and its budget of adaptive-cubature regions per sample: the samples the chamber rule leaves above
# tol lie in the far tail (the observation near the edge of what the attention can reach); there
# 100 000 regions (the denoiser's default) took 5-6 s per sample without improving on the chamber
# rule's estimate, 2 000 take ~1.2 s with the same estimate (docs/performance.md); and the chamber
# rule's budget of node combinations per sample: every level of two blocks of T = 2 (the finest,
# (22, 48), is 6336^2 = 4.0e7). Where one layer is nearly known the finer levels settle the
# far-tail samples (bench.denoiser --budget, docs/performance.md: three layers at Q_33 = 0.995,
# 11 -> 3 of 64 above tol and mean estimate 1.9e-2 -> 1.5e-3 at 2.5x the time of a budget of 6e6,
# which stopped at level 4). Samples left above tol are counted and their estimates folded into
# the standard errors.
SE_CERTIFIED_REGIONS = 2_000
SE_CERTIFIED_COMBINATIONS = 41_000_000
# where every direction of V is below MODAL_BELOW (near perfect recovery) the SE's denoiser is the
# mode-centred rule at SE_TOL, for every reduced dimension: the posterior there is close to its
# Laplace mixture, which the rule's fast path integrates at ~0.3 ms per sample (k = 2, 3), while
# the polar and fixed rules grow costly or biased as V -> 0
MODAL_BELOW = 1e-2
# V = I - Q is clipped at OVERLAP_EPS (clip_overlap), so 1 - Q_kk below PERFECT_RESOLUTION is not
# resolved: such an entry is reported as perfect recovery, not as a number
OVERLAP_EPS = 1e-9
PERFECT_RESOLUTION = 1e-8
# convergence is relative to min(Q_kk, 1 - Q_kk), floored at LOWER_FLOOR near Q = 0 (where the
# uninformed fixed point sits exactly at 0) and at PERFECT_RESOLUTION near Q = I
LOWER_FLOOR = 0.01
# perfect recovery by the homogeneity of the map near Q = I (see _iterate): PERFECT_STEPS steps
# below PERFECT_NEAR, each contracting every 1 - Q_kk by at most PERFECT_RATE, at rates that
# change by at most PERFECT_RATE_SPREAD from step to step (the linear regime of an attracting Q = I)
PERFECT_NEAR = 2e-2
PERFECT_RATE = 0.98
PERFECT_RATE_SPREAD = 0.02
PERFECT_STEPS = 5
# ... or, closer to the local stability of Q = I (rates up to PERFECT_RATE_SLOW: two layers at
# skip 1, alpha = 1.075, ~0.985 per step, 500 steps short of the resolution), PERFECT_STEPS_SLOW
# steps; on either path the Aitken limit of 1 - Q_kk must stay below PERFECT_LIMIT of 1 - Q_kk
# (a fixed point 1 - Q* below that share of 1 - Q where the window sits is not told from I)
PERFECT_RATE_SLOW = 0.995
PERFECT_STEPS_SLOW = 10
PERFECT_LIMIT = 0.01
PERFECT_NEAR_SLOW = 0.05  # (every 1 - Q_kk below it)
# after the jump, PERFECT_CONFIRM steps along which no 1 - Q_kk grows confirm Q = I (stable at the
# clip): the iteration ends there (the verdict does not wait for V's shape to settle under the clip)
PERFECT_CONFIRM = 3
# escape from Q_kk ~ 0 (a layer just above its weak-recovery threshold, from an uninformed or warm
# start or a re-seed): there the map is linear in the small entry, which grows by a steady factor
# rho per step (1.07-1.09 for layer 1 of three layers at alpha = 0.9: some 60 steps, each a minute,
# from 1e-4 to 1e-2). After ESCAPE_STEPS steps at rates above ESCAPE_RATE that change by at most
# ESCAPE_SPREAD (rho - 1), the entry jumps to ESCAPE_TO (its row and column scaled alike), where the
# iteration takes over: the same path along the unstable direction, without the linear stretch
ESCAPE_FROM = 2e-3
ESCAPE_TO = LOWER_FLOOR
ESCAPE_RATE = 1.005
ESCAPE_SPREAD = 0.1
ESCAPE_STEPS = 4
# the re-seeding's verdict "stable" (see _reseed): every re-seeded entry shrinking by a factor of at
# most RESEED_DECAY per step for RESEED_STEPS steps (the linear regime of a stable zero; each
# further step until the iteration converges, ~20 at rates ~0.7, is a map for nothing)
RESEED_DECAY = 0.9
RESEED_STEPS = 4
# convergence within the statistical error: the iteration (and the Newton polish) also stops where
# every entry's remaining distance is below STAT_STOP of its fixed point's replica error (near a
# transition, where the map contracts critically slowly and that error is large, the relative tol
# alone asks for digits far below it); the distance left is folded into Q_stderr
STAT_STOP = 0.1
# ... on a steady contraction only: STAT_STEADY steps at rates in [STAT_RATE, 1) within STAT_RATE_SPREAD
STAT_STEADY = 4
STAT_RATE = 0.5
STAT_RATE_SPREAD = 0.1
# the coarse pass hands over to the full rule once some 1 - Q_kk is below this (see state_evolution)
COARSE_NEAR_ONE = 0.05
# a Newton step in the iteration (_iterate, _newton_jump) after NEWTON_AFTER steps shrinking at a
# steady rate (spread <= NEWTON_RATE_SPREAD) of at least NEWTON_RATE, on at most NEWTON_MAX_FREE
# learned entries (its Jacobian costs that many maps), at most NEWTON_TRIES attempts per iteration,
# NEWTON_AFTER steps apart (an attempt that is not a local correction costs its maps for nothing)
NEWTON_AFTER = 4
# a Newton step (newton_polish, _newton_jump) is taken only as a local correction: every diagonal
# entry moves by at most LOCAL_STEP of its error scale (farther, it is left to the iteration)
LOCAL_STEP = 0.5
NEWTON_RATE = 0.6
NEWTON_RATE_SPREAD = 0.1
NEWTON_MAX_FREE = 3
NEWTON_TRIES = 8


# ----------------------------------------------------------------------------- sampling
def normal_points(dim: int, samples: int, replicas: int, seed) -> np.ndarray:
    """Randomised QMC standard normals: (replicas, samples // replicas, dim), scrambled Sobol."""
    if replicas < 2:
        raise AimsymError("replicas", f"need at least 2 replicas for a standard error, got {replicas}")
    per = samples // replicas
    if per < 2:
        raise AimsymError("samples", f"need at least 2 points per replica, got {samples} for {replicas} replicas")
    m = int(np.ceil(np.log2(per)))
    seeds = np.random.SeedSequence(seed).spawn(replicas)
    out = np.empty((replicas, per, dim))
    for r, s in enumerate(seeds):
        u = qmc.Sobol(dim, scramble=True, seed=np.random.default_rng(s)).random_base2(m)[:per]
        out[r] = norm.ppf(np.clip(u, 1e-15, 1 - 1e-15))
    return out


def mean_and_stderr(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x: (replicas, ...) replica means -> (mean, standard error of the mean)."""
    R = x.shape[0]
    return x.mean(axis=0), x.std(axis=0, ddof=1) / np.sqrt(R)


# ----------------------------------------------------------------------------- matrices
def sym(A: np.ndarray) -> np.ndarray:
    return 0.5 * (A + np.swapaxes(A, -1, -2))


def clip_overlap(Q: np.ndarray, eps: float = OVERLAP_EPS) -> np.ndarray:
    """Project a symmetric matrix onto 0 <= Q <= (1 - eps) I (eigenvalue clipping)."""
    w, U = np.linalg.eigh(sym(Q))
    return sym((U * np.clip(w, 0.0, 1.0 - eps)) @ U.T)


def sqrt_psd(Q: np.ndarray) -> np.ndarray:
    w, U = np.linalg.eigh(sym(Q))
    return sym((U * np.sqrt(np.clip(w, 0.0, None))) @ U.T)


def side_matrix(p: int, lam: float, block=None) -> np.ndarray:
    """Lambda = lam on the diagonal of ``block`` (indices; all of them if None)."""
    d = np.zeros(p)
    d[list(range(p)) if block is None else list(block)] = lam
    return np.diag(d)


def q_from_q_hat(Q_hat: np.ndarray, Lam: np.ndarray) -> np.ndarray:
    """Gaussian prior update Q = (Q_hat + Lambda)(I + Q_hat + Lambda)^{-1} (symmetrised)."""
    A = Q_hat + Lam
    p = A.shape[-1]
    return sym(np.eye(p) - np.linalg.inv(np.eye(p) + A))


# ----------------------------------------------------------------------------- the map
@dataclass
class Channel:
    """The model, its denoiser and the fixed expectation points of one SE run."""

    model: object
    den: object
    points: np.ndarray  # (R, n, 2 p T [+ noise dims])
    # the denoiser of the last call (``den`` or the mode-centred rule near V = 0)
    used: object = field(default=None, init=False)
    on_pass: object = None  # called with the number of points after every denoiser pass (progress display)
    passes: Passes | None = None  # denoiser passes kept on disk (a stopped run resumes; smi/passes.py)
    _pass_key: str | None = field(default=None, init=False, repr=False, compare=False)  # (of den and points)

    @property
    def p(self):
        return self.model.p

    @property
    def T(self):
        return self.model.tokens

    def subset(self, fraction: int) -> "Channel":
        """The first 1/fraction of every replica's points (a coarser rule, same denoiser)."""
        n = max(self.points.shape[1] // fraction, 2)
        return self.with_points(self.points[:, :n])

    def with_points(self, points: np.ndarray) -> "Channel":
        """The same denoiser (and progress display and kept passes) at other points."""
        return replace(self, points=points)

    def with_denoiser(self, den) -> "Channel":
        """The same points (and progress display and kept passes) with another denoiser."""
        return replace(self, den=den)

    def split(self):
        p, T = self.p, self.T
        R, n, _ = self.points.shape
        xi = self.points[..., : p * T].reshape(R, n, p, T)
        eta = self.points[..., p * T: 2 * p * T].reshape(R, n, p, T)
        noise = self.points[..., 2 * p * T:]
        return xi, eta, noise

    @property
    def uses_observation(self) -> bool:
        """True when the denoiser is fed the reduced observation h = model.observation(Z)
        instead of y = g(Z): noise-free models with an exact reduction (attention links). Same
        posterior (h is a function of y and conversely), but exact where the output softmax
        underflows to exact zeros (large skip), where y itself is rejected."""
        return uses_observation(self.model, self.den)

    def omega_and_v(self, Q: np.ndarray):
        """(omega, V) at overlap Q for every point: omega = Q^{1/2} xi (R, n, p, T), V = I - Q
        (Q clipped)."""
        Qc = clip_overlap(Q)
        return sqrt_psd(Qc) @ self.split()[0], np.eye(self.p) - Qc

    def observe(self, Q: np.ndarray):
        """(omega, V, obs) at overlap Q for every point: omega (R, n, p, T); obs is y (R, n, *out)
        or, if :attr:`uses_observation`, the reduced observation h (R, n, n_obs)."""
        _, eta, noise = self.split()
        omega, V = self.omega_and_v(Q)
        Z = omega + sqrt_psd(V) @ eta
        if self.uses_observation:
            return omega, V, self.model.observation(Z)
        y = self.model.link(Z)
        if self.model.noise > 0:
            y = y + np.sqrt(self.model.noise) * noise.reshape(y.shape)
        return omega, V, y

    @property
    def outputs(self) -> np.ndarray | None:
        """The finite output set of a noiseless discrete link (the SE sums over it instead of
        sampling y: :mod:`aimsym.smi.outputs`); None for other links."""
        return output_set(self.model)

    def denoise(self, Q: np.ndarray):
        """Denoiser output at every point at overlap Q (flattened batch R * n). Samples whose
        error estimate stays above the denoiser's tol are recomputed by the mode-centred rule
        (:func:`rescue`)."""
        R, n = self.points.shape[:2]
        omega, V, y = self.observe(Q)
        om = omega.reshape(R * n, self.p, self.T)
        if self.uses_observation:
            args, kw = (None, om, V), {"obs": y.reshape(R * n, -1)}
        else:
            args, kw = (y.reshape(R * n, *y.shape[2:]), om, V), {}
        return self._run(Q, args, kw, ""), R, n

    def denoise_outputs(self, Q: np.ndarray):
        """The denoiser at every point and every output of :attr:`outputs` (K of them), as a batch
        ordered (R, K, n): returns (out, R, n, K); sum over y with weights exp(log_z_out)."""
        Y = self.outputs
        K = Y.shape[0]
        R, n = self.points.shape[:2]
        omega, V = self.omega_and_v(Q)
        om = np.broadcast_to(omega[:, None], (R, K, n, self.p, self.T)).reshape(R * K * n, self.p, self.T)
        y = np.broadcast_to(Y[None, :, None], (R, K, n) + Y.shape[1:]).reshape((R * K * n,) + Y.shape[1:])
        return self._run(Q, (np.ascontiguousarray(y), np.ascontiguousarray(om), V), {}, "|outputs"), R, n, K

    def _run(self, Q, args, kw, key_suffix: str):
        """One denoiser pass (kept in, or replayed from, :attr:`passes`)."""
        V = np.eye(self.p) - clip_overlap(Q)
        modal = _modal(self.model, SE_TOL) if np.linalg.eigvalsh(V).max() <= MODAL_BELOW else None
        batch = self.points.shape[0] * self.points.shape[1]  # (progress counts expectation points)
        key = None
        if self.passes is not None:
            if self._pass_key is None:
                self._pass_key = channel_key(self.model, self.den, self.points)
            key = self._pass_key + key_suffix
            out = self.passes.load(key, Q)
            if out is not None:  # made before (a resumed run): the same bits as computing it
                self.used = modal or self.den
                if self.on_pass is not None:
                    self.on_pass(batch)
                return out
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            out = (modal or self.den)(*args, **kw)
            if modal is not None:
                out = _refill_non_finite(out, self.den, args, kw)
        if modal is None:
            out = rescue(self.model, self.den, out, args, kw)
        self.used = modal or self.den
        _rewarn(caught, out, getattr(self.used, "tol", None), getattr(self.used, "mean_tol", None))
        if self.passes is not None:
            self.passes.save(key, Q, out)
        if self.on_pass is not None:
            self.on_pass(batch)
        return out


def _modal(model, tol):
    """The mode-centred denoiser (``rule='modal'``) of a model at tol, cached per model; None
    where the model has no such path."""
    key = (model.hash(), tol)
    if key not in _MODAL:
        try:
            _MODAL[key] = model.denoiser(rule="modal", tol=tol)
        except AimsymError:
            _MODAL[key] = None
    return _MODAL[key]


_MODAL: dict = {}


def rescue(model, den, out, args, kw):
    """Recompute, with the mode-centred rule at the same tol, the samples whose error estimate
    exceeds ``den.tol``, and keep each new value where its estimate is the smaller. Near V = 0
    with one layer nearly known the polar rule cannot resolve the posterior's ridge (V = diag(1e-2,
    1e-6), two layers T = 2: 1278 of 2048 samples above 1e-6, E[sum_t g^T V g] = 2.39 where the
    rank identity allows 2; with the rescue 1.98)."""
    tol = getattr(den, "tol", None)
    err = getattr(out, "error", None)
    if tol is None or err is None or getattr(den, "rule", "auto") == "modal" or \
            getattr(den, "dim", 0) > MAX_CONTROLLED_DIM:
        return out
    bad = np.flatnonzero(~(np.asarray(err).ravel() <= tol))
    if bad.size == 0:
        return out
    modal = _modal(model, tol)
    if modal is None:
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        o2 = _call_subset(modal, args, kw, bad)
    better = np.asarray(o2.error) < np.asarray(err).ravel()[bad]
    idx = bad[better]
    for name in ("g_out", "dg_out", "log_z_out", "ess", "error"):
        getattr(out, name)[idx] = getattr(o2, name)[better]
    return out


def _call_subset(den, args, kw, idx):
    """``den`` on the samples idx of a flattened call (args = (y or None, omega, V), kw: obs)."""
    y, om, V = args
    sub_kw = {k: v[idx] for k, v in kw.items()}
    return den(None if y is None else y[idx], om[idx], V if V.ndim == 2 else V[idx], **sub_kw)


def _refill_non_finite(out, den, args, kw):
    """Samples the mode-centred rule returned non-finite (its Laplace scale overflowed in a far
    tail: seen once in 8192 points for y = z1 z2 near V = 0) are recomputed by the model's own
    rule; its error estimate goes with them into the diagnostics."""
    n = out.log_z_out.size
    bad = np.flatnonzero(~(np.isfinite(out.g_out.reshape(n, -1)).all(axis=1)
                           & np.isfinite(out.dg_out.reshape(n, -1)).all(axis=1) & np.isfinite(out.log_z_out.ravel())))
    if bad.size == 0:
        return out
    o2 = _call_subset(den, args, kw, bad)
    for name in ("g_out", "dg_out", "log_z_out", "ess"):
        getattr(out, name).reshape(n, -1)[bad] = getattr(o2, name).reshape(bad.size, -1)
    if getattr(out, "error", None) is not None:
        out.error.reshape(n)[bad] = np.inf if getattr(o2, "error", None) is None else np.asarray(o2.error).ravel()
    return out


def _rewarn(caught, out, tol, mean_tol=None) -> None:
    """Warnings of the denoiser call, with its 'did not reach tol' count replaced by the count
    after :func:`rescue`; none where the batch's mean estimate meets ``mean_tol`` (the samples
    left above tol were stopped there on purpose; their estimates are in the diagnostics)."""
    for w in caught:  # (the per-chunk counts of both kinds are summed up below, once per pass)
        if "did not reach tol" not in str(w.message) and "heavy-tailed importance" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    err = getattr(out, "error", None)
    if tol is not None and err is not None:
        missed = int(np.sum(~(np.asarray(err) <= tol)))
        uncontrolled = int(np.sum(np.isinf(np.asarray(err))))
        why = f"; {uncontrolled} not controlled (no estimate, e.g. heavy-tailed weights)" if uncontrolled else ""
        if missed and not mean_target_met(err, mean_tol):
            warnings.warn(f"denoiser: {missed} of {np.size(err)} samples did not reach tol={tol:g} even with "
                          f"the mode-centred rule (largest estimated error {np.nanmax(err):.1e}{why})",
                          RuntimeWarning, stacklevel=3)


def uses_observation(model, den) -> bool:
    if model.noise > 0 or getattr(getattr(den, "kernels", None), "PATH", None) == "halfspace":
        return False
    if not hasattr(model, "observation") or not hasattr(model, "has_observation"):
        return False  # duck-typed models (e.g. closed-form stand-ins in tests): y only
    return model.has_observation


def make_channel(model, *, samples: int, replicas: int, seed, nodes=None, extra_dims: int = 0,
                 polar=None, checkpoint=None) -> Channel:
    """The SE's expectation points and denoiser; ``checkpoint``: a folder keeping its passes."""
    den = model.denoiser(**denoiser_accuracy(model, nodes, polar, samples=samples))
    n_out = int(np.prod(model.output_shape)) if model.noise > 0 else 0
    dim = 2 * model.p * model.tokens + n_out + extra_dims
    return Channel(model, den, normal_points(dim, samples, replicas, seed), passes=as_passes(checkpoint))


def se_tol(samples: int | None) -> float:
    """Denoiser tol of the certified rule in SE (k >= 3): SE_STAT_SHARE / sqrt(samples), at most
    SE_TOL_MAX."""
    return SE_TOL_MAX if not samples else min(SE_TOL_MAX, SE_STAT_SHARE / float(np.sqrt(samples)))


def modal_only_tol(samples: int | None) -> float:
    """Denoiser tol in SE on the paths served by the mode-centred rule alone:
    SE_STAT_SHARE / sqrt(samples), at most SE_MODAL_TOL."""
    return SE_MODAL_TOL if not samples else min(SE_MODAL_TOL, SE_STAT_SHARE / float(np.sqrt(samples)))


def denoiser_accuracy(model, nodes=None, polar=None, samples: int | None = None) -> dict:
    """Denoiser options used by SE: ``nodes`` (Gauss-Hermite per dimension) or the SE default for
    the reduced dimension; ``polar`` (angle nodes per sector, radial nodes) or SE_POLAR in 2-D
    (ignored by the denoiser where the polar rule does not apply); for k >= 3 models with attention
    blocks (k = 2 without the polar rule) and no explicit ``nodes``, the certified rule at
    ``se_tol(samples)``."""
    dim = int(model.kernels.INTEGRAL_DIM) if hasattr(model, "kernels") else 0
    if nodes is None and hasattr(model, "kernels") and certified_default(model.kernels):
        # the SE's quadrature error is a mean over its points: the far-tail samples stop refining
        # once the batch's mean estimate meets the same tol (docs/performance.md, "The SE's budgets")
        return {"rule": "modal", "tol": se_tol(samples), "max_regions": SE_CERTIFIED_REGIONS,
                "max_combinations": SE_CERTIFIED_COMBINATIONS, "mean_tol": se_tol(samples)}
    out = {}
    if nodes is not None:
        out["nodes"] = int(nodes)
    elif dim in SE_NODES:
        out["nodes"] = SE_NODES[dim]
    if dim == 2:
        out["polar"] = tuple(int(v) for v in (polar or SE_POLAR))
    # error control where it is affordable: reduced dimension 1-2 (polar and Gauss-Hermite rules,
    # rescued by the mode-centred rule); at k >= 3 the mode-centred rule is too slow per sample
    # (docs/tuning.md) and the SE runs the fixed rule, its error unestimated (the result's
    # diagnostics say so)
    path = getattr(getattr(model, "kernels", None), "PATH", "")  # (test doubles have no kernels)
    if path in MODAL_ONLY:
        # only the mode-centred rule carries a marginalised block: its tol follows the SE's Monte
        # Carlo error (a few % at hundreds of points), with a small adaptive budget
        out = {"tol": modal_only_tol(samples), "max_regions": SE_MODAL_REGIONS, "mean_tol": modal_only_tol(samples)}
    elif path == "hardmax-wedge-mixed":
        # the adaptive rule in u with its own estimate, to the SE's share of its statistical error
        out["tol"] = se_tol(samples)
    elif 0 < dim <= MAX_CONTROLLED_DIM and path not in ("noisy", "halfspace", "hardmax-wedge"):
        out["tol"] = SE_TOL
    return out


def denoised(ch: Channel, Q: np.ndarray):
    """The denoiser at overlap Q as (out, R, n, W): out holds R * n samples; W (R, n) weighs them
    (None: plain means). For a discrete link the samples are (point, output) pairs, n = K * points,
    W = K * P(y | omega, V), so that a plain mean over n of W f is E_y[f] at each point."""
    if ch.outputs is None:
        out, R, n = ch.denoise(Q)
        return out, R, n, None
    out, R, n, K = ch.denoise_outputs(Q)
    w = output_weights(out.log_z_out).reshape(R, K * n)
    return out, R, K * n, K * w


def output_sum(W: np.ndarray, K: int) -> dict:
    """Diagnostics of the sum over a discrete link's K outputs: the smallest total probability of
    an expectation point (1 when the output set is complete), with a warning below 1 - MASS_TOL."""
    R = W.shape[0]
    mass = float((W.reshape(R, K, -1).sum(axis=1) / K).min())
    if mass < 1.0 - MASS_TOL:
        warnings.warn(f"SE sum over the outputs: an expectation point has total output probability {mass:.6g} "
                      f"< 1 (an output missing from the set read from the link, or the denoiser's error on P(y | omega, V))", RuntimeWarning, stacklevel=3)
    return {"outputs": K, "output_mass_min": mass,
            "output_note": f"exact sum over the link's {K} outputs (y not sampled: the map is smooth in Q)"}


def _weighted_mean(W, x):
    """Mean over axis 1 of x (R, n, ...), weighted by W (R, n) (None: plain); impossible outputs
    (W = 0) count 0 whatever their (non-finite) denoiser values."""
    if W is None:
        return x.mean(axis=1)
    Wb = W.reshape(W.shape + (1,) * (x.ndim - 2))
    return (Wb * np.where(Wb > 0, x, 0.0)).mean(axis=1)


def se_map(ch: Channel, Q: np.ndarray, alpha: float, *, diagnostics: bool = False):
    """One SE output step at Q: replica values of Q_hat (R, p, p) and of Psi_out (R,).
    ``diagnostics``: also a dict with the Nishimori residual and the denoiser's error estimate."""
    out, R, n, W = denoised(ch, Q)
    g = out.g_out.reshape(R, n, ch.p, ch.T)
    gg_r = _weighted_mean(W, np.einsum("rnkt,rnlt->rnkl", g, g))
    Q_hat_r = alpha * gg_r
    psi_r = _weighted_mean(W, out.log_z_out.reshape(R, n))
    _check_finite(Q_hat_r, "Q_hat")
    if not diagnostics:
        return sym(Q_hat_r), psi_r
    dg = out.dg_out.reshape(R, n, ch.p, ch.T, ch.p, ch.T)
    summary = quadrature_summary(out, ch.used or ch.den)
    if W is not None:
        summary.update(output_sum(W, ch.outputs.shape[0]))
    err = getattr(out, "error", None)
    finer = finer_rule(ch.model, ch.used or ch.den) if err is None else None
    if finer is not None:  # a fixed rule: its error per sample against the rule with twice the nodes
        from ..denoise.output import difference

        fine = denoised(replace(ch, den=finer, on_pass=None), Q)[0]
        err = difference(out.g_out, out.dg_out, fine.g_out, fine.dg_out, out.log_z_out, fine.log_z_out)
        if W is not None:
            err = np.where(W.ravel() > 0, err, 0.0)
        summary.update(quadrature_error_max=float(np.max(err)), quadrature_error_median=float(np.median(err)),
                       quadrature_note="fixed rule: its error estimated against twice its nodes (at the fixed point)")
    return sym(Q_hat_r), psi_r, {**nishimori_residual(gg_r, _weighted_mean(W, np.einsum("rnktlt->rnkl", dg)),
                                                      nishimori_quadrature(g, dg, err, W)), **summary,
                                 **quadrature_share(g, err, alpha, Q_hat_r, W)}


def nishimori_quadrature(g: np.ndarray, dg: np.ndarray, err, W=None) -> np.ndarray | None:
    """First-order bound (p, p) of the quadrature error of the Nishimori residual from the
    per-sample estimates e_n (relative to max(1, |g_n|) and max(1, |dg_n|)): g (R, n, p, T), dg
    (R, n, p, T, p, T); W (R, n) the samples' weights (None: 1). None without estimates."""
    if err is None:
        return None
    R, n, p, T = g.shape
    e = np.asarray(err, dtype=float).reshape(R, n)
    if W is not None:
        e = np.where(W > 0, W * e, 0.0)
        g, dg = (np.where(W.reshape((R, n) + (1,) * (x.ndim - 2)) > 0, x, 0.0) for x in (g, dg))
    if not np.isfinite(e).all():  # (a sample without an estimate: no bound; inf * 0 would give nan)
        return np.full((p, p), np.inf)
    dg_abs = e * np.maximum(1.0, np.abs(g).max(axis=(2, 3)))  # each entry of g_out
    ddg_abs = e * np.maximum(1.0, np.abs(dg).reshape(R, n, -1).max(axis=2))  # each entry of dg_out
    a = np.abs(g).sum(axis=3)  # sum_t |g_kt|
    gg = np.einsum("rn,rnk->k", dg_abs, a) / (R * n)
    return (gg[:, None] + gg[None, :]) + T * ddg_abs.mean() * np.ones((p, p))


def nishimori_residual(gg_r: np.ndarray, dg_r: np.ndarray, quad: np.ndarray | None = None) -> dict:
    """E[sum_t g g^T] + E[sum_t dg_out[:, t; :, t]] (zero for a correct denoiser, theory section 4)
    from replica means (R, p, p): the residual matrix, its standard error, and the largest entry
    in standard errors (``z``) and relative to |E[g g^T]| (``relative``). ``quad``: a bound on the
    residual's quadrature error per entry; ``z`` then counts only what exceeds it (an entry that
    vanishes by symmetry, e.g. an unlearned layer's, has a replica error far below the denoiser's
    tolerance)."""
    res, se = mean_and_stderr(sym(gg_r + dg_r))
    scale = float(np.max(np.abs(gg_r.mean(axis=0)))) or 1.0
    excess = np.abs(res) if quad is None else np.maximum(0.0, np.abs(res) - quad)
    z = excess / np.where(se > 0, se, np.inf)
    out = {"nishimori_residual": res.tolist(), "nishimori_stderr": se.tolist(),
           "nishimori_z": float(np.max(z)), "nishimori_relative": float(np.max(np.abs(res)) / scale)}
    if quad is not None:
        out["nishimori_quadrature_bound"] = quad.tolist()
    return out


def quadrature_summary(out, den) -> dict:
    """The denoiser's own error estimate over the batch (None where it gives none)."""
    err = getattr(out, "error", None)
    tol = getattr(den, "tol", None)
    if err is None:
        model = getattr(den, "model", None)
        if (model is not None and getattr(model.kernels, "INTEGRAL_DIM", None) == 0
                and model.kernels.PATH in ("attention-rank1", "solve", "halfspace")):
            # the reduced posterior is a finite set of points: no integral, only rounding
            return {"quadrature_error_max": 0.0, "quadrature_tol": tol, "quadrature_missed": 0,
                    "quadrature_note": "exact: the reduced posterior is a finite set of points (no integral)"}
        return {"quadrature_error_max": None, "quadrature_tol": tol, "quadrature_missed": None,
                "quadrature_note": "fixed rule: the quadrature error is not estimated"}
    err = np.asarray(err, dtype=float).ravel()
    missed = int(np.sum(err > tol)) if tol else None
    uncontrolled = int(np.sum(~np.isfinite(err)))
    mean_tol = getattr(den, "mean_tol", None)
    note = f"{missed} of {err.size} samples above tol" if missed else "every sample within tol"
    if missed and mean_target_met(err, mean_tol):
        note += f" (refinement stopped once the mean estimate met mean_tol = {mean_tol:g})"
    if uncontrolled:
        # (heavy-tailed importance weights, or no stage within its budget: the bounds below are inf)
        note += f"; {uncontrolled} without an error estimate (not controlled)"
    return {"quadrature_error_max": float(np.max(err)), "quadrature_error_median": float(np.median(err)),
            "quadrature_error_mean": float(np.mean(err)), "quadrature_tol": tol, "quadrature_mean_tol": mean_tol,
            "quadrature_missed": missed, "quadrature_uncontrolled": uncontrolled, "quadrature_note": note}


def finer_rule(model, den):
    """The denoiser with twice the nodes where ``den`` runs a fixed rule over an integral (the
    generic noisy path, region constraints, explicit node counts); None where it controls its
    error or has no integral. Its difference to ``den`` estimates the rule's error."""
    k = getattr(model, "kernels", None)
    if k is None or getattr(den, "tol", None) is not None or int(k.INTEGRAL_DIM) == 0 and k.PATH != "noisy":
        return None
    if k.PATH in ("halfspace",) or not getattr(den, "nodes", None):
        return None
    acc = {"nodes": min(256, 2 * int(den.nodes))}
    if getattr(den, "polar", None):
        acc["polar"] = tuple(2 * v for v in den.polar)
    return model.denoiser(**acc)


def quadrature_share(g: np.ndarray, err, alpha: float, Q_hat_r: np.ndarray, W=None) -> dict:
    """First-order bound of the quadrature error of the diagonal of Q_hat = alpha E[sum_t g g^T]
    from the per-sample estimates (relative to max(1, |g|)), against its replica standard error:
    their largest ratio is ``quadrature_to_statistical`` (> 1: the quadrature error dominates).
    W (R, n): the samples' weights (None: 1)."""
    if err is None:
        return {"quadrature_Q_hat_bound": None, "quadrature_to_statistical": None}
    R, n = g.shape[:2]
    err = np.asarray(err, dtype=float).reshape(R, n)
    if W is not None:
        err = np.where(W > 0, W * err, 0.0)
        g = np.where(W[..., None, None] > 0, g, 0.0)
    if not np.isfinite(err).all():  # (a sample without an estimate: no bound; inf * 0 would give nan)
        return {"quadrature_Q_hat_bound": float("inf"), "quadrature_to_statistical": float("inf")}
    dg = err * np.maximum(1.0, np.abs(g).max(axis=(2, 3)))  # (R, n) absolute error of each g entry
    a = np.abs(g).sum(axis=3)  # (R, n, p): sum_t |g_kt|
    bound = 2.0 * alpha * np.einsum("rn,rnk->k", dg, a) / (R * n)  # diagonal entries Q_hat_kk
    se_hat = np.diag(mean_and_stderr(Q_hat_r)[1])
    # (entries that vanish by a symmetry, e.g. a layer not yet learned, carry rounding-level
    # errors on both sides: measured against a floor at 1e-6 of the largest stderr)
    ratio = bound / np.maximum(se_hat, 1e-6 * se_hat.max() + 1e-300)
    return {"quadrature_Q_hat_bound": float(bound.max()), "quadrature_to_statistical": float(ratio.max())}


def _check_finite(x, what):
    if not np.all(np.isfinite(x)):
        raise AimsymError(what, "became non-finite (denoiser returned NaN/inf); raise nodes or samples")


# ----------------------------------------------------------------------------- free entropy
def free_entropy(Q: np.ndarray, Q_hat: np.ndarray, alpha: float, psi_out: float) -> float:
    """Phi(Q, Q_hat) of theory section 4 (larger is better)."""
    p = Q.shape[0]
    _, logdet = np.linalg.slogdet(np.eye(p) + Q_hat)
    return float(-0.5 * np.trace(Q @ Q_hat) + 0.5 * np.trace(Q_hat) - 0.5 * logdet + alpha * psi_out)


# ----------------------------------------------------------------------------- errors
from ..results import Result  # noqa: E402  (kept out of the header block, which holds the solver's constants)


@dataclass
class PredictionErrors(Result):
    """Prediction errors of the output at overlap Q (see :func:`prediction_errors`)."""

    bayes_optimal: float
    bayes_optimal_stderr: float
    plug_in: float
    plug_in_stderr: float


def prediction_errors(model, Q: np.ndarray, *, samples: int = 1 << 14, replicas: int = 8,
                      seed=0) -> PredictionErrors:
    """Bayes-optimal E||g(Z)||^2 - E_xi||E_eta g(Z)||^2 and plug-in E||g(Z) - g(Q^{1/2} xi)||^2.

    E_xi ||E_eta g||^2 is estimated without bias as E[g(Q^{1/2} xi + C eta1) . g(Q^{1/2} xi + C eta2)].
    Noise-free link outputs (the label noise adds Delta * size to both errors and is left out).
    """
    p, T = model.p, model.tokens
    pts = normal_points(3 * p * T, samples, replicas, seed)
    R, n, _ = pts.shape
    xi, e1, e2 = (pts[..., i * p * T:(i + 1) * p * T].reshape(R, n, p, T) for i in range(3))
    Qc = clip_overlap(Q)
    S, C = sqrt_psd(Qc), sqrt_psd(np.eye(p) - Qc)
    om = S @ xi
    y1, y2, y0 = (model.link(z).reshape(R, n, -1) for z in (om + C @ e1, om + C @ e2, om))
    bayes = (np.sum(y1 * y1, -1) - np.sum(y1 * y2, -1)).mean(axis=1)
    plug = np.sum((y1 - y0) ** 2, -1).mean(axis=1)
    (b, bs), (q, qs) = mean_and_stderr(bayes), mean_and_stderr(plug)
    return PredictionErrors(bayes_optimal=float(b), bayes_optimal_stderr=float(bs), plug_in=float(q),
                            plug_in_stderr=float(qs))


# ----------------------------------------------------------------------------- driver
@dataclass
class SEResult:
    alpha: float
    Q: np.ndarray
    Q_stderr: np.ndarray
    Q_hat: np.ndarray
    Q_hat_stderr: np.ndarray
    errors: dict
    free_entropy: float
    free_entropy_stderr: float
    iterations: int
    converged: bool
    init: str
    side_info: float
    side_block: list | None
    history: list = field(repr=False, default_factory=list)
    accuracy: dict = field(default_factory=dict)
    diagnostics: dict = field(default_factory=dict)  # Nishimori residual, quadrature error estimate
    seconds: float = 0.0
    provenance: dict = field(default_factory=dict)

    @property
    def perfect_recovery(self) -> bool:
        """Every (unrestricted) entry at perfect recovery: 1 - Q_kk below PERFECT_RESOLUTION."""
        return bool(all(self.errors["perfect_recovery"]))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("history")
        for k in ("Q", "Q_stderr", "Q_hat", "Q_hat_stderr"):
            d[k] = np.asarray(d[k]).tolist()
        return d

    def to_json(self) -> dict:
        return self.to_dict()


@dataclass
class Response:
    """The sampled SE map F near a point Q0, on its free entries (upper triangle inside the
    mask, leaving out entries at perfect recovery, which the clipping of V pins): F0 = F(Q0)
    and J = dF/dQ (forward differences of step rel_step * sqrt(s_k s_l), s = :func:`error_scale`;
    one map evaluation per free entry and one at Q0)."""

    free: list
    F0: np.ndarray
    J: np.ndarray
    delta: np.ndarray | None = None  # the last Newton step (I - J)^{-1} (F(Q) - Q) on the free entries

    def vec(self, M: np.ndarray) -> np.ndarray:
        return np.array([M[..., i, j] for i, j in self.free]).T

    def unvec(self, v: np.ndarray, p: int) -> np.ndarray:
        M = np.zeros((p, p))
        for c, (i, j) in enumerate(self.free):
            M[i, j] = M[j, i] = v[c]
        return M

    @property
    def stable(self) -> bool:
        return bool(np.max(np.abs(np.linalg.eigvals(self.J)), initial=0.0) < 1.0)


def map_response(ch: Channel, Q0: np.ndarray, alpha: float, Lam: np.ndarray, mask: np.ndarray,
                 rel_step: float = 1e-3, free_mask: np.ndarray | None = None) -> Response:
    """The map's value at Q0 and its Jacobian by forward differences in the free entries (those of
    ``mask``, or of ``free_mask`` where given, whose 1 - Q_kk is resolved): 1 + len(free) maps."""
    p = Q0.shape[0]
    e = 1.0 - np.diag(Q0)
    fm = mask if free_mask is None else free_mask
    free = [(i, j) for i in range(p) for j in range(i, p)
            if fm[i, j] > 0 and e[i] >= PERFECT_RESOLUTION and e[j] >= PERFECT_RESOLUTION]
    resp = Response(free, np.zeros(len(free)), np.zeros((len(free), len(free))))
    if not free:
        return resp

    def F(Qx):
        Q_hat_r, _ = se_map(ch, Qx, alpha)
        return resp.vec(q_from_q_hat(Q_hat_r.mean(axis=0) * mask, Lam) * mask)

    s = np.sqrt(error_scale(Q0))
    resp.F0 = F(Q0)
    for c, (i, j) in enumerate(free):
        h = rel_step * s[i] * s[j]
        sign = -1.0 if Q0[i, i] + h >= 1.0 or Q0[j, j] + h >= 1.0 else 1.0
        E = np.zeros((p, p))
        E[i, j] = E[j, i] = sign * h
        resp.J[:, c] = (F(Q0 + E) - resp.F0) / (sign * h)
    return resp


def newton_polish(ch: Channel, Q: np.ndarray, alpha: float, Lam: np.ndarray, mask: np.ndarray, tol: float,
                  steps: int = 3, slack: np.ndarray | None = None):
    """Newton steps Q <- Q + (I - J)^{-1} (F(Q) - Q) on the fixed-point equation, at a stable
    fixed point of the iteration only (a Newton step would also reach unstable ones). Near a
    transition the iteration contracts critically slowly (rate -> 1) and its extrapolated
    stopping rule can stop early (linear channel at alpha = 0.99: 1 % off in 1 - Q at tol 1e-4);
    the Newton distance (I - J)^{-1} (F(Q) - Q) is the actual distance to the fixed point.
    ``slack`` (p, p): a step within it entry by entry is also close enough (STAT_STOP of the
    fixed point's replica error). Returns (Q, response at Q (its ``delta``: the last Newton step),
    distance to the fixed point in :func:`relative_step` units)."""
    p = Q.shape[0]
    resp = map_response(ch, Q, alpha, Lam, mask)
    dist = 0.0
    for _ in range(steps + 1):
        if not resp.free:
            return Q, resp, 0.0
        dq = _newton_delta(resp, Q)
        if dq is None:
            return Q, resp, float("inf")
        resp.delta = dq
        s = np.sqrt(error_scale(Q))
        dist = float(np.max(np.abs(dq) / np.array([s[i] * s[j] for i, j in resp.free])))
        if dist < tol or not resp.stable or _ == steps or _within(np.abs(dq), resp.vec(slack) if slack is not None
                                                                   else None):
            break
        Q_new = clip_overlap(Q + resp.unvec(dq, p)) * mask
        if not _local(Q, Q_new):
            break  # not a local correction: leave it to the iteration
        Q = Q_new
        resp = map_response(ch, Q, alpha, Lam, mask)
    return Q, resp, dist


def _within(x, slack) -> bool:
    return slack is not None and bool(np.all(x <= slack))


def _newton_delta(resp: Response, Q: np.ndarray) -> np.ndarray | None:
    """(I - J)^{-1} (F(Q) - Q) over the free entries of ``resp`` (the map's response at Q), or
    None where I - J is singular."""
    try:
        return np.linalg.solve(np.eye(len(resp.free)) - resp.J, resp.F0 - resp.vec(Q))
    except np.linalg.LinAlgError:
        return None


def _local(Q: np.ndarray, Q_new: np.ndarray) -> bool:
    """A local correction: every diagonal entry moves by at most LOCAL_STEP of its error scale."""
    return bool(np.all(np.abs(np.diag(Q_new) - np.diag(Q)) <= LOCAL_STEP * error_scale(Q)))


def fixed_point_stderr(resp: Response, Q_r: np.ndarray):
    """Standard error of the fixed point Q* = F(Q*) of the sampled map F, from the replica values
    Q_r of F(Q*): a change dF of the map moves the fixed point by (I - J)^{-1} dF. Near a
    transition |I - J| -> 0 and the one-step spread alone understates the error (linear channel
    y = z at alpha = 0.99: by a factor 250). Returns (stderr matrix, largest amplification)."""
    R = Q_r.shape[0]
    _, se_step = mean_and_stderr(Q_r)
    if not resp.free:
        return se_step, 1.0
    V = resp.vec(Q_r)
    D = V - V.mean(axis=0)
    C = D.T @ D / (R - 1) / R
    try:
        A = np.linalg.inv(np.eye(len(resp.free)) - resp.J)
    except np.linalg.LinAlgError:
        A = np.full_like(resp.J, np.inf)
    var = np.diag(A @ C @ A.T)
    out = se_step.copy()
    for c, (i, j) in enumerate(resp.free):
        out[i, j] = out[j, i] = np.sqrt(var[c]) if np.isfinite(var[c]) else np.inf
    # the amplification over the entries whose one-step spread is resolved (an entry the map keeps
    # at exactly 0 in every replica, an unlearned layer, has none: its ratio would be 0/0)
    c = np.diag(C)
    seen = c > 1e-20 * np.max(c, initial=0.0)
    if not np.any(seen):
        return out, 1.0
    return out, float(np.max(np.sqrt(np.maximum(var[seen], 0)) / np.sqrt(c[seen])))


def layer_errors(Q: np.ndarray, Q_se: np.ndarray, mask: np.ndarray) -> dict:
    """1 - Q_kk with standard errors; entries below PERFECT_RESOLUTION are perfect recovery
    (reported as 0 with ``perfect_recovery`` true: the SE cannot resolve them)."""
    e = 1.0 - np.diag(Q)
    active = np.diag(mask) > 0
    perfect = active & (e < PERFECT_RESOLUTION)
    # the clip holds the smallest direction of V at 1e-9 while V keeps its shape (two layers,
    # T = 2: V11 : V22 ~ 100 : 1 near Q = I), so the others stop above the resolution: a fixed
    # point with one entry at the clip and all within PERFECT_NEAR is perfect recovery
    if perfect.any() and np.all(e[active] < PERFECT_NEAR):
        perfect = active.copy()
    return {"layers": np.where(perfect, 0.0, e).tolist(), "layers_stderr": np.diag(Q_se).tolist(),
            "perfect_recovery": perfect.tolist(), "resolution": PERFECT_RESOLUTION}


def initial_overlap(p: int, init, eps: float = 1e-4) -> np.ndarray:
    """'uninformed' (eps I), 'informed' ((1 - eps) I) or an explicit p x p matrix."""
    if isinstance(init, str):
        if init == "uninformed":
            return eps * np.eye(p)
        if init == "informed":
            return (1 - eps) * np.eye(p)
        raise AimsymError("init", f"expected 'uninformed', 'informed' or a matrix, got {init!r}")
    Q = np.asarray(init, dtype=float)
    if Q.shape != (p, p):
        raise AimsymError("init", f"expected a {p}x{p} overlap matrix, got shape {Q.shape}")
    return clip_overlap(Q)


def state_evolution(model, alpha: float, *, init="uninformed", side_info: float = 0.0, side_block=None,
                    restrict=None, damping: float = 0.0, tol: float = 1e-4, max_iter: int = 500,
                    samples: int = 4096, replicas: int = 8, nodes=None, seed=0, errors: bool = True,
                    channel: Channel | None = None, init_eps: float = 1e-4, coarse: int = 8,
                    anderson: int = 3, stop=None, progress: bool = False, checkpoint=None) -> SEResult:
    """Iterate the SE to a fixed point (see :func:`_converged` for the test).

    side_info / side_block: lambda on a block of indices (all if None). ``restrict``: indices U;
    Q is kept zero outside U x U (the SE branch supported on U used by the staircase).
    ``channel``: reuse a :func:`make_channel` (same points) across calls, e.g. along alpha.
    ``stop``: optional predicate on Q; the iteration ends (converged = False) as soon as it holds
    (e.g. "the overlap has left zero", all a bisection needs to know).
    ``progress``: a progress display of the denoiser passes (points denoised) on stderr.
    ``checkpoint``: a folder (or :class:`~aimsym.smi.passes.Passes`) keeping every denoiser pass;
    the same call again replays the passes made and continues (a stopped run resumes). The
    caller removes them (:func:`aimsym.smi.passes.clear`) once the result is safe.
    """
    alpha = float(alpha)
    if not (np.isfinite(alpha) and alpha >= 0):
        raise AimsymError("alpha", f"must be a finite number >= 0, got {alpha!r}")
    if not 0.0 <= damping < 1.0:
        raise AimsymError("damping", f"must be in [0, 1), got {damping!r}")
    if side_info < 0:
        raise AimsymError("side_info", f"must be >= 0, got {side_info!r}")
    if not (np.isfinite(tol) and tol > 0):
        raise AimsymError("tol", f"must be a finite number > 0, got {tol!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int | np.integer) or max_iter < 1:
        raise AimsymError("max_iter", f"must be an integer >= 1, got {max_iter!r}")
    if isinstance(seed, int | np.integer) and seed < 0:
        raise AimsymError("seed", f"must be an integer >= 0, got {seed!r}")
    t0 = time.perf_counter()
    p = model.p
    ch = channel or make_channel(model, samples=samples, replicas=replicas, seed=seed, nodes=nodes)
    if checkpoint is not None:
        ch = replace(ch, passes=as_passes(checkpoint))
    bar = None
    if progress and ch.on_pass is None:
        from tqdm.auto import tqdm

        bar = tqdm(desc=f"SE alpha={alpha:g}", unit="pt", unit_scale=True, leave=False)
        ch = replace(ch, on_pass=bar.update)
    try:
        res = _state_evolution(model, ch, alpha, init, side_info, side_block, restrict, damping, tol, max_iter,
                               errors, init_eps, coarse, anderson, stop, t0, seed)
        # a fixed rule left at its default (generic noisy path): while its quadrature error dominates
        # the statistical one, double the nodes and continue from the fixed point, up to the cap
        finer = finer_rule(model, ch.den) if (nodes is None and channel is None and stop is None) else None
        while (finer is not None and (res.diagnostics.get("quadrature_to_statistical") or 0.0) > 1.0
               and finer.nodes <= SE_MAX_NODES.get(int(model.kernels.INTEGRAL_DIM), 0)):
            ch = ch.with_denoiser(finer)
            res = _state_evolution(model, ch, alpha, res.Q, side_info, side_block, restrict, damping, tol,
                                   max_iter, errors, init_eps, coarse, anderson, stop, t0, seed)
            res.diagnostics["refined_nodes"] = int(finer.nodes)
            res.diagnostics["quadrature_note"] += f" (rule refined to {finer.nodes} nodes per dimension)"
            finer = finer_rule(model, finer)
        return res
    finally:
        if bar is not None:
            bar.close()


def _state_evolution(model, ch, alpha, init, side_info, side_block, restrict, damping, tol, max_iter, errors,
                     init_eps, coarse, anderson, stop, t0, seed) -> SEResult:
    p = model.p
    Lam = side_matrix(p, side_info, side_block)
    mask = _restrict_mask(p, restrict)
    Q = initial_overlap(p, init, init_eps) * mask
    history, it = [], 0
    # coarse pass on 1/8 of the points (cheap), then the full rule from there
    for stage, (rule, stage_tol) in enumerate(((ch.subset(coarse), 4 * tol), (ch, tol))):
        # no coarse pass under a stop predicate: it would decide on 1/8 of the points (another
        # sampled map), e.g. "the overlap has left zero" where the full rule is still stable
        if stage == 0 and (coarse <= 1 or stop is not None):
            continue
        # near Q = I the coarse map can overshoot the full map's fixed point (1/8 of the points
        # carry a little more information, e.g. perfect recovery at alpha = 0.99 < alpha_PR), and
        # from above the full rule would approach it critically slowly or stay on another branch:
        # the coarse pass hands over to the full rule as soon as some 1 - Q_kk < COARSE_NEAR_ONE
        near_one = (lambda Qx: bool(np.any((1.0 - np.diag(Qx) < COARSE_NEAR_ONE) & (np.diag(mask) > 0))))
        flags = {}
        Q, n_it, converged = _iterate(rule, Q, alpha, Lam, mask, damping, stage_tol, max_iter - it, history,
                                      anderson, near_one if stage == 0 else stop, flags)
        it += n_it
        if stop is not None and stop(Q):
            break
    if stop is None:
        Q, n_it, converged = _reseed(ch, Q, alpha, Lam, mask, damping, tol, max_iter - it, history, anderson,
                                     init_eps, converged)
        it += n_it
    distance = None
    if stop is None:
        slack = None if flags.get("noise") is None else STAT_STOP * flags["noise"]
        Q, resp, distance = newton_polish(ch, Q, alpha, Lam, mask, tol, slack=slack)
    Q_hat_r, psi_r, diag = se_map(ch, Q, alpha, diagnostics=True)
    Q_hat_r = Q_hat_r * mask
    Q_hat, Q_hat_se = mean_and_stderr(Q_hat_r)
    Q_r = np.stack([q_from_q_hat(x, Lam) * mask for x in Q_hat_r])
    Q_fp = q_from_q_hat(Q_hat, Lam) * mask
    if stop is None:
        Q_se, response = fixed_point_stderr(resp, Q_r)
    else:
        (_, Q_se), response = mean_and_stderr(Q_r), None
    if distance is not None:
        # close enough: within tol (relative) or within STAT_STOP of the fixed point's error, entry
        # by entry; the Newton step left is added to the error
        step = np.abs(resp.unvec(resp.delta, p)) if resp.delta is not None else np.zeros_like(Q_se)
        close = distance < tol or _within(resp.vec(step), resp.vec(STAT_STOP * Q_se))
        converged = bool(converged and close) or bool(close and resp.stable)
        Q_se = np.sqrt(Q_se**2 + step**2)
    # the quadrature error folded in (conservatively, by its largest share of Q_hat's stderr)
    share = diag.get("quadrature_to_statistical") or 0.0
    # (share inf: samples without an error estimate; the stderr is then inf, not 0 * inf = nan)
    Q_se = Q_se * np.sqrt(1.0 + share**2) if np.isfinite(share) else np.full_like(Q_se, np.inf)
    if share > 1.0:
        diag["quadrature_note"] += ("; the quadrature error dominates the statistical error" if np.isfinite(share) else
                                    "; Q_stderr is inf: the quadrature error is not controlled")
    phi_r = np.array([free_entropy(Q_fp, Q_hat, alpha, s) for s in psi_r])
    phi, phi_se = mean_and_stderr(phi_r)
    errs = layer_errors(Q_fp, Q_se, mask)
    if errors:
        errs["prediction"] = prediction_errors(model, Q_fp, seed=seed)
    if not converged and stop is None:  # (under a stop predicate the iteration ends early on purpose)
        warnings.warn(f"state evolution at alpha = {alpha:g} did not converge in {it} iterations "
                      f"(tol {tol:g} relative to min(Q_kk, 1 - Q_kk)); raise max_iter or damping",
                      ConvergenceWarning, stacklevel=2)
    # (the denoiser's own rule and tol keep their names: "rule" and "tol" are the SE's below)
    accuracy = {**ch.den.accuracy, "denoiser_rule": getattr(ch.den, "rule", None),
                "denoiser_tol": getattr(ch.den, "tol", None), "samples": int(ch.points.shape[0] * ch.points.shape[1]),
                "replicas": int(ch.points.shape[0]), "rule": "scrambled Sobol (randomised QMC)",
                "tol": tol, "convergence": "relative to min(Q_kk, 1 - Q_kk), or within STAT_STOP of the "
                                           "fixed point's replica error",
                "perfect_resolution": PERFECT_RESOLUTION, "damping": damping, "max_iter": max_iter,
                "Q_stderr": "replica error of the fixed point: one step's spread amplified by (I - J)^{-1}, times "
                            "sqrt(1 + s^2), s = diagnostics.quadrature_to_statistical",
                "amplification": response, "distance_to_fixed_point": distance}
    return SEResult(
        alpha=alpha, Q=Q_fp, Q_stderr=Q_se, Q_hat=Q_hat, Q_hat_stderr=Q_hat_se, errors=errs,
        free_entropy=float(phi), free_entropy_stderr=float(phi_se), iterations=it, converged=converged,
        init=init if isinstance(init, str) else "matrix", side_info=float(side_info),
        side_block=None if side_block is None else [int(i) for i in side_block], history=history,
        accuracy=accuracy, diagnostics=diag, seconds=time.perf_counter() - t0,
        provenance=provenance(seed=seed, model_hash=model.hash(), accuracy=accuracy,
                              parameters=dict(getattr(model, "parameters", {}))),
    )


def _iterate(ch, Q, alpha, Lam, mask, damping, tol, max_iter, history, anderson=3, stop=None, flags=None,
             watch=None):
    """Damped fixed-point iteration of the SE map; returns (Q, iterations, converged).
    ``flags["noise"]``: the map's replica error (p, p) at the last step. ``watch(Q,
    Q_new)``: ends the iteration when true (not converged), unlike ``stop`` without changing its
    steps (the escape and Newton jumps stay on)."""
    start = len(history)
    xs, gs = [], []  # Anderson memory: iterates and their images
    active = np.diag(mask) > 0
    rates, jumped, confirmed = [], False, 0  # per step, e_new / e_old of the active entries on a steady contraction
    newton_tries, last_try = 0, 0
    growth, escaped = [], np.zeros(Q.shape[0], bool)  # per-step factors of the diagonal; entries jumped
    for it in range(1, max_iter + 1):
        Q_hat_r, _ = se_map(ch, Q, alpha)
        Q_new = q_from_q_hat(Q_hat_r.mean(axis=0) * mask, Lam) * mask
        noise_m = _map_noise(Q_hat_r, Lam, mask)
        if flags is not None:
            flags["noise"] = noise_m
        # near Q = I the map is homogeneous in V = I - Q: a steady contraction of every 1 - Q_kk
        # (_perfect_ahead) continues to V = 0. Jump to the resolution there (saving the ~10 steps
        # per decade, each costly where one layer is nearly known); the map then confirms it
        # (PERFECT_CONFIRM steps along which no 1 - Q_kk grows), or moves away from I if the
        # contraction was transient
        e_old, e_new = 1.0 - np.diag(Q), 1.0 - np.diag(Q_new)
        near = (active.any() and np.all(e_new[active] < PERFECT_NEAR_SLOW)
                and np.any(e_new[active] > 2 * OVERLAP_EPS))
        rate = e_new[active] / np.maximum(e_old[active], OVERLAP_EPS) if near else None
        steady = rate is not None and np.all(rate <= PERFECT_RATE_SLOW) and (
            not rates or np.all(np.abs(rate - rates[-1]) <= PERFECT_RATE_SPREAD))
        rates = rates + [rate] if steady else []
        if jumped:
            confirmed = confirmed + 1 if np.all(e_new[active] <= e_old[active] * (1 + 1e-9)) else 0
        elif _perfect_ahead(rates, float(e_new[active].max()) if near else 1.0):
            # scale V = I - Q down along its shape until its smallest diagonal entry sits at the clip
            A = np.ix_(active, active)
            V = np.eye(int(active.sum())) - Q_new[A]
            Q_new = Q_new.copy()
            Q_new[A] = np.eye(V.shape[0]) - V * (2 * OVERLAP_EPS / e_new[active].min())
            Q_new = clip_overlap(Q_new) * mask
            jumped = True  # once: at the clip the map is left to settle
            confirmed = 0
        if stop is None and (Q_esc := _escape_jump(Q, Q_new, growth, escaped, active)) is not None:
            Q_new, xs, gs = Q_esc * mask, [], []
        history.append(relative_step(Q, Q_new))
        if watch is not None and watch(Q, Q_new):
            return Q_new, it, False
        # still growing out of Q ~ 0 (an uninformed start just above a threshold grows by a factor
        # alpha * rho ~ 1 per step while transients decay): not converged, whatever the step size
        # (per diagonal entry: one layer can be escaping while another is already learned)
        d_old, d_new = np.diag(Q), np.diag(Q_new)
        escaping = bool(np.any((d_new < 0.01) & (d_new > 1e-12) & (d_new > d_old * (1 + tol))))
        if not escaping and (confirmed >= PERFECT_CONFIRM
                             or _converged(history[start:], tol, np.abs(Q_new - Q), STAT_STOP * noise_m, Q_new)):
            return Q_new, it, True
        if stop is not None and stop(Q_new):
            return Q_new, it, False
        Q_plain = damping * Q + (1 - damping) * Q_new
        h = history[start:]
        # a slow steady contraction (near Q = I, where Anderson is off, rate ~0.85-0.95: dozens of
        # steps, each minutes for three layers): one Newton step on the learned entries for
        # 1 + n maps, at most NEWTON_TRIES per call; the iteration then confirms (or goes on)
        if (newton_tries < NEWTON_TRIES and it - last_try >= NEWTON_AFTER and not escaping and stop is None
                and _slow_steady(h) and _local_ahead(Q, Q_new, h)):
            newton_tries, last_try = newton_tries + 1, it
            if (Q_jump := _newton_jump(ch, Q_new, alpha, Lam, mask)) is not None:
                xs, gs = [], []
                Q = Q_jump
                continue
        # Anderson only while the plain map contracts (it would also find unstable fixed
        # points, e.g. Q = 0 above a weak-recovery threshold)
        contracting = len(h) >= 4 and h[-1] < h[-2] < h[-3] < h[-4]
        # (not near Q = I: there the map's noise in 1 - Q_kk is of the order of the step, which
        # the extrapolation amplifies; docs/tuning.md)
        contracting = contracting and not np.any(e_new[active] < COARSE_NEAR_ONE)
        if not contracting:
            xs, gs = [], []
        xs, gs = (xs + [Q])[-anderson - 1:], (gs + [Q_plain])[-anderson - 1:]
        Q = _anderson(xs, gs) if anderson and contracting and len(xs) > 1 else Q_plain
    return Q, max(max_iter, 0), False


def _perfect_ahead(rates, e_max: float) -> bool:
    """The contraction towards Q = I is in its linear regime: every 1 - Q_kk shrinks by a steady
    factor and its Aitken limit (the limit e* of e_k = 1 - Q_kk if it approaches it
    geometrically, from three consecutive e) is at most PERFECT_LIMIT of e at every step of the
    window: PERFECT_STEPS steps at rates up to PERFECT_RATE with every 1 - Q_kk (largest: e_max)
    below PERFECT_NEAR, or PERFECT_STEPS_SLOW steps at rates up to PERFECT_RATE_SLOW. An approach
    to a fixed point short of I has rates that creep up towards 1 and a positive limit (y = z at
    alpha = 0.99: e* = 0.01, half of e where the window starts)."""
    if e_max < PERFECT_NEAR and len(rates) >= PERFECT_STEPS and np.all(np.array(rates[-PERFECT_STEPS:]) <= PERFECT_RATE):
        return _limit_near_zero(np.array(rates[-PERFECT_STEPS:]))
    return len(rates) >= PERFECT_STEPS_SLOW and _limit_near_zero(np.array(rates[-PERFECT_STEPS_SLOW:]))


def _limit_near_zero(r: np.ndarray) -> bool:
    """Aitken's limit e* / e at each step of rates r (steps, entries) at most PERFECT_LIMIT."""
    r1, r2 = r[:-1], r[1:]
    # e0, e1, e2 = e2 / (r1 r2), e2 / r2, e2: e* / e2 = 1 - (e2 - e1)^2 / (e2 (e2 - 2 e1 + e0))
    curve = 1.0 - 2.0 / r2 + 1.0 / (r1 * r2)
    if np.any(curve <= 0):  # not convex: no geometric approach to read a limit from
        return False
    return bool(np.all(1.0 - (1.0 - 1.0 / r2) ** 2 / curve <= PERFECT_LIMIT))


def _escape_jump(Q, Q_new, growth, escaped, active) -> np.ndarray | None:
    """Q_new with each diagonal entry escaping linearly from ~0 moved to ESCAPE_TO (see the
    constants), or None. ``growth`` collects the per-step factors of the diagonal (appended here),
    ``escaped`` the entries already moved (once each: after the jump the map is no longer linear)."""
    d_old, d_new = np.diag(Q), np.diag(Q_new)
    with np.errstate(divide="ignore", invalid="ignore"):
        growth.append(np.where(d_old > 0, d_new / d_old, np.nan))
    if len(growth) < ESCAPE_STEPS:
        return None
    r = np.array(growth[-ESCAPE_STEPS:])
    steady = np.all(r >= ESCAPE_RATE, axis=0) & np.all(
        np.abs(np.diff(r, axis=0)) <= ESCAPE_SPREAD * (r[1:] - 1.0), axis=0)
    jump = steady & active & ~escaped & (d_new > 0) & (d_new < ESCAPE_FROM)
    if not jump.any():
        return None
    escaped |= jump
    s = np.where(jump, np.sqrt(ESCAPE_TO / np.where(jump, d_new, 1.0)), 1.0)
    return clip_overlap(sym(Q_new * np.outer(s, s)))


def _slow_steady(h) -> bool:
    """The last NEWTON_AFTER steps shrink steadily at a rate between NEWTON_RATE and 1."""
    return _steady_rates(h, NEWTON_AFTER, NEWTON_RATE, NEWTON_RATE_SPREAD)


def _steady_rates(h, n: int, low: float, spread: float) -> bool:
    """The last n steps of h shrink at rates in [low, 1) that differ by at most spread."""
    if len(h) < n + 1:
        return False
    r = np.array(h[-n:]) / np.maximum(np.array(h[-n - 1:-1]), 1e-300)
    return bool(np.all((r >= low) & (r < 1.0)) and r.max() - r.min() <= spread)


def _local_ahead(Q_old, Q_new, h) -> bool:
    """Whether the geometric extrapolation of the last step (rate h[-1] / h[-2]) stays within
    half of every diagonal entry's error scale: a Newton step that would not (the iteration
    heading for Q = I, where 1 - Q_kk shrinks towards 0) is refused by ``_newton_jump`` anyway,
    after its maps are paid."""
    r = min(h[-1] / h[-2], 0.999)
    ahead = np.abs(np.diag(Q_new) - np.diag(Q_old)) * r / (1.0 - r)
    return bool(np.all(ahead <= LOCAL_STEP * error_scale(Q_new)))


def _newton_jump(ch, Q, alpha, Lam, mask):
    """One Newton step Q + (I - J)^{-1} (F(Q) - Q) in the learned entries (Q_kk between
    LOWER_FLOOR and 1 - PERFECT_RESOLUTION; the others stay where the iteration has them), or None
    where it is not a local correction (or the learned block is not contracting: J's spectral
    radius >= 1) or there are more than NEWTON_MAX_FREE entries."""
    d = np.diag(Q)
    learned = (d >= LOWER_FLOOR) & (1.0 - d >= PERFECT_RESOLUTION) & (np.diag(mask) > 0)
    n = int(learned.sum())
    if n == 0 or n * (n + 1) // 2 > NEWTON_MAX_FREE:
        return None
    resp = map_response(ch, Q, alpha, Lam, mask, free_mask=mask * np.outer(learned, learned))
    if not resp.free or not resp.stable or (dq := _newton_delta(resp, Q)) is None:
        return None
    Q_new = clip_overlap(Q + resp.unvec(dq, Q.shape[0])) * mask  # (entries off the learned block stay)
    return Q_new if _local(Q, Q_new) else None


def _reseed(ch, Q, alpha, Lam, mask, damping, tol, max_iter, history, anderson, eps, converged, rounds=2):
    """Stability of vanished diagonal entries at the fixed point. An uninformed start can shrink a
    later-learned index to ~1e-12 while another index is still being learned (layer 1 while layer 2
    grows: the factor per step is ~0.2 there) and then stop on a fixed point that is unstable in
    that index, which from 1e-12 would need dozens of steps to show. Such entries are re-seeded at
    ``eps`` and the iteration continued: they escape if the fixed point is unstable there (the
    escape test in :func:`_iterate` keeps it going while they grow), else they decay back, which
    RESEED_STEPS steps of steady decay settle (:func:`_decaying`)."""
    n_total = 0
    for _ in range(rounds):
        small = (np.diag(Q) < eps) & (np.diag(mask) > 0)
        if not small.any() or max_iter - n_total <= 0:
            break
        Q_seed = Q + eps * np.diag(small.astype(float))
        Q_new, n_it, conv = _iterate(ch, Q_seed, alpha, Lam, mask, damping, tol, max_iter - n_total, history,
                                     anderson, watch=_decaying(small))
        n_total += n_it
        if not np.any(np.diag(Q_new)[small] >= eps):
            break  # decayed back: Q is stable there (keep it, not the half-decayed perturbation)
        Q, converged = Q_new, conv
    return Q, n_total, converged


def _decaying(small: np.ndarray):
    """A ``watch`` for :func:`_iterate`: true once every entry ``small`` of the diagonal has shrunk
    by at most RESEED_DECAY per step for RESEED_STEPS steps."""
    rates = []

    def watch(Q_old, Q_new):
        d_old, d_new = np.diag(Q_old)[small], np.diag(Q_new)[small]
        rates.append(float(np.max(d_new / np.maximum(d_old, 1e-300))))
        return len(rates) >= RESEED_STEPS and max(rates[-RESEED_STEPS:]) <= RESEED_DECAY

    return watch


def _anderson(xs, gs) -> np.ndarray:
    """Anderson mixing: the affine combination of the images with the smallest residual;
    falls back to the last plain image if the combination leaves 0 <= Q <= I."""
    F = np.stack([(g - x).ravel() for x, g in zip(xs, gs)], axis=1)
    dF = F[:, 1:] - F[:, :-1]
    gamma, *_ = np.linalg.lstsq(dF, F[:, -1], rcond=None)
    G = np.stack([g.ravel() for g in gs], axis=1)
    Q = (G[:, -1] - (G[:, 1:] - G[:, :-1]) @ gamma).reshape(xs[0].shape)
    w = np.linalg.eigvalsh(sym(Q))
    if not np.all(np.isfinite(Q)) or w.min() < 0 or w.max() >= 1:
        return gs[-1]
    return sym(Q)


def error_scale(Q: np.ndarray) -> np.ndarray:
    """Per diagonal entry, the size of what the user reads off it: min(Q_kk, 1 - Q_kk), floored
    at LOWER_FLOOR on the lower side (the uninformed fixed point sits at exactly 0) and at
    PERFECT_RESOLUTION on the upper side (the clipping of V = I - Q)."""
    d = np.diag(Q)
    return np.where(d <= 0.5, np.maximum(d, LOWER_FLOOR), np.maximum(1.0 - d, PERFECT_RESOLUTION))


def relative_step(Q_old: np.ndarray, Q_new: np.ndarray) -> float:
    """max_kl |Delta Q_kl| / sqrt(s_k s_l), s = :func:`error_scale` of Q_new: a step of the
    iteration measured relative to the error 1 - Q_kk near Q = I (an absolute step says nothing
    about 1 - Q there) and to Q_kk near Q = 0."""
    s = np.sqrt(error_scale(Q_new))
    return float(np.max(np.abs(Q_new - Q_old) / np.outer(s, s)))


def _map_noise(Q_hat_r, Lam, mask) -> np.ndarray:
    """The replica standard error of one step's image (p, p)."""
    Q_r = np.stack([q_from_q_hat(x * mask, Lam) * mask for x in Q_hat_r])
    return mean_and_stderr(Q_r)[1]


def _converged(history, tol, step=None, slack=None, Q=None) -> bool:
    """Distance to the fixed point (in :func:`relative_step` units), extrapolated from the
    geometric rate of the last two steps, below tol; or, entry by entry (``step`` (p, p), the last
    step; ``slack``: STAT_STOP times the map's replica error), below tol or the step below its
    slack: along the slow direction the distance step / (1 - rate) and the fixed point's replica
    error noise / (1 - rate) share the amplification, so their ratio is that of step and noise."""
    last = history[-1]
    rate = min(history[-1] / history[-2], 0.999) if len(history) > 1 and history[-2] > 0 else 0.5
    if len(history) > 1 and history[-1] > history[-2]:
        return False
    if last / (1.0 - rate) < tol:
        return True
    # (only on a steady contraction, where the extrapolated distance means something)
    if slack is None or not _steady_rates(history, STAT_STEADY, STAT_RATE, STAT_RATE_SPREAD):
        return False
    s = np.sqrt(error_scale(Q))
    return bool(np.all((step / np.outer(s, s) / (1.0 - rate) < tol) | (step <= slack)))


def _restrict_mask(p, restrict):
    if restrict is None:
        return np.ones((p, p))
    m = np.zeros(p)
    m[list(restrict)] = 1.0
    return np.outer(m, m)


# ----------------------------------------------------------------------------- closed forms
def gaussian_channel_fixed_point(alpha: float, Delta: float) -> float:
    """p = T = 1 channel y = z + sqrt(Delta) noise: Q_hat = alpha / (1 - Q + Delta), Q = Q_hat/(1+Q_hat).

    Fixed point: Q (1 - Q + Delta + alpha) = alpha, i.e. Q^2 - (1 + Delta + alpha) Q + alpha = 0,
    whose smaller root lies in [0, 1].
    """
    b = 1.0 + Delta + alpha
    return float((b - np.sqrt(b * b - 4.0 * alpha)) / 2.0)
