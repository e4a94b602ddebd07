"""Masked multi-head attention with pluggable backends.

Shape legend (used in every comment of this package)::

    B   batch                 H    query heads          Hkv  key/value heads (H % Hkv == 0)
    Tq  query length          Tk   key/value length     D    head dim
    C   model dim             V    vocabulary

``attention(q, k, v, mask)`` computes ``softmax(QKᵀ/√D + M) V`` in every head, where ``M`` is the
additive form of a boolean mask (True = may attend, see :mod:`attnmask.masks`). Query rows that may
attend to nothing give **zero output and zero gradient**, never NaN, on every backend and dtype.

Backends live in a registry (:data:`BACKENDS`); models never name a kernel, so a faster one can
be added with :func:`register_backend` without touching them:

- ``reference``: the seeds' formula written out, with an additive 0/-inf mask; returns weights;
- ``math``: the same as two batched matrix products in the inputs' dtype around a float32 softmax,
  the mask applied by ``masked_fill``; returns weights. For many short problems on the CPU;
- ``sdpa``: PyTorch's fused kernel, ``is_causal=True`` only when exactly right (pure causal,
  ``Tq == Tk``, query row i at position i), the materialized mask otherwise;
- ``sdpa_blocks``: a causal / contiguous-padding / packed-documents mask run as unmasked (or causal)
  SDPA calls over the real tokens, one per segment (see :class:`SdpaCall`), no ``Tq x Tk`` mask; other
  masks as ``sdpa``. A Python loop of kernel calls: for the CPU;
- ``tiles``: block-sparse attention over the key blocks a structured mask allows (windows, documents,
  causal, prefix LM, padding and their ``&``/``|``), forward and recomputing backward, never a
  ``Tq x Tk`` tensor (:mod:`.blocked`). CPU; other masks, devices and dropout run as ``sdpa``;
- ``flex``: compiled FlexAttention with the mask's ``BlockMask`` (:meth:`attnmask.masks.Mask.block_mask`),
  built once per prepared mask. Training and inference on CUDA; inference only on the CPU (torch has
  no CPU backward for it); no attention dropout;
- ``auto``: the fastest correct choice for the device: ``reference`` for weights; on the CPU,
  ``math`` for many short problems (bfloat16 with short keys, float32 inference on short rows),
  else the cheapest of ``tiles``, ``sdpa_blocks`` and ``sdpa`` by cost models in SDPA scores
  (shapes, dtype, pass, the mask's key blocks and whether the CPU multiplies bfloat16 natively;
  measured in docs/benchmarks.md, never timed at run time); on an accelerator, ``sdpa`` with ``is_causal`` for pure
  causal, ``flex`` for structured masks, ``sdpa`` with the dense mask for literal tensors,
  predicates, and when attention dropout is on -- never a loop of kernel launches.

No kernel choice reads a mask back to the host on an accelerator or under ``torch.compile``: masks
are checked where they are built (lengths) or where a raw tensor enters :func:`attention`, and the
prepared forms are built from device tensors.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

import attnmask.linear as products
from attnmask import masks as M
from attnmask.attention.blocked import TilePlan, estimate, plan_tiles, tile_attention
from attnmask.attention.plan import PreparedMask, SdpaCall, _host_readable, prepare_mask
from attnmask.errors import UserError, UserTypeError
from attnmask.linear import cpu_info

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
    # Softmax in at least float32 (half types lose too much in exp and the row sum); float64 stays.
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = (q @ k.transpose(-2, -1)).to(acc) * scale  # (B, H, Tq, Tk)
    allowed = pm.dense(q.device)
    empty = pm.empty_rows
    if allowed is not None:
        if empty is not None:
            allowed = allowed | empty  # keep the softmax finite; the rows are zeroed below
        additive = torch.zeros(allowed.shape, dtype=acc, device=q.device)  # (B|1, H|1, Tq, Tk)
        scores = scores + additive.masked_fill_(~allowed, float("-inf"))
    weights = scores.softmax(dim=-1)  # (B, H, Tq, Tk)
    if empty is not None:
        weights = weights.masked_fill(empty, 0.0)  # zero output and, through masked_fill, zero gradient
    weights = weights.to(q.dtype)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = dropped @ v  # (B, H, Tq, D)
    return out, (weights if return_weights else None)


def _math(q, k, v, pm: PreparedMask, *, scale, dropout_p, return_weights):
    """Two batched matrix products in q's dtype around a float32 softmax, the mask applied with one
    ``masked_fill``: what ``auto`` runs for short keys in bfloat16 on the CPU, where PyTorch's fused
    kernel is slowest (forward + backward up to 13x slower for up to 128 keys, docs/benchmarks.md)."""
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)  # (B, H, Tk, D)
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = (q * scale) @ k.transpose(-2, -1)  # (B, H, Tq, Tk)
    allowed, empty = pm.dense(q.device), pm.empty_rows
    if allowed is not None:
        if empty is not None:
            allowed = allowed | empty  # keep the softmax finite; the rows are zeroed below
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = scores.softmax(dim=-1, dtype=acc)  # (B, H, Tq, Tk)
    if empty is not None:
        weights = weights.masked_fill(empty, 0.0)  # zero output and, through masked_fill, zero gradient
    weights = weights.to(q.dtype)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return dropped @ v, (weights if return_weights else None)  # (B, H, Tq, D)


def _sdpa(q, k, v, pm: PreparedMask, *, scale, dropout_p, return_weights):
    """PyTorch's fused kernel; ``is_causal`` only when exactly right (pure causal, Tq == Tk)."""
    if return_weights:
        raise UserError("backend 'sdpa' cannot return attention weights; use backend='reference' (or 'auto')")
    groups = q.shape[1] // k.shape[1]
    empty = pm.empty_rows
    attn_mask = pm.sdpa_mask(q.dtype)  # empty rows opened: SDPA would give NaN for them
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
    if empty is not None:
        out = out.masked_fill(empty, 0.0)  # zero output, and zero gradient into those rows
    return out, None


