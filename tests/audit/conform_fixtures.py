"""Known-bad attention kernels, registered with transformers' AttentionInterface the way a team
registers its own: each reproduces one bug class that conformance must catch and name.

- ``wide_window``: the sliding window one key too wide (FlashAttention-2's window off by one);
- ``narrow_window``: the sliding window one key too narrow;
- ``pad_leak``: the padding factor dropped from the mask, so left pads leak into real rows;
- ``pack_leak``: the packed-sequence (block-diagonal) factor dropped: samples see each other;
- ``topleft_cache``: ``is_causal=True`` whenever queries and keys differ in length, which SDPA
  aligns top-left: with a cache, a new token sees only the first key (cache != no cache);
- ``clean_sdpa``: plain SDPA under a new name, which must pass everything.

Each kernel receives transformers' SDPA-style boolean mask ``(B, 1, Tq, Tk)`` (True = may attend,
or None for plain causal) because :func:`registered` also registers ``sdpa_mask`` for its name.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


def _attend(module, query, key, value, mask, *, is_causal: bool, scaling):
    """SDPA over ``(B, H, T, D)`` with grouped key/value heads repeated; returns ``(B, Tq, H, D)``."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)  # (B, H, Tk, D)
    value = value.repeat_interleave(groups, dim=1)  # (B, H, Tk, D)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None  # (B, Tq, H, D)


def _causal(Tq: int, Tk: int, device) -> torch.Tensor:
    q = torch.arange(Tq, device=device)[:, None] + (Tk - Tq)  # bottom-right: the last query sees every key
    return torch.arange(Tk, device=device)[None, :] <= q  # (Tq, Tk)


def _kernel(rewrite):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        Tq, Tk = query.shape[2], key.shape[2]
        if attention_mask is None:
            return _attend(module, query, key, value, None, is_causal=Tq > 1, scaling=scaling)
        mask = rewrite(attention_mask.bool(), Tq, Tk)  # (B, 1, Tq, Tk)
        return _attend(module, query, key, value, mask, is_causal=False, scaling=scaling)

    return attention


def _wide_window(mask, Tq, Tk):
    real_key = mask.any(-2, keepdim=True)  # (B, 1, 1, Tk): keys some query may see
    older = torch.zeros_like(mask)
    older[..., :-1] = mask[..., 1:]  # key j allowed where key j + 1 is: one more key at the window's tail
    return mask | (older & real_key)


def _narrow_window(mask, Tq, Tk):
    newer = torch.ones_like(mask)
    newer[..., 1:] = mask[..., :-1]  # key j kept where key j - 1 is allowed too: the window's tail cut off
    return mask & newer


def _pad_leak(mask, Tq, Tk):
    return _causal(Tq, Tk, mask.device).expand_as(mask)  # the padding factor forgotten


def _pack_leak(mask, Tq, Tk):
    real_key = mask.any(-2, keepdim=True)  # padding kept, the block-diagonal factor forgotten
    return _causal(Tq, Tk, mask.device) & real_key


def _topleft_cache(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    Tq, Tk = query.shape[2], key.shape[2]
    if Tq != Tk:  # decoding with a cache: SDPA's is_causal aligns top-left, so token t sees key 0 only
        return _attend(module, query, key, value, None, is_causal=True, scaling=scaling)
    mask = None if attention_mask is None else attention_mask.bool()
    return _attend(module, query, key, value, mask, is_causal=mask is None and Tq > 1, scaling=scaling)


KERNELS = {
    "wide_window": _kernel(_wide_window),
    "narrow_window": _kernel(_narrow_window),
    "pad_leak": _kernel(_pad_leak),
    "pack_leak": _kernel(_pack_leak),
    "topleft_cache": _topleft_cache,
    "clean_sdpa": _kernel(lambda mask, Tq, Tk: mask),
}


@contextlib.contextmanager
def registered(*names: str):
    """Register the named kernels (and ``sdpa_mask`` for them) for the duration of the block."""
    for name in names:
        AttentionInterface.register(name, KERNELS[name])
        AttentionMaskInterface.register(name, sdpa_mask)
    try:
        yield
    finally:
        for name in names:
            AttentionInterface._global_mapping.pop(name, None)
            AttentionMaskInterface._global_mapping.pop(name, None)
