"""Denoiser for a hardmax last layer after a tied rank-one first layer, T = 2 (reduction kind
``hardmax-wedge-mixed``; theory section 3, region constraints).

With u = z_1 (first-layer index, both tokens) and w = z_2, the last layer sees
v = M_1(u) w, M_1(u) = c I + S_1(u), and y = hardmax(beta v v^T) reveals the signs of
v_1 (v_1 - v_2) and v_2 (v_2 - v_1): v lies in a union W_y of the six wedges cut by v_1 = 0,
v_2 = 0, v_1 = v_2 (two opposite wedges for each of the three possible patterns; the
anti-diagonal pattern has probability zero). Hence

    Z_out(y; omega, V) = P(y) = int du N(u; omega_u, V_uu I) P(w in M_1(u)^{-1} W_y | u),

w | u ~ N(m(u), s^2 I) with m_t = omega_{w,t} + (V_uw / V_uu)(u_t - omega_{u,t}) and
s^2 = V_ww - V_uw^2 / V_uu (tokens independent, so the conditional is isotropic). The image of
a wedge under M_1(u)^{-1} is a wedge; on it the probability and the first two moments of w are
a radial closed form integrated over the angle (graded Gauss-Legendre, ``wedge`` nodes per
piece). The outer integral over u uses a polar rule (``polar`` = angle nodes per sector, radial
nodes) on the disk (or annular sector, when omega_u is far from the origin) holding the prior
of u to 9 standard deviations, cut on the lines u_1 = 0, u_2 = 0, u_1 = u_2 where the first
layer's attention switches. ``log_z_out`` is the log probability of y (normalised: the three
possible outputs sum to one). g_out and dg_out come from the posterior mean and covariance of Z.

The numeric driver is :mod:`aimsym.denoise.hardmax_template` (appended to the generated module with
the model's ``mixing`` kernel).
"""

from __future__ import annotations

import numpy as np

from ..errors import ChannelError
from .output import DenoiserOutput, raise_on_status, validate_tol

# outer polar rule (angle nodes per sector, radial nodes) and Gauss-Legendre nodes per graded
# angular piece of a wedge; about 1e-9 relative at moderate V (docs/denoiser.md)
DEFAULT_POLAR = (16, 40)
DEFAULT_WEDGE = 10
# adaptive outer rule (when a tol is given): nodes per direction of a region's tensor rule
# (Fejer type 2, nested: the odd ones form the coarse rule) and the region budget per sample
ADAPTIVE_NODES = 15
DEFAULT_MAX_REGIONS = 600
# times the wedge rule is refined (x1.5) for samples whose inner part of the estimate is above tol / 2
WEDGE_LEVELS = 3
# the adaptive rule's tol when an error estimate is asked for without a tol
ERROR_TOL = 1e-6
# v-plane wedges: edges (0, 1, 2, 4, 5, 6, 8) x pi/4 (same order as HM_EDGES in the driver)
_EDGES = np.array([0.0, 1.0, 2.0, 4.0, 5.0, 6.0, 8.0]) * np.pi / 4

_STATUS = {
    1: ("V", "is not symmetric positive definite"),
    3: ("y", "has zero likelihood under the model at this omega, V (or M_1 is singular everywhere)"),
    4: ("omega", "gave a non-finite posterior weight (|omega| or 1/V too large)"),
}


