"""Key/value cache for incremental decoding.

Seed 000 observes that the logits of positions already decoded never change as the output grows:
the look-ahead mask stops them from seeing later tokens. So their keys and values never change
either, and each step only has to compute the new token's.

Layout: preallocated per-layer buffers ``(B, Hkv, Tmax, D)`` and one shared position ``pos``,
advanced in place after each forward. A layer's ``update(k, v)`` writes the new keys/values at
``[pos, pos + T)`` and returns the valid prefix ``[0, pos + T)``; the queries are therefore the
*last* T keys, and the self-attention mask is the bottom-right aligned ``masks.causal()`` plus key
padding over all ``pos + T`` keys. Cross-attention keys/values are projected from the encoder
output once per source and kept.

``batch_size`` and ``max_len`` are capacities: a batch of up to ``batch_size`` rows may use the
cache (after :meth:`KVCache.reset` it may be a different one), and a bigger batch or a sequence
longer than ``max_len`` raises ``ValueError``. :meth:`KVCache.reorder` selects and permutes rows
in place: beam search reorders hypotheses with it, and batch decoding drops finished rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnmask.errors import UserError


class LayerCache:
    """One layer's self-attention keys and values; a view into its :class:`KVCache`."""

    __slots__ = ("parent", "k", "v")

    def __init__(self, parent: KVCache):
        self.parent = parent
        self.k: Tensor | None = None  # (B, Hkv, Tmax, D), allocated by the first update
        self.v: Tensor | None = None

    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``(B, Hkv, T, D)`` at the current position; return keys/values ``(B, Hkv, pos+T, D)``."""
        B, _, T, _ = k_new.shape
        parent, pos = self.parent, self.parent.pos
        parent._claim(B, T)
        if self.k is None or (parent.dtype is None and self.k.dtype != k_new.dtype):
            self._allocate(k_new)
        self.k[:B, :, pos : pos + T] = k_new
        self.v[:B, :, pos : pos + T] = v_new
        return self.k[:B, :, : pos + T], self.v[:B, :, : pos + T]

    def _allocate(self, like: Tensor) -> None:
        """Buffers in the dtype the keys arrive in (autocast may make them bfloat16), keeping what
        was cached so far."""
        parent = self.parent
        if like.shape[1] != parent.n_kv_heads or like.shape[3] != parent.head_dim:
            raise UserError(
                f"keys of shape {tuple(like.shape)} do not fit a KV cache of Hkv={parent.n_kv_heads}, "
                f"D={parent.head_dim}; expected (B, {parent.n_kv_heads}, T, {parent.head_dim})"
            )
        dtype = parent.dtype or like.dtype
        shape = (parent.capacity, parent.n_kv_heads, parent.max_len, parent.head_dim)  # (B, Hkv, Tmax, D)
        # uninitialized: only positions already written ([0, pos)) are ever read
        k, v = (torch.empty(shape, dtype=dtype, device=like.device) for _ in range(2))
        if self.k is not None:
            k[:, :, : parent.pos], v[:, :, : parent.pos] = self.k[:, :, : parent.pos], self.v[:, :, : parent.pos]
        self.k, self.v = k, v


class KVCache:
    """Per-layer self-attention buffers plus cross-attention keys/values (encoder-decoder).

    Args:
        n_layers: decoder layers.
        batch_size: most rows decoded at once (capacity).
        max_len: most positions (prompt + generated) per row (capacity).
        n_kv_heads, head_dim: ``Hkv`` and ``D`` of the model's attention.
        dtype: of the buffers; None = the dtype of the first keys written (the model's, or
            autocast's). Buffers are allocated on the first write, on the keys' device.
    """

    def __init__(
        self,
        *,
        n_layers: int,
        batch_size: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | None = None,
    ):
        if batch_size < 1 or max_len < 1:
            raise UserError(f"KV cache needs batch_size >= 1 and max_len >= 1, got {batch_size}, {max_len}")
        self.capacity, self.max_len = batch_size, max_len
        self.n_kv_heads, self.head_dim, self.dtype = n_kv_heads, head_dim, dtype
        self.layers = [LayerCache(self) for _ in range(n_layers)]
        self.reset()

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int | None = None, dtype=None) -> KVCache:
        """A cache shaped for ``model``'s decoder; ``max_len`` defaults to ``config.max_seq_len``."""
        cfg = model.config
        return cls(
            n_layers=cfg.n_layers,
            batch_size=batch_size,
            max_len=max_len or cfg.max_seq_len,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            dtype=dtype,
        )

    @property
    def batch_size(self) -> int:
        """Rows in use (0 before the first forward after :meth:`reset`)."""
        return self.rows or 0

    def reset(self) -> None:
        """Forget everything cached, so a new batch (of any size up to the capacity) can start."""
        self.pos = 0
        self.rows: int | None = None  # rows in use, fixed by the first update
        self._cross: list[tuple[Tensor, Tensor] | None] = [None] * len(self.layers)
        self.cross_len = 0
        # what a decoding step derives from the model once per generation rather than every token
        # (attnmask.decode.static: the layers' parts, the fused step's operands), keyed by its user
        self.memo: dict = {}

    def _claim(self, rows: int, T: int) -> None:
        if self.rows is None:
            if rows > self.capacity:
                raise UserError(
                    f"KV cache overflow: batch of {rows} rows > capacity {self.capacity} (batch_size); "
                    "allocate a bigger cache or decode in smaller batches"
                )
            self.rows = rows
        elif rows != self.rows:
            raise UserError(
                f"KV cache holds a batch of {self.rows} rows, got keys for {rows}; call reset() before a new batch"
            )
        if self.pos + T > self.max_len:
            raise UserError(
                f"KV cache overflow: {self.pos} cached + {T} new tokens > capacity {self.max_len} (max_len)"
            )

    def layer(self, i: int) -> LayerCache:
        return self.layers[i]

    def advance(self, n: int) -> None:
        """Move the position past the ``n`` tokens every layer has just written."""
        self.pos += n

    def cross_kv(self, i: int, attn, memory: Tensor | None) -> tuple[Tensor, Tensor]:
        """Cross-attention keys/values ``(B, Hkv, S, D)`` of layer ``i``: from ``memory`` once, then reused."""
        kv = self._cross[i]
        if kv is None:
            if memory is None:
                raise UserError("the cache holds no encoder keys/values yet: pass memory on the first step")
            kv = self._cross[i] = attn.project_kv(memory)
            self.cross_len = memory.shape[1]
        return kv

    def reorder(self, index: Tensor, *, cross: bool = True) -> None:
        """Keep rows ``index`` (B',) in that order: row ``r`` becomes old row ``index[r]``.

        Beam search passes each surviving hypothesis's parent; batch decoding passes the rows still
        running (``B' < B``). Only the ``pos`` filled positions are copied. ``cross=False`` leaves
        the encoder keys/values alone — correct when ``index`` maps every row to a row of the same
        source (beams of one sentence) and ``B' == B``.
        """
        if self.rows is None:
            raise UserError("reorder() on an empty KV cache; run a forward pass first")
        index = torch.as_tensor(index, device=self.layers[0].k.device if self.layers[0].k is not None else None)
        if index.dim() != 1 or (index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.rows)):
            raise UserError(f"reorder index must be 1-D with values in [0, {self.rows}), got {index.tolist()}")
        n, pos = index.numel(), self.pos
        if n > self.capacity:
            raise UserError(f"KV cache overflow: reorder to {n} rows > capacity {self.capacity}")
        if not cross and n != self.rows:
            raise UserError(f"reorder(cross=False) must keep the batch size {self.rows}, got {n} rows")
        for layer in self.layers:
            if layer.k is None:
                continue
            # advanced indexing copies first, so overlapping source and destination rows are safe
            layer.k[:n, :, :pos] = layer.k[index, :, :pos]  # (B', Hkv, pos, D)
            layer.v[:n, :, :pos] = layer.v[index, :, :pos]  # (B', Hkv, pos, D)
        if cross:
            self._cross = [None if kv is None else (kv[0][index], kv[1][index]) for kv in self._cross]
        self.rows = n
