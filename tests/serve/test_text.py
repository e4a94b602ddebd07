"""Tests for attnmask.serve.text: incremental detokenization (valid UTF-8 pieces) and stop strings."""

from __future__ import annotations

import random
import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnmask.serve.text import TextStream


def byte_decode(ids: list[int]) -> str:
    """A byte-level vocabulary: token = one byte, so a character may span several tokens."""
    return bytes(ids).decode("utf-8", errors="replace")


def stream_all(text: str, stop=()) -> tuple[list[str], TextStream]:
    s = TextStream(byte_decode, stop)
    pieces = [s.push(b) for b in text.encode("utf-8")]
    pieces.append(s.finish())
    return pieces, s


def test_a_multibyte_character_is_held_until_complete():
    s = TextStream(byte_decode)
    euro = "€".encode()  # 3 bytes
    assert [s.push(b) for b in b"a" + euro + b"b"] == ["a", "", "", "€", "b"]
    assert s.finish() == ""


def test_pieces_are_valid_and_add_up_to_the_text():
    pieces, s = stream_all("héllo 🙂 wörld")
    assert "".join(pieces) == "héllo 🙂 wörld" == s.text
    assert all("\ufffd" not in p for p in pieces)


def test_a_truncated_character_at_the_end_is_sent_by_finish():
    s = TextStream(byte_decode)
    assert s.push(ord("a")) == "a"
    assert s.push(0xE2) == ""  # the first byte of a 3-byte character, then the request ends
    assert s.finish() == "\ufffd"


def test_the_stop_string_cuts_the_text_and_is_not_included():
    pieces, s = stream_all("one two STOP three", stop=["STOP"])
    assert "".join(pieces) == "one two " == s.text and s.stopped


def test_the_earliest_of_several_stop_strings_wins():
    _, s = stream_all("abc END xyz HALT", stop=["HALT", "END"])
    assert s.text == "abc "


def test_a_possible_stop_prefix_is_held_then_released():
    s = TextStream(byte_decode, ["STOP"])
    out = [s.push(b) for b in b"xST"]
    assert out == ["x", "", ""]  # "S", "ST" could begin "STOP"
    assert s.push(ord("x")) == "STx"  # it did not
    assert s.finish() == ""


def test_tokens_after_the_stop_add_nothing():
    s = TextStream(byte_decode, ["."])
    assert [s.push(b) for b in b"ab.cd"] == ["a", "b", "", "", ""]
    assert s.text == "ab" and s.offsets == [0, 1, 2, 2, 2]


def first_stop(text: str, stops) -> tuple[str, bool]:
    """The answer as the engine ends it: at the first prefix holding a stop string, cut at the
    earliest stop string in that prefix."""
    for end in range(len(text) + 1):
        found = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if found:
            return text[: min(found)], True
    return text, False


CHARS = st.characters(codec="utf-8", exclude_characters="\ufffd")  # U+FFFD only ever marks an incomplete character


@given(st.text(CHARS, max_size=30), st.lists(st.text(CHARS, min_size=1, max_size=3), max_size=2))
def test_streamed_equals_the_whole_text_cut_at_the_first_stop(text, stops):
    pieces, s = stream_all(text, stops)
    assert ("".join(pieces), s.stopped) == first_stop(text, stops)
    assert all("\ufffd" not in p for p in pieces)


@given(st.data())
def test_stop_strings_taken_from_the_text(data):
    text = data.draw(st.text(CHARS, min_size=1, max_size=20))
    spans = st.tuples(st.integers(0, len(text) - 1), st.integers(1, 4))
    stops = [text[i : i + n] for i, n in data.draw(st.lists(spans, min_size=1, max_size=3))]
    pieces, s = stream_all(text, stops)
    assert ("".join(pieces), s.stopped) == first_stop(text, stops)


# ---------------------------------------------------------------------------------------------
# The window: text is decode(ids) after every token, with the real tokenizers
# ---------------------------------------------------------------------------------------------
VARIED = [
    "Grüße aus Köln — naïve café, 12,345.67 € and 3.14159",
    "def f(x):\n    return x ** 2  # squares\n\n\tindented\ttabs",
    "emoji 🙂👍🏽 and 日本語のテキスト, 한국어, العربية",
    "runs of   spaces    and\n\n\nnewlines ... end.",
    " leading space, trailing space ",
]


def sentencepiece_like(pieces: list[str]):
    """A decoder with the habits a window must survive. SentencePiece's: the text's first space is
    dropped and "▁" read as a space, with special tokens ("<s>") skipped before, so that a space after
    them at the start is dropped too. And a text for a token that depends on the token before it: NFC
    composes "e" and a combining acute into "é", so the text before a new token can change. Like
    every tokenizer's decoder, it looks no further back than that: NFC also reorders runs of combining
    marks of different classes, which a window cannot follow, so there is one mark here."""

    def decode(ids: list[int]) -> str:
        text = "".join(pieces[i] for i in ids if pieces[i] != "<s>").replace("▁", " ")
        return unicodedata.normalize("NFC", text[1:] if text.startswith(" ") else text)

    return decode


PIECES = ["▁", "a", "▁the", "e", "\u0301", "▁b", ".", "▁▁", "x", "\u0301\u0301", "c", "<s>"]


@given(st.lists(st.integers(0, len(PIECES) - 1), max_size=25))
def test_the_window_gives_the_whole_decoding(ids):
    decode = sentencepiece_like(PIECES)
    s = TextStream(decode)
    pieces = []
    for k, token in enumerate(ids, 1):
        pieces.append(s.push(token))
        assert s.text == decode(ids[:k])
    pieces.append(s.finish())
    texts = [decode(ids[:k]) for k in range(len(ids) + 1)]
    if all(b.startswith(a.rstrip("\ufffd")) for a, b in zip(texts, texts[1:])):  # text that only grows
        assert "".join(pieces) == decode(ids)  # (an accent joining a sent "e" cannot be streamed)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's byte-level BPE tokenizer, the one ``attnmask serve --model smollm2`` decodes with."""
    from attnmask.errors import UserError
    from attnmask.pretrained import MODELS, load, locate

    try:
        locate("smollm2")
    except UserError:
        pytest.skip(f"SmolLM2 weights not installed ({MODELS['smollm2'].install})")
    return load("smollm2", quantized=True)[1]  # the session's cache: converted once for all tests


def test_the_window_gives_the_whole_decoding_with_a_real_tokenizer(smollm2_tokenizer):
    tok, rng = smollm2_tokenizer, random.Random(0)
    for text in VARIED:
        ids = tok.encode(text)
        for trial in range(3):  # as encoded, then with random ids spliced in (a model may emit any
            seq = list(ids)  # token: lone bytes, pieces that begin with a space, special tokens)
            for _ in range(trial * len(seq) // 3):
                seq.insert(rng.randrange(len(seq) + 1), rng.randrange(tok.vocab_size))
            s = TextStream(tok.decode)
            pieces = []
            for k, token in enumerate(seq, 1):
                pieces.append(s.push(token))
                assert s.text == tok.decode(seq[:k]), (text, trial, k)
            pieces.append(s.finish())
            assert "".join(pieces) == tok.decode(seq), (text, trial)