def _blocks(q, k, v, blocks: tuple[SdpaCall, ...], *, scale, dropout_p) -> Tensor:
    """Run a mask decomposed into :class:`SdpaCall` s: one SDPA call per block, no ``Tq x Tk`` mask.

    Padding is sliced away instead of masked, and causal blocks use SDPA's ``is_causal`` path, so
    the work shrinks with the padding; rows in no block are zero (zero output, zero gradient).
    Consecutive batch rows with the same blocks share calls. The inputs are cut with ``split`` and
    the output glued with ``cat``, whose backward passes are views: indexing a slice per block
    would make autograd allocate and zero a full-size gradient for every block.
    """
    B, H, Tq, _ = q.shape
    gqa = q.shape[1] != k.shape[1]

    def run(qb: Tensor, kb: Tensor, vb: Tensor, blk: SdpaCall) -> Tensor:
        if (blk.k0, blk.k1) != (0, kb.shape[2]):
            kb, vb = kb[:, :, blk.k0 : blk.k1], vb[:, :, blk.k0 : blk.k1]  # (n, Hkv, k1 - k0, D)
        tril = None
        if blk.diag:  # query t sees its first t + diag + 1 keys: a small mask, not SDPA's is_causal
            tril = torch.ones(blk.q1 - blk.q0, blk.k1 - blk.k0, dtype=torch.bool, device=q.device).tril(blk.diag)
        return F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=tril, dropout_p=dropout_p, is_causal=blk.diag == 0, scale=scale, enable_gqa=gqa
        )  # (n, H, q1 - q0, D)

    if len(blocks) == 1 and _covers(blocks[0], B, Tq):
        return run(q, k, v, blocks[0])  # one call for the whole batch (e.g. causal, nothing padded)
    plans: list[list[SdpaCall]] = [[] for _ in range(B)]
    for blk in blocks:
        for b in blk.rows:
            plans[b].append(blk)
    keys = [tuple((x.q0, x.q1, x.k0, x.k1, x.diag) for x in sorted(p, key=lambda x: x.q0)) for p in plans]
    runs: list[int] = []  # sizes of runs of consecutive batch rows with the same blocks
    for b in range(B):
        if b and keys[b] == keys[b - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    outs, b = [], 0
    for q_g, k_g, v_g, n in zip(q.split(runs), k.split(runs), v.split(runs), runs):
        plan = sorted(plans[b], key=lambda x: x.q0)
        b += n
        cuts, pos = [], 0  # the query axis cut into gaps (zero rows) and blocks
        for blk in plan:
            if blk.q0 > pos:
                cuts.append((None, blk.q0 - pos))
            cuts.append((blk, blk.q1 - blk.q0))
            pos = blk.q1
        if pos < Tq:
            cuts.append((None, Tq - pos))
        pieces = q_g.split([size for _, size in cuts], dim=2) if len(cuts) > 1 else (q_g,)
        parts = [
            q_g.new_zeros(n, H, size, v.shape[-1]) if blk is None else run(piece, k_g, v_g, blk)
            for (blk, size), piece in zip(cuts, pieces)
        ]  # (n, H, size, D) each
        outs.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])  # (n, H, Tq, D)
    return torch.cat(outs) if len(outs) > 1 else outs[0]  # (B, H, Tq, D)


