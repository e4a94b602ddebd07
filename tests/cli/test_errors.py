"""User mistakes on every subcommand: one line on stderr, exit code 2, never a traceback; and
everything else (a bug) an internal error with its traceback, exit code 70."""

from __future__ import annotations

import errno
import importlib
import os
import subprocess
import sys

import pytest
import torch

from attnmask import allocator
from attnmask.cli import COMPUTE_SUBCOMMANDS, EX_INTERNAL, SUBCOMMANDS, main
from attnmask.data.files import DataError
from attnmask.errors import UserError, UserTypeError
from tests.cli.test_decode_commands import make_run
from tests.conftest import REPO

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mt_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("mt"), "translation")


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("lm"), "lm")


def one_line_error(capsys, argv, match: str, code: int = 2) -> str:
    """Run ``attnmask argv``; it must exit ``code`` with exactly one stderr line holding ``match``."""
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert rc == code, captured.err
    assert len(err) == 1 and match in err[0], captured.err
    assert "Traceback" not in captured.err
    return err[0]


# ---------------------------------------------------------------------------------------------
# What escapes a subcommand: a user mistake (one line, 2) or a bug (the traceback, 70)
# ---------------------------------------------------------------------------------------------
BANNER = "attnmask: internal error — please report:"


def plant(monkeypatch, error: BaseException) -> None:
    """Make ``attnmask mask`` raise ``error`` from inside (where it parses --kind)."""

    def broken(spec):
        raise error

    monkeypatch.setattr("attnmask.cli.mask._parse_kinds", broken)
    monkeypatch.delenv("ATTNMASK_DEBUG", raising=False)


