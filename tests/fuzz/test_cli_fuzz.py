"""Fuzzing the command line: random argument vectors and random or corrupted files, every subcommand.

Properties of every run of ``attnmask ARGV``:

- the exit code is 0, 1 (an audit that found a leak; its report is on stdout) or 2 (a user
  mistake, said in exactly one line on stderr, ``attnmask CMD: error: ...``); no run ever prints a
  traceback. An internal error (exit code 70, ``attnmask: internal error — please report:`` and the
  traceback) fails the property: whatever a user can type is either accepted or refused in one line;
- run directories handed to a command are byte-for-byte unchanged (only ``train --out`` writes one,
  and only when it succeeds);
- memory stays bounded (the process's peak resident size grows by less than 2 GiB).

Flags and their choices are read from the parsers themselves, so a new flag is fuzzed without
editing this file. Values come from pools of good, bad and corrupted inputs (truncated
safetensors, invalid JSON, wrong-task runs, binary and non-UTF-8 text, huge token counts, bad
devices). ``demo`` and ``train`` are fuzzed on their flags' validation only with a few examples
(a valid argument vector trains a model): see ``test_train_fuzz.py``.

The default run keeps to a few dozen examples (seconds); ``pytest -m slow tests/fuzz`` runs many more.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import resource
import signal
import string
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnmask.cli import EX_INTERNAL, INTERNAL_BANNER, build_parser, main
from attnmask.data.tokenizer import Tokenizer
from attnmask.train.rundir import CONFIG, TOKENIZER, WEIGHTS
from tests.cli.test_decode_commands import make_run

pytestmark = pytest.mark.usefixtures("one_thread")

FUZZED = ("translate", "generate", "eval", "mask", "attention", "audit")
EXAMPLE_SECONDS = 120  # one command taking longer than this is a failure (a hang)
MAX_RSS_GROWTH_KIB = 2 * 1024 * 1024


# ---------------------------------------------------------------------------------------------
# The world: good runs, corrupted runs, and files of every sort
# ---------------------------------------------------------------------------------------------
def build_world(root: Path) -> dict[str, Path]:
    w: dict[str, Path] = {}
    w["mt_run"] = make_run(_mkdir(root / "mt_run"), "translation")
    w["lm_run"] = make_run(_mkdir(root / "lm_run"), "lm")
    trunc = make_run(_mkdir(root / "truncated_run"), "translation")
    data = (trunc / WEIGHTS).read_bytes()
    (trunc / WEIGHTS).write_bytes(data[: len(data) // 2])
    w["truncated_run"] = trunc
    flipped = make_run(_mkdir(root / "bitflip_run"), "lm")
    data = bytearray((flipped / WEIGHTS).read_bytes())
    data[4] ^= 0xFF  # the header length: the file no longer parses
    (flipped / WEIGHTS).write_bytes(bytes(data))
    w["bitflip_run"] = flipped
    bad_json = make_run(_mkdir(root / "badjson_run"), "translation")
    (bad_json / CONFIG).write_text('{"task": "translation", "model": {', encoding="utf-8")
    w["badjson_run"] = bad_json
    wrong_model = make_run(_mkdir(root / "wrongmodel_run"), "lm")
    cfg = (wrong_model / CONFIG).read_text(encoding="utf-8").replace('"dim": 32', '"dim": 48')
    (wrong_model / CONFIG).write_text(cfg, encoding="utf-8")
    w["wrongmodel_run"] = wrong_model
    big_vocab = make_run(_mkdir(root / "bigvocab_run"), "lm")  # a tokenizer with ids past the embedding
    Tokenizer.train_chars(["a man rides a horse zwei Hunde " + string.ascii_letters]).save(big_vocab / TOKENIZER)
    w["bigvocab_run"] = big_vocab
    w["empty_dir"] = _mkdir(root / "empty_dir")
    w["text"] = _write(root / "text.txt", "a man rides a horse\nzwei Hunde\n")
    w["empty_file"] = _write(root / "empty.txt", "")
    w["binary"] = _write(root / "binary.bin", bytes(range(256)) * 4)
    w["latin1"] = _write(root / "latin1.txt", "caf\xe9 na\xefve\n".encode("latin-1"))
    w["huge_tokens"] = _write(root / "huge.txt", ("a man " * 4000 + "\n") * 2)
    w["emoji"] = _write(root / "emoji.txt", "🙂 日本 a man\n")
    w["json_garbage"] = _write(root / "config.json", "{not json")
    w["missing"] = root / "does" / "not" / "exist"
    w["scratch"] = _mkdir(root / "scratch")
    return w


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write(path: Path, content: str | bytes) -> Path:
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    else:
        path.write_bytes(content)
    return path


RUN_KEYS = ("mt_run", "lm_run", "truncated_run", "bitflip_run", "badjson_run", "wrongmodel_run", "bigvocab_run")


def snapshot(paths: list[Path]) -> dict[str, str]:
    """Every file under ``paths`` with a hash of its bytes."""
    out = {}
    for root in paths:
        for file in sorted(root.rglob("*")):
            if file.is_file():
                out[str(file)] = hashlib.blake2b(file.read_bytes(), digest_size=16).hexdigest()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    w = build_world(root)
    before = os.getcwd()
    os.chdir(w["scratch"])  # `attention` writes ./attention by default
    with address_space_cap(ADDRESS_SPACE_HEADROOM):
        yield w
    os.chdir(before)


ADDRESS_SPACE_HEADROOM = 8 * 1024**3


@contextlib.contextmanager
def address_space_cap(headroom: int):
    """Cap this process's address space at its present size plus ``headroom`` bytes.

    A command that tries to allocate without bound then fails its example with an allocation
    error naming the argument vector, instead of the whole test run being killed by the OOM killer.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    size = _address_space_now()
    if size is None:
        yield
        return
    cap = size + headroom if hard == resource.RLIM_INFINITY else min(size + headroom, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _address_space_now() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ---------------------------------------------------------------------------------------------
# Argument vectors, from the parsers' own actions
# ---------------------------------------------------------------------------------------------
TEXTS = ["a man", "", " ", "🙂 日本 a man", "a\x00b", "-x", "a " * 3000, "zwei Hunde spielen", "Good morning <PAD>"]
INTS = ["-1", "0", "1", "2", "3", "7", "64", "1000000000", "x", "1.5"]
FLOATS = ["-1", "0", "0.5", "1", "2", "nan", "inf", "-inf", "1e309", "x"]
DEVICES = ["cpu", "auto", "cuda", "cuda:1", "banana", "", "mps", "cpu:0"]
WRITE_FLAGS = {"--output", "--png", "--out"}


def value_strategy(action: argparse.Action, world: dict[str, Path]) -> st.SearchStrategy[str]:
    dest = action.dest
    paths = [str(p) for k, p in world.items() if k != "scratch"]
    if dest in ("output", "png", "out"):  # written to: only somewhere harmless, or somewhere impossible
        scratch = world["scratch"]
        return st.sampled_from(
            [str(scratch / "o.png"), str(scratch / "o.txt"), str(scratch / "dir"), str(scratch), "", "/proc/x.png"]
        )
    if dest == "device":
        return st.sampled_from(DEVICES)
    if action.choices:
        return st.sampled_from([*map(str, action.choices), "nope", ""])
    if action.type is int:
        return st.sampled_from(INTS)
    if action.type is float:
        return st.sampled_from(FLOATS)
    if dest in ("run", "src", "ref", "input", "hf_config", "text", "valid_text"):
        return st.sampled_from(paths + ["gpt2", "llama"] if dest == "hf_config" else paths)
    if dest == "model":
        return st.sampled_from(["nope", "", "../x", "tiny"])
    return st.sampled_from(TEXTS + paths[:3])


@st.composite
def argv_strategy(draw, command: str, world: dict[str, Path]) -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    positionals = [a for a in sub._actions if not a.option_strings]
    argv = [command]
    # a required run usually gets a good one, so that the deeper options get exercised too
    for action in draw(st.lists(st.sampled_from(options), max_size=6, unique_by=lambda a: a.dest)):
        flag = action.option_strings[-1]
        if action.nargs == 0:
            argv.append(flag)
        else:
            argv += [flag, draw(value_strategy(action, world))]
    if not any(a in argv for a in ("--run", "--tiny", "--hf-config", "--model")) and draw(st.booleans()):
        key = "lm_run" if command == "generate" else "mt_run"
        argv += ["--run", str(world[draw(st.sampled_from([key, key, *RUN_KEYS]))])]
    for _ in positionals:
        if draw(st.booleans()):
            argv.append(draw(st.sampled_from(TEXTS)))
    if draw(st.integers(0, 9)) == 0:
        argv.append(draw(st.sampled_from(["--bogus", "extra", "-"])))
    return argv


# ---------------------------------------------------------------------------------------------
# Running one argument vector and checking the properties
# ---------------------------------------------------------------------------------------------
class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"a command ran past {EXAMPLE_SECONDS} s")


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(EXAMPLE_SECONDS)
    stdin = sys.stdin
    try:
        sys.stdin = io.StringIO("")  # translate reads stdin when given no sentence
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse: --help (0) and usage errors (2)
                rc = e.code if isinstance(e.code, int) else 2
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        sys.stdin = stdin
    return rc, out.getvalue(), err.getvalue()


