"""The output-channel denoiser (theory section 3): g_out, dg_out, log Z_out for a batch.

Normalisation of ``log_z_out``. With normalised Gaussians N(z_t; omega_t, V):

* exact path (reduction found): log of  sum_branches  integral du  prod_t N(z_t; omega_t, V) * J,
  with z = (u, solved entries of the branch) and J the branch's weight factor:
  1/|det M_{L-1}(u)| for attention models (the y <-> h Jacobian is excluded: it does not
  depend on omega or V and cancels in g_out), 1/|dg/dz_solved| for solved free-form links
  (so that log_z_out is then the true log density of y);
* generic path (no reduction): log of the integral of prod_t N(z_t; omega_t, V) N(y; g(Z), Delta I)
  over all of Z, Delta > 0 the output noise variance (the true log density of y).

Accuracy. Two rules for the integral over the free entries u:

* tensor Gauss-Hermite with ``nodes`` points per dimension, started on the prior marginal of u
  and re-centred ``adapt`` times on each branch's posterior mean and covariance (the adaptation
  passes use a rule with half as many points per dimension). Defaults: ``DEFAULT_NODES`` and
  ``DEFAULT_ADAPT`` by dimension.
* for two-layer T = 2 models (tied rank-one first layer) a *polar sector rule* on the disk
  |u| <= |omega_u| + kr sqrt(V_uu), kr = POLAR_RADIUS (or an annular sector around omega_u when
  that excludes the origin), split along the lines where the first layer's attention switches.
  The domain is sized on the posterior of u: where its edge carries weight (the likelihood
  pulls the posterior off the prior), it grows and is then fitted to the posterior
  (``Denoiser._sized_run``), and the edge's weight share is part of the error estimate. Default
  ``polar_map="sinh"``: ``polar = (angle nodes per half sector, radial nodes)``, logarithmic in
  radius, sinh-graded in angle from each switching line, u and -u per kernel call (see
  ``denoise_one_polar_mapped`` in the driver and docs/denoiser.md); ``polar_map="legendre"``: the
  earlier plain Gauss-Legendre rule, ``polar = (angle nodes per sector, radial nodes)``.
  Gauss-Hermite is used instead only where the prior of u is narrow (``gh_plausible``) *and* the
  Gauss-Hermite result agrees with a rule of 3/4 the size to ``check_tol``.

``rule="modal"`` (exact path, any number of free entries; for k >= 3, where tensor Gauss-Hermite
does not converge): the mode-centred adaptive cubature of ``aimsym.denoise.modal``, always controlled to
``tol`` (default DEFAULT_TOL) up to a budget of ``max_regions`` regions per sample, with the
per-sample estimate in ``error`` (see docs/denoiser.md).

``error=True`` repeats the computation with rules of 3/4 the size (per dimension) and reports the
largest difference of g_out and dg_out as ``error``. ``tol`` (optional) makes that a loop: samples
whose difference exceeds tol (relative to the size of g_out and dg_out) are recomputed with rules
REFINE = 4/3 times larger, up to ``max_refine`` (default MAX_REFINE = 7) times; the returned
``error`` is then the last difference (at least the weight share on the polar domain's edge).
The default denoiser (``model.denoiser()`` with no rule sizes) runs with ``tol = DEFAULT_TOL``
(1e-8) on the exact path; explicit rule sizes (the solvers' fast settings) run the fixed rule
unless a ``tol`` is given too. ``den(..., tol=None)`` skips the control for one call.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np

from ..errors import ChannelError
from .hardmax_channel import DEFAULT_WEDGE, layer_patterns, one_layer_wedges, output_mask
from .output import DenoiserOutput, difference, mean_target_met, raise_on_status, refine_to_tol, validate_tol

# default Gauss-Hermite points per dimension, by integral dimension (about 1e-9 relative
# on the bundled models at moderate V, see docs/denoiser.md)
DEFAULT_NODES = {1: 80, 2: 48, 3: 20, 4: 12, 5: 7, 6: 5}
# adaptive re-centring pays in one and two dimensions; in three and four the moment-matched
# Gaussian of the (often multimodal) reduced posterior is a worse rule than the prior marginal
DEFAULT_ADAPT = {1: 1, 2: 1}
# polar rule for two-layer T = 2 models (see the driver): the mapped rule (sinh-graded angles
# from each switching line, logarithmic radius, +-u symmetry) with (angle nodes per half
# sector, radial nodes), or the earlier Gauss-Legendre rule (angle nodes per sector, radial nodes)
DEFAULT_POLAR_MAP = "sinh"
DEFAULT_POLAR = {"sinh": (10, 28), "legendre": (18, 48)}
# mapped rule: angular layer scale eps = POLAR_KAPPA / (beta r^2), radial map r^2 = POLAR_CRAD (e^s - 1)
POLAR_KAPPA = 2.0
POLAR_CRAD = 1.0
# radius of the polar disk in prior standard deviations of u (the prior mass outside is < e^{-36})
POLAR_RADIUS = 8.5
# the domain is sized on the prior of u, but the likelihood can pull the posterior far from it
# (omega_w many sd from every solved row): where the domain's edge carries more than EDGE_TOL
# of the weight (typical samples: < 1e-14), the domain grows by DOMAIN_GROWTH, at most
# MAX_DOMAIN_GROWTH times in a row, and is then fitted to the posterior of u (DOMAIN_FITS times)
EDGE_TOL = 1e-12
DOMAIN_GROWTH = 1.5
MAX_DOMAIN_GROWTH = 8
DOMAIN_FITS = 2
# a sample above tol whose posterior mean of u lies more than POSTERIOR_OFF prior sd from
# omega_u is also retried on the domain fitted to its posterior (the prior's domain grades its
# nodes towards the prior's bump)
POSTERIOR_OFF = 3.0
# Gauss-Hermite size tried first on polar models where the prior of u is narrow, and the
# tolerance of its check against 3/4 the size
POLAR_MODEL_GH_NODES = 20
GH_CHECK_TOL = 1e-10
# error target of the default denoiser (model.denoiser() without rule sizes), see ``tol``
DEFAULT_TOL = 1e-8
# rounding of the one-layer hardmax wedge moments, per unit of (1 + |omega| / sqrt(v) +
# |E[z - omega]|^2 / v, |log Z|): measured up to 5e-15 (dg_out v off by 7e-13 at |omega| / sqrt(v)
# = 1.4e4, and by 4e-10 at |E[z - omega]| = 250 sd)
WEDGE_ROUNDING = 64 * np.finfo(float).eps
# growth of the rules per refinement level: the inverse of the check's 3/4, so each level is
# checked against the previous one as the main rule is against the check (fewer nodes than
# x1.5 per level: docs/tuning.md)
REFINE = 4 / 3
# at most this many levels ((4/3)^7 = 7.5x per axis). The SE regimes need at most 4 (2 048 points
# each, none above tol after level 4); the extra levels serve rare far points (a narrow
# posterior far from the origin, docs/denoiser.md), which stopped at estimates up to 2e-6 with
# 4 and reach 1e-8 with 7
MAX_REFINE = 7
MAX_TENSOR_NODES = 200_000
# memory for the node tables of one denoiser and rule size (about 0.1 MB per table at the
# default rule); beyond it the cache restarts
MAX_TABLE_BYTES = 2**28
# exact paths integrated by the mode-centred rule only (a Gaussian block marginalised analytically)
MODAL_ONLY = ("attention-untied",)
_NO_TABLES = np.zeros((0, 1, 1))
_NO_KEYS = np.zeros(0, dtype=np.int64)

_STATUS = {
    1: ("V", "is not symmetric positive definite"),
    2: ("y", "is not on the model's output manifold (e.g. softmax rows must be positive and sum to 1, "
             "and y must be sigma(beta h h^T) for some h)"),
    3: ("y", "has zero likelihood under the model at this omega, V"),
    4: ("omega", "gave a non-finite posterior weight (|omega| or 1/V too large)"),
}


def _rows(V, idx):
    """V for the samples idx (V shared by the batch: unchanged)."""
    return np.ascontiguousarray(V if V.shape[0] == 1 else V[idx])


def gauss_hermite_rule(D: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Tensor Gauss-Hermite rule for the standard normal in D dimensions: (nodes, log weights)."""
    if D == 0:
        return np.zeros((1, 0)), np.zeros(1)
    if n**D > MAX_TENSOR_NODES:
        raise ChannelError("nodes", f"{n}^{D} tensor nodes exceed {MAX_TENSOR_NODES}; lower nodes")
    x, w = np.polynomial.hermite_e.hermegauss(n)
    w = w / np.sqrt(2 * np.pi)
    grids = np.meshgrid(*([x] * D), indexing="ij")
    nodes = np.stack([g.reshape(-1) for g in grids], axis=1)
    lw = sum(np.log(w)[idx.reshape(-1)] for idx in np.meshgrid(*([np.arange(n)] * D), indexing="ij"))
    return np.ascontiguousarray(nodes), np.ascontiguousarray(lw)


