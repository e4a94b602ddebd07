"""Tests for attnmask.data.tokenizer: special ids, exact round trips, persistence and errors."""

from __future__ import annotations

import gzip
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from attnmask.data.tokenizer import (
    EOS,
    EOS_ID,
    MIN_BPE_VOCAB_SIZE,
    PAD,
    PAD_ID,
    SOS,
    SOS_ID,
    UNK,
    UNK_ID,
    Tokenizer,
)
from tests.conftest import MULTI30K

CORPUS = [
    "A man in a blue shirt is standing on a ladder cleaning windows.",
    "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
    "Three people sit in a cave.  Two dogs play!",
    "Ein kleines Mädchen klettert in ein Spielhaus aus Holz.",
]

TRICKY = [
    "",
    " ",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n",
    "punctuation: (a), [b]; {c}! ¿qué? «oui» — “quotes”",
    "unicode: Größe, naïve, 東京, emoji 🙂",
    "looks special: <pad> <sos> <eos> <unk>",
]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.train_bpe(CORPUS * 3, vocab_size=320)


@pytest.fixture(scope="module")
def chars() -> Tokenizer:
    return Tokenizer.train_chars(CORPUS)


def test_special_constants_are_fixed():
    assert (PAD, SOS, EOS, UNK) == ("<pad>", "<sos>", "<eos>", "<unk>")
    assert (PAD_ID, SOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)


@pytest.mark.parametrize("kind", ["bpe", "chars"])
def test_special_ids(kind, request):
    tok = request.getfixturevalue(kind)
    assert (tok.pad_id, tok.sos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert [tok.id_to_token(i) for i in range(4)] == ["<pad>", "<sos>", "<eos>", "<unk>"]


def test_bpe_vocab_size_is_bounded_and_merges_learned(bpe):
    assert MIN_BPE_VOCAB_SIZE < bpe.vocab_size <= 320
    # Merges make common words shorter than their byte count.
    assert len(bpe.encode("in a")) < len(b"in a")


@pytest.mark.parametrize("text", CORPUS + TRICKY)
def test_bpe_round_trip_literal(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60))
def test_bpe_round_trip_any_text(bpe, text):
    ids = bpe.encode(text)
    assert all(i >= 4 for i in ids), "encode must never produce specials"
    assert bpe.decode(ids) == text


def test_encode_adds_no_specials_and_decode_skips_them(bpe):
    text = "a man"
    ids = bpe.encode(text)
    wrapped = [SOS_ID, *ids, EOS_ID, PAD_ID, PAD_ID]
    assert bpe.decode(wrapped) == text
    assert bpe.decode(wrapped, skip_special=False) == "<sos>a man<eos><pad><pad>"
    assert bpe.encode("") == []


def test_literal_special_spelling_is_not_a_special(bpe, chars):
    assert PAD_ID not in bpe.encode("<pad>")
    # '<' and '>' never occur in CORPUS, the letters do: five character tokens, no <pad>.
    assert chars.encode("<pad>") == [UNK_ID, *chars.encode("pad"), UNK_ID]


def test_decode_accepts_tensor_and_batch(bpe):
    ids = bpe.encode("two dogs")
    assert bpe.decode(torch.tensor(ids)) == "two dogs"
    rows = torch.tensor([[SOS_ID, *ids, EOS_ID], [SOS_ID, *ids, PAD_ID]])
    assert bpe.decode_batch(rows) == ["two dogs", "two dogs"]


def test_encode_batch_matches_encode(bpe):
    assert bpe.encode_batch(TRICKY) == [bpe.encode(t) for t in TRICKY]


def test_chars_one_token_per_character(chars):
    text = "Ein Mann"
    ids = chars.encode(text)
    assert len(ids) == len(text)
    assert [chars.id_to_token(i) for i in ids] == list(text)
    # Ids follow sorted code point order after the specials.
    assert chars.encode(" ") == [4]


def test_chars_round_trip_and_unknown(chars):
    for text in CORPUS:
        assert chars.decode(chars.encode(text)) == text
    with pytest.warns(UserWarning, match="outside the tokenizer's vocabulary"):
        assert chars.encode("aQa") == [chars.encode("a")[0], UNK_ID, chars.encode("a")[0]]
    with pytest.warns(UserWarning):
        assert chars.decode(chars.encode("aQa")) == "aa"


def test_unknown_characters_warn_once_per_call_naming_them():
    dates = Tokenizer.train_chars(["22 Nov 2026", "1 Feb 2000"])
    with pytest.warns(UserWarning) as caught:
        ids = dates.encode("🙂 22 Nov 2026 日本")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "3 character(s)" in message and "'🙂', '日', '本'" in message, message
    assert ids.count(UNK_ID) == 3
    with pytest.warns(UserWarning) as caught:
        dates.encode_batch(["🙂 1 Feb", "2000 🙂", "x"])  # one warning for the whole batch
    assert len(caught) == 1 and "3 character(s)" in str(caught[0].message) and "'🙂', 'x'" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # text the vocabulary covers: silent
        dates.encode("1 Feb 2026")
        dates.encode_batch(["22 Nov 2000", ""])
        Tokenizer.train_bpe(["some text"], vocab_size=300).encode("🙂 日本")  # byte-level: nothing unknown


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=sorted(set("".join(CORPUS))), max_size=40))
def test_chars_round_trip_any_text_over_alphabet(chars, text):
    assert chars.decode(chars.encode(text)) == text