def shown_run(argv: list[str], err: str) -> str:
    return f"attnmask {' '.join(repr(a) if ' ' in a or not a else a for a in argv)[:400]}\nstderr: {err[-3000:]}"


def check_exit(argv: list[str], rc: int, err: str, codes: tuple[int, ...]) -> list[str]:
    """The exit of ``attnmask argv``: never an internal error or a traceback, an exit code in
    ``codes``, and a refusal (2) in exactly one line ``attnmask CMD: error: ...``. Returns the
    stderr lines other than warnings and the kernels' one-time build notice."""
    shown = shown_run(argv, err)
    assert rc != EX_INTERNAL and INTERNAL_BANNER not in err, f"internal error (a bug): {shown}"
    assert "Traceback" not in err, shown
    assert rc in codes, f"exit code {rc}: {shown}"
    notices = ("attnmask: warning:", "building attnmask kernels (once")  # the kernels' first build says so, once
    errors = [line for line in err.splitlines() if line.strip() and not line.startswith(notices)]
    if rc == 2:  # a user mistake: said in one line, by the CLI or by argparse
        assert len(errors) == 1, f"{len(errors)} error lines: {shown}"
        assert errors[0].startswith("attnmask") and ": error: " in errors[0], shown
    return errors


def check_properties(argv: list[str], world: dict[str, Path]) -> None:
    runs = [world[k] for k in RUN_KEYS]
    before = snapshot(runs)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rc, _, err = run_cli(argv)
    errors = check_exit(argv, rc, err, codes=(0, 1, 2))
    if rc == 1:  # an audit that found a leak: the report is on stdout
        assert argv[0] == "audit" and len(errors) <= 1, shown_run(argv, err)
    assert snapshot(runs) == before, f"a run directory changed: {shown_run(argv, err)}"
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert growth < MAX_RSS_GROWTH_KIB, f"peak memory grew by {growth / 1024:.0f} MiB: {shown_run(argv, err)}"


