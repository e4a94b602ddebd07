"""attnmask's native library: every C/C++ kernel in one build, loaded once a process.

``csrc/blocks_kernel.c`` (the block-weight products), ``csrc/blocks.cpp`` (their operators) and
``csrc/decoding.cpp`` (the decoding step's operators, which call the block product through
``csrc/blocks.h``) are built together by :func:`attnmask.ops.build.load_library` into
``<cache>/kernels``, for the SIMD level PyTorch finds this CPU runs, with OpenMP where the compiler
has it. Loading registers the CPU kernels of every operator of :mod:`attnmask.ops.blocks` and
:mod:`attnmask.ops.decoding`; without it each operator runs its PyTorch definition.

:func:`available` builds and loads the library the first time it is asked (one line on stderr
before a build) and answers whether the kernels are there; where they cannot be built (no
compiler, a failed build), it warns once, naming the compiler's first error and the build log, and
answers False: the callers (block layers, the decoding step) then take their PyTorch paths, which
compute the same function. ``ATTNMASK_KERNELS=0`` turns the library off without trying.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from attnmask.ops import blocks, build, decoding

__all__ = ["OPERATORS", "Status", "available", "cached", "load", "status"]

NAME = "attnmask_ops"
CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / "blocks_kernel.c", CSRC / "blocks.cpp", CSRC / "rows.cpp", CSRC / "decoding.cpp"]

# Every operator of the library: its name, the module that defines it (schema and PyTorch definition).
OPERATORS = {
    "block_matmul": blocks,
    "block_matmul_i8": blocks,
    "block_dequantize": blocks,
    "pack_block_panels": blocks,
    "block_panels_matmul": blocks,
    "rms_norm": decoding,
    "add_rms_norm": decoding,
    "silu_mul": decoding,
    "paged_attend": decoding,
    "packed_step": decoding,
    "linear_rows": decoding,
    "pack_panels": decoding,
    "linear_panels": decoding,
    "head_argmax": decoding,
}


@dataclass(frozen=True)
class Status:
    """Where the operators' CPU kernels come from in this process.

    ``state``: ``built`` (compiled by this process), ``cached`` (a build found in the cache folder),
    ``fallback`` (could not be built: PyTorch definitions), ``disabled`` (``ATTNMASK_KERNELS=0``) or
    ``unloaded`` (not asked for yet). ``why`` says it in words; ``simd`` is the vector width the
    block kernel was compiled for, ``threads`` whether OpenMP splits the work."""

    state: str
    why: str
    path: Path | None = None
    simd: str = ""
    threads: str = ""
    seconds: float = 0.0

    @property
    def native(self) -> bool:
        return self.state in ("built", "cached")


def _flags() -> dict[str, list]:
    return {
        # every sum and product in the order and rounding it is written in: the block sums, and the C++
        # code that must equal its PyTorch definition bit for bit (g++ contracts a * b + c * d into a fused
        # multiply-add by default, even with -std=c++20, where gcc's C mode does not)
        "cflags": ["-ffp-contract=off", *build.simd_flags()],
        "cxxflags": ["-ffp-contract=off", *build.simd_flags()],
        "variants": [["-fopenmp"], []],  # without an OpenMP runtime: one thread
    }


def cached() -> Path | None:
    """The build :func:`load` would load from the cache folder without compiling, if there is one."""
    return build.find_library(NAME, SOURCES, **_flags())[0]


_lock = threading.Lock()
_status = Status("unloaded", "not loaded yet (built on first use, or by `attnmask kernels --build`)")


def load(*, notice=None) -> Status:
    """Build (if needed) and load the library, once a process; returns its :class:`Status`."""
    global _status
    if _status.state != "unloaded":
        return _status
    with _lock:
        if _status.state != "unloaded":
            return _status
        setting = os.environ.get("ATTNMASK_KERNELS", "1").strip()
        if setting not in ("0", "1", ""):
            warnings.warn(f"ATTNMASK_KERNELS={setting!r}: expected 1 (the default) or 0; taking 1", stacklevel=3)
        if setting == "0":
            _status = Status("disabled", "disabled by ATTNMASK_KERNELS=0: every operator runs its PyTorch definition")
            return _status
        try:
            built = build.load_library(NAME, SOURCES, **_flags(), notice=notice)
        except (OSError, RuntimeError) as err:  # BuildError, or a cached library that does not load
            _status = Status("fallback", f"PyTorch definitions: {err}")
            warnings.warn(f"attnmask: native kernels unavailable, using PyTorch's (slower): {err}", stacklevel=3)
            return _status
        simd = {512: "AVX-512", 256: "AVX2"}.get(int(torch.ops.attnmask.kernel_simd()), "portable C")
        threads = "OpenMP threads" if "-fopenmp" in built.flags else "one thread (no OpenMP)"
        state = "built" if built.built_now else "cached"
        took = f", built in {built.seconds:.0f} s" if built.built_now else ""
        _status = Status(
            state, f"C/C++, {simd}, {threads} ({built.path}{took})", built.path, simd, threads, built.seconds
        )
        return _status


@torch.compiler.assume_constant_result  # a compiled graph asks once, at trace time
def available() -> bool:
    """Whether the native CPU kernels are loaded (building them on the first call)."""
    return load().native


def status() -> Status:
    """The library's :class:`Status` in this process, without building or loading anything."""
    return _status
