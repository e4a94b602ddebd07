"""Block-sparse attention on the CPU: the work a structured mask allows, never ``Tq x Tk``.

The query axis is cut into blocks of ``bq`` rows and the key axis into blocks of ``bk`` keys. The
mask algebra says, per query row, which key intervals it may reach (:meth:`attnmask.masks.Mask.key_spans`);
a :class:`TilePlan` keeps, for every query block, only the key blocks those intervals touch. Query
blocks that need the same number of key blocks are stacked, their keys gathered, and run as one
batched product, a few blocks at a time so that the scores stay within :data:`SCORE_BUDGET`
elements; the exact mask is evaluated on those tiles only (:meth:`~attnmask.masks.Mask.evaluate`).
A query block whose keys exceed :data:`MAX_KEYS` is split into segments that are merged by the
online (log-sum-exp) softmax, flash-style. The backward recomputes the scores per tile, so memory
is ``O(T·D)`` plus the budget, forward and backward: ``O(T·(block + window))`` at most.

Rows that may attend to nothing give zero output and zero gradient (the package's convention).
The plan is read on the host: CPU tensors outside ``torch.compile`` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnmask import masks as M

SCORE_BUDGET = 1 << 19  # score elements (B·H·rows·keys) per batched product: 2 MiB in float32
MAX_KEYS = 2048  # keys per query block and segment; more are merged by the online softmax
KEY_QUANTUM = 128  # keys a query block reads are rounded up to a multiple of this
TILE_CACHE = 1 << 24  # mask elements (bool) a plan keeps between calls; larger plans re-evaluate


@dataclass(frozen=True)
class TileGroup:
    """Query blocks ``blocks`` (n,) that each read ``keys.shape[1]`` keys: ``keys`` (n, ck) holds key
    positions (past ``Tk`` for a ragged last block: masked). ``segment``: which of a block's key
    segments this is (0 for most; a later one is merged into the earlier by the online softmax).
    ``chunks``: the ``[lo, hi)`` item ranges run as one product each (within :data:`SCORE_BUDGET`)."""

    blocks: Tensor
    keys: Tensor
    segment: int
    chunks: tuple[tuple[int, int], ...]


@dataclass
class TilePlan:
    """The tiles of one problem: ``nq`` query blocks of ``bq`` rows and ``groups`` of work.

    ``live``: bool ``(B|1, nq * bq)``, the rows that may attend to something (None when all may);
    ``segments``: the most key segments of any query block (1: no online-softmax merge needed)."""

    bq: int
    bk: int
    nq: int
    q_len: int
    kv_len: int
    q_start: int
    groups: tuple[TileGroup, ...]
    mask: M.Mask
    batch_size: int
    segments: int = 1
    live: Tensor | None = None
    cache: dict | None = None  # (group, chunk) -> bool (B|1, n, bq, ck) of masked-out scores

    def scores(self) -> int:
        """Query-key pairs computed per (batch row, head): the plan's cost, beside ``Tq * Tk`` dense."""
        return sum(g.keys.numel() * self.bq for g in self.groups)

    def blocked(self, gi: int, ci: int) -> Tensor:
        """Where the scores of chunk ``ci`` of group ``gi`` are masked out: bool (B|1, n, bq, ck)."""
        if self.cache is not None and (gi, ci) in self.cache:
            return self.cache[gi, ci]
        g = self.groups[gi]
        lo, hi = g.chunks[ci]
        rows = g.blocks[lo:hi, None] * self.bq + torch.arange(self.bq)  # (n, bq) query rows
        q_pos = self.q_start + rows.clamp(max=self.q_len - 1)  # rows past Tq repeat the last one (cut off)
        keys = g.keys[lo:hi]  # (n, ck)
        allowed = self.mask.evaluate(
            self.batch_size,
            self.q_len,
            self.kv_len,
            self.q_start,
            q_pos[None, :, :, None],
            keys.clamp(max=self.kv_len - 1)[None, :, None, :],
        )
        allowed = allowed.view((1,) * (4 - allowed.dim()) + tuple(allowed.shape))  # (B|1, n|1, bq|1, ck|1)
        if int(keys.max()) >= self.kv_len:
            allowed = allowed & (keys < self.kv_len)[None, :, None, :]  # the ragged last key block
        n, ck = hi - lo, keys.shape[1]
        return (~allowed).expand(allowed.shape[0], n, self.bq, ck).contiguous()  # (B|1, n, bq, ck)