FAST = settings(max_examples=8, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
MANY = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("command", FUZZED)
def test_random_argv(world, command):
    @FAST
    @given(argv=argv_strategy(command, world))
    def check(argv):
        check_properties(argv, world)

    check()


@pytest.mark.slow
@pytest.mark.parametrize("command", FUZZED)
def test_random_argv_many(world, command):
    @MANY
    @given(argv=argv_strategy(command, world))
    def check(argv):
        check_properties(argv, world)

    check()


# ---------------------------------------------------------------------------------------------
# Each corrupted input, on every command that reads it: fixed cases, always run
# ---------------------------------------------------------------------------------------------
CORRUPT_RUNS = [
    "truncated_run", "bitflip_run", "badjson_run", "wrongmodel_run", "bigvocab_run", "empty_dir", "text", "missing"
]  # fmt: skip


@pytest.mark.parametrize("bad", CORRUPT_RUNS)
@pytest.mark.parametrize(
    "argv",
    [
        ["translate", "a man"],
        ["generate", "a man", "--max-new-tokens", "2"],
        ["eval", "--src", "TEXT", "--ref", "TEXT"],
        ["attention", "a man", "--max-new-tokens", "2"],
        ["audit", "--length", "4", "--sequences", "1", "--replacements", "1"],
    ],
    ids=lambda a: a[0] if isinstance(a, list) else a,
)
def test_corrupted_run_is_one_line(world, argv, bad):
    argv = [str(world["text"]) if a == "TEXT" else a for a in argv] + ["--run", str(world[bad])]
    rc, _, err = run_cli(argv)
    check_exit(argv, rc, err, codes=(2,))


@pytest.mark.parametrize("bad", ["binary", "latin1", "empty_file", "missing", "empty_dir", "huge_tokens", "emoji"])
@pytest.mark.parametrize("flag", ["--input", "--src"])
def test_bad_input_files(world, flag, bad):
    argv = (
        ["translate", "--run", str(world["mt_run"]), "--input", str(world[bad])]
        if flag == "--input"
        else ["eval", "--run", str(world["mt_run"]), "--src", str(world[bad]), "--ref", str(world[bad])]
    )
    check_properties(argv, world)
