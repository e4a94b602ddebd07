"""A paged key/value cache: fixed-size blocks in one pool per layer, a block table per sequence.

Every layer keeps its keys and values in a pool of ``num_blocks`` blocks of ``block_size``
positions, ``(P, S, Hkv, D)``; a sequence holds a list of block ids (its *block table*), so position
``t`` of the sequence lives at ``(table[t // S], t % S)``. Blocks are handed out as a sequence grows
and returned when it ends (or is preempted), so memory is bounded by the pool, not by the longest
sequence times the batch, and sequences of any lengths share one pool without padding.

Block 0 is never handed out: it is the *null block* that unused table entries point to, so that a
table is a dense ``(sequences, max blocks)`` tensor the kernel can read (the kernel reads only the
entries up to each row's position, which are real blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnmask.errors import UserError

__all__ = ["BlockPool", "PagedKVCache", "blocks_for_memory"]


def blocks_for_memory(mib: float, *, n_layers: int, kv_heads: int, head_dim: int, block_size: int, dtype) -> int:
    """How many blocks of ``block_size`` positions fit in ``mib`` MiB of keys and values for every layer."""
    per_block = 2 * n_layers * block_size * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
    return int(mib * (1 << 20)) // per_block


class BlockPool:
    """Which blocks are free. Block 0 is the null block, never handed out.

    ``allocate`` and ``free`` cost O(blocks moved); the free list hands out the most recently freed
    block first (its memory is likeliest to be in cache)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise UserError(f"a paged cache needs at least 2 blocks (one is the null block); got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out 1, 2, 3, ... first

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

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} cache blocks, {len(self._free)} free")  # the scheduler checks first
        return [self._free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


@dataclass
class PagedKVCache:
    """Keys and values of every layer, ``k[layer]`` and ``v[layer]`` of shape ``(P, S, Hkv, D)``."""

    k: list[Tensor]
    v: list[Tensor]
    pool: BlockPool

    @classmethod
    def for_model(cls, model, *, num_blocks: int, block_size: int = 16, dtype=None, device=None) -> PagedKVCache:
        cfg = model.config
        first = next(model.parameters())
        dtype = dtype or (first.dtype if first.dtype.is_floating_point else torch.float32)
        device = device or first.device
        shape = (num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)  # (P, S, Hkv, D)
        # zeros, not empty: the null block is read by no row, but a NaN left in memory must not exist at all
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
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

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
