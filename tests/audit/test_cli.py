"""attnmask audit: a CI gate (exit 1 on a leak), JSON, pictures, and one line for a user mistake."""

import json

import pytest

from attnmask.audit.faults import tiny_model
from attnmask.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_cli_exit_codes_and_json(capsys, tmp_path):
    assert main(["audit", "--tiny", "decoder", "--length", "6"]) == 0
    assert "PASSED: no leak found" in capsys.readouterr().out
    png = tmp_path / "a.png"
    code = main(["audit", "--tiny", "decoder", "--inject", "off_by_one", "--length", "6", "--json", "--png", str(png)])
    assert code == 1
    data = json.loads(capsys.readouterr().out)
    assert (data["first_leak"]["check"], data["first_leak"]["i"], data["first_leak"]["j"]) == ("causality", 0, 1)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_audits_a_run_directory(capsys, tmp_path):
    from attnmask.data.tokenizer import Tokenizer
    from attnmask.train.checkpoint import save_weights
    from attnmask.train.rundir import TOKENIZER, WEIGHTS, write_config

    tok = Tokenizer.train_chars(["abc def"])
    model = tiny_model("encoder_decoder", vocab_size=tok.vocab_size)
    tok.save(tmp_path / TOKENIZER)
    write_config(tmp_path, task="translation", model=model.config, train={}, src_tokenizer=False)
    save_weights(tmp_path / WEIGHTS, model, metadata={"step": "1"})
    assert main(["audit", "--run", str(tmp_path), "--length", "6", "--src-length", "5", "--pad", "2"]) == 0
    out = capsys.readouterr().out
    assert f"attnmask audit: run {tmp_path} (translation, encoder_decoder)" in out
    assert "PASS  source padding" in out


def test_cli_hf_config(capsys):
    pytest.importorskip("transformers")
    assert main(["audit", "--hf-config", "llama", "--length", "6"]) == 0
    assert "Hugging Face LlamaForCausalLM (llama, random)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["audit", "--tiny", "decoder", "--pad", "0"], "--pad '0': expected comma-separated ints >= 1"),
        (["audit", "--run", "/nonexistent/run"], "not a run directory"),
        (["audit", "--hf-config", "gpt2", "--inject", "padding"], "--inject breaks attnmask models only"),
        (["audit", "--tiny", "decoder", "--length", "1"], "audit length must be an int >= 2"),
    ],
)
def test_cli_user_errors_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
