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
- ``sdpa``: PyTorch's fused kernel, ``is_causal=True`` only when exactly right (pure causal,
  ``Tq == Tk``, query row i at position i), the materialized bool mask otherwise;
- ``sdpa_blocks``: a causal / contiguous-padding mask run as unmasked SDPA calls over the real
  tokens (see :class:`Block`), no ``Tq x Tk`` mask; other masks as ``sdpa``;
- ``auto``: the fastest correct choice: ``reference`` for weights, ``sdpa_blocks`` when a cost
  model says the blocks are cheaper than one dense call (measured in docs/benchmarks.md), else
  ``sdpa``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnmask import masks as M

__all__ = [
    "attention",
    "prepare_mask",
    "PreparedMask",
    "Block",
    "MultiHeadAttention",
    "BACKENDS",
    "register_backend",
]


# ---------------------------------------------------------------------------------------------
# Masks as a kernel sees them
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    """One unmasked (or simply causal) SDPA call that a structured mask decomposes into.

    Batch rows ``rows``, query rows ``[q0, q1)`` and keys ``[k0, k1)``. ``diag=None``: every query
    of the block sees every key of the block; ``diag=c >= 0``: the block's query ``t`` sees its first
    ``t + c + 1`` keys (``c == 0`` is SDPA's top-left ``is_causal``). Query rows covered by no
    block attend to nothing and get zero output.
    """

    rows: tuple[int, ...]
    q0: int
    q1: int
    k0: int
    k1: int
    diag: int | None


_UNSET = object()


class PreparedMask:
    """A mask resolved for one ``(B, H, Tq, Tk)`` problem: built once per forward, shared by layers.

    What kernels read:

    - ``is_causal``: pure causal with ``Tq == Tk``, query row ``i`` at position ``i`` and nothing
      else masked -- exactly SDPA's ``is_causal=True`` (``allowed`` is then None);
    - ``allowed``: bool, broadcastable to ``(B, H, Tq, Tk)``, True = may attend; None when nothing
      is masked or ``is_causal``. For a structured mask it is materialized on first use only;
    - ``empty_rows``: bool ``(B|1, H|1, Tq, 1)``, query rows that may attend to nothing, or None;
    - ``blocks``: the mask as :class:`Block` calls needing no mask tensor, or None when the mask is
      not of that form (only causal and contiguous padding are).
    """

    def __init__(
        self,
        allowed: Tensor | None = None,
        is_causal: bool = False,
        empty_rows: Tensor | None = _UNSET,  # type: ignore[assignment]
        q_len: int = 0,
        kv_len: int = 0,
        *,
        blocks: tuple[Block, ...] | None = None,
        build: Callable[[], Tensor] | None = None,
    ):
        if is_causal and (allowed is not None or build is not None):
            raise ValueError("PreparedMask: is_causal=True takes no allowed tensor (the causal mask is implied)")
        self.is_causal, self.q_len, self.kv_len, self.blocks = is_causal, q_len, kv_len, blocks
        self._allowed, self._build, self._empty = allowed, build, empty_rows

    @property
    def allowed(self) -> Tensor | None:
        if self._build is not None:
            self._allowed, self._build = self._build(), None
        return self._allowed

    @property
    def empty_rows(self) -> Tensor | None:
        if self._empty is _UNSET:
            allowed = self.allowed
            empty = None if allowed is None else ~allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, Tq|1, 1)
            self._empty = empty if empty is not None and bool(empty.any()) else None
        return self._empty

    def dense(self, device=None) -> Tensor | None:
        """The bool mask as a tensor (materializing the causal fast path if needed)."""
        if self.is_causal:
            return (
                torch.ones(self.q_len, self.kv_len, dtype=torch.bool, device=device)
                .tril()
                .view(1, 1, self.q_len, self.kv_len)
            )  # (1, 1, Tq, Tk)
        return self.allowed

    def __repr__(self) -> str:
        kind = "causal" if self.is_causal else "none" if self._allowed is None and self._build is None else "dense"
        blocks = "" if self.blocks is None else f", {len(self.blocks)} blocks"
        return f"PreparedMask({kind}, Tq={self.q_len}, Tk={self.kv_len}{blocks})"


