"""One forward step over a packed batch: every scheduled sequence's new tokens in one row of ``N`` tokens.

Each scheduled sequence contributes a chunk: a prefill chunk of its prompt or one decode token, at
its own cache offset. The chunks are concatenated (``tokens``, ``positions``, ``row_seq``: for each
of the ``N`` rows its token, its position in its sequence and which sequence it belongs to); keys
and values go into a :class:`~attnmask.engine.cache.PagedKVCache` through each sequence's block table.

Attention is the mask algebra's ``document(sequence ids) & causal`` with each sequence's own offset
(``& sliding_window`` where the model has one): :func:`packed_mask` builds it over the packed rows and
the sequences' keys, for the reference path and the tests. On the CPU its lowering is one range of
keys per row, ``[pos - window + 1, pos]`` of the row's own sequence, which is what the operator
:func:`attnmask.ops.decoding.paged_attend` computes without materialising anything.

**Batch invariance.** A row's result must not depend on which rows it is packed with, where it sits
in the pack, or how its sequence's prompt was chunked, bit for bit. Every operation here is either
elementwise, a reduction within one row (norms: the native ``rms_norm``), a product whose every
output is computed by the same operations whatever the number of rows (the native ``linear_rows``
for float32 weights, ``block_matmul`` for GGUF blocks: threads split the weight's rows, never a
sum), or the paged attention (each row and head alone, keys in order). Where the native kernels are
not built, products run one row at a time (the BLAS's result for a row depends on the shape of the
whole product otherwise): the same guarantee, slower.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnmask import masks, ops
from attnmask.engine.cache import PagedKVCache
from attnmask.errors import UserError
from attnmask.linear import Linear
from attnmask.model.layers import RMSNorm, Rotary
from attnmask.ops import decoding
from attnmask.pretrained.quantized import BlockLinear

__all__ = ["check_servable", "fused_plan", "packed_forward", "packed_mask", "slots_of"]


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


def slots_of(tables: Tensor, row_seq: Tensor, row_pos: Tensor, block_size: int) -> Tensor:
    """Flat pool index ``block * S + offset`` of each row's position in its sequence ``(N,)``."""
    return tables[row_seq, row_pos // block_size] * block_size + row_pos % block_size


def check_servable(model) -> None:
    """Raise UserError unless the packed step can run ``model``: a decoder-only Transformer."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "layers"):
        raise UserError(f"the engine serves attnmask Transformers; got {type(model).__name__}")
    if model.is_encoder_decoder:
        raise UserError("the engine serves decoder-only models; translate with attnmask.decode.translate")


def _native(t: Tensor) -> bool:
    return t.is_cpu and t.dtype == torch.float32 and ops.available()


def _product(proj: nn.Module, x: Tensor) -> Tensor:
    """``proj(x)`` for rows ``x (N, K)``, each row's result independent of the others (see the module's
    docstring)."""
    if isinstance(proj, BlockLinear):
        if _native(x):
            return proj.matmul_rows(x)
    elif type(proj) in (nn.Linear, Linear) and _native(x):
        w, b = proj.weight, proj.bias
        if w.dtype == torch.float32 and w.is_contiguous():
            return decoding.linear_rows(x, w, b)
    if not x.is_cpu:
        return proj(x)  # on a GPU the kernels are not row-invariant here (documented)
    return torch.cat([proj(x[i : i + 1]) for i in range(x.shape[0])]) if x.shape[0] > 1 else proj(x)


def _norm(norm: nn.Module, x: Tensor) -> Tensor:
    if isinstance(norm, RMSNorm) and _native(x) and norm.weight.dtype == torch.float32:
        return decoding.rms_norm(x, norm.weight, norm.eps)
    return norm(x)


def _mlp(mlp: nn.Module, h: Tensor) -> Tensor:
    if mlp.gate_up_proj is not None:
        gate_up = _product(mlp.gate_up_proj, h)
        a = (
            decoding.silu_mul(gate_up)
            if _native(gate_up)
            else F.silu(gate_up.chunk(2, -1)[0]) * gate_up.chunk(2, -1)[1]
        )
    elif mlp.activation == "swiglu":
        a = F.silu(_product(mlp.gate_proj, h)) * _product(mlp.up_proj, h)
    else:
        a = _product(mlp.up_proj, h)
        a = {
            "relu": F.relu,
            "gelu": F.gelu,
            "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        }.get(mlp.activation, F.silu)(a)
    return _product(mlp.down_proj, a)


def _attention(attn, h: Tensor, rope, cache: PagedKVCache, layer: int, slots, tables, row_seq, row_pos, window):
    N = h.shape[0]
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if attn.qkv_proj is not None:
        q, k, v = _product(attn.qkv_proj, h).split([H * D, Hkv * D, Hkv * D], dim=-1)
    else:
        q, k, v = _product(attn.q_proj, h), _product(attn.k_proj, h), _product(attn.v_proj, h)
    q, k, v = q.reshape(N, H, D), k.reshape(N, Hkv, D), v.reshape(N, Hkv, D)
    if rope is not None:
        q, k = Rotary.rotate_signed(q, *rope), Rotary.rotate_signed(k, *rope)  # elementwise per row
    k_pool, v_pool = cache.k[layer], cache.v[layer]
    k_pool.view(-1, Hkv, D).index_copy_(0, slots, k.to(k_pool.dtype))  # each row's key into its slot
    v_pool.view(-1, Hkv, D).index_copy_(0, slots, v.to(v_pool.dtype))
    q = q.reshape(N, H * D).contiguous()
    # the native kernel reads float32 CPU tensors; other dtypes take the operator's PyTorch definition
    attend = decoding.paged_attend if _native(q) and k_pool.dtype == torch.float32 else decoding.paged_attend_reference
    out = attend(q, k_pool, v_pool, tables, row_seq, row_pos, window, H, D**-0.5)  # (N, H D)
    return _product(attn.o_proj, out)


def _operands(proj: nn.Module) -> tuple[int, list[Tensor]] | None:
    """A product as ``packed_step`` takes it: GGUF blocks, or a row-major float32 weight and its bias."""
    if proj._forward_hooks or proj._forward_pre_hooks:
        return None  # a watched module must be called
    if isinstance(proj, BlockLinear):
        return proj.decoder_operands()
    if type(proj) in (nn.Linear, Linear):
        w, b = proj.weight, proj.bias
        if w.dtype == torch.float32 and w.is_cpu and w.is_contiguous():
            return decoding.DENSE, [w, w.new_empty(0) if b is None else b]
    return None


def fused_plan(model) -> tuple | None:
    """What :func:`attnmask.ops.decoding.packed_step` needs of ``model`` (norm weights and eps, product
    tensors and kinds), read once; None where the whole step cannot be one native call: the model is
    not a pre-norm RMSNorm / SwiGLU decoder with fused q/k/v and gate/up projections in float32 on the
    CPU, or the native kernels are not built. Such models take the per-operation path, which is
    batch-invariant too."""
    cfg = model.config
    if model.is_encoder_decoder or model.training or cfg.norm_position != "pre" or not ops.available():
        return None
    if not isinstance(model.norm, RMSNorm) or any(
        not (p.is_cpu and p.dtype == torch.float32) for p in model.parameters()
    ):
        return None
    norms, products, kinds = [], [], []
    modules = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(layer.self_norm, RMSNorm) or not isinstance(layer.mlp_norm, RMSNorm):
            return None
        if attn.qkv_proj is None or getattr(mlp, "gate_up_proj", None) is None:
            return None
        norms += [layer.self_norm, layer.mlp_norm]
        modules += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    norms.append(model.norm)
    for proj in [*modules, model.lm_head]:
        operands = _operands(proj)
        if operands is None:
            return None
        kinds.append(operands[0])
        products += operands[1]
    attn = model.layers[0].self_attn
    weights = [n.weight for n in norms]
    return weights, [n.eps for n in norms], products, kinds, attn.num_heads, attn.num_kv_heads, attn.head_dim


def packed_forward(
    model,
    cache: PagedKVCache,
    tokens: Tensor,
    positions: Tensor,
    row_seq: Tensor,
    tables: Tensor,
    logit_rows: Tensor,
    plan: tuple | None = None,
) -> Tensor:
    """One step of ``model`` over packed rows; returns the logits of ``logit_rows`` only ``(M, V)``.

    Args:
        tokens, positions, row_seq: ``(N,)`` int64: each row's token, its position in its sequence,
            and the index of its sequence in ``tables``.
        tables: ``(Q, W)`` int64 block tables, one row per scheduled sequence, covering every position
            up to the last one scheduled (unused entries: the null block 0).
        logit_rows: ``(M,)`` rows whose next-token logits are wanted (a sequence's last scheduled
            row, when it is to sample): only they go through the final norm and the head.

        plan: :func:`fused_plan` of ``model`` (read once by the caller): the whole step in one
            native call (``packed_step``); None: the same work operation by operation.

    Keys and values of every row are written into ``cache`` before the rows attend, so a chunk's
    rows see each other causally, and later steps see them all.
    """
    cfg = model.config
    window = int(getattr(cfg, "sliding_window", 0) or 0)
    x = model._embed(tokens[None], positions[None], source=False)[0]  # (N, C)
    rope = None
    if cfg.positions == "rotary":
        cos, sin = model.rotary.cos_sin(positions[None])  # (1, 1, N, D)
        cos, signed = cos[0, 0][:, None], Rotary.signed_sin(sin)[0, 0][:, None]  # (N, 1, D): every head alike
        rope = (cos, signed)
    slots = slots_of(tables, row_seq, positions, cache.block_size)  # (N,)
    if plan is not None:
        weights, eps, products, kinds, H, Hkv, D = plan
        cos, signed = (rope[0][:, 0], rope[1][:, 0]) if rope is not None else (x.new_empty(0), x.new_empty(0))
        return decoding.packed_step(
            x.contiguous(), cos.contiguous(), signed.contiguous(), weights, eps, products, kinds, cache.k, cache.v,
            tables, row_seq, positions, slots, logit_rows, window, H, Hkv, D**-0.5,
        )  # fmt: skip
    for i, layer in enumerate(model.layers):
        mods = layer._modules

        def attend(h, attn=mods["self_attn"], i=i):
            return _attention(attn, h, rope, cache, i, slots, tables, row_seq, positions, window)

        for norm, fn in ((mods["self_norm"], attend), (mods["mlp_norm"], lambda h, m=mods["mlp"]: _mlp(m, h))):
            x = x + fn(_norm(norm, x)) if layer.pre else _norm(norm, x + fn(x))
    h = x.index_select(0, logit_rows)  # (M, C)
    return _product(model.lm_head, _norm(model.norm, h))  # (M, V)
