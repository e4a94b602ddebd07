"""Choosing the next token from logits: greedy, temperature, top-k, top-p.

The settings travel as one frozen :class:`Sampling` object. ``temperature == 0`` is greedy
decoding (seed 000, eq. 9: the softmax is monotonic, so the arg-max of the logits is the most
probable token). Randomness comes only from an explicit ``torch.Generator``, so a seed reproduces
a sample.

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
