"""What attnmask raises when its input cannot be used, so that a caller can tell a mistake from a bug.

Every check a user can trip (a mask of the wrong shape, an unknown model name, a malformed data
file, a flag out of range) raises :class:`UserError`, or :class:`UserTypeError` when the input is
of the wrong kind, with the offending value and the expected form in the message. Both subclass
the built-in exceptions they stand for (``ValueError``, ``TypeError``), so ``except ValueError``
in a caller's code keeps working.

The command line reports these as one line on stderr with exit code 2; anything else that escapes
a subcommand (a ``TypeError`` from a wrong call, an ``IndexError``, a plain ``ValueError`` from
inside a library) is a bug, reported with its traceback as an internal error (exit code 70).
"""

from __future__ import annotations

__all__ = ["UserError", "UserTypeError"]


class UserError(ValueError):
    """Input that cannot be used as given: the message names the value and what was expected."""


class UserTypeError(UserError, TypeError):
    """Input of the wrong kind (a tensor where a mask was expected, a string where a number was)."""
