"""Structured masks: causal, sliding window, padding, prefix LM, documents, predicates, tensors.

Each keeps what it is, so attention can pick a kernel without building a ``Tq x Tk`` tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnmask.errors import UserError, UserTypeError
from attnmask.masks.core import ALIGNMENTS, Mask, _batch_index, _Ctx


# ---------------------------------------------------------------------------------------------
# Structured masks
# ---------------------------------------------------------------------------------------------
def _check_align(align: str) -> str:
    if align not in ALIGNMENTS:
        raise UserError(f"align must be one of {ALIGNMENTS}, got {align!r}")
    return align


class Causal(Mask):
    """Look-ahead mask: query at position p sees keys ``j <= p`` (seed 000, eq. 1)."""

    def __init__(self, align: str = "bottom_right"):
        self.align = _check_align(align)

    def _batch_free(self):
        return True

    def _eval(self, ctx, b, h, q, kv):
        return kv <= q

    def _spans(self, ctx, pos):
        return [(torch.zeros_like(pos), pos + 1)]

    def __repr__(self):
        return f"Causal(align={self.align!r})"


class SlidingWindow(Mask):
    """Causal local attention: query at position p sees keys ``p - size < j <= p``."""

    def __init__(self, size: int, align: str = "bottom_right"):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise UserError(f"sliding window size must be an int >= 1, got {size!r}")
        self.size = size
        self.align = _check_align(align)

    def _batch_free(self):
        return True

    def _eval(self, ctx, b, h, q, kv):
        return (kv <= q) & (kv > q - self.size)

    def _spans(self, ctx, pos):
        return [(pos - self.size + 1, pos + 1)]

    def __repr__(self):
        return f"SlidingWindow(size={self.size}, align={self.align!r})"


def _checking() -> bool:
    """Value checks (host reads) run where a mask is built eagerly; inside ``torch.compile`` they
    would break the graph, and the values there come from tensors the model itself made."""
    return not torch.compiler.is_compiling()


def _lengths_tensor(lengths, name: str, *, allow_int: bool = False) -> Tensor:
    if allow_int and isinstance(lengths, int) and not isinstance(lengths, bool):
        lengths = [lengths]  # one length for every batch row
    t = torch.as_tensor(lengths)
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise UserTypeError(f"{name} must be integers, got dtype {t.dtype}")
    if t.dim() != 1:
        hint = " (a plain int is not allowed: pass one length per batch row, e.g. [3] * B)" if t.dim() == 0 else ""
        raise UserError(f"{name} must have shape (B,), got {tuple(t.shape)}{hint}")
    if _checking() and t.numel() and bool((t < 0).any()):
        raise UserError(f"{name} must be >= 0, got {t.tolist()}")
    return t.long()


def _max_or_none(t: Tensor | None) -> int | None:
    """The largest value of a lengths tensor, read once where the mask is built (None when unknown)."""
    if t is None or not t.numel() or not _checking():
        return None
    return int(t.max())


class _Padding(Mask):
    """Shared machinery of key and query padding: which positions along one axis are real."""

    axis_name = "key"

    def __init__(self, *, lengths=None, keep=None, side: str = "right"):
        if (lengths is None) == (keep is None):
            got = "both lengths= and keep=" if lengths is not None else "neither"
            raise UserError(
                f"padding needs exactly one of lengths=(B,) ints, keep=(B, T) bool, or token_ids=; got {got}"
            )
        if side not in ("right", "left"):
            raise UserError(f"padding side must be 'right' or 'left', got {side!r}")
        self.side = side
        self.lengths = _lengths_tensor(lengths, "lengths") if lengths is not None else None
        self._max_length = _max_or_none(self.lengths)  # checked against the padded length in _check
        if keep is not None:
            keep = torch.as_tensor(keep)
            if keep.dtype != torch.bool:
                raise UserTypeError(
                    f"keep must be a bool tensor (True = real token), got dtype {keep.dtype}; "
                    "for Hugging Face 0/1 attention masks use masks.from_hf"
                )
            if keep.dim() != 2:
                raise UserError(f"keep must have shape (B, T), got {tuple(keep.shape)}")
        self.keep = keep

    @property
    def batch_size(self) -> int:
        return len(self.lengths) if self.lengths is not None else self.keep.shape[0]

    def _device(self):
        return (self.lengths if self.lengths is not None else self.keep).device

    def _axis_len(self, q_len: int, kv_len: int) -> int:
        return kv_len

    def _check(self, batch_size, q_len, kv_len):
        n = self._axis_len(q_len, kv_len)
        if self.batch_size not in (1, batch_size):
            raise UserError(f"{self.axis_name} padding has batch size {self.batch_size}, expected {batch_size}")
        if self.lengths is not None:
            if self._max_length is not None and self._max_length > n:
                raise UserError(
                    f"{self.axis_name} padding lengths {self.lengths.tolist()} exceed the sequence length {n}"
                )
        elif self.keep.shape[1] != n:
            raise UserError(
                f"{self.axis_name} padding keep has shape {tuple(self.keep.shape)}, expected (B={batch_size}, T={n})"
            )

    def spans(self, batch_size: int, n: int) -> tuple[list[int], list[int]] | None:
        """Each row's real tokens as one interval ``[lo, hi)`` along the padded axis of length ``n``.

        Returns ``(lo, hi)`` lists of ``batch_size`` ints, or None when some row's real tokens are
        not contiguous (a ``keep`` with holes). The CPU block plan uses this to slice instead of
        masking; it reads the tensors on the host, so nothing on an accelerator or under
        ``torch.compile`` calls it.
        """
        if self.lengths is not None:
            lengths = self.lengths.expand(batch_size).tolist()
            if self.side == "right":
                return [0] * batch_size, lengths
            return [n - L for L in lengths], [n] * batch_size
        if n == 0:
            return [0] * batch_size, [0] * batch_size
        keep = self.keep.expand(batch_size, n)  # (B, n)
        count = keep.sum(dim=1)  # (B,)
        lo = keep.to(torch.uint8).argmax(dim=1)  # (B,) first real token (0 when there is none)
        pos = torch.arange(n, device=keep.device)  # (n,)
        interval = (pos >= lo[:, None]) & (pos < (lo + count)[:, None])  # (B, n)
        if not torch.equal(interval, keep):
            return None
        lo, count = lo.tolist(), count.tolist()
        return lo, [a + c for a, c in zip(lo, count)]

    def _batch_free(self):
        return self.batch_size == 1

    def _interval(self, ctx: _Ctx, n: int) -> tuple[Tensor, Tensor]:
        """Each row's real tokens bounded by one interval ``[lo, hi)`` along the axis of length ``n``,
        as ``(B|1, 1)`` long tensors (exact for lengths and contiguous ``keep``)."""
        if self.keep is not None:
            keep = ctx.on_device(self.keep)  # (B|1, n)
            pos = torch.arange(keep.shape[1], device=keep.device)  # (n,)
            lo = torch.where(keep, pos, n).amin(dim=1, keepdim=True)  # (B|1, 1) first real token
            hi = torch.where(keep, pos + 1, 0).amax(dim=1, keepdim=True)  # (B|1, 1) after the last one
            return lo, hi
        lengths = ctx.on_device(self.lengths).view(-1, 1)  # (B|1, 1)
        if self.side == "right":
            return torch.zeros_like(lengths), lengths
        return n - lengths, torch.full_like(lengths, n)

    def _real(self, ctx: _Ctx, b: Tensor, local: Tensor, n: int | None) -> Tensor:
        """Whether index ``local`` along the padded axis (of length ``n``) is a real token in batch
        row ``b``; ``b`` and ``local`` are broadcast index tensors or, in a mask_mod, scalars."""
        if self.keep is not None:
            keep = ctx.on_device(self.keep)  # (B|1, n)
            if ctx.dense:  # local is an arange along the padded axis: slice, no per-element gather
                return keep[:, local.reshape(-1)].view(keep.shape[0], *local.shape[1:])  # (B|1, 1, Tq|1, Tk|1)
            return keep[_batch_index(b, keep.shape[0]), local.clamp(0, keep.shape[1] - 1)]
        lengths = ctx.on_device(self.lengths)  # (B|1,)
        length = lengths.view(-1, 1, 1, 1) if ctx.dense else lengths[_batch_index(b, lengths.shape[0])]
        if self.side == "right":
            return local < length
        if n is None:
            raise UserError(
                f"left {self.axis_name} padding by lengths needs the padded length: call mask_mod(q_len, kv_len)"
            )
        return local >= n - length

    def __repr__(self):
        what = f"lengths={self.lengths.tolist()}" if self.lengths is not None else "keep=..."
        return f"{type(self).__name__}({what}, side={self.side!r})"


class KeyPadding(_Padding):
    """Blocks ``<PAD>`` keys (seed 004's padding mask); cross-attention uses it over encoder keys."""

    def _eval(self, ctx, b, h, q, kv):
        return self._real(ctx, b, kv, ctx.kv_len)  # (B, 1, 1, Tk)

    def _spans(self, ctx, pos):
        return [self._interval(ctx, ctx.kv_len)]  # (B|1, 1) each


class QueryPadding(_Padding):
    """Blocks whole query rows that are padding; their attention output is zero."""

    axis_name = "query"

    def _axis_len(self, q_len, kv_len):
        return q_len

    def _eval(self, ctx, b, h, q, kv):
        return self._real(ctx, b, q - ctx.q_start, ctx.q_len)  # (B, 1, Tq, 1)

    def _spans(self, ctx, pos):
        if self.keep is not None:
            real = ctx.on_device(self.keep)  # (B|1, Tq)
        else:
            lo, hi = self._interval(ctx, ctx.q_len)  # (B|1, 1) real query rows
            row = pos - ctx.q_start  # (1, Tq)
            real = (row >= lo) & (row < hi)  # (B|1, Tq)
        zero = torch.zeros_like(real, dtype=torch.long)
        return [(zero, real.long() * ctx.kv_len)]  # (B|1, Tq): every key, or none


class PrefixLM(Mask):
    """Bidirectional over each row's prefix, causal after it (T5/UL2 prefix LM).

    ``prefix_lengths``: (B,) ints, or one int for every row; each at most the number of keys."""

    def __init__(self, prefix_lengths, align: str = "bottom_right"):
        self.prefix_lengths = _lengths_tensor(prefix_lengths, "prefix_lengths", allow_int=True)
        self._max_length = _max_or_none(self.prefix_lengths)
        self.align = _check_align(align)

    def _device(self):
        return self.prefix_lengths.device

    def _batch_free(self):
        return len(self.prefix_lengths) == 1

    def _check(self, batch_size, q_len, kv_len):
        if len(self.prefix_lengths) not in (1, batch_size):
            raise UserError(f"prefix_lengths has {len(self.prefix_lengths)} rows, expected {batch_size}")
        if self._max_length is not None and self._max_length > kv_len:
            raise UserError(
                f"prefix_lengths {self.prefix_lengths.tolist()} exceed the sequence length {kv_len} (the keys)"
            )

    def _eval(self, ctx, b, h, q, kv):
        lengths = ctx.on_device(self.prefix_lengths)
        # (B|1, 1, 1, 1) dense; a scalar in a mask_mod
        prefix = lengths.view(-1, 1, 1, 1) if ctx.dense else lengths[_batch_index(b, lengths.shape[0])]
        return (kv <= q) | (kv < prefix)

    def _spans(self, ctx, pos):
        prefix = ctx.on_device(self.prefix_lengths).view(-1, 1)  # (B|1, 1)
        return [(torch.zeros_like(pos), torch.maximum(pos + 1, prefix))]  # (B|1, Tq)

    def __repr__(self):
        return f"PrefixLM(prefix_lengths={self.prefix_lengths.tolist()}, align={self.align!r})"


class Document(Mask):
    """Packed sequences: a query sees only keys of its own segment.

    ``segment_ids`` (B, Tk) names the segment of every key. A query's segment is, by default, the
    segment of the key at its own position (self-attention over one packed row). With
    ``query_segment_ids`` (B, Tq) the queries carry their own segments, so queries and keys may be
    different sequences: cross-attention from each packed target sentence to its own source only.
    """

    def __init__(self, segment_ids, query_segment_ids=None):
        self.segment_ids = self._ids(segment_ids, "segment_ids")
        q = query_segment_ids
        self.query_segment_ids = None if q is None else self._ids(q, "query_segment_ids")

    @staticmethod
    def _ids(ids, name: str) -> Tensor:
        seg = torch.as_tensor(ids)
        if seg.dim() != 2 or seg.dtype.is_floating_point or seg.dtype == torch.bool:
            raise UserError(f"{name} must be an integer tensor (B, T), got {seg.dtype} {tuple(seg.shape)}")
        return seg

    def _device(self):
        return self.segment_ids.device

    def _check(self, batch_size, q_len, kv_len):
        B, T = self.segment_ids.shape
        if B not in (1, batch_size) or kv_len != T:
            raise UserError(
                f"segment_ids has shape {(B, T)}, expected (B={batch_size}, Tk={kv_len}) covering every key"
            )
        if self.query_segment_ids is not None:
            Bq, Tq = self.query_segment_ids.shape
            if Bq not in (1, batch_size) or q_len != Tq:
                raise UserError(
                    f"query_segment_ids has shape {(Bq, Tq)}, expected (B={batch_size}, Tq={q_len}) "
                    "covering every query"
                )

    def runs(self, batch_size: int) -> list[list[tuple[int, int]]] | None:
        """Each row's segments as ``[start, end)`` intervals of keys, in order, or None when some segment is
        not one contiguous run. Like :meth:`KeyPadding.spans`, for the CPU block plan: it reads the ids on
        the host."""
        out = []
        for row in self.segment_ids.expand(batch_size, -1).cpu():
            cuts = [0, *((row[1:] != row[:-1]).nonzero().flatten() + 1).tolist(), len(row)]
            names = row[cuts[:-1]].tolist() if len(row) else []
            if len(set(names)) != len(names):
                return None
            out.append(list(zip(cuts[:-1], cuts[1:])))
        return out

    def _batch_free(self):
        rows = [self.segment_ids] + ([] if self.query_segment_ids is None else [self.query_segment_ids])
        return all(t.shape[0] == 1 for t in rows)

    def _eval(self, ctx, b, h, q, kv):
        seg = ctx.on_device(self.segment_ids)  # (B|1, Tk)
        if self.query_segment_ids is not None:
            qseg = ctx.on_device(self.query_segment_ids)  # (B|1, Tq)
            row = q - ctx.q_start  # query row index
            if ctx.dense:
                seg_q = qseg[:, row.reshape(-1)].view(qseg.shape[0], 1, -1, 1)  # (B|1, 1, Tq, 1)
                return seg_q == seg.view(seg.shape[0], 1, 1, -1)  # (B|1|B, 1, Tq, Tk)
            last_q, last_key = qseg.shape[1] - 1, seg.shape[1] - 1
            return (
                qseg[_batch_index(b, qseg.shape[0]), row.clamp(0, last_q)]
                == seg[_batch_index(b, seg.shape[0]), kv.clamp(0, last_key)]
            )
        # A query's segment is the segment of the key at its position, so every query must sit on a key.
        first, last = ctx.q_start, ctx.q_start + (ctx.q_len or 0) - 1
        if ctx.q_len and (first < 0 or last >= ctx.kv_len):
            raise UserError(
                f"document mask: queries sit at positions {first}..{last} but segment_ids cover keys "
                f"0..{ctx.kv_len - 1}; expected every query position to be a key position (Tq <= Tk, and "
                "with align='top_left' q_offset + Tq <= Tk), or query_segment_ids"
            )
        if ctx.dense:  # q and kv are aranges of positions, all on keys (checked above)
            seg_q = seg[:, q.reshape(-1)].view(seg.shape[0], 1, -1, 1)  # (B|1, 1, Tq, 1)
            return seg_q == seg.view(seg.shape[0], 1, 1, -1)  # (B|1, 1, Tq, Tk)
        row, last_key = _batch_index(b, seg.shape[0]), seg.shape[1] - 1
        return seg[row, q.clamp(0, last_key)] == seg[row, kv.clamp(0, last_key)]

    def _spans(self, ctx, pos):
        """From the first to past the last key of the query's segment (exact for contiguous segments)."""
        seg = ctx.on_device(self.segment_ids)  # (Bk, Tk), Bk in (1, B)
        Bk, Tk = seg.shape
        if self.query_segment_ids is None:
            qseg = seg[:, pos.view(-1).clamp(0, max(Tk - 1, 0))] if Tk else seg[:, :0]  # (Bk, Tq)
        else:
            qseg = ctx.on_device(self.query_segment_ids)  # (Bq, Tq)
        R = max(Bk, qseg.shape[0])
        seg, qseg = seg.expand(R, -1), qseg.expand(R, qseg.shape[1])  # (R, Tk), (R, Tq)
        ids, inv = torch.unique(torch.cat([seg, qseg], dim=1), return_inverse=True)  # inv (R, Tk + Tq)
        U = max(len(ids), 1)
        group = inv + U * torch.arange(R, device=inv.device).view(-1, 1)  # (R, Tk + Tq): (row, segment)
        key_group = group[:, :Tk].reshape(-1)  # (R * Tk,)
        key_pos = torch.arange(Tk, device=seg.device).repeat(R)  # (R * Tk,)
        first = torch.full((R * U,), Tk, dtype=torch.long, device=seg.device)
        first = first.scatter_reduce(0, key_group, key_pos, "amin")  # (R * U,) first key of each segment
        last = torch.full((R * U,), -1, dtype=torch.long, device=seg.device)
        last = last.scatter_reduce(0, key_group, key_pos, "amax")  # (R * U,) its last key
        q_group = group[:, Tk:]  # (R, Tq)
        return [(first[q_group], last[q_group] + 1)]  # (R, Tq)

    def __repr__(self):
        q = "" if self.query_segment_ids is None else f", query_segment_ids shape={tuple(self.query_segment_ids.shape)}"
        return f"Document(segment_ids shape={tuple(self.segment_ids.shape)}{q})"


class Predicate(Mask):
    """A user predicate ``fn(b, h, q_idx, kv_idx) -> bool tensor`` over broadcast index tensors."""

    def __init__(self, fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], align: str | None = None):
        if not callable(fn):
            raise UserTypeError(
                f"from_predicate needs a callable (b, h, q_idx, kv_idx) -> bool, got {type(fn).__name__}"
            )
        self.fn = fn
        self.align = None if align is None else _check_align(align)

    def _eval(self, ctx, b, h, q, kv):
        out = self.fn(b, h, q, kv)
        if not isinstance(out, Tensor) or out.dtype != torch.bool:
            got = out.dtype if isinstance(out, Tensor) else type(out).__name__
            raise UserTypeError(f"mask predicate must return a bool tensor, got {got}")
        return out

    def __repr__(self):
        return f"Predicate({getattr(self.fn, '__name__', 'fn')})"


