"""Command-line interface: ``aimsym <command> ...``.

Each pipeline stage registers its own sub-command through a ``register(subparsers)``
function in its ``cli`` module (listed in ``_COMMAND_MODULES``); a handler is stored as
``func`` on the parsed namespace and returns an exit code. Bad input raises
:class:`aimsym.errors.AimsymError`, printed as one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from .errors import AimsymError

# Modules providing ``register(subparsers)``; imported lazily so that ``aimsym --help``
# stays fast and a missing optional stage does not break the others.
_COMMAND_MODULES = (
    "aimsym.cli_smi",
    "aimsym.cli_se",
    "aimsym.cli_amp",
    "aimsym.aim.cli",
    "aimsym.erm.cli",
)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        sys.stderr.write(f"aimsym: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="aimsym", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if name.startswith(exc.name or "\0"):  # stage not present in this build
                continue
            raise
        module.register(sub)
    return parser


def print_json(obj) -> None:
    """Print ``obj`` as JSON (numpy arrays and scalars converted)."""
    print(json.dumps(obj, indent=2, default=_to_builtin))


def _to_builtin(obj):
    import numpy as np

    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from . import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except AimsymError as exc:
        sys.stderr.write(f"aimsym: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("aimsym: interrupted\n")
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
