"""``aimsym aim ...``: state evolution, thresholds, AMP, gradient descent, figures."""

from __future__ import annotations

import numpy as np

from ..errors import AimsymError
from . import common


def parse_grid(text: str, field: str = "--alpha") -> tuple[np.ndarray, bool]:
    """'0.1' -> ([0.1], False); 'start:stop:step' (stop included if on the grid) or 'a,b,c' ->
    (values, True): a list prints as a list even when it holds one value."""
    return np.array(common.parse_grid(text, field, third="step")), common.is_list(text)


def _common(p, alpha=True):
    p.add_argument("--tokens", type=int, default=2, help="sequence length T >= 2 (default 2)")
    p.add_argument("--rho", type=float, default=0.5, help="width ratio r/d > 0 (default 0.5)")
    p.add_argument("--activation", default="softmax", help="softmax, hardmax or linear (default softmax)")
    p.add_argument("--beta", type=float, default=1.0, help="inverse temperature (default 1)")
    if alpha:
        p.add_argument("--alpha", default="0.1", help="n/d^2: a number, a,b,c or start:stop:step")
    p.add_argument("--json", action="store_true", help="print JSON")


def register(subparsers) -> None:
    aim = subparsers.add_parser("aim", help="attention-indexed models at extensive width")
    sub = aim.add_subparsers(dest="aim_command", parser_class=type(aim))
    aim.set_defaults(func=lambda args: (aim.print_help(), 2)[1])

    p = sub.add_parser("se", help="Bayes-optimal state evolution (mmse, q, q_hat)")
    _common(p)
    p.add_argument("--method", default="auto", help="auto (parametric/root), iterate")
    p.add_argument("--init", default="uninformed", help="uninformed or informed (with --method iterate)")
    p.add_argument("--damping", type=float, default=0.0, help="damping in [0, 1) (iterate)")
    p.add_argument("--small-width", action="store_true",
                   help="rho -> 0 limit (softmax/linear any T: closed form; hardmax T=2 or 3): "
                        "--alpha is alpha_bar = alpha / rho")
    p.set_defaults(func=_cmd_se)

    p = sub.add_parser("thresholds", help="perfect- and weak-recovery thresholds")
    _common(p, alpha=False)
    p.set_defaults(func=_cmd_thresholds)

    for name, helptext in (("amp", "matrix GAMP with the RIE denoiser at finite d"),
                           ("gd", "Adam on the square loss at finite d (single and averaged)")):
        p = sub.add_parser(name, help=helptext)
        _common(p)
        p.add_argument("--d", type=int, default=60, help="dimension d (default 60)")
        p.add_argument("--seeds", default="0", help="seeds: n, a,b,c or start:stop:step (default 0)")
        if name == "amp":
            p.add_argument("--iterations", type=int, default=60, help="max AMP iterations")
            p.add_argument("--damping", type=float, default=None,
                           help="damping in [0, 1) (default 0.3; 0.5 with --deep)")
            p.add_argument("--deep", action="store_true",
                           help="two-layer AIM (softmax, T = 2): --rho is rho_1 of layer 1, with --rho2 and --skip")
            p.add_argument("--rho2", type=float, default=0.5, help="width ratio of layer 2 (--deep; default 0.5)")
            p.add_argument("--skip", type=float, default=1.0, help="skip strength c of layer 1 (--deep; default 1)")
            p.add_argument("--n-inner", type=int, default=8,
                           help="Gauss-Hermite nodes per dimension of the layer-1 rule (--deep; default 8)")
            p.add_argument("--no-se", action="store_true", help="skip the two-layer SE (--deep)")
            p.add_argument("--quiet", action="store_true", help="no progress bar (--deep)")
            p.set_defaults(func=_cmd_amp)
        else:
            p.add_argument("--steps", type=int, default=1500, help="Adam steps (default 1500)")
            p.add_argument("--lr", type=float, default=0.01, help="Adam learning rate (default 0.01)")
            p.add_argument("--runs", type=int, default=4, help="independent inits averaged (AGD)")
            p.set_defaults(func=_cmd_gd)

    p = sub.add_parser("plot", help="write the AIM figures (PNG)")
    p.add_argument("--out", default="docs/figures", help="output directory")
    p.add_argument("--which", default="all",
                   help="all or comma list of softmax,tokens,hardmax,small_width,small_width_softmax,amp,deep")
    p.add_argument("--d", type=int, default=100, help="d for AMP/GD points")
    p.add_argument("--seeds", type=int, default=4, help="seeds for AMP/GD points")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_plot)


