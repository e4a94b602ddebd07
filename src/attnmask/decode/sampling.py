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
from attnmask.ops import decoding

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
        return decoding.first_largest(logits)  # (B,): each row's first largest logit, as max(dim=-1)
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
        self._in_prompt = frozenset(int(t) for t in prompt)
        self.prompt = sorted(self._in_prompt)  # the prompt's distinct tokens
        self.counts: dict[int, int] = {}  # generated token -> times
        self.fresh: list[int] = []  # generated tokens not in the prompt, each once

    def add(self, token: int) -> None:
        if token not in self.counts and token not in self._in_prompt:
            self.fresh.append(token)
        self.counts[token] = self.counts.get(token, 0) + 1


class Penalized:
    """Rows of a logits tensor changed in place by :func:`penalize_rows`; :meth:`restore` puts the model's
    own values back (exactly: the changed entries were saved)."""

    def __init__(self, logits: Tensor, where: tuple[Tensor, Tensor], saved: Tensor):
        self.logits, self.where, self.saved = logits, where, saved

    def restore(self) -> None:
        with torch.inference_mode(self.logits.is_inference()):  # a step's logits may be inference tensors
            self.logits.index_put_(self.where, self.saved)


def penalize_rows(
    logits: Tensor, rows: list[int], penalties: list[Penalties], histories: list[TokenHistory],
    banned: list[tuple[int, ...]] | None = None,
) -> Penalized:  # fmt: skip
    """Apply each of ``rows``' penalties to ``logits (R, V)`` in place, from that row's own history, and
    set its ``banned`` tokens to -inf; returns what restores the rows.

    Every changed entry is computed from that entry alone (bias added, then the repetition penalty,
    then the frequency and presence penalties, in float32), in one indexed operation per kind for all
    rows: a row's values are the same bits whatever rows are beside it.
    """
    bias_r, bias_t, bias_v = [], [], []
    rep_r, rep_t, rep_p = [], [], []
    pen_r, pen_t, pen_c, pen_f, pen_p = [], [], [], [], []
    ban_r, ban_t = [], []
    for i, (r, p, h) in enumerate(zip(rows, penalties, histories)):
        for t, b in p.logit_bias:
            bias_r.append(r), bias_t.append(t), bias_v.append(b)
        if p.repetition != 1.0:
            seen = h.prompt + h.fresh
            rep_r += [r] * len(seen)
            rep_t += seen
            rep_p += [p.repetition] * len(seen)
        if (p.presence or p.frequency) and h.counts:
            n = len(h.counts)
            pen_r += [r] * n
            pen_t += h.counts.keys()
            pen_c += h.counts.values()
            pen_f += [p.frequency] * n
            pen_p += [p.presence] * n
        for t in banned[i] if banned is not None else ():
            ban_r.append(r), ban_t.append(t)
    with torch.inference_mode(logits.is_inference()):  # a step's logits may be inference tensors
        return _penalize_rows(logits, (bias_r, bias_t, bias_v), (rep_r, rep_t, rep_p),
                              (pen_r, pen_t, pen_c, pen_f, pen_p), (ban_r, ban_t))  # fmt: skip


def _penalize_rows(logits: Tensor, bias, rep, pen, ban) -> Penalized:
    """:func:`penalize_rows`'s indexed operations, from its lists of (row, token, value...) entries."""
    (bias_r, bias_t, bias_v), (rep_r, rep_t, rep_p), (pen_r, pen_t, pen_c, pen_f, pen_p), (ban_r, ban_t) = (
        bias,
        rep,
        pen,
        ban,
    )
    device = logits.device
    index = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    number = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)  # noqa: E731
    where = (index(bias_r + rep_r + pen_r + ban_r), index(bias_t + rep_t + pen_t + ban_t))
    saved = logits[where]  # (n,) the model's own values, to restore
    if bias_r:
        at = (index(bias_r), index(bias_t))
        logits[at] = (logits[at].float() + number(bias_v)).to(logits.dtype)
    if rep_r:
        at = (index(rep_r), index(rep_t))
        values, p = logits[at].float(), number(rep_p)
        logits[at] = torch.where(values > 0, values / p, values * p).to(logits.dtype)
    if pen_r:
        at = (index(pen_r), index(pen_t))
        logits[at] = (logits[at].float() - (number(pen_c) * number(pen_f) + number(pen_p))).to(logits.dtype)
    if ban_r:
        logits[index(ban_r), index(ban_t)] = float("-inf")
    return Penalized(logits, where, saved)


def penalize(row: Tensor, penalties: Penalties, history: TokenHistory) -> Tensor:
    """``row (V,)``'s logits under ``penalties`` for a sequence with ``history``: a new float32 row
    (:func:`penalize_rows` on a copy)."""
    out = row.float().clone()[None]  # (1, V)
    penalize_rows(out, [0], [penalties], [history])
    return out[0]
