"""The linter: shape, dtype and polarity of raw mask tensors, checked where they enter the public API."""

from __future__ import annotations

import torch
from torch import Tensor

# Foreign additive masks use -inf, finfo.min, -1e9 or -1e4 for "blocked": anything at or below this
# counts as blocked when converting them (see from_additive).
BLOCK_THRESHOLD = -1e4


# ---------------------------------------------------------------------------------------------
# The linter: shape, dtype and polarity of raw tensors
# ---------------------------------------------------------------------------------------------
def _lint_bool_tensor(t, name: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or attnmask Mask, got {type(t).__name__}")
    if t.dtype != torch.bool:
        if t.dtype.is_floating_point:
            raise TypeError(
                f"{name} has dtype {t.dtype}; attnmask masks are bool (True = may attend). "
                "For an additive 0/-inf mask use masks.from_additive(t)"
            )
        vals = torch.unique(t)
        if len(vals) <= 2 and set(vals.tolist()) <= {0, 1}:
            raise TypeError(
                f"{name} is a 0/1 {t.dtype} tensor of unknown polarity; expected bool with True = may "
                "attend. Use masks.from_hf(t) if 1 = attend, masks.from_tf(t) if 1 = blocked"
            )
        raise TypeError(f"{name} has dtype {t.dtype}; expected bool (True = may attend)")
    if t.dim() == 3:
        raise ValueError(
            f"{name} has 3-D shape {tuple(t.shape)}: ambiguous. Expected 4-D (B, 1|H, Tq, Tk) or 2-D "
            f"(Tq, Tk); for a per-batch (B, Tq, Tk) mask use t.unsqueeze(1) -> "
            f"{(t.shape[0], 1, *t.shape[1:])}"
        )
    if t.dim() not in (2, 4):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected 4-D (B, 1|H, Tq, Tk) or 2-D (Tq, Tk)")
    if t.dim() == 4 and t.shape[1] != 1:
        raise ValueError(
            f"{name} has per-head shape {tuple(t.shape)}; attnmask Mask objects are shared across heads "
            "(B, 1, Tq, Tk). Pass per-head tensors straight to attention() instead"
        )
    return t


def lint_polarity(t: Tensor, name: str = "mask") -> None:
    """Raise on a bool mask that is exactly an *inverted* causal mask (True strictly above the
    diagonal, the last query seeing nothing): ``nn.MultiheadAttention``'s / TensorFlow's look-ahead
    mask (True = blocked) passed where attnmask expects True = may attend. Applied where users hand
    in raw bool tensors (:func:`from_tensor`, ``attention``), not to converters' outputs. Only
    square masks of 4 x 4 or more are judged, so that small hand-made masks are left alone."""
    n = t.shape[-1]
    if t.dim() < 2 or t.shape[-2] != n or n < 4:
        return
    future = torch.ones(n, n, dtype=torch.bool, device=t.device).triu(1)  # (T, T)
    if torch.equal(t, future.expand_as(t)):
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} is True exactly above the diagonal: an inverted causal "
            "mask (True = blocked, the nn.MultiheadAttention / TensorFlow convention)? attnmask masks are "
            "True = may attend: use masks.causal(), or masks.from_mha(t) to convert"
        )


def check_additive(t: Tensor, dtype: torch.dtype | None = None, name: str = "additive mask") -> None:
    """Raise if an additive mask cannot be represented in ``dtype`` (e.g. -1e9 in float16)."""
    if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{name} must be a floating tensor of 0 / -inf, got {got}")
    dtype = dtype or t.dtype
    finite = t[torch.isfinite(t)]
    if finite.numel() and finite.min().item() < torch.finfo(dtype).min:
        raise ValueError(
            f"{name} holds {finite.min().item():g}, which overflows {dtype} (min {torch.finfo(dtype).min:g}); "
            f"use -inf or torch.finfo({dtype}).min instead of a magic number"
        )
    if torch.isnan(t).any():
        raise ValueError(f"{name} contains NaN")


def additive_to_bool(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The bool form (True = may attend) of an additive mask of 0 (attend) and -inf, finfo.min or
    anything <= ``BLOCK_THRESHOLD`` (blocked), any shape. ``dtype`` is the dtype the scores will
    have; a value that overflows it is an error, and so is any other value (a soft bias, 0/1)."""
    check_additive(t, dtype)
    odd = (t != 0) & (t > BLOCK_THRESHOLD)
    if odd.any():
        if bool(((t == 0) | (t == 1)).all()):
            raise ValueError(
                "additive mask holds only 0 and 1: a 0/1 mask of unknown polarity, not an additive one "
                "(expected 0 = attend, -inf / finfo.min = blocked). Use masks.from_hf(t) if 1 = attend, "
                "masks.from_tf(t) if 1 = blocked"
            )
        raise ValueError(
            f"additive mask holds {t[odd][0].item():g}: expected only 0 (attend) and -inf / finfo.min "
            "(blocked); a soft bias is not a mask"
        )
    return t == 0