def prepare_mask(
    mask,
    batch_size: int,
    num_heads: int,
    q_len: int,
    kv_len: int,
    *,
    q_offset: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> PreparedMask:
    """Lint and resolve ``mask`` for a ``(B, H, Tq, Tk)`` problem.

    ``mask`` is None, a :class:`~attnmask.masks.Mask`, a bool tensor (True = may attend) or an
    additive float tensor (0 / -inf), broadcastable to ``(B, H, Tq, Tk)``; ``dtype`` is the dtype of
    the scores (an additive value it cannot hold is an error). Raises ValueError/TypeError.
    """
    if isinstance(mask, PreparedMask):
        return mask
    if mask is None:
        return PreparedMask(q_len=q_len, kv_len=kv_len)
    if isinstance(mask, M.Mask):
        q_start = mask.validate(batch_size, q_len, kv_len, q_offset, device=device)
        parts = mask.parts()
        if all(isinstance(p, M.Causal) for p in parts) and q_len == kv_len and q_start == 0:
            return PreparedMask(is_causal=True, q_len=q_len, kv_len=kv_len)
        blocks = _plan_blocks(parts, batch_size, q_len, kv_len, q_start)
        # with a block plan, a query row is empty exactly when no block covers it: no need to scan
        # the (B, Tq, Tk) tensor for empty rows when every row is covered
        covered = blocks is not None and sum(len(b.rows) * (b.q1 - b.q0) for b in blocks) == batch_size * q_len
        return PreparedMask(
            q_len=q_len,
            kv_len=kv_len,
            empty_rows=None if covered else _UNSET,
            blocks=blocks,
            build=lambda: mask.to_bool(batch_size, q_len, kv_len, q_offset, device=device),  # (B, 1, Tq, Tk)
        )
    if isinstance(mask, Tensor):
        allowed = _lint_tensor(mask, batch_size, num_heads, q_len, kv_len, device, dtype)
        return PreparedMask(allowed, q_len=q_len, kv_len=kv_len)
    raise TypeError(
        f"mask must be None, an attnmask Mask, or a tensor (bool True = may attend, or additive float), "
        f"got {type(mask).__name__}"
    )


def _plan_blocks(parts: list[M.Mask], B: int, Tq: int, Tk: int, q_start: int) -> tuple[Block, ...] | None:
    """Decompose ``causal & key padding & query padding`` (contiguous padding) into blocks.

    Each batch row keeps one interval of queries and one of keys; with a causal factor, query row
    ``i`` (position ``q_start + i``) sees keys ``[k_lo, min(k_hi, q_start + i + 1))``. Rows with the
    same blocks are grouped so that they share one call.
    """
    q_lo, q_hi, k_lo, k_hi = [0] * B, [Tq] * B, [0] * B, [Tk] * B
    causal = False
    for p in parts:
        if isinstance(p, M.Causal):
            causal = True
        elif isinstance(p, (M.KeyPadding, M.QueryPadding)):
            is_key = isinstance(p, M.KeyPadding)
            spans = p.spans(B, Tk if is_key else Tq)
            if spans is None:
                return None
            lo, hi = (k_lo, k_hi) if is_key else (q_lo, q_hi)
            for b, (a, z) in enumerate(zip(*spans)):
                lo[b], hi[b] = max(lo[b], a), min(hi[b], z)
        else:
            return None
    groups: dict[tuple[int, int, int, int, int | None], list[int]] = {}
    for b in range(B):
        for key in _row_blocks(q_lo[b], q_hi[b], k_lo[b], k_hi[b], q_start if causal else None):
            groups.setdefault(key, []).append(b)
    return tuple(Block(tuple(rows), *key) for key, rows in groups.items())


def _row_blocks(q0: int, q1: int, k0: int, k1: int, start: int | None) -> list[tuple[int, int, int, int, int | None]]:
    """The blocks of one batch row whose queries ``[q0, q1)`` see keys ``[k0, k1)``, causally from
    position ``start`` when it is not None (see :func:`_plan_blocks`)."""
    if q0 >= q1 or k0 >= k1:
        return []  # every query row is empty
    if start is None:
        return [(q0, q1, k0, k1, None)]
    e = min(max(q0, k0 - start), q1)  # rows before e see no key
    f = min(max(e, k1 - start), q1)  # rows from f on see all of [k0, k1), so does row f - 1
    out = []
    if e < f:  # row e + t sees keys [k0, k0 + t + c + 1)
        out.append((e, f, k0, start + f, e + start - k0))
    if f < q1:
        out.append((f, q1, k0, k1, None))
    return out


def _lint_tensor(t: Tensor, B: int, H: int, Tq: int, Tk: int, device, dtype) -> Tensor:
    expected = f"(B={B}, H={H} or 1, Tq={Tq}, Tk={Tk})"
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"mask is on {t.device} but the queries are on {torch.device(device)}; move it with .to()")
    if t.dim() == 3:
        raise ValueError(
            f"mask has 3-D shape {tuple(t.shape)}: ambiguous. Expected 4-D {expected} or 2-D (Tq, Tk); "
            f"for a per-batch (B, Tq, Tk) mask use mask.unsqueeze(1)"
        )
    if t.dim() not in (2, 4):
        raise ValueError(f"mask has shape {tuple(t.shape)}, expected 4-D {expected} or 2-D (Tq, Tk)")
    shape4 = t.shape if t.dim() == 4 else (1, 1, *t.shape)
    for got, want, name in zip(shape4, (B, H, Tq, Tk), ("B", "H", "Tq", "Tk")):
        if got not in (1, want):
            raise ValueError(f"mask has shape {tuple(t.shape)}, expected broadcastable to {expected} ({name} differs)")
    if t.dtype == torch.bool:
        M.lint_polarity(t)
        allowed = t
    elif t.dtype.is_floating_point:
        allowed = M.additive_to_bool(t, dtype)
    else:
        M._lint_bool_tensor(t, "mask")  # raises the polarity / dtype error
        raise AssertionError("unreachable")
    return allowed.reshape(shape4)  # (B|1, H|1, Tq, Tk); reshape: the mask may be a non-contiguous view


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


