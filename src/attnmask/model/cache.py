"""The key/value cache of incremental decoding: a paged cache, what every decoding path runs on.

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

**Layer groups and windows.** A model whose layers attend to different spans (Gemma 3: 15 layers see
their last 512 positions, 3 see everything) keeps one block table per sequence *per group* of layers
(:func:`layer_groups`, made with ``by_window=True``): layers of one window, in groups of equal size
(the greatest common divisor of the windows' layer counts: Gemma 3 makes one full group and five
window groups of 3 layers). All groups share one :class:`BlockPool`: a block id is a block of whichever
group holds it, and the groups' layers share their pools' memory (layer ``j`` of every group lives in
the ``j``-th pool tensor), so a block is ``layers per group`` layers' worth and no budget is split
between groups: short sequences hold as many blocks in every group, long ones few in the window
groups. A window group's blocks that hold only positions below ``lowest - window + 1`` (``lowest``:
the lowest position the sequence will still compute; its rows read keys ``[p - window + 1, p]``) go back
to the pool and their entries become the null block (:meth:`Paging.forget`), so a window group holds at
most ``ceil((window + chunk) / S) + 1`` blocks of a sequence fed ``chunk`` tokens a step
(:meth:`Paging.peak`). A model with one window (or none) makes one group of every layer: one table, the
pools as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnmask.errors import UserError


def blocks_for_memory(mib: float, *, n_layers: int, kv_heads: int, head_dim: int, block_size: int, dtype) -> int:
    """How many blocks of ``block_size`` positions fit in ``mib`` MiB of keys and values of ``n_layers``
    layers: every layer, or the layers of one group where the cache has groups (a block is then that
    many layers' worth: :func:`layer_groups`)."""
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
        """One more table holds each of ``blocks`` (null entries, 0, are no block)."""
        for b in blocks:
            if b:
                self._refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        """One table fewer holds each of ``blocks``; those nobody holds go back to the free list (null
        entries, 0, are no block)."""
        for b in reversed(blocks):
            if not b:
                continue
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)


@dataclass(frozen=True)
class LayerGroup:
    """Decoder layers that share one block table per sequence."""

    window: int  # 0: the layers read every earlier position; w > 0: the last w only (older blocks are freed)
    layers: tuple[int, ...]  # in order; layer layers[j] keeps its keys in the cache's j-th pool tensor


def layer_window(cfg, layer: int) -> int:
    """The self-attention window of ``layer`` (0: none) as the model's config gives it."""
    window = getattr(cfg, "layer_window", None)
    return int(window(layer)) if window is not None else int(getattr(cfg, "sliding_window", 0) or 0)


def layer_groups(cfg, *, by_window: bool = False) -> list[LayerGroup]:
    """The cache's layer groups for a model config: one group of every layer (window 0: nothing freed,
    each layer's window still applied when attending) unless ``by_window``; then the layers of each
    window in groups of equal size (the greatest common divisor of the windows' layer counts), the full
    layers' groups first. A model with one window makes one group either way (of that window when
    ``by_window``)."""
    n = cfg.n_layers
    if not by_window:
        return [LayerGroup(0, tuple(range(n)))]
    of: dict[int, list[int]] = {}
    for i in range(n):
        of.setdefault(layer_window(cfg, i), []).append(i)
    size = math.gcd(*(len(ls) for ls in of.values()))
    return [LayerGroup(w, tuple(ls[a : a + size])) for w, ls in sorted(of.items()) for a in range(0, len(ls), size)]


