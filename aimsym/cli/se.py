"""CLI: ``aimsym se``, ``aimsym thresholds``, ``aimsym sweep``, ``aimsym plot``."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import AimsymError


def _common(p, *, samples: int):
    p.add_argument("model", help="architecture file (TOML), e.g. derivations/attention_L2_T2.toml")
    p.add_argument("--set", action="append", metavar="NAME=VALUE", help="bind a symbolic parameter (repeatable)")
    p.add_argument("--samples", type=int, default=samples, help=f"QMC points per expectation (default {samples})")
    p.add_argument("--replicas", type=int, default=8, help="independent scrambles for standard errors (default 8)")
    p.add_argument("--nodes", type=int, default=None, help="denoiser Gauss-Hermite nodes per dimension")
    p.add_argument("--seed", type=int, default=0, help="seed of the QMC scrambles (default 0)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="keep every denoiser pass in DIR: the same command again resumes where a stopped run "
                        "ended (cluster wall time, Ctrl-C); removed once the result is printed")


def register(sub) -> None:
    p = sub.add_parser("se", help="Bayes-optimal state evolution fixed point at one alpha")
    _common(p, samples=4096)
    p.add_argument("--alpha", type=float, required=True, help="sample complexity n/d")
    p.add_argument("--init", default="uninformed", choices=("uninformed", "informed"))
    p.add_argument("--side-info", type=float, default=0.0, dest="side_info", help="side information lambda")
    p.add_argument("--side-block", default=None, dest="side_block",
                   help="comma-separated indices (rows of Z) receiving lambda (default all)")
    p.add_argument("--damping", type=float, default=0.0)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--max-iter", type=int, default=500, dest="max_iter")
    p.set_defaults(func=cmd_se)

    try:
        from ..smi import thresholds  # noqa: F401
    except ImportError:  # pragma: no cover - stage under construction
        return
    p = sub.add_parser("thresholds", help="weak-recovery threshold and grand staircase")
    _common(p, samples=1 << 16)
    p.add_argument("--se-samples", type=int, default=2048, dest="se_samples",
                   help="QMC points of the restricted SE along the staircase (default 2048)")
    p.add_argument("--no-staircase", action="store_true", dest="no_staircase")
    p.add_argument("--stair-steps", type=int, default=None, dest="stair_steps",
                   help="stop the staircase after this many steps past alpha_c (default: until every index "
                        "is learned; a later step can take hours where the denoiser is in its ridge regime)")
    p.add_argument("--check", action="store_true", help="also locate alpha_c by SE with tiny side information")
    p.add_argument("--no-perfect-recovery", action="store_true", dest="no_perfect",
                   help="skip the perfect-recovery transition (local stability of Q = I, uninformed SE bisection)")
    p.add_argument("--pr-local", action="store_true", dest="pr_local",
                   help="perfect recovery: only where Q = I is locally stable (local_alpha), not the bisection of "
                        "uninformed SE runs (~100x cheaper; for phase diagrams)")
    p.add_argument("--pr-samples", type=int, default=1024, dest="pr_samples",
                   help="QMC points of the SE runs locating perfect recovery (default 1024)")
    p.add_argument("--over", default=None, metavar="NAME=START:STOP:NUM",
                   help="phase diagram: thresholds at every value of one parameter (e.g. skip=0.25:4:16)")
    p.add_argument("--stair-samples", type=int, default=1 << 13, dest="stair_samples",
                   help="with --over: QMC points of the staircase operator (default 8192)")
    p.add_argument("--workers", type=int, default=None, help="with --over: processes (default: all cores)")
    p.add_argument("--out", default=None, help="with --over: write the phase diagram JSON here")
    p.add_argument("--figure", default=None, help="with --over: draw the phase diagram (PNG) here")
    p.set_defaults(func=cmd_thresholds)


def load_model(args):
    from ..model import load
    from aimsym.derive.spec import parse_assignments

    from ..derive.files import resolve

    path = resolve(args.model)
    if not path.is_file():
        bare = Path(args.model).name == args.model and not args.model.endswith(".toml")
        raise AimsymError("model", f"no such file{' or bundled model' if bare else ''}: {args.model}")
    return load(path, **parse_assignments(args.set))


def parse_block(text):
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise AimsymError("--side-block", f"expected comma-separated integers, got {text!r}") from None


def cmd_se(args) -> int:
    from ..smi.se import state_evolution

    model = load_model(args)
    block = parse_block(args.side_block)
    if block is not None and any(not 0 <= i < model.p for i in block):
        raise AimsymError("--side-block", f"indices must be in 0..{model.p - 1}, got {block}")
    res = state_evolution(model, args.alpha, init=args.init, side_info=args.side_info, side_block=block,
                          damping=args.damping, tol=args.tol, max_iter=args.max_iter, samples=args.samples,
                          replicas=args.replicas, nodes=args.nodes, seed=args.seed,
                          progress=sys.stderr.isatty(), checkpoint=args.checkpoint)
    _print_se(model, res, args.json)
    _clear_checkpoint(args)
    return 0


def _kept(args):
    """Where ``--checkpoint`` keeps finished results that outlive a code change (smi.passes.Kept)."""
    return Path(args.checkpoint) / "points" if getattr(args, "checkpoint", None) else None


def _clear_checkpoint(args) -> None:
    if getattr(args, "checkpoint", None):
        from ..smi.passes import clear

        sys.stdout.flush()  # (the result is out before the passes that led to it go)
        clear(_kept(args), "*.json")
        clear(args.checkpoint)


def _print_se(model, res, as_json: bool) -> None:
    from .common import print_json

    out = res.to_dict()
    if as_json:
        print_json(out)
        return
    print(f"model {model.name} {model.parameters}  alpha = {res.alpha}  init = {res.init}")
    print(f"converged = {res.converged} after {res.iterations} iterations ({res.seconds:.1f} s)")
    for k in range(model.p):
        row = "  ".join(f"{res.Q[k, j]: .4f}±{res.Q_stderr[k, j]:.4f}" for j in range(model.p))
        print(f"Q[{k}]  {row}")
    print("errors 1 - Q_kk:", ", ".join(
        ("perfect recovery" if pr else f"{e:.4g} ± {s:.2g}")
        for e, s, pr in zip(res.errors["layers"], res.errors["layers_stderr"], res.errors["perfect_recovery"])))
    dg = res.diagnostics
    beyond = " beyond its quadrature bound" if "nishimori_quadrature_bound" in dg else ""
    print(f"Nishimori residual {dg['nishimori_z']:.1f} stderr{beyond} (relative {dg['nishimori_relative']:.1e}); "
          f"quadrature: {dg['quadrature_note']}")
    if "prediction" in res.errors:
        pe = res.errors["prediction"]
        print(f"prediction error: Bayes-optimal {pe.bayes_optimal:.4f}  plug-in {pe.plug_in:.4f}")
    print(f"free entropy {res.free_entropy:.5f} ± {res.free_entropy_stderr:.5f}")


def cmd_thresholds(args) -> int:
    from ..smi.thresholds import threshold_report

    if args.over:
        if args.checkpoint:
            raise AimsymError("--checkpoint", "not available with --over (a phase diagram's values run in "
                                              "separate processes); use it for one model's thresholds")
        return cmd_phase_diagram(args)
    model = load_model(args)
    rep = threshold_report(model, samples=args.samples, replicas=args.replicas, nodes=args.nodes, seed=args.seed,
                           staircase=not args.no_staircase, se_samples=args.se_samples, check=args.check,
                           stair_steps=args.stair_steps, perfect=not args.no_perfect, pr_samples=args.pr_samples,
                           pr_algorithmic=not args.pr_local, checkpoint=args.checkpoint, kept=_kept(args))
    _print_thresholds(model, rep, args.json)
    if rep.failed:
        return 1  # (a failed stage keeps its passes: the same command resumes it)
    _clear_checkpoint(args)
    return 0


def _print_thresholds(model, rep, as_json: bool) -> None:
    from .common import print_json

    if as_json:
        print_json(rep)
        return
    ini = rep.initial
    print(f"model {model.name} {model.parameters}")
    print(f"alpha_c = {_pm(ini.alpha, ini.stderr)}  (rho(F) = {_pm(ini.rho, ini.rho_stderr)}), direction:")
    if ini.quadrature_error is not None and ini.nodes is not None:
        dom = "; the quadrature error dominates: raise --nodes" if ini.quadrature_error > ini.statistical_stderr else ""
        print(f"  (stderr = statistical {ini.statistical_stderr:.2g} and quadrature {ini.quadrature_error:.2g}: the "
              f"denoiser's fixed rule, {ini.nodes} nodes per dimension, against the rule with twice or half as many{dom})")
    elif ini.quadrature_error is not None:
        print(f"  {_split(ini.statistical_stderr, ini.quadrature_error)}")
    for row in ini.direction:
        print("   ", "  ".join(f"{v: .3f}" for v in row))
    for step in rep.staircase:
        quad = getattr(step, "quadrature_error", None)
        stat = None if quad is None else (max(step.stderr**2 - quad**2, 0.0)) ** 0.5
        print(f"subspace {step.subspace}: alpha = {_pm(step.alpha, step.stderr)}"
              + ("" if quad is None else f"  {_split(stat, quad)}"))
    pr = rep.perfect_recovery
    if pr is not None:
        print(f"counting bound alpha_PR = p/m = {pr.counting_alpha}  (m = {pr.m}; {pr.note})")
        loc, alg = pr.local, pr.algorithmic
        if loc is not None:
            print(f"Q = I locally stable above {loc.local_alpha:.4f} ± {loc.local_alpha_stderr:.4f}"
                  f"  (tr Pi = {loc.trace_Pi:.4f} ± {loc.trace_Pi_stderr:.4f}, m = {pr.m})")
        if alg is not None:
            print(f"uninformed SE reaches Q = I at alpha = {alg.alpha:.4f} ± {pr.stderr:.4f} ({alg.kind})")
    for stage, msg in (rep.failed or {}).items():
        print(f"{stage}: failed ({msg}); the results above are complete")


def _split(stat: float, quad: float) -> str:
    """The two parts of a folded stderr: the statistical one and the error-controlled denoiser's bound."""
    dom = "; the quadrature bound dominates" if quad > stat else ""
    return f"(stderr = statistical {stat:.2g} and quadrature bound {quad:.2g} from the denoiser's estimates{dom})"