def test_chars_handles_newlines():
    tok = Tokenizer.train_chars(["line one\nline two\n"])
    assert tok.decode(tok.encode("one\ntwo\n")) == "one\ntwo\n"


@pytest.mark.parametrize("kind", ["bpe", "chars"])
def test_save_load_equality(kind, request, tmp_path):
    tok = request.getfixturevalue(kind)
    written = tok.save(tmp_path / "sub" / "tokenizer.json")
    assert written == tmp_path / "sub" / "tokenizer.json"
    loaded = Tokenizer.load(written)
    assert loaded == tok
    assert loaded.vocab_size == tok.vocab_size
    for text in CORPUS:
        assert loaded.encode(text) == tok.encode(text)
    # After loading, special spellings must still encode as plain text.
    assert loaded.encode("<eos>") == tok.encode("<eos>")
    assert PAD_ID not in loaded.encode("<pad>")


def test_save_into_directory(bpe, tmp_path):
    written = bpe.save(tmp_path)
    assert written == tmp_path / "tokenizer.json"
    assert Tokenizer.load(tmp_path) == bpe


def test_from_hf_copies_and_checks(bpe):
    hf = HFTokenizer.from_str(bpe.to_json())
    wrapped = Tokenizer.from_hf(hf)
    assert wrapped == bpe
    assert hf.encode_special_tokens is False, "from_hf must not mutate its argument"

    no_specials = HFTokenizer(models.WordLevel(vocab={"a": 0, "<unk>": 1}, unk_token="<unk>"))
    with pytest.raises(ValueError, match=r"special token '<pad>' has id None, expected 0"):
        Tokenizer.from_hf(no_specials)
    with pytest.raises(TypeError, match="expected a tokenizers.Tokenizer, got dict"):
        Tokenizer.from_hf({})


def test_vocab_size_too_small():
    with pytest.raises(ValueError, match=r"vocab_size=100 is too small .* at least 260"):
        Tokenizer.train_bpe(CORPUS, vocab_size=100)


@pytest.mark.parametrize("texts", [[], ["", ""]])
def test_empty_training_texts(texts):
    with pytest.raises(ValueError, match="expected at least one non-empty text"):
        Tokenizer.train_bpe(texts, vocab_size=300)
    with pytest.raises(ValueError, match="expected at least one non-empty text"):
        Tokenizer.train_chars(texts)


def test_non_str_texts():
    with pytest.raises(TypeError, match="expected text as str, got bytes"):
        Tokenizer.train_chars([b"bytes"])
    with pytest.raises(TypeError, match="expected text as str, got int"):
        Tokenizer.train_bpe(["ok", 3], vocab_size=300)


def test_out_of_range_ids(bpe):
    with pytest.raises(ValueError, match=rf"out of range, expected 0 <= id < {bpe.vocab_size}"):
        bpe.decode([5, bpe.vocab_size])
    with pytest.raises(ValueError, match="out of range"):
        bpe.decode([-1])
    with pytest.raises(ValueError, match=rf"token id {bpe.vocab_size} is out of range"):
        bpe.id_to_token(bpe.vocab_size)


def test_load_rejects_non_tokenizer_files(tmp_path, bpe):
    not_json = tmp_path / "notes.json"
    not_json.write_text("hello, not json")
    with pytest.raises(ValueError, match=r"notes\.json is not a tokenizer\.json file"):
        Tokenizer.load(not_json)

    other_json = tmp_path / "config.json"
    other_json.write_text('{"d_model": 64}')
    with pytest.raises(ValueError, match=r"config\.json is not a tokenizer\.json file"):
        Tokenizer.load(other_json)

    binary = tmp_path / "tokenizer.json.gz"
    binary.write_bytes(gzip.compress(bpe.to_json().encode()))
    with pytest.raises(ValueError, match=r"tokenizer\.json\.gz is not a tokenizer\.json file"):
        Tokenizer.load(binary)

    foreign = tmp_path / "foreign.json"
    HFTokenizer(models.WordLevel(vocab={"a": 0, "<unk>": 1}, unk_token="<unk>")).save(str(foreign))
    with pytest.raises(ValueError, match=r"foreign\.json: special token '<pad>'"):
        Tokenizer.load(foreign)

    with pytest.raises(FileNotFoundError):
        Tokenizer.load(tmp_path / "missing.json")


@pytest.mark.skipif(not MULTI30K.is_dir(), reason=f"multi30k data not found at {MULTI30K}")
def test_multi30k_bpe_round_trip():
    from attnmask.data import read_parallel

    train = read_parallel(MULTI30K / "train.de.gz", MULTI30K / "train.en.gz")
    tok = Tokenizer.train_bpe(train.sources[:400] + train.targets[:400], vocab_size=1000)
    val = read_parallel(MULTI30K / "val.de.gz", MULTI30K / "val.en.gz")
    texts = val.sources[:300] + val.targets[:300]
    ids = tok.encode_batch(texts)
    assert [tok.decode(row) for row in ids] == texts
    # A learned vocabulary compresses: far fewer tokens than bytes.
    assert sum(map(len, ids)) < 0.5 * sum(len(t.encode()) for t in texts)


def test_save_failure_is_an_oserror(tmp_path, monkeypatch):
    tok = Tokenizer.train_chars(["abc"])

    class Full:
        def save(self, path):
            raise Exception("No space left on device (os error 28)")  # what tokenizers raises

    monkeypatch.setattr(tok, "_hf", Full())
    with pytest.raises(OSError, match=r"cannot write .*tokenizer.json: No space left on device"):
        tok.save(tmp_path / "tokenizer.json")