def _sdpa(q, k, v, pm: PreparedMask, *, scale, dropout_p, return_weights):
    """PyTorch's fused kernel; ``is_causal`` only when exactly right (pure causal, Tq == Tk)."""
    if return_weights:
        raise ValueError("backend 'sdpa' cannot return attention weights; use backend='reference' (or 'auto')")
    groups = q.shape[1] // k.shape[1]
    attn_mask, empty = pm.allowed, pm.empty_rows
    if attn_mask is not None and empty is not None:
        attn_mask = attn_mask | empty  # SDPA would give NaN for rows with nothing to attend to
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


def _blocks(q, k, v, blocks: tuple[Block, ...], *, scale, dropout_p) -> Tensor:
    """Run a mask decomposed into :class:`Block` s: one SDPA call per block, no ``Tq x Tk`` mask.

    Padding is sliced away instead of masked, and causal blocks use SDPA's ``is_causal`` path, so
    the work shrinks with the padding; rows in no block are zero (zero output, zero gradient).
    Consecutive batch rows with the same blocks share calls. The inputs are cut with ``split`` and
    the output glued with ``cat``, whose backward passes are views: indexing a slice per block
    would make autograd allocate and zero a full-size gradient for every block.
    """
    B, H, Tq, _ = q.shape
    gqa = q.shape[1] != k.shape[1]

    def run(qb: Tensor, kb: Tensor, vb: Tensor, blk: Block) -> Tensor:
        if (blk.k0, blk.k1) != (0, kb.shape[2]):
            kb, vb = kb[:, :, blk.k0 : blk.k1], vb[:, :, blk.k0 : blk.k1]  # (n, Hkv, k1 - k0, D)
        tril = None
        if blk.diag:  # query t sees its first t + diag + 1 keys: a small mask, not SDPA's is_causal
            tril = torch.ones(blk.q1 - blk.q0, blk.k1 - blk.k0, dtype=torch.bool, device=q.device).tril(blk.diag)
        return F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=tril, dropout_p=dropout_p, is_causal=blk.diag == 0, scale=scale, enable_gqa=gqa
        )  # (n, H, q1 - q0, D)

    plans: list[list[Block]] = [[] for _ in range(B)]
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


