"""``decode_one``: one token per row through the decoder, written for speed and for ``torch.compile``.

:meth:`attnmask.model.Transformer.decode` is the general forward pass (any mask, any length, the
attention backends, shape checks); a decoding step needs one case of it: one new token per row,
keys and values already in the preallocated :class:`~attnmask.model.cache.KVCache`. This module
runs that case with the model's own modules (embeddings, norms, projections, MLP, rotary, head) and
one ``scaled_dot_product_attention`` per attention, and nothing else:

- the new keys/values are written into the cache buffers in place (``index_copy_`` at a column
  given as a tensor), so the buffers never move and never change shape;
- the self-attention mask is built from tensors (``column <= step`` and the rows' key padding):
  no Python branch on a tensor value, no host read;
- grouped-query heads attend without repeating keys: the ``H / Hkv`` query heads of a key/value
  head are its ``G`` queries (``(B, Hkv, G, D)`` against ``(B, Hkv, Tk, D)``).

Eager, a pre-norm RMSNorm / SwiGLU decoder with fused projections in float32 on the CPU (Llama,
SmolLM2) takes a shorter route, :func:`_fused_step`: the work between the products in the C++
operators of :mod:`attnmask.ops.decoding`, four products and three calls a layer, all made from C++
in one ``decoder_step`` call a token (what that saves: docs/benchmarks.md, SmolLM2).

Eager calls attend over exactly the ``step + 1`` cached keys. :class:`CompiledStep` (``torch.compile``)
attends over a *bucket* of keys (the next power of two >= 64, at most the cache's length), masked
beyond the step: the compiled graph's shapes then change only when the bucket grows (a few times
per generation), not every step; the cache's unwritten tail is zeroed once so masked keys are
finite. Both compute every row's logits independently of the other rows.
"""

from __future__ import annotations

import os
import types
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnmask import ops
from attnmask.errors import UserError
from attnmask.linear import Linear
from attnmask.linear import engine as linear_engine
from attnmask.model.cache import KVCache
from attnmask.model.layers import RMSNorm, Rotary
from attnmask.ops import decoding

__all__ = ["CompiledStep", "auto_compile", "bucket", "decode_one", "zero_unwritten"]


def auto_compile(model) -> bool:
    """Whether compiling the step pays by default: on a GPU (a batch-1 step is bound by kernel
    launches, which a CUDA graph replays at once), not on a CPU (there the eager step with the fused
    operators measured faster than inductor's graph for SmolLM2: docs/benchmarks.md)."""
    return next(model.parameters()).device.type == "cuda"


