"""The linter: shape, dtype and polarity of raw mask tensors, checked where they enter the public API."""

from __future__ import annotations

import torch
from torch import Tensor

from attnmask.errors import UserError, UserTypeError

# Foreign additive masks use -inf, finfo.min, -1e9 or -1e4 for "blocked": anything at or below this
# counts as blocked when converting them (see from_additive).
BLOCK_THRESHOLD = -1e4


# ---------------------------------------------------------------------------------------------
# The linter: shape, dtype and polarity of raw tensors
# ---------------------------------------------------------------------------------------------
def _lint_bool_tensor(t, name: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise UserTypeError(f"{name} must be a torch.Tensor or attnmask Mask, got {type(t).__name__}")
    if t.dtype != torch.bool:
        if t.dtype.is_floating_point:
            raise UserTypeError(
                f"{name} has dtype {t.dtype}; attnmask masks are bool (True = may attend). "
                "For an additive 0/-inf mask use masks.from_additive(t)"
            )
        vals = torch.unique(t)
        if len(vals) <= 2 and set(vals.tolist()) <= {0, 1}:
            raise UserTypeError(
                f"{name} is a 0/1 {t.dtype} tensor of unknown polarity; expected bool with True = may "
                "attend. Use masks.from_hf(t) if 1 = attend, masks.from_tf(t) if 1 = blocked"
            )
        raise UserTypeError(f"{name} has dtype {t.dtype}; expected bool (True = may attend)")
    if t.dim() == 3:
        raise UserError(
            f"{name} has 3-D shape {tuple(t.shape)}: ambiguous. Expected 4-D (B, 1|H, Tq, Tk) or 2-D "
            f"(Tq, Tk); for a per-batch (B, Tq, Tk) mask use t.unsqueeze(1) -> "
            f"{(t.shape[0], 1, *t.shape[1:])}"
        )
    if t.dim() not in (2, 4):
        raise UserError(f"{name} has shape {tuple(t.shape)}; expected 4-D (B, 1|H, Tq, Tk) or 2-D (Tq, Tk)")
    if t.dim() == 4 and t.shape[1] != 1:
        raise UserError(
            f"{name} has per-head shape {tuple(t.shape)}; attnmask Mask objects are shared across heads "
            "(B, 1, Tq, Tk). Pass per-head tensors straight to attention() instead"
        )
    return t


def lint_polarity(t: Tensor, name: str = "mask") -> None:
    """Raise where ``attention`` would reject ``t``'s polarity, and on the one mistake a shape
    cannot show: a mask that is exactly an *inverted* causal mask.

    - bool: True strictly above the diagonal, the last query seeing nothing -- ``nn.MultiheadAttention``'s
      / TensorFlow's look-ahead mask (True = blocked) passed where attnmask expects True = may attend;
    - floating: an additive mask (0 = attend, -inf / finfo.min = blocked) whose allowed positions
      are exactly that pattern (0 above the diagonal, -inf on and below it); a float mask of only
      0 and 1 (unknown polarity) or of other values is a ValueError, as ``attention`` says;
    - integer: unknown polarity (TypeError, as ``attention`` says).

    Applied where users hand in raw tensors (:func:`from_tensor`, :func:`from_additive`, ``attention``),
    not to converters' outputs. Only square masks of 4 x 4 or more are judged for inversion, so that
    small hand-made masks are left alone. Reads the tensor on the host: a linter for where masks
    enter the API, not for a kernel's hot path. Returns None when nothing is wrong."""
    if not isinstance(t, Tensor):
        raise UserTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point:
        _lint_inverted(additive_to_bool(t), name, additive=True)  # additive_to_bool raises on 0/1 and soft values
    elif t.dtype == torch.bool:
        _lint_inverted(t, name, additive=False)
    else:
        _lint_bool_tensor(t, name)  # raises the dtype / polarity TypeError


def _lint_inverted(allowed: Tensor, name: str, *, additive: bool) -> None:
    """Raise when bool ``allowed`` (True = may attend) is exactly True above the diagonal."""
    n = allowed.shape[-1]
    if allowed.dim() < 2 or allowed.shape[-2] != n or n < 4:
        return
    future = torch.ones(n, n, dtype=torch.bool, device=allowed.device).triu(1)  # (T, T)
    if not torch.equal(allowed, future.expand_as(allowed)):
        return
    if additive:
        raise UserError(
            f"{name} of shape {tuple(allowed.shape)} is 0 (attend) exactly above the diagonal and -inf (blocked) on "
            "and below it: an inverted causal additive mask (0 where blocked)? attnmask's additive masks are "
            "0 = may attend, -inf = blocked: use masks.causal() (or masks.causal().to_additive(...))"
        )
    raise UserError(
        f"{name} of shape {tuple(allowed.shape)} is True exactly above the diagonal: an inverted causal "
        "mask (True = blocked, the nn.MultiheadAttention / TensorFlow convention)? attnmask masks are "
        "True = may attend: use masks.causal(), or masks.from_mha(t) to convert"
    )


def check_additive(t: Tensor, dtype: torch.dtype | None = None, name: str = "additive mask") -> None:
    """Raise if an additive mask cannot be represented in ``dtype`` (e.g. -1e9 in float16)."""
    if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise UserTypeError(f"{name} must be a floating tensor of 0 / -inf, got {got}")
    dtype = dtype or t.dtype
    finite = t[torch.isfinite(t)]
    if finite.numel() and finite.min().item() < torch.finfo(dtype).min:
        raise UserError(
            f"{name} holds {finite.min().item():g}, which overflows {dtype} (min {torch.finfo(dtype).min:g}); "
            f"use -inf or torch.finfo({dtype}).min instead of a magic number"
        )
    if torch.isnan(t).any():
        raise UserError(f"{name} contains NaN")


def additive_to_bool(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The bool form (True = may attend) of an additive mask of 0 (attend) and -inf, finfo.min or
    anything <= ``BLOCK_THRESHOLD`` (blocked), any shape. ``dtype`` is the dtype the scores will
    have; a value that overflows it is an error, and so is any other value (a soft bias, 0/1)."""
    check_additive(t, dtype)
    odd = (t != 0) & (t > BLOCK_THRESHOLD)
    if odd.any():
        if bool(((t == 0) | (t == 1)).all()):
            raise UserError(
                "additive mask holds only 0 and 1: a 0/1 mask of unknown polarity, not an additive one "
                "(expected 0 = attend, -inf / finfo.min = blocked). Use masks.from_hf(t) if 1 = attend, "
                "masks.from_tf(t) if 1 = blocked"
            )
        raise UserError(
            f"additive mask holds {t[odd][0].item():g}: expected only 0 (attend) and -inf / finfo.min "
            "(blocked); a soft bias is not a mask"
        )
    return t == 0
