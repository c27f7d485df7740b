"""Command-line interface: ``aimsym <command> ...``.

Each pipeline stage registers its own sub-command through a ``register(subparsers)``
function in its ``cli`` module (listed in ``_COMMAND_MODULES``); a handler is stored as
``func`` on the parsed namespace and returns an exit code. Bad input raises
:class:`aimsym.errors.AimsymError`, printed as one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import warnings

from ..errors import AimsymError

# Modules providing ``register(subparsers)``; imported lazily so that ``aimsym --help``
# stays fast and a missing optional stage does not break the others.
_COMMAND_MODULES = (
    "aimsym.cli.derive",
    "aimsym.cli.se",
    "aimsym.cli.studies",
    "aimsym.cli.amp",
    "aimsym.cli.aim",
    "aimsym.cli.erm",
    "aimsym.cli.reproduce",
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


# Options shared by several commands, checked right after parsing, before a model is loaded
# or anything is computed or written: dest -> (kind, test, what is allowed).
_OPTION_CHECKS = {
    "seed": (int, lambda v: v >= 0, "an integer >= 0"),
    "seeds": (int, lambda v: v >= 1, "an integer >= 1"),
    "samples": (int, lambda v: v >= 4, "an integer >= 4"),
    "se_samples": (int, lambda v: v >= 4, "an integer >= 4"),
    "stair_samples": (int, lambda v: v >= 4, "an integer >= 4"),
    "stair_steps": (int, lambda v: v >= 1, "an integer >= 1"),
    "pr_samples": (int, lambda v: v >= 4, "an integer >= 4"),
    "replicas": (int, lambda v: v >= 2, "an integer >= 2 (standard errors need two replicas)"),
    "nodes": (int, lambda v: v >= 1, "an integer >= 1"),
    "workers": (int, lambda v: v >= 1, "an integer >= 1"),
    "max_iter": (int, lambda v: v >= 1, "an integer >= 1"),
    "tol": (float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    "damping": (float, lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "alpha": (float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    "side_info": (float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    "lam": (float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    "init_scale": (float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
}


def check_options(args) -> None:
    """One-line errors for out-of-range shared options (see ``_OPTION_CHECKS``)."""
    for dest, (kind, ok, allowed) in _OPTION_CHECKS.items():
        v = getattr(args, dest, None)
        # (options of the same name holding text, e.g. an alpha grid, are checked by their command)
        if v is None or isinstance(v, bool) or not isinstance(v, kind):
            continue
        if not ok(v):
            raise AimsymError("--" + dest.replace("_", "-"), f"must be {allowed}, got {v!r}")
    if isinstance(getattr(args, "samples", None), int) and isinstance(getattr(args, "replicas", None), int):
        if args.samples // args.replicas < 2:
            raise AimsymError("--samples", f"need at least 2 points per replica: >= {2 * args.replicas} for "
                                           f"--replicas {args.replicas}, got {args.samples}")


def _close_progress_bars() -> None:
    """End unfinished progress bars, so that a message starts on a fresh line."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", None) or ()):
        try:
            bar.close()
        except Exception:  # noqa: BLE001 - a bar that cannot close must not hide the error
            pass


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Warnings for users as one line (no file, line or source); others as Python prints them."""
    from ..errors import AimsymWarning

    if issubclass(category, AimsymWarning):
        _close_progress_bars()
        sys.stderr.write(f"aimsym: warning: {message}\n")
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


_default_showwarning = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    from .declared import rewrite

    parser = build_parser()
    try:  # a common verb on a declared aim/erm file runs that kind's sub-command
        argv = rewrite(list(sys.argv[1:] if argv is None else argv))
    except AimsymError as exc:
        sys.stderr.write(f"aimsym: error: {exc}\n")
        return 2
    args = parser.parse_args(argv)
    warnings.showwarning = _show_warning
    if args.version:
        from ..provenance import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        check_options(args)
        return int(args.func(args) or 0)
    except AimsymError as exc:
        _close_progress_bars()
        sys.stderr.write(f"aimsym: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        _close_progress_bars()
        sys.stderr.write("aimsym: interrupted\n")
        return 130
    except RecursionError:
        _close_progress_bars()
        sys.stderr.write("aimsym: error: model: an expression is nested too deeply to process\n")
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