# Cost model of the block plan, in units of one (batch row, head, query, key) score. Calibrated on a
# 2-core AVX2 CPU with torch 2.13 (benchmarks/attention.py, docs/benchmarks.md): one SDPA call costs
# about as much as 8k scores forward and forward+backward; 16k keeps a margin for the split/cat.
_CALL_COST = 16384
_MIN_SAVING = 0.9  # take the blocks only when they cost at most 90% of the dense call


def _causal_cost(n: int, device: torch.device) -> float:
    """Fraction of an ``n x n`` block that SDPA's ``is_causal`` kernel actually computes.

    PyTorch's CPU flash kernel skips key chunks of 512 above the diagonal (query chunks of 256), so it
    saves nothing below ~600 keys and tends to one half; GPU kernels skip at a fine grain.
    """
    if device.type == "cpu":
        return min(1.0, 0.5 + 256 / max(n, 1))
    return 0.5


def _covers(blk: SdpaCall, B: int, Tq: int) -> bool:
    return len(blk.rows) == B and (blk.q0, blk.q1) == (0, Tq)


def _use_blocks(q: Tensor, k: Tensor, pm: PreparedMask) -> bool:
    """Whether the block plan beats one SDPA call with the dense mask: the blocks skip padding (and,
    for long causal blocks, half the scores) but each costs a kernel call. Decided once per
    PreparedMask and head count."""
    key = ("blocks", q.shape[1], q.device)
    if key not in pm.choices:
        pm.choices[key] = _blocks_cheaper(q, k, pm)
    return pm.choices[key]


def _blocks_cheaper(q: Tensor, k: Tensor, pm: PreparedMask) -> bool:
    if not pm.blocks:  # no plan, or every row empty: the dense path keeps the autograd graph
        return False
    B, H, Tq, _ = q.shape
    if len(pm.blocks) == 1 and _covers(pm.blocks[0], B, Tq):
        return True  # one plain SDPA call (is_causal, or keys sliced) never loses to a masked one
    return _blocks_work(q, pm) <= _MIN_SAVING * B * H * Tq * k.shape[2]


def _blocks_work(q: Tensor, pm: PreparedMask) -> float:
    """The block plan's cost in scores: its rectangles (causal ones as SDPA computes them) and calls."""
    H, work = q.shape[1], 0.0
    for blk in pm.blocks:
        rect = len(blk.rows) * H * (blk.q1 - blk.q0) * (blk.k1 - blk.k0)
        work += rect * (_causal_cost(blk.k1 - blk.k0, q.device) if blk.diag == 0 else 1.0) + _CALL_COST
    return work


def _sdpa_blocks(q, k, v, pm: PreparedMask, *, scale, dropout_p, return_weights):
    """:func:`_blocks` whenever the mask has a block plan (causal / contiguous padding / packed
    documents), else ``sdpa``."""
    if return_weights:
        raise UserError("backend 'sdpa_blocks' cannot return attention weights; use backend='reference' (or 'auto')")
    if pm.is_causal or not pm.blocks:
        return _sdpa(q, k, v, pm, scale=scale, dropout_p=dropout_p, return_weights=False)
    return _blocks(q, k, v, pm.blocks, scale=scale, dropout_p=dropout_p), None


# ---------------------------------------------------------------------------------------------
# Block-sparse tiles (CPU)
# ---------------------------------------------------------------------------------------------
def _tile_plan(q: Tensor, k: Tensor, pm: PreparedMask) -> TilePlan | None:
    """The mask's tile plan (built once per PreparedMask and block size), or None when there is no
    structure to plan from: nothing masked, a raw tensor, off the CPU or inside ``torch.compile``."""
    if q.device.type != "cpu" or not _host_readable(q.device):
        return None
    mask = M.causal() if pm.is_causal else pm.mask
    if mask is None or pm.batch_size is None:
        return None
    key = ("tiles", q.shape[1])
    if key not in pm.choices:
        q_start = 0 if pm.is_causal else M.query_start(mask, pm.q_len, pm.kv_len, pm.q_offset)
        pm.choices[key] = plan_tiles(mask, pm.batch_size, q.shape[1], pm.q_len, pm.kv_len, q_start)
    return pm.choices[key]


