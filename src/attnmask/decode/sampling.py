"""Choosing the next token from logits: greedy, temperature, top-k, top-p; penalties and biases.

The settings travel as one frozen :class:`Sampling` object. ``temperature == 0`` is greedy
decoding (seed 000, eq. 9: the softmax is monotonic, so the arg-max of the logits is the most
probable token). Randomness comes only from an explicit ``torch.Generator``, so a seed reproduces
a sample.

:class:`Penalties` change a row's logits before the choice, from what the sequence holds already
(OpenAI's presence and frequency penalties, the repetition penalty of Hugging Face and vLLM) and from
the caller (``logit_bias``); :class:`TokenHistory` keeps what they read, a token at a time, and
:func:`penalize` applies them to one row.

Defaults: text generation (:func:`attnmask.decode.generate` and ``attnmask generate``) samples at
``temperature = DEFAULT_TEMPERATURE = 1.0``, the model's own distribution; the id-level loops
(:func:`attnmask.decode.stream`, :func:`attnmask.decode.generate_ids`) default to :data:`GREEDY`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from attnmask.errors import UserError, UserTypeError

DEFAULT_TEMPERATURE = 1.0  # the one default of the API and the CLI


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ValueError for settings :func:`sample` cannot honour."""
    if not temperature >= 0.0:  # also rejects NaN
        raise UserError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise UserError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise UserError(f"top_p must be in (0, 1] or None, got {top_p}")


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen; checked when built (ValueError for impossible settings).

    ``temperature`` 0 takes the arg-max (greedy); otherwise tokens are drawn from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most probable tokens and to the
    nucleus of mass ``top_p`` (None = no restriction), with ``generator`` as the only source of
    randomness (None = PyTorch's global generator).
    """

    temperature: float = DEFAULT_TEMPERATURE
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def of(cls, sampling: Sampling | None, default: Sampling | None = None, **keywords) -> Sampling:
        """``sampling``, or ``default`` (else ``Sampling()``) with ``keywords`` (temperature,
        top_k, top_p, generator) replaced: the older keyword spelling of the same settings.

        Raises TypeError for an unknown keyword or for both a ``Sampling`` and keywords.
        """
        unknown = set(keywords) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise UserTypeError(f"unexpected sampling keyword(s) {sorted(unknown)}")
        if sampling is not None:
            if keywords:
                raise UserTypeError(f"give sampling=Sampling(...) or the keywords {sorted(keywords)}, not both")
            if not isinstance(sampling, Sampling):
                raise UserTypeError(f"sampling must be a Sampling, got {type(sampling).__name__}")
            return sampling
        base = default if default is not None else cls()
        return dataclasses.replace(base, **keywords) if keywords else base


GREEDY = Sampling(temperature=0.0)


def filter_logits(logits: Tensor, *, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Set to ``-inf`` every logit outside the top ``k`` and outside the nucleus of mass ``p``.

    ``logits`` is ``(B, V)``. Top-p keeps the smallest set of most probable tokens whose
    probability reaches ``p`` (always at least the most probable one). Ties at the top-k border
    are all kept.
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V), (B, V)
        probs = sorted_logits.softmax(dim=-1)  # (B, V)
        # mass strictly before each token: a token is kept while that is still below p
        before = probs.cumsum(dim=-1) - probs  # (B, V)
        drop_sorted = before >= top_p  # (B, V); the first token has before == 0 and stays
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)  # (B, V) in vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: Tensor, sampling: Sampling | None = None, **keywords) -> Tensor:
    """Next tokens ``(B,)`` from logits ``(B, V)`` under ``sampling`` (default ``Sampling()``);
    the keywords ``temperature``, ``top_k``, ``top_p``, ``generator`` are accepted instead."""
    s = Sampling.of(sampling, **keywords)
    if s.greedy:
        # the first largest logit, as argmax, but max's reduction is about 2.5x faster on the CPU
        return logits.max(dim=-1).indices  # (B,)
    logits = filter_logits(logits.float() / s.temperature, top_k=s.top_k, top_p=s.top_p)  # (B, V)
    probs = logits.softmax(dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=s.generator).squeeze(-1)  # (B,)


MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-100, 100] (OpenAI's range)


@dataclass(frozen=True)
class Penalties:
    """What a sequence's own tokens and its caller do to its logits before the next token is chosen.

    - ``presence`` / ``frequency`` (OpenAI's, in [-2, 2]): each token generated so far loses
      ``presence`` once and ``frequency`` per time it was generated (the prompt does not count, as in
      OpenAI's API and vLLM);
    - ``repetition`` (Hugging Face's and vLLM's, > 0; 1 = off): each token of the prompt or generated
      so far has its logit divided by it where positive, multiplied where not;
    - ``logit_bias``: ``(token, bias)`` pairs, bias in [-100, 100], added to those tokens' logits
      (-100 in effect bans a token, 100 forces it).

    Applied in that order: the bias, then the repetition, presence and frequency penalties (vLLM's).
    Each reads only its own row and sequence, so a row's result does not depend on the batch.
    """

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        for name in ("presence", "frequency"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise UserError(
                    f"{name} penalty must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}"
                )
        if not isinstance(self.repetition, (int, float)) or not 0.0 < self.repetition < float("inf"):
            raise UserError(f"repetition penalty must be a number > 0 (1 = none), got {self.repetition!r}")
        tokens = [t for t, _ in self.logit_bias]
        if len(set(tokens)) != len(tokens):
            raise UserError(f"logit_bias names a token twice: {sorted(tokens)}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise UserError(f"logit_bias tokens must be token ids (ints >= 0), got {token!r}")
            if not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise UserError(f"a logit bias must be a number in [-100, 100], got {bias!r} for token {token}")

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.logit_bias)


NO_PENALTIES = Penalties()


class TokenHistory:
    """What :func:`penalize` reads of one sequence: its prompt's distinct tokens and how often each
    generated token came; :meth:`add` each generated token as it comes."""

    def __init__(self, prompt: list[int] | tuple[int, ...]):
        self.prompt = frozenset(int(t) for t in prompt)
        self.counts: dict[int, int] = {}

    def add(self, token: int) -> None:
        self.counts[token] = self.counts.get(token, 0) + 1


def penalize(row: Tensor, penalties: Penalties, history: TokenHistory) -> Tensor:
    """``row (V,)``'s logits under ``penalties`` for a sequence with ``history``: a new float32 row."""
    row = row.float().clone()  # (V,)
    device = row.device
    if penalties.logit_bias:
        ids = torch.tensor([t for t, _ in penalties.logit_bias], device=device)
        row[ids] += torch.tensor([b for _, b in penalties.logit_bias], dtype=torch.float32, device=device)
    if penalties.repetition != 1.0:
        seen = torch.tensor(sorted(history.prompt | history.counts.keys()), dtype=torch.long, device=device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / penalties.repetition, values * penalties.repetition)
    if (penalties.presence or penalties.frequency) and history.counts:
        ids = torch.tensor(list(history.counts), dtype=torch.long, device=device)
        counts = torch.tensor(list(history.counts.values()), dtype=torch.float32, device=device)
        row[ids] -= counts * penalties.frequency + penalties.presence
    return row
