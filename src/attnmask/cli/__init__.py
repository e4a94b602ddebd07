"""The ``attnmask`` command line: one console script, one module per subcommand.

Each subcommand module exposes ``add_parser(subparsers)`` which registers its parser and sets
``func``. What escapes a subcommand is sorted in two (Click's ``ClickException`` vs the rest):

- a user mistake: :class:`attnmask.errors.UserError` (``UserTypeError``, ``DataError``) or an OS
  error about a path the user named (:func:`attnmask.cli.common.is_user_mistake`) becomes one line
  on stderr, ``attnmask CMD: error: ...``, and exit code 2, never a traceback;
- anything else is a bug in attnmask, a ``TypeError`` from a wrong call or a ``ValueError`` or
  ``RuntimeError`` from inside a library alike: ``attnmask: internal error — please report:`` and
  the traceback on stderr, exit code 70 (``EX_SOFTWARE``).

Ctrl-C exits 130. ``ATTNMASK_DEBUG=1`` lets every exception propagate with its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
import warnings

from attnmask import allocator
from attnmask.cli.common import is_user_mistake, one_line
from attnmask.errors import UserError

__all__ = ["COMPUTE_SUBCOMMANDS", "EX_INTERNAL", "EX_USAGE", "SUBCOMMANDS", "UserError", "build_parser", "main"]

# Subcommand modules, in --help order.
SUBCOMMANDS = (
    "demo",
    "train",
    "export",
    "translate",
    "generate",
    "serve",
    "eval",
    "mask",
    "attention",
    "audit",
    "conform",
    "kernels",
)

# Subcommands that run a model long enough for the allocator policy to matter: these alone get
# allocator.keep_freed_memory() ($ATTNMASK_MALLOC); `mask` only draws and keeps the C library's default.
COMPUTE_SUBCOMMANDS = frozenset({"train", "demo", "translate", "generate", "eval", "serve"})

EX_USAGE = 2  # a user mistake, as argparse's own usage errors
EX_INTERNAL = 70  # EX_SOFTWARE (sysexits.h): a bug in attnmask
INTERNAL_BANNER = "attnmask: internal error — please report:"


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
            if args.command in COMPUTE_SUBCOMMANDS:
                allocator.keep_freed_memory()  # freed memory is kept for reuse (ATTNMASK_MALLOC)
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("attnmask: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("ATTNMASK_DEBUG"):
            raise
        if is_user_mistake(e):
            print(f"attnmask {args.command}: error: {one_line(e)}", file=sys.stderr)
            return EX_USAGE
        print(INTERNAL_BANNER, file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        return EX_INTERNAL


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command)
    return None


if __name__ == "__main__":
    sys.exit(main())