# ``auto``'s CPU cost of the tiles backend, in the scores of SDPA's CPU kernel (the unit of the block
# plan's cost model above): one computed score there costs _TILE_COST[dtype, pass] of SDPA's, and
# every batched product _TILE_PRODUCT_COST more. Measured on Zen 5 with torch 2.13 (one thread,
# benchmarks/attention.py; docs/benchmarks.md): in float32 a tile score costs about twice an SDPA
# score (SDPA's kernel is fused, the tiles are products around a softmax), forward and backward; in
# bfloat16 the tiles' products run the CPU's bfloat16 instructions (avx512_bf16 / amx_bf16) where
# SDPA's CPU kernel gains nothing over float32, and a tile score costs 0.8-1.0 of SDPA's forward,
# 1.1-1.3 forward+backward against a causal call, and less against the block plan's short calls.
# A CPU without those instructions multiplies bfloat16 (and float16) by conversion: there the tiles
# are taken only when they skip most of the scores (not measured here).
_TILE_COST = {("float32", False): 2.0, ("float32", True): 2.0, ("bf16", False): 0.75, ("bf16", True): 1.0}
_TILE_COST_EMULATED = 4.0  # half types without native products, and float64
_TILE_PRODUCT_COST = 16384


@functools.cache
def _native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo,
    else what PyTorch's own check says). Read once a process; a fact of the machine, not a timing."""
    info = cpu_info()
    if info is not None and info.flags:
        return bool(info.flags & {"avx512_bf16", "amx_bf16"})
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check()) if check is not None else False


def _tile_cost_per_score(dtype: torch.dtype, training: bool, native_bf16: bool) -> float:
    """What one score of the tiles backend costs against one of SDPA's CPU kernel (see _TILE_COST)."""
    if dtype == torch.float32:
        return _TILE_COST["float32", training]
    if dtype == torch.bfloat16 and native_bf16:
        return _TILE_COST["bf16", training]
    return _TILE_COST_EMULATED


def _tiles_cost(q: Tensor, k: Tensor, pm: PreparedMask, training: bool) -> float | None:
    """The tiles backend's cost for this problem in SDPA scores, from the mask's key blocks (no tile
    is evaluated), or None where it cannot run (no structured mask, off the CPU, under compile)."""
    if q.device.type != "cpu" or not _host_readable(q.device) or pm.batch_size is None:
        return None
    mask = M.causal() if pm.is_causal else pm.mask
    if mask is None:
        return None
    B, H, Tq, _ = q.shape
    key = ("tiles-estimate", H)
    if key not in pm.choices:
        q_start = 0 if pm.is_causal else M.query_start(mask, pm.q_len, pm.kv_len, pm.q_offset)
        pm.choices[key] = estimate(mask, B, H, Tq, k.shape[2], q_start)
    scores, products = pm.choices[key]
    per_score = _tile_cost_per_score(q.dtype, training, _native_bf16())
    return scores * per_score + products * _TILE_PRODUCT_COST + _CALL_COST


def _tiles(q, k, v, pm: PreparedMask, *, scale, dropout_p, return_weights):
    """Block-sparse attention over the tiles a structured mask allows (:mod:`.blocked`): time and
    memory follow the allowed region, never ``Tq x Tk``. CPU only, without attention dropout (the
    backward would have to replay it); other masks, devices and dropout run as ``sdpa``."""
    if return_weights:
        raise UserError("backend 'tiles' cannot return attention weights; use backend='reference' (or 'auto')")
    plan = None if dropout_p > 0 else _tile_plan(q, k, pm)
    if plan is None:
        return _sdpa(q, k, v, pm, scale=scale, dropout_p=dropout_p, return_weights=False)
    return tile_attention(q, k, v, plan, scale), None


