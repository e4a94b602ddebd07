"""``attnmask serve --run DIR`` of a fine-tuned chat run: its own chat template answers /v1/chat/completions."""

from __future__ import annotations

import argparse
import contextlib
import json

import openai
import pytest

from attnmask.cli import main
from attnmask.cli.serve import load_model
from attnmask.decode import Sampling, generate
from attnmask.engine import Engine
from tests.pretrained.test_pretrained import write_tiny_gguf
from tests.serve.conftest import TIMEOUT, serve

ROWS = [
    {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello there"}]},
    {"prompt": "capital of France?", "completion": "Paris"},
]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_run")
    init, data, out = root / "tiny.gguf", root / "chat.jsonl", root / "run"
    write_tiny_gguf(init, tied=True)
    data.write_text("\n".join(json.dumps(r) for r in ROWS * 4) + "\n", encoding="utf-8")
    argv = ["train", "--init", str(init), "--data", str(data), "--out", str(out), "--max-len", "120",
            "--batch-tokens", "256", "--max-steps", "1", "--eval-every", "0", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    return out


def test_a_chat_run_is_served_with_its_own_template(chat_run, one_thread):
    args = argparse.Namespace(run=str(chat_run), model=None, served_model_name=None, quantized=False)
    model, tokenizer, template, name = load_model(args)
    assert template is not None and name == "run"
    want = generate(model, tokenizer, template("hello"), max_new_tokens=8, sampling=Sampling(temperature=0.0))
    engine = Engine(model, kv_cache_mib=4, eos_ids=tokenizer.stop_ids, detokenize=tokenizer.decode)
    with contextlib.ExitStack() as stack:
        s = stack.enter_context(serve(engine, tokenizer, template, name=name))
        client = stack.enter_context(openai.OpenAI(base_url=s.base_url, api_key="-", timeout=TIMEOUT, max_retries=0))
        r = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
        )
        assert want and r.choices[0].message.content == want  # a reply, and the one generate gives
        assert s.wait_idle()["attnmask_cache_blocks_used"] == 0