@pytest.mark.parametrize(
    "error",
    [
        TypeError("planted() takes 1 positional argument but 2 were given"),
        ValueError("not enough values to unpack (expected 3, got 2)"),  # a plain ValueError, not a UserError
        RuntimeError("shape '[2, 3]' is invalid for input of size 5"),
        KeyError("model"),
        OSError(errno.EPIPE, "Broken pipe"),  # an OSError about no path the user named
        AssertionError("internal invariant"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_bug_is_an_internal_error_with_its_traceback(capsys, monkeypatch, error):
    plant(monkeypatch, error)
    assert main(["mask", "a b c"]) == EX_INTERNAL == 70
    err = capsys.readouterr().err
    assert err.startswith(BANNER + "\n"), err
    assert "Traceback (most recent call last):" in err and "in broken" in err  # where it was raised
    assert f"{type(error).__name__}: " in err.splitlines()[-1]
    assert "attnmask mask: error:" not in err  # not passed off as the user's mistake


@pytest.mark.parametrize(
    "error, line",
    [
        (UserError("--kind 'x': expected causal"), "--kind 'x': expected causal"),
        (UserTypeError("--kind: expected a string, got int"), "--kind: expected a string, got int"),
        (DataError("data.txt line 3: not UTF-8"), "data.txt line 3: not UTF-8"),
        (UserError("first line\nsecond line"), "first line"),
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "in.txt"), "No such file or directory: 'in.txt'"),
        (IsADirectoryError(errno.EISDIR, "Is a directory", "out"), "Is a directory: 'out'"),
        (PermissionError(errno.EACCES, "Permission denied", "/root/x"), "Permission denied: '/root/x'"),
        (OSError(errno.ENOSPC, "No space left on device", "o.png"), "No space left on device: 'o.png'"),
    ],
    ids=lambda x: type(x).__name__ if isinstance(x, BaseException) else None,
)
def test_a_user_mistake_is_one_line(capsys, monkeypatch, error, line):
    plant(monkeypatch, error)
    assert main(["mask", "a b c"]) == 2
    err = capsys.readouterr().err
    assert err == f"attnmask mask: error: {line}\n"


@pytest.mark.parametrize("error", [UserError("bad --kind"), TypeError("a bug")], ids=["user", "bug"])
def test_debug_lets_every_error_through(monkeypatch, error):
    plant(monkeypatch, error)
    monkeypatch.setenv("ATTNMASK_DEBUG", "1")
    with pytest.raises(type(error), match=str(error)):
        main(["mask", "a b c"])


def test_interrupt_is_130(capsys, monkeypatch):
    plant(monkeypatch, KeyboardInterrupt())
    assert main(["mask", "a b c"]) == 130
    assert capsys.readouterr().err == "attnmask: interrupted\n"


def test_a_bug_in_a_subprocess_exits_70():
    """The console script as a user runs it: exit status 70 and the traceback on stderr."""
    code = (
        "import sys\n"
        "import attnmask.cli.mask as m\n"
        "m._parse_kinds = lambda spec: None + 1\n"
        "from attnmask.cli import main\n"
        "sys.exit(main(['mask', 'a b']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ATTNMASK_DEBUG"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 70, proc.stderr
    assert proc.stderr.startswith(BANNER) and "TypeError: unsupported operand" in proc.stderr


def minimal_argv(command: str) -> list[str]:
    """The fewest arguments ``attnmask command`` parses: each required option, positional and
    required either-or group given a placeholder (the first choice where there are choices)."""
    import argparse

    from attnmask.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    argv = [command]

    def value(action) -> str:
        return str(next(iter(action.choices))) if action.choices else "X"

    for action in sub._actions:
        if action.required and action.option_strings:
            argv += [action.option_strings[-1]] + ([] if action.nargs == 0 else [value(action)])
        elif not action.option_strings and action.nargs in (None, 1, "+"):
            argv.append(value(action))
    for group in sub._mutually_exclusive_groups:
        if group.required:
            first = group._group_actions[0]
            argv += [first.option_strings[-1]] + ([] if first.nargs == 0 else [value(first)])
    return argv


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_only_compute_subcommands_set_the_allocator(monkeypatch, command):
    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append(command) or "spied")
    monkeypatch.setattr(importlib.import_module(f"attnmask.cli.{command}"), "run", lambda args: 0)
    assert main(minimal_argv(command)) == 0
    assert calls == ([command] if command in COMPUTE_SUBCOMMANDS else []), calls


def test_mask_draws_without_touching_the_allocator(capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append(1) or "spied")
    assert main(["mask", "a b c"]) == 0  # the real command, start to end
    assert "look-ahead" in capsys.readouterr().out and calls == []


# ---------------------------------------------------------------------------------------------
# --device and --run, checked before anything loads
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cuda", "cuda:3", "banana", "mps", "cuda:-1"])
@pytest.mark.parametrize("command", ["translate", "generate", "eval"])
def test_unusable_device_is_one_line(capsys, mt_run, lm_run, tmp_path, device, command):
    if device in ("cuda", "cuda:3") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    src = tmp_path / "src.txt"
    src.write_text("a man\n")
    argv = {
        "translate": ["translate", "--run", str(mt_run), "a man"],
        "generate": ["generate", "--run", str(lm_run), "a man", "--max-new-tokens", "2"],
        "eval": ["eval", "--run", str(mt_run), "--src", str(src), "--ref", str(src)],
    }[command]
    line = one_line_error(capsys, [*argv, "--device", device], f"--device {device!r}")
    assert line.startswith(f"attnmask {command}: error: --device {device!r}"), line


@pytest.mark.parametrize("command", ["translate", "generate", "eval", "attention", "audit"])
def test_run_that_is_a_file_says_so(capsys, tmp_path, command):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"not a directory")
    argv = {
        "translate": ["translate", "--run", str(file), "a man"],
        "generate": ["generate", "--run", str(file), "a man"],
        "eval": ["eval", "--run", str(file), "--src", str(file), "--ref", str(file)],
        "attention": ["attention", "--run", str(file), "a man"],
        "audit": ["audit", "--run", str(file)],
    }[command]
    line = one_line_error(capsys, argv, "not a run directory (it is a file)")
    assert "no such directory" not in line


