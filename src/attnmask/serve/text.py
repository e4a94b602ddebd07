"""Generated token ids into text, a piece at a time, for streaming.

A token is not always a whole character: a byte-level vocabulary spells ``é`` or an emoji over
several tokens, and decoding a prefix of them gives U+FFFD (the replacement character). So each
step sends what is new beyond what was sent, holding back a trailing U+FFFD until the next token
completes the character.

Each step decodes a window, not the whole answer (whose cost grows with its length: 1.1 ms a token
at 2,048 tokens with SmolLM2's tokenizer, on the thread that serves every stream). The window starts
at the tokens of the last commit that added text, as context: a tokenizer that drops the
leading space of the text it decodes (SentencePiece) drops it from the context, not from the new
text, which is what the window adds beyond its context's decoding. Tokens are committed once they
end on a whole character. Where the window's text does not begin with its context's (a decoder
whose text for a token depends on the token before it), the whole id list is decoded instead. So
``text`` is ``decode(ids)`` for any decoder that looks back no further than the context, as every
tokenizer's decoder does (byte-level, byte fallback, SentencePiece's first space, WordPiece's
"##"); a Unicode normalisation over the whole text would not be (none decodes with one).

Stop strings end the text before they begin (the stop string itself is not part of the answer, as in
OpenAI's API); while the text ends with what could be the start of a stop string, that tail is held
back too, so a streamed answer is exactly the non-streamed one cut into pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["TextStream"]

REPLACEMENT = "\ufffd"


class TextStream:
    """The text of one request's generated ids, released in valid pieces.

    Args:
        decode: ids -> text (a tokenizer's ``decode``, special tokens skipped).
        stop: strings that end the text; the first occurrence of any of them cuts it.

    ``push(token)`` returns the new text that may be sent now; ``finish()`` returns the rest, once
    the request has ended. ``text`` is the answer so far (cut at a stop string), ``stopped`` whether
    a stop string was seen, ``offsets[i]`` the length of the text before token ``i`` was added.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self.decode, self.stop = decode, tuple(stop)
        self.ids: list[int] = []
        self.offsets: list[int] = []
        self.text = ""
        self.sent = 0  # characters of ``text`` already released
        self.stopped = False
        # ids[:_read] decode to _committed, which ends on a whole character; ids[_context:_read] is
        # the window's context, the tokens of the last commit that added text (and any after it)
        self._context = self._read = 0
        self._committed = ""

    def push(self, token: int) -> str:
        if self.stopped:  # tokens after a stop string add nothing to the answer
            self.offsets.append(len(self.text))
            return ""
        self.offsets.append(len(self.text))
        self.ids.append(token)
        text = self._decoded()
        cut = self._first_stop(text)
        if cut is not None:
            self.text, self.stopped = text[: max(cut, self.sent)], True
            return self._release(len(self.text))
        self.text = text
        return self._release(len(text) - self._held(text))

    def _decoded(self) -> str:
        """``decode(ids)``, from the window ``ids[_context:]``; commits the tokens that end on a whole
        character."""
        ids, context = self.ids, self.decode(self.ids[self._context : self._read]) if self._read else ""
        window = self.decode(ids[self._context :])
        # (where the context decodes differently before the new tokens, there is no shortcut)
        text = self._committed + window[len(context) :] if window.startswith(context) else self.decode(ids)
        if not text.endswith(REPLACEMENT):
            if len(text) > len(self._committed):  # new text: its tokens are the next window's context
                self._context = self._read  # (tokens without text, e.g. skipped special tokens, join the
            self._read, self._committed = len(ids), text  # context: alone they would leave it empty)
        return text

    def finish(self) -> str:
        """Everything not yet released (a held-back tail included)."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : upto], upto
        return piece

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` that may still change meaning: an incomplete character
        (U+FFFD) or the beginning of a stop string."""
        complete = text.rstrip(REPLACEMENT)
        prefix = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(complete)), prefix, -1):
                if complete.endswith(s[:k]):
                    prefix = k
                    break
        return len(text) - len(complete) + prefix
