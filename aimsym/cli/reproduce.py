"""``aimsym reproduce``: the papers' figures, one command each (registry: aimsym.reproduce)."""

from __future__ import annotations

from ..errors import AimsymError
from .common import print_json


def register(sub) -> None:
    p = sub.add_parser("reproduce", help="draw a figure of the papers (PNG, PDF, CSV data, JSON provenance)")
    p.add_argument("name", nargs="?", metavar="NAME", help="figure name (see --list)")
    p.add_argument("--list", action="store_true", help="list the papers' figures with their status")
    p.add_argument("--quick", action="store_true", help="small grids (seconds to a minute on one core)")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default ./reproduce/NAME)")
    p.add_argument("--compare", default=None, metavar="CSV",
                   help="after the run, compare its data with another run's NAME.csv at their shared points "
                        "(e.g. a quick run against the full one); exit 1 if they disagree beyond their errors")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_reproduce)


def cmd_reproduce(args) -> int:
    from ..reproduce import listing, names, run

    if args.list:
        if args.name:
            raise AimsymError("--list", "takes no figure name")
        rows = listing()
        if args.json:
            print_json(rows)
            return 0
        for r in rows:
            what = "" if r["status"] == "available" else f"  [{r['status']}: {r['reason']}]"
            print(f"{r['name']:<16} {r['paper']} {r['figure']:<22} {r['caption']}{what}")
        return 0
    if not args.name:
        raise AimsymError("NAME", f"give a figure name or --list; one of {', '.join(names())}")
    if args.compare is not None:
        from pathlib import Path

        if not Path(args.compare).is_file():
            raise AimsymError("--compare", f"no such CSV file: {args.compare}")
    record = run(args.name, args.out, quick=args.quick)
    check = None
    if args.compare is not None:
        from ..reproduce import compare_runs, lookup

        check = record["comparison"] = compare_runs(record["files"]["csv"], args.compare,
                                                    line_rtol=lookup(args.name).line_rtol)
    if args.json:
        print_json(record)
    else:
        for kind, path in record["files"].items():
            print(f"{kind:<10} {path}")
        print(f"{record['name']}: {record['rows']} data rows, {record['seconds']:.1f} s")
        if check is not None:
            print(f"compared with {args.compare}: {check['shared_points']} shared points "
                  f"({check['unchecked']} without error bars, not compared), worst "
                  f"{check['worst_ratio']:.2f} of the allowed difference, "
                  + ("agree" if check["ok"] else f"{len(check['failures'])} disagree"))
            for fl in check["failures"][:10]:
                print(f"  {fl}")
    return 0 if check is None or check["ok"] else 1
