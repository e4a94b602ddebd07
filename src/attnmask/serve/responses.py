r"""OpenAI's response objects: a whole answer, the chunks of a streamed one, usage, log-probabilities.

An answer is built from :class:`Piece`\ s, what each engine event adds (text, a token's
log-probability, the end); :class:`Shape` writes them as a completion (``text_completion``) or a
chat completion (``chat.completion`` / ``chat.completion.chunk``), with ids ``cmpl-...`` /
``chatcmpl-...``. Log-probabilities: in a completion OpenAI's legacy ``{tokens, token_logprobs,
top_logprobs, text_offset}``, ``top_logprobs`` a ``{token: logprob}`` object a token holding the N most
likely tokens and the chosen one (null for N = 0, and for an echoed prompt's first token, which
nothing predicts); in a chat ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob,
bytes}]}]}``. A chat that offered tools (:class:`~attnmask.serve.tools.Tools`) answers with the JSON of
their form, which becomes the message's ``tool_calls`` or ``content``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from attnmask.serve.tools import Tools

__all__ = ["Piece", "Shape", "usage"]


TopTexts = list[tuple[str, float]]  # the most likely tokens at a position, as (text, logprob)


@dataclass
class Piece:
    """What one engine event adds to an answer: new text, the token (for logprobs), the end."""

    text: str
    generated: int = 0  # 1 when the event carries a token (0: a cancellation, an echoed prompt)
    logprob: float = 0.0  # the generated token's log-probability, where the engine computed it
    # logprobs: (token text, logprob, offset, the most likely tokens there); logprob None: nothing predicts it
    tokens: list[tuple[str, float | None, int, TopTexts | None]] = field(default_factory=list)
    finish_reason: str | None = None


def _top_object(token: str, logprob: float, top: TopTexts | None) -> dict[str, float]:
    """``{text: logprob}`` of the most likely tokens, then the chosen one; where two tokens have one text
    (bytes of a split character), the more likely one's stays."""
    out: dict[str, float] = {}
    for text, lp in top or ():
        out.setdefault(text, lp)
    out.setdefault(token, logprob)
    return out


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
    top_logprobs: int = 0
    tools: Tools | None = None  # a chat whose answers are tool calls' JSON form
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _head(self, object_: str) -> dict:
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {"id": f"{prefix}-{self.id}", "object": object_, "created": self.created, "model": self.model}

    def _logprobs(self, tokens: list[tuple[str, float | None, int, TopTexts | None]]) -> dict | None:
        if not self.logprobs:
            return None
        if self.chat:
            entry = lambda t, lp: {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}  # noqa: E731
            content = [{**entry(t, lp), "top_logprobs": [entry(*x) for x in top or ()]} for t, lp, _, top in tokens]
            return {"content": content, "refusal": None}
        tops = None
        if self.top_logprobs:  # the N most likely and the chosen token (OpenAI: up to N + 1 entries)
            tops = [None if lp is None else _top_object(t, lp, top) for t, lp, _, top in tokens]
        return {
            "tokens": [t for t, _, _, _ in tokens],
            "token_logprobs": [lp for _, lp, _, _ in tokens],
            "top_logprobs": tops,
            "text_offset": [offset for _, _, offset, _ in tokens],
        }

    def response(self, choices: list[list[Piece]], *, prompt_tokens: int, completion_tokens: int | None = None) -> dict:
        """The whole answer: one choice a prompt, from its pieces; ``prompt_tokens`` of all prompts;
        ``completion_tokens``: those generated (default: the choices'; ``best_of`` counts all it computed)."""
        out, generated = [], 0
        for index, pieces in enumerate(choices):
            text = "".join(p.text for p in pieces)
            tokens = [t for p in pieces for t in p.tokens]
            generated += sum(p.generated for p in pieces)
            finish = pieces[-1].finish_reason if pieces else None
            logprobs = self._logprobs(tokens)
            if self.chat:
                message, finish = self._message(text, finish)
                out.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish})
            else:
                out.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
        generated = generated if completion_tokens is None else completion_tokens
        return {**self._head(self.object), "choices": out, "usage": usage(prompt_tokens, generated)}

    def _message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A chat answer's message and finish reason: its text, or with tools the calls its JSON makes."""
        if self.tools is None:
            return {"role": "assistant", "content": text}, finish
        content, calls, finish = self.tools.parse(text, finish)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.message() for call in calls]
        return message, finish

    def tool_end(self, content: str | None, calls: list[dict], finish: str | None, *, index: int = 0) -> dict:
        """The last chunk of a streamed chat answer that offered tools: its unsent text or call deltas."""
        delta = {} if not content else {"content": content}
        if calls:
            delta["tool_calls"] = calls
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def chunk(self, piece: Piece, *, role: bool = False, index: int = 0, tool_calls: list | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": piece.text} if piece.text else {})
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": piece.finish_reason}
            if piece.tokens:
                choice["logprobs"] = self._logprobs(piece.tokens)
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": piece.text, "logprobs": None, "finish_reason": piece.finish_reason}
        if piece.tokens:
            choice["logprobs"] = self._logprobs(piece.tokens)
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        object_ = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(object_), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
