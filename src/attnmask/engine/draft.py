"""Draft tokens for speculative decoding, by prompt lookup: the tokens that followed the last time the
sequence's latest ``n`` tokens occurred in it (prompt included), longest ``n`` first.

No draft model: text that repeats its context (code being edited, a document being summarised or
quoted, a JSON that echoes its keys, a multiple-turn chat) gives drafts that the model then checks in
one step, several positions at once. This is llama.cpp's lookup decoding and vLLM's ``ngram``
speculator. The engine keeps a draft token only where the model's own choice at that position is that
token, so the answer is bit for bit the one without drafts (see :class:`~attnmask.engine.Engine`).
"""

from __future__ import annotations

__all__ = ["PromptLookup"]


class PromptLookup:
    """An index of one sequence's ``n``-grams (``n`` from ``longest`` down to ``shortest``), each mapped to
    the position after its latest occurrence; kept up to date as the sequence grows."""

    def __init__(self, longest: int = 3, shortest: int = 2):
        if not 1 <= shortest <= longest:
            raise ValueError(f"expected 1 <= shortest <= longest; got {shortest}, {longest}")
        self.sizes = range(longest, shortest - 1, -1)
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._next: dict[int, int] = {n: 0 for n in self.sizes}  # the next start to index, per n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow ``tokens`` (the same list, grown, at every call), or none."""
        end = len(tokens) - 1  # n-grams followed by a token, the latest suffix excluded
        for n in self.sizes:
            after, i = self._after[n], self._next[n]
            while i + n <= end:
                after[tuple(tokens[i : i + n])] = i + n
                i += 1
            self._next[n] = i
        for n in self.sizes:
            if len(tokens) > n and (j := self._after[n].get(tuple(tokens[-n:]))) is not None:
                return tokens[j : j + k]
        return []
