"""Keep the memory a training step frees for the next step, instead of handing it back to the kernel.

A training step on the CPU allocates and frees the same few hundred tensors every step, many of
them megabytes (activations, their gradients, the loss's chunks). glibc's ``malloc`` returns a
freed block above its mmap threshold to the kernel at once and trims free memory at the top of
its heap, so the next step asks the kernel for the same memory again and takes a page fault on
every 4 KiB page of it, each page zeroed on the way: about 23,000 faults a step for the Multi30k
training step of ``benchmarks/train_throughput.py``, 5-8% of its time on a 2-core Zen 5.

:func:`keep_freed_memory` raises both thresholds through ``mallopt``: blocks up to
:data:`MMAP_THRESHOLD` come from the heap, and up to :data:`TRIM_THRESHOLD` of free memory stays
in it. The cost is that the process holds on to its peak heap until it exits. It changes where
memory comes from, never what is computed.

``$ATTNMASK_MALLOC`` = ``keep`` (the default) or ``default`` (leave the C library as it is). Nothing
changes where the C library is not glibc, or where another allocator (jemalloc, tcmalloc) is
preloaded.
"""

from __future__ import annotations

import ctypes
import os
import platform

from attnmask.errors import UserError

__all__ = ["MMAP_THRESHOLD", "POLICIES", "TRIM_THRESHOLD", "keep_freed_memory"]

POLICIES = ("keep", "default")
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit systems
TRIM_THRESHOLD = 1 << 30
_M_TRIM, _M_MMAP = -1, -3  # mallopt's parameter numbers (malloc.h)

_applied: str | None = None  # the sentence for the log, once applied


def _policy() -> str:
    name = os.environ.get("ATTNMASK_MALLOC", "keep").strip().lower() or "keep"
    if name not in POLICIES:
        raise UserError(f"ATTNMASK_MALLOC={name!r}: expected one of {', '.join(POLICIES)}")
    return name


def keep_freed_memory() -> str:
    """Apply ``$ATTNMASK_MALLOC`` to this process (once; later calls repeat the answer) and say what
    was done, for a run's log."""
    global _applied
    if _applied is not None:
        return _applied
    preloaded = [lib for lib in ("jemalloc", "tcmalloc", "mimalloc") if lib in os.environ.get("LD_PRELOAD", "")]
    if _policy() == "default":
        _applied = "the C library's default (ATTNMASK_MALLOC=default)"
    elif preloaded:
        _applied = f"{preloaded[0]} (preloaded), left as it is"
    elif platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
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
