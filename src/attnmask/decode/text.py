"""Text in, text out: :func:`translate` and :func:`generate` on top of the decoding loop (the packed step)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator, Sequence

import torch

from attnmask.data.tokenizer import EOS_ID, SOS_ID
from attnmask.decode.grammar import Grammar, Matcher, grammar_tokenizer
from attnmask.decode.sampling import NO_PENALTIES, Penalties, Sampling
from attnmask.decode.steps import (
    DEFAULT_NEW_TOKENS,
    _check_length,
    _steps,
    default_max_new_tokens,
    greedy,
    source_ids,
    stop_set,
)
from attnmask.errors import UserError


# ---------------------------------------------------------------------------------------------
# Text in, text out
# ---------------------------------------------------------------------------------------------
def translate(
    model,
    src_tokenizer,
    tgt_tokenizer,
    sentences: Sequence[str],
    *,
    beam: int = 1,
    max_len: int | None = None,
    batch_size: int = 64,
    length_penalty: float = 1.0,
    progress: bool = False,
) -> list[str]:
    """Translate ``sentences`` (in their order) with greedy decoding (``beam=1``) or beam search.

    Sentences are batched by length (longest first); ``max_len`` limits the generated tokens per
    sentence (default :func:`~attnmask.decode.steps.default_max_new_tokens` of its source, so a
    sentence's translation does not depend on its batch).

    ``progress``: a bar on stderr, when stderr is a terminal.

    Raises ValueError for a source longer than the model's maximum, TypeError for a non-string.
    """
    from attnmask.decode.beam import beam_search, best_tokens  # beam builds on this module

    if not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch_size must be an int >= 1, got {batch_size!r}")
    sentences = list(sentences)
    ids = source_ids(src_tokenizer, sentences)
    model_max = model.config.max_seq_len
    for i, s in enumerate(ids):
        _check_length(len(s), f"sentence {i + 1} (with <eos>)", model_max)
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    out: list[str] = [""] * len(ids)
    bar = None
    if progress:
        from tqdm import tqdm

        # a text bar on a terminal only: redirected to a file it would write a "\r" line per batch
        bar = tqdm(total=len(ids), unit="sent", desc="translate", leave=False, disable=not sys.stderr.isatty())
    for first in range(0, len(order), batch_size):
        chunk = order[first : first + batch_size]
        src = [ids[i] for i in chunk]
        limits = [max_len or default_max_new_tokens(len(s), model_max) for s in src]
        if beam == 1:
            hyps = greedy(model, src=src, max_new_tokens=limits)
        else:
            results = beam_search(model, src=src, beam_size=beam, max_new_tokens=limits, length_penalty=length_penalty)
            hyps = best_tokens(results)
        for i, h in zip(chunk, hyps):
            out[i] = tgt_tokenizer.decode(h)
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return out


class _TextStream:
    """Turns a growing list of ids into new text pieces, holding back incomplete characters."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a byte-level token split a UTF-8 character: wait for the rest
            return ""
        return self.flush(text)

    def flush(self, text: str | None = None) -> str:
        text = self.tokenizer.decode(self.ids) if text is None else text
        piece, self.sent = text[self.sent :], len(text)
        return piece


def generate(
    model,
    tokenizer,
    prompts: str | Sequence[str],
    *,
    max_new_tokens: int = DEFAULT_NEW_TOKENS,
    sampling: Sampling | None = None,
    seed: int | None = None,
    stream: bool = False,
    eos_id: int | None = None,
    penalties: Penalties | None = None,
    grammar: Grammar | None = None,
    **sampling_keywords,
):
    """Continue text prompt(s) with a decoder-only model.

    Returns the continuation (a ``str`` for one prompt, a list for a list), or with ``stream=True``
    an iterator of text pieces as tokens arrive (``str`` pieces for one prompt, one list of pieces
    per step for a list). ``sampling`` defaults to ``Sampling()``
    (temperature 1.0, the same default as ``attnmask generate``); the keywords ``temperature``,
    ``top_k``, ``top_p`` are accepted instead, and ``temperature=0`` is greedy. ``seed`` makes
    sampling reproducible (a generator of its own; or pass ``Sampling(generator=...)``).
    ``eos_id`` (one id or several) defaults to the tokenizer's ``stop_ids`` if it has them (chat
    models), else its ``eos_id``. ``penalties``: presence, frequency and repetition penalties and a
    logit bias (:class:`~attnmask.decode.sampling.Penalties`), each prompt's from its own tokens.
    ``grammar``: what each continuation must be (:class:`~attnmask.decode.grammar.Grammar`: JSON, a JSON
    schema, a regex, a choice, a Lark grammar; structured output, needs llguidance); a continuation ends
    when its grammar is complete.

    Raises ValueError for an empty prompt or one longer than the model's maximum.
    """
    single = isinstance(prompts, str)
    texts = [prompts] if single else list(prompts)
    if not texts:
        raise UserError("no prompts given; expected at least one")
    ids = [tokenizer.encode(t) for t in texts]
    for i, p in enumerate(ids):
        if not p:
            raise UserError(f"prompt {i + 1} is empty; expected some text to continue")
        _check_length(len(p), f"prompt {i + 1}", model.config.max_seq_len)
    settings = Sampling.of(sampling, **sampling_keywords)
    if seed is not None:
        if settings.generator is not None:
            raise UserError("give seed= or Sampling(generator=...), not both")
        generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
        settings = dataclasses.replace(settings, generator=generator)
    eos = eos_id
    if eos is None:
        eos = getattr(tokenizer, "stop_ids", None) or getattr(tokenizer, "eos_id", EOS_ID)
    matchers = None
    if grammar is not None:
        stop_ids = sorted(stop_set(eos))
        llg = grammar_tokenizer(tokenizer, model.config.vocab_size, stop_ids)
        matchers = [Matcher(grammar, llg) for _ in ids]
    steps = _steps(
        model,
        src=None,
        prompts=ids,
        max_new_tokens=max_new_tokens,
        sampling=settings,
        eos_id=eos,
        sos_id=SOS_ID,
        penalties=penalties or NO_PENALTIES,
        matchers=matchers,
    )
    pieces = _text_pieces(steps, tokenizer, len(texts), stop_set(eos))
    if stream:
        return (p[0] for p in pieces) if single else pieces
    parts = [[] for _ in texts]
    for step in pieces:
        for r, piece in enumerate(step):
            parts[r].append(piece)
    out = ["".join(p) for p in parts]
    return out[0] if single else out


def _text_pieces(steps, tokenizer, n: int, stops: frozenset[int]) -> Iterator[list[str]]:
    streams = [_TextStream(tokenizer) for _ in range(n)]
    for _, rows, tokens in steps:
        pieces = [""] * n
        for r, t in zip(rows.tolist(), tokens.tolist()):
            if t not in stops:
                pieces[r] = streams[r].push(t)
        yield pieces
    tail = [s.flush() for s in streams]  # whatever an unfinished character held back
    if any(tail):
        yield tail
