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


@pytest.mark.parametrize("name", ["m.jpgx", "m.pgf", "m.PNG!"])
def test_mask_picture_format_nobody_writes_is_one_line(tmp_path, capsys, name):
    assert main(["mask", "a b", "--png", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pictures; expected a name ending in .png" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_mask_picture_in_another_format(tmp_path, capsys):
    assert main(["mask", "a b", "--png", str(tmp_path / "m.svg")]) == 0
    assert (tmp_path / "m.svg").read_text().lstrip().startswith("<?xml")


def test_mask_bad_kind_is_one_line(capsys):
    assert main(["mask", "--kind", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown mask kind 'nope'" in err[0]


@pytest.mark.parametrize("argv", [["mask", "--window", "x"]])
def test_mask_argparse_errors_exit_nonzero(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code != 0