def _edit_config(run, edit) -> None:
    import json

    file = run / "config.json"
    config = json.loads(file.read_text(encoding="utf-8"))
    file.write_text(json.dumps(edit(config)), encoding="utf-8")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: [1, 2], "holds a JSON list; expected an object"),
        (lambda c: {**c, "model": None}, "model=None; expected an object of ModelConfig fields"),
        (lambda c: {**c, "model": {**c["model"], "dim": "32"}}, "model.dim='32'; expected int"),
        (lambda c: {**c, "model": {**c["model"], "bias": 1}}, "model.bias=1; expected bool"),
        (lambda c: {**c, "model": {k: v for k, v in c["model"].items() if k != "vocab_size"}}, "lacks ['vocab_size']"),
        (lambda c: {**c, "model": {**c["model"], "bogus": 1}}, "config.json: unknown ModelConfig fields ['bogus']"),
        (lambda c: {**c, "tokenizers": None}, 'tokenizers=None; expected {"tgt": FILE'),
        (lambda c: {**c, "tokenizers": {"tgt": 3}}, "tokenizers={'tgt': 3}"),
        (lambda c: {**c, "train": []}, "train=[]; expected an object"),
    ],
    ids=["list", "model-null", "dim-str", "bias-int", "no-vocab", "unknown-field", "tok-null", "tok-int", "train-list"],
)
@pytest.mark.parametrize("command", ["translate", "audit"])
def test_damaged_config_json_is_one_line(capsys, tmp_path, edit, message, command):
    run = tmp_path / "run"
    run.mkdir()
    _edit_config(make_run(run, "translation"), edit)
    argv = {"translate": ["translate", "--run", str(run), "a man"], "audit": ["audit", "--run", str(run)]}[command]
    line = one_line_error(capsys, argv, message)
    assert str(run / "config.json") in line


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not a usable Hugging Face config: It looks like the config file"),
        ("[1]", "not a usable Hugging Face config: Unrecognized model"),
        ('{"model_type": "no_such_model_xyz"}', "not a usable Hugging Face config: The checkpoint you are trying"),
        ('{"model_type": "t5"}', "expected a decoder-only (causal LM) config"),
    ],
    ids=["json", "list", "model-type", "seq2seq"],
)
def test_unusable_hf_config_is_one_line(capsys, tmp_path, content, message):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(content, encoding="utf-8")
    for spec in (tmp_path, tmp_path / "config.json"):
        one_line_error(capsys, ["audit", "--hf-config", str(spec)], message)
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(capsys, ["audit", "--hf-config", str(empty)], "the directory holds no config.json")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("flag", ["--lr", "--weight-decay", "--grad-clip", "--max-minutes", "--dropout"])
def test_train_number_flags_must_be_finite(capsys, tmp_path, flag, value):
    argv = ["train", "--task", "lm", "--text", str(tmp_path / "t.txt"), "--out", str(tmp_path / "o"), f"{flag}={value}"]
    one_line_error(capsys, argv, f"{flag} {float(value)}: expected a finite number")
    assert not (tmp_path / "o").exists()


def test_check_device_names():
    from attnmask.cli.common import check_device

    assert check_device("cpu") == "cpu"
    assert check_device("auto") in ("cpu", "cuda")
    for bad in ("banana", "", "cpu:x", "mps"):
        with pytest.raises(ValueError, match="--device"):
            check_device(bad)


# ---------------------------------------------------------------------------------------------
# argparse mistakes: the subcommand's own usage, one line
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv", [["train"], ["translate", "--run", "R"], ["mask"], ["audit", "--tiny", "decoder"], ["demo"]]
)
def test_unknown_flag_points_to_the_subcommands_help(capsys, argv):
    command = argv[0]
    line = one_line_error(capsys, [*argv, "--bogus-flag"], "unrecognized arguments: --bogus-flag")
    assert line.startswith(f"attnmask {command}: error:") and f"`attnmask {command} --help`" in line


def test_bad_flag_value_is_one_line(capsys):
    line = one_line_error(capsys, ["mask", "--window", "x"], "invalid int value: 'x'")
    assert line.startswith("attnmask mask: error: argument --window")


def test_help_still_prints_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["mask", "--help"])
    assert e.value.code == 0 and "usage: attnmask mask" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# mask: options that drew something else than asked
