"""Checks shared by the subcommands: ``--device`` names and ``--run`` directories.

They run before anything is loaded, so a mistake gives one line (through :func:`attnmask.cli.main`)
instead of a traceback from deep inside torch: ``model.to("cuda")`` on a CPU-only build raises an
``AssertionError``, and ``torch.device("banana")`` a ``RuntimeError``, neither of which the CLI
treats as a user mistake.
"""

from __future__ import annotations

from pathlib import Path

import torch

from attnmask.errors import UserError

DEVICE_HELP = "auto, cpu, cuda or cuda:N"


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


def check_args(args) -> None:
    """Validate (and normalise) ``args.device`` and ``args.run`` where a subcommand has them."""
    if getattr(args, "device", None) is not None:
        args.device = check_device(args.device)
    if getattr(args, "run", None) is not None:
        check_run_dir(args.run)
