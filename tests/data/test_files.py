"""Tests for attnmask.data: file reading errors and the teacher-forcing / LM batch builders."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from attnmask.data import (
    IGNORE_INDEX,
    DataError,
    LMBatch,
    TranslationBatch,
    make_lm_batch,
    make_translation_batch,
    read_lines,
    read_parallel,
    read_text,
    translation_lengths,
)
from tests.conftest import MULTI30K

SPECIALS = {"pad_id": 0, "sos_id": 1, "eos_id": 2}


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


# --- read_lines -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["text.txt", "text.txt.gz"])
def test_read_lines_skips_and_counts_empty(tmp_path, name):
    path = write(tmp_path / name, b"first\n\nsecond line\r\n   \nthird\n")
    result = read_lines(path)
    assert result.lines == ["first", "second line", "third"]
    assert result.skipped_empty == 2
    assert result.path == path


def test_read_lines_keeps_unicode_and_drops_bom(tmp_path):
    path = write(tmp_path / "de.txt", "\ufeffGrüße\nno final newline".encode())
    assert read_lines(path).lines == ["Grüße", "no final newline"]


@pytest.mark.parametrize("name", ["empty.txt", "empty.txt.gz"])
@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_read_lines_empty_file(tmp_path, name, content):
    path = write(tmp_path / name, content)
    with pytest.raises(DataError, match=rf"{name}: no text found"):
        read_lines(path)


@pytest.mark.parametrize("name", ["bad.txt", "bad.txt.gz"])
def test_read_lines_invalid_utf8_names_line_and_offset(tmp_path, name):
    # Line 2 starts at byte 3 ("ok\n"); the bad byte 0xff is 2 bytes into it: offset 5.
    path = write(tmp_path / name, b"ok\nab\xff\xfe\nfine\n")
    with pytest.raises(DataError, match=rf"{name}: invalid UTF-8 at line 2, byte offset 5") as info:
        read_lines(path)
    assert "0xff" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_read_lines_not_gzip(tmp_path):
    path = tmp_path / "plain.txt.gz"
    path.write_bytes(b"not compressed\n")
    with pytest.raises(DataError, match=r"plain\.txt\.gz: not a valid gzip file"):
        read_lines(path)


def test_read_lines_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_lines(tmp_path / "nope.txt")


# --- read_text --------------------------------------------------------------------------------


def test_read_text_is_exact(tmp_path):
    content = "First Citizen:\nBefore we proceed\n\n  any further\n"
    assert read_text(write(tmp_path / "a.txt", content.encode())) == content
    assert read_text(write(tmp_path / "a.txt.gz", content.encode())) == content


def test_read_text_errors(tmp_path):
    with pytest.raises(DataError, match=r"blank\.txt: no text found"):
        read_text(write(tmp_path / "blank.txt", b" \n\n"))
    with pytest.raises(DataError, match=r"bad\.txt: invalid UTF-8 at line 3, byte offset 5"):
        read_text(write(tmp_path / "bad.txt", b"a\nbc\n\xfe"))  # "a\\nbc\\n" is 5 bytes, so 0xfe sits at offset 5


# --- read_parallel ----------------------------------------------------------------------------


def test_read_parallel_pairs_and_skips(tmp_path):
    src = write(tmp_path / "train.de.gz", b"eins\n\ndrei\nvier\n")
    tgt = write(tmp_path / "train.en", b"one\ntwo\n\nfour\n")
    result = read_parallel(src, tgt)
    assert list(result) == [("eins", "one"), ("vier", "four")]
    assert result.skipped_empty == 2
    assert len(result) == 2 and result[1] == ("vier", "four")
    assert result.sources == ["eins", "vier"] and result.targets == ["one", "four"]


def test_read_parallel_differing_line_counts(tmp_path):
    src = write(tmp_path / "a.de", b"eins\nzwei\ndrei\n")
    tgt = write(tmp_path / "a.en", b"one\ntwo\n")
    with pytest.raises(DataError, match=r"a\.de has 3 lines but .*a\.en has 2"):
        read_parallel(src, tgt)


def test_read_parallel_no_pairs_left(tmp_path):
    src = write(tmp_path / "x.de", b"eins\n\n")
    tgt = write(tmp_path / "x.en", b"\ntwo\n")
    with pytest.raises(DataError, match=r"x\.de and .*x\.en: no pair with text on both sides"):
        read_parallel(src, tgt)


def test_read_parallel_invalid_utf8_on_target(tmp_path):
    src = write(tmp_path / "y.de", b"eins\n")
    tgt = write(tmp_path / "y.en", b"\xffne\n")
    with pytest.raises(DataError, match=r"y\.en: invalid UTF-8 at line 1, byte offset 0"):
        read_parallel(src, tgt)


@pytest.mark.skipif(not MULTI30K.is_dir(), reason=f"multi30k data not found at {MULTI30K}")
def test_read_parallel_multi30k_val():
    result = read_parallel(MULTI30K / "val.de.gz", MULTI30K / "val.en.gz")
    assert len(result) + result.skipped_empty == 1014
    assert all(src.strip() and tgt.strip() for src, tgt in result)


# --- translation batches ----------------------------------------------------------------------


def test_translation_batch_literal():
    batch = make_translation_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], **SPECIALS)
    assert isinstance(batch, TranslationBatch)
    assert_close(batch.src, torch.tensor([[5, 6, 7, 2], [8, 2, 0, 0]]))
    assert_close(batch.src_lengths, torch.tensor([4, 2]))
    assert_close(batch.tgt_in, torch.tensor([[1, 9, 10, 0], [1, 11, 12, 13]]))
    assert_close(batch.tgt_lengths, torch.tensor([3, 4]))
    assert_close(batch.labels, torch.tensor([[9, 10, 2, -100], [11, 12, 13, 2]]))
    assert batch.num_tokens == 7
    assert batch.padding_fraction == pytest.approx(3 / 16)  # 2 src pads + 1 tgt pad of 16 slots


def test_translation_batch_empty_sequences():
    batch = make_translation_batch([[]], [[]], **SPECIALS)
    assert_close(batch.src, torch.tensor([[2]]))
    assert_close(batch.tgt_in, torch.tensor([[1]]))
    assert_close(batch.labels, torch.tensor([[2]]))


sequences = st.lists(st.integers(min_value=4, max_value=50), max_size=7)


@settings(max_examples=100, deadline=None)
@given(pairs=st.lists(st.tuples(sequences, sequences), min_size=1, max_size=5))
def test_translation_batch_shift_property(pairs):
    src_ids = [s for s, _ in pairs]
    tgt_ids = [t for _, t in pairs]
    batch = make_translation_batch(src_ids, tgt_ids, **SPECIALS)
    B = len(pairs)
    assert batch.src.shape == (B, max(len(s) for s in src_ids) + 1)
    assert batch.tgt_in.shape == batch.labels.shape == (B, max(len(t) for t in tgt_ids) + 1)
    for dtype_field in (batch.src, batch.src_lengths, batch.tgt_in, batch.tgt_lengths, batch.labels):
        assert dtype_field.dtype == torch.long
    for b, (src, tgt) in enumerate(pairs):
        n = len(tgt) + 1
        assert_close(batch.src[b, : len(src) + 1], torch.tensor(src + [2]))
        assert_close(batch.tgt_in[b, :n], torch.tensor([1] + tgt))
        assert_close(batch.labels[b, :n], torch.tensor(tgt + [2]))
        # Shift: the label at t is the decoder input at t + 1.
        assert_close(batch.labels[b, : n - 1], batch.tgt_in[b, 1:n])
        assert (batch.tgt_in[b, n:] == 0).all() and (batch.labels[b, n:] == IGNORE_INDEX).all()
    assert batch.num_tokens == int(batch.tgt_lengths.sum())
    assert [tuple(x) for x in zip(batch.src_lengths.tolist(), batch.tgt_lengths.tolist())] == (
        translation_lengths(src_ids, tgt_ids)
    )


def test_translation_batch_errors():
    with pytest.raises(ValueError, match="got 2 source and 1 target sequences"):
        make_translation_batch([[4], [5]], [[6]], **SPECIALS)
    with pytest.raises(ValueError, match="cannot build an empty batch"):
        make_translation_batch([], [], **SPECIALS)


def test_batch_to_device_copies_all_fields():
    batch = make_translation_batch([[5]], [[6]], **SPECIALS)
    moved = batch.to("cpu")
    assert isinstance(moved, TranslationBatch)
    for name in ("src", "src_lengths", "tgt_in", "tgt_lengths", "labels"):
        assert_close(getattr(moved, name), getattr(batch, name))
    lm = make_lm_batch([[1, 2, 3]], pad_id=0).to(torch.device("cpu"))
    assert isinstance(lm, LMBatch)


# --- language-model batches -------------------------------------------------------------------


def test_lm_batch_literal():
    batch = make_lm_batch([[1, 5, 6, 7, 2], [1, 8, 2]], pad_id=0)
    assert_close(batch.input_ids, torch.tensor([[1, 5, 6, 7], [1, 8, 0, 0]]))
    assert_close(batch.lengths, torch.tensor([4, 2]))
    assert_close(batch.labels, torch.tensor([[5, 6, 7, 2], [8, 2, -100, -100]]))
    assert batch.num_tokens == 6


def test_lm_batch_errors():
    with pytest.raises(ValueError, match="sequence 1 has 1 tokens; expected at least 2"):
        make_lm_batch([[1, 2], [3]], pad_id=0)
    with pytest.raises(ValueError, match="cannot build an empty batch"):
        make_lm_batch([], pad_id=0)
