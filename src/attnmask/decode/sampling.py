"""Choosing the next token from logits: greedy, temperature, top-k, top-p.

``temperature == 0`` is greedy decoding (seed 000, eq. 9: the softmax is monotonic, so the
arg-max of the logits is the most probable token). Randomness comes only from an explicit
``torch.Generator``, so a seed reproduces a sample.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ValueError for settings :func:`sample` cannot honour."""
    if not temperature >= 0.0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")


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


def sample(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next tokens ``(B,)`` from logits ``(B, V)``; ``temperature == 0`` takes the arg-max."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0.0:
        return logits.argmax(dim=-1)  # (B,)
    logits = filter_logits(logits.float() / temperature, top_k=top_k, top_p=top_p)  # (B, V)
    probs = logits.softmax(dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