def polar_rule(sizes: tuple[int, int] | None):
    """Gauss-Legendre nodes and weights on [-1, 1] for the polar rule (empty: not used)."""
    if sizes is None:
        e = np.zeros(0)
        return e, e, e, e
    th, w_th = np.polynomial.legendre.leggauss(sizes[0])
    rr, w_r = np.polynomial.legendre.leggauss(sizes[1])
    return th, w_th, rr, w_r


def observe_untied(y: np.ndarray, beta: float) -> np.ndarray:
    """(qhat, ehat) from row-softmax outputs y (n, T, T) of an untied last layer (theory section 3):
    l_ab = log(y_ab / y_aa) / beta = q_a (k_b - k_a), so R_ab = l_ab - l_a1 = q_a d_b (d_b = k_b - k_1,
    b >= 2) is the rank-one matrix q d^T; ehat = its unit row direction with ehat_1 >= 0 (from the
    row of largest norm) and qhat = R ehat. Rejects y off the manifold (R not of rank one)."""
    n, T, _ = y.shape
    with np.errstate(divide="ignore"):
        ly = np.log(y)
    P = (ly - np.diagonal(ly, axis1=1, axis2=2)[:, :, None]) / beta
    R = P[:, :, 1:] - P[:, :, :1]  # (n, T, T - 1)
    norms = np.linalg.norm(R, axis=2)
    top = np.argmax(norms, axis=1)
    e = R[np.arange(n), top] / norms[np.arange(n), top][:, None]
    e *= np.where(e[:, :1] < 0, -1.0, 1.0)
    qh = np.einsum("nab,nb->na", R, e)
    resid = np.linalg.norm(R - qh[:, :, None] * e[:, None, :], axis=(1, 2))
    bad = ~(resid <= 1e-6 * (1.0 + np.linalg.norm(R, axis=(1, 2))))
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ChannelError("y", f"sample {i}: {_STATUS[2][1]} (the log-ratios are not of rank one q d^T)")
    return np.ascontiguousarray(np.concatenate([qh, e], axis=1))


def _budget(name: str, value, default: int) -> int:
    """A per-sample budget: a positive integer (None: the default); otherwise one error naming it."""
    if value is None:
        return int(default)
    if isinstance(value, bool) or not (isinstance(value, int | np.integer) and value >= 1):
        raise ChannelError(name, f"must be a positive integer, got {value!r}")
    return int(value)