def _pm(x: float, err: float) -> str:
    """x ± err with err to two significant digits (at least 4 decimals): the reweighted alpha_c
    errors go down to 1e-5 and below, which a fixed 4 decimals printed as ± 0.0000."""
    import math

    if not (math.isfinite(err) and err > 0):
        return f"{x:.4f} ± {err:.4g}"
    d = max(4, 1 - math.floor(math.log10(err)))
    return f"{x:.{d}f} ± {err:.{d}f}"


def cmd_phase_diagram(args) -> int:
    import json

    from .common import print_json
    from .common import parse_grid, to_builtin
    from ..smi.thresholds import phase_diagram, phase_rows

    name, _, grid = args.over.partition("=")
    if not grid:
        raise AimsymError("--over", f"expected NAME=START:STOP:NUM or NAME=V1,V2,..., got {args.over!r}")
    if args.set:
        raise AimsymError("--set", "not supported together with --over (one swept parameter)")
    model = load_model(args)  # checks the file
    values = parse_grid(grid, "--over")
    for v in values:  # every value is a valid binding (e.g. beta = 0 refused) before any work
        model.with_values(**{name.strip(): v})
    pd = phase_diagram(args.model, name.strip(), values, workers=args.workers, progress=not args.json,
                       samples=args.samples, replicas=args.replicas, stair_samples=args.stair_samples,
                       se_samples=args.se_samples, seed=args.seed, nodes=args.nodes,
                       staircase=not args.no_staircase, perfect=not args.no_perfect, pr_samples=args.pr_samples,
                       pr_algorithmic=not args.pr_local)
    if args.out:  # (parent folders are created: a long computation is not lost to a typo)
        from pathlib import Path

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(pd, fh, indent=1, default=to_builtin)
    if args.figure:
        from ..plot.se import phase_diagram as draw

        draw(phase_rows(pd), args.figure, title=f"{Path(args.model).stem}: thresholds vs {name}")
    if args.json:
        print_json(pd)
        return 0
    for pt in pd.points:
        steps = "  ".join(f"{s.subspace}: {s.alpha:.4f}±{s.stderr:.4f}" for s in pt.staircase)
        print(f"{name} = {pt.value:<8.4g} {steps}")
    print(f"{pd.seconds:.1f} s")
    return 0
