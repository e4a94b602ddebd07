"""Masked multi-head attention with pluggable backends.

Shape legend (used in every comment of this package)::

    B   batch                 H    query heads          Hkv  key/value heads (H % Hkv == 0)
    Tq  query length          Tk   key/value length     D    head dim
    C   model dim             V    vocabulary

``attention(q, k, v, mask)`` computes ``softmax(QKᵀ/√D + M) V`` in every head, where ``M`` is the
additive form of a boolean mask (True = may attend, see :mod:`attnmask.masks`). Query rows that may
attend to nothing give **zero output and zero gradient**, never NaN, on every backend and dtype.

Backends live in a registry (:data:`BACKENDS`); models never name a kernel, so a faster one can
be added with :func:`register_backend` without touching them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnmask import masks as M

__all__ = [
    "attention",
    "prepare_mask",
    "PreparedMask",
    "MultiHeadAttention",
    "BACKENDS",
    "register_backend",
]


# ---------------------------------------------------------------------------------------------
# Masks as a kernel sees them
# ---------------------------------------------------------------------------------------------
@dataclass
class PreparedMask:
    """A mask resolved for one problem size, built once per forward and shared by every layer.

    Exactly one of: ``allowed`` is None and ``is_causal`` False (no mask); ``is_causal`` True (pure
    top-left causal, Tq == Tk, nothing else masked: SDPA's fast path); ``allowed`` a bool tensor
    broadcastable to ``(B, H, Tq, Tk)``. ``empty_rows`` is a bool ``(B, 1|H, Tq, 1)`` of query rows
    that may attend to nothing, or None when there are none.
    """

    allowed: Tensor | None = None
    is_causal: bool = False
    empty_rows: Tensor | None = None
    q_len: int = 0
    kv_len: int = 0

    def dense(self, device=None) -> Tensor | None:
        """The bool mask as a tensor (materializing the causal fast path if needed)."""
        if self.is_causal:
            return (
                torch.ones(self.q_len, self.kv_len, dtype=torch.bool, device=device)
                .tril()
                .view(1, 1, self.q_len, self.kv_len)
            )
        return self.allowed


def prepare_mask(
    mask,
    batch_size: int,
    num_heads: int,
    q_len: int,
    kv_len: int,
    *,
    q_offset: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> PreparedMask:
    """Lint and resolve ``mask`` (None, a :class:`~attnmask.masks.Mask`, a bool tensor with
    True = may attend, or an additive float tensor of 0/-inf) for a ``(B, H, Tq, Tk)`` problem."""
    if isinstance(mask, PreparedMask):
        return mask
    if mask is None:
        return PreparedMask(q_len=q_len, kv_len=kv_len)
    if isinstance(mask, M.Mask):
        parts = mask.parts()
        if len(parts) == 1 and isinstance(parts[0], M.Causal) and q_len == kv_len and q_offset == 0:
            return PreparedMask(is_causal=True, q_len=q_len, kv_len=kv_len)
        allowed = mask.to_bool(batch_size, q_len, kv_len, q_offset, device=device)  # (B, 1, Tq, Tk)
    elif isinstance(mask, Tensor):
        allowed = _lint_tensor(mask, batch_size, num_heads, q_len, kv_len, device, dtype)
    else:
        raise TypeError(
            f"mask must be None, an attnmask Mask, or a tensor (bool True = may attend, or additive float), "
            f"got {type(mask).__name__}"
        )
    if device is not None and allowed.device != torch.device(device):
        allowed = allowed.to(device)
    empty = ~allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, Tq|1, 1)
    return PreparedMask(allowed=allowed, empty_rows=empty if bool(empty.any()) else None, q_len=q_len, kv_len=kv_len)


def _lint_tensor(t: Tensor, B: int, H: int, Tq: int, Tk: int, device, dtype) -> Tensor:
    expected = f"(B={B}, H={H} or 1, Tq={Tq}, Tk={Tk})"
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"mask is on {t.device} but the queries are on {torch.device(device)}; move it with .to()")
    if t.dim() == 3:
        raise ValueError(
            f"mask has 3-D shape {tuple(t.shape)}: ambiguous. Expected 4-D {expected} or 2-D (Tq, Tk); "
            f"for a per-batch (B, Tq, Tk) mask use mask.unsqueeze(1)"
        )
    if t.dim() not in (2, 4):
        raise ValueError(f"mask has shape {tuple(t.shape)}, expected 4-D {expected} or 2-D (Tq, Tk)")
    shape4 = t.shape if t.dim() == 4 else (1, 1, *t.shape)
    for got, want, name in zip(shape4, (B, H, Tq, Tk), ("B", "H", "Tq", "Tk")):
        if got not in (1, want):
            raise ValueError(f"mask has shape {tuple(t.shape)}, expected broadcastable to {expected} ({name} differs)")
    if t.dtype == torch.bool:
        allowed = t
    elif t.dtype.is_floating_point:
        allowed = M.from_additive(t, dtype).tensor if t.dim() != 4 or t.shape[1] == 1 else None
        if allowed is None:  # per-head additive: check values the same way, keep heads
            M.check_additive(t, dtype)
            allowed = t == 0
    else:
        M._lint_bool_tensor(t, "mask")  # raises the polarity error
        raise AssertionError("unreachable")
    return allowed.view(shape4)


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------
Backend = Callable[..., tuple[Tensor, Tensor | None]]
BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, fn: Backend) -> None:
    """Add a kernel: ``fn(q, k, v, pm: PreparedMask, *, scale, dropout_p, return_weights) -> (out, w)``.

    q is ``(B, H, Tq, D)`` and k, v are ``(B, Hkv, Tk, D)``; the backend must honour grouped-query
    heads and return zero for ``pm.empty_rows``.
    """
    BACKENDS[name] = fn


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return x
    B, Hkv, T, D = x.shape
    return x[:, :, None].expand(B, Hkv, groups, T, D).reshape(B, Hkv * groups, T, D)  # (B, H, T, D)


def _reference(q, k, v, pm: PreparedMask, *, scale, dropout_p, return_weights):
    """The seeds' formula written out: ``softmax(QKᵀ/√D + M) V`` with an additive 0/-inf mask."""
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)  # (B, H, Tk, D)
    scores = (q @ k.transpose(-2, -1)).float() * scale  # (B, H, Tq, Tk), softmax in float32
    allowed = pm.dense(q.device)
    if allowed is not None:
        if pm.empty_rows is not None:
            allowed = allowed | pm.empty_rows  # keep the softmax finite; rows zeroed below
        additive = torch.zeros(allowed.shape, dtype=scores.dtype, device=q.device)
        scores = scores + additive.masked_fill_(~allowed, float("-inf"))
    weights = scores.softmax(dim=-1)
    if pm.empty_rows is not None:
        weights = weights.masked_fill(pm.empty_rows, 0.0)
    weights = weights.to(q.dtype)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = dropped @ v  # (B, H, Tq, D)
    return out, (weights if return_weights else None)


