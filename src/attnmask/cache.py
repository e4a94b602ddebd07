"""Key/value cache for incremental decoding.

Preallocated per-layer buffers ``(B, Hkv, Tmax, D)``; one shared position ``pos`` advanced in
place after each forward. A layer's ``update(k, v)`` writes the new keys/values at
``[pos, pos + T)`` and returns the valid prefix ``[0, pos + T)``, so the self-attention mask is
the *bottom-right* aligned causal mask (queries are the last T keys) plus key padding.
Cross-attention keys/values are computed once per source and kept.
"""

from __future__ import annotations

import torch
from torch import Tensor


class LayerCache:
    def __init__(self, parent: KVCache, k: Tensor, v: Tensor):
        self.parent, self.k, self.v = parent, k, v

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``(B, Hkv, T, D)`` at the current position; return keys/values ``(B, Hkv, pos+T, D)``."""
        B, _, T, _ = k_new.shape
        pos = self.parent.pos
        if self.k.shape[0] != B:
            raise ValueError(f"KV cache holds batch {self.k.shape[0]}, got keys for batch {B}")
        if pos + T > self.k.shape[2]:
            raise ValueError(f"KV cache overflow: {pos} cached + {T} new tokens > capacity {self.k.shape[2]} (max_len)")
        self.k[:, :, pos : pos + T] = k_new
        self.v[:, :, pos : pos + T] = v_new
        return self.k[:, :, : pos + T], self.v[:, :, : pos + T]


class KVCache:
    """Per-layer self-attention buffers plus cross-attention keys/values (encoder-decoder)."""

    def __init__(
        self,
        *,
        n_layers: int,
        batch_size: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"KV cache needs batch_size >= 1 and max_len >= 1, got {batch_size}, {max_len}")
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.batch_size, self.max_len = batch_size, max_len
        self.pos = 0
        self.layers = [
            LayerCache(
                self, torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
            )
            for _ in range(n_layers)
        ]
        self._cross: list[tuple[Tensor, Tensor] | None] = [None] * n_layers
        self.cross_len = 0

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int | None = None, dtype=None, device=None) -> KVCache:
        cfg = model.config
        p = next(model.parameters())
        return cls(
            n_layers=cfg.n_layers,
            batch_size=batch_size,
            max_len=max_len or cfg.max_seq_len,
            n_kv_heads=cfg.kv_heads,
            head_dim=cfg.d_head,
            dtype=dtype or p.dtype,
            device=device or p.device,
        )

    def layer(self, i: int) -> LayerCache:
        return self.layers[i]

    def advance(self, n: int) -> None:
        self.pos += n

    def cross_kv(self, i: int, attn, memory: Tensor | None) -> tuple[Tensor, Tensor]:
        """Cross-attention keys/values of layer ``i``: computed from ``memory`` once, then reused."""
        if self._cross[i] is None:
            if memory is None:
                raise ValueError("the cache holds no encoder keys/values yet: pass memory on the first step")
            self._cross[i] = attn.project_kv(memory)
            self.cross_len = memory.shape[1]
        return self._cross[i]
