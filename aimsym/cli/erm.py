"""``aimsym erm ...``: fixed point, Adam training, spectrum, thresholds, figures."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import numpy as np

from ..errors import AimsymError
from . import common


def parse_grid(text: str, field: str = "--alpha") -> list[float]:
    """'0.05', '0.01,0.1', or 'start:stop:step' (stop included) -> list of floats."""
    return common.parse_grid(text, field, third="step")


def _add_model_args(p):
    p.add_argument("--tokens", type=int, default=2, help="sequence length T")
    p.add_argument("--kappa0", type=float, default=0.5, help="target rank ratio r*/d")
    p.add_argument("--lam", type=float, default=0.01, help="weight decay lambda")
    p.add_argument("--noise", type=float, default=0.0, help="label noise Delta (inside the softmax)")
    p.add_argument("--beta", type=float, default=1.0, help="student inverse temperature")
    p.add_argument("--beta0", type=float, default=1.0, help="teacher inverse temperature")
    p.add_argument("--model", default="factorised", help="factorised | direct")
    p.add_argument("--penalty", default=None, help="pnn (factorised); ridge | snn (direct)")
    p.add_argument("--kappa", type=float, default=None, help="student width r/d (rank cap)")
    p.add_argument("--output", default="label", help="label (seq-to-label) | sequence (seq-to-seq)")
    p.add_argument("--target", default="wishart",
                   help="target spectrum: wishart (W* W*^T) | power (groups at c k^-gamma)")
    p.add_argument("--gamma", type=float, default=None, help="power-law exponent (--target power)")
    p.add_argument("--groups", type=int, default=None,
                   help="number of eigenvalue groups of the power-law target (default 40)")
    p.add_argument("--json", action="store_true", help="print JSON")


def _params(args):
    from ..erm.params import ERMParams
    return ERMParams(tokens=args.tokens, kappa0=args.kappa0, lam=args.lam, Delta=args.noise,
                     beta=args.beta, beta0=args.beta0, model=args.model, penalty=args.penalty,
                     kappa=args.kappa, output=args.output, target=args.target,
                     gamma=args.gamma, groups=args.groups)


def _accuracy(args):
    from ..erm.se import Accuracy
    acc = Accuracy()
    if getattr(args, "gh_nodes", None):
        acc = Accuracy(gh_nodes=args.gh_nodes)
    return acc


def model_hash(params) -> str:
    return hashlib.sha256(json.dumps(params.asdict(), sort_keys=True).encode()).hexdigest()[:16]


def _prov(params, accuracy=None, seed=None):
    from ..provenance import provenance
    return provenance(seed=seed, model_hash=model_hash(params), accuracy=accuracy or {})


def _emit(args, rows, keys):
    common.emit(rows[0] if len(rows) == 1 else rows, args, keys, width=12, fmt=".6g")


def cmd_se(args) -> int:
    from ..erm.se import curve
    params = _params(args)
    acc = _accuracy(args)
    alphas = parse_grid(args.alpha)
    fps = curve(params, alphas, acc, progress=not args.json and len(alphas) > 3)
    prov = _prov(params, asdict(acc) | acc.rule(params.tokens).describe())
    rows = []
    for fp in fps:
        row = fp.asdict()
        row["provenance"] = prov
        rows.append(row)
    _emit(args, rows, ["alpha", "alpha_bar", "test", "train", "q", "m", "matrix_error", "rank", "converged"])
    return 0


def cmd_train(args) -> int:
    from ..erm.train import train
    params = _params(args)
    alphas = parse_grid(args.alpha)
    seeds = [int(s) for s in parse_grid(args.seeds, "seeds")]
    if any(s < 0 for s in seeds):
        raise AimsymError("--seeds", f"seeds are integers >= 0, got {args.seeds!r}")
    rows = []
    for a in alphas:
        for s in seeds:
            res = train(params, a, args.d, seed=s, lr=args.lr, max_steps=args.max_steps)
            row = res.asdict(spectrum=args.spectrum)
            row.update(params.asdict())
            row["provenance"] = _prov(params, {"lr": args.lr, "max_steps": args.max_steps,
                                               "optimizer": "adam full batch"}, seed=s)
            rows.append(row)
    _emit(args, rows, ["alpha", "d", "seed", "test", "train", "q", "m", "rank", "steps", "stop"])
    return 0


def cmd_spectrum(args) -> int:
    from ..erm.se import fixed_point
    from ..erm.spectrum import ks_distance, singular_value_density, spectrum
    params = _params(args)
    if params.target != "wishart":
        raise AimsymError("--target", "erm spectrum supports the wishart target only")
    acc = _accuracy(args)
    alpha = parse_grid(args.alpha)
    if len(alpha) != 1:
        raise AimsymError("alpha", "spectrum takes a single value")
    fp = fixed_point(params, alpha[0], acc)
    sp = spectrum(fp, args.points)
    out = {"alpha": alpha[0], "rank": sp.rank, "delta_peak": sp.delta_peak, "s": sp.s,
           "density": sp.density, "q": fp.q, "m": fp.m, "delta": fp.delta, "eps": fp.eps}
    if params.model == "factorised":
        sv = singular_value_density(fp, args.points)
        out["singular_values"] = {"sigma": sv.sigma, "density": sv.density}
    if args.d:
        from ..erm.train import train
        res = train(params, alpha[0], args.d, seed=args.seed)
        out["adam"] = {"d": args.d, "seed": args.seed, "eigenvalues": res.eigenvalues,
                       "ks": ks_distance(fp, res.eigenvalues), "rank": res.rank, "test": res.test}
    out["provenance"] = _prov(params, asdict(acc), seed=args.seed if args.d else None)
    from .common import print_json
    if args.json:
        print_json(out)
    else:
        print(f"alpha={alpha[0]} rank={sp.rank:.4f} delta_peak={sp.delta_peak:.4f} "
              f"support=[{sp.s.min():.4g}, {sp.s.max():.4g}]"
              + (f" adam KS={out['adam']['ks']:.4f}" if args.d else ""))
    return 0


def cmd_thresholds(args) -> int:
    from ..erm import thresholds as th
    k0, T = args.kappa0, args.tokens
    if not (np.isfinite(k0) and k0 > 0):
        raise AimsymError("kappa0", f"must be a finite number > 0, got {k0}")
    if not 2 <= T <= 8:
        raise AimsymError("tokens", f"must be an integer in 2..8, got {T}")
    cf = th.closed_forms(k0)
    to_alpha = 2.0 / (T * T + T - 2)
    located = {"perfect_recovery": {"factorised": th.locate_perfect_recovery(k0, "factorised"),
                                    "direct": th.locate_perfect_recovery(k0, "direct")}}
    if args.noise > 0:
        located["interpolation"] = {"factorised": th.locate_interpolation(k0, args.noise)}
    out = {"kappa0": k0, "tokens": T, "Delta": args.noise, "units": "alpha_bar = alpha (T^2+T-2)/2",
           "closed_form": cf, "located": located,
           "alpha": {"perfect_recovery": {k: v * to_alpha for k, v in cf.perfect_recovery.items()
                                          if k != "factorised_c"},
                     "interpolation_factorised": cf.interpolation["factorised"] * to_alpha}}
    from ..provenance import provenance
    out["provenance"] = provenance(accuracy={"delta0": 1e-4, "prior_nodes": 320})
    from .common import print_json
    if args.json:
        print_json(out)
    else:
        pr = cf.perfect_recovery
        print(f"perfect recovery (alpha_bar): bayes {pr['bayes']:.6f}  direct {pr['direct']:.6f} "
              f"(located {located['perfect_recovery']['direct']:.6f})  factorised {pr['factorised']:.6f} "
              f"(located {located['perfect_recovery']['factorised']:.6f})")
        line = f"interpolation (factorised, Delta->0+): {cf.interpolation['factorised']:.6f}"
        if args.noise > 0:
            line += f"  located at Delta={args.noise}: {located['interpolation']['factorised']:.6f}"
        print(line)
    return 0


def cmd_plot(args) -> int:
    from ..plot.erm import FIGURES, make
    if args.figure not in FIGURES:
        raise AimsymError("figure", f"must be one of {', '.join(FIGURES)}, got {args.figure!r}")
    path = make(args.figure, args.out, d=args.d, seeds=args.seeds_n, quick=args.quick)
    print(path)
    return 0


def register(subparsers) -> None:
    erm = subparsers.add_parser("erm", help="ERM in a tied attention layer (theory.md section 8)")
    sub = erm.add_subparsers(dest="erm_command", parser_class=type(erm))

    p = sub.add_parser("se", help="asymptotic fixed point (grid of alpha)")
    _add_model_args(p)
    p.add_argument("--alpha", required=True, help="alpha = n/d^2: value, list or start:stop:step")
    p.add_argument("--gh-nodes", type=int, default=None, help="Gauss-Hermite nodes per dimension")
    p.set_defaults(func=cmd_se)

    p = sub.add_parser("train", help="Adam on finite-size data")
    _add_model_args(p)
    p.add_argument("--alpha", required=True)
    p.add_argument("--d", type=int, default=50, help="dimension d (n = alpha d^2)")
    p.add_argument("--seeds", default="0", help="seeds: value, list or start:stop:step")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--max-steps", type=int, default=5000)
    p.add_argument("--spectrum", action="store_true", help="include eigenvalues of S")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("spectrum", help="predicted spectrum of the learned S (optionally vs Adam)")
    _add_model_args(p)
    p.add_argument("--alpha", required=True)
    p.add_argument("--points", type=int, default=200)
    p.add_argument("--d", type=int, default=0, help="also train Adam at this d and give the KS distance")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gh-nodes", type=int, default=None)
    p.set_defaults(func=cmd_spectrum)

    p = sub.add_parser("thresholds", help="perfect recovery and interpolation thresholds")
    p.add_argument("--kappa0", type=float, default=0.5)
    p.add_argument("--tokens", type=int, default=2)
    p.add_argument("--noise", type=float, default=0.0, help="label noise Delta for the interpolation threshold")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_thresholds)

    p = sub.add_parser("plot", help="figures of docs/erm.md")
    p.add_argument("figure", help="lam | models | spectra | rank | beta_T | seq | powerlaw")
    p.add_argument("--out", default=None, help="PNG path (default docs/figures/erm_<figure>.png)")
    p.add_argument("--d", type=int, default=60, help="Adam dimension for the points")
    p.add_argument("--seeds-n", type=int, default=3, help="Adam seeds per point")
    p.add_argument("--quick", action="store_true", help="coarse grids (smoke test)")
    p.set_defaults(func=cmd_plot)
