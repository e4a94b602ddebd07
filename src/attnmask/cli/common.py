"""Checks shared by the subcommands (``--device`` names, ``--run`` directories) and which exceptions are
the user's mistakes (:func:`is_user_mistake`).

They run before anything is loaded, so a mistake gives one line (through :func:`attnmask.cli.main`)
instead of a traceback from deep inside torch: ``model.to("cuda")`` on a CPU-only build raises an
``AssertionError``, and ``torch.device("banana")`` a ``RuntimeError``, neither of which the CLI
treats as a user mistake.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import torch

from attnmask.errors import UserError

DEVICE_HELP = "auto, cpu, cuda or cuda:N"
# --activations of the quantized blocks: attnmask.pretrained.quantized.ACTIVATIONS (named here so that
# building the parsers imports nothing of the model code; a test keeps the two equal)
ACTIVATIONS = ("float32", "int8")

# OS errors that are about a path the user named (--src, --out, --png, ...) or the disk it is on:
# the file is not there, is a directory or is not one, may not be read or written, already exists
# (an exclusive create), or the name is too long, the disk full, the file system read-only. None of
# these is fixed by changing attnmask. Every other OSError (a broken pipe, a failed mmap, ENOMEM, a
# bad file descriptor) points at attnmask's own handling and is reported as an internal error.
USER_OS_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)
USER_OS_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ELOOP})


def is_user_mistake(err: BaseException) -> bool:
    """Whether ``err`` is the user's mistake (said in one line) rather than a bug (a traceback):
    a :class:`~attnmask.errors.UserError` (``UserTypeError``, ``DataError``) or an OS error about
    a path the user named (:data:`USER_OS_ERRORS`, :data:`USER_OS_ERRNOS`)."""
    if isinstance(err, (UserError, *USER_OS_ERRORS)):
        return True
    return isinstance(err, OSError) and err.errno in USER_OS_ERRNOS


def one_line(err: BaseException) -> str:
    """The first line of what ``err`` says, for ``attnmask CMD: error: ...``; an OS error as Python
    words it, without the ``[Errno N]`` prefix: ``No such file or directory: 'in.txt'``."""
    text = str(err).strip()
    if isinstance(err, OSError) and err.errno is not None:
        text = re.sub(r"^\[Errno \d+\] ", "", text)
    return text.splitlines()[0] if text else type(err).__name__


def check_device(spec: str) -> str:
    """The torch device named by ``spec`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``), as a string.

    ``auto`` is CUDA when available, else the CPU.

    Raises:
        ValueError: ``spec`` is not a device name, or names a CUDA device this machine lacks.
    """
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as err:
        raise UserError(f"--device {spec!r} is not a device name; expected {DEVICE_HELP}") from err
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {spec!r}: attnmask runs on {DEVICE_HELP}, not {device.type!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {spec!r} asks for CUDA, but this torch has no usable CUDA device")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UserError(f"--device {spec!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return str(device)


def check_run_dir(path: str | Path) -> Path:
    """``path`` as a :class:`~pathlib.Path` if it is a directory; says what it is otherwise.

    Only whether it is a directory at all is checked here; :func:`attnmask.train.rundir.load_run`
    checks its contents.

    Raises:
        ValueError: ``path`` does not exist or is not a directory.
    """
    path = Path(path)
    if path.is_dir():
        return path
    if path.exists():
        kind = "it is a file" if path.is_file() else "it is not a directory"
        raise UserError(f"--run {path}: not a run directory ({kind}); expected the --out of `attnmask train`")
    raise UserError(f"--run {path}: not a run directory (no such directory); expected the --out of `attnmask train`")


def check_picture_path(flag: str, path: str) -> None:
    """``--png FILE``: a name whose suffix matplotlib can write (``.png``, ``.svg``, ``.pdf``, ...) or none.

    Checked before any work, so that a name the system cannot take is refused before a picture or a
    report is made: a NUL byte, or a file name longer than the folder's limit (255 bytes on most).

    Raises:
        ValueError: a suffix matplotlib has no writer for (``--png out.jpgx``), a NUL byte, a name too long.
    """
    shown = path if len(path) <= 80 else path[:77] + "..."
    if "\0" in path:
        raise UserError(f"{flag} {shown!r}: the name contains a NUL byte; expected a file path")
    name = Path(path).name if Path(path).suffix else Path(path).name + ".png"  # what _save writes
    folder = Path(path).parent
    try:
        limit = os.pathconf(folder if folder.is_dir() else ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    if len(os.fsencode(name)) > limit:
        raise UserError(f"{flag} {shown}: the file name is {len(os.fsencode(name))} bytes; expected at most {limit}")
    suffix = Path(path).suffix.lower().removeprefix(".")
    if not suffix:
        return
    from matplotlib.backend_bases import FigureCanvasBase

    formats = set(FigureCanvasBase.get_supported_filetypes()) - {"pgf"}  # .pgf needs a TeX installation
    if suffix not in formats:
        raise UserError(
            f"{flag} {path}: cannot write .{suffix} pictures; expected a name ending in .png "
            f"(or one of {', '.join('.' + f for f in sorted(formats) if f != 'png')})"
        )


def check_args(args) -> None:
    """Validate (and normalise) ``args.device`` and ``args.run`` where a subcommand has them."""
    if getattr(args, "device", None) is not None:
        args.device = check_device(args.device)
    if getattr(args, "run", None) is not None:
        check_run_dir(args.run)
