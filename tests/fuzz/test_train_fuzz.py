"""Fuzzing ``attnmask train`` (and ``demo``'s flags): random flags on top of a tiny language-model run.

A valid argument vector trains, so every vector starts from a two-step tiny model on a small text
file, and random flags are added from the train parser's own actions. Properties as in
``test_cli_fuzz.py``; besides, a failed run leaves no ``--out`` directory behind that was not
there before, and a ``--resume`` of a good run that fails leaves its files as they were.
"""

from __future__ import annotations

import argparse
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnmask.cli import build_parser
from tests.fuzz.test_cli_fuzz import DEVICES, FLOATS, INTS, build_world, check_exit, run_cli, shown_run, snapshot

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "the cat sat on the mat. the dog sat on the log. a bird sang in the tree.\n" * 40
PINNED = {"max_steps", "max_minutes", "out", "resume", "task", "text", "model", "progress", "builtin_task"}
_counter = itertools.count()


@pytest.fixture(scope="module")
def train_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_fuzz")
    world = build_world(root / "world")
    world["corpus"] = root / "corpus.txt"
    world["corpus"].write_text(TEXT, encoding="utf-8")
    world["outs"] = root / "outs"
    world["outs"].mkdir()
    return world


def base_argv(world, out) -> list[str]:
    return ["train", "--task", "lm", "--text", str(world["corpus"]), "--model", "tiny", "--max-steps", "2",
            "--eval-every", "0", "--no-progress", "--out", str(out)]  # fmt: skip


@st.composite
def train_argv(draw, world) -> tuple[list[str], object]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    options = [a for a in sub._actions if a.option_strings and a.dest not in PINNED and a.dest != "help"]
    out = world["outs"] / f"run{next(_counter)}"
    argv = base_argv(world, out)
    files = [str(world[k]) for k in ("binary", "latin1", "empty_file", "missing", "emoji", "text", "empty_dir")]
    for action in draw(st.lists(st.sampled_from(options), max_size=3, unique_by=lambda a: a.dest)):
        flag = action.option_strings[-1]
        if action.nargs == 0:
            argv.append(flag)
        elif action.dest == "device":
            argv += [flag, draw(st.sampled_from(DEVICES))]
        elif action.choices:
            argv += [flag, draw(st.sampled_from([*map(str, action.choices), "nope"]))]
        elif action.type is int:
            argv += [flag, draw(st.sampled_from([v for v in INTS if v != "1000000000"]))]  # no huge models
        elif action.type is float:
            argv += [flag, draw(st.sampled_from(FLOATS))]
        else:
            argv += [flag, draw(st.sampled_from(files))]
    return argv, out


def check_train(argv, out, world) -> tuple[int, bool]:
    existed = out.exists()
    runs = [world[k] for k in ("mt_run", "lm_run")]
    before = snapshot(runs)
    rc, _, err = run_cli(argv)
    shown = shown_run(argv, err)
    check_exit(argv, rc, err, codes=(0, 2))  # an internal error (70) fails
    assert snapshot(runs) == before, shown
    return rc, existed


def test_train_random_flags(train_world):
    @settings(max_examples=4, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=train_argv(train_world))
    def check(case):
        argv, out = case
        check_train(argv, out, train_world)

    check()


@pytest.mark.slow
def test_train_random_flags_many(train_world):
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=train_argv(train_world))
    def check(case):
        argv, out = case
        check_train(argv, out, train_world)

    check()


@pytest.mark.parametrize("bad", ["binary", "latin1", "empty_file", "missing"])
def test_train_bad_text_is_one_line(train_world, bad):
    out = train_world["outs"] / f"bad_{bad}"
    argv = base_argv(train_world, out)
    argv[argv.index("--text") + 1] = str(train_world[bad])
    rc, _ = check_train(argv, out, train_world)
    assert rc == 2


@pytest.mark.parametrize("bad", ["binary", "empty_file", "missing"])
def test_failed_train_leaves_no_out_directory(train_world, bad):
    out = train_world["outs"] / f"left_{bad}"
    argv = base_argv(train_world, out)
    argv[argv.index("--text") + 1] = str(train_world[bad])
    rc, existed = check_train(argv, out, train_world)
    assert rc == 2 and not existed
    assert not out.exists(), f"{out} left behind by a failed run"


@pytest.mark.parametrize(
    "argv", [["demo", "--device", "banana"], ["demo", "--device", "cuda:7"], ["demo", "--seed", "x"]]
)
def test_demo_flag_mistakes_are_one_line(train_world, argv):
    import torch

    if "cuda" in argv[-1] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = train_world["outs"] / f"demo{next(_counter)}"
    rc, _, err = run_cli([*argv, "--out", str(out)])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
