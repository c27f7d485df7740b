"""How fast the finite-L network with separate weights approaches its large-depth limit.

    python -m aimsym.studies.depth_limit [--tau 1] [--beta 1] [--samples 200000] [--json]

For L in (4, 8, 16, 32, 64), with common random numbers across L, it prints L times:
- the bias of the first layers' mixing, max |E M_{L-1} - Mbar| (-> a constant: O(1/L));
- the mean square distance of the output to the limit link, E (y_11 - ybar_11)^2 (O(1/L));
- the last layer's SE information Qhat(q) with the first layers uninformed (their indices
  marginalised by Monte Carlo over their prior) minus the limit's (O(1/L)).
Each with its Monte Carlo standard error (docs/models.md, "Large-depth limit").
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from ..derive import depth
from ..smi.se import mean_and_stderr


def last_layer_information(z: np.ndarray, omega: np.ndarray, V: float, M_true: np.ndarray,
                           M_draws: np.ndarray) -> np.ndarray:
    """sum_t g_out_t^2 per sample for the last layer's index z (n, T) seen through the observed
    h = M_true z (y fixes h up to sign), the unknown first layers marginalised over the draws
    M_draws (K, T, T) of their mixing: the posterior of z is the 2K points +-M_k^{-1} h with
    weights N(.; omega, V) / |det M_k|."""
    h = np.einsum("nab,nb->na", M_true, z)
    pts = np.einsum("kab,nb->nka", np.linalg.inv(M_draws), h)
    pts = np.concatenate([pts, -pts], axis=1)
    log_det = np.tile(-np.log(np.abs(np.linalg.det(M_draws))), 2)
    lw = -((pts - omega[:, None]) ** 2).sum(axis=2) / (2 * V) + log_det
    w = np.exp(lw - lw.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    g = (np.einsum("nk,nka->na", w, pts) - omega) / V
    return (g ** 2).sum(axis=1)


def _mean_se(x: np.ndarray) -> tuple[float, float]:
    mean, se = mean_and_stderr(np.asarray(x, dtype=float))  # (ddof 1: 8 replicas are few)
    return float(mean), float(se)


def convergence(tau: float = 1.0, beta: float = 1.0, depths=(4, 8, 16, 32, 64), samples: int = 200_000,
                q: float = 0.5, se_samples: int = 20_000, draws: int = 512, replicas: int = 8, seed: int = 0,
                activation: str = "softmax") -> dict:
    """Rows of L x (bias, mean square, Qhat difference), each (value, standard error), T = 2."""
    T = 2
    mf = depth.mean_field_mixing(tau, beta, T, activation)
    Mbar = mf.matrix
    rng = np.random.default_rng(seed)
    z_last = rng.standard_normal((samples, T))
    y_bar = depth.attention_output(Mbar, z_last, beta, activation)
    omega = np.sqrt(q) * rng.standard_normal((se_samples, T))
    z_se = omega + np.sqrt(1 - q) * rng.standard_normal((se_samples, T))
    info_bar = last_layer_information(z_se, omega, 1 - q, np.broadcast_to(Mbar, (se_samples, T, T)), Mbar[None])
    rows = []
    for L in depths:
        r = np.random.default_rng([seed, L])
        M = depth.finite_depth_mixing(r.standard_normal((samples, L - 1, T)), tau, beta, activation)
        diff = M - Mbar
        k = np.unravel_index(np.abs(diff.mean(axis=0)).argmax(), (T, T))
        bias = _mean_se(diff[:, k[0], k[1]])
        msq = _mean_se((depth.attention_output(M, z_last, beta, activation)[:, 0, 0] - y_bar[:, 0, 0]) ** 2)
        # the K draws are shared by the samples of a replica: the standard error is taken across
        # replicas with their own draws, so the draws' own randomness is in it
        per = []
        for idx in np.array_split(np.arange(se_samples), replicas):
            M_se = depth.finite_depth_mixing(r.standard_normal((idx.size, L - 1, T)), tau, beta, activation)
            M_draws = depth.finite_depth_mixing(r.standard_normal((draws, L - 1, T)), tau, beta, activation)
            per.append((last_layer_information(z_se[idx], omega[idx], 1 - q, M_se, M_draws) - info_bar[idx]).mean())
        info = _mean_se(np.array(per))
        rows.append({"L": L, "bias_times_L": [L * bias[0], L * bias[1]],
                     "mean_square_times_L": [L * msq[0], L * msq[1]],
                     "q_hat_difference_times_L": [L * info[0], L * info[1]]})
    return {"tau": tau, "beta": beta, "activation": activation, "mbar": mf.to_json(), "q": q,
            "samples": samples, "se_samples": se_samples, "draws": draws, "replicas": replicas, "seed": seed,
            "q_hat_limit": list(_mean_se(info_bar)), "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m aimsym.studies.depth_limit", description=__doc__.splitlines()[0])
    p.add_argument("--tau", type=float, default=1.0)
    p.add_argument("--beta", type=float, default=1.0)
    p.add_argument("--samples", type=int, default=200_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = convergence(args.tau, args.beta, samples=args.samples, seed=args.seed)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    M = out["mbar"]["matrix"]
    print(f"Mbar(tau={args.tau:g}, beta={args.beta:g}): diagonal {M[0][0]:.10f}, off-diagonal {M[0][1]:.10f} "
          f"(error {out['mbar']['error']:.1e}); limit Qhat(q={out['q']}) = "
          f"{out['q_hat_limit'][0]:.4f} +- {out['q_hat_limit'][1]:.4f}")
    print(f"{'L':>4}  {'L x bias of M_{L-1}':>22}  {'L x E(y-ybar)^2':>20}  {'L x (Qhat_L - Qhat)':>22}")
    for r in out["rows"]:
        f = lambda v: f"{v[0]:+.4f} +- {v[1]:.4f}"  # noqa: E731
        print(f"{r['L']:>4}  {f(r['bias_times_L']):>22}  {f(r['mean_square_times_L']):>20}  "
              f"{f(r['q_hat_difference_times_L']):>22}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