# ---------------------------------------------------------------------------------------------
def test_mask_prefix_longer_than_the_sentence(capsys):
    one_line_error(capsys, ["mask", "a b c", "--kind", "prefix", "--prefix", "99"], "--prefix 99 does not fit")
    one_line_error(capsys, ["mask", "a b c", "--kind", "prefix", "--prefix", "-1"], "--prefix -1 does not fit")
    assert main(["mask", "a b c", "--kind", "prefix", "--prefix", "3"]) == 0


def test_mask_document_without_separator(capsys):
    one_line_error(capsys, ["mask", "a b c", "--kind", "document"], "no sentence holds the separator '<SEP>'")
    assert main(["mask", "a <SEP> b", "--kind", "document"]) == 0


def test_mask_window_below_one(capsys):
    line = one_line_error(capsys, ["mask", "a b c", "--kind", "window", "--window", "0"], "--window must be >= 1")
    assert line.startswith("attnmask mask: error:"), line
    assert main(["mask", "a b c", "--kind", "window", "--window", "1"]) == 0


def test_mask_too_many_tokens_for_text(capsys, tmp_path):
    long = " ".join(f"t{i}" for i in range(150))
    one_line_error(capsys, ["mask", long], "too many for a text grid")
    png = tmp_path / "long.png"
    assert main(["mask", long, "--png", str(png)]) == 0
    assert "no text grid" in capsys.readouterr().out and png.stat().st_size > 0
    huge = " ".join(["x"] * 5000)
    one_line_error(capsys, ["mask", huge, "--png", str(png)], "expected at most 4096")


def test_mask_several_sentences_without_png_suffix_get_one_file_each(capsys, tmp_path):
    assert main(["mask", "a b", "c d e", "--png", str(tmp_path / "grid")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid_1.png", "grid_2.png"]


def test_mask_grid_with_emoji_and_cjk_lines_up(capsys):
    assert main(["mask", "🙂 日本 a", "--kind", "causal"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "│" in line]
    from tests.test_viz import _columns

    assert len({_columns(line.split("│")[0]) for line in lines}) == 1
    assert len({_columns(line) for line in lines}) == 1


def test_mask_png_of_300_tokens_stays_small():
    """Once a 24 GiB figure killed by the OOM killer; now a capped, downsampled picture."""
    # VmHWM is the peak of this process image only: ru_maxrss would include the pytest process
    # the child was forked from (Linux keeps the pre-exec high-water mark), gigabytes late in a run
    code = (
        "import sys\n"
        "from attnmask.cli import main\n"
        "rc = main(['mask', ' '.join(f't{i}' for i in range(300)), '--png', sys.argv[1]])\n"
        "hwm = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
        "print(rc, hwm)\n"
    )
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # not tmp_path: the child writes it
        png = f"{tmp}/m.png"
        proc = subprocess.run([sys.executable, "-c", code, png], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        rc, maxrss_kib = proc.stdout.split()[-2:]
        with open(png, "rb") as f:
            data = f.read(24)
    assert rc == "0"
    assert int(maxrss_kib) < 1_500_000, f"peak memory {int(maxrss_kib) / 1e6:.1f} GB"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert max(width, height) <= 6000


# ---------------------------------------------------------------------------------------------
# unknown characters and where pictures go
# ---------------------------------------------------------------------------------------------
def test_unknown_characters_are_one_warning_line(capsys, mt_run):
    assert main(["translate", "--run", str(mt_run), "🙂 a man 日本"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnmask: warning: 3 character(s)"), err
    assert "'🙂', '日', '本'" in err[0]


def test_attention_says_where_it_writes(capsys, lm_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["attention", "--run", str(lm_run), "a man", "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert f"to {tmp_path / 'attention'} (set with --out DIR)" in out
    assert (tmp_path / "attention" / "decoder_self.png").exists()
    one_line_error(capsys, ["attention", "--run", str(lm_run), "a", "--max-heads", "-1"], "--max-heads must be >= 1")


def test_gitignore_covers_run_and_picture_folders():
    for folder in ("runs", "attention", "attn"):
        proc = subprocess.run(
            ["git", "check-ignore", "-q", f"{folder}/x.png"], cwd=REPO, capture_output=True, timeout=30
        )
        if proc.returncode == 128:
            pytest.skip("not a git checkout")
        assert proc.returncode == 0, f"{folder}/ is not ignored"