# ---------------------------------------------------------------------------------------------
# FlexAttention
# ---------------------------------------------------------------------------------------------
FLEX_COMPILE = True  # False: eager FlexAttention (same masks and maths, unfused); tests use it for speed
_FLEX_COMPILED: dict[str, Callable] = {}  # device type -> compiled flex_attention
_FLEX_MIN_HEAD_DIM = 16  # Triton's FlexAttention kernels need D >= 16 (smaller: a lowering error)
# the dtypes compiled FlexAttention takes on the CPU (torch 2.13: no float64)
_CPU_FLEX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def flex_available() -> bool:
    """Whether the installed torch has FlexAttention (``torch.nn.attention.flex_attention``, torch >= 2.5)."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _flex_kernel(q: Tensor):
    """FlexAttention as it should run for ``q``: traced as is inside ``torch.compile``, compiled
    once per process otherwise (the fused kernel), eager where compiling is off or unsupported."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():
        return flex_attention
    if not FLEX_COMPILE or (q.device.type == "cpu" and q.dtype not in _CPU_FLEX_DTYPES):

        def eager(*args, **kwargs):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                return flex_attention(*args, **kwargs)

        return eager
    kind = q.device.type
    if kind not in _FLEX_COMPILED:
        # CPU: one kernel per shape -- torch 2.13's C++ template fails to build with dynamic shapes
        # (measured: a second sequence length raised a CppCompileError). CUDA: automatic dynamic
        # shapes, so that a new sequence length compiles once more and then stays dynamic.
        _FLEX_COMPILED[kind] = torch.compile(flex_attention, dynamic=False if kind == "cpu" else None)
    return _FLEX_COMPILED[kind]


def flex_call(q: Tensor, k: Tensor, v: Tensor, *, block_mask, scale: float | None, enable_gqa: bool, **kwargs):
    """FlexAttention over ``q, k, v (B, H, T, D)`` as attnmask runs it: the kernel of
    :func:`_flex_kernel`; head sizes under 16 zero-padded to 16, which Triton's kernels need (exact: the
    padded columns add 0 to every score and give output columns that are dropped), with the scale of the
    true size; run by :func:`attnmask.masks.core.call_compiled` (past dynamo's default of 8 compiled variants
    it ran unfused; a CPU kernel is compiled per shape, so there a ninth sequence length was enough)."""
    D = q.shape[-1]
    if scale is None:
        scale = D**-0.5
    if D < _FLEX_MIN_HEAD_DIM:
        pad = (0, _FLEX_MIN_HEAD_DIM - D)
        q, k, v = F.pad(q, pad), F.pad(k, pad), F.pad(v, pad)
    kernel = _flex_kernel(q)
    out = M.core.call_compiled(kernel, q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, **kwargs)
    return out[..., :D] if out.shape[-1] != D else out


def _flex(q, k, v, pm: PreparedMask, *, scale, dropout_p, return_weights):
    """Compiled FlexAttention with the mask's ``BlockMask`` (built once per PreparedMask, so once per
    forward for every layer). Fully masked rows give zero output and zero gradient by FlexAttention's
    own definition. Training on CUDA; on the CPU inference only (torch has no CPU backward for it)."""
    if return_weights:
        raise UserError("backend 'flex' cannot return attention weights; use backend='reference' (or 'auto')")
    if dropout_p > 0:
        raise UserError(
            "backend 'flex' has no attention dropout (FlexAttention does not implement it); use backend='auto' "
            "(SDPA when dropout is on) or 'sdpa'"
        )
    if not flex_available():
        raise UserError(f"backend 'flex' needs FlexAttention (torch >= 2.5); this is torch {torch.__version__}")
    if q.device.type == "cpu":
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise UserError(
                f"backend 'flex' on the CPU is inference-only: FlexAttention in torch {torch.__version__} has no CPU "
                "backward. Run it under torch.no_grad() (or inference_mode), or train with backend='auto' "
                "(SDPA and the block plan on the CPU)"
            )
        q, k, v = q.detach(), k.detach(), v.detach()  # FlexAttention refuses CPU tensors that require grad
    out = flex_call(
        q, k, v, block_mask=pm.block_mask(q.device), scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )  # (B, H, Tq, D)
    return out, None


def _flex_suits(pm: PreparedMask) -> bool:
    """A structured mask FlexAttention runs without a dense tensor: built from attnmask's own masks
    (causal, padding, windows, prefix LM, documents and their algebra), no literal tensor or user
    predicate (which may not trace)."""
    if pm.mask is None:
        return False
    from attnmask.masks.core import _walk

    return not any(isinstance(p, (M.TensorMask, M.Predicate)) for p in _walk(pm.mask))


