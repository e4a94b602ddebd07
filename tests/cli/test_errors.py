"""User mistakes on every subcommand: one line on stderr, a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from attnmask.cli import main
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
