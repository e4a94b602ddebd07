"""attnmask.allocator: freed memory is kept for the next step (no page faults), and says what it did;
a bad setting is a warning, never an error; the same policy through GLIBC_TUNABLES for library users."""

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


def faults(policy: str, tunables: str | None = None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    env["ATTNMASK_MALLOC"] = policy
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    done = subprocess.run([sys.executable, "-c", STEPS], env=env, capture_output=True, text=True, check=True)
    return int(done.stdout), done.stderr.strip()


PAGES = 64 * (4 << 20) // 4096  # the pages a step touches


@glibc_linux
def test_kept_memory_is_reused_without_page_faults():
    default, said_default = faults("default")
    kept, said_kept = faults("keep")
    assert said_default == "the C library's default (ATTNMASK_MALLOC=default)"
    assert said_kept.startswith("freed memory kept for reuse (glibc: blocks up to 32 MiB")
    assert default > PAGES // 2, f"glibc's default kept the memory ({default} faults): the test shows nothing"
    assert kept < PAGES // 4, f"{kept} page faults with freed memory kept, {default} without (of {PAGES} pages)"


@glibc_linux
def test_the_documented_glibc_tunables_keep_memory_as_mallopt_does():
    # what the module's docstring tells a library user to set, instead of calling keep_freed_memory
    assert allocator.TUNABLES in allocator.__doc__
    assert allocator.TUNABLES == "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"
    default, _ = faults("default")
    tuned, _ = faults("default", tunables=allocator.TUNABLES)  # mallopt not called: glibc read its environment
    assert default > PAGES // 2, f"glibc's default kept the memory ({default} faults): the test shows nothing"
    assert tuned < PAGES // 4, f"{tuned} page faults under GLIBC_TUNABLES, {default} without (of {PAGES} pages)"


def test_current_policy_says_what_the_process_runs_under_and_changes_nothing(monkeypatch):
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setattr(allocator.ctypes, "CDLL", no_mallopt)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert allocator.current_policy() == "the C library's default"
    monkeypatch.setenv("GLIBC_TUNABLES", f"glibc.cpu.x86_shstk=off:{allocator.TUNABLES}")
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert allocator.current_policy() == f"glibc tunables {allocator.TUNABLES} (GLIBC_TUNABLES)"
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")
    assert allocator.current_policy() == "jemalloc (preloaded)"
    monkeypatch.setattr(allocator, "_applied", "freed memory kept for reuse (glibc: ...)")
    assert allocator.current_policy() == "freed memory kept for reuse (glibc: ...)"


def no_mallopt(*args, **kwargs):
    raise AssertionError("the C library was opened: mallopt would have been called")


@pytest.mark.parametrize("value", ["fast", "KEEP!", "off"])
def test_a_bad_setting_is_a_warning_and_the_c_librarys_default(value, monkeypatch):
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setattr(allocator.ctypes, "CDLL", no_mallopt)
    monkeypatch.setenv("ATTNMASK_MALLOC", value)
    with pytest.warns(UserWarning, match=rf"ATTNMASK_MALLOC={value!r}: expected keep\|default"):
        said = allocator.keep_freed_memory()  # no exception
    assert said == "the C library's default (ATTNMASK_MALLOC=default)"
    assert allocator.current_policy() == said


@pytest.mark.slow  # trains the demo's --quick model
def test_the_cli_warns_about_a_bad_setting_in_one_line_and_runs(monkeypatch, capsys, tmp_path):
    from attnmask.cli import main

    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setattr(allocator.ctypes, "CDLL", no_mallopt)
    monkeypatch.setenv("ATTNMASK_MALLOC", "fast")
    monkeypatch.delenv("ATTNMASK_DEBUG", raising=False)
    assert main(["demo", "--quick", "--out", str(tmp_path / "demo")]) == 0
    err = capsys.readouterr().err
    expected = "attnmask: warning: ATTNMASK_MALLOC='fast': expected keep|default; leaving the C library's default"
    assert err.splitlines().count(expected) == 1, err
    assert "Traceback" not in err and "error:" not in err
