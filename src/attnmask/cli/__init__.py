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

# Subcommand modules, in --help order. A module missing here is simply not offered.
SUBCOMMANDS = ("demo", "train", "translate", "generate", "eval", "mask", "attention", "audit", "conform")


class UserError(Exception):
    """An error caused by the user's input; printed as one line."""


def build_parser() -> argparse.ArgumentParser:
    from attnmask import __version__

    parser = argparse.ArgumentParser(
        prog="attnmask",
        description="Masked attention done right: masks, Transformers that train and decode with them, "
        "and audits that prove no token peeks.",
    )
    parser.add_argument("--version", action="version", version=f"attnmask {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            mod = importlib.import_module(f"attnmask.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"attnmask.cli.{name}":
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
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


if __name__ == "__main__":
    sys.exit(main())
