"""attnmask.allocator: freed memory is kept for the next step (no page faults), and says what it did."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from attnmask import allocator

glibc_linux = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"
)

# A "step": 64 tensors of 4 MiB (each below glibc's largest mmap threshold) made and freed. Prints the
# page faults of the second step: glibc's default hands the first step's memory back to the kernel,
# so the second faults in all 65,536 pages again (65,520 in eight runs); kept, it reuses them
# (2,049-9,218 faults in thirty runs: the heap's layout settles in over a few steps).
STEPS = """
import resource, sys, torch
from attnmask import allocator
print(allocator.keep_freed_memory(), file=sys.stderr)
def step():
    xs = [torch.ones(1 << 20) for _ in range(64)]
    del xs
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(policy: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    env["ATTNMASK_MALLOC"] = policy
    done = subprocess.run([sys.executable, "-c", STEPS], env=env, capture_output=True, text=True, check=True)
    return int(done.stdout), done.stderr.strip()


@glibc_linux
def test_kept_memory_is_reused_without_page_faults():
    default, said_default = faults("default")
    kept, said_kept = faults("keep")
    assert said_default == "the C library's default (ATTNMASK_MALLOC=default)"
    assert said_kept.startswith("freed memory kept for reuse (glibc: blocks up to 32 MiB")
    pages = 64 * (4 << 20) // 4096
    assert default > pages // 2, f"glibc's default kept the memory ({default} faults): the test shows nothing"
    assert kept < pages // 4, f"{kept} page faults with freed memory kept, {default} without (of {pages} pages)"


def test_a_bad_setting_names_the_choices(monkeypatch):
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setenv("ATTNMASK_MALLOC", "fast")
    with pytest.raises(ValueError, match="ATTNMASK_MALLOC='fast': expected one of keep, default"):
        allocator.keep_freed_memory()


def test_the_cli_reports_a_bad_setting_in_one_line(monkeypatch, capsys):
    from attnmask.cli import main

    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setenv("ATTNMASK_MALLOC", "fast")
    monkeypatch.delenv("ATTNMASK_DEBUG", raising=False)
    assert main(["mask", "a b c"]) == 2
    err = capsys.readouterr().err
    assert err == "attnmask mask: error: ATTNMASK_MALLOC='fast': expected one of keep, default\n"
