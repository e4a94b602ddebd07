"""`attnmask demo` end to end, in its reduced (--quick) mode."""

from __future__ import annotations

import re

import pytest

from attnmask.cli import main
from attnmask.train.rundir import load_run, read_metrics

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # trains the demo model end to end


def test_demo_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    text, err = capsys.readouterr()
    assert "\r" not in text + err  # redirected (captured): no progress bar's carriage returns, log lines kept
    assert "float32 products: " in text and "memory: " in text
    assert "held-out test exact match:" in text
    assert 'numbers are read day first: "1/2/2000" -> "2000-02-01"' in text
    assert re.search(r"everyday forms \(never trained on\): \d+/50 right", text)
    for form in ("1 Feb 2000", "1/2/2000", "2024-2-29"):  # a handful of everyday forms, always shown
        assert f"“{form}”" in text
    assert text.count("✓") + text.count("✗") >= 8  # translated examples, each marked
    assert "decoder self-attention, look-ahead & padding" in text
    assert "cross-attention, target queries x source keys" in text
    # the causal grid: the <sos> row may attend to itself only, the last row to everything
    grid = [line for line in text.split("M_total):")[1].split("\n\n")[0].splitlines() if "│" in line]
    rows = [line.split("│")[1].split() for line in grid[1:]]  # grid[0] is the key labels
    assert rows[0] == ["■"] + ["·"] * (len(rows) - 1)
    assert rows[-1] == ["■"] * len(rows)
    # source padding: the cross-attention grid blocks the pad columns in every row
    cross = [line for line in text.split("source keys")[1].split("\n\n")[0].splitlines() if "│" in line]
    header = cross[0].split("│")[1].split()
    pads = [i for i, label in enumerate(header) if label == "pad"]
    assert pads, "the example should be batched with a longer source"
    assert len(cross) == len(rows) + 1
    for line in cross[1:]:
        cells = line.split("│")[1].split()
        assert [cells[i] for i in pads] == ["·"] * len(pads)
        assert "·" not in cells[: pads[0]]

    test = [r for r in read_metrics(out) if r["split"] == "test"]
    assert len(test) == 1 and 0.0 <= test[0]["exact_match"] <= 1.0 and test[0]["sentences"] == 100
    everyday = [r for r in read_metrics(out) if r["split"] == "everyday"]
    assert len(everyday) == 1 and everyday[0]["sentences"] == 50
    assert (out / "loss.png").stat().st_size > 0
    assert load_run(out).task == "translation"


def test_demo_help_states_the_date_convention(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "read day first" in " ".join(capsys.readouterr().out.split())


def test_demo_replaces_its_own_previous_run_but_not_another(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    assert "replacing the previous demo run" in capsys.readouterr().out
    assert [r["split"] for r in read_metrics(out)].count("test") == 1  # the old metrics are gone

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"task": "lm", "train": {"builtin_task": null}}')
    assert main(["demo", "--quick", "--out", str(other)]) == 2
    assert "holds another run (not a demo); choose another --out" in capsys.readouterr().err


def test_the_demo_is_bounded_by_steps_not_time():
    # same command, same seed, same machine -> same model whatever the load: no clock in the schedule
    from attnmask.cli.demo import demo_config

    for quick in (False, True):
        cfg = demo_config("unused", quick=quick)
        assert cfg.optim.max_minutes is None
        assert cfg.optim.max_steps is not None and cfg.optim.max_steps > 0
    assert demo_config("unused").run.seed == 0 and demo_config("unused", seed=3).run.seed == 3
