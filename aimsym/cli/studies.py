"""``aimsym sweep`` (SE over a grid, resumable store) and ``aimsym plot`` (overlaps from a store)."""

from __future__ import annotations

import json
import time

from ..errors import AimsymError
from .common import parse_grid, parse_sets, print_json


def register(sub) -> None:
    _register_sweep(sub)
    _register_plot(sub)


def _register_sweep(sub) -> None:
    p = sub.add_parser("sweep", help="SE over a grid of alpha (and parameters); resumable")
    p.add_argument("model")
    p.add_argument("--alpha", required=True, help="START:STOP:NUM (linspace) or comma-separated values")
    p.add_argument("--set", action="append", metavar="NAME=V1[,V2...]", help="parameter value(s) (repeatable)")
    p.add_argument("--init", default="uninformed", help="uninformed, informed or both (comma-separated)")
    p.add_argument("--store", default="sweep.sqlite",
                   help="SQLite file written by this process only (its folder is created if missing)")
    p.add_argument("--csv", default=None)
    p.add_argument("--parquet", default=None)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--max-iter", type=int, default=None, dest="max_iter",
                   help="SE maps per point (default: the SE's 500); a point that reaches it is stored as "
                        "not converged (a later run with a larger budget keeps it)")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--scheduler", default=None, help="Dask distributed scheduler ADDRESS")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args) -> int:
    from ..studies.sweep import check_parquet, export, run_sweep

    params = parse_sets(args.set)
    inits = tuple(s.strip() for s in args.init.split(","))
    if any(i not in ("uninformed", "informed") for i in inits):
        raise AimsymError("--init", f"expected uninformed and/or informed, got {args.init!r}")
    check_parquet(args.parquet)
    t0 = time.perf_counter()
    n = run_sweep(args.model, parse_grid(args.alpha), params=params, inits=inits, store=args.store,
                  samples=args.samples, replicas=args.replicas, seed=args.seed, nodes=args.nodes, tol=args.tol,
                  workers=args.workers, scheduler=args.scheduler, progress=not args.json, max_iter=args.max_iter)
    rows = export(args.store, args.csv, args.parquet)
    slow = sum(1 for r in rows if not r["converged"])
    summary = {"computed": n, "stored": len(rows), "not_converged": slow, "store": args.store, "csv": args.csv,
               "parquet": args.parquet, "seconds": time.perf_counter() - t0}
    if slow:
        import sys

        sys.stderr.write(f"aimsym: warning: {slow} of {len(rows)} stored points did not converge within the "
                         "iteration limit (column 'converged' of --csv); raise --samples or --max-iter, or loosen --tol\n")
    if args.json:
        print_json(summary)
    else:
        print(f"computed {n} points, {len(rows)} in {args.store} ({summary['seconds']:.1f} s)")
    return 0


def _register_plot(sub) -> None:
    p = sub.add_parser("plot", help="overlaps vs alpha from a sweep store (+ thresholds JSON)")
    p.add_argument("store", help="sweep SQLite file")
    p.add_argument("--thresholds", default=None,
                   help="JSON written by 'aimsym thresholds --json' (or a reproduce state's thresholds.json)")
    p.add_argument("--init", default="uninformed", choices=("uninformed", "informed"),
                   help="which stored start to draw (default uninformed)")
    p.add_argument("--out", default="se_overlaps.png")
    p.add_argument("--title", default="")
    p.set_defaults(func=cmd_plot)


def _load_thresholds(path, hashes) -> dict:
    try:
        with open(path) as fh:
            data = json.load(fh)
        if isinstance(data, dict) and set(data) == {"key", "value"}:
            data = data["value"]  # a reproduce run's state (OUT/NAME_state/thresholds.json): the report and its key
        steps = data["staircase"]
        if not isinstance(steps, list) or not all(isinstance(t, dict) and "alpha" in t for t in steps):
            raise KeyError("staircase")
    except OSError as exc:
        raise AimsymError("--thresholds", f"cannot read {path}: {exc.strerror}") from None
    except (ValueError, KeyError, TypeError):
        raise AimsymError("--thresholds", f"{path} is not the JSON of 'aimsym thresholds --json' "
                                          "(needs a 'staircase' list of {alpha, stderr, subspace})") from None
    h = (data.get("provenance") or {}).get("model_hash")
    if h and h not in hashes:
        import warnings

        from ..errors import AimsymWarning

        warnings.warn(AimsymWarning(f"--thresholds: {path} was computed for model {h}, which is not among the "
                                    f"stored points ({', '.join(sorted(hashes))})"))
    return data


def cmd_plot(args) -> int:
    from ..plot.se import overlaps
    from ..studies.sweep import table

    rows = [r for r in table(args.store) if r["init"] == args.init]
    if not rows:
        raise AimsymError("store", f"{args.store}: no points with init = {args.init} stored")
    th = _load_thresholds(args.thresholds, {r["model_hash"] for r in rows}) if args.thresholds else {}
    overlaps(rows, args.out, th.get("staircase"), args.title, perfect=th.get("perfect_recovery"))
    print(args.out)
    return 0