@dataclass(frozen=True)
class Paging:
    """How a sequence's block tables (``tables[g]``: one list of block ids per layer group) follow its
    positions: the rules every holder of tables (a decoding run, the engine's scheduler) applies, over
    one shared :class:`BlockPool`. Null entries (0) stand for blocks a window group has freed."""

    pool: BlockPool
    block_size: int
    windows: tuple[int, ...] = (0,)  # of each group

    def new(self) -> list[list[int]]:
        return [[] for _ in self.windows]

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def first_kept(self, window: int, lowest: int) -> int:
        """Index of the first block a window group keeps when no row reads below ``lowest - window + 1``."""
        return max(0, lowest - window + 1) // self.block_size if window > 0 else 0

    def forget(self, tables: list[list[int]], lowest: int) -> int:
        """Free the window groups' blocks that hold only positions no row from ``lowest`` on reads
        (below ``lowest - window + 1``); their entries become the null block. Returns the blocks let go.
        Freed entries form a prefix of each table, so this costs what it frees."""
        freed = 0
        for t, w in zip(tables, self.windows):
            j = min(self.first_kept(w, lowest), len(t)) - 1
            while j >= 0 and t[j]:
                self.pool.release([t[j]])
                t[j] = 0
                freed += 1
                j -= 1
        return freed

    def _each(self, positions: int | Sequence[int]) -> list[int]:
        return [positions] * len(self.windows) if isinstance(positions, int) else list(positions)

    def missing(self, tables: list[list[int]], positions: int | Sequence[int], lowest: int = 0) -> int:
        """Blocks :meth:`extend` would take to cover ``positions`` positions (or one count a group),
        rows from ``lowest`` on."""
        return sum(
            max(0, self.blocks_for(p) - max(len(t), self.first_kept(w, lowest)))
            for t, w, p in zip(tables, self.windows, self._each(positions))
        )

    def extend(self, tables: list[list[int]], positions: int | Sequence[int], lowest: int = 0) -> None:
        """Give every group's table blocks up to ``positions`` positions (or one count a group), null
        entries where a window group will never read them again (rows from ``lowest`` on). The caller
        checks :meth:`missing` against the free blocks first."""
        for t, w, p in zip(tables, self.windows, self._each(positions)):
            n = self.blocks_for(p)
            if len(t) < n:
                skip = max(0, min(self.first_kept(w, lowest), n) - len(t))
                t += [0] * skip + self.pool.allocate(n - len(t) - skip)

    def share(self, tables: list[list[int]]) -> None:
        for t in tables:
            self.pool.share(t)

    def release(self, tables: list[list[int]]) -> None:
        """Give every block of ``tables`` back (one holder fewer) and empty them."""
        for t in tables:
            self.pool.release(t)
            t.clear()

    def held(self, tables: list[list[int]]) -> int:
        return sum(1 for t in tables for b in t if b)

    def peak(self, positions: int, chunk: int) -> int:
        """The most blocks a sequence of ``positions`` positions holds at once, fed at most ``chunk``
        tokens a step with :meth:`forget` before each: a full group all of them, a window group the
        blocks spanning ``window + chunk`` positions at most."""
        n = self.blocks_for(positions)
        return sum(n if w == 0 else min(n, -(-(w + chunk) // self.block_size) + 1) for w in self.windows)

    def most_positions(self, chunk: int) -> int | None:
        """The most positions one sequence may reach with the whole pool to itself (its :meth:`peak`
        within the pool's capacity); None: any number (window groups alone, their peaks fit)."""
        cap = self.pool.capacity
        if self.peak(1 << 62, chunk) <= cap:
            return None
        lo, hi = 0, cap * self.block_size  # peak(lo) <= cap < peak(hi + 1)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.peak(mid, chunk) <= cap else (lo, mid - 1)
        return lo


@dataclass
class PagedKVCache:
    """Keys and values of every layer, ``k[layer]`` and ``v[layer]`` of shape ``(P, S, Hkv, D)``, in one
    :class:`BlockPool`; ``groups``: the layers that share one block table per sequence (None: one group
    of every layer). Layers of different groups share pool tensors (see the module's docstring)."""

    k: list[Tensor]
    v: list[Tensor]
    pool: BlockPool
    groups: list[LayerGroup] | None = None
    layer_group: list[int] = field(init=False)  # the group of each layer

    def __post_init__(self):
        if self.groups is None:
            self.groups = [LayerGroup(0, tuple(range(len(self.k))))]
        self.layer_group = [0] * len(self.k)
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                self.layer_group[layer] = g

    @classmethod
    def for_model(
        cls,
        model,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype=None,
        device=None,
        zeroed: bool = True,
        by_window: bool = False,
    ) -> PagedKVCache:
        """A pool for ``model``'s decoder layers. ``zeroed=False`` leaves the blocks uninitialised (the
        kernels read only positions already written; a large pool then costs no time to make).
        ``by_window``: a block table per sequence per group of layers of one window (:func:`layer_groups`),
        the window groups' old blocks freed as the sequence grows; else one table for every layer."""
        cfg = model.config
        first = next(model.parameters())
        dtype = dtype or (first.dtype if first.dtype.is_floating_point else torch.float32)
        device = device or first.device
        groups = layer_groups(cfg, by_window=by_window)
        shape = (num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)  # (P, S, Hkv, D)
        # off the CPU the step's FlexAttention reads whole blocks of the pool (masked weights are 0,
        # and 0 * NaN garbage is NaN): those pools are zeroed always
        zeroed = zeroed or torch.device(device).type != "cpu"
        make = torch.zeros if zeroed else torch.empty
        per_block = len(groups[0].layers)  # layers of a group: one pool tensor each
        ks = [make(shape, dtype=dtype, device=device) for _ in range(per_block)]
        vs = [make(shape, dtype=dtype, device=device) for _ in range(per_block)]
        if not zeroed:
            for t in (*ks, *vs):
                t[0].zero_()  # the null block: read by no row, but never garbage
        k, v = [ks[0]] * cfg.n_layers, [vs[0]] * cfg.n_layers
        for group in groups:
            for j, layer in enumerate(group.layers):
                k[layer], v[layer] = ks[j], vs[j]
        return cls(k, v, BlockPool(num_blocks), groups)

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def windows(self) -> tuple[int, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def paging(self) -> Paging:
        """The rules of this cache's block tables (one per group) over its pool."""
        return Paging(self.pool, self.block_size, self.windows)

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold ``positions`` positions."""
        return -(-positions // self.block_size)

    def _tensors(self) -> list[Tensor]:
        """Every pool tensor once (layers of different groups share them)."""
        seen: dict[int, Tensor] = {}
        for t in (*self.k, *self.v):
            seen.setdefault(id(t), t)
        return list(seen.values())

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Block ``src[i]`` copied into block ``dst[i]`` in every pool tensor (copy on write): a block
        belongs to one group, so this copies its group's layers."""
        if not src:
            return
        s = torch.tensor(src, device=self.k[0].device)
        d = torch.tensor(dst, device=self.k[0].device)
        for pool in self._tensors():
            pool.index_copy_(0, d, pool.index_select(0, s))

    def nbytes(self) -> int:
        """Bytes of the pool tensors (each counted once)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())
