"""The one decoding step: a forward step over a packed batch, every sequence's new tokens in one row of ``N``.

Each sequence contributes a chunk: a prefill chunk of its prompt or one decode token, at its own cache
offset. The chunks are concatenated (``tokens``, ``positions``, ``row_seq``: for each of the ``N`` rows
its token, its position in its sequence and which sequence it belongs to); keys and values go into a
:class:`~attnmask.model.cache.PagedKVCache` through each sequence's block table. Greedy, sampled and beam
decoding (:mod:`attnmask.decode.steps`, :mod:`attnmask.decode.beam`), the serving engine
(:mod:`attnmask.engine`) and the audit's cache checks all run this one step.

Self-attention is the mask algebra's ``document(sequence ids) & causal`` with each sequence's own
offset (``& sliding_window`` on the layers the model's config gives a window, :meth:`layer_window`):
:func:`packed_mask` builds it over the packed rows and the sequences' keys, for the reference path and
the tests. On the CPU its lowering is one range of keys per row, ``[pos - window + 1, pos]`` of the
row's own sequence, which is what the operator :func:`attnmask.ops.decoding.paged_attend` computes
without materialising anything.

Encoder-decoder models attend to their source too (:class:`SourceMemory`): each sequence's encoder keys
and values are projected once, when it starts, into one block per source, and each row attends to its
own sequence's source only, all of it (``document`` between rows and source positions, no causality):
``paged_attend`` again, each source a one-block table read up to its last real position.

**Batch invariance.** A row's result must not depend on which rows it is packed with, where it sits in the
pack, or how its sequence's prompt was chunked, bit for bit. Every operation here is either elementwise, a
reduction within one row (norms: the native ``rms_norm``), a product whose every output is computed by the
same operations whatever the number of rows (the native ``linear_panels`` for float32 weights, packed once
into panels; ``block_matmul`` for GGUF blocks: threads split the weight's rows, never a sum), or the paged
attention (each row and head alone, keys in order). Where the native kernels are not built, products run one
row at a time (the BLAS's result for a row depends on the shape of the whole product otherwise): the same
guarantee, slower. A module a hook watches is called as it is, on all the rows (the hook sees the call; the
BLAS then decides the bits).

For a pre-norm RMSNorm decoder with a gated MLP in float32 or GGUF blocks (Llama, SmolLM2, Gemma 3
with its q/k norms, post-sublayer norms, per-layer rotary and windows and its layer groups) the whole
step is one native call (``packed_step``, :func:`fused_plan`); so is an encoder-decoder's decoder
(``seq2seq_step``: LayerNorm or RMSNorm, pre- or post-norm as in the original Transformer and Marian,
rotary or not, source attention, a plain or gated MLP), which makes the operators of the
per-operation path in the same order from C++, so the same bits. Every other model (a decoder-only
model with post-norm, LayerNorm or an MLP without a gate, a module watched by a hook, weights in
another dtype) takes the per-operation path, batch-invariant too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnmask import masks, ops
from attnmask.attention.backends import flex_available, flex_call
from attnmask.errors import UserError
from attnmask.linear import Linear
from attnmask.model.cache import PagedKVCache
from attnmask.model.layers import MLP, RMSNorm, Rotary
from attnmask.ops import decoding

__all__ = [
    "FusedPlan", "Seq2SeqPlan", "SourceMemory", "check_servable", "fused_plan", "logical_blocks", "packed_forward",
    "packed_mask", "paged_mask", "prepare_screen", "screened_head", "slots_of",
]  # fmt: skip


def packed_mask(row_seq: Tensor, row_pos: Tensor, key_seq: Tensor, key_pos: Tensor, window: int = 0) -> masks.Mask:
    """The packed step's attention mask, in the algebra: rows ``(N,)`` (sequence, position) against keys
    ``(K,)`` (sequence, position): ``document & causal`` with each sequence's own offset, ``&`` a
    sliding window of ``window`` keys (0: none). Batch 1: ``to_bool(1, N, K)``."""
    same = masks.document(key_seq[None], query_segment_ids=row_seq[None])  # a row sees only its own sequence
    # top-left: q and kv are the row and key indices (positions live in row_pos / key_pos)
    causal = masks.from_predicate(lambda b, h, q, kv: key_pos[kv] <= row_pos[q], align="top_left")
    mask = same & causal
    if window > 0:
        mask = mask & masks.from_predicate(lambda b, h, q, kv: key_pos[kv] > row_pos[q] - window, align="top_left")
    return mask


def paged_mask(row_seq: Tensor, row_pos: Tensor, logical: Tensor, block_size: int, window: int = 0) -> masks.Mask:
    """The packed step's mask over the pool's key slots, as FlexAttention reads the cache in place:
    row ``q`` (sequence ``row_seq[q]``, position ``row_pos[q]``) against slot ``kv`` of the flattened
    pool ``(P S,)``. ``logical (Q', P)``: the index of physical block ``p`` in sequence ``s``'s block table,
    -1 where the block is not the sequence's (:func:`logical_blocks`), so slot ``kv`` holds position
    ``logical[s, kv // S] * S + kv % S`` of sequence ``s``. ``document`` (the slot is one of the row's own
    sequence's: a block shared by beams belongs to each of them) ``& causal`` at each sequence's own
    offset ``&`` a sliding window of ``window`` keys (0: none); the same mask as :func:`packed_mask`,
    over physical slots instead of a sequence's logical keys."""
    S = block_size

    def block(q, kv):  # the slot's block's place in the row's sequence, -1 where it is another's
        return logical[row_seq[q], kv // S]

    def key_pos(q, kv):
        return block(q, kv) * S + kv % S

    own = masks.from_predicate(lambda b, h, q, kv: block(q, kv) >= 0, align="top_left")
    mask = own & masks.from_predicate(lambda b, h, q, kv: key_pos(q, kv) <= row_pos[q], align="top_left")
    if window > 0:
        mask = mask & masks.from_predicate(lambda b, h, q, kv: key_pos(q, kv) > row_pos[q] - window, align="top_left")
    return mask


def logical_blocks(tables: Tensor, num_blocks: int, rows: int | None = None) -> Tensor:
    """``(rows, P)`` int32: for each sequence (a row of ``tables (Q, W)``) and physical block ``p``, the
    index ``w`` with ``tables[q, w] == p``, -1 where ``p`` is not in the table (the null block 0 never
    is). ``rows >= Q`` pads with sequences that own nothing."""
    Q, W = tables.shape
    out = torch.full((max(Q, rows or 0), num_blocks), -1, dtype=torch.int32, device=tables.device)
    where = torch.arange(W, dtype=torch.int32, device=tables.device).expand(Q, W).contiguous()
    out[:Q].scatter_(1, tables.long(), where)
    out[:, 0] = -1  # null entries all point at block 0
    return out


def slots_of(tables: Tensor, row_seq: Tensor, row_pos: Tensor, block_size: int) -> Tensor:
    """Flat pool index ``block * S + offset`` of each row's position in its sequence ``(N,)``."""
    return tables[row_seq, row_pos // block_size] * block_size + row_pos % block_size


def check_servable(model) -> None:
    """Raise UserError unless the packed step can run ``model``: an attnmask Transformer."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "layers"):
        raise UserError(f"the engine serves attnmask Transformers; got {type(model).__name__}")


@dataclass
class SourceMemory:
    """Encoder-decoder models: every source's cross-attention keys and values, one block per source.

    ``k[layer]``, ``v[layer]``: ``(Q, S, Hkv, D)``, source ``q``'s real positions first (the rest is
    never read); ``lengths (Q,)``: real positions of each source. A row attends to the source its
    sequence names (``row_src`` in :func:`packed_forward`), all of its real positions."""

    k: list[Tensor]
    v: list[Tensor]
    lengths: Tensor

    @classmethod
    @torch.no_grad()
    def encode(cls, model, src_ids: Tensor, keep: Tensor | None) -> SourceMemory:
        """Run the encoder once over ``src_ids (B, S)`` (``keep (B, S)``: real positions, None: all) and
        project every layer's keys and values, each source's real positions first.

        Right-padded sources (each row's real positions a prefix) are encoded packed: their real tokens
        in one row, positions restarting at each source, so no work goes to padding (a batch of 64
        sentences sorted by length pads the longest's batch by up to half). On the CPU in float32 with
        the native kernels, each source's memory is then the bits it has encoded alone, whatever the
        batch (:meth:`_encode_rows`); elsewhere it is the general forward with a ``document`` mask,
        each source's memory what it is alone up to float32 rounding."""
        B, S = src_ids.shape
        padding = None if keep is None else masks.padding(keep=keep)
        if keep is None:
            if src_ids.is_cpu and _rows_encoder(model):
                return cls._encode_rows(model, src_ids.reshape(-1), torch.full((B,), S, dtype=torch.long), None)
            return cls.project(model, model.encode(src_ids, None), None)
        spans = None if not keep.is_cpu else padding.spans(B, S)
        prefixes = spans is not None and not any(spans[0]) and min(spans[1]) > 0  # each row real from 0, none empty
        if prefixes and _rows_encoder(model):
            return cls._encode_rows(model, src_ids[keep], keep.sum(1), keep)
        if prefixes and B > 1:
            return cls._encode_packed(model, src_ids, keep, keep.sum(1))
        memory = model.encode(src_ids, padding)  # (B, S, C)
        return cls.project(model, memory, keep)

    @classmethod
    def _encode_packed(cls, model, src_ids: Tensor, keep: Tensor, lengths: Tensor) -> SourceMemory:
        from attnmask.model.transformer import segment_positions

        segments = torch.repeat_interleave(torch.arange(len(lengths), device=src_ids.device), lengths)[None]  # (1, T)
        memory = model.encode(src_ids[keep][None], masks.document(segments), positions=segment_positions(segments))
        ks, vs = [], []
        for layer in model.layers:
            k, v = layer.cross_attn.project_kv(memory)  # (1, Hkv, T, D)
            for packed, out in ((k, ks), (v, vs)):
                full = packed.new_zeros(*keep.shape, *packed.shape[1:2], packed.shape[3])  # (B, S, Hkv, D)
                full[keep] = packed[0].transpose(0, 1)
                out.append(full)
        return cls(ks, vs, lengths.cpu().to(src_ids.device))

    @classmethod
    def _encode_rows(cls, model, ids: Tensor, lengths: Tensor, keep: Tensor | None) -> SourceMemory:
        """The encoder over the sources' real tokens ``ids (T,)`` packed in one row (``lengths (Q,)`` of
        them each), as the decoder's packed step computes: every product one whose rows are computed
        alone (``linear_panels``), each source's keys and values one block that its rows attend to whole
        (``paged_attend``), norms and activations row by row. A source's memory is the same bits alone
        or in any batch, and so are its translations (the decoder's step is batch-invariant too)."""
        Q, S = lengths.shape[0], int(lengths.max())
        segments = torch.repeat_interleave(torch.arange(Q), lengths)  # (T,)
        starts = torch.cumsum(lengths, 0) - lengths  # (Q,)
        positions = torch.arange(ids.shape[0]) - starts[segments]  # (T,): restarting at each source
        # a source longer than the model's positions: a clear error
        model._positions(positions[None], 1, positions.shape[0], positions.device)
        last = (lengths - 1)[segments]  # (T,): each row reads its source whole
        tables = torch.arange(Q)[:, None]  # (Q, 1): one block per source
        x = model._embed(ids[None], positions[None], source=True)[0]  # (T, C)
        rope = None
        if model.config.positions == "rotary":
            cos, sin = model.rotary.cos_sin(positions[None])  # (1, 1, T, D)
            rope = (cos[0, 0][:, None], Rotary.signed_sin(sin)[0, 0][:, None])  # (T, 1, D)
        layers = model.encoder_layers
        attn = layers[0].self_attn
        shape = (Q, S, attn.num_kv_heads, attn.head_dim)
        pools = _Pools([x.new_empty(shape) for _ in layers], [x.new_empty(shape) for _ in layers])
        slots = segments * S + positions  # (T,)
        for i, layer in enumerate(layers):
            mods = layer._modules

            def attend(h, attn=mods["self_attn"], i=i):
                return _self_attention(attn, h, rope, pools, i, slots, tables, segments, last, 0)

            sublayers = [
                (mods["self_norm"], attend, getattr(layer, "post_self_norm", None)),
                (mods["mlp_norm"], lambda h, m=mods["mlp"]: _mlp(m, h), getattr(layer, "post_mlp_norm", None)),
            ]
            for norm, fn, post in sublayers:
                x = x + _norm(post, fn(_norm(norm, x))) if layer.pre else _norm(norm, x + _norm(post, fn(x)))
        memory = _norm(model.encoder_norm, x)  # (T, C)
        ks, vs = [], []
        for layer in model.layers:
            cross = layer.cross_attn
            for proj, out in ((cross.k_proj, ks), (cross.v_proj, vs)):
                packed = _product(proj, memory).reshape(-1, cross.num_kv_heads, cross.head_dim)  # (T, Hkv, D)
                if keep is None:
                    out.append(packed.reshape(Q, S, *packed.shape[1:]))
                else:
                    full = packed.new_zeros(*keep.shape, *packed.shape[1:])  # (B, S, Hkv, D)
                    full[keep] = packed
                    out.append(full)
        return cls(ks, vs, lengths.clone())

    @classmethod
    @torch.no_grad()
    def project(cls, model, memory: Tensor, keep: Tensor | None) -> SourceMemory:
        """Every layer's keys and values of encoder output ``memory (B, S, C)``, each source's real
        positions (``keep (B, S)``, None: all) first."""
        B, S = memory.shape[:2]
        if keep is None:
            lengths = torch.full((B,), S, dtype=torch.long)
            gather = None
        else:
            lengths = keep.sum(1).cpu()  # (B,)
            # each source's real positions in order, first: their index among the columns
            gather = torch.sort(~keep, dim=1, stable=True).indices.to(memory.device)  # (B, S)
        ks, vs = [], []
        for layer in model.layers:
            k, v = layer.cross_attn.project_kv(memory)  # (B, Hkv, S, D)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, S, Hkv, D)
            if gather is not None:
                index = gather[:, :, None, None].expand_as(k)
                k, v = k.gather(1, index), v.gather(1, index)
            ks.append(k.contiguous())
            vs.append(v.contiguous())
        return cls(ks, vs, lengths.to(memory.device))

    @property
    def every_source_real(self) -> bool:
        """No source is padding alone (its rows then attend to nothing and get zeros)."""
        if not hasattr(self, "_every_real"):
            self._every_real = bool((self.lengths > 0).all())
        return self._every_real

    @property
    def tables(self) -> Tensor:
        """One block per source: ``(Q, 1)``."""
        return torch.arange(self.lengths.shape[0], device=self.lengths.device)[:, None]


class _Pools(NamedTuple):
    """Key and value pools a layer, where a step reads a cache: the encoder's, one block per source."""

    k: list[Tensor]
    v: list[Tensor]


def _rows_encoder(model) -> bool:
    """Whether :meth:`SourceMemory._encode_rows` runs ``model``'s encoder: float32 on the CPU, with the native
    kernels (elsewhere each row's products would run one at a time), in eval mode, the cross-attention's
    keys and values in products of their own."""
    if model.training or not ops.available() or any(layer.cross_attn.k_proj is None for layer in model.layers):
        return False
    return all(p.is_cpu and p.dtype == torch.float32 for p in model.parameters())


def _native(t: Tensor) -> bool:
    return t.is_cpu and t.dtype == torch.float32 and ops.available()


def _watched(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _product(proj: nn.Module, x: Tensor) -> Tensor:
    """``proj(x)`` for rows ``x (N, K)``, each row's result independent of the others (see the module's
    docstring)."""
    if _watched(proj):
        return proj(x)
    matmul_rows = getattr(proj, "matmul_rows", None)  # GGUF block layers
    if matmul_rows is not None:
        if _native(x):
            return matmul_rows(x)
    elif type(proj) in (nn.Linear, Linear) and _native(x):
        w, b = proj.weight, proj.bias
        if w.dtype == torch.float32 and w.is_contiguous():
            return decoding.linear_panels(x, decoding.panels(w), b, w.shape[0])
    if not x.is_cpu:
        return proj(x)  # on a GPU the kernels are not row-invariant here (documented)
    return torch.cat([proj(x[i : i + 1]) for i in range(x.shape[0])]) if x.shape[0] > 1 else proj(x)


def _norm(norm: nn.Module | None, x: Tensor) -> Tensor:
    if norm is None:
        return x
    if type(norm) is RMSNorm and _native(x) and norm.weight.dtype == torch.float32 and not _watched(norm):
        return decoding.rms_norm(x.contiguous(), norm.weight, norm.eps)
    return norm(x)


_ACTIVATIONS = {
    "swiglu": F.silu,
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "geglu": lambda t: F.gelu(t, approximate="tanh"),
}


def _activation(mlp: nn.Module):
    """The MLP's own activation: SiLU for SwiGLU (which the native ``silu_mul`` computes), else its
    ``act`` / ``act_fn`` module or method where it has one, else the one its ``activation`` name says."""
    if mlp.activation in ("swiglu", "silu"):
        return F.silu
    for name in ("act", "act_fn"):
        fn = getattr(mlp, name, None)
        if callable(fn):
            return fn
    return _ACTIVATIONS.get(mlp.activation, F.silu)


def _mlp(mlp: nn.Module, h: Tensor) -> Tensor:
    gate_up = getattr(mlp, "gate_up_proj", None)
    gate = getattr(mlp, "gate_proj", None)
    act = _activation(mlp)
    if gate_up is not None:
        both = _product(gate_up, h)
        if act is F.silu and _native(both):
            a = decoding.silu_mul(both)
        else:
            g, u = both.chunk(2, -1)
            a = act(g) * u
    elif gate is not None:
        a = act(_product(gate, h)) * _product(mlp.up_proj, h)
    else:
        a = act(_product(mlp.up_proj, h))
    return _product(mlp.down_proj, a)


def _attend(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables, row_seq, row_pos, window: int, H: int, D: int):
    # the native kernel reads float32 CPU tensors; other dtypes take the operator's PyTorch definition
    native = _native(q) and k_pool.dtype == torch.float32
    attend = decoding.paged_attend if native else decoding.paged_attend_reference
    return attend(q.contiguous(), k_pool, v_pool, tables, row_seq, row_pos, window, H, D**-0.5)  # (N, H D)


class _FlexMasks:
    """The step's FlexAttention ``BlockMask`` per (layer group, window), built on first use and shared by
    the layers of that kind: :func:`paged_mask` over the whole pool, the rows padded to a multiple of
    128 (one query block; the padding rows see no key) so that a serving loop's steps fall in a few
    shapes and compile a few times."""

    QUANTUM = 128

    def __init__(self, cache: PagedKVCache, tables: list[Tensor], row_seq: Tensor, row_pos: Tensor):
        N = row_seq.shape[0]
        self.rows = -(-N // self.QUANTUM) * self.QUANTUM
        self.cache, self.tables, self.built = cache, tables, {}
        pad = self.rows - N
        self.row_seq = F.pad(row_seq, (0, pad))  # padding rows: sequence 0 at position -1, no key
        self.row_pos = F.pad(row_pos, (0, pad), value=-1)

    def __call__(self, group: int, window: int):
        key = (group, window)
        if key not in self.built:
            cache = self.cache
            logical = logical_blocks(self.tables[group], cache.num_blocks, self.rows)
            mask = paged_mask(self.row_seq, self.row_pos, logical, cache.block_size, window)
            keys = cache.num_blocks * cache.block_size
            self.built[key] = mask.block_mask(1, self.rows, keys, device=self.row_seq.device)
        return self.built[key]


def _attend_flex(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_mask, H: int, D: int) -> Tensor:
    """Rows ``q (N, H D)`` against the whole pool through FlexAttention, ``block_mask`` skipping every
    block of keys no row may see; the cache is read in place (a strided view), nothing gathered."""
    N = q.shape[0]
    P, S, Hkv, _ = k_pool.shape
    rows = block_mask.shape[-2]
    qq = k_pool.new_zeros(rows, H, D)  # in the cache's dtype (rotary may have made q float32)
    qq[:N] = q.reshape(N, H, D)
    qq = qq.permute(1, 0, 2)[None]  # (1, H, rows, D)
    k = k_pool.view(P * S, Hkv, D).permute(1, 0, 2)[None]  # (1, Hkv, P S, D), a view of the pool
    v = v_pool.view(P * S, Hkv, D).permute(1, 0, 2)[None]
    options = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2} if qq.is_cuda else None  # fits shared memory
    out = flex_call(qq, k, v, block_mask=block_mask, scale=D**-0.5, enable_gqa=Hkv != H, kernel_options=options)
    return out[0, :, :N].permute(1, 0, 2).reshape(N, H * D).to(q.dtype)


def _self_attention(
    attn, h: Tensor, rope, cache: PagedKVCache, layer: int, slots, tables, row_seq, row_pos, window, flex=None
):
    N = h.shape[0]
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if attn.qkv_proj is not None:
        q, k, v = _product(attn.qkv_proj, h).split([H * D, Hkv * D, Hkv * D], dim=-1)
    else:
        q, k, v = _product(attn.q_proj, h), _product(attn.k_proj, h), _product(attn.v_proj, h)
    q, k, v = q.reshape(N, H, D), k.reshape(N, Hkv, D), v.reshape(N, Hkv, D)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q_norm is not None:  # Gemma 3: each head of q and k normalised before the rotation
        q = _norm(q_norm, q.reshape(N * H, D)).reshape(N, H, D)
    if k_norm is not None:
        k = _norm(k_norm, k.reshape(N * Hkv, D)).reshape(N, Hkv, D)
    if rope is not None:
        q, k = Rotary.rotate_signed(q, *rope), Rotary.rotate_signed(k, *rope)  # elementwise per row
    k_pool, v_pool = cache.k[layer], cache.v[layer]
    k_pool.view(-1, Hkv, D).index_copy_(0, slots, k.to(k_pool.dtype))  # each row's key into its slot
    v_pool.view(-1, Hkv, D).index_copy_(0, slots, v.to(v_pool.dtype))
    if flex is not None:
        out = _attend_flex(q.reshape(N, H * D), k_pool, v_pool, flex(cache.layer_group[layer], window), H, D)
    else:
        out = _attend(q.reshape(N, H * D), k_pool, v_pool, tables, row_seq, row_pos, window, H, D)
    return _product(attn.o_proj, out)


def _cross_attention(attn, h: Tensor, memory: SourceMemory, layer: int, src_tables, row_src, src_last, src_real):
    H, D = attn.num_heads, attn.head_dim
    q = _product(attn.q_proj, h)  # (N, H D)
    out = _attend(q, memory.k[layer], memory.v[layer], src_tables, row_src, src_last, 0, H, D)  # (N, H D)
    if src_real is not None:
        out = out * src_real
    return _product(attn.o_proj, out)


def _layer_window(cfg, i: int) -> int:
    window = getattr(cfg, "layer_window", None)
    return int(window(i)) if window is not None else int(getattr(cfg, "sliding_window", 0) or 0)


def screened_head(model, rows: int = 1) -> nn.Module | None:
    """The head where :func:`head_argmax_of` can find its arg-max without the logits, native kernels built;
    else None: a plain float32 CPU linear map, unwatched, large enough to pay for ``rows`` rows
    (:func:`~attnmask.ops.decoding.screens`), or a block head in the 8-bit layout (Q8_0, Q5_0) with float32
    activations, for ``BLOCK_SCREEN_MIN_ROWS`` rows or more where the int8 estimates run fast
    (:func:`~attnmask.ops.decoding.block_argmax_rows`; at fewer rows its reading is what the head costs)."""
    head = model.lm_head
    if _block_head(head) and head.kind in ("Q8_0", "Q5_0"):
        fits = head.activations == "float32" and head.codes.is_cpu and not _watched(head)
        return head if fits and rows >= decoding.BLOCK_SCREEN_MIN_ROWS and decoding.estimates_fast() else None
    if type(head) not in (nn.Linear, Linear) or _watched(head):
        return None
    w, b = head.weight, head.bias
    if not (w.is_contiguous() and _native(w)) or not decoding.screens(w, rows):
        return None
    return head if b is None or (b.dtype == torch.float32 and b.is_contiguous()) else None


def _headless(products: list[Tensor], kinds: list[int]) -> tuple[list[Tensor], list[int]]:
    """A fused plan's products and kinds with the head's slot empty (kind NONE, its two tensors dropped): the
    step then returns the final norm's rows, for :func:`head_argmax_of`."""
    return products[:-2], [*kinds[:-1], decoding.NONE]


def _block_head(head: nn.Module) -> bool:
    return hasattr(head, "decoder_operands")  # a BlockLinear (pretrained is a layer above decode: not imported)


def prepare_screen(model) -> None:
    """Make the head's screen now (the weight's 8-bit copy and bounds, or a block head's row norms), where
    greedy steps of one row or of many will read it, rather than in the first request's step."""
    for rows in (1, decoding.BLOCK_SCREEN_MIN_ROWS, decoding.SCREEN_MAX_ROWS + 1):
        head = screened_head(model, rows)
        if head is not None and _block_head(head):
            decoding.block_norms(head.panels()[0], head.out_features)
        elif head is not None:
            decoding.screen(head.weight)


def head_argmax_of(head: nn.Module, h: Tensor) -> Tensor:
    """Each row's first largest logit of ``head(h)``, the logits' own arg-max, through the head's screen
    (``head``: :func:`screened_head`'s)."""
    if _block_head(head):
        return decoding.block_argmax_rows(h, head.panels()[0], head.out_features)
    return decoding.argmax_rows(h, head.weight, head.bias)


def _operands(proj: nn.Module | None) -> tuple[int, list[Tensor]] | None:
    """A product as ``packed_step`` takes it: GGUF blocks, or a float32 weight in panels and its bias."""
    if proj is None or _watched(proj):
        return None  # a watched module must be called
    blocks = getattr(proj, "decoder_operands", None)
    if blocks is not None:
        return blocks()
    if type(proj) in (nn.Linear, Linear):
        w, b = proj.weight, proj.bias
        if w.dtype == torch.float32 and w.is_cpu and w.is_contiguous():
            return decoding.DENSE, [decoding.panels(w), decoding.bias_operand(w, b)]
    return None


def _take_operands(slots: list[tuple[nn.Module | None, bool]], kinds: list[int], products: list[Tensor]) -> bool:
    """Append each ``(module, optional)`` slot's product kind and tensors (:func:`_operands`; ``NONE`` for an
    optional slot without a module); False where a product cannot be taken."""
    for proj, optional in slots:
        operands = (decoding.NONE, []) if proj is None and optional else _operands(proj)
        if operands is None:
            return False
        kinds.append(operands[0])
        products += operands[1]
    return True


def _norm_operand(norm: nn.Module | None, optional: bool) -> Tensor | None:
    """A norm's weight as ``packed_step`` takes it (an empty tensor for an optional norm a layer lacks);
    None where the step cannot compute it (not an RMSNorm in float32, or watched)."""
    if norm is None:
        return torch.empty(0) if optional else None
    if type(norm) is not RMSNorm or _watched(norm):
        return None
    w = norm.weight
    return w if w.dtype == torch.float32 and w.is_cpu and w.is_contiguous() else None


_STEP_ACTIVATIONS = {"swiglu": "silu", "silu": "silu", "geglu_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _step_activation(mlp: nn.Module) -> str | None:
    """The gated MLP's activation as ``packed_step`` names it; None for an MLP the step does not make (not
    gated, another activation, or ``act`` replaced on the module)."""
    if type(mlp) is not MLP or not mlp.gated or "act" in vars(mlp) or "act_fn" in vars(mlp):
        return None
    return _STEP_ACTIVATIONS.get(mlp.activation)


class FusedPlan(NamedTuple):
    """What :func:`attnmask.ops.decoding.packed_step` needs of a model, read once (:func:`fused_plan`):
    its lists of norms and products in the operator's slots, and the per-layer choices."""

    norms: list[Tensor]  # NORMS a layer (empty: none), then the final norm
    eps: list[float]
    products: list[Tensor]  # PRODUCTS slots a layer, then the head, their tensors as kinds says
    kinds: list[int]
    activation: str  # "silu" or "gelu_tanh"
    rotaries: list[Rotary]  # the distinct rotary modules (none: positions without rotary)
    layer_rope: list[int]  # each layer's index in rotaries
    windows: list[int]  # each layer's window (0: none)
    heads: int
    kv_heads: int
    head_dim: int


class Seq2SeqPlan(NamedTuple):
    """What :func:`attnmask.ops.decoding.seq2seq_step` needs of an encoder-decoder (:func:`fused_plan`)."""

    norms: list[Tensor]  # (weight, bias) pairs: S2S_NORMS a layer (an empty bias: none), then the final norm's
    eps: list[float]
    pre: bool  # norms before the sublayers (else after their residuals)
    rms: bool  # RMSNorm (else LayerNorm)
    products: list[Tensor]  # S2S_PRODUCTS slots a layer, then the head
    kinds: list[int]
    activation: str  # "silu", "relu", "gelu" or "gelu_tanh"
    windows: list[int]
    heads: int
    kv_heads: int
    head_dim: int


def fused_plan(model) -> FusedPlan | Seq2SeqPlan | None:
    """What :func:`attnmask.ops.decoding.packed_step` needs of ``model`` (norm weights and eps, product
    tensors and kinds, each layer's rotary and window), read once; None where the whole step cannot be
    one native call: the model is not a pre-norm RMSNorm decoder with a SiLU- or tanh-GELU-gated MLP
    whose weights are float32 or GGUF blocks on the CPU, a module is watched by a hook, or the native
    kernels are not built. Gemma 3's parts (q/k norms, post-sublayer norms, a rotary and a window per
    layer) are the step's own. An encoder-decoder gets :func:`seq2seq_step`'s plan instead, where it
    allows (:class:`Seq2SeqPlan`). Other models take the per-operation path, which is batch-invariant too."""
    cfg = model.config
    if model.training:
        return None
    if any(not (p.is_cpu and p.dtype == torch.float32) for p in model.parameters()) or not ops.available():
        return None
    if model.is_encoder_decoder:
        return _seq2seq_plan(model)
    if cfg.norm_position != "pre":
        return None
    per_layer = getattr(model, "layer_rotary", None)
    rotaries: list[Rotary] = []
    norms: list[Tensor | None] = []
    eps: list[float] = []
    products, kinds, layer_rope, activations = [], [], [], set()
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(layer, "cross_attn", None) is not None or not layer.pre:
            return None
        if any(_watched(m) for m in (layer, attn, mlp)):
            return None
        parts = [
            (layer.self_norm, False),
            (getattr(attn, "q_norm", None), True),
            (getattr(attn, "k_norm", None), True),
            (getattr(layer, "post_self_norm", None), True),
            (layer.mlp_norm, False),
            (getattr(layer, "post_mlp_norm", None), True),
        ]
        for norm, optional in parts:
            norms.append(_norm_operand(norm, optional))
            eps.append(float(getattr(norm, "eps", 0.0)))
        activation = _step_activation(mlp)
        if activation is None:
            return None
        activations.add(activation)
        fused_qkv, fused_gate_up = attn.qkv_proj is not None, mlp.gate_up_proj is not None
        qkv = [attn.qkv_proj, None, None] if fused_qkv else [attn.q_proj, attn.k_proj, attn.v_proj]
        mlps = [mlp.gate_up_proj, None] if fused_gate_up else [mlp.gate_proj, mlp.up_proj]
        slots = [
            *zip(qkv, (False, True, True)),
            (attn.o_proj, False),
            *zip(mlps, (False, True)),
            (mlp.down_proj, False),
        ]
        if not _take_operands(slots, kinds, products):
            return None
        rotary = (per_layer(i) if per_layer is not None else model.rotary) if cfg.positions == "rotary" else None
        if cfg.positions == "rotary" and rotary is None:
            return None
        if rotary is not None and all(r is not rotary for r in rotaries):
            rotaries.append(rotary)
        layer_rope.append(next((j for j, r in enumerate(rotaries) if r is rotary), 0))
    norms.append(_norm_operand(model.norm, False))
    eps.append(float(getattr(model.norm, "eps", 0.0)))
    if (
        any(n is None for n in norms)
        or len(activations) != 1
        or not _take_operands([(model.lm_head, False)], kinds, products)
    ):
        return None
    attn = model.layers[0].self_attn
    windows = [_layer_window(cfg, i) for i in range(len(model.layers))]
    return FusedPlan(
        norms, eps, products, kinds, activations.pop(), rotaries, layer_rope, windows,
        attn.num_heads, attn.num_kv_heads, attn.head_dim,
    )  # fmt: skip


# an MLP's activation as seq2seq_step names it, as MLP.act computes it (any other name: erf GELU)
_S2S_ACTIVATIONS = {
    "swiglu": "silu",
    "silu": "silu",
    "geglu_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "relu": "relu",
}


def _s2s_norm(norm: nn.Module | None, rms: bool) -> tuple[Tensor, Tensor] | None:
    """A norm as ``seq2seq_step`` takes it, ``(weight, bias)`` (an empty bias: none); None where the step
    cannot compute it: not the model's kind of norm over its width, not float32, or watched."""
    if norm is None or _watched(norm):
        return None
    if rms:
        return (norm.weight, torch.empty(0)) if type(norm) is RMSNorm and norm.weight.is_contiguous() else None
    if type(norm) is not nn.LayerNorm or norm.weight is None or len(norm.normalized_shape) != 1:
        return None
    bias = norm.bias if norm.bias is not None else torch.empty(0)
    return (norm.weight, bias) if norm.weight.is_contiguous() and bias.is_contiguous() else None


def _seq2seq_plan(model) -> Seq2SeqPlan | None:
    """:func:`fused_plan` of an encoder-decoder: its decoder's lists in ``seq2seq_step``'s slots."""
    cfg = model.config
    if cfg.norm not in ("layernorm", "rmsnorm"):
        return None
    if any(model.layer_rotary(i) is not getattr(model, "rotary", None) for i in range(len(model.layers))):
        return None  # one rotary for every layer (or none), as the step takes it
    rms = cfg.norm == "rmsnorm"
    pairs: list[tuple[Tensor, Tensor] | None] = []
    eps: list[float] = []
    products, kinds, activations = [], [], set()
    attn = model.layers[0].self_attn
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    for layer in model.layers:
        attn, cross, mlp = layer.self_attn, layer.cross_attn, layer.mlp
        if cross is None or any(_watched(m) for m in (layer, attn, cross, mlp)):
            return None
        if any(getattr(m, name, None) is not None for m, name in [(attn, "q_norm"), (attn, "k_norm"),
               (layer, "post_self_norm"), (layer, "post_mlp_norm")]):  # fmt: skip
            return None
        if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (H, Hkv, D):
            return None
        if (cross.num_heads, cross.head_dim) != (H, D):  # the source's key/value heads: its pools say
            return None
        for norm in (layer.self_norm, layer.cross_norm, layer.mlp_norm):
            pairs.append(_s2s_norm(norm, rms))
            eps.append(float(getattr(norm, "eps", 0.0)))
        if type(mlp) is not MLP or "act" in vars(mlp) or "act_fn" in vars(mlp):
            return None
        activations.add(_S2S_ACTIVATIONS.get(mlp.activation, "gelu"))
        qkv = [attn.qkv_proj, None, None] if attn.qkv_proj is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
        if mlp.gate_up_proj is not None:
            mlps = [mlp.gate_up_proj, None]
        else:
            mlps = [mlp.gate_proj, mlp.up_proj] if mlp.gated else [None, mlp.up_proj]
        slots = [*zip(qkv, (False, True, True)), (attn.o_proj, False), (cross.q_proj, False), (cross.o_proj, False),
                 *zip(mlps, (True, mlp.gate_up_proj is not None)), (mlp.down_proj, False)]  # fmt: skip
        if not _take_operands(slots, kinds, products):
            return None
    if isinstance(model.norm, nn.Identity):
        pairs.append((torch.empty(0), torch.empty(0)))
        eps.append(0.0)
    else:
        pairs.append(_s2s_norm(model.norm, rms))
        eps.append(float(getattr(model.norm, "eps", 0.0)))
    if (
        any(p is None for p in pairs)
        or len(activations) != 1
        or not _take_operands([(model.lm_head, False)], kinds, products)
    ):
        return None
    windows = [_layer_window(cfg, i) for i in range(len(model.layers))]
    norms = [t for pair in pairs for t in pair]
    return Seq2SeqPlan(
        norms, eps, cfg.norm_position == "pre", rms, products, kinds, activations.pop(), windows, H, Hkv, D
    )


def _rotaries(model, positions: Tensor) -> list:
    """Each layer's rotary factors ``(cos, signed_sin)``, ``(N, 1, D)`` (every head alike), computed once
    per distinct rotary module (``model.layer_rotary(i)`` where the model has one per layer)."""
    if model.config.positions != "rotary":
        return [None] * len(model.layers)
    per_layer = getattr(model, "layer_rotary", None)
    made: dict[int, tuple[Tensor, Tensor]] = {}  # id(rotary) -> its factors
    out = []
    for i in range(len(model.layers)):
        rotary = per_layer(i) if per_layer is not None else model.rotary
        if id(rotary) not in made:
            cos, sin = rotary.cos_sin(positions[None])  # (1, 1, N, D)
            made[id(rotary)] = (cos[0, 0][:, None], Rotary.signed_sin(sin)[0, 0][:, None])  # (N, 1, D)
        out.append(made[id(rotary)])
    return out


def _float32_cache(cache: PagedKVCache, memory: SourceMemory) -> bool:
    return all(t.dtype == torch.float32 and t.is_cpu for t in (cache.k[0], memory.k[0]))


def packed_forward(
    model,
    cache: PagedKVCache,
    tokens: Tensor,
    positions: Tensor,
    row_seq: Tensor,
    tables: Tensor | Sequence[Tensor],
    logit_rows: Tensor,
    plan: FusedPlan | None = None,
    *,
    memory: SourceMemory | None = None,
    row_src: Tensor | None = None,
    flex: bool | None = None,
    argmax: bool = False,
) -> Tensor:
    """One step of ``model`` over packed rows; returns the logits of ``logit_rows`` only ``(M, V)``, or with
    ``argmax`` their arg-max tokens ``(M,)``.

    Args:
        tokens, positions, row_seq: ``(N,)`` int64: each row's token, its position in its sequence,
            and the index of its sequence in ``tables``.
        tables: ``(Q, W)`` int64 block tables, one row per scheduled sequence, covering every position
            up to the last one scheduled (unused entries: the null block 0); a list of them, one per
            group of ``cache.groups``, where the cache has several (layers of several windows, each
            group's window blocks freed: its entries below a row's window may be null, never read).
        logit_rows: ``(M,)`` rows whose next-token logits are wanted (a sequence's last scheduled
            row, when it is to sample): only they go through the final norm and the head.
        plan: :func:`fused_plan` of ``model`` (read once by the caller): the whole step in one
            native call (``packed_step``; ``seq2seq_step`` for an encoder-decoder); None: the same work
            operation by operation.
        memory, row_src: encoder-decoder models: the sources' keys and values and, per row ``(N,)``,
            the index of its sequence's source in ``memory``.
        flex: self-attention through FlexAttention and a ``BlockMask`` of :func:`paged_mask` (None: on
            CUDA, where FlexAttention is available; the CPU keeps ``paged_attend``).
        argmax: return each logit row's first largest logit's token, as ``logits.max(-1).indices`` of
            the logits would: for a large float32 head on the CPU found exactly without computing the
            logits (:func:`attnmask.ops.decoding.argmax_rows`: the head's 8-bit screen read, about a
            quarter of its bytes, and a few of its rows), the whole head where the step cannot do that.
            Greedy decoding's step.

    Keys and values of every row are written into ``cache`` before the rows attend, so a chunk's
    rows see each other causally, and later steps see them all.
    """
    cfg = model.config
    if model.is_encoder_decoder and (memory is None or row_src is None):
        raise UserError("an encoder-decoder model's packed step needs memory= (SourceMemory) and row_src=")
    tables = [tables] if isinstance(tables, Tensor) else list(tables)
    if len(tables) != len(cache.groups):
        raise UserError(f"the cache has {len(cache.groups)} layer groups; got {len(tables)} block tables (one a group)")
    x = model._embed(tokens[None], positions[None], source=False)[0]  # (N, C)
    if flex is None:
        flex = x.is_cuda and flex_available()
    screened = screened_head(model, int(logit_rows.numel())) if argmax else None
    if isinstance(plan, Seq2SeqPlan) and memory is not None and not flex and _float32_cache(cache, memory):
        lengths = memory.lengths.index_select(0, row_src)  # (N,)
        src_real = None if memory.every_source_real else (lengths > 0).to(x.dtype)[:, None]  # (N, 1)
        cos = signed = x.new_empty(0)
        if cfg.positions == "rotary":
            cos, sin = model.rotary.cos_sin(positions[None])  # (1, 1, N, D)
            cos, signed = cos[0, 0].contiguous(), Rotary.signed_sin(sin)[0, 0].contiguous()  # (N, D)
        products, kinds = plan.products, plan.kinds
        if screened is not None:  # the step ends at the final norm's rows (the head: NONE), argmax_rows does the rest
            products, kinds = _headless(products, kinds)
        out = decoding.seq2seq_step(
            x.contiguous(), cos, signed, plan.norms, plan.eps, plan.pre, plan.rms, products, kinds,
            plan.activation, cache.k, cache.v, tables, cache.layer_group, plan.windows, memory.k, memory.v,
            memory.tables, row_seq, positions, row_src, (lengths - 1).clamp(min=0), src_real, logit_rows, plan.heads,
            plan.kv_heads, plan.head_dim**-0.5,
        )  # fmt: skip
        if screened is not None:
            return head_argmax_of(screened, out)
        return decoding.first_largest(out) if argmax else out
    if isinstance(plan, FusedPlan) and memory is None and not flex:
        cos, signed = x.new_empty(0), x.new_empty(0)
        if plan.rotaries:
            factors = [rotary.cos_sin(positions[None]) for rotary in plan.rotaries]  # (1, 1, N, D) each
            cos = torch.cat([c[0] for c, _ in factors])  # (R, N, D)
            signed = torch.cat([Rotary.signed_sin(s)[0] for _, s in factors])  # (R, N, D)
        products, kinds = plan.products, plan.kinds
        if screened is not None:  # the step ends at the final norm's rows (the head: NONE), argmax_rows does the rest
            products, kinds = _headless(products, kinds)
        out = decoding.packed_step(
            x.contiguous(), cos, signed, plan.layer_rope, plan.norms, plan.eps, products, kinds,
            plan.activation, cache.k, cache.v, tables, cache.layer_group, plan.windows, row_seq, positions,
            logit_rows, plan.heads, plan.kv_heads, plan.head_dim**-0.5,
        )  # fmt: skip
        if screened is not None:
            return head_argmax_of(screened, out)
        return decoding.first_largest(out) if argmax else out
    slots = [slots_of(t, row_seq, positions, cache.block_size) for t in tables]  # (N,) each group
    flex_masks = _FlexMasks(cache, tables, row_seq, positions) if flex else None
    ropes = _rotaries(model, positions)
    src_tables = src_last = src_real = None
    if memory is not None:
        src_tables = memory.tables  # (Q, 1)
        lengths = memory.lengths.index_select(0, row_src)  # (N,)
        src_last = (lengths - 1).clamp(min=0)  # every row reads its whole source
        if not memory.every_source_real:  # a source of padding alone: nothing to attend to, zeros
            src_real = (lengths > 0).to(x.dtype)[:, None]  # (N, 1)
    for i, layer in enumerate(model.layers):
        mods = layer._modules
        window = _layer_window(cfg, i)

        def attend(h, attn=mods["self_attn"], i=i, window=window, g=cache.layer_group[i]):
            return _self_attention(
                attn, h, ropes[i], cache, i, slots[g], tables[g], row_seq, positions, window, flex_masks
            )

        sublayers = [(mods["self_norm"], attend, getattr(layer, "post_self_norm", None))]
        if mods.get("cross_attn") is not None:

            def cross(h, attn=mods["cross_attn"], i=i):
                return _cross_attention(attn, h, memory, i, src_tables, row_src, src_last, src_real)

            sublayers.append((mods["cross_norm"], cross, None))
        sublayers.append((mods["mlp_norm"], lambda h, m=mods["mlp"]: _mlp(m, h), getattr(layer, "post_mlp_norm", None)))
        for norm, fn, post in sublayers:  # post: a norm of the sublayer's output (Gemma 3), or None
            x = x + _norm(post, fn(_norm(norm, x))) if layer.pre else _norm(norm, x + _norm(post, fn(x)))
    h = _norm(model.norm, x.index_select(0, logit_rows))  # (M, C)
    if screened is not None and _native(h):
        return head_argmax_of(screened, h.contiguous())
    logits = _product(model.lm_head, h)  # (M, V)
    return decoding.first_largest(logits) if argmax else logits