def _sdpa(q, k, v, pm: PreparedMask, *, scale, dropout_p, return_weights):
    """PyTorch's fused kernel; ``is_causal`` only when exactly right (pure causal, Tq == Tk)."""
    if return_weights:
        raise ValueError("backend 'sdpa' cannot return attention weights; use backend='reference'")
    groups = q.shape[1] // k.shape[1]
    attn_mask = pm.allowed
    if attn_mask is not None and pm.empty_rows is not None:
        attn_mask = attn_mask | pm.empty_rows
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=pm.is_causal,
        scale=scale,
        enable_gqa=groups > 1,
    )  # (B, H, Tq, D)
    if pm.empty_rows is not None:
        out = out.masked_fill(pm.empty_rows, 0.0)
    return out, None


def _auto(q, k, v, pm: PreparedMask, *, scale, dropout_p, return_weights):
    """The fastest correct choice: the fused kernel, unless weights are asked for."""
    if return_weights:
        return _reference(q, k, v, pm, scale=scale, dropout_p=dropout_p, return_weights=True)
    return _sdpa(q, k, v, pm, scale=scale, dropout_p=dropout_p, return_weights=False)


register_backend("reference", _reference)
register_backend("sdpa", _sdpa)
register_backend("auto", _auto)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask=None,
    *,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_weights: bool = False,
    scale: float | None = None,
    q_offset: int = 0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Masked scaled dot-product attention.

    Args:
        q: ``(B, H, Tq, D)``; k, v: ``(B, Hkv, Tk, D)`` with ``H % Hkv == 0`` (grouped-query).
        mask: None, an :class:`attnmask.masks.Mask`, a :class:`PreparedMask`, a bool tensor
            (True = may attend) or an additive float tensor (0 / -inf), broadcastable to
            ``(B, H, Tq, Tk)``.
        q_offset: absolute position of the first query (see masks' "Positions and causal alignment").
        return_weights: also return the ``(B, H, Tq, Tk)`` attention weights (reference kernel).

    Returns:
        ``(B, H, Tq, D)``, or ``(out, weights)`` with ``return_weights``.

    Raises:
        ValueError/TypeError naming the offending shape, dtype, device or polarity.
    """
    _check_qkv(q, k, v)
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {sorted(BACKENDS)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    pm = prepare_mask(mask, B, H, Tq, Tk, q_offset=q_offset, device=q.device, dtype=q.dtype)
    if (pm.q_len, pm.kv_len) != (Tq, Tk):
        raise ValueError(f"prepared mask is for (Tq={pm.q_len}, Tk={pm.kv_len}), attention has ({Tq}, {Tk})")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out, weights = BACKENDS[backend](q, k, v, pm, scale=scale, dropout_p=dropout_p, return_weights=return_weights)
    return (out, weights) if return_weights else out


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            want = "(B, H, Tq, D)" if name == "q" else "(B, Hkv, Tk, D)"
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected 4-D {want}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} has dtype {t.dtype}, expected a floating dtype")
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; expected equal (B, Hkv, Tk, D)")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim; expected "
            "q (B, H, Tq, D) and k (B, Hkv, Tk, D)"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads H={q.shape[1]} must be a multiple of key/value heads Hkv={k.shape[1]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")


# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------
class MultiHeadAttention(nn.Module):
    """Multi-head (grouped-query) attention for self- and cross-attention.

    ``forward(x, context=None, mask=None, ...)``: queries from ``x`` ``(B, Tq, C)``; keys/values
    from ``context`` ``(B, Tk, C)`` (cross-attention) or from ``x`` (self-attention).
    """

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = False,
        dropout: float = 0.0,
        backend: str = "auto",
    ):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        head_dim = head_dim or dim // num_heads
        if head_dim * num_heads != dim and head_dim == dim // num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}; pass head_dim explicitly")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dropout, self.backend = dropout, backend
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=bias)

    def project_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values ``(B, Hkv, Tk, D)`` of ``context`` (B, Tk, C) — cacheable for cross-attention."""
        B, Tk, _ = context.shape
        k = self.k_proj(context).view(B, Tk, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, Tk, D)
        v = self.v_proj(context).view(B, Tk, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, Tk, D)
        return k, v

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        mask=None,
        *,
        rope: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
        kv_cache=None,
        static_kv: tuple[Tensor, Tensor] | None = None,
        q_offset: int = 0,
        return_weights: bool = False,
    ):
        """Args:
            x: ``(B, Tq, C)``; context: ``(B, Tk, C)`` for cross-attention.
            mask: as for :func:`attention` (a PreparedMask avoids rebuilding it in every layer).
            rope: ``rope(q, k) -> (q, k)`` applying rotary positions to ``(B, H|Hkv, T, D)``.
            kv_cache: an object with ``update(k, v) -> (k_all, v_all)`` (see :mod:`attnmask.cache`).
            static_kv: precomputed cross-attention ``(k, v)`` (encoder computed once per source).
        Returns ``(B, Tq, C)`` (and the weights with ``return_weights``).
        """
        B, Tq, _ = x.shape
        q = self.q_proj(x).view(B, Tq, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, Tq, D)
        if static_kv is not None:
            k, v = static_kv
        else:
            k, v = self.project_kv(x if context is None else context)  # (B, Hkv, Tk, D)
            if rope is not None:
                q, k = rope(q, k)
            if kv_cache is not None:
                k, v = kv_cache.update(k, v)  # (B, Hkv, Tpast + Tq, D)
        res = attention(
            q,
            k,
            v,
            mask,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self.backend,
            return_weights=return_weights,
            q_offset=q_offset,
        )
        out, weights = res if return_weights else (res, None)
        out = self.o_proj(out.transpose(1, 2).reshape(B, Tq, self.num_heads * self.head_dim))  # (B, Tq, C)
        return (out, weights) if return_weights else out
