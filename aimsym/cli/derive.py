"""CLI of the foundation stages: ``aimsym derive`` and ``aimsym generate``."""

from __future__ import annotations

import sys
from pathlib import Path


# the names of aimsym.derive.latex.PARTS (kept here: the CLI starts without importing SymPy)
LATEX_PARTS = ("model", "link", "reduction", "jacobian", "state-evolution", "free-entropy", "operator")


def register(sub) -> None:
    p = sub.add_parser("derive", help="derive the SMI form of a model (link, symmetries, reduction)")
    p.add_argument("model", help="a TOML file (e.g. derivations/attention_L2_T2.toml)")
    p.add_argument("--set", action="append", metavar="NAME=VALUE", help="bind a symbolic parameter")
    p.add_argument("--latex", metavar="FILE", help="write a self-contained LaTeX document")
    p.add_argument("--no-appendix", action="store_true",
                   help="leave the appendix (program, Jacobian, reduction entries) out of the document")
    p.add_argument("--latex-part", metavar="PART", choices=LATEX_PARTS,
                   help="write one align block for pasting (" + ", ".join(LATEX_PARTS) + ") "
                        "instead of the document: to --latex FILE, else to stdout")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.add_argument("--check", action="store_true",
                   help="also evaluate the generated link at random Z and compare with the symbolic one")
    p.set_defaults(func=_derive)

    g = sub.add_parser("generate", help="write numba kernels for models into generated/ (or the cache)")
    g.add_argument("models", nargs="*", help="TOML files (default: every file in derivations/)")
    g.add_argument("--check", action="store_true", help="exit 1 if a committed module is stale or missing")
    g.add_argument("--out", metavar="DIR", help="write here instead of generated/ or the cache")
    g.set_defaults(func=_generate)


def _load(args):
    from ..model import load
    from aimsym.derive.spec import parse_assignments

    return load(Path(args.model), **parse_assignments(args.set))


def _derive(args) -> int:
    from aimsym.cli.common import print_json

    model = _load(args)
    d = model.derivation
    summary = model.summary()
    if args.latex_part and not args.latex:
        from aimsym.derive.latex import part

        sys.stdout.write(part(d, args.latex_part))
        return 0
    if args.latex:
        from aimsym.derive.latex import document, part

        text = part(d, args.latex_part) if args.latex_part else document(d, appendix=not args.no_appendix)
        Path(args.latex).parent.mkdir(parents=True, exist_ok=True)
        Path(args.latex).write_text(text)
        summary["latex"] = str(args.latex)
    if args.check:
        import numpy as np

        rng = np.random.default_rng(0)
        Z = rng.standard_normal((8, model.p, model.tokens))
        prm = model.params_array()
        ref = np.stack([d.numeric_link(z, prm) for z in Z]).reshape(8, *model.output_shape)
        summary["check_max_abs_diff"] = float(np.max(np.abs(model.link(Z) - ref)))
    if args.json:
        print_json(summary)
        return 0
    red = summary["reduction"]
    print(f"model        {summary['name']} ({summary['kind']}, spec hash {summary['spec_hash']})")
    print(f"indices p    {summary['indices']}   tokens T {summary['tokens']}   output {tuple(summary['output_shape'])}")
    if summary["parameters"]:
        print(f"parameters   {', '.join(summary['parameters'])}  bound: {summary['values'] or 'none'}")
    for k, lbl in enumerate(summary["index_labels"]):
        print(f"  z[{k}, :]   {lbl}")
    print("symmetries   " + ("; ".join(s["name"] for s in summary["symmetries"]) or "none"))
    if red["found"]:
        print(f"reduction    found: integral dimension {red['integral_dim']}, {red['branches']} branches")
    else:
        print("reduction    not found")
    print(f"             {red['reason']}")
    for note in red["notes"]:
        print(f"  note: {note}")
    print(f"denoiser     {summary['denoiser_path']}")
    if args.latex:
        print(f"latex        written to {args.latex}")
    if "check_max_abs_diff" in summary:
        print(f"check        generated vs symbolic link: max |diff| = {summary['check_max_abs_diff']:.2e}")
    return 0


def _generate(args) -> int:
    from aimsym.derive import codegen
    from aimsym.derive import spec as spec_mod
    from aimsym.errors import AimsymError

    from aimsym.derive import setups
    from aimsym.derive.files import derivations_dir, resolve

    # aim and erm setups have no SMI derivation, hence no kernels
    files = [resolve(m) for m in args.models] or [f for f in sorted(derivations_dir().glob("*.toml"))
                                                  if setups.kind_of(f) not in setups.KINDS]
    if not files:
        raise AimsymError("models", "no TOML files given and none in derivations/")
    stale = []
    for f in files:
        spec = spec_mod.load(f)
        if args.out:
            path = Path(args.out) / f"{spec.name}.py"
        else:
            path = codegen.module_path(spec)
        if args.check:
            if codegen.is_stale(spec, path):
                stale.append(str(path))
                print(f"stale    {path}", file=sys.stderr)
            else:
                print(f"ok       {path}")
            continue
        codegen.write_module(spec, path)
        print(f"wrote    {path}")
    if stale:
        print(f"{len(stale)} generated module(s) out of date: run `aimsym generate`", file=sys.stderr)
        return 1
    return 0
