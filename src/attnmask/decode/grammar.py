"""Structured output: the answer's text held to a grammar, token by token (llguidance).

A :class:`Grammar` names what the text must be: any JSON object, JSON that follows a schema, a
regular expression, one of several strings, or a Lark / GBNF grammar. At each step a request's
:class:`Matcher` says which tokens may come next (a bit per vocabulary entry), the step sets the others'
logits to -inf before the choice, greedy or sampled, and the chosen token advances the matcher. When
the grammar is complete, only the end-of-sequence tokens are allowed (the request then stops).

The masks come from `llguidance <https://github.com/guidance-ai/llguidance>`_ (what llama.cpp, vLLM
and SGLang use for the same thing), built once per tokenizer from its Hugging Face ``tokenizer.json``
(:func:`grammar_tokenizer`). It is in the ``serve`` extra: ``pip install 'attnmask[serve]'``.

A row's mask depends only on its own request's tokens, so structured requests keep the engine's
guarantee: the same bits alone or in any batch. Log-probabilities stay the model's own (before the mask).

>>> g = Grammar.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}}})
>>> RequestParams(grammar=g, max_tokens=64)   # attnmask.engine; the engine needs a tokenizer
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnmask.errors import UserError

__all__ = ["Grammar", "Masked", "Matcher", "grammar_tokenizer", "mask_rows"]

KINDS = ("json", "json_schema", "regex", "choice", "lark")


def _llguidance():
    try:
        import llguidance
    except ImportError as err:  # an optional dependency (the serve extra)
        raise UserError("structured output needs llguidance: pip install 'attnmask[serve]'") from err
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What a request's text must be. Build one with :meth:`json_object`, :meth:`json_schema`,
    :meth:`regex`, :meth:`choice` or :meth:`lark`; :meth:`check` raises :class:`UserError` naming the
    problem when llguidance cannot compile it."""

    kind: str
    text: str  # the schema as JSON, the pattern, the choices as a JSON list, the grammar

    def __post_init__(self):
        if self.kind not in KINDS:
            raise UserError(f"grammar kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if not isinstance(self.text, str):
            raise UserError(f"a grammar's text must be a string; got {type(self.text).__name__}")

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json", '{"type": "object"}')

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Grammar:
        """JSON that follows ``schema`` (a JSON Schema, as a dict or its text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise UserError(f"the JSON schema is not valid JSON: {err}") from err
        if not isinstance(schema, dict):
            raise UserError(f"a JSON schema must be a JSON object; got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))  # its order kept: properties come in it

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text that matches ``pattern`` whole (Rust's ``regex`` syntax)."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> Grammar:
        """Exactly one of ``options``."""
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise UserError(f"choices must be a non-empty list of non-empty strings; got {options!r}")
        return cls("choice", json.dumps(options))

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """A context-free grammar in Lark syntax (llguidance's) or llama.cpp's GBNF."""
        return cls("lark", grammar)

    @functools.cached_property
    def compiled(self) -> str:
        """llguidance's grammar for this one."""
        llg = _llguidance()
        try:
            if self.kind in ("json", "json_schema"):
                return llg.LLMatcher.grammar_from_json_schema(self.text)
            if self.kind == "regex":
                return llg.LLMatcher.grammar_from_regex(self.text)
            return llg.grammar_from("choice" if self.kind == "choice" else "grammar", self.text)
        except ValueError as err:
            raise UserError(f"the {self.kind} grammar could not be read: {err}") from err

    def check(self) -> None:
        """Raise :class:`UserError` with llguidance's message when the grammar does not compile."""
        message = _llguidance().LLMatcher.validate_grammar(self.compiled)
        if message:
            raise UserError(f"the {self.kind} grammar is not valid: {' '.join(message.split())}")


class _Vocabulary:
    """A tokenizer as llguidance's ``TokenizerWrapper`` reads one: each id's bytes, the special ids, and
    ``encode``. For the tokenizers whose ``tokenizer.json`` llguidance cannot read itself (attnmask's
    character tokenizers)."""

    def __init__(self, tokenizer, eos: int):
        n = tokenizer.vocab_size
        specials = {i for i in range(n) if tokenizer.hf.id_to_token(i) in tokenizer.hf.get_added_tokens_decoder()
                    and tokenizer.hf.get_added_tokens_decoder()[i].special}  # fmt: skip
        self.tokens = [tokenizer.decode([i], skip_special=False).encode("utf-8") for i in range(n)]
        self.special_token_ids = sorted(specials)
        self.eos_token_id, self.bos_token_id = eos, getattr(tokenizer, "sos_id", None)
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


def _build_tokenizer(tokenizer, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]):
    llg = _llguidance()
    try:
        return llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))
    except ValueError:  # a decoder llguidance does not know: give it the vocabulary's bytes instead
        wrapped = llg.TokenizerWrapper(_Vocabulary(tokenizer, eos_ids[0]))
        return llg.LLTokenizer(wrapped, n_vocab=vocab_size, eos_token=list(eos_ids))


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids) -> Any:
    """llguidance's view of an attnmask tokenizer (its Hugging Face ``tokenizer.json``, or each id's bytes)
    over the model's ``vocab_size`` ids, ending a complete grammar with ``eos_ids``. Building one takes
    ~0.2 s (SmolLM2's 49,152 tokens): keep it (the engine builds it once)."""
    eos = tuple(sorted(int(i) for i in eos_ids))
    if not eos:
        raise UserError("structured output needs an end-of-sequence id (the engine's eos_ids)")
    return _build_tokenizer(tokenizer, tokenizer.hf.to_str(), int(vocab_size), eos)


