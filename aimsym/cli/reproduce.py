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
    record = run(args.name, args.out, quick=args.quick)
    if args.json:
        print_json(record)
        return 0
    for kind, path in record["files"].items():
        print(f"{kind:<10} {path}")
    print(f"{record['name']}: {record['rows']} data rows, {record['seconds']:.1f} s")
    return 0
