"""Foreign conventions in and out, through named converters only, and the linter that rejects ambiguous tensors.

nn.MultiheadAttention (True = ignore), additive 0/-inf, Hugging Face 2-D 0/1, TensorFlow (1 = blocked).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnmask.errors import UserError, UserTypeError
from attnmask.masks.core import And, Mask, TensorMask
from attnmask.masks.lint import _lint_inverted, additive_to_bool, check_additive
from attnmask.masks.structured import KeyPadding, padding


def from_additive(t: Tensor, dtype: torch.dtype | None = None) -> TensorMask:
    """From an additive mask ``(Tq, Tk)`` or ``(B, 1, Tq, Tk)`` (0 = attend; -inf, finfo.min or
    <= -1e4 = blocked). ``dtype`` is the dtype the scores will have; a value that overflows it is an
    error (e.g. -1e9 for float16), and so is an inverted causal mask (0 where blocked, see
    :func:`lint_polarity`)."""
    allowed = additive_to_bool(t, dtype)
    _lint_inverted(allowed, "additive mask", additive=True)
    return TensorMask(allowed)


def to_mha(mask: Mask, batch_size: int, q_len: int, kv_len: int, num_heads: int) -> Tensor:
    """For ``nn.MultiheadAttention(attn_mask=...)``: bool ``(B*num_heads, Tq, Tk)``, True = *ignore*."""
    if not isinstance(num_heads, int) or num_heads < 1:
        raise UserError(f"num_heads must be an int >= 1, got {num_heads!r}")
    allowed = mask.to_bool(batch_size, q_len, kv_len)  # (B, 1, Tq, Tk)
    blocked = (~allowed).expand(batch_size, num_heads, q_len, kv_len)  # (B, H, Tq, Tk)
    return blocked.reshape(batch_size * num_heads, q_len, kv_len)  # (B*H, Tq, Tk)


def from_mha(
    attn_mask: Tensor | None = None, key_padding_mask: Tensor | None = None, *, num_heads: int | None = None
) -> Mask:
    """From ``nn.MultiheadAttention`` conventions (bool, True = ignore; or float additive).

    ``attn_mask`` is ``(Tq, Tk)``, or ``(B*num_heads, Tq, Tk)`` with ``num_heads`` given and the
    same mask in every head (an attnmask Mask is shared across heads); ``key_padding_mask`` is
    ``(B, Tk)``.
    """
    parts: list[Mask] = []
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor) or not (
            attn_mask.dtype == torch.bool or attn_mask.dtype.is_floating_point
        ):
            got = attn_mask.dtype if isinstance(attn_mask, Tensor) else type(attn_mask).__name__
            raise UserTypeError(
                f"nn.MultiheadAttention attn_mask must be bool (True = ignore) or float additive, got {got}"
            )
        allowed = ~attn_mask if attn_mask.dtype == torch.bool else None
        if attn_mask.dim() == 3:
            if num_heads is None:
                raise UserError(
                    f"attn_mask has 3-D shape {tuple(attn_mask.shape)}; nn.MultiheadAttention's 3-D masks are "
                    "(B*num_heads, Tq, Tk): pass num_heads= to split them"
                )
            N, Tq, Tk = attn_mask.shape
            if N % num_heads:
                raise UserError(f"attn_mask has {N} rows, expected a multiple of num_heads={num_heads} (B*num_heads)")
            per_head = attn_mask.reshape(N // num_heads, num_heads, Tq, Tk)  # (B, H, Tq, Tk)
            if not torch.equal(per_head, per_head[:, :1].expand_as(per_head)):
                raise UserError("attn_mask differs between heads; an attnmask Mask is the same in every head")
            attn_mask = per_head[:, :1]  # (B, 1, Tq, Tk)
            allowed = ~attn_mask if attn_mask.dtype == torch.bool else None
        elif attn_mask.dim() != 2:
            raise UserError(f"attn_mask has shape {tuple(attn_mask.shape)}, expected (Tq, Tk) or (B*num_heads, Tq, Tk)")
        parts.append(from_additive(attn_mask) if allowed is None else TensorMask(allowed))
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor):
            raise UserTypeError(f"key_padding_mask must be a tensor (B, Tk), got {type(key_padding_mask).__name__}")
        if key_padding_mask.dtype.is_floating_point:
            check_additive(key_padding_mask, name="key_padding_mask")
            keep = key_padding_mask == 0
        elif key_padding_mask.dtype == torch.bool:
            keep = ~key_padding_mask
        else:
            raise UserTypeError(f"key_padding_mask must be bool (True = ignore) or float, got {key_padding_mask.dtype}")
        parts.append(padding(keep=keep))
    if not parts:
        raise UserError("from_mha needs attn_mask and/or key_padding_mask")
    return parts[0] if len(parts) == 1 else And(*parts)


def from_hf(attention_mask: Tensor) -> KeyPadding:
    """From a Hugging Face 2-D attention mask ``(B, T)`` of 0/1 (1 = real token, attend)."""
    t = torch.as_tensor(attention_mask)
    if t.dim() != 2:
        raise UserError(f"Hugging Face attention_mask must be 2-D (B, T) of 0/1, got shape {tuple(t.shape)}")
    bad = (t != 0) & (t != 1)
    if bad.any():
        raise UserError(f"Hugging Face attention_mask must hold only 0/1, got {t[bad][0].item()!r}")
    return padding(keep=t.bool())


def to_hf(mask: KeyPadding, batch_size: int, seq_len: int) -> Tensor:
    """To a Hugging Face 2-D attention mask ``(B, T)`` long, 1 = attend. Needs a key-padding mask."""
    if not isinstance(mask, KeyPadding):
        raise UserTypeError(f"to_hf converts key-padding masks only (Hugging Face 2-D masks cannot express {mask!r})")
    allowed = mask.to_bool(batch_size, 1, seq_len)  # (B, 1, 1, T)
    return allowed[:, 0, 0, :].long()


def from_tf(t: Tensor) -> TensorMask:
    """From a TensorFlow-style attention mask, 1 = blocked: ``(Tq, Tk)`` or ``(B, 1, Tq, Tk)``
    (``(B, 1, 1, Tk)`` for the TensorFlow tutorial's padding mask).

    For a ``(B, T)`` padding mask (1 = pad) use :func:`from_tf_padding`.
    """
    t = torch.as_tensor(t)
    bad = (t != 0) & (t != 1)
    if bad.any():
        raise UserError(f"TensorFlow mask must hold only 0/1 (1 = blocked), got {t[bad][0].item()!r}")
    return TensorMask(t == 0)


def from_tf_padding(t: Tensor) -> KeyPadding:
    """From a TensorFlow-style padding mask ``(B, T)``, 1 = pad (blocked)."""
    t = torch.as_tensor(t)
    if t.dim() != 2:
        raise UserError(f"TensorFlow padding mask must be (B, T), got {tuple(t.shape)}")
    return padding(keep=from_tf(t).tensor)


def to_tf(mask: Mask, batch_size: int, q_len: int, kv_len: int) -> Tensor:
    """To a TensorFlow-style float mask ``(B, 1, Tq, Tk)``: 1.0 = blocked, 0.0 = attend."""
    return (~mask.to_bool(batch_size, q_len, kv_len)).float()