def fejer2(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Fejer's second rule on [-1, 1] (nodes cos(k pi / (n + 1)), k = 1..n, ascending): open and
    nested (for odd n, the rule of (n - 1) / 2 nodes is the odd-indexed nodes)."""
    th = np.arange(1, n + 1) * np.pi / (n + 1)
    j = np.arange(1, (n + 1) // 2 + 1)
    w = 4 * np.sin(th) / (n + 1) * np.sum(np.sin(np.outer(th, 2 * j - 1)) / (2 * j - 1), axis=1)
    return np.cos(th)[::-1].copy(), w[::-1].copy()


def wedge_patterns(beta_sign: float) -> np.ndarray:
    """(6, 2, 2): the hardmax output of each v-plane wedge (beta of the given sign)."""
    out = np.empty((6, 2, 2))
    for k, (a0, a1) in enumerate(zip(_EDGES[:-1], _EDGES[1:])):
        e = np.array([np.cos((a0 + a1) / 2), np.sin((a0 + a1) / 2)])
        A = beta_sign * np.outer(e, e)
        out[k] = (A == A.max(axis=1, keepdims=True)).astype(float)
    return out


def layer_patterns(kernels, params) -> np.ndarray:
    """``wedge_patterns`` of the model's hardmax layer (by the sign of its beta; beta must be
    finite and non-zero)."""
    beta = float(kernels.last_beta(params))
    if not (np.isfinite(beta) and beta != 0.0):
        raise ChannelError("beta", f"the hardmax layer's beta must be finite and non-zero, got {beta}")
    return wedge_patterns(np.sign(beta))


def output_mask(y, patterns) -> np.ndarray:
    """(..., 6) boolean: the wedges (of ``wedge_patterns``) whose hardmax output is y; checks y."""
    y = np.asarray(y, dtype=float)
    if y.shape[-2:] != (2, 2):
        raise ChannelError("y", f"expected shape (..., 2, 2), got {y.shape}")
    if not np.all(np.isfinite(y)):
        raise ChannelError("y", "contains NaN or infinite entries")
    if not np.all(np.isin(y, (0.0, 1.0))) or np.any(y.sum(axis=-1) != 1):
        raise ChannelError("y", "a hardmax output must have rows with a single 1 and zeros elsewhere")
    m = np.all(y[..., None, :, :] == patterns, axis=(-2, -1))
    if not np.all(m.any(axis=-1)):
        bad = int(np.argmax(~m.reshape(-1, 6).any(axis=1)))
        raise ChannelError("y", f"sample {bad}: this hardmax pattern has probability zero under the model "
                                f"(possible: {', '.join(str(p.astype(int).tolist()) for p in np.unique(patterns, axis=0))})")
    return m


def one_layer_wedges(kernels, mask, w, v, wedge: int):
    """One hardmax layer (kind hardmax-wedge): z ~ N(w, v I) in the plane restricted to the
    wedges in mask (n, 6); returns g_out (n, 2), dg_out (n, 2, 2), log_z_out (n), from the
    truncated moments of z - w in units of sqrt(v) (``hm_one_layer_batch``, ``wedge`` nodes per piece)."""
    n = len(w)
    sv = np.sqrt(v)
    res = np.empty((n, 6))
    status = np.empty(n, dtype=np.int64)
    kernels.hm_one_layer_batch(np.ascontiguousarray(w / sv[:, None]), mask, *np.polynomial.legendre.leggauss(wedge),
                               res, status)
    if np.any(status):
        i = int(np.flatnonzero(status)[0])
        raise ChannelError("y", f"sample {i}: has zero likelihood at this omega, V (|omega| / sqrt(V) too large)")
    d = res[:, 1:3]  # E[x] - mu, x = z / sqrt(v), mu = w / sqrt(v) (no cancellation when |mu| is large)
    dd = np.stack([res[:, 3], res[:, 4], res[:, 4], res[:, 5]], axis=1).reshape(n, 2, 2)
    cov = dd - np.einsum("ni,nj->nij", d, d)  # of x (= that of z over v)
    g = d / sv[:, None]
    dg = (cov - np.eye(2)) / v[:, None, None]
    return g, dg, res[:, 0].copy()


def _sizes(value, name, default, length):
    if value is None or (isinstance(value, str) and value == "auto"):
        return default
    if length == 0:
        if isinstance(value, int | np.integer) and not isinstance(value, bool) and 2 <= value <= 128:
            return int(value)
        raise ChannelError(name, f"must be an integer in 2..128, got {value!r}")
    if (isinstance(value, tuple | list) and len(value) == length
            and all(isinstance(v, int | np.integer) and not isinstance(v, bool) and 2 <= v <= 256 for v in value)):
        return tuple(int(v) for v in value)
    raise ChannelError(name, f"must be (angle nodes per sector, radial nodes), integers in 2..256; got {value!r}")


class HardmaxMixedDenoiser:
    """``den(y, omega, V)`` for models of reduction kind ``hardmax-wedge-mixed``: y (..., 2, 2)
    hardmax outputs, omega (..., 2, 2), V (2, 2) or (..., 2, 2).

    Accuracy: ``polar`` (angle nodes per sector, radial nodes) for the outer integral over the
    first-layer index, ``wedge`` Gauss-Legendre nodes per angular piece of a wedge.
    ``nodes``, ``adapt``, ``inflate``, ``check_tol`` and ``max_refine`` (settings of other
    paths, passed by the solvers) are accepted and not used here.

    Without a tol and ``error=False`` the outer rule is the fixed polar rule (fast, its error
    not estimated). With a ``tol`` (the constructor's or the call's; ``error=True`` alone means
    tol = ERROR_TOL) the outer integral is adaptive:
    rectangles in (angle, radius) of the polar pieces, each with a nested tensor rule
    (``ADAPTIVE_NODES`` Fejer nodes per direction and its odd half), the one contributing most
    to the estimate bisected until the estimate meets tol or ``max_regions`` regions are used.
    The estimate sums, over the regions, the change of g_out, dg_out and log_z_out from the
    coarse to the fine rule (outer error) and from ``wedge`` to 3/4 of it on the coarse nodes
    (inner error), in absolute value, per sample relative to max(1, the size of g_out and of
    dg_out) and absolute for log_z_out; it is what ``error`` reports. Samples whose inner part
    stays above tol / 2 are redone with x1.5 the wedge nodes. The adaptive rule follows
    the steps of P(y | u) in u when the last layer is nearly known (width ~ sqrt(V_ww)), which
    no fixed polar rule resolves: the fixed rule's difference to a rule of 3/4 its size missed
    the actual error there at 6 of 100 points (up to 5.4x), so this path estimates errors only
    with the adaptive rule.
    """

    path = "exact"

    def __init__(self, model, *, polar="auto", wedge=None, nodes=None, adapt=None, inflate=None, check_tol=None,
                 tol=None, max_regions=DEFAULT_MAX_REGIONS):
        self.model = model
        self.kernels = model.kernels
        if self.kernels.PATH != "hardmax-wedge-mixed":
            raise ChannelError("model", f"{model.name!r} is not a hardmax-last-layer model (path {self.kernels.PATH!r})")
        self.params = model.params_array()
        self.dim = int(self.kernels.INTEGRAL_DIM)
        self.polar = _sizes(polar, "polar", DEFAULT_POLAR, 2)
        self.wedge = _sizes(wedge, "wedge", DEFAULT_WEDGE, 0)
        self.tol = validate_tol(tol)  # the calls' default tol (None: the fixed rule, no estimate)
        self.patterns = layer_patterns(self.kernels, self.params)
        if not (isinstance(max_regions, int | np.integer) and not isinstance(max_regions, bool)
                and 1 <= max_regions <= 100_000):
            raise ChannelError("max_regions", f"must be an integer in 1..100000, got {max_regions!r}")
        self.max_regions = int(max_regions)
        self._rules = {}

    @property
    def accuracy(self) -> dict:
        outer = (f"adaptive polar rule in u = z_1 (regions of {ADAPTIVE_NODES}^2 nested Fejer nodes, at most "
                 f"{self.max_regions})" if self.tol is not None else "polar rule in u = z_1")
        return {"path": self.path, "integral_dim": self.dim, "polar": self.polar, "wedge": self.wedge, "tol": self.tol,
                "max_regions": self.max_regions,
                "rule": f"{outer} split on u_1 = 0, u_2 = 0, u_1 = u_2; wedges in z_2 by radial "
                        "closed form and graded Gauss-Legendre in angle"}

    def _rule(self, polar, wedge):
        key = (polar, wedge)
        if key not in self._rules:
            leg = np.polynomial.legendre.leggauss
            self._rules[key] = (*leg(polar[0]), *leg(polar[1]), *leg(wedge))
        return self._rules[key]

    def mask(self, y) -> np.ndarray:
        """(..., 6) boolean: the v-plane wedges whose hardmax output is y; checks y."""
        return output_mask(y, self.patterns)

    def __call__(self, y, omega, V, *, error: bool = False, obs=None, tol: float | None | str = "default",
                 max_refine: int = 3):
        if obs is not None:
            raise ChannelError("obs", "the hardmax-last-layer path takes y itself (no reduced observation)")
        tol = self.tol if (isinstance(tol, str) and tol == "default") else validate_tol(tol)
        if not (isinstance(max_refine, int | np.integer) and 0 <= max_refine <= 10):
            raise ChannelError("max_refine", f"must be an integer in 0..10, got {max_refine!r}")
        omega = np.asarray(omega, dtype=float)
        V = np.asarray(V, dtype=float)
        if omega.shape[-2:] != (2, 2):
            raise ChannelError("omega", f"expected shape (..., 2, 2), got {omega.shape}")
        if V.shape[-2:] != (2, 2):
            raise ChannelError("V", f"expected shape (..., 2, 2), got {V.shape}")
        if not np.all(np.isfinite(omega)):
            raise ChannelError("omega", "contains NaN or infinite entries")
        if not np.all(np.isfinite(V)):
            raise ChannelError("V", "contains NaN or infinite entries")
        mask = self.mask(y)
        batch = np.broadcast_shapes(mask.shape[:-1], omega.shape[:-2], V.shape[:-2] if V.ndim > 2 else ())
        mask_f = np.ascontiguousarray(np.broadcast_to(mask, (*batch, 6)).reshape(-1, 6))
        om_f = np.ascontiguousarray(np.broadcast_to(omega, (*batch, 2, 2)).reshape(-1, 2, 2))
        if V.ndim == 2:
            V_f = np.ascontiguousarray(V.reshape(1, 2, 2))
        else:
            V_f = np.ascontiguousarray(np.broadcast_to(V, (*batch, 2, 2)).reshape(-1, 2, 2))
        V_f = 0.5 * (V_f + np.swapaxes(V_f, 1, 2))
        polar, wedge = self.polar, self.wedge
        err = None
        if tol is None and error:
            tol = ERROR_TOL
        if tol is not None:
            g, dg, extra, err = self._run_adaptive(mask_f, om_f, V_f, wedge, tol)
            err = err.reshape(batch)
        else:
            g, dg, extra = self._run(mask_f, om_f, V_f, polar, wedge)
        return DenoiserOutput(
            g_out=g.reshape(*batch, 2, 2),
            dg_out=dg.reshape(*batch, 2, 2, 2, 2),
            log_z_out=extra[:, 0].reshape(batch),
            ess=extra[:, 1].reshape(batch),
            error=err,
            path=self.path,
            polar=np.ones(batch, dtype=bool),
        )

    def _run_adaptive(self, mask, omega, V, wedge, tol):
        """The adaptive outer rule (``hm_adaptive_batch``). Samples whose inner (wedge rule) part
        of the estimate stays above tol / 2 are redone with x1.5 the wedge nodes (at most
        ``WEDGE_LEVELS`` times); warns with the samples whose estimate stayed above tol."""
        n = omega.shape[0]
        g = np.empty((n, 2, 2))
        dg = np.empty((n, 2, 2, 2, 2))
        extra = np.empty((n, 5))
        status = np.empty(n, dtype=np.int64)
        self._adaptive(mask, omega, V, wedge, tol, g, dg, extra, status)
        for level in range(1, WEDGE_LEVELS + 1):
            redo = np.flatnonzero((status == 2) & (extra[:, 4] > 0.5 * tol))
            if not redo.size:
                break
            Vr = V if V.shape[0] == 1 else np.ascontiguousarray(V[redo])
            parts = (np.empty((redo.size, 2, 2)), np.empty((redo.size, 2, 2, 2, 2)), np.empty((redo.size, 5)),
                     np.empty(redo.size, dtype=np.int64))
            self._adaptive(np.ascontiguousarray(mask[redo]), np.ascontiguousarray(omega[redo]), Vr,
                           int(np.ceil(wedge * 1.5**level)), tol, *parts)
            g[redo], dg[redo], extra[redo], status[redo] = parts
        err = extra[:, 2].copy()
        if np.any(status == 2):
            import warnings

            warnings.warn(f"denoiser: {int(np.sum(status == 2))} of {n} samples did not reach tol={tol:g} within "
                          f"{self.max_regions} regions and {WEDGE_LEVELS} wedge refinements (largest estimated error "
                          f"{np.max(err):.1e})", RuntimeWarning, stacklevel=3)
        return g, dg, extra[:, :2], err

    def _adaptive(self, mask, omega, V, wedge, tol, g, dg, extra, status):
        key = ("adaptive", wedge)
        if key not in self._rules:
            leg = np.polynomial.legendre.leggauss
            xf, wf = fejer2(ADAPTIVE_NODES)
            self._rules[key] = (xf, wf, fejer2(ADAPTIVE_NODES // 2)[1], *leg(wedge), *leg(wedge - wedge // 4))
        self.kernels.hm_adaptive_batch(mask, omega, V, self.params, *self._rules[key], float(tol), self.max_regions,
                                       g, dg, extra, status)
        raise_on_status((status != 0) & (status != 2), status, _STATUS)  # (2: above tol, reported by the caller)

    def _run(self, mask, omega, V, polar, wedge):
        n = omega.shape[0]
        g = np.empty((n, 2, 2))
        dg = np.empty((n, 2, 2, 2, 2))
        extra = np.empty((n, 2))
        status = np.empty(n, dtype=np.int64)
        th, w_th, rr, w_r, gx, gw = self._rule(polar, wedge)
        self.kernels.hm_denoise_batch(mask, omega, V, self.params, th, w_th, rr, w_r, gx, gw, g, dg, extra, status)
        raise_on_status(status != 0, status, _STATUS)
        return g, dg, extra
