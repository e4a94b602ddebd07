"""Crash-safe files: every checkpoint file is complete or absent, never half written.

Each file is written to a temporary name in the same directory, flushed to disk (``fsync``), then
renamed over the old one with :func:`os.replace`, which is atomic on POSIX file systems: a reader
(or a resumed run after ``kill -9``) sees either the previous version or the new one. The
directory is fsynced too, so the rename itself survives a power cut.

A training checkpoint is two files in the run directory (see :mod:`attnmask.train.rundir`):

- ``model.safetensors``: the weights, for inference (:func:`attnmask.train.rundir.load_run`);
- ``trainer_state.pt``: everything a resume needs, **weights included**, in one file. Resuming
  reads only this file, so a crash between the two renames can never pair step-N weights with
  step-N+1 optimizer state.
"""

from __future__ import annotations

import io
import os
import random
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from attnmask.errors import UserError


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not every platform can open a directory (Windows); the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)``, fsync the result, then atomically rename it to ``path``.

    If ``write`` raises (or the process dies), ``path`` keeps its previous content and the
    temporary file is removed (or, after ``kill -9``, left as ``.<name>.tmp-<pid>``, which nothing
    reads).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete temporary files left by writers that were killed mid-write (never read by anyone)."""
    stale = [p for p in Path(directory).glob(".*.tmp-*") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def save_torch(path: str | Path, obj) -> Path:
    """``torch.save`` made atomic. The object is serialized in memory first, so a failure while
    pickling never touches the disk."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return atomic_write_bytes(path, buffer.getvalue())


def save_weights(path: str | Path, model: nn.Module, metadata: dict[str, str] | None = None) -> Path:
    """Weights as safetensors (tied/shared tensors stored once), atomically."""
    return atomic_write(path, lambda tmp: save_model(model, str(tmp), metadata=metadata))


def load_weights(path: str | Path, model: nn.Module) -> None:
    """Load ``save_weights`` output into ``model`` (strict: every tensor must match).

    Raises:
        ValueError: the file is not safetensors, or names/shapes differ from the model's.
    """
    try:
        load_model(model, str(path), strict=True)
    except Exception as err:  # safetensors raises several types for a bad file or mismatch
        raise UserError(f"{path}: cannot load weights into the model: {' '.join(str(err).split())}") from err


def load_torch(path: str | Path) -> dict:
    """Read a :func:`save_torch` file (only plain tensors/containers: ``weights_only=True``).

    Raises:
        ValueError: the file is not a readable checkpoint.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:  # a truncated or foreign file
        raise UserError(f"{path}: not a readable trainer checkpoint ({err})") from err


# --- random number generators ------------------------------------------------------------------


def rng_state() -> dict:
    """The state of every generator a training step draws from (dropout, shuffles)."""
    state = {"torch": torch.get_rng_state(), "python": _python_state_to_tensor(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_python_state_from_tensor(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _python_state_to_tensor(state: tuple) -> dict:
    # random.getstate() is (version, tuple_of_625_ints, gauss_next); kept as plain types so the
    # checkpoint loads with weights_only=True.
    version, internal, gauss = state
    return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}


def _python_state_from_tensor(state: dict) -> tuple:
    return (state["version"], tuple(int(x) for x in state["internal"].tolist()), state["gauss"])