def key_blocks(
    mask: M.Mask, batch_size: int, q_len: int, kv_len: int, q_start: int, *, bq: int | None = None, bk: int = 16
) -> tuple[int, Tensor]:
    """``(bq, need)``: the query block size (``bq=None``: from the mask's mean span, see
    :func:`query_block`) and bool ``(nq, nk)``, the key blocks of ``bk`` keys that query block ``i``
    reads: those the mask's key spans touch, over every batch row. Nothing is evaluated per tile."""
    spans = mask.key_spans(batch_size, q_len, kv_len, q_start, device="cpu")
    if bq is None:
        bq = query_block(spans, kv_len)
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    need = torch.zeros(nq, nk, dtype=torch.bool)  # (nq, nk) key blocks each query block reads
    kb = torch.arange(nk)  # (nk,)
    big = torch.iinfo(torch.long).max
    pad = nq * bq - q_len
    for lo, hi in spans:
        lo, hi = torch.broadcast_tensors(lo.clamp(0, kv_len), hi.clamp(0, kv_len))  # (B|1, Tq|1)
        lo, hi = lo.expand(lo.shape[0], q_len), hi.expand(hi.shape[0], q_len)  # (B|1, Tq)
        empty = lo >= hi
        lo, hi = lo.masked_fill(empty, big), hi.masked_fill(empty, -1)
        lo, hi = F.pad(lo, (0, pad), value=big), F.pad(hi, (0, pad), value=-1)  # (B|1, nq * bq)
        first = lo.view(-1, nq, bq).amin(dim=2).amin(dim=0)  # (nq,) first key any row of the block reads
        last = hi.view(-1, nq, bq).amax(dim=2).amax(dim=0)  # (nq,) past the last one
        start, stop = first.clamp(max=kv_len) // bk, (last + bk - 1).clamp(min=0) // bk
        need |= (kb >= start[:, None]) & (kb < stop[:, None]) & (first < last)[:, None]
    return bq, need