class Matcher:
    """One request's place in its grammar: :meth:`fill` writes the allowed tokens' bits, :meth:`advance`
    takes the chosen token."""

    def __init__(self, grammar: Grammar, llg_tokenizer):
        llg = _llguidance()
        self._m = llg.LLMatcher(llg_tokenizer, grammar.compiled, log_level=0)
        if self._m.is_error():
            raise UserError(f"the {grammar.kind} grammar is not valid: {' '.join(self._m.get_error().split())}")

    def fill(self, bitmask: Tensor, row: int) -> None:
        """The allowed next tokens into ``bitmask[row]`` (int32 words, a bit per token)."""
        words = bitmask[row]  # (V/32,) int32, contiguous: llguidance writes it in place
        assert bitmask.dtype == torch.int32 and words.is_contiguous() and words.device.type == "cpu"
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def advance(self, token: int) -> bool:
        """Take ``token`` (one :meth:`fill` allowed); False when the matcher cannot (a grammar that needs
        text the vocabulary cannot write, as a character tokenizer without some character: see :attr:`error`)."""
        return bool(self._m.consume_token(token))

    @property
    def error(self) -> str:
        """Why the matcher stopped taking tokens, on one line ("" when it has not)."""
        if not self._m.is_error():
            return ""
        message = " ".join(self._m.get_error().split()).split(" <state>")[0]  # the parser's dump after it
        return message if len(message) <= 300 else message[:297] + "..."

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (a JSON schema's keys and punctuation), as the tokenizer
        writes them; empty when the next token is free."""
        return [] if self._m.is_error() else list(self._m.compute_ff_tokens())

    @property
    def done(self) -> bool:
        """The grammar is complete (its end-of-sequence token taken, or nothing more can follow)."""
        return self._m.is_stopped()


class Masked:
    """Rows of a logits tensor masked in place by :func:`mask_rows`; :meth:`restore` puts them back."""

    def __init__(self, logits: Tensor, rows: Tensor, before: Tensor):
        self.logits, self.rows, self.before = logits, rows, before

    def restore(self) -> None:
        with torch.inference_mode(self.logits.is_inference()):
            self.logits.index_copy_(0, self.rows, self.before)


_LANES = torch.arange(32, dtype=torch.int32)  # bit i of a mask word: token 32 w + i
_NEG_INF = int(torch.tensor(float("-inf")).view(torch.int32))  # -inf's bits


def mask_rows(logits: Tensor, rows: list[int], matchers: list[Matcher], *, restorable: bool = True) -> Masked | None:
    """Set each of ``rows``' disallowed tokens to -inf in place, each from its own matcher; returns what
    puts the rows back (with ``restorable``: a copy of the rows is saved first; else None).

    Branch-free (a random mask defeats ``masked_fill``'s branches: 1.5 ms for 16 rows of 49,152): each
    token's bit becomes the bits of 0.0 (allowed) or -inf, added to its logit."""
    R, V = len(rows), logits.shape[1]
    bitmask = torch.full((R, (V + 31) // 32), -1, dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.fill(bitmask, i)
    # (bit - 1) & bits(-inf): 0 -> -inf's bits, 1 -> 0 (0.0's bits)
    add = ((((bitmask[:, :, None] >> _LANES) & 1) - 1) & _NEG_INF).reshape(R, -1)[:, :V].view(torch.float32)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    with torch.inference_mode(logits.is_inference()):  # a step's logits may be inference tensors
        before = logits.index_select(0, index) if restorable else None  # (R, V)
        logits.index_add_(0, index, add.to(device=logits.device, dtype=logits.dtype))
    return Masked(logits, index, before) if restorable else None
