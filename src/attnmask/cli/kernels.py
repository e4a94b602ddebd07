"""``attnmask kernels``: where each operator's CPU kernel comes from here, and ``--build`` to build them now."""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch

from attnmask import ops
from attnmask.ops import build, native


def add_parser(sub) -> None:
    p = sub.add_parser(
        "kernels",
        help="show the native kernels' status; --build builds them now",
        description="attnmask's operators (block-weight products, the decoding step's operators) run "
        "native CPU kernels from one C/C++ library, built on first use into the cache folder, or "
        "their PyTorch definitions where it cannot be built (the same results, slower). This shows "
        "which, and why. --build builds the library now, e.g. when making an image or warming CI; "
        "it exits 1 if the build fails.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--build", action="store_true", help="build (or load) the library now and report")
    p.set_defaults(func=run)


def _compilers() -> list[str]:
    found = []
    for variable, default in (("CC", "cc"), ("CXX", "c++")):
        command = os.environ.get(variable, default)
        where = shutil.which(command)
        found.append(f"${variable}={command} ({'found' if where else 'not found'})")
    return found


def run(args) -> int:
    status = ops.load() if args.build else ops.status()
    disabled = os.environ.get("ATTNMASK_KERNELS", "1").strip() == "0"
    if status.state == "unloaded" and (disabled or native.cached() is not None):
        status = ops.load()  # disabled, or a cached build: loading is instant
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"library   {native.NAME}: {', '.join(p.name for p in native.SOURCES)} (attnmask/ops/csrc)")
    print(f"CPU       PyTorch capability {capability}: builds for {build.simd_level()}")
    print(f"compilers {', '.join(_compilers())}")
    print(f"cache     {build.kernels_dir()}")
    state = {
        "built": "built now",
        "cached": "cached",
        "fallback": "fallback (PyTorch definitions)",
        "disabled": "disabled (PyTorch definitions)",
        "unloaded": "not built yet: built on first use, or now with `attnmask kernels --build`",
    }[status.state]
    print(f"status    {state}")
    if status.state != "unloaded":
        print(f"          {status.why}")
    print()
    kernel = {
        "built": f"native, {status.simd}, {status.threads}",
        "cached": f"native, {status.simd}, {status.threads}",
    }.get(status.state, "PyTorch definition" if status.state != "unloaded" else "native once built")
    width = max(len(name) for name in native.OPERATORS)
    print(f"{'operator':<{width + 10}}  {'defined in':<22}  CPU kernel")
    for name, module in native.OPERATORS.items():
        print(f"attnmask::{name:<{width}}  {module.__name__:<22}  {kernel}")
    sys.stdout.flush()
    return 1 if args.build and not status.native else 0
