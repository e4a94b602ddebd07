r"""OpenAI's response objects: a whole answer, the chunks of a streamed one, usage, log-probabilities.

An answer is built from :class:`Piece`\ s, what each engine event adds (text, a token's
log-probability, the end); :class:`Shape` writes them as a completion (``text_completion``) or a
chat completion (``chat.completion`` / ``chat.completion.chunk``), with ids ``cmpl-...`` /
``chatcmpl-...``. Log-probabilities are the chosen tokens' only: in a completion OpenAI's legacy
``{tokens, token_logprobs, top_logprobs: null, text_offset}``, in a chat ``{content: [{token,
logprob, bytes, top_logprobs: []}]}``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

__all__ = ["Piece", "Shape", "usage"]


@dataclass
class Piece:
    """What one engine event adds to an answer: new text, the token (for logprobs), the end."""

    text: str
    generated: int = 0  # 1 when the event carries a token (0: a cancellation)
    tokens: list[tuple[str, float | None, int]] = field(default_factory=list)  # logprobs: (token text, logprob, offset)
    finish_reason: str | None = None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class Shape:
    """OpenAI's response objects for one request: a completion or a chat completion."""

    chat: bool
    model: str
    logprobs: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _head(self, object_: str) -> dict:
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {"id": f"{prefix}-{self.id}", "object": object_, "created": self.created, "model": self.model}

    def _logprobs(self, tokens: list[tuple[str, float | None, int]]) -> dict | None:
        if not self.logprobs:
            return None
        if self.chat:
            content = [
                {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []} for t, lp, _ in tokens
            ]
            return {"content": content, "refusal": None}
        return {
            "tokens": [t for t, _, _ in tokens],
            "token_logprobs": [lp for _, lp, _ in tokens],
            "top_logprobs": None,  # the engine reports the chosen token's log-probability only
            "text_offset": [offset for _, _, offset in tokens],
        }

    def response(self, pieces: list[Piece], *, prompt_tokens: int) -> dict:
        text = "".join(p.text for p in pieces)
        tokens = [t for p in pieces for t in p.tokens]
        generated = sum(p.generated for p in pieces)
        finish = pieces[-1].finish_reason if pieces else None
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": self._logprobs(tokens), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(tokens), "finish_reason": finish}
        return {**self._head(self.object), "choices": [choice], "usage": usage(prompt_tokens, generated)}

    def chunk(self, piece: Piece, *, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": piece.text} if piece.text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": piece.finish_reason}
            if piece.tokens:
                choice["logprobs"] = self._logprobs(piece.tokens)
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": piece.text, "logprobs": None, "finish_reason": piece.finish_reason}
        if piece.tokens:
            choice["logprobs"] = self._logprobs(piece.tokens)
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        object_ = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(object_), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
