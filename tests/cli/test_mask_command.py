import pytest

from attnmask.cli import main


def test_mask_default_is_seed_004_combined(capsys):
    assert main(["mask"]) == 0
    out = capsys.readouterr().out
    combined = out.split("combined M_total")[1]
    rows = [line.split("│")[1].split() for line in combined.strip().splitlines()[2:5]]
    assert rows == [["0", "-∞", "-∞"], ["0", "0", "-∞"], ["0", "0", "-∞"]]


def test_mask_png(tmp_path, capsys):
    png = tmp_path / "m.png"
    assert main(["mask", "How are you", "--kind", "causal", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mask_bad_kind_is_one_line(capsys):
    assert main(["mask", "--kind", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown mask kind 'nope'" in err[0]


@pytest.mark.parametrize("argv", [["mask", "--window", "x"]])
def test_mask_argparse_errors_exit_nonzero(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code != 0