# ---------------------------------------------------------------------------------------------
# Public constructors (the names users and tests rely on)
# ---------------------------------------------------------------------------------------------
def causal(align: str = "bottom_right") -> Causal:
    """Look-ahead mask ``M[i, j] = 0 if j <= i else -inf`` (seeds 000-004)."""
    return Causal(align)


def padding(*, lengths=None, keep=None, token_ids=None, pad_id: int | None = None, side: str = "right") -> KeyPadding:
    """Key-padding mask from exactly one of:

    - ``lengths`` (B,) real-token counts, padding on ``side`` ("right" or "left");
    - ``keep`` (B, Tk) bool, True = real token;
    - ``token_ids`` (B, Tk) with ``pad_id``.
    """
    if token_ids is not None:
        if lengths is not None or keep is not None:
            extra = " and ".join(n for n, v in (("lengths=", lengths), ("keep=", keep)) if v is not None)
            raise UserError(f"padding needs exactly one of lengths=, keep=, token_ids=; got token_ids= and {extra}")
        if pad_id is None:
            raise UserError("padding(token_ids=...) needs pad_id=<the id of <PAD>>")
        ids = torch.as_tensor(token_ids)
        if ids.dim() != 2:
            raise UserError(f"token_ids must have shape (B, T), got {tuple(ids.shape)}")
        keep = ids != pad_id
    return KeyPadding(lengths=lengths, keep=keep, side=side)


def query_padding(
    *, lengths=None, keep=None, token_ids=None, pad_id: int | None = None, side: str = "right"
) -> QueryPadding:
    """Query-padding mask: rows of pad queries attend to nothing (zero output). Same inputs as padding."""
    kp = padding(lengths=lengths, keep=keep, token_ids=token_ids, pad_id=pad_id, side=side)
    return QueryPadding(lengths=kp.lengths, keep=kp.keep, side=side)


def sliding_window(size: int, align: str = "bottom_right") -> SlidingWindow:
    return SlidingWindow(size, align)


def prefix_lm(prefix_lengths, align: str = "bottom_right") -> PrefixLM:
    """Bidirectional over the first ``prefix_lengths[b]`` keys of row b, causal after them.
    ``prefix_lengths``: (B,) ints or one int for every row; longer than the keys is an error."""
    return PrefixLM(prefix_lengths, align)


def document(segment_ids, query_segment_ids=None) -> Document:
    return Document(segment_ids, query_segment_ids)


def from_predicate(fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], align: str | None = None) -> Predicate:
    return Predicate(fn, align)
