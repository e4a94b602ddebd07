"""attnmask audit --checks and the layer reach check from the command line: a Hugging Face Gemma 3
config (sliding and full layers) measured layer by layer, its picture, and one line for a mistake."""

from __future__ import annotations

import json

import pytest

from attnmask.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_checks_picks_the_checks_run(capsys):
    assert main(["audit", "--tiny", "decoder", "--length", "6", "--checks", "gradient,layer reach", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in data["checks"]] == ["gradient", "layer reach"]
    assert [(r["layer"], r["window"], r["reach"]) for r in data["layer_reach"]] == [(0, 0, 5), (1, 0, 5)]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tiny", "decoder", "--checks", "causality,reach"], "--checks 'causality,reach': expected comma-separated"),
        (["--tiny", "decoder", "--checks", ","], "--checks ',': expected comma-separated"),
        (["--tiny", "decoder", "--checks", "causality", "--reach-png", "r.png"], "add 'layer reach' to --checks"),
        (["--tiny", "decoder", "--reach-png", "a\0b"], "--reach-png 'a\\x00b': the name contains a NUL byte"),
        (["--tiny", "decoder", "--png", "ok.png", "--reach-png", "a" * 300], "the file name is 304 bytes; expected"),
    ],
)
def test_mistakes_exit_2_before_the_audit_runs(capsys, argv, message):
    assert main(["audit", "--length", "6", *argv]) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_an_unknown_pretrained_model_is_a_usage_error(capsys):
    assert main(["audit", "--model", "no-such-model", "--checks", "layer reach"]) == 2
    assert "no-such-model" in capsys.readouterr().err


def test_a_gemma3_config_is_measured_layer_by_layer(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=64,
    )  # fmt: skip
    cfg.save_pretrained(tmp_path)
    png = tmp_path / "reach.png"
    argv = ["audit", "--hf-config", str(tmp_path), "--length", "6", "--checks", "layer reach", "--reach-png", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS  layer reach" in out and "its output at position 19 of T=20" in out
    table = [line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "1 ", "2 "))]
    assert [row[:6] for row in table] == [
        ["0", "4", "3", "back", "3", "back"],
        ["1", "full", "19", "back", "19", "back"],
        ["2", "4", "3", "back", "3", "back"],
    ]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_two_pictures_are_reported_in_one_line(capsys, tmp_path):
    argv = ["audit", "--tiny", "decoder", "--length", "6", "--checks", "causality,layer reach"]
    assert main([*argv, "--png", str(tmp_path / "m.png"), "--reach-png", str(tmp_path / "r")]) == 0
    lines = capsys.readouterr().err.splitlines()
    err = [line for line in lines if line.strip() and not line.startswith("building attnmask kernels")]
    assert err == [f"wrote {tmp_path / 'm.png'} and {tmp_path / 'r.png'}"]
