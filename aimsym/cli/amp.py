"""``aimsym amp`` (GAMP at finite size) and ``aimsym gd`` (gradient-descent baselines)."""

from __future__ import annotations

import sys

from ..errors import AimsymError


def _common(p):
    p.add_argument("model", help="derivation TOML file (e.g. derivations/attention_L2_T2.toml)")
    p.add_argument("--set", dest="assign", action="append", metavar="NAME=VALUE", default=[],
                   help="bind a symbolic parameter (repeatable), e.g. --set skip=1")
    p.add_argument("--d", type=int, default=500, help="input dimension d (default 500)")
    p.add_argument("--alpha", type=float, default=1.2, help="sample ratio n / d (default 1.2)")
    p.add_argument("--seeds", type=int, default=1, help="independent data sets averaged (default 1)")
    p.add_argument("--seed", type=int, default=0, help="root seed (default 0)")
    p.add_argument("--n-test", type=int, default=None, help="test samples (default min(2000, n))")
    p.add_argument("--json", action="store_true", help="print the full result as JSON on stdout")
    p.add_argument("--output", default=None, help="also write the JSON result to this file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def register(subparsers) -> None:
    p = subparsers.add_parser("amp", help="GAMP on teacher-student data (theory section 6)")
    _common(p)
    p.add_argument("--lambda", dest="lam", type=float, default=1e-2,
                   help="side-information strength lambda (default 1e-2; needed to leave Q = 0 for even links)")
    p.add_argument("--init-scale", type=float, default=0.0,
                   help="random uninformative init W_hat_0 = s N(0,1) (default 0)")
    p.add_argument("--damping", type=float, default=0.0, help="damping in [0, 1) (default 0)")
    p.add_argument("--max-iter", type=int, default=50, help="maximum iterations (default 50)")
    p.add_argument("--tol", type=float, default=1e-4, help="stop when the rms change of W_hat < tol")
    p.add_argument("--nodes", type=int, default=None,
                   help="a fixed Gauss-Hermite rule of this many points per dimension (audited after the run) "
                        "instead of the error-controlled denoiser")
    p.add_argument("--denoiser-tol", default="auto", metavar="TOL",
                   help="the denoiser's error tolerance per sample: 'auto' (0.1 / sqrt(n), a tenth of the "
                        "statistical error over the n samples; the default) or a number")
    p.set_defaults(func=_run_amp)

    g = subparsers.add_parser("gd", help="gradient-descent baselines on teacher-student data")
    _common(g)
    g.add_argument("--optimizer", choices=("gd", "sgd", "adam"), default="adam", help="default adam")
    g.add_argument("--lr", type=float, default=None, help="learning rate (default per optimizer, see docs/amp.md)")
    g.add_argument("--epochs", type=int, default=200, help="training epochs (default 200)")
    g.add_argument("--batch-size", type=int, default=None, help="mini-batch size for sgd/adam (default: full batch)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="weight decay lambda (default 0)")
    g.add_argument("--init-scale", type=float, default=0.1, help="init W = s N(0, 1) (default 0.1)")
    g.add_argument("--average", type=int, default=1,
                   help="independent initialisations whose predictions are averaged (default 1)")
    g.set_defaults(func=_run_gd)


def _load(args):
    from ..model import load
    from ..derive.spec import parse_assignments

    return load(args.model, **parse_assignments(args.assign))


def _check(args):
    if args.d < 2:
        raise AimsymError("--d", f"must be an integer >= 2, got {args.d}")
    if not args.alpha > 0:
        raise AimsymError("--alpha", f"must be > 0, got {args.alpha}")
    if args.seeds < 1:
        raise AimsymError("--seeds", f"must be >= 1, got {args.seeds}")


def _nan_to_none(obj):
    """Standard JSON has no NaN: standard errors of a single seed become null."""
    import numpy as np

    if hasattr(obj, "to_json"):
        return _nan_to_none(obj.to_json())
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_nan_to_none(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _nan_to_none(obj.tolist())
    if isinstance(obj, float | np.floating) and not np.isfinite(obj):
        return None
    return obj


def _emit(args, result, lines):
    from .common import print_json

    result = _nan_to_none(result)

    if args.output:
        import json

        from .common import to_builtin

        from pathlib import Path

        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "w") as fh:
            json.dump(result, fh, indent=2, default=to_builtin)
    if args.json:
        print_json(result)
    else:
        print("\n".join(lines))


def _run_amp(args) -> int:
    from ..smi.amp import run_amp

    _check(args)
    model = _load(args)
    res = run_amp(model, d=args.d, alpha=args.alpha, seeds=args.seeds, seed=args.seed, lam=args.lam,
                  damping=args.damping, max_iter=args.max_iter, tol=args.tol, init_scale=args.init_scale,
                  n_test=args.n_test, nodes=args.nodes, progress=not args.quiet and sys.stderr.isatty(),
                  denoiser_tol=_denoiser_tol(args.denoiser_tol))
    M, se = res.final["M"], res.final["M_stderr"]
    lines = [f"GAMP {model.name} {model.parameters} d={args.d} alpha={args.alpha} seeds={args.seeds}: "
             f"{res.iterations} iterations, converged {res.converged}",
             "iter  " + "  ".join(f"M[{k},{k}]" for k in range(model.p)) + "  test_error"]
    for t, (Mt, e) in enumerate(zip(res.overlaps["M"], res.test_error["mean"])):
        lines.append(f"{t:4d}  " + "  ".join(f"{Mt[k, k]:+.4f}" for k in range(model.p)) + f"  {e:.5f}")
    lines.append("final M (mean +- s.e.): " + "; ".join(f"{M[k, k]:.4f} +- {se[k, k]:.4f}" for k in range(model.p)))
    t = res.timing
    lines.append(f"time: denoiser {t['denoiser_s']:.2f} s, linear algebra {t['linear_algebra_s']:.2f} s "
                 f"over {t['iterations']} iterations")
    qa = res.quadrature
    if qa.get("audited"):
        for r in qa["iterations"]:
            err = "unresolved" if r["max_error"] is None else f"at most {r['max_error']:.1e}"
            lines.append(f"quadrature at iteration {r['iteration']} (tr V / p = {r['V_scale']:.1e}): error {err} "
                         f"(against the error-controlled rule on {r['samples'] - r['reference_missed_tol']} of "
                         f"{r['samples']} inputs)")
    elif qa.get("evaluations"):
        lines.append(f"quadrature: error-controlled at tol {qa['tol']:.1e} per sample; {qa['missed']} of "
                     f"{qa['evaluations']} evaluations above tol (largest estimate {qa['max_error']:.1e})")
    else:
        lines.append(f"quadrature: {qa.get('note', 'not audited')}")
    _emit(args, res, lines)
    return 0


def _denoiser_tol(raw: str):
    if raw == "auto":
        return raw
    try:
        v = float(raw)
    except ValueError:
        raise AimsymError("--denoiser-tol", f"must be 'auto' or a number > 0, got {raw!r}") from None
    if not (v > 0 and v < 1):
        raise AimsymError("--denoiser-tol", f"must be 'auto' or a number in (0, 1), got {raw!r}")
    return v


def _run_gd(args) -> int:
    from ..smi.gd import run_gd

    _check(args)
    model = _load(args)
    res = run_gd(model, d=args.d, alpha=args.alpha, seeds=args.seeds, seed=args.seed, optimizer=args.optimizer,
                 lr=args.lr, epochs=args.epochs, batch_size=args.batch_size, weight_decay=args.weight_decay,
                 init_scale=args.init_scale, average=args.average, n_test=args.n_test,
                 progress=not args.quiet and sys.stderr.isatty())
    ov, se = res.final["overlap"], res.final["overlap_stderr"]
    lines = [f"{args.optimizer} {model.name} {model.parameters} d={args.d} alpha={args.alpha} seeds={args.seeds}: "
             f"{res.epochs} epochs",
             "epoch  " + "  ".join(f"layer{l + 1}" for l in range(len(ov))) + "  train_loss  test_error"]
    for e, (o, tl, te) in enumerate(zip(res.overlaps["layer"], res.train_loss["mean"], res.test_error["mean"])):
        lines.append(f"{res.epochs_logged[e]:5d}  " + "  ".join(f"{x:.4f}" for x in o) + f"  {tl:.5f}  {te:.5f}")
    lines.append("final per-layer overlap (mean +- s.e.): "
                 + "; ".join(f"{o:.4f} +- {s:.4f}" for o, s in zip(ov, se)))
    _emit(args, res, lines)
    return 0
