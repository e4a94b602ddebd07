"""The one loader of attnmask's native code: C and C++ sources built on first use, kept in a cache folder.

:func:`load_library` compiles a list of sources (C files with ``$CC``, C++ files with ``$CXX``
against PyTorch's headers) into one shared library and loads it with ``torch.ops.load_library``,
so that its ``TORCH_LIBRARY_IMPL`` blocks register their kernels. The library's file name hashes
everything it is built from (the sources and the headers they include, the flags, both compilers
and their versions, PyTorch's version), so a change of any of them builds anew; the build happens
in a temporary folder and is published with one ``os.replace``, so concurrent processes see a whole
library or none; older builds of the same name are pruned once a new one is published.

What a user sees:

- the first build prints one line on stderr, ``building attnmask kernels (once, ~N s)...`` (N: how
  long the last build took on this machine, else an estimate), and nothing when the library is
  already cached;
- a failed build raises :class:`BuildError` with the compiler's first ``error:`` line and the path
  of the full build log (``<cache>/kernels/<name>.log``). The callers catch it, warn once and run
  the operators' PyTorch definitions instead, which give the same results up to rounding order.

``$ATTNMASK_CACHE`` (else ``$XDG_CACHE_HOME/attnmask``, else ``~/.cache/attnmask``) is the cache
folder for compiled kernels and converted weights alike (:func:`cache_dir`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["BuildError", "Built", "cache_dir", "compiler", "kernels_dir", "load_library", "simd_flags"]

# What a first build takes on 2 cores when no build has been timed on this machine yet (seconds).
FIRST_BUILD_ESTIMATE = 60


class BuildError(OSError):
    """A native library could not be built: the compiler's first error line and the build log's path."""


@dataclass(frozen=True)
class Built:
    """What :func:`load_library` loaded: the file, whether this call built it, and how long that took."""

    path: Path
    built_now: bool
    seconds: float = 0.0
    flags: tuple[str, ...] = field(default_factory=tuple)


def cache_dir() -> Path:
    """``$ATTNMASK_CACHE``, else ``$XDG_CACHE_HOME/attnmask``, else ``~/.cache/attnmask``."""
    if os.environ.get("ATTNMASK_CACHE"):
        return Path(os.environ["ATTNMASK_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnmask"


def kernels_dir() -> Path:
    """Where compiled libraries and their build logs live: ``<cache_dir>/kernels``."""
    return cache_dir() / "kernels"


def simd_flags() -> list[str]:
    """Compiler flags for the vector instructions PyTorch found this CPU can run (``ATEN_CPU_CAPABILITY``
    lowers them, as it lowers PyTorch's own kernels)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-mavx2", "-mfma", "-mf16c"] if capability in ("AVX2", "AVX512") else []
    flags += ["-mavx512f", "-mavx512vl"] if capability == "AVX512" else []
    return flags + _vnni_flags(capability)


def _vnni_flags(capability: str) -> list[str]:
    """The byte dot products (``vpdpbusd``) of the int8 kernels, where the CPU's flags have them:
    AVX512-VNNI beside AVX-512, else AVX-VNNI (VEX, 256 bits) beside AVX2."""
    from attnmask.linear import cpu_info

    cpu = cpu_info()
    flags = cpu.flags if cpu is not None else frozenset()
    if capability == "AVX512" and "avx512_vnni" in flags:
        # with byte permutes (VBMI), the 8-bit panels' int8 estimates (blocks_kernel.c) run their vector loop
        extra = ["-mavx512bw", "-mavx512vbmi"] if {"avx512bw", "avx512vbmi"} <= flags else []
        return ["-mavx512vnni", *extra]
    if capability in ("AVX2", "AVX512") and "avx_vnni" in flags:
        return ["-mavxvnni"]
    return []


def simd_level() -> str:
    """The vector instructions :func:`simd_flags` builds for, in words."""
    capability = torch.backends.cpu.get_cpu_capability()
    level = {"AVX512": "AVX-512", "AVX2": "AVX2"}.get(capability, "portable C")
    vnni = {"-mavx512vnni": " + AVX512-VNNI", "-mavxvnni": " + AVX-VNNI", "-mavx512vbmi": " + VBMI"}
    return level + "".join(vnni.get(flag, "") for flag in _vnni_flags(capability))


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


def _first_error(output: str) -> str:
    """The first line of a compiler's output that says what went wrong (not its last, which is usually
    ``compilation terminated.`` or a count of errors)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    pattern = re.compile(r"\berror\b|\bundefined reference\b|\bcannot find\b|\bnot found\b", re.I)
    return next((line for line in lines if pattern.search(line)), lines[0] if lines else "no output")


def _includes(source: Path) -> list[Path]:
    """The project headers ``source`` includes with quotes, found beside it (part of the key)."""
    found = re.findall(r'^\s*#\s*include\s+"([^"]+)"', source.read_text(encoding="utf-8"), flags=re.M)
    return sorted(source.parent / name for name in found if (source.parent / name).is_file())


def _key(parts: list[str]) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _library_path(name: str, key: str) -> Path:
    return kernels_dir() / f"{name}-{sys.platform}-{platform.machine()}-{key}.so"


def _estimate(name: str) -> int:
    try:
        return int(round(json.loads((kernels_dir() / f"{name}.timing.json").read_text())["seconds"]))
    except (OSError, ValueError, KeyError, TypeError):
        return FIRST_BUILD_ESTIMATE


def _run(command: list[str], log, what: str, log_path: Path) -> None:
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except FileNotFoundError as err:
        log.write(f"{err}\n")
        raise BuildError(f"cannot build {what}: no compiler {command[0]!r} ({err.strerror}); log: {log_path}") from err
    except (OSError, subprocess.SubprocessError) as err:
        log.write(f"{err}\n")
        raise BuildError(f"cannot build {what}: {err}; log: {log_path}") from err
    log.write(proc.stdout + proc.stderr)
    log.flush()
    if proc.returncode:
        first = _first_error(proc.stderr + proc.stdout)
        raise BuildError(f"{command[0]} could not build {what}: {first}; full log: {log_path}")


def _prune(name: str, keep: Path) -> None:
    """Remove older builds of ``name`` and their logs; a process that has one loaded keeps its mapping
    (unlinking a loaded library is safe on POSIX)."""
    for old in kernels_dir().glob(f"{name}-{sys.platform}-{platform.machine()}-*"):
        if old.stem != keep.stem and old.suffix in (".so", ".log"):
            with contextlib.suppress(OSError):  # another process pruned it first, or it is not ours to remove
                old.unlink()


def _targets(name, sources, cflags, cxxflags, variants, cc, cxx) -> list[tuple[list[str], Path]]:
    """Each variant's extra flags and the file its build would be published as."""
    texts = []
    for source in sources:
        for path in [source, *_includes(source)]:
            texts.append(f"{path.name}\n{path.read_text(encoding='utf-8')}")
    out = []
    for extra in variants:
        c_all, cxx_all = [*cflags, *extra], [*cxxflags, *extra]
        key = _key([*texts, " ".join(c_all), " ".join(cxx_all), *cc, *cxx, torch.__version__])
        out.append((list(extra), _library_path(name, key)))
    return out


def find_library(
    name: str, sources: list[Path], *, cflags: list[str] = (), cxxflags: list[str] = (), variants=([],)
) -> tuple[Path | None, tuple[str, ...]]:
    """The build :func:`load_library` would load without building (and its variant's flags), or None."""
    cc, cxx = compiler("CC", "cc"), compiler("CXX", "c++")
    for extra, target in _targets(name, sources, cflags, cxxflags, variants, cc, cxx):
        if target.is_file():
            return target, tuple(extra)
    return None, ()


def load_library(
    name: str,
    sources: list[Path],
    *,
    cflags: list[str] = (),
    cxxflags: list[str] = (),
    variants: list[list[str]] = ([],),
    notice=None,
) -> Built:
    """Build (once, into :func:`kernels_dir`) and load the native library ``name`` from ``sources``.

    Args:
        sources: ``.c`` files (compiled with ``$CC`` and ``cflags``) and ``.cpp`` files (``$CXX``,
            ``cxxflags``, PyTorch's headers), linked with PyTorch's libraries into one library.
        variants: extra flags for both compilers, tried in order until one builds (e.g. with
            ``-fopenmp``, then without where the OpenMP runtime is missing).
        notice: called with the line to print before a build (default: print it on stderr).

    Returns:
        :class:`Built`. The library is loaded with ``torch.ops.load_library``.

    Raises:
        BuildError: no variant builds (the compiler's first error line and the log's path).
    """
    from torch.utils import cpp_extension

    cc, cxx = compiler("CC", "cc"), compiler("CXX", "c++")
    say = notice or (lambda line: print(line, file=sys.stderr, flush=True))
    error: BuildError | None = None
    for extra, target in _targets(name, sources, cflags, cxxflags, variants, cc, cxx):
        c_all, cxx_all = [*cflags, *extra], [*cxxflags, *extra]
        if target.is_file():
            torch.ops.load_library(str(target))
            return Built(target, built_now=False, flags=tuple(extra))
        kernels_dir().mkdir(parents=True, exist_ok=True)
        log_path = target.with_suffix(".log")
        say(f"building attnmask kernels (once, ~{_estimate(name)} s)...")
        start = time.perf_counter()
        try:
            with open(log_path, "w", encoding="utf-8") as log, tempfile.TemporaryDirectory(dir=kernels_dir()) as tmp:
                objects = []
                for source in sources:
                    obj = Path(tmp) / f"{source.stem}.o"
                    if source.suffix == ".c":
                        command = [cc[0], "-O3", "-fPIC", "-std=c11", *c_all, "-c", str(source), "-o", str(obj)]
                    else:
                        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
                        includes = [f"-I{path}" for path in cpp_extension.include_paths()]
                        command = [cxx[0], "-O3", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *cxx_all]
                        command += [*includes, "-c", str(source), "-o", str(obj)]
                    _run(command, log, source.name, log_path)
                    objects.append(str(obj))
                torch_lib = cpp_extension.library_paths()[0]
                out = Path(tmp) / target.name
                link = [
                    cxx[0],
                    "-shared",
                    *extra,
                    *objects,
                    "-o",
                    str(out),
                    f"-L{torch_lib}",
                    f"-Wl,-rpath,{torch_lib}",
                ]
                _run([*link, "-ltorch", "-ltorch_cpu", "-lc10"], log, f"the library {name}", log_path)
                os.replace(out, target)  # atomic: concurrent processes see a whole library or none
        except BuildError as err:
            error = err
            continue
        seconds = time.perf_counter() - start
        (kernels_dir() / f"{name}.timing.json").write_text(json.dumps({"seconds": round(seconds, 1)}))
        _prune(name, target)
        torch.ops.load_library(str(target))
        return Built(target, built_now=True, seconds=seconds, flags=tuple(extra))
    assert error is not None  # variants is never empty
    raise error
