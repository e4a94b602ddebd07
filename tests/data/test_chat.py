"""Chat rows: parsing, bad-row reports, and labels on exactly the assistant's text.

The labels come from the template's role spans; the property test renders random conversations
with a ChatML template and a small byte-level BPE, then rebuilds the assistant turns from the
labelled tokens alone.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnmask.data.chat import ChatRows, RowError, parse_row, read_chat_jsonl, tokenize_chat, tokenize_rows
from attnmask.data.files import DataError

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def chatml_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(["user assistant system hello there, how are you? fine thanks"] * 4, trainer=trainer)
    return tok


TOK = chatml_tokenizer()
END = TOK.token_to_id("<|im_end|>")


def render(messages, add_generation_prompt=False):
    from attnmask.pretrained import ChatTemplate

    return ChatTemplate(CHATML)(messages, add_generation_prompt=add_generation_prompt)


def encode(text):
    return TOK.encode(text, add_special_tokens=False).ids


def labelled_spans(ex) -> list[str]:
    """The text of each run of labelled tokens."""
    spans, run = [], []
    for i, keep in zip(ex.ids, ex.targets):
        if keep:
            run.append(i)
        elif run:
            spans.append(run)
            run = []
    if run:
        spans.append(run)
    return [TOK.decode(s, skip_special_tokens=False) for s in spans]


TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="<|>"), max_size=30)


@st.composite
def conversations(draw):
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(TEXT)})
    for _ in range(draw(st.integers(1, 4))):
        msgs.append({"role": "user", "content": draw(TEXT)})
        msgs.append({"role": "assistant", "content": draw(TEXT)})
        if draw(st.booleans()):  # several user turns in a row
            msgs.append({"role": "user", "content": draw(TEXT)})
    return msgs


@settings(deadline=None, max_examples=60)
@given(conversations())
def test_labelled_tokens_are_exactly_the_assistant_turns(messages):
    ex = tokenize_chat(messages, render=render, encode=encode, end_ids={END})
    assert len(ex.ids) == len(ex.targets)
    assert TOK.decode(ex.ids, skip_special_tokens=False) == render(messages)
    wanted = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert labelled_spans(ex) == wanted


def test_labels_start_where_the_generation_prompt_ends():
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine thanks"}]
    ex = tokenize_chat(msgs, render=render, encode=encode, end_ids={END}, bos_id=0)
    prompt = encode(render(msgs[:1], add_generation_prompt=True))
    assert ex.ids[0] == 0 and ex.ids[1 : 1 + len(prompt)] == prompt
    assert not any(ex.targets[: 1 + len(prompt)])
    assert ex.targets[1 + len(prompt)]
    assert ex.ids[-1] == encode("\n")[-1] and not ex.targets[-1]  # the newline after <|im_end|> is no target


@pytest.mark.parametrize(
    ("row", "why"),
    [
        ([1, 2], "a JSON list"),
        ({"text": "x"}, "expected"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"content": "hi"}]}, "message 0 has no role"),
        ({"messages": [{"role": "bot", "content": "hi"}]}, "role 'bot'"),
        ({"messages": [{"role": "user", "content": 3}]}, "no string content"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "no user turn before"),
        ({"prompt": "hi"}, '"completion" is missing'),
    ],
)
def test_bad_rows_say_why(row, why):
    with pytest.raises(RowError, match=why):
        parse_row(row)


def test_prompt_completion_is_a_user_and_an_assistant_turn():
    assert parse_row({"prompt": "a", "completion": "b"}) == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]


def test_file_reports_bad_rows_by_line_and_counts_them(tmp_path):
    good = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}
    long = {"prompt": "hello " * 50, "completion": "fine"}
    lines = [json.dumps(good), "{not json", "", json.dumps({"messages": [{"role": "user", "content": "x"}]}),
             json.dumps(long)]  # fmt: skip
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    rows = read_chat_jsonl(path)
    examples = tokenize_rows(rows, render=render, encode=encode, end_ids={END}, max_len=40)
    assert [ex.line for ex in examples] == [1]
    report = rows.report()
    assert [r.split(": skipped")[0] for r in report[:-1]] == [f"{path}:2", f"{path}:4", f"{path}:5"]
    assert "not JSON" in report[0] and "no assistant turn" in report[1] and "longer than --max-len 40" in report[2]
    assert report[-1] == f"{path}: skipped 3 of 4 rows"


def test_no_good_row_is_a_data_error(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("[]\n{}\n", encoding="utf-8")
    rows = read_chat_jsonl(path)
    with pytest.raises(DataError, match="no usable conversation in 2 rows"):
        tokenize_rows(rows, render=render, encode=encode, end_ids={END}, max_len=100)
    assert ChatRows("x").report() == []
