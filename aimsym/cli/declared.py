"""The common verbs on declared AIM and ERM files: ``aimsym se|thresholds|amp|gd FILE ...`` with
``kind = "aim"`` or ``"erm"`` runs ``aimsym aim VERB`` / ``aimsym erm VERB`` with the file's values
as options (same code path, so the same numbers); ``--set NAME=VALUE`` overrides a value."""

from __future__ import annotations

from ..errors import AimsymError

# common verb -> sub-command of the kind (erm trains by Adam: its gd is ``erm train``)
VERBS = {"aim": {"se": "se", "thresholds": "thresholds", "amp": "amp", "gd": "gd"},
         "erm": {"se": "se", "thresholds": "thresholds", "gd": "train"}}


def _split_sets(args: list[str]) -> tuple[list[str], list[str]]:
    rest, sets, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a == "--set" and i + 1 < len(args):
            sets.append(args[i + 1])
            i += 2
            continue
        if a.startswith("--set="):
            sets.append(a.split("=", 1)[1])
        else:
            rest.append(a)
        i += 1
    return rest, sets


def rewrite(argv: list[str]) -> list[str]:
    """``argv`` unchanged unless it is a common verb on an aim or erm file."""
    if len(argv) < 2 or argv[0] not in ("se", "thresholds", "amp", "gd"):
        return argv
    from ..derive import setups
    from ..derive.files import resolve
    from ..derive.spec import parse_assignments

    path = resolve(argv[1])
    if not path.is_file() or path.suffix != ".toml":
        return argv
    try:
        kind = setups.kind_of(path)
    except AimsymError:
        return argv  # the verb itself reports the broken file
    if kind not in setups.KINDS:
        return argv
    verb = VERBS[kind].get(argv[0])
    if verb is None:
        raise AimsymError("model", f"{path.name} is an {kind} model: '{argv[0]}' does not apply "
                                   f"(use {', '.join(VERBS[kind])})")
    rest, sets = _split_sets(argv[2:])
    setup = setups.load(path)
    overrides = {}
    for item in sets:
        k, _, v = item.partition("=")
        overrides.update(parse_assignments([item]) if k.strip() not in ("activation", "model", "penalty", "output")
                         else {k.strip(): v.strip()})
    setup = setup.with_values(**overrides)
    return [kind, verb, *setup.options(verb), *rest]
