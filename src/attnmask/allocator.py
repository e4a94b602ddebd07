"""Keep the memory a training step frees for the next step, instead of handing it back to the kernel.

A training step on the CPU allocates and frees the same few hundred tensors every step, many of
them megabytes (activations, their gradients, the loss's chunks). glibc's ``malloc`` returns a
freed block above its mmap threshold to the kernel at once and trims free memory at the top of
its heap, so the next step asks the kernel for the same memory again and takes a page fault on
every 4 KiB page of it, each page zeroed on the way (figures: ``docs/benchmarks.md``, "Training").

:func:`keep_freed_memory` raises both thresholds through ``mallopt``: blocks up to
:data:`MMAP_THRESHOLD` come from the heap, and up to :data:`TRIM_THRESHOLD` of free memory stays
in it. The cost is that the process holds on to its peak heap until it exits. It changes where
memory comes from, never what is computed.

This is a switch on the whole process, and irreversible: the library never calls it. The
``attnmask`` CLI applies it to its compute subcommands, as the benchmarks do, because they own
their process. ``$ATTNMASK_MALLOC`` = ``keep`` (the default there) or ``default`` (leave the C
library as it is); any other value is warned about and treated as ``default``. A program of your
own that wants the same policy sets it where a process's policy belongs, in its environment, before
Python starts (glibc reads it at startup)::

    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824 python train.py

:func:`current_policy` says, without changing anything, which policy this process runs under.
Nothing changes where the C library is not glibc, or where another allocator (jemalloc, tcmalloc,
mimalloc) is preloaded.
"""

from __future__ import annotations

import ctypes
import os
import platform
import warnings

__all__ = ["MMAP_THRESHOLD", "POLICIES", "TRIM_THRESHOLD", "TUNABLES", "current_policy", "keep_freed_memory"]

POLICIES = ("keep", "default")
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit systems
TRIM_THRESHOLD = 1 << 30
_M_TRIM, _M_MMAP = -1, -3  # mallopt's parameter numbers (malloc.h)
# the same two settings as glibc tunables, for $GLIBC_TUNABLES (read by glibc when a process starts)
TUNABLES = f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:glibc.malloc.trim_threshold={TRIM_THRESHOLD}"

_applied: str | None = None  # the sentence for the log, once keep_freed_memory has run


def _policy() -> str:
    """``$ATTNMASK_MALLOC``: ``keep`` or ``default``; anything else is warned about and is ``default``."""
    raw = os.environ.get("ATTNMASK_MALLOC", "keep")
    name = raw.strip().lower() or "keep"
    if name not in POLICIES:
        warnings.warn(f"ATTNMASK_MALLOC={raw!r}: expected keep|default; leaving the C library's default", stacklevel=3)
        return "default"
    return name


def _preloaded() -> str | None:
    preload = os.environ.get("LD_PRELOAD", "")
    return next((lib for lib in ("jemalloc", "tcmalloc", "mimalloc") if lib in preload), None)


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def keep_freed_memory() -> str:
    """Apply ``$ATTNMASK_MALLOC`` to this whole process (once; later calls repeat the answer) and
    say what was done, for a run's log. For the program that owns the process (the CLI, a
    benchmark), never for library code. A value other than ``keep`` or ``default`` warns
    (``UserWarning``) and leaves the C library's default; nothing here raises."""
    global _applied
    if _applied is not None:
        return _applied
    preloaded = _preloaded()
    if _policy() == "default":
        _applied = "the C library's default (ATTNMASK_MALLOC=default)"
    elif preloaded:
        _applied = f"{preloaded} (preloaded), left as it is"
    elif not _glibc():
        _applied = "the C library's default (not glibc)"
    else:
        libc = ctypes.CDLL(None)
        settings = ((_M_MMAP, MMAP_THRESHOLD), (_M_TRIM, TRIM_THRESHOLD))
        ok = all(libc.mallopt(param, value) == 1 for param, value in settings)
        _applied = (
            f"freed memory kept for reuse (glibc: blocks up to {MMAP_THRESHOLD >> 20} MiB from the heap, "
            f"up to {TRIM_THRESHOLD >> 30} GiB of it kept free)"
            if ok
            else "the C library's default (glibc refused mallopt)"
        )
    return _applied


def current_policy() -> str:
    """The allocator policy this process runs under, for a log line; changes nothing.

    What :func:`keep_freed_memory` did if it ran, else the malloc settings of ``$GLIBC_TUNABLES``
    or a preloaded allocator if there is one, else ``"the C library's default"``."""
    if _applied is not None:
        return _applied
    preloaded = _preloaded()
    if preloaded:
        return f"{preloaded} (preloaded)"
    tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t.startswith("glibc.malloc.")]
    if tunables and _glibc():
        return f"glibc tunables {':'.join(tunables)} (GLIBC_TUNABLES)"
    return "the C library's default"