def _covers(blk: Block, B: int, Tq: int) -> bool:
    return len(blk.rows) == B and (blk.q0, blk.q1) == (0, Tq)


def _use_blocks(q: Tensor, k: Tensor, pm: PreparedMask) -> bool:
    """Whether the block plan beats one SDPA call with the dense mask: the blocks skip padding (and,
    for long causal blocks, half the scores) but each costs a kernel call."""
    if not pm.blocks:  # no plan, or every row empty: the dense path keeps the autograd graph
        return False
    B, H, Tq, _ = q.shape
    if len(pm.blocks) == 1 and _covers(pm.blocks[0], B, Tq):
        return True  # one plain SDPA call (is_causal, or keys sliced) never loses to a masked one
    dense = B * H * Tq * k.shape[2]
    work = 0.0
    for blk in pm.blocks:
        rect = len(blk.rows) * H * (blk.q1 - blk.q0) * (blk.k1 - blk.k0)
        work += rect * (_causal_cost(blk.k1 - blk.k0, q.device) if blk.diag == 0 else 1.0) + _CALL_COST
    return work <= _MIN_SAVING * dense


def _sdpa_blocks(q, k, v, pm: PreparedMask, *, scale, dropout_p, return_weights):
    """:func:`_blocks` whenever the mask has a block plan (causal / contiguous padding), else ``sdpa``."""
    if return_weights:
        raise ValueError("backend 'sdpa_blocks' cannot return attention weights; use backend='reference' (or 'auto')")
    if pm.is_causal or not pm.blocks:
        return _sdpa(q, k, v, pm, scale=scale, dropout_p=dropout_p, return_weights=False)
    return _blocks(q, k, v, pm.blocks, scale=scale, dropout_p=dropout_p), None


def _auto(q, k, v, pm: PreparedMask, *, scale, dropout_p, return_weights):
    """The fastest correct choice: weights need the reference kernel; a causal / contiguous padding
    mask runs as unmasked SDPA blocks when that is cheaper; anything else is SDPA with the mask."""
    if return_weights:
        return _reference(q, k, v, pm, scale=scale, dropout_p=dropout_p, return_weights=True)
    if not pm.is_causal and _use_blocks(q, k, pm):
        return _blocks(q, k, v, pm.blocks, scale=scale, dropout_p=dropout_p), None
    return _sdpa(q, k, v, pm, scale=scale, dropout_p=dropout_p, return_weights=False)