# ``auto`` on the CPU takes ``math`` for many short problems, where SDPA's fused kernels lose
# (measured on Zen 5 with torch 2.13: docs/benchmarks.md, attention): bfloat16 with up to 128 keys
# (at 256 keys SDPA is faster) on a CPU that multiplies bfloat16 natively -- without avx512_bf16 /
# amx_bf16 (Zen 3) ``math``'s converted bfloat16 products made it 2.5-13x slower than SDPA at 16-128
# keys, forward and backward; float32 at inference for up to 64 queries over up to 256 keys in at
# least 32 (batch row, head) pairs, as a batch of short sentences through the encoder or a short
# decoder forward (decoding steps attend through the paged cache's ``paged_attend``, not here);
# float32 training over up to 64 keys in at least 32 pairs (at 96-128 keys and 8 heads SDPA catches
# up). Never when the float32 scores would pass 64 MiB.
_MATH_MAX_SCORES = 1 << 24
# float32 inference: at most this many scores per (batch row, head). 20 x 20 and 1 x 256 (one step)
# measured faster in ``math``, 64 x 64 with 32 pairs slower than SDPA (0.57-0.64 against 0.50-0.54 ms)
_MATH_MAX_ROW_PAIRS = 2048


def _math_suits(q: Tensor, k: Tensor, v: Tensor) -> bool:
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    if B * H * Tq * Tk > _MATH_MAX_SCORES:
        return False
    if q.dtype == torch.bfloat16:  # without native products each bfloat16 product is converted
        return Tk <= 128 and _native_bf16()
    if q.dtype != torch.float32 or B * H < 32:
        return False
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return Tk <= 64 if training else Tq <= 64 and Tk <= 256 and Tq * Tk <= _MATH_MAX_ROW_PAIRS


