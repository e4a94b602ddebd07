"""``attnmask kernels``: the native library's status without building it, ``--build`` from an empty cache,
and what a machine without compilers gets (one warning, the PyTorch definitions, the same text).

Each case runs in a fresh process: a loaded operator library cannot be unloaded, and the status is
per process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def attnmask(*args: str, **env: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "attnmask", *args]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT, timeout=900)


def test_status_from_an_empty_cache_builds_nothing(tmp_path):
    proc = attnmask("kernels", ATTNMASK_CACHE=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "not built yet" in proc.stdout and "attnmask kernels --build" in proc.stdout
    for name in ("block_matmul", "block_dequantize", "rms_norm", "paged_attend", "linear_rows", "packed_step"):
        assert f"attnmask::{name} " in proc.stdout
    assert not (tmp_path / "kernels").exists() or not list((tmp_path / "kernels").glob("*.so"))
    assert proc.stderr == ""


def test_disabled_says_so(tmp_path):
    proc = attnmask("kernels", ATTNMASK_CACHE=str(tmp_path), ATTNMASK_KERNELS="0")
    assert proc.returncode == 0 and "disabled (PyTorch definitions)" in proc.stdout
    assert "ATTNMASK_KERNELS=0" in proc.stdout


def test_build_without_compilers_falls_back_with_one_warning_and_exit_1(tmp_path):
    nowhere = {"CC": str(tmp_path / "no-cc"), "CXX": str(tmp_path / "no-c++"), "ATTNMASK_CACHE": str(tmp_path)}
    proc = attnmask("kernels", "--build", **nowhere)
    assert proc.returncode == 1
    assert "fallback (PyTorch definitions)" in proc.stdout and "no compiler" in proc.stdout, proc.stdout
    assert "PyTorch definition" in proc.stdout.splitlines()[-1]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("attnmask: warning:")]
    assert len(warnings) == 1 and "native kernels unavailable" in warnings[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # builds the whole library (a minute or so on 2 cores)
def test_build_from_an_empty_cache_builds_and_reports(tmp_path):
    if shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C/C++ compiler here")
    proc = attnmask("kernels", "--build", ATTNMASK_CACHE=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.startswith("building attnmask kernels (once, ~"), proc.stderr  # the notice, once
    assert proc.stderr.count("building attnmask kernels") == 1
    assert "status    built now" in proc.stdout and "built in" in proc.stdout
    built = list((tmp_path / "kernels").glob("*.so"))
    assert len(built) == 1 and str(built[0]) in proc.stdout
    again = attnmask("kernels", ATTNMASK_CACHE=str(tmp_path))  # the next process finds it
    assert again.returncode == 0 and "status    cached" in again.stdout and again.stderr == ""


@pytest.mark.slow  # the real SmolLM2 file, twice
def test_generate_without_compilers_gives_one_warning_and_the_same_text(tmp_path):
    pytest.importorskip("gguf")
    from attnmask.pretrained import locate

    try:
        locate("smollm2")
    except ValueError as err:
        pytest.skip(str(err))
    args = ("generate", "--model", "smollm2", "--quantized", "--prompt", "The capital of France is")
    args += ("--max-new-tokens", "16", "--temperature", "0")  # greedy: the same text, not the same draws
    native = attnmask(*args)
    nowhere = {"CC": str(tmp_path / "no-cc"), "CXX": str(tmp_path / "no-c++"), "ATTNMASK_CACHE": str(tmp_path)}
    fallback = attnmask(*args, **nowhere)
    assert native.returncode == 0 and fallback.returncode == 0, native.stderr + fallback.stderr
    assert fallback.stdout == native.stdout and "Paris" in native.stdout
    warnings = [line for line in fallback.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "no compiler" in warnings[0], fallback.stderr