register_backend("reference", _reference)
register_backend("sdpa", _sdpa)
register_backend("sdpa_blocks", _sdpa_blocks)
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
            ``"sdpa"`` (PyTorch's fused kernel with the mask) or ``"auto"`` (the fastest correct one).
        return_weights: also return the ``(B, H, Tq, Tk)`` attention weights (reference kernel).

    Returns:
        ``(B, H, Tq, D)``, or ``(out, weights)`` with ``return_weights``.

    Raises:
        ValueError/TypeError naming the offending shape, dtype, device or polarity.
    """
    _check_qkv(q, k, v)
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {sorted(BACKENDS)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    pm = prepare_mask(mask, B, H, Tq, Tk, q_offset=q_offset, device=q.device, dtype=q.dtype)
    if (pm.q_len, pm.kv_len) != (Tq, Tk):
        raise ValueError(f"prepared mask is for (Tq={pm.q_len}, Tk={pm.kv_len}), attention has ({Tq}, {Tk})")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out, weights = BACKENDS[backend](q, k, v, pm, scale=scale, dropout_p=dropout_p, return_weights=return_weights)
    return (out, weights) if return_weights else out


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            want = "(B, H, Tq, D)" if name == "q" else "(B, Hkv, Tk, D)"
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected 4-D {want}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} has dtype {t.dtype}, expected a floating dtype")
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; expected equal (B, Hkv, Tk, D)")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim; expected "
            "q (B, H, Tq, D) and k (B, Hkv, Tk, D)"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads H={q.shape[1]} must be a multiple of key/value heads Hkv={k.shape[1]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")


# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------
_FUSED_SELF_ONLY = "this attention's projections are fused (fuse_projections_): it attends to its own input only"


class MultiHeadAttention(nn.Module):
    """Multi-head (grouped-query) attention for self- and cross-attention.

    ``forward(x, context=None, mask=None, ...)``: queries from ``x`` ``(B, Tq, C)``; keys/values
    from ``context`` ``(B, Tk, C)`` (cross-attention) or from ``x`` (self-attention).
    """

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = False,
        dropout: float = 0.0,
        backend: str = "auto",
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, val in (("dim", dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"MultiHeadAttention {name} must be an int >= 1, got {val!r}")
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}; pass head_dim explicitly")
            head_dim = dim // num_heads
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; expected one of {sorted(BACKENDS)}")
        self.dim, self.num_heads, self.num_kv_heads, self.head_dim = dim, num_heads, num_kv_heads, head_dim
        self.dropout, self.backend = dropout, backend
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=bias)
        # set by attnmask.model.fuse_projections_: one product for q, k and v of self-attention
        self.qkv_proj: nn.Module | None = None

    def project_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values ``(B, Hkv, Tk, D)`` of ``context`` (B, Tk, C) — cacheable for cross-attention."""
        if self.k_proj is None:
            raise ValueError(_FUSED_SELF_ONLY)
        B, Tk, _ = context.shape
        k = self.k_proj(context).view(B, Tk, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, Tk, D)
        v = self.v_proj(context).view(B, Tk, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, Tk, D)
        return k, v

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        mask=None,
        *,
        rope: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
        kv_cache=None,
        static_kv: tuple[Tensor, Tensor] | None = None,
        q_offset: int = 0,
        return_weights: bool = False,
    ):
        """Args:
            x: ``(B, Tq, C)``; context: ``(B, Tk, C)`` for cross-attention.
            mask: as for :func:`attention` (a PreparedMask avoids rebuilding it in every layer).
            rope: ``rope(q, k) -> (q, k)`` applying rotary positions to ``(B, H|Hkv, T, D)``.
            kv_cache: an object with ``update(k, v) -> (k_all, v_all)`` (see :mod:`attnmask.cache`).
            static_kv: precomputed cross-attention ``(k, v)`` (encoder computed once per source).
        Returns ``(B, Tq, C)`` (and the weights with ``return_weights``).
        """
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x has shape {tuple(x.shape)}, expected (B, Tq, C={self.dim})")
        B, Tq, _ = x.shape
        if context is not None and (context.dim() != 3 or context.shape[0] != B or context.shape[-1] != self.dim):
            raise ValueError(f"context has shape {tuple(context.shape)}, expected (B={B}, Tk, C={self.dim})")
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            if context is not None or static_kv is not None:
                raise ValueError(_FUSED_SELF_ONLY)
            q, k, v = self.qkv_proj(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
            q = q.view(B, Tq, H, D).transpose(1, 2)  # (B, H, Tq, D)
            k, v = (t.view(B, Tq, Hkv, D).transpose(1, 2) for t in (k, v))  # (B, Hkv, Tq, D)
        else:
            q = self.q_proj(x).view(B, Tq, H, D).transpose(1, 2)  # (B, H, Tq, D)
        if static_kv is not None:
            k, v = static_kv
        else:
            if self.qkv_proj is None:
                k, v = self.project_kv(x if context is None else context)  # (B, Hkv, Tk, D)
            if rope is not None:
                q, k = rope(q, k)
            if kv_cache is not None:
                k, v = kv_cache.update(k, v)  # (B, Hkv, Tpast + Tq, D)
        res = attention(
            q,
            k,
            v,
            mask,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self.backend,
            return_weights=return_weights,
            q_offset=q_offset,
        )
        out, weights = res if return_weights else (res, None)
        out = self.o_proj(out.transpose(1, 2).reshape(B, Tq, self.num_heads * self.head_dim))  # (B, Tq, C)
        return (out, weights) if return_weights else out
