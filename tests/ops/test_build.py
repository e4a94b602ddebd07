"""The one loader of native code (:func:`attnmask.ops.build.load_library`): a notice before a build and
none after, a name that changes with what the library is built from, older builds pruned, the
compiler's first error and a full log on failure, variants tried in order.

These build a few lines of C (a second or two each), not attnmask's kernels: what is checked is the
loader. The real library is built by the operator tests and by ``attnmask kernels --build``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from attnmask.ops import build

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None or shutil.which(os.environ.get("CXX", "c++")) is None,
    reason="no C/C++ compiler here",
)

GOOD = "int attnmask_test_answer(void) { return %d; }\n"
BROKEN = "int attnmask_test_answer(void) { return 42 }\nint also_broken(void) { return nope; }\n"


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ATTNMASK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def _source(tmp_path: Path, text: str, name: str = "answer.c") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _load(source: Path, lines: list[str], **kwargs) -> build.Built:
    return build.load_library("attnmask_test", [source], notice=lines.append, **kwargs)


def test_the_first_build_says_so_and_the_next_load_is_quiet(tmp_path, cache):
    source, lines = _source(tmp_path, GOOD % 42), []
    first = _load(source, lines)
    assert first.built_now and first.path.parent == cache and first.path.suffix == ".so"
    assert lines == [f"building attnmask kernels (once, ~{build.FIRST_BUILD_ESTIMATE} s)..."]
    again = _load(source, lines)
    assert (again.path, again.built_now) == (first.path, False)
    assert len(lines) == 1  # no second notice
    import ctypes

    assert ctypes.CDLL(str(first.path)).attnmask_test_answer() == 42
    # the next build's notice gives the time this one took
    _load(_source(tmp_path, GOOD % 43), lines)
    assert lines[-1] == f"building attnmask kernels (once, ~{round(first.seconds)} s)..."


def test_a_changed_source_builds_anew_and_prunes_the_older_build(tmp_path, cache):
    lines = []
    old = _load(_source(tmp_path, GOOD % 1), lines)
    new = _load(_source(tmp_path, GOOD % 2), lines)
    assert new.path != old.path and new.built_now
    assert not old.path.exists() and new.path.exists()
    assert sorted(p.name for p in cache.glob("attnmask_test-*.so")) == [new.path.name]


def test_the_name_follows_the_compiler_and_the_flags(tmp_path, cache, monkeypatch):
    source, lines = _source(tmp_path, GOOD % 7), []
    plain = _load(source, lines).path
    flagged = _load(source, lines, cflags=["-DATTNMASK_TEST=1"]).path
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text(f'#!/bin/sh\nexec "{shutil.which(os.environ.get("CC", "cc"))}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    other_compiler = _load(source, lines).path
    assert len({plain.name, flagged.name, other_compiler.name}) == 3


def test_a_failed_build_names_the_first_error_and_keeps_a_log(tmp_path, cache):
    source, lines = _source(tmp_path, BROKEN, "broken.c"), []
    with pytest.raises(build.BuildError) as caught:
        _load(source, lines)
    message = str(caught.value)
    assert "could not build broken.c" in message
    first_error = message.split("broken.c: ", 1)[1].split("; full log: ")[0]
    assert "error:" in first_error and "broken.c:1:" in first_error, first_error  # the first error, line 1
    log = Path(message.split("; full log: ")[1])
    assert log.is_file() and "nope" in log.read_text()  # the whole output, later errors included
    assert not list(cache.glob("attnmask_test-*.so"))


def test_variants_are_tried_in_order(tmp_path, cache):
    source, lines = _source(tmp_path, GOOD % 5), []
    built = _load(source, lines, variants=[["-fno-such-option-anywhere"], []])
    assert built.built_now and built.flags == ()
    assert len(lines) == 2  # a notice before each attempt


def test_no_compiler_is_a_build_error_naming_it(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(build.BuildError, match=r"no compiler '.*no-such-cc'"):
        _load(_source(tmp_path, GOOD % 3), [])


def test_the_first_error_line_is_picked_from_compiler_output():
    output = "x.c: In function 'f':\nx.c:3:5: error: expected ';' before '}' token\nx.c:9:1: error: other\n"
    assert build._first_error(output) == "x.c:3:5: error: expected ';' before '}' token"
    assert build._first_error("/usr/bin/ld: cannot find -lfoo\ncollect2: error: ld returned 1") == (
        "/usr/bin/ld: cannot find -lfoo"
    )
    assert build._first_error("") == "no output"


@pytest.mark.parametrize(
    "capability, flags, want",
    [
        ("AVX512", {"avx512f", "avx512_vnni", "avx_vnni"}, ["-mavx512vnni"]),  # Sapphire Rapids, Zen 5
        ("AVX512", {"avx512f", "avx512_vnni"}, ["-mavx512vnni"]),  # Cascade Lake
        # Zen 4, Ice Lake: byte permutes too, for the int8 estimates
        (
            "AVX512",
            {"avx512f", "avx512_vnni", "avx512bw", "avx512vbmi"},
            ["-mavx512vnni", "-mavx512bw", "-mavx512vbmi"],
        ),
        ("AVX2", {"avx2", "avx_vnni"}, ["-mavxvnni"]),  # Alder Lake, or ATEN_CPU_CAPABILITY=avx2 on the above
        ("AVX2", {"avx2", "avx512_vnni"}, []),  # AVX-512 lowered away: its VNNI with it
        ("AVX2", {"avx2", "fma"}, []),  # Zen 3
        ("DEFAULT", {"avx_vnni"}, []),  # the portable build
    ],
)
def test_the_int8_dot_products_are_built_where_the_cpu_has_them(monkeypatch, capability, flags, want):
    import attnmask.linear as linear

    monkeypatch.setattr(build.torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(linear, "cpu_info", lambda: linear.CpuInfo("GenuineIntel", 6, frozenset(flags)))
    assert build.simd_flags()[-len(want) :] == want if want else not any("vnni" in f for f in build.simd_flags())
    assert ("VNNI" in build.simd_level()) == bool(want)
