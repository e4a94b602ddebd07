"""attnmask's C and C++ code, built on first use with the system compilers and kept in a cache folder.

Two native pieces ship as source: the block-weight kernel (``attnmask/pretrained/_quantized.c`` and
its operator ``_quantized_op.cpp``) and the decoding step's fused operators
(``attnmask/decode/_fused.cpp``). Each is compiled the first time it is needed, for the SIMD level
PyTorch finds this CPU runs, into ``<cache_dir>/kernels`` under a name that hashes the sources, the
flags, the compilers and PyTorch's version, so that a change of any of them builds anew and
concurrent processes never see half a library. Where a compiler is missing, the callers fall back
to PyTorch and say so once; nothing here is needed for correctness.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

__all__ = ["build_operator", "cache_dir", "compiler", "library_name", "run", "simd_flags"]


def cache_dir() -> Path:
    """``$ATTNMASK_CACHE``, else ``$XDG_CACHE_HOME/attnmask``, else ``~/.cache/attnmask``."""
    if os.environ.get("ATTNMASK_CACHE"):
        return Path(os.environ["ATTNMASK_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnmask"


def simd_flags() -> list[str]:
    """Compiler flags for the vector instructions PyTorch found this CPU can run."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-mavx2", "-mfma"] if capability in ("AVX2", "AVX512") else []
    return flags + (["-mavx512f", "-mavx512vl"] if capability == "AVX512" else [])


def compiler(variable: str = "CC", default: str = "cc") -> tuple[str, str]:
    """The compiler named by ``$variable`` (else ``default``) and the first line of its ``--version``:
    part of a library's name, so that another compiler (or version) builds its own."""
    command = os.environ.get(variable, default)
    try:
        proc = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=30)
        version = (proc.stdout.strip().splitlines() or ["?"])[0]
    except (OSError, subprocess.SubprocessError):
        version = "unknown"  # the build then reports why it cannot run
    return command, version


def run(command: list[str], what: str) -> None:
    """Run a build command; ``OSError`` naming ``what`` and the compiler's last line if it fails."""
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise OSError(f"{command[0]} could not build {what}: {last}")


def library_name(prefix: str, *parts: str) -> str:
    """``<prefix>-<platform>-<machine>-<hash of parts>.so``: parts are what the library is built from."""
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return f"{prefix}-{sys.platform}-{platform.machine()}-{key}.so"


def build_operator(target: Path, source: Path, cxx: str, *, objects: list[Path] = (), flags: list[str] = ()) -> None:
    """Compile the C++ ``source`` (PyTorch operator implementations, ``TORCH_LIBRARY_IMPL``) with
    ``objects`` into the shared library ``target``, against this PyTorch's headers and libraries.
    ``objects`` are built by the caller into ``target``'s folder (e.g. a C kernel)."""
    from torch.utils import cpp_extension

    torch_lib = cpp_extension.library_paths()[0]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        run(
            [cxx, "-O3", "-shared", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *flags, *includes]
            + [str(source), *map(str, objects), "-o", str(out), f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"]
            + ["-ltorch", "-ltorch_cpu", "-lc10"],
            source.name,
        )
        os.replace(out, target)  # atomic: concurrent processes see a whole library or none
