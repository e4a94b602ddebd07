"""Tests for attnmask.serve.text: incremental detokenization (valid UTF-8 pieces) and stop strings."""

from __future__ import annotations

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