def _cmd_se(args) -> int:
    from ..provenance import provenance
    from ..aim import se

    alphas, is_list = parse_grid(args.alpha)
    if args.small_width:
        if args.activation not in ("softmax", "linear", "hardmax"):
            raise AimsymError("--activation", f"--small-width: softmax, linear or hardmax, got {args.activation!r}")
        if args.activation == "hardmax" and args.tokens not in (2, 3):
            raise AimsymError("--tokens", f"--small-width with hardmax: 2 or 3, got {args.tokens}")
        if args.method not in ("auto", "iterate"):
            raise AimsymError("--method", f"--small-width: auto or iterate, got {args.method!r}")
        if np.any(alphas <= 0):
            raise AimsymError("--alpha", "--small-width: alpha_bar = alpha / rho must be > 0")
        rows = [se.small_width_se(a, init=args.init, tokens=args.tokens, activation=args.activation,
                                  method=args.method).to_json() for a in alphas]
        for r in rows:
            r["provenance"] = provenance(accuracy={"tol": 1e-12} if r["method"] == "iterate" else {})
    elif args.method == "iterate":
        rows = [se.iterate(a, args.rho, args.tokens, args.activation, args.beta, init=args.init,
                           damping=args.damping).to_dict() for a in alphas]
    else:
        rows = [r.to_dict() for r in se.curve(alphas, args.rho, args.tokens, args.activation, args.beta)]
    return _emit(rows if is_list else rows[0], args, ("alpha", "alpha_bar", "q", "q_hat", "t", "mmse"))


def _cmd_thresholds(args) -> int:
    from ..aim import se

    out = se.thresholds(args.tokens, args.rho, args.activation, args.beta)
    if args.json:
        from .common import print_json

        print_json(out)
    else:
        for k, v in out.to_json().items():
            if k != "provenance":
                print(f"{k}: {v}")
    return 0


def _seeds(text):
    vals, is_list = parse_grid(text, "--seeds")
    if not np.all((vals >= 0) & (vals == np.round(vals))):
        raise AimsymError("--seeds", f"seeds are integers >= 0 (n, a,b,c or start:stop:step), got {text!r}")
    if not is_list:
        return list(range(int(vals[0]))) if vals[0] > 1 else [int(vals[0])]
    return [int(v) for v in vals]


def _cmd_amp(args) -> int:
    from ..aim import amp

    alphas, is_list = parse_grid(args.alpha)
    if args.deep:
        return _cmd_amp_deep(args, alphas, is_list)
    rows = []
    for a in alphas:
        rows.append(amp.run_many(alpha=a, rho=args.rho, d=args.d, tokens=args.tokens,
                                 activation=args.activation, beta=args.beta, seeds=_seeds(args.seeds),
                                 iterations=args.iterations, damping=0.3 if args.damping is None else args.damping))
    return _emit(rows if is_list else rows[0], args, ("alpha", "mmse", "mmse_sem", "mmse_se"))


def _cmd_amp_deep(args, alphas, is_list) -> int:
    from ..aim import deep

    if args.tokens != 2:
        raise AimsymError("--tokens", f"the two-layer AMP has T = 2 only, got {args.tokens}")
    if args.activation != "softmax":
        raise AimsymError("--activation", f"the two-layer AMP has softmax layers only, got {args.activation!r}")
    if args.n_inner < 2:
        raise AimsymError("--n-inner", f"must be >= 2, got {args.n_inner}")
    damping = 0.5 if args.damping is None else args.damping
    rows = []
    for a in alphas:
        r = deep.run_many(a, args.d, args.rho, args.rho2, args.skip, args.beta, seeds=_seeds(args.seeds),
                          iterations=args.iterations, damping=damping, n_inner=args.n_inner, se=not args.no_se,
                          progress=not args.quiet).to_json()
        for key in ("mmse1", "mmse2"):
            r[key + "_se"] = r["se"][key] if r["se"] else None
        rows.append(r)
    return _emit(rows if is_list else rows[0], args,
                 ("alpha", "mmse1", "mmse1_sem", "mmse1_se", "mmse2", "mmse2_sem", "mmse2_se"))


def _cmd_gd(args) -> int:
    from ..aim import gd

    alphas, is_list = parse_grid(args.alpha)
    rows = []
    for a in alphas:
        rows.append(gd.run_many(alpha=a, rho=args.rho, d=args.d, tokens=args.tokens,
                                activation=args.activation, beta=args.beta, seeds=_seeds(args.seeds),
                                steps=args.steps, lr=args.lr, runs=args.runs))
    return _emit(rows if is_list else rows[0], args,
                 ("alpha", "mmse_gd", "mmse_gd_sem", "mmse_agd", "mmse_agd_sem", "mmse_se"))


def _cmd_plot(args) -> int:
    from ..plot import aim as plots

    which = None if args.which == "all" else [w.strip() for w in args.which.split(",")]
    written = plots.make_all(args.out, which=which, d=args.d, n_seeds=args.seeds)
    if args.json:
        from .common import print_json

        print_json({"written": written})
    else:
        for w in written:
            print(w)
    return 0


def _emit(obj, args, columns) -> int:
    return common.emit(obj, args, columns, width=14, fmt=".8g")


__all__ = ["register", "parse_grid"]
