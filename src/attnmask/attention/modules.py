"""The attention module: projections, rotary positions, grouped-query heads."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from attnmask.attention.backends import BACKENDS, attention
from attnmask.errors import UserError
from attnmask.linear import Linear

# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------
_FUSED_SELF_ONLY = "this attention's projections are fused (fuse_projections_): it attends to its own input only"


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
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, val in (("dim", dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if not isinstance(val, int) or val < 1:
                raise UserError(f"MultiHeadAttention {name} must be an int >= 1, got {val!r}")
        if num_heads % num_kv_heads != 0:
            raise UserError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if head_dim is None:
            if dim % num_heads:
                raise UserError(f"dim={dim} is not divisible by num_heads={num_heads}; pass head_dim explicitly")
            head_dim = dim // num_heads
        if backend not in BACKENDS:
            raise UserError(f"unknown attention backend {backend!r}; expected one of {sorted(BACKENDS)}")
        self.dim, self.num_heads, self.num_kv_heads, self.head_dim = dim, num_heads, num_kv_heads, head_dim
        self.dropout, self.backend = dropout, backend
        self.q_proj = Linear(dim, num_heads * head_dim, bias=bias)
        self.k_proj = Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(num_heads * head_dim, dim, bias=bias)
        # set by attnmask.model.fuse_projections_: one product for q, k and v of self-attention
        self.qkv_proj: nn.Module | None = None
        # optional norms over head_dim on each head of q and k, before rotary positions (set by the
        # model that has them, e.g. Gemma 3's RMSNorm; see attnmask.model.TransformerLayer)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None

    def project_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values ``(B, Hkv, Tk, D)`` of ``context`` (B, Tk, C): what a cross-attention reads,
        computed once per source where decoding keeps them (:class:`attnmask.decode.step.SourceMemory`)."""
        if self.k_proj is None:
            raise UserError(_FUSED_SELF_ONLY)
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
        return_weights: bool = False,
    ):
        """Args:
            x: ``(B, Tq, C)``; context: ``(B, Tk, C)`` for cross-attention.
            mask: as for :func:`attention` (a PreparedMask avoids rebuilding it in every layer).
            rope: ``rope(q, k) -> (q, k)`` applying rotary positions to ``(B, H|Hkv, T, D)``.
        Returns ``(B, Tq, C)`` (and the weights with ``return_weights``).
        """
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise UserError(f"x has shape {tuple(x.shape)}, expected (B, Tq, C={self.dim})")
        B, Tq, _ = x.shape
        if context is not None and (context.dim() != 3 or context.shape[0] != B or context.shape[-1] != self.dim):
            raise UserError(f"context has shape {tuple(context.shape)}, expected (B={B}, Tk, C={self.dim})")
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            if context is not None:
                raise UserError(_FUSED_SELF_ONLY)
            q, k, v = self.qkv_proj(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
            q = q.view(B, Tq, H, D).transpose(1, 2)  # (B, H, Tq, D)
            k, v = (t.view(B, Tq, Hkv, D).transpose(1, 2) for t in (k, v))  # (B, Hkv, Tq, D)
        else:
            q = self.q_proj(x).view(B, Tq, H, D).transpose(1, 2)  # (B, H, Tq, D)
        if self.qkv_proj is None:
            k, v = self.project_kv(x if context is None else context)  # (B, Hkv, Tk, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over D, each head alone
        if rope is not None:
            q, k = rope(q, k)
        res = attention(
            q,
            k,
            v,
            mask,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self.backend,
            return_weights=return_weights,
        )
        out, weights = res if return_weights else (res, None)
        out = self.o_proj(out.transpose(1, 2).reshape(B, Tq, self.num_heads * self.head_dim))  # (B, Tq, C)
        return (out, weights) if return_weights else out
