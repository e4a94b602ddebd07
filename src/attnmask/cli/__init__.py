"""The ``attnmask`` command line: one console script, one module per subcommand.

Each subcommand module exposes ``add_parser(subparsers)`` which registers its parser and sets
``func``. A user mistake (``ValueError``, ``TypeError``, ``OSError``) becomes one line on stderr and
exit code 2, never a traceback; ``ATTNMASK_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from attnmask import allocator

# Subcommand modules, in --help order.
SUBCOMMANDS = ("demo", "train", "translate", "generate", "eval", "mask", "attention", "audit", "conform")


class UserError(Exception):
    """An error caused by the user's input; printed as one line."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr (exit code 2): the
    subcommand's name, what was wrong, and where the usage is. Subparsers inherit the class."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"attnmask: warning: {str(message).strip().splitlines()[0]}", file=file or sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    from attnmask import __version__

    parser = Parser(
        prog="attnmask",
        description="Masked attention done right: masks, Transformers that train and decode with them, "
        "and audits that prove no token peeks.",
    )
    parser.add_argument("--version", action="version", version=f"attnmask {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"attnmask.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the subcommand's parser, so the pointer goes to its --help
        sub = _subparser(parser, getattr(args, "command", None))
        (sub or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning  # restored on exit
            allocator.keep_freed_memory()  # a compute job: freed memory is kept for reuse (ATTNMASK_MALLOC)
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("attnmask: interrupted", file=sys.stderr)
        return 130
    except (UserError, ValueError, TypeError, OSError) as e:
        if os.environ.get("ATTNMASK_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"attnmask {args.command}: error: {msg}", file=sys.stderr)
        return 2


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command)
    return None


if __name__ == "__main__":
    sys.exit(main())