def _bf16_by_float32(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """bfloat16 attention with a backward pass on a CPU whose bfloat16 products are slow
    (``linear.fast_bf16_products``: no oneDNN bfloat16, an AVX2-only CPU): ``auto`` computes it in
    float32 on the same bfloat16 values and rounds the output to bfloat16 (SDPA's CPU kernels sum
    bfloat16 in float32 too). There SDPA's bfloat16 backward took 5-7x float32's (Zen 3, T = 512:
    460 against 67 ms forward + backward), a quarter of a bfloat16 fine-tuning step; its forward alone
    is as fast as float32's and is kept."""
    return (
        q.dtype == torch.bfloat16
        and q.device.type == "cpu"
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
        and not torch.compiler.is_compiling()
        and not products.fast_bf16_products()
    )


def _auto(q, k, v, pm: PreparedMask, *, scale, dropout_p, return_weights):
    """The fastest correct choice, by device.

    - weights: the reference kernel;
    - CPU: ``math`` for many short problems (bfloat16 with short keys, float32 over a batch of
      short rows: see ``_math_suits``); else the cheapest by ``_cpu_choice``: the tiles over the
      key blocks a structured mask allows, a causal / contiguous padding / packed-documents mask as
      unmasked SDPA blocks, or SDPA with the mask. Inside ``torch.compile`` neither the block plan nor the tiles
      (which read the mask on the host) are used;
    - GPU: never a Python loop of kernel launches: SDPA ``is_causal`` for pure causal, compiled
      FlexAttention for structured masks (SDPA with the mask when attention dropout is on, which
      FlexAttention lacks), SDPA with the dense mask for literal tensors and predicates.
    """
    if return_weights:
        return _reference(q, k, v, pm, scale=scale, dropout_p=dropout_p, return_weights=True)
    if _bf16_by_float32(q, k, v):  # the same function in float32 on the bfloat16 values, cast back
        with torch.autocast("cpu", enabled=False):  # (autocast would cast SDPA's inputs back)
            out, _ = _auto(q.float(), k.float(), v.float(), pm, scale=scale, dropout_p=dropout_p, return_weights=False)
        return out.to(torch.bfloat16), None
    if q.device.type != "cpu":
        if not pm.is_causal and dropout_p == 0 and _flex_suits(pm) and flex_available():
            return _flex(q, k, v, pm, scale=scale, dropout_p=0.0, return_weights=False)
    elif _math_suits(q, k, v):
        return _math(q, k, v, pm, scale=scale, dropout_p=dropout_p, return_weights=False)
    else:
        choice = _cpu_choice(q, k, v, pm, dropout_p)
        if choice == "tiles":
            return tile_attention(q, k, v, _tile_plan(q, k, pm), scale), None
        if choice == "blocks":
            return _blocks(q, k, v, pm.blocks, scale=scale, dropout_p=dropout_p), None
    return _sdpa(q, k, v, pm, scale=scale, dropout_p=dropout_p, return_weights=False)


def _cpu_choice(q: Tensor, k: Tensor, v: Tensor, pm: PreparedMask, dropout_p: float) -> str:
    """``"tiles"``, ``"blocks"`` or ``"sdpa"`` for a CPU problem past ``math``'s: the cheapest by the
    cost models (in SDPA scores: the block plan's, the tiles' by dtype, pass and the CPU's bfloat16
    instructions), decided once per PreparedMask, head count, dtype and pass. No timing."""
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    key = ("auto", q.shape[1], q.dtype, training, dropout_p > 0)
    if key in pm.choices:
        return pm.choices[key]
    B, H, Tq, _ = q.shape
    dense = B * H * Tq * k.shape[2]
    if pm.is_causal:
        choice, cost = "sdpa", dense * _causal_cost(k.shape[2], q.device)
    elif _use_blocks(q, k, pm):
        choice, cost = "blocks", _blocks_work(q, pm) if pm.blocks else dense
    else:
        choice, cost = "sdpa", float(dense)
    if dropout_p == 0 and dense > 4 * _CALL_COST:  # smaller: a call's overhead is all there is
        tiles = _tiles_cost(q, k, pm, training)
        if tiles is not None and tiles <= cost:
            choice = "tiles"
    pm.choices[key] = choice
    return choice


register_backend("reference", _reference)
register_backend("math", _math)
register_backend("sdpa", _sdpa)
register_backend("sdpa_blocks", _sdpa_blocks)
register_backend("flex", _flex)
register_backend("tiles", _tiles)
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
        q_offset: absolute position of query row 0 for top-left aligned masks (e.g. a preallocated
            cache's write position); bottom-right masks place the queries at the last Tq keys and
            need 0 (see :mod:`attnmask.masks`, "Positions and causal alignment").
        backend: a name in :data:`BACKENDS`: ``"reference"`` (the seeds' formula, returns weights),
            ``"sdpa"`` (PyTorch's fused kernel with the mask), ``"sdpa_blocks"``, ``"flex"``
            (FlexAttention) or ``"auto"`` (the fastest correct one for the device).
        return_weights: also return the ``(B, H, Tq, Tk)`` attention weights (reference kernel).

    Returns:
        ``(B, H, Tq, D)``, or ``(out, weights)`` with ``return_weights``.

    Raises:
        ValueError/TypeError naming the offending shape, dtype, device or polarity.
    """
    _check_qkv(q, k, v)
    if backend not in BACKENDS:
        raise UserError(f"unknown attention backend {backend!r}; expected one of {sorted(BACKENDS)}")
    if not 0.0 <= dropout_p < 1.0:
        raise UserError(f"dropout_p must be in [0, 1), got {dropout_p}")
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    pm = prepare_mask(mask, B, H, Tq, Tk, q_offset=q_offset, device=q.device, dtype=q.dtype)
    if (pm.q_len, pm.kv_len) != (Tq, Tk):
        raise UserError(f"prepared mask is for (Tq={pm.q_len}, Tk={pm.kv_len}), attention has ({Tq}, {Tk})")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out, weights = BACKENDS[backend](q, k, v, pm, scale=scale, dropout_p=dropout_p, return_weights=return_weights)
    return (out, weights) if return_weights else out


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise UserTypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            want = "(B, H, Tq, D)" if name == "q" else "(B, Hkv, Tk, D)"
            raise UserError(f"{name} has shape {tuple(t.shape)}, expected 4-D {want}")
        if not t.dtype.is_floating_point:
            raise UserTypeError(f"{name} has dtype {t.dtype}, expected a floating dtype")
    if k.shape != v.shape:
        raise UserError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; expected equal (B, Hkv, Tk, D)")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise UserError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim; expected "
            "q (B, H, Tq, D) and k (B, Hkv, Tk, D)"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise UserError(f"query heads H={q.shape[1]} must be a multiple of key/value heads Hkv={k.shape[1]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise UserTypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise UserError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
