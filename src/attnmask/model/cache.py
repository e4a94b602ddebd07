"""Key/value caches for incremental decoding: a paged cache (what every decoding path runs on) and
the contiguous :class:`KVCache` that :meth:`attnmask.model.Transformer.decode` takes.

Seed 000 observes that the logits of positions already decoded never change as the output grows:
the look-ahead mask stops them from seeing later tokens. So their keys and values never change
either, and each step only has to compute the new token's.

**The paged cache** (:class:`PagedKVCache`): every layer keeps its keys and values in a pool of
``num_blocks`` blocks of ``block_size`` positions, ``(P, S, Hkv, D)``; a sequence holds a list of block
ids (its *block table*), so position ``t`` of the sequence lives at ``(table[t // S], t % S)``. Blocks
are handed out as a sequence grows and returned when it ends, so sequences of any lengths share one pool
without padding. Blocks are reference-counted (:class:`BlockPool`): sequences that share a prefix (the
beams of one sentence) share its blocks, and a sequence about to write into a shared block copies it
first (copy on write). Block 0 is never handed out: it is the *null block* that unused table entries
point to, so that tables are a dense ``(sequences, max blocks)`` tensor a kernel can read.

**The contiguous cache** (:class:`KVCache`): preallocated per-layer buffers ``(B, Hkv, Tmax, D)`` and one
shared position ``pos``, advanced in place after each forward. A layer's ``update(k, v)`` writes the new keys/values at
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

from dataclasses import dataclass

import torch
from torch import Tensor

from attnmask.errors import UserError


def blocks_for_memory(mib: float, *, n_layers: int, kv_heads: int, head_dim: int, block_size: int, dtype) -> int:
    """How many blocks of ``block_size`` positions fit in ``mib`` MiB of keys and values for every layer."""
    per_block = 2 * n_layers * block_size * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
    return int(mib * (1 << 20)) // per_block


class BlockPool:
    """Which blocks are free, and how many block tables hold each of the others. Block 0 is the null
    block, never handed out.

    ``allocate`` hands out blocks held once; ``share`` adds a holder (a forked table); ``release``
    drops one holder of each block and frees the blocks nobody holds any more. Each costs O(blocks);
    the free list hands out the most recently freed block first (its memory is likeliest to be in
    cache)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise UserError(f"a paged cache needs at least 2 blocks (one is the null block); got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out 1, 2, 3, ... first
        self._refs = [0] * num_blocks  # holders of each block

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks a sequence may ever hold (all but the null block)."""
        return self.num_blocks - 1

    def refs(self, block: int) -> int:
        """How many block tables hold ``block``."""
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} cache blocks, {len(self._free)} free")  # callers check first
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more table holds each of ``blocks``."""
        for b in blocks:
            self._refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        """One table fewer holds each of ``blocks``; those nobody holds go back to the free list."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)


@dataclass
class PagedKVCache:
    """Keys and values of every layer, ``k[layer]`` and ``v[layer]`` of shape ``(P, S, Hkv, D)``."""

    k: list[Tensor]
    v: list[Tensor]
    pool: BlockPool

    @classmethod
    def for_model(
        cls, model, *, num_blocks: int, block_size: int = 16, dtype=None, device=None, zeroed: bool = True
    ) -> PagedKVCache:
        """A pool for ``model``'s decoder layers. ``zeroed=False`` leaves the blocks uninitialised (the
        kernels read only positions already written; a large pool then costs no time to make)."""
        cfg = model.config
        first = next(model.parameters())
        dtype = dtype or (first.dtype if first.dtype.is_floating_point else torch.float32)
        device = device or first.device
        shape = (num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)  # (P, S, Hkv, D)
        make = torch.zeros if zeroed else torch.empty
        k = [make(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        v = [make(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        if not zeroed:
            for t in (*k, *v):
                t[0].zero_()  # the null block: read by no row, but never garbage
        return cls(k, v, BlockPool(num_blocks))

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold ``positions`` positions."""
        return -(-positions // self.block_size)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Every layer's block ``src[i]`` copied into block ``dst[i]`` (copy on write), one copy per pool."""
        if not src:
            return
        s = torch.tensor(src, device=self.k[0].device)
        d = torch.tensor(dst, device=self.k[0].device)
        for pool in (*self.k, *self.v):
            pool.index_copy_(0, d, pool.index_select(0, s))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


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