class Denoiser:
    """Compiled batch denoiser of a :class:`~aimsym.model.Model`.

    ``den(y, omega, V)`` with y (..., *output_shape), omega (..., p, T), V (p, p) or (..., p, p).
    """

    def __init__(self, model, *, nodes: int | None = None, adapt: int | None = None, inflate: float = 1.0,
                 polar: tuple[int, int] | None | str = "auto", check_tol: float = GH_CHECK_TOL,
                 tol: float | None | str = "auto", polar_map: str = DEFAULT_POLAR_MAP, rule: str = "auto",
                 max_regions: int | None = None, max_combinations: int | None = None,
                 mean_tol: float | None = None):
        # an explicit Gauss-Hermite size is a request for that rule (e.g. the solvers' fast
        # low-accuracy settings); the polar rule is the default only when neither is given
        defaults = nodes is None and isinstance(polar, str)
        if polar_map not in DEFAULT_POLAR:
            raise ChannelError("polar_map", f"must be one of {sorted(DEFAULT_POLAR)}; got {polar_map!r}")
        self.polar_map = polar_map
        # rule="modal": the mode-centred adaptive cubature (``aimsym.denoise.modal``) on the exact path,
        # any reduced dimension, always error-controlled (tol defaults to DEFAULT_TOL)
        if rule not in ("auto", "modal"):
            raise ChannelError("rule", f"must be 'auto' or 'modal'; got {rule!r}")
        self.rule = rule
        from .chamber import MAX_COMBINATIONS, certified_default
        from .modal import MAX_REGIONS
        # budgets per sample: adaptive-cubature regions, and the chamber rule's node combinations per
        # level (its finest level within the budget)
        self.max_regions = _budget("max_regions", max_regions, MAX_REGIONS)
        self.max_combinations = _budget("max_combinations", max_combinations, MAX_COMBINATIONS)
        # rule="modal": a target for the mean estimate of a call's batch (refinement of the samples
        # still above tol ends once it holds; the state evolution's error is a mean over its points)
        self.mean_tol = validate_tol(mean_tol, "mean_tol")
        if isinstance(polar, str):
            if polar != "auto":
                raise ChannelError("polar", f"must be (angle nodes, radial nodes), None or 'auto'; got {polar!r}")
            polar = DEFAULT_POLAR[polar_map] if nodes is None else None
        self.model = model
        self.kernels = model.kernels
        self._pT = (model.p, model.tokens)  # (spec properties, recomputed on every access)
        self.params = model.params_array()
        self.dim = int(self.kernels.INTEGRAL_DIM)
        self.path = {"noisy": "generic", "halfspace": "closed-form"}.get(self.kernels.PATH, "exact")
        # one hardmax layer: the output of each wedge (by the sign of beta)
        self._patterns = layer_patterns(self.kernels, self.params) if self.kernels.PATH == "hardmax-wedge" else None
        if self.kernels.PATH in MODAL_ONLY:  # (the tensor rules do not carry a marginalised block)
            rule = self.rule = "modal"
        # the certified rule (the chamber rule within ``aimsym.denoise.modal``) by default where
        # the model has attention blocks and no polar rule serves it
        if rule == "auto" and defaults and certified_default(self.kernels):
            rule = self.rule = "modal"
        if rule == "modal" and not (self.path == "exact" and self.kernels.PATH in ("attention-rank1", "solve",
                                                                                   *MODAL_ONLY) and self.dim > 0):
            raise ChannelError("rule", f"'modal' needs an exact reduction with free entries (model {model.name!r} has "
                                       f"path {self.kernels.PATH!r}, {self.dim} free entries)")
        if self.path == "generic" and not model.noise > 0:
            raise ChannelError(
                "noise",
                f"model {model.name!r} has no exact reduction ({model.reduction_reason}); "
                "the generic path needs output noise Delta > 0 (set noise in the model file)",
            )
        if nodes is None:
            nodes = (POLAR_MODEL_GH_NODES if (polar is not None and len(self.kernels.POLAR_ANGLES))
                     else DEFAULT_NODES.get(self.dim, 4))
        if adapt is None:
            adapt = DEFAULT_ADAPT.get(self.dim, 0)
        if not (isinstance(nodes, int | np.integer) and 2 <= nodes <= 256):
            # (numpy's Gauss-Hermite weights overflow beyond a few hundred nodes)
            raise ChannelError("nodes", f"must be an integer in 2..256, got {nodes!r}")
        if not (isinstance(adapt, int | np.integer) and 0 <= adapt <= 10):
            raise ChannelError("adapt", f"must be an integer in 0..10, got {adapt!r}")
        self.nodes = int(nodes)
        self.adapt = int(adapt)
        self.inflate = float(inflate)
        self.polar = None
        if polar is not None and len(self.kernels.POLAR_ANGLES):
            if not (len(polar) == 2 and all(isinstance(v, int | np.integer) and v >= 2 for v in polar)):
                raise ChannelError("polar", f"must be (angle nodes per sector, radial nodes), each >= 2; got {polar!r}")
            self.polar = (int(polar[0]), int(polar[1]))
        self.check_tol = float(check_tol)
        # the default denoiser controls its error (DEFAULT_TOL); explicit rule sizes (the solvers'
        # fast settings) run the fixed rule unless a tol is also given
        if isinstance(tol, str):
            if tol != "auto":
                raise ChannelError("tol", f"must be a positive number, None or 'auto'; got {tol!r}")
            tol = DEFAULT_TOL if ((defaults or rule == "modal") and self.path == "exact"
                                  and (self.dim > 0 or self.kernels.PATH == "hardmax-wedge")) else None
        self.tol = validate_tol(tol)
        self._rule_cache = {}
        self._tables = {}  # node tables of the mapped polar rule per rule size (``_node_tables``)
        self._table_lock = threading.Lock()
        # the adaptation passes only need the posterior's mean and covariance: a coarser rule
        self._rule_coarse = (None if self.rule == "modal"  # (tensor rules are not used; k can be large)
                             else gauss_hermite_rule(self.dim, max(6, self.nodes // 2)))

    @property
    def accuracy(self) -> dict:
        acc = {"path": self.path, "integral_dim": self.dim, "nodes_per_dim": self.nodes,
                "adapt": self.adapt, "inflate": self.inflate, "polar": self.polar,
                "polar_map": self.polar_map if self.polar else None,
                "polar_radius": POLAR_RADIUS if self.polar else None,
                # the mapped rule's full-disk radius is rounded up to this grid (node tables)
                "polar_radius_grid": (f"2^(k/{self.kernels.POLAR_GRID})"
                                      if self.polar and self.polar_map == "sinh" else None),
                "gh_check_tol": self.check_tol if self.polar else None, "tol": self.tol,
                "max_refine": MAX_REFINE, "rule": self.rule,
                "max_regions": self.max_regions if self.rule == "modal" else None,
                "max_combinations": self.max_combinations if self.rule == "modal" else None,
                "mean_tol": self.mean_tol if self.rule == "modal" else None,
                # the polar domain is sized on the posterior of u (``_sized_run``)
                "polar_domain": ({"edge_tol": EDGE_TOL, "growth": DOMAIN_GROWTH, "max_growth": MAX_DOMAIN_GROWTH,
                                  "fits": DOMAIN_FITS, "posterior_off_sd": POSTERIOR_OFF} if self.polar else None)}
        if self.kernels.PATH == "hardmax-wedge":  # Gauss-Legendre nodes per graded angle piece (x1.5 per refinement)
            acc["wedge"] = DEFAULT_WEDGE
        return acc

    def _polar_tables(self, sizes):
        """Legendre rule: (cos, sin, log weight) of every angle node over the sectors; both rules:
        the radial Gauss-Legendre nodes and weights on [-1, 1]; mapped rule: the angle's
        Gauss-Legendre nodes and weights on [-1, 1] (mapped per radius in the driver)."""
        th, w_th, rr, w_r = polar_rule(sizes)
        e = np.zeros(0)
        if sizes is None:
            return e, e, e, rr, w_r, e, e
        if self.polar_map == "sinh":
            return e, e, e, rr, w_r, th, w_th
        edges = np.asarray(self.kernels.POLAR_ANGLES)
        half = 0.5 * np.diff(edges)[:, None]
        ang = (0.5 * (edges[:-1] + edges[1:]))[:, None] + half * th[None, :]
        lw = np.log(half * w_th[None, :])
        return (np.ascontiguousarray(np.cos(ang).ravel()), np.ascontiguousarray(np.sin(ang).ravel()),
                np.ascontiguousarray(lw.ravel()), rr, w_r, e, e)

    def observe(self, y: np.ndarray) -> np.ndarray:
        """Observed reduced quantity (h for attention models, else y), with manifold checks."""
        k = self.kernels
        rows, cols = k.LINK_SHAPE
        y = np.asarray(y, dtype=float)
        out_shape = tuple(self.model.output_shape)
        if y.shape[len(y.shape) - len(out_shape):] != out_shape:
            raise ChannelError("y", f"expected shape (..., {', '.join(map(str, out_shape))}), got {y.shape}")
        batch = y.shape[: y.ndim - len(out_shape)]
        yf = np.ascontiguousarray(y.reshape(-1, rows, cols))
        if not np.all(np.isfinite(yf)):
            raise ChannelError("y", "contains NaN or infinite entries")
        if k.OBS_KIND in ("h", "qd"):
            if k.LAST_ACTIVATION == "softmax":
                rs = yf.sum(axis=2)
                if np.any(np.abs(rs - 1) > 1e-9) or np.any(yf <= 0):
                    bad = int(np.argmax(np.any(np.abs(rs - 1) > 1e-9, axis=1) | np.any(yf <= 0, axis=(1, 2))))
                    raise ChannelError("y", f"sample {bad}: softmax rows must be positive and sum to 1")
            n_obs = k.T
        else:
            n_obs = rows * cols
        if k.OBS_KIND == "qd":
            return observe_untied(yf, float(k.last_beta(self.params))).reshape(*batch, 2 * k.T - 1)
        obs = np.empty((yf.shape[0], n_obs))
        status = np.empty(yf.shape[0], dtype=np.int64)
        k.observe_batch(yf, self.params, obs, status)
        self._raise(status)
        return obs.reshape(*batch, n_obs)

    def __call__(self, y, omega, V, *, error: bool = False, obs=None, tol: float | None | str = "default",
                 max_refine: int = MAX_REFINE) -> DenoiserOutput:
        """``obs`` (optional, from ``model.observation(Z)``) replaces y: the reduced observed
        quantity, e.g. h for attention models when the output softmax underflows. ``error``:
        estimate the error from rules of 3/4 the size; ``tol``: refine (rules x4/3) the samples
        whose estimated error exceeds tol, at most ``max_refine`` times (see the module doc)."""
        p, T = self._pT
        omega = np.asarray(omega, dtype=float)
        V = np.asarray(V, dtype=float)
        if omega.shape[-2:] != (p, T):
            raise ChannelError("omega", f"expected shape (..., {p}, {T}), got {omega.shape}")
        if V.shape[-2:] != (p, p):
            raise ChannelError("V", f"expected shape (..., {p}, {p}), got {V.shape}")
        if not np.all(np.isfinite(omega)):
            raise ChannelError("omega", "contains NaN or infinite entries")
        if not np.all(np.isfinite(V)):
            raise ChannelError("V", "contains NaN or infinite entries")
        asym = float(np.max(np.abs(V - np.swapaxes(V, -1, -2)), initial=0.0))
        if asym > 1e-8 * max(1.0, float(np.max(np.abs(V), initial=0.0))):  # (the kernels read one triangle)
            raise ChannelError("V", f"must be symmetric, got max |V - V^T| = {asym:.3g}; pass (V + V^T) / 2")
        lead = [omega.shape[:-2], V.shape[:-2]]
        if obs is not None:
            lead.append(np.shape(obs)[:-1])
        elif y is not None:
            lead.append(np.shape(y)[:max(0, np.ndim(y) - len(self.model.output_shape))])
        try:
            np.broadcast_shapes(*lead)
        except ValueError:
            raise ChannelError("y", f"batch shapes do not match: y (or obs) {lead[-1] if len(lead) > 2 else ()}, "
                                    f"omega {lead[0]}, V {lead[1]}; they must be equal or broadcast") from None
        tol = self.tol if (isinstance(tol, str) and tol == "default") else validate_tol(tol)
        if isinstance(max_refine, bool) or not (isinstance(max_refine, int | np.integer) and 0 <= max_refine <= 10):
            raise ChannelError("max_refine", f"must be an integer in 0..10, got {max_refine!r}")
        if self.kernels.PATH == "halfspace":
            return self._halfspace(y, omega, V)
        if self.kernels.PATH == "hardmax-wedge":
            return self._wedges(y, omega, V, error, tol, max_refine)
        if self.kernels.PATH == "hardmax-wedge-mixed":  # (model.denoiser() builds it directly)
            from .hardmax_channel import HardmaxMixedDenoiser

            return HardmaxMixedDenoiser(self.model, polar=self.polar)(y, omega, V, error=error, obs=obs, tol=tol,
                                                                      max_refine=max_refine)
        obs = self.observe(y) if obs is None else np.asarray(obs, dtype=float)
        batch = np.broadcast_shapes(obs.shape[:-1], omega.shape[:-2], V.shape[:-2] if V.ndim > 2 else ())
        obs_f = np.ascontiguousarray(np.broadcast_to(obs, (*batch, obs.shape[-1])).reshape(-1, obs.shape[-1]))
        om_f = np.ascontiguousarray(np.broadcast_to(omega, (*batch, p, T)).reshape(-1, p, T))
        if V.ndim == 2:
            V_f = np.ascontiguousarray(V.reshape(1, p, p))
        else:
            V_f = np.ascontiguousarray(np.broadcast_to(V, (*batch, p, p)).reshape(-1, p, p))
        V_f = 0.5 * (V_f + np.swapaxes(V_f, 1, 2))
        if self.rule == "modal":
            return self._modal(obs_f, om_f, V_f, batch, DEFAULT_TOL if tol is None else tol)
        g, dg, extra, dom = self._sized_run(obs_f, om_f, V_f, self._rules(0))
        err = None
        if error or tol is not None:
            err = self._estimate(obs_f, om_f, V_f, g, dg, extra, 0, dom)
            if tol is not None:
                self._refit_failing(obs_f, om_f, V_f, g, dg, extra, dom, err, tol)
            level = 0
            while tol is not None and level < max_refine:
                bad = np.flatnonzero(~(err <= tol))
                if bad.size == 0:
                    break
                level += 1
                rules = self._rules(level)
                if rules is None:  # the rule cannot grow further (tensor size cap)
                    break
                gb, dgb, eb = self._run(obs_f[bad], om_f[bad], _rows(V_f, bad), rules, dom[bad])
                # new estimate: the larger rule against the previous one (or its own check)
                eb_err = difference(gb, dgb, g[bad], dg[bad], eb[:, 0], extra[bad, 0])
                gh = np.isfinite(eb[:, 2])
                eb_err[gh] = eb[gh, 2]
                err[bad] = np.maximum(eb_err, eb[:, 3])
                g[bad], dg[bad], extra[bad] = gb, dgb, eb
            if tol is not None and np.any(~(err <= tol)):
                warnings.warn(f"denoiser: {int(np.sum(~(err <= tol)))} of {len(err)} samples did not reach tol={tol:g} "
                              f"(largest estimated error {np.nanmax(err):.1e}; the rule cannot grow further)",
                              RuntimeWarning, stacklevel=2)
            err = err.reshape(batch)
        return DenoiserOutput(
            g_out=g.reshape(*batch, p, T),
            dg_out=dg.reshape(*batch, p, T, p, T),
            log_z_out=extra[:, 0].reshape(batch),
            ess=np.abs(extra[:, 1]).reshape(batch),
            error=err,
            path=self.path,
            polar=(extra[:, 1] < 0).reshape(batch),
        )

    def _modal(self, obs, omega, V, batch, tol) -> DenoiserOutput:
        """The mode-centred adaptive cubature (``aimsym.denoise.modal``): every sample is controlled to
        tol, up to the region budget; the estimate is always returned."""
        from . import modal

        p, T = self._pT
        g, dg, lz, err, evals, hit, status = modal.run(self.kernels, obs, omega, V, self.params, tol=tol,
                                                       max_regions=self.max_regions,
                                                       max_combinations=self.max_combinations, mean_tol=self.mean_tol)
        self._raise(status)
        if np.any(~(err <= tol)):
            why = (f"the batch's mean estimate {np.mean(err):.1e} met mean_tol={self.mean_tol:g}"
                   if mean_target_met(err, self.mean_tol) else
                   f"{int(np.sum(hit & ~(err <= tol)))} stopped at the budget of " + modal.budget_name(self.kernels,
                                                                                          self.max_regions))
            warnings.warn(f"denoiser: {int(np.sum(~(err <= tol)))} of {len(err)} samples did not reach tol={tol:g} "
                          f"(largest estimated error {np.nanmax(err):.1e}; {why})", RuntimeWarning, stacklevel=3)
        return DenoiserOutput(g_out=g.reshape(*batch, p, T), dg_out=dg.reshape(*batch, p, T, p, T),
                              log_z_out=lz.reshape(batch), ess=evals.reshape(batch), error=err.reshape(batch),
                              path=self.path)

    def _halfspace(self, y, omega, V) -> DenoiserOutput:
        """y = sign(z_k) (T = 1): Gaussian truncated to y z_k > 0, in closed form."""
        from scipy.special import log_ndtr

        k = int(self.kernels.SOLVED[0][0])
        y = np.asarray(y, dtype=float)
        if not np.all(np.isin(y, (-1.0, 1.0))):
            raise ChannelError("y", "the sign channel's outputs must be -1 or +1")
        w = omega[..., 0]  # (..., p)
        Vb = np.broadcast_to(V, (*w.shape[:-1], *V.shape[-2:]))
        if np.any(np.linalg.eigvalsh(Vb) <= 0):
            raise ChannelError("V", "is not symmetric positive definite")
        vkk = Vb[..., k, k]
        kappa = y * w[..., k] / np.sqrt(vkk)
        log_z = log_ndtr(kappa)
        r = np.exp(-0.5 * kappa**2 - 0.5 * np.log(2 * np.pi) - log_z)  # phi/Phi, stable in the tail
        g = np.zeros(w.shape)
        g[..., k] = y * r / np.sqrt(vkk)
        dg = np.zeros((*w.shape, w.shape[-1]))
        dg[..., k, k] = -(kappa * r + r**2) / vkk
        p = w.shape[-1]
        return DenoiserOutput(g_out=g[..., None], dg_out=dg.reshape(*w.shape[:-1], p, 1, p, 1),
                              log_z_out=log_z, ess=np.full(log_z.shape, np.inf), path=self.path)

    def _wedges(self, y, omega, V, error: bool, tol, max_refine: int) -> DenoiserOutput:
        """One hardmax layer, T = 2, rank one: y fixes the signs of z_1 (z_1 - z_2) and
        z_2 (z_2 - z_1), i.e. a union of the six wedges cut by z_1 = 0, z_2 = 0, z_1 = z_2.
        On each wedge the radial integrals are closed forms and the angle is integrated on
        pieces graded away from the integrand's peak (the hardmax driver's ``hm_wedge``, shared
        with the hardmax-last-layer path). The error estimate is the difference to the rule of
        3/4 the wedge nodes, relative to the prior's scales of g_out and dg_out (1 / sqrt(v),
        1 / v) when v < 1, at least the rounding (WEDGE_ROUNDING); ``tol`` refines (wedge nodes
        x1.5) where the rule's part of it is above tol (a sample held above tol by rounding alone
        keeps its rule and its estimate)."""
        mask = output_mask(y, self._patterns)
        batch = np.broadcast_shapes(mask.shape[:-1], omega.shape[:-2], V.shape[:-2] if V.ndim > 2 else ())
        mask = np.ascontiguousarray(np.broadcast_to(mask, (*batch, 6)).reshape(-1, 6))
        w = np.broadcast_to(omega, (*batch, 1, 2)).reshape(-1, 2)
        v = np.broadcast_to(V, (*batch, 1, 1)).reshape(-1).copy()
        if np.any(~(v > 0)):
            raise ChannelError("V", "must be positive")
        wedge = DEFAULT_WEDGE
        g, dg, lz = one_layer_wedges(self.kernels, mask, w, v, wedge)
        err = None
        if error or tol is not None:
            # the rule's part of each estimate (the rest is rounding, which refining cannot lower)
            rule_err = np.zeros(len(v))

            def estimate(idx, g, dg, lz, wedge):  # against the rule of 3/4 the wedge nodes
                vi = v[idx]
                g2, dg2, lz2 = one_layer_wedges(self.kernels, mask[idx], w[idx], vi, wedge - wedge // 4)
                # on the scales of g_out and dg_out (1 / sqrt(v), 1 / v: the prior's), at least the
                # rounding: of the angles, at R = |omega| / sqrt(v) sd from the origin, and of
                # moments about omega that lie |d| = sqrt(v) |g| sd from it
                R = np.sqrt((w[idx] ** 2).sum(axis=1) / vi)
                rounding = WEDGE_ROUNDING * np.maximum(1.0 + R + vi * (g**2).sum(axis=1), np.abs(lz))
                rule_err[idx] = difference(g, dg, g2, dg2, lz, lz2, np.maximum(1.0, vi**-0.5),
                                           np.maximum(1.0, 1.0 / vi))
                return np.maximum(rule_err[idx], rounding)

            err = estimate(slice(None), g, dg, lz, wedge)

            def redo(bad, level):  # wedge nodes x1.5 per level, where the rule's part is above tol
                bad = np.asarray(bad)
                out = err[bad].copy()
                sel = rule_err[bad] > tol
                if np.any(sel):
                    idx = bad[sel]
                    n = int(np.ceil(DEFAULT_WEDGE * 1.5**level))
                    g[idx], dg[idx], lz[idx] = one_layer_wedges(self.kernels, mask[idx], w[idx], v[idx], n)
                    out[sel] = estimate(idx, g[idx], dg[idx], lz[idx], n)
                return out

            refine_to_tol(err, tol, max_refine, redo)
            err = err.reshape(batch)
        return DenoiserOutput(g_out=g.reshape(*batch, 1, 2), dg_out=dg.reshape(*batch, 1, 2, 1, 2),
                              log_z_out=lz.reshape(batch), ess=np.full(batch, np.inf), error=err, path=self.path)

    def _estimate(self, obs, omega, V, g, dg, extra, level, dom):
        """Error estimate per sample: the Gauss-Hermite check where it was accepted, else the
        difference to rules of 3/4 the size on the same domain; at least the weight share on
        the polar domain's edge (a bound on what the domain leaves out, see EDGE_TOL)."""
        err = extra[:, 2].copy()
        rest = np.flatnonzero(~np.isfinite(err))
        if rest.size:
            g2, dg2, e2 = self._run(obs[rest], omega[rest], _rows(V, rest), self._rules(level, small=True), dom[rest])
            err[rest] = difference(g[rest], dg[rest], g2, dg2, extra[rest, 0], e2[:, 0])
        return np.maximum(err, extra[:, 3])

    def _sized_run(self, obs, omega, V, rules):
        """``_run`` with the polar domain sized on the posterior of u. First on the prior of u
        (centre omega_u, POLAR_RADIUS sd); where the posterior reaches the domain's edge (edge
        weight share > EDGE_TOL) the domain grows (``_grow``) until it holds the posterior, and is
        then fitted to it: centre its mean, scale its largest sd (``_posterior_domain``; a far
        posterior is narrow, so the grown domain resolves it poorly), grown again if needed;
        DOMAIN_FITS times. Returns the results and each sample's domain (for the check and the
        refinements)."""
        dom = self._prior_domain(omega, V)
        g, dg, extra = self._run(obs, omega, V, rules, dom)
        moved = self._grow(obs, omega, V, rules, dom, g, dg, extra, np.arange(omega.shape[0]))
        for _ in range(DOMAIN_FITS if moved.size else 0):
            g[moved], dg[moved], extra[moved], dom[moved] = self._fitted_run(obs[moved], omega[moved], _rows(V, moved),
                                                                             rules, g[moved], dg[moved])
        return g, dg, extra, dom

    def _fitted_run(self, obs, omega, V, rules, g, dg):
        """``_run`` on the domain fitted to the posterior of u of a previous result g, dg
        (``_posterior_domain``), grown where its edge carries weight."""
        dom = self._posterior_domain(omega, V, g, dg)
        g, dg, extra = self._run(obs, omega, V, rules, dom)
        self._grow(obs, omega, V, rules, dom, g, dg, extra, np.arange(omega.shape[0]))
        return g, dg, extra, dom

    def _refit_failing(self, obs, omega, V, g, dg, extra, dom, err, tol):
        """Samples of the polar rule above tol, on the prior's domain, whose posterior mean of u
        lies more than POSTERIOR_OFF prior sd from omega_u: rerun on the domain fitted to the
        posterior (DOMAIN_FITS times) and keep that result where its estimated error is smaller.
        Updates the arrays in place."""
        bad = np.flatnonzero(~(err <= tol) & (extra[:, 1] < 0))
        if bad.size == 0:
            return
        Vb = _rows(V, bad)
        prior = self._prior_domain(omega[bad], Vb)
        shift = self._posterior_mean_u(omega[bad], Vb, g[bad]) - prior[:, :2]
        off = np.hypot(shift[:, 0], shift[:, 1]) > POSTERIOR_OFF * prior[:, 2]
        idx = bad[off & np.all(dom[bad] == prior, axis=1)]
        if idx.size == 0 or DOMAIN_FITS < 1:
            return
        Vi, rules = _rows(V, idx), self._rules(0)
        gi, dgi = g[idx], dg[idx]
        for _ in range(DOMAIN_FITS):
            gi, dgi, ei, di = self._fitted_run(obs[idx], omega[idx], Vi, rules, gi, dgi)
        erri = self._estimate(obs[idx], omega[idx], Vi, gi, dgi, ei, 0, di)
        keep = erri < err[idx]
        k = idx[keep]
        g[k], dg[k], extra[k], dom[k], err[k] = gi[keep], dgi[keep], ei[keep], di[keep], erri[keep]

    def _grow(self, obs, omega, V, rules, dom, g, dg, extra, idx):
        """Grow the domain (kr x DOMAIN_GROWTH) of the samples idx whose edge weight share
        exceeds EDGE_TOL, and rerun them, until none does (at most MAX_DOMAIN_GROWTH times);
        updates dom and the results in place. Returns the samples grown."""
        grown = np.zeros(omega.shape[0], dtype=bool)
        for _ in range(MAX_DOMAIN_GROWTH):
            grow = idx[extra[idx, 3] > EDGE_TOL]
            if grow.size == 0:
                break
            grown[grow] = True
            dom[grow, 3] *= DOMAIN_GROWTH
            g[grow], dg[grow], extra[grow] = self._run(obs[grow], omega[grow], _rows(V, grow), rules, dom[grow])
        return np.flatnonzero(grown)

    def _u_index(self):
        """Layer and token indices of the two free entries u of the polar models."""
        return np.asarray(self.kernels.FREE_K[:2]), np.asarray(self.kernels.FREE_T[:2])

    def _posterior_mean_u(self, omega, V, g):
        """E[u] per sample from g_out: E[z_t] = omega_t + V g_t."""
        fk, ft = self._u_index()
        Vb = np.broadcast_to(V, (omega.shape[0], *V.shape[1:]))
        return (omega + np.einsum("nkj,njt->nkt", Vb, g))[:, fk, ft]

    def _prior_domain(self, omega, V):
        """Polar domain per sample from the prior of u: (omega_u, its largest prior sd, POLAR_RADIUS)."""
        dom = np.zeros((omega.shape[0], 4))
        dom[:, 3] = POLAR_RADIUS
        if not self.kernels.HAS_POLAR:  # (unused)
            return dom
        fk, ft = self._u_index()
        dom[:, :2] = omega[:, fk, ft]
        dom[:, 2] = np.sqrt(np.maximum(V[:, fk, fk].max(axis=1), 0.0))
        return dom

    def _posterior_domain(self, omega, V, g, dg):
        """Polar domain per sample fitted to the posterior of u, from g_out and dg_out:
        E[z_t] = omega_t + V g_t, Cov(z_t, z_s) = V dg[:, t, :, s] V + delta_ts V; centre E[u],
        scale the largest sd of u, POLAR_RADIUS. The scale is at least half the prior sd of u
        given the other entries of its token, 1/sqrt((V^-1)_uu): where the solved row w(u)
        is flat (saturated attention, where a far posterior sits) that is the posterior's
        width, and a poorly resolved first pass can report a much smaller one."""
        fk, ft = self._u_index()
        Vb = np.broadcast_to(V, (omega.shape[0], *V.shape[1:]))
        cov_tt = np.einsum("nka,natbs,nbl->ntksl", Vb, dg, Vb)  # (n, T, p, T, p)
        cu = cov_tt[:, ft[:, None], fk[:, None], ft[None, :], fk[None, :]]
        cu = cu + np.where(ft[:, None] == ft[None, :], Vb[:, fk[:, None], fk[None, :]], 0.0)
        dom = np.empty((omega.shape[0], 4))
        dom[:, :2] = self._posterior_mean_u(omega, V, g)
        sd = np.sqrt(np.maximum(np.linalg.eigvalsh(0.5 * (cu + np.swapaxes(cu, 1, 2)))[:, -1], 0.0))
        cond = 1.0 / np.sqrt(np.linalg.inv(Vb)[:, fk, fk].max(axis=1))
        dom[:, 2] = np.maximum(sd, 0.5 * cond)
        dom[:, 3] = POLAR_RADIUS
        return dom

    def _rules(self, level: int, small: bool = False):
        """Rule set at refinement ``level`` (sizes x REFINE^level; x3/4 when ``small``), cached;
        None when the tensor rule would exceed MAX_TENSOR_NODES or 256 points."""
        key = (level, small)
        if key not in self._rule_cache:
            f = REFINE**level
            shrink = (lambda v: v - v // 4) if small else (lambda v: v)
            n = shrink(int(round(self.nodes * f)))
            if self.dim > 0 and (n > 256 or n**self.dim > MAX_TENSOR_NODES):
                return None
            polar = None if self.polar is None else tuple(shrink(int(round(v * f))) for v in self.polar)
            self._rule_cache[key] = (gauss_hermite_rule(self.dim, n), gauss_hermite_rule(self.dim, n - n // 4),
                                     self._polar_tables(polar))
        return self._rule_cache[key]

    def _run(self, obs, omega, V, rules, dom):
        """One pass of the kernels; dom: each sample's polar domain (c_0, c_1, s, kr: the disk
        |u| <= |c| + kr s, or an annular sector around c; see the driver).
        extra columns: log Z, effective nodes (< 0: polar rule), the Gauss-Hermite check's
        difference (NaN where not used), the weight share on the polar domain's edge."""
        n = omega.shape[0]
        p, T = self._pT
        g = np.empty((n, p, T))
        dg = np.empty((n, p, T, p, T))
        extra = np.empty((n, 4))
        status = np.empty(n, dtype=np.int64)
        (nodes, lw), (nk, lwk), (pc, ps, plw, rr, w_r, xa, wa) = rules
        nc, lwc = self._rule_coarse
        if not len(rr):  # no polar rule: no Gauss-Hermite check either
            nk, lwk = np.zeros((0, max(self.dim, 1))), np.zeros(0)
        dom = np.ascontiguousarray(dom, dtype=float)
        G, gidx = self._node_tables(omega, V, xa, wa, rr, w_r, len(nk) > 0, dom)
        self.kernels.denoise_batch(obs, omega, V, self.params, nodes, lw, nc, lwc, self.adapt, self.inflate,
                                   pc, ps, plw, rr, w_r, dom, self.polar_map == "sinh", xa, wa,
                                   POLAR_KAPPA, POLAR_CRAD, nk, lwk, self.check_tol, G, gidx, g, dg, extra, status)
        self._raise(status)
        return g, dg, extra

    def _node_tables(self, omega, V, xa, wa, rr, w_r, skip_gh, dom):
        """Node tables of the mapped polar rule (driver ``polar_tables``): the full-disk radius is
        rounded up to a grid and the solved row is w = M(u)^{-1} h, so the node geometry and
        M^{-1} are computed once per grid radius and kept for every later sample and call with
        it, instead of per sample. Returns the rule's table array and each sample's table (-1:
        the per-sample kernel, for a domain cut around omega_u or where Gauss-Hermite is tried
        first). Results equal the per-sample kernel's up to rounding (tests)."""
        k = self.kernels
        n = omega.shape[0]
        if not (len(rr) and self.polar_map == "sinh" and k.POLAR_LINEAR_OBS):
            return _NO_TABLES, np.full(n, -1, dtype=np.int64)
        key = np.empty(n, dtype=np.int64)
        k.polar_table_keys(omega, V, dom, skip_gh, key)
        gidx = np.empty(n, dtype=np.int64)
        rule = (len(xa), len(rr), self.params.tobytes())  # (the tables depend on skip and beta too)
        with self._table_lock:
            G, cached, slot = self._tables.get(rule, (_NO_TABLES, _NO_KEYS, _NO_KEYS))
            if k.polar_table_lookup(key, cached, slot, gidx) == 0:
                return G, gidx
            # build the missing tables (a table costs about one sample's nodes and polar_rows)
            new = np.unique(key[gidx == -2])
            rows, NT = k.POLAR_TABLE_ROWS, k.polar_table_nodes(len(xa), len(rr))
            room = MAX_TABLE_BYTES // (8 * rows * NT)
            used = len(cached)
            if used + new.size > room:  # memory cap: start the cache afresh with this batch's tables
                cached, slot, used = _NO_KEYS, _NO_KEYS, 0
                new = np.unique(key[key != k.NO_TABLE])[:room]
            if used + new.size > G.shape[0] or used == 0:  # grow (doubling), keeping the cached tables
                grown = np.empty((min(room, max(2 * G.shape[0], used + new.size)), rows, NT))
                grown[:used] = G[:used]
                G = grown
            k.polar_tables(new, self.params, xa, wa, rr, w_r, POLAR_KAPPA, POLAR_CRAD, G[used:used + new.size])
            allk = np.concatenate([cached, new])
            alls = np.concatenate([slot, np.arange(used, used + new.size)])
            order = np.argsort(allk)
            cached, slot = allk[order], alls[order]
            self._tables[rule] = (G, cached, slot)
            k.polar_table_lookup(key, cached, slot, gidx)
        gidx[gidx == -2] = -1  # beyond the memory cap: the per-sample kernel
        return G, gidx

    @staticmethod
    def _raise(status):
        raise_on_status(status != 0, status, _STATUS)