def estimate(mask: M.Mask, batch_size: int, heads: int, q_len: int, kv_len: int, q_start: int) -> tuple[int, int]:
    """``(scores, products)`` a plan would compute, without building it (no tile is evaluated):
    query-key pairs over every batch row and head, and about how many batched products they take."""
    bq, need = key_blocks(mask, batch_size, q_len, kv_len, q_start)
    keys = (need.sum(dim=1) * 16 + KEY_QUANTUM - 1) // KEY_QUANTUM * KEY_QUANTUM  # (nq,) as planned
    scores = int(keys.sum()) * bq * batch_size * heads
    return scores, len(keys.unique()) + -(-scores // SCORE_BUDGET)


def plan_tiles(
    mask: M.Mask,
    batch_size: int,
    heads: int,
    q_len: int,
    kv_len: int,
    q_start: int,
    *,
    bq: int | None = None,
    bk: int = 16,
    max_keys: int | None = None,
) -> TilePlan:
    """The key blocks each query block needs, from the mask's key spans (a superset of the allowed
    keys; the union over batch rows), grouped by how many they are. Host work of
    ``(Tq / bq) x (Tk / bk)`` flags plus one evaluation of the mask on the tiles (which rows are
    empty; the tiles are kept for later calls up to :data:`TILE_CACHE` elements). ``bq=None``
    picks the query block from the mask's mean span (:func:`query_block`)."""
    bq, need = key_blocks(mask, batch_size, q_len, kv_len, q_start, bq=bq, bk=bk)
    nq, nk = need.shape
    pad = nq * bq - q_len
    counts = need.sum(dim=1)  # (nq,) key blocks of each query block
    cols = need.nonzero()[:, 1]  # (sum counts,) their indices, block by block
    offsets = counts.cumsum(0) - counts  # (nq,) where each block's indices start in cols
    seg_blocks = max(1, (MAX_KEYS if max_keys is None else max_keys) // bk)
    # Few distinct shapes: a block's key count is rounded up to KEY_QUANTUM (the extra keys sit past
    # Tk and are masked), so that products come in a handful of shapes. Every new shape costs a
    # oneDNN kernel and its scratch memory (measured: ~2 MB each in bfloat16, 70 shapes for packed
    # documents at T=16k before rounding).
    quantum = max(1, KEY_QUANTUM // bk)
    padded = (counts + quantum - 1) // quantum * quantum  # (nq,)
    groups = []
    for c in padded.unique().tolist():
        if c == 0:
            continue
        blocks = (padded == c).nonzero()[:, 0]  # (n,) query blocks that read up to c key blocks
        ar = torch.arange(c)  # (c,)
        real = ar < counts[blocks, None]  # (n, c)
        at = (offsets[blocks, None] + ar).clamp(max=max(len(cols) - 1, 0))  # (n, c)
        idx = torch.where(real, cols[at], nk + ar)  # (n, c) their key blocks; past the last: masked
        for s0 in range(0, c, seg_blocks):
            part = idx[:, s0 : s0 + seg_blocks]  # (n, c') one segment of them
            keys = (part[:, :, None] * bk + torch.arange(bk)).reshape(len(blocks), -1)  # (n, c' * bk)
            step = max(1, SCORE_BUDGET // (batch_size * heads * bq * keys.shape[1]))
            chunks = tuple((lo, min(len(blocks), lo + step)) for lo in range(0, len(blocks), step))
            groups.append(TileGroup(blocks, keys, s0 // seg_blocks, chunks))
    groups.sort(key=lambda g: g.segment)  # a block's first segment runs before those merged into it
    plan = TilePlan(bq, bk, nq, q_len, kv_len, q_start, tuple(groups), mask, batch_size)
    plan.segments = 1 + max((g.segment for g in groups), default=0)
    live = torch.zeros(batch_size, nq, bq, dtype=torch.bool)  # (B, nq, bq)
    cache, size = {}, 0
    for gi, g in enumerate(plan.groups):
        for ci, (lo, hi) in enumerate(g.chunks):
            blocked = plan.blocked(gi, ci)  # (B|1, n, bq, ck)
            live[:, g.blocks[lo:hi]] |= ~blocked.all(dim=-1)
            size += blocked.numel()
            if size <= TILE_CACHE:
                cache[gi, ci] = blocked
    plan.cache = cache if size <= TILE_CACHE else None
    live = live.view(batch_size, nq * bq)[:, :q_len]  # (B, Tq)
    plan.live = None if bool(live.all()) else F.pad(live, (0, pad), value=True)  # (B, nq * bq)
    return plan


def query_block(spans: list[tuple[Tensor, Tensor]], kv_len: int) -> int:
    """Query rows per block: a block reads the keys of all its rows, so around a window of ``w`` keys
    it reads about ``w + bq``; smaller blocks waste less, larger ones make fewer and larger products.
    128 rows when the rows reach 192 keys or more on average, 64 from 48, else 32."""
    mean = 0.0
    for lo, hi in spans:
        mean += float((hi.clamp(0, kv_len) - lo.clamp(0, kv_len)).clamp_min(0).float().mean())
    return 128 if mean >= 192 else 64 if mean >= 48 else 32


def _blocked_q(x: Tensor, Hkv: int, bq: int, nq: int) -> Tensor:
    """(B, H, Tq, D) -> (B, Hkv, nq, G * bq, D): the query rows of each block over the G heads that
    share one key/value head, so that one product serves the whole group (grouped-query). A view
    when nothing is padded and G == 1."""
    B, H, Tq, D = x.shape
    G = H // Hkv
    if nq * bq != Tq:
        x = F.pad(x, (0, 0, 0, nq * bq - Tq))  # (B, H, nq * bq, D)
    x = x.view(B, Hkv, G, nq, bq, D).transpose(2, 3)  # (B, Hkv, nq, G, bq, D)
    return x.reshape(B, Hkv, nq, G * bq, D)


def _unblocked(x: Tensor, H: int, Tq: int) -> Tensor:
    """The inverse of :func:`_blocked_q`: (B, Hkv, nq, G * bq, D) -> (B, H, Tq, D)."""
    B, Hkv, nq, Gbq, D = x.shape
    G = H // Hkv
    x = x.view(B, Hkv, nq, G, Gbq // G, D).transpose(2, 3)  # (B, Hkv, G, nq, bq, D)
    return x.reshape(B, H, -1, D)[:, :, :Tq]


def _dead(plan: TilePlan, shape: tuple[int, ...]) -> Tensor:
    """The rows that attend to nothing, shaped to mask a (B, Hkv, nq, G * bq, X) tensor."""
    B, Hkv, nq, Gbq = shape[:4]
    G = Gbq // plan.bq
    dead = ~plan.live.view(-1, 1, nq, 1, plan.bq, 1)  # (B|1, 1, nq, 1, bq, 1)
    return dead.expand(dead.shape[0], Hkv, nq, G, plan.bq, 1).reshape(-1, Hkv, nq, Gbq, 1)


class _TileAttention(torch.autograd.Function):
    """Forward over the plan's tiles (online softmax across a block's key segments); the backward
    recomputes each tile's probabilities: by softmax, or from the saved log-sum-exp when a block's
    keys came in several segments."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: TilePlan, scale: float) -> Tensor:
        B, H, Tq, D = q.shape
        Hkv = k.shape[1]
        G, bq, nq = H // Hkv, plan.bq, plan.nq
        dt = q.dtype
        qb = _blocked_q(q, Hkv, bq, nq)  # (B, Hkv, nq, G * bq, D)
        merge = plan.segments > 1
        # one query head per key/value head, whole blocks, one segment: the blocks are a view of the
        # result, written in place (no second (B, H, Tq, D) tensor)
        direct = not merge and G == 1 and nq * bq == Tq
        if direct:
            result = torch.zeros(B, H, Tq, D, dtype=dt)
            out = result.view(B, Hkv, nq, bq, D)
        else:
            out = torch.zeros(B, Hkv, nq, G * bq, D, dtype=torch.float32 if merge else dt)
        lse = torch.full((B, Hkv, nq, G * bq), float("-inf")) if merge else None  # (B, Hkv, nq, G * bq)
        for gi, g in enumerate(plan.groups):
            ck = g.keys.shape[1]
            for ci, (lo, hi) in enumerate(g.chunks):
                blk, n = g.blocks[lo:hi], hi - lo
                keys = g.keys[lo:hi].clamp(max=plan.kv_len - 1).reshape(-1)  # (n * ck,)
                kt = k.index_select(2, keys).view(B * Hkv * n, ck, D)  # (B·Hkv·n, ck, D)
                vt = v.index_select(2, keys).view(B * Hkv * n, ck, D)
                qt = qb.index_select(2, blk).view(B * Hkv * n, G * bq, D)  # (B·Hkv·n, G·bq, D)
                s = _scaled_bmm(qt, kt.transpose(1, 2), scale)  # (B·Hkv·n, G·bq, ck)
                blocked = plan.blocked(gi, ci)[:, None, :, None]  # (B|1, 1, n, 1, bq, ck)
                s.view(B, Hkv, n, G, bq, ck).masked_fill_(blocked, torch.finfo(dt).min)  # finite: no NaN rows
                o = torch.bmm(s.softmax(dim=-1), vt).view(B, Hkv, n, G * bq, D)  # (B, Hkv, n, G·bq, D)
                if not merge:
                    out.index_copy_(2, blk, o)
                    continue
                part = torch.logsumexp(s.float(), dim=-1).view(B, Hkv, n, G * bq)  # this segment's
                if g.segment == 0:
                    out.index_copy_(2, blk, o.float())
                    lse.index_copy_(2, blk, part)
                    continue
                before = lse.index_select(2, blk)  # (B, Hkv, n, G·bq)
                total = torch.logaddexp(before, part)
                mixed = out.index_select(2, blk) * (before - total).exp()[..., None]
                out.index_copy_(2, blk, mixed + o.float() * (part - total).exp()[..., None])
                lse.index_copy_(2, blk, total)
        if plan.live is not None:
            out.masked_fill_(_dead(plan, out.shape), 0.0)  # rows that may attend to nothing
        if not direct:
            result = _unblocked(out.to(dt), H, Tq)  # (B, H, Tq, D)
        ctx.plan, ctx.scale = plan, scale
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        B, H, Tq, D = q.shape
        Hkv = k.shape[1]
        G, bq, nq = H // Hkv, plan.bq, plan.nq
        dt = q.dtype
        qb = _blocked_q(q, Hkv, bq, nq)  # (B, Hkv, nq, G * bq, D)
        do = _blocked_q(grad.to(dt), Hkv, bq, nq)  # (B, Hkv, nq, G * bq, D)
        if plan.live is not None:
            do = do.masked_fill(_dead(plan, do.shape), 0.0)  # no gradient through empty rows
        ob = _blocked_q(out, Hkv, bq, nq)  # (B, Hkv, nq, G * bq, D)
        delta = torch.empty(do.shape[:-1])  # (B, Hkv, nq, G·bq): rowsum(dO∘O), a few blocks at a time
        step = max(1, SCORE_BUDGET // max(1, B * Hkv * do.shape[3] * D))
        for i in range(0, nq, step):
            delta[:, :, i : i + step] = (do[:, :, i : i + step].float() * ob[:, :, i : i + step].float()).sum(dim=-1)
        acc = torch.float32
        dq = torch.zeros(qb.shape, dtype=acc)  # (B, Hkv, nq, G * bq, D)
        dk = torch.zeros(k.shape, dtype=acc)  # (B, Hkv, Tk, D)
        dv = torch.zeros(v.shape, dtype=acc)
        for gi, g in enumerate(plan.groups):
            ck = g.keys.shape[1]
            for ci, (lo, hi) in enumerate(g.chunks):
                blk, n = g.blocks[lo:hi], hi - lo
                keys = g.keys[lo:hi].clamp(max=plan.kv_len - 1).reshape(-1)  # (n * ck,)
                kt = k.index_select(2, keys).view(B * Hkv * n, ck, D)  # (B·Hkv·n, ck, D)
                vt = v.index_select(2, keys).view(B * Hkv * n, ck, D)
                qt = qb.index_select(2, blk).view(B * Hkv * n, G * bq, D)  # (B·Hkv·n, G·bq, D)
                dot = do.index_select(2, blk).view(B * Hkv * n, G * bq, D)
                s = _scaled_bmm(qt, kt.transpose(1, 2), scale)  # (B·Hkv·n, G·bq, ck)
                blocked = plan.blocked(gi, ci)[:, None, :, None]  # (B|1, 1, n, 1, bq, ck)
                s.view(B, Hkv, n, G, bq, ck).masked_fill_(blocked, torch.finfo(dt).min)
                if lse is None:
                    p = s.softmax(dim=-1)  # (B·Hkv·n, G·bq, ck): the block's keys are all here
                else:
                    rows = lse.index_select(2, blk).view(B * Hkv * n, G * bq, 1)
                    p = (s.float() - rows).exp_().to(dt)
                dv_t = torch.bmm(p.transpose(1, 2), dot)  # (B·Hkv·n, ck, D)
                dp = torch.bmm(dot, vt.transpose(1, 2))  # (B·Hkv·n, G·bq, ck)
                ds = (dp - delta.index_select(2, blk).view(B * Hkv * n, G * bq, 1)).mul_(p).to(dt)  # dS
                dq_t = _scaled_bmm(ds, kt, scale)  # (B·Hkv·n, G·bq, D)
                dk_t = _scaled_bmm(ds.transpose(1, 2), qt, scale)  # (B·Hkv·n, ck, D)
                dq.index_add_(2, blk, dq_t.view(B, Hkv, n, G * bq, D).to(acc))
                dk.index_add_(2, keys, dk_t.view(B, Hkv, n * ck, D).to(acc))
                dv.index_add_(2, keys, dv_t.view(B, Hkv, n * ck, D).to(acc))
        return _unblocked(dq, H, Tq).to(dt), dk.to(dt), dv.to(dt), None, None


def _scaled_bmm(a: Tensor, b: Tensor, scale: float) -> Tensor:
    """``scale * (a @ b)`` for batches of matrices, the scale applied inside the product."""
    return torch.baddbmm(a.new_empty(1, 1, 1), a, b, beta=0, alpha=scale)  # beta=0: the input is ignored


def tile_attention(q: Tensor, k: Tensor, v: Tensor, plan: TilePlan, scale: float) -> Tensor:
    """``softmax(QKᵀ·scale + M) V`` over the plan's tiles: q ``(B, H, Tq, D)``, k, v ``(B, Hkv, Tk, D)``."""
    return _TileAttention.apply(q, k, v, plan, scale)