def _attend(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None) -> Tensor:
    """``q (B, H, 1, D)`` against ``k, v (B, Hkv, Tk, D)``, ``allowed (B, 1, 1, Tk)`` -> ``(B, 1, H*D)``."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, H // Hkv, D)  # the G query heads of each key/value head as its G queries
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=allowed)  # (B, Hkv, G, D)
    return out.reshape(B, 1, H * D)  # heads in order h = j * G + g


def _allowed(col: Tensor, keys: int, key_ok: Tensor | None, bucketed: bool) -> Tensor | None:
    """Bool ``(B|1, 1, 1, keys)``: the columns written so far (``<= col``) and not padding; None when
    that is every column (eager, nothing padded)."""
    allowed = None
    if bucketed:
        allowed = (torch.arange(keys, device=col.device) <= col)[None, None, None, :]  # (1, 1, 1, Tk)
    if key_ok is not None:
        allowed = key_ok[..., :keys] if allowed is None else allowed & key_ok[..., :keys]  # (B, 1, 1, Tk)
    return allowed


def _additive(allowed: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A bool mask as the additive one SDPA would make of it in every layer, made once per step."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _self_attention(attn, h: Tensor, rope, k_buf: Tensor, v_buf: Tensor, col: Tensor, keys: int, allowed):
    B = h.shape[0]
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if attn.qkv_proj is not None:
        qk, v = attn.qkv_proj(h).split([(H + Hkv) * D, Hkv * D], dim=-1)
        qk = qk.view(B, 1, H + Hkv, D).transpose(1, 2)  # (B, H + Hkv, 1, D)
        if rope is not None:  # queries and keys rotated as one tensor: the same products, half the calls
            qk = Rotary.rotate_signed(qk, *rope)
        q, k = qk.split([H, Hkv], dim=1)  # (B, H, 1, D), (B, Hkv, 1, D)
    else:
        q = attn.q_proj(h).view(B, 1, H, D).transpose(1, 2)  # (B, H, 1, D)
        k = attn.k_proj(h).view(B, 1, Hkv, D).transpose(1, 2)  # (B, Hkv, 1, D)
        if rope is not None:
            q, k = Rotary.rotate_signed(q, *rope), Rotary.rotate_signed(k, *rope)
    v = (
        v.view(B, 1, Hkv, D).transpose(1, 2)
        if attn.qkv_proj is not None
        else attn.v_proj(h).view(B, 1, Hkv, D).transpose(1, 2)
    )
    k_buf.index_copy_(2, col, k.to(k_buf.dtype))  # the cache column of this step, in place
    v_buf.index_copy_(2, col, v.to(v_buf.dtype))
    out = _attend(q, k_buf[:, :, :keys].to(q.dtype), v_buf[:, :, :keys].to(q.dtype), allowed)
    return attn.o_proj(out)


def _cross_attention(attn, h: Tensor, kv: tuple[Tensor, Tensor], allowed: Tensor | None) -> Tensor:
    B = h.shape[0]
    q = attn.q_proj(h).view(B, 1, attn.num_heads, attn.head_dim).transpose(1, 2)  # (B, H, 1, D)
    return attn.o_proj(_attend(q, kv[0], kv[1], allowed))


def _step(
    model,
    k_bufs: list[Tensor],
    v_bufs: list[Tensor],
    cross: list[tuple[Tensor, Tensor]] | None,
    tokens: Tensor,
    positions: Tensor,
    col: Tensor,
    keys: int,
    key_ok: Tensor | None,
    src_ok: Tensor | None,
    bucketed: bool = False,
) -> Tensor:
    """The step itself, a pure function of tensors (what :class:`CompiledStep` compiles).

    ``tokens, positions (B,)``; ``col (1,)`` the cache column written; ``keys`` the columns attended
    (``col + 1`` eager, a bucket compiled); ``key_ok (B, 1, 1, >= keys)`` key padding or None;
    ``src_ok (B, 1, 1, S)`` source padding or None. Returns logits ``(B, V)``.
    """
    x = model._embed(tokens[:, None], positions[:, None], source=False)  # (B, 1, C)
    allowed = _additive(_allowed(col, keys, key_ok, bucketed), x.dtype)  # (B|1, 1, 1, Tk) or None
    src_ok = _additive(src_ok, x.dtype)  # (B, 1, 1, S) or None
    rope = None
    if model.config.positions == "rotary":  # cos and sin once per step, shared by every layer
        cos, sin = model.rotary.cos_sin(positions[:, None])  # (B, 1, 1, D)
        rope = (cos, Rotary.signed_sin(sin))
    for i, layer in enumerate(model.layers):
        x = layer._sublayer(
            x,
            layer.self_norm,
            lambda h, a=layer.self_attn, i=i: _self_attention(a, h, rope, k_bufs[i], v_bufs[i], col, keys, allowed),
        )
        if cross is not None:
            x = layer._sublayer(
                x, layer.cross_norm, lambda h, a=layer.cross_attn, i=i: _cross_attention(a, h, cross[i], src_ok)
            )
        x = layer._sublayer(x, layer.mlp_norm, layer.mlp)
    return model.lm_head(model.norm(x))[:, 0]  # (B, V)


def _layer_parts(model) -> list[tuple]:
    """Per layer: (self-attention, its norm, MLP, its norm) and, per attention and MLP, the submodules
    the fused step calls, read from the modules' own dicts: ``module.name`` goes through nn.Module's
    Python ``__getattr__`` (~0.6 us), and a SmolLM2 step would make ~900 such lookups."""
    parts = []
    for layer in model.layers:
        mods = layer._modules
        attn, mlp = mods["self_attn"]._modules, mods["mlp"]._modules
        parts.append(
            (mods["self_attn"], mods["self_norm"], mods["mlp_norm"], attn.get("qkv_proj"), attn.get("o_proj"))
            + (mlp.get("gate_up_proj"), mlp.get("down_proj"))
        )
    return parts


def _fusable(model, parts: list[tuple], k_bufs: list[Tensor], cross) -> bool:
    """Whether :func:`_fused_step` can run this step: a decoder-only, pre-norm RMSNorm / SwiGLU model
    in eval mode with fused q/k/v and gate/up projections, float32 on the CPU, and the C++ operators
    of :mod:`attnmask.ops.decoding` built."""
    cfg, final = model.config, model._modules["norm"]
    if cross is not None or model.training or cfg.norm_position != "pre" or not isinstance(final, RMSNorm):
        return False
    if not k_bufs or k_bufs[0].dtype != torch.float32 or k_bufs[0].device.type != "cpu":
        return False
    if not all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters()):
        return False  # e.g. a bfloat16 model decoding into a float32 cache
    for _, self_norm, mlp_norm, qkv, _, gate_up, _ in parts:
        if qkv is None or gate_up is None or not isinstance(self_norm, RMSNorm) or not isinstance(mlp_norm, RMSNorm):
            return False
    return ops.available()


# Up to this many rows, linear_rows multiplies a float32 weight streamed from memory faster than the
# BLAS (1536x576, Zen 5, one thread: 102 against 213 us at 1 row, 385 against 490 at 16; two threads
# 77 / 210 and 198 / 336); beyond, the BLAS's matrix-matrix kernels take over.
LINEAR_ROWS_MAX = 16


def _operands(proj, rows: int) -> tuple[int, list[Tensor]] | None:
    """What :func:`attnmask.ops.decoding.decoder_step` takes for ``proj``: ``(kind, tensors)`` for a
    block layer (its ``decoder_operands``) or a float32 ``nn.Linear`` with a row-major weight (up to
    ``LINEAR_ROWS_MAX`` rows); None where it has no product for it, or a hook watches the module."""
    if proj._forward_hooks or proj._forward_pre_hooks:
        return None
    blocks = getattr(proj, "decoder_operands", None)
    if blocks is not None:
        return blocks()
    if type(proj) in (nn.Linear, Linear) and rows <= LINEAR_ROWS_MAX:
        w, b = proj._parameters["weight"], proj._parameters["bias"]
        if w.dtype == torch.float32 and w.is_contiguous():
            return decoding.DENSE, [w, w.new_empty(0) if b is None else b]
    return None


def _project(proj, h: Tensor) -> Tensor:
    """``proj(h)`` for float32 rows ``h (rows, K)`` as :func:`attnmask.ops.decoding.decoder_step` computes
    it (``linear_rows``, or the block operator without the module's per-call checks), else the module."""
    operands = _operands(proj, h.shape[0])
    if operands is None:
        return proj(h)
    kind, (w, b, *_) = operands
    return decoding.linear_rows(h, w, b if b.numel() else None) if kind == decoding.DENSE else proj.matmul_rows(h)


def _step_operands(model, parts, rows: int) -> tuple[list[Tensor], list[float], list[Tensor], list[int]] | None:
    """The norms, their eps, the product tensors and their kinds of a whole step, in
    :func:`attnmask.ops.decoding.decoder_step`'s order; None where one product cannot go through it."""
    norms = [n for p in parts for n in (p[1], p[2])] + [model._modules["norm"]]
    products, kinds = [], []
    for proj in [m for p in parts for m in p[3:]] + [model._modules["lm_head"]]:
        operands = _operands(proj, rows)
        if operands is None:
            return None
        kinds.append(operands[0])
        products += operands[1]
    return [n._parameters["weight"] for n in norms], [n.eps for n in norms], products, kinds


def _plan(model, cache: KVCache, k_bufs: list[Tensor], cross) -> tuple | None:
    """``(parts, operands)`` for :func:`_fused_step` (operands None: not through decoder_step), or None
    where the fused step does not apply. Read from the modules once per generation and batch size
    (kept in ``cache.memo``): a generation does not swap the model's modules or hooks between its
    tokens, and reading them costs ~0.5 ms a SmolLM2 token."""
    key = ("fused", k_bufs[0].shape[0] if k_bufs else 0)
    memo = cache.memo.get(key)
    if memo is None or memo[0] is not model:
        parts = _layer_parts(model)
        plan = None
        if _fusable(model, parts, k_bufs, cross):
            plan = (parts, _step_operands(model, parts, k_bufs[0].shape[0]))
        memo = cache.memo[key] = (model, plan)
    return memo[1]


def _fused_step(model, plan, k_bufs, v_bufs, tokens: Tensor, positions: Tensor, col: int, key_ok) -> Tensor:
    """:func:`_step` (eager, decoder-only) through the operators of :mod:`attnmask.ops.decoding`: the
    whole step in one call (:func:`~attnmask.ops.decoding.decoder_step`) where every product can go
    through it, else the same calls from Python, per layer the four products and three calls between
    them (the same bits either way). Returns logits ``(B, V)``."""
    B = tokens.shape[0]
    x = model._embed(tokens[:, None], positions[:, None], source=False).reshape(B, -1)  # (B, C), float32
    bias = _additive(_allowed(None, col + 1, key_ok, False), x.dtype)  # (B, 1, 1, col + 1) or None
    cos = signed = x.new_empty(0)
    if model.config.positions == "rotary":
        cos, sin = model.rotary.cos_sin(positions[:, None])  # (B, 1, 1, D)
        cos, signed = cos.reshape(B, -1), Rotary.signed_sin(sin).reshape(B, -1)  # (B, D)
    parts, operands = plan
    attn0 = parts[0][0]
    H, Hkv, D = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
    if operands is not None:
        norm_weights, eps, products, kinds = operands
        return decoding.decoder_step(
            x, cos, signed, norm_weights, eps, products, kinds, k_bufs, v_bufs, col, bias, H, Hkv, D**-0.5
        )
    norms = [p[1] for p in parts] + [model._modules["norm"]]  # each layer's first norm, then the final one
    h = decoding.rms_norm(x, norms[0]._parameters["weight"], norms[0].eps)
    for i, (_, _, mlp_norm, qkv_proj, o_proj, gate_up, down) in enumerate(parts):
        qkv = _project(qkv_proj, h)  # (B, (H + 2 Hkv) D)
        out = decoding.rope_attend(qkv, cos, signed, k_bufs[i], v_bufs[i], col, col + 1, bias, H, Hkv, D**-0.5)
        x, h = decoding.add_rms_norm(x, _project(o_proj, out), mlp_norm._parameters["weight"], mlp_norm.eps)
        delta = _project(down, decoding.silu_mul(_project(gate_up, h)))
        x, h = decoding.add_rms_norm(x, delta, norms[i + 1]._parameters["weight"], norms[i + 1].eps)
    return _project(model._modules["lm_head"], h)  # (B, V)


def _buffers(model, cache: KVCache, rows: int):
    if cache.rows != rows:
        raise UserError(f"decode_one: {rows} tokens for a cache holding {cache.rows} rows")
    if cache.pos + 1 > cache.max_len:
        raise UserError(f"KV cache overflow: {cache.pos} cached + 1 new token > capacity {cache.max_len} (max_len)")
    k_bufs = [layer.k[:rows] for layer in cache.layers]  # views: writes land in the cache
    v_bufs = [layer.v[:rows] for layer in cache.layers]
    cross = None
    if model.is_encoder_decoder:
        cross = [cache.cross_kv(i, layer.cross_attn, None) for i, layer in enumerate(model.layers)]
    return k_bufs, v_bufs, cross


@torch.inference_mode()
def decode_one(
    model, cache: KVCache, tokens: Tensor, positions: Tensor, key_ok: Tensor | None, src_ok: Tensor | None
) -> Tensor:
    """Feed ``tokens (B,)`` at ``positions (B,)`` into the prefilled ``cache`` (advanced by one);
    returns the next logits ``(B, V)``. ``key_ok (B, 1, 1, Tmax)``: key padding (None: none);
    ``src_ok (B, 1, 1, S)``: source padding for cross-attention (None: none)."""
    k_bufs, v_bufs, cross = _buffers(model, cache, tokens.shape[0])
    plan = _plan(model, cache, k_bufs, cross)
    if plan is not None:
        logits = _fused_step(model, plan, k_bufs, v_bufs, tokens, positions, cache.pos, key_ok)
    else:
        col = torch.tensor([cache.pos], device=tokens.device)
        logits = _step(model, k_bufs, v_bufs, cross, tokens, positions, col, cache.pos + 1, key_ok, src_ok)
    cache.advance(1)
    return logits


def zero_unwritten(cache: KVCache) -> None:
    """Zero the cache columns not written yet, so that masked keys beyond the step are finite."""
    for layer in cache.layers:
        if layer.k is not None:
            layer.k[:, :, cache.pos :].zero_()
            layer.v[:, :, cache.pos :].zero_()


def compile_failure(err: BaseException) -> str:
    """``"Type: first line"`` of the error under torch.compile's wrappers: what went wrong, in one line."""
    root = err
    while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
        root = inner
    lines = str(root).strip().splitlines()
    return f"{type(root).__name__}: {lines[0] if lines else ''}"


def bucket(n: int) -> int:
    """The shape a compiled step uses for ``n`` columns: the next power of two, at least 64."""
    return max(64, 1 << (n - 1).bit_length())


class CompiledStep:
    """:func:`decode_one` through ``torch.compile``: inductor on the CPU, CUDA graphs
    (``mode="reduce-overhead"``) on a GPU. Keys are attended in buckets (see the module's notes),
    so the graph is recompiled only when the bucket or the batch size changes.

    If the compiler cannot run here, the first call says so once (``notice(message)``, default a
    warning) and every call runs :func:`decode_one` eagerly; results are the same either way up to
    rounding. ``ATTNMASK_NO_COMPILE=1`` turns it off. ``backend`` other than ``"inductor"`` (e.g.
    ``"eager"``: trace only) is for tests.
    """

    def __init__(self, model, mode: str | None = None, *, backend: str = "inductor", notice=None):
        self.model, self.backend = model, backend
        self.notice = notice if notice is not None else (lambda msg: warnings.warn(msg, stacklevel=4))
        device = next(model.parameters()).device
        self.mode = mode if mode is not None else ("reduce-overhead" if device.type == "cuda" else "default")
        self._fn = None
        self._source = None  # (the cache's first cross keys, src_ok, their padded forms)
        self.capacity = 0  # the longest cache seen: later caches are at least as long (same strides)
        self.failed: str | None = None
        if os.environ.get("ATTNMASK_NO_COMPILE", "") not in ("", "0"):
            self.failed = "disabled by ATTNMASK_NO_COMPILE"

    def _padded_source(self, cross, src_ok):
        """Cross-attention keys/values and source padding padded with masked zero columns to a
        bucket of source positions, once per source batch (they do not change while it decodes)."""
        if self._source is not None and self._source[0] is cross[0][0] and self._source[1] is src_ok:
            return self._source[2], self._source[3]
        k0 = cross[0][0]
        B, S = k0.shape[0], k0.shape[2]
        S2 = bucket(S)
        padded = [tuple(F.pad(t, (0, 0, 0, S2 - S)) for t in kv) for kv in cross]  # (B, Hkv, S2, D)
        ok = torch.ones(B, 1, 1, S, dtype=torch.bool, device=k0.device) if src_ok is None else src_ok
        ok = F.pad(ok, (0, S2 - S), value=False)  # (B, 1, 1, S2)
        self._source = (k0, src_ok, padded, ok)
        return padded, ok

    def _compiled(self):
        if self._fn is None:
            mode = self.mode if self.backend == "inductor" else None
            # a function of its own (a copy of _step's code): Dynamo keeps compiled graphs, and counts
            # recompilations against its limit, per code object, so steps of other models or
            # backends do not share them
            fn = types.FunctionType(_step.__code__.replace(), _step.__globals__, "_step", _step.__defaults__)
            linear_engine()  # decided (and timed) before tracing, not inside it
            self._fn = torch.compile(fn, backend=self.backend, mode=mode, dynamic=False, fullgraph=True)
        return self._fn

    @torch.inference_mode()
    def __call__(
        self, cache: KVCache, tokens: Tensor, positions: Tensor, key_ok: Tensor | None, src_ok: Tensor | None
    ) -> Tensor:
        if self.failed is not None:
            return decode_one(self.model, cache, tokens, positions, key_ok, src_ok)
        k_bufs, v_bufs, cross = _buffers(self.model, cache, tokens.shape[0])
        col = torch.tensor([cache.pos], device=tokens.device)
        keys = min(bucket(cache.pos + 1), cache.max_len)
        # every shape the graph sees is a bucket: the cache's columns, the key padding, the source
        k_fixed, v_fixed = [k[:, :, :keys] for k in k_bufs], [v[:, :, :keys] for v in v_bufs]
        key_fixed = None if key_ok is None else key_ok[..., :keys]
        if cross is not None:
            cross, src_fixed = self._padded_source(cross, src_ok)
        else:
            src_fixed = src_ok
        try:
            logits = self._compiled()(
                self.model, k_fixed, v_fixed, cross, tokens, positions, col, keys, key_fixed, src_fixed, True
            )
        except Exception as err:  # no C++ compiler, no triton, an unsupported op: run eagerly
            self.failed = compile_failure(err)
            self.notice(f"attnmask: torch.compile unavailable, decoding without it ({self.failed})")
            logits = _step(self.model, k_bufs, v_bufs, cross, tokens, positions, col, cache.pos + 1, key_ok, src_ok)
        cache.advance(1)
        return logits
