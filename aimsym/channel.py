"""The output-channel denoiser (theory section 3): g_out, dg_out, log Z_out for a batch.

Normalisation of ``log_z_out``. With normalised Gaussians N(z_t; omega_t, V):

* exact path (reduction found): log of  sum_branches  integral du  prod_t N(z_t; omega_t, V) * J,
  with z = (u, solved entries of the branch) and J the branch's weight factor:
  1/|det M_{L-1}(u)| for attention models (the y <-> h Jacobian is excluded: it does not
  depend on omega or V and cancels in g_out), 1/|dg/dz_solved| for solved free-form links
  (so that log_z_out is then the true log density of y);
* generic path (no reduction): log of the integral of prod_t N(z_t; omega_t, V) N(y; g(Z), Delta I)
  over all of Z, Delta > 0 the output noise variance (the true log density of y).

Accuracy. The integral over the free entries u is a tensor Gauss-Hermite rule with ``nodes``
points per dimension, started on the prior marginal of u and re-centred ``adapt`` times on
each branch's posterior mean and covariance (the adaptation passes use a rule with half as
many points per dimension). Defaults: ``DEFAULT_NODES`` and ``DEFAULT_ADAPT`` by dimension. ``error=True`` repeats the final pass with a
smaller rule (``nodes - nodes // 4`` per dimension) and reports the largest difference of
g_out and dg_out as ``error``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ChannelError

# default Gauss-Hermite points per dimension, by integral dimension (about 1e-9 relative
# on the bundled models at moderate V, see docs/denoiser.md)
DEFAULT_NODES = {1: 80, 2: 48, 3: 20, 4: 12, 5: 7, 6: 5}
# adaptive re-centring pays in one and two dimensions; in three and four the moment-matched
# Gaussian of the (often multimodal) reduced posterior is a worse rule than the prior marginal
DEFAULT_ADAPT = {1: 1, 2: 1}
# polar rule (angle nodes per sector, radial nodes) for two-layer T = 2 models (see the driver);
# about 2e-9 relative at moderate V (docs/denoiser.md)
DEFAULT_POLAR = (18, 48)
MAX_TENSOR_NODES = 200_000

_STATUS = {
    1: ("V", "is not symmetric positive definite"),
    2: ("y", "is not on the model's output manifold (e.g. softmax rows must be positive and sum to 1, "
             "and y must be sigma(beta h h^T) for some h)"),
    3: ("y", "has zero likelihood under the model at this omega, V"),
    4: ("omega", "gave a non-finite posterior weight (|omega| or 1/V too large)"),
}


@dataclass
class DenoiserOutput:
    g_out: np.ndarray  # (..., p, T)
    dg_out: np.ndarray  # (..., p, T, p, T)
    log_z_out: np.ndarray  # (...)
    ess: np.ndarray  # (...) effective number of quadrature nodes of the final pass
    error: np.ndarray | None = None  # (...) estimated absolute error of g_out/dg_out
    path: str = ""
    polar: np.ndarray | None = None  # (...) True where the polar rule was used (else Gauss-Hermite)


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


class Denoiser:
    """Compiled batch denoiser of a :class:`~aimsym.model.Model`.

    ``den(y, omega, V)`` with y (..., *output_shape), omega (..., p, T), V (p, p) or (..., p, p).
    """

    def __init__(self, model, *, nodes: int | None = None, adapt: int | None = None, inflate: float = 1.0,
                 polar: tuple[int, int] | None | str = "auto"):
        # an explicit Gauss-Hermite size is a request for that rule (e.g. the solvers' fast
        # low-accuracy settings); the polar rule is the default only when neither is given
        if isinstance(polar, str):
            if polar != "auto":
                raise ChannelError("polar", f"must be (angle nodes, radial nodes), None or 'auto'; got {polar!r}")
            polar = DEFAULT_POLAR if nodes is None else None
        self.model = model
        self.kernels = model.kernels
        self.params = model.params_array()
        self.dim = int(self.kernels.INTEGRAL_DIM)
        self.path = {"noisy": "generic", "halfspace": "closed-form",
                     "hardmax-wedge": "closed-form"}.get(self.kernels.PATH, "exact")
        if self.path == "generic" and not model.noise > 0:
            raise ChannelError(
                "noise",
                f"model {model.name!r} has no exact reduction ({model.derivation.reduction_reason}); "
                "the generic path needs output noise Delta > 0 (set noise in the model file)",
            )
        if nodes is None:
            nodes = DEFAULT_NODES.get(self.dim, 4)
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
        self._polar_rule = polar_rule(self.polar)
        self._rule = gauss_hermite_rule(self.dim, self.nodes)
        # the adaptation passes only need the posterior's mean and covariance: a coarser rule
        self._rule_coarse = gauss_hermite_rule(self.dim, max(6, self.nodes // 2))
        self._rule_small = None

    @property
    def accuracy(self) -> dict:
        return {"path": self.path, "integral_dim": self.dim, "nodes_per_dim": self.nodes,
                "adapt": self.adapt, "inflate": self.inflate, "polar": self.polar}

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
        if k.OBS_KIND == "h":
            if k.LAST_ACTIVATION == "softmax":
                rs = yf.sum(axis=2)
                if np.any(np.abs(rs - 1) > 1e-9) or np.any(yf <= 0):
                    bad = int(np.argmax(np.any(np.abs(rs - 1) > 1e-9, axis=1) | np.any(yf <= 0, axis=(1, 2))))
                    raise ChannelError("y", f"sample {bad}: softmax rows must be positive and sum to 1")
            n_obs = k.T
        else:
            n_obs = rows * cols
        obs = np.empty((yf.shape[0], n_obs))
        status = np.empty(yf.shape[0], dtype=np.int64)
        k.observe_batch(yf, self.params, obs, status)
        self._raise(status)
        return obs.reshape(*batch, n_obs)

    def __call__(self, y, omega, V, *, error: bool = False, obs=None) -> DenoiserOutput:
        """``obs`` (optional, from ``model.observation(Z)``) replaces y: the reduced observed
        quantity, e.g. h for attention models when the output softmax underflows."""
        p, T = self.model.p, self.model.tokens
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
        if self.kernels.PATH == "halfspace":
            return self._halfspace(y, omega, V)
        if self.kernels.PATH == "hardmax-wedge":
            return self._wedges(y, omega, V)
        obs = self.observe(y) if obs is None else np.asarray(obs, dtype=float)
        batch = np.broadcast_shapes(obs.shape[:-1], omega.shape[:-2], V.shape[:-2] if V.ndim > 2 else ())
        obs_f = np.ascontiguousarray(np.broadcast_to(obs, (*batch, obs.shape[-1])).reshape(-1, obs.shape[-1]))
        om_f = np.ascontiguousarray(np.broadcast_to(omega, (*batch, p, T)).reshape(-1, p, T))
        if V.ndim == 2:
            V_f = np.ascontiguousarray(V.reshape(1, p, p))
        else:
            V_f = np.ascontiguousarray(np.broadcast_to(V, (*batch, p, p)).reshape(-1, p, p))
        V_f = 0.5 * (V_f + np.swapaxes(V_f, 1, 2))
        g, dg, extra = self._run(obs_f, om_f, V_f, self._rule, self._polar_rule)
        err = None
        if error:
            if self._rule_small is None:
                small = None if self.polar is None else tuple(v - v // 4 for v in self.polar)
                self._rule_small = (gauss_hermite_rule(self.dim, self.nodes - self.nodes // 4), polar_rule(small))
            g2, dg2, _ = self._run(obs_f, om_f, V_f, *self._rule_small)
            err = np.maximum(np.abs(g - g2).reshape(len(g), -1).max(axis=1),
                             np.abs(dg - dg2).reshape(len(g), -1).max(axis=1)).reshape(batch)
        return DenoiserOutput(
            g_out=g.reshape(*batch, p, T),
            dg_out=dg.reshape(*batch, p, T, p, T),
            log_z_out=extra[:, 0].reshape(batch),
            ess=np.abs(extra[:, 1]).reshape(batch),
            error=err,
            path=self.path,
            polar=(extra[:, 1] < 0).reshape(batch),
        )

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

    def _wedges(self, y, omega, V, n_angle: int = 40) -> DenoiserOutput:
        """One hardmax layer, T = 2, rank one: y fixes the signs of z_1 (z_1 - z_2) and
        z_2 (z_2 - z_1), i.e. a union of the six wedges cut by z_1 = 0, z_2 = 0, z_1 = z_2.
        On each wedge the radial integrals of r^k N(r e; omega, v I) are closed forms
        (erfcx, stable in the tail); the angle is integrated by Gauss-Legendre (smooth)."""
        from scipy.special import erfcx

        y = np.asarray(y, dtype=float)
        if y.shape[-2:] != (2, 2) or not np.all(np.isin(y, (0.0, 1.0))) or np.any(y.sum(axis=-1) != 1):
            raise ChannelError("y", "a hardmax output must have rows with a single 1 and zeros elsewhere")
        batch = np.broadcast_shapes(y.shape[:-2], omega.shape[:-2], V.shape[:-2] if V.ndim > 2 else ())
        yb = np.broadcast_to(y, (*batch, 2, 2)).reshape(-1, 2, 2)
        w = np.broadcast_to(omega, (*batch, 1, 2)).reshape(-1, 2)
        v = np.broadcast_to(V, (*batch, 1, 1)).reshape(-1)
        if np.any(~(v > 0)):
            raise ChannelError("V", "must be positive")
        edges = np.array([0, 1, 2, 4, 5, 6, 8]) * np.pi / 4
        t, wt = np.polynomial.legendre.leggauss(n_angle)
        n = len(w)
        Z0, Z1, Z2 = np.zeros(n), np.zeros((n, 2)), np.zeros((n, 2, 2))
        logs, terms = [], []
        for a0, a1 in zip(edges[:-1], edges[1:]):
            mid = np.array([np.cos((a0 + a1) / 2), np.sin((a0 + a1) / 2)])
            pattern = np.outer(mid, mid)
            hm = (pattern == pattern.max(axis=1, keepdims=True)).astype(float)  # hardmax of the wedge
            inside = np.all(yb == hm, axis=(1, 2))
            th = 0.5 * (a0 + a1) + 0.5 * (a1 - a0) * t
            e = np.stack([np.cos(th), np.sin(th)], axis=1)  # (n_angle, 2)
            c = w @ e.T  # (n, n_angle)
            a = c / np.sqrt(v)[:, None]
            m = np.sqrt(np.pi / 2) * erfcx(-a / np.sqrt(2))  # sqrt(2 pi) Phi(a) e^{a^2/2}
            I1, I2, I3 = 1 + a * m, a + (1 + a**2) * m, a**2 + 2 + (a**3 + 3 * a) * m  # times e^{-a^2/2}
            logw = -0.5 * ((w**2).sum(axis=1)[:, None] / v[:, None]) + np.log(0.5 * (a1 - a0) * wt)[None, :]
            logs.append(np.where(inside[:, None], logw, -np.inf))
            terms.append((I1, I2, I3, e))
        big = np.max(np.concatenate(logs, axis=1), axis=1)
        if np.any(~np.isfinite(big)):
            raise ChannelError("y", "has zero likelihood under the model (no wedge matches)")
        sv = np.sqrt(v)
        for lw, (I1, I2, I3, e) in zip(logs, terms):
            k = np.exp(lw - big[:, None]) / (2 * np.pi)
            Z0 += (k * I1).sum(axis=1)
            Z1 += np.einsum("na,ai->ni", k * I2, e) * sv[:, None]
            Z2 += np.einsum("na,ai,aj->nij", k * I3, e, e) * v[:, None, None]
        mean = Z1 / Z0[:, None]
        cov = Z2 / Z0[:, None, None] - np.einsum("ni,nj->nij", mean, mean)
        g = (mean - w) / v[:, None]
        dg = cov / v[:, None, None] ** 2 - np.eye(2)[None] / v[:, None, None]
        log_z = big + np.log(Z0)
        return DenoiserOutput(g_out=g.reshape(*batch, 1, 2), dg_out=dg.reshape(*batch, 1, 2, 1, 2),
                              log_z_out=log_z.reshape(batch), ess=np.full(batch, np.inf), path=self.path)

    def _run(self, obs, omega, V, rule, polar):
        n = omega.shape[0]
        p, T = self.model.p, self.model.tokens
        g = np.empty((n, p, T))
        dg = np.empty((n, p, T, p, T))
        extra = np.empty((n, 2))
        status = np.empty(n, dtype=np.int64)
        nodes, lw = rule
        nc, lwc = self._rule_coarse
        th, w_th, rr, w_r = polar
        self.kernels.denoise_batch(obs, omega, V, self.params, nodes, lw, nc, lwc, self.adapt, self.inflate,
                                   th, w_th, rr, w_r, g, dg, extra, status)
        self._raise(status)
        return g, dg, extra

    @staticmethod
    def _raise(status):
        bad = np.flatnonzero(status)
        if bad.size:
            i = int(bad[0])
            fld, msg = _STATUS.get(int(status[i]), ("input", f"failed with status {int(status[i])}"))
            more = f" ({bad.size} samples affected)" if bad.size > 1 else ""
            raise ChannelError(fld, f"sample {i}: {msg}{more}")
