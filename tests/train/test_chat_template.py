"""``--chat-template FILE.jinja|NAME`` for a model whose files carry no chat template (a base model,
Gemma 3's GGUF): the built-in templates' assistant spans, the turn's end token joining the stop ids,
``attnmask train --init`` refusing a template-less model in one line that names the option, and a tiny
template-less Llama fine-tuned with a named and with a file template."""

from __future__ import annotations

import json
import random

import pytest

from attnmask.cli import main
from attnmask.data.chat import tokenize_chat
from attnmask.errors import UserError
from attnmask.pretrained import PretrainedTokenizer
from attnmask.pretrained.chat import TEMPLATES, chat_template_for, template_source
from attnmask.train.rundir import load_run

pytestmark = pytest.mark.usefixtures("one_thread")

TURN_TOKENS = ["<eos>", "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>"]


def word_tokenizer() -> PretrainedTokenizer:
    """Characters as tokens, the turn markers of both built-in templates as special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = sorted({chr(c) for c in range(32, 127)} | {"\n"})
    hf = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=" "))
    hf.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    hf.add_special_tokens(TURN_TOKENS)
    return PretrainedTokenizer(hf, bos_id=None, eos_id=hf.token_to_id("<eos>"))


def random_conversation(rng: random.Random) -> list[dict]:
    words = ["cat", "Dog", "run", "7", "blue sky", "a.b", "x y z"]
    messages = [{"role": "system", "content": "be brief"}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        for role in ("user", "assistant"):
            messages.append({"role": role, "content": " ".join(rng.choices(words, k=rng.randint(1, 4)))})
    return messages


@pytest.mark.parametrize("name,end", [("chatml", "<|im_end|>"), ("gemma", "<end_of_turn>")])
def test_builtin_template_labels_exactly_the_assistant_turns(name, end):
    tok = word_tokenizer()
    template = chat_template_for(tok, name)
    end_id = tok.hf.token_to_id(end)
    assert end_id in tok.stop_ids  # generation stops at the turn's end; the loss is taken on it
    rng = random.Random(0)
    for _ in range(20):
        messages = random_conversation(rng)
        ex = tokenize_chat(
            messages, render=template, encode=lambda t: tok.hf.encode(t, add_special_tokens=False).ids,
            end_ids=set(tok.stop_ids),
        )  # fmt: skip
        labelled = [i for i, t in zip(ex.ids, ex.targets) if t]
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert "".join(tok.hf.id_to_token(i) for i in labelled) == "".join(r + end for r in replies)


def test_gemma_template_folds_the_system_message_into_the_first_user_turn():
    text = template_source("gemma")
    assert "<start_of_turn>model" in text
    template = chat_template_for(word_tokenizer(), "gemma")
    rendered = template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert rendered == "<start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n"


def test_unknown_or_broken_templates_are_user_errors(tmp_path):
    with pytest.raises(UserError, match=r"--chat-template nope: no such file or template name.*chatml"):
        template_source("nope")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }", encoding="utf-8")
    with pytest.raises(UserError, match="does not render"):
        chat_template_for(word_tokenizer(), str(broken))
    silent = tmp_path / "silent.jinja"
    silent.write_text("{% for m in messages %}{{ m['role'] }}{% endfor %}", encoding="utf-8")
    with pytest.raises(UserError, match="assistant's message"):
        chat_template_for(word_tokenizer(), str(silent))
    assert set(TEMPLATES) == {"chatml", "gemma"}


# --- a tiny Llama without a template, fine-tuned through the CLI -----------------------------------


@pytest.fixture(scope="module")
def bare_hf_dir(tmp_path_factory):
    """A tiny Llama checkpoint directory whose tokenizer_config.json has no chat template."""
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -e '.[hf]')")
    from attnmask.train.export import export_hf
    from attnmask.train.init import load_init
    from tests.pretrained.test_pretrained import write_tiny_gguf

    root = tmp_path_factory.mktemp("bare")
    write_tiny_gguf(root / "tiny.gguf", tied=True)
    init = load_init(str(root / "tiny.gguf"))
    out = export_hf(init.model, init.tokenizer, None, root / "hf")
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    return out


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    rows = [{"prompt": f"add {i} and 1", "completion": str(i + 1)} for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def train_args(init, data, out, *extra):
    return ["train", "--init", str(init), "--data", str(data), "--out", str(out), "--max-len", "100",
            "--batch-tokens", "200", "--max-steps", "2", "--eval-every", "0", "--log-every", "1",
            "--no-progress", *extra]  # fmt: skip


def test_a_model_without_template_stops_in_one_line_naming_the_option(bare_hf_dir, chats, tmp_path, capsys):
    assert main(train_args(bare_hf_dir, chats, tmp_path / "run")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "carry no chat template" in err[0] and "--chat-template" in err[0]
    assert not (tmp_path / "run").exists()
    assert main(train_args(bare_hf_dir, chats, tmp_path / "run", "--chat-template", "nope")) == 2
    assert "--chat-template nope" in capsys.readouterr().err


def test_chat_template_by_name_and_by_file_fine_tunes_a_bare_model(bare_hf_dir, chats, tmp_path, capsys):
    assert main(train_args(bare_hf_dir, chats, tmp_path / "named", "--chat-template", "chatml")) == 0
    run = load_run(tmp_path / "named")
    assert run.chat_template.source == TEMPLATES["chatml"]
    assert run.chat_template("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    own = tmp_path / "plain.jinja"
    own.write_text(
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}",
        encoding="utf-8",
    )
    assert main(train_args(bare_hf_dir, chats, tmp_path / "file", "--chat-template", str(own))) == 0
    assert load_run(tmp_path / "file").chat_template("hi") == "user: hi<|im_end|>assistant: "
    assert load_run(tmp_path / "file").tokenizer.stop_ids == load_run(tmp_path / "named").tokenizer.stop_ids
    assert main(["generate", "--run", str(tmp_path / "file"), "hi", "--chat-template", "chatml"]) == 2
    assert "--chat-template applies with --chat" in capsys.readouterr().err
