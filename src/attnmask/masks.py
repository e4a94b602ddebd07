"""Attention masks: one convention, structured, composable.

The one polarity
----------------
A mask is **boolean and True means "may attend"**, broadcastable to ``(B, H|1, Tq, Tk)``
(the convention of PyTorch SDPA, FlexAttention and Hugging Face ``masking_utils``). The additive
form used by the seeds' formula ``softmax(QKᵀ/√d + M) V`` is derived from it: ``0`` where True,
``-inf`` where False. Foreign conventions enter and leave only through the named converters at the
bottom of this module.

Positions and causal alignment
------------------------------
Masks are predicates ``(b, h, q_idx, kv_idx) -> bool`` over absolute positions. Key column ``j``
is position ``j``. Query row ``i`` is position ``start + i``, where ``start`` depends on the
mask's alignment:

- ``bottom_right`` (the default): ``start = Tk - Tq``, the queries are the *last* ``Tq`` keys, as
  with a KV cache that returns the filled prefix (FlashAttention >= 2.1). ``q_offset`` must be 0:
  the alignment already says where the queries are.
- ``top_left`` (PyTorch's ``is_causal``): ``start = q_offset``, the absolute position of query
  row 0 -- e.g. the write position of a preallocated cache whose unfilled slots are also keys.

With ``Tq == Tk`` and ``q_offset == 0`` the two agree. Masks without an opinion (padding, document,
predicates without ``align``, tensors) take the alignment of what they are combined with; alone,
they are ``bottom_right`` when ``q_offset == 0`` and ``top_left`` (``start = q_offset``) otherwise.
Padding is indexed by row and column, never by position, so it is the same under any alignment.

Structured masks keep what they are (``Causal``, ``KeyPadding`` with lengths, ``SlidingWindow``,
``Document``), so attention can pick a kernel without building a ``Tq x Tk`` tensor. Predicates
become tensors in one place, :func:`_materialize`, by broadcasting index ranges.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "Mask",
    "Causal",
    "KeyPadding",
    "QueryPadding",
    "SlidingWindow",
    "PrefixLM",
    "Document",
    "Predicate",
    "TensorMask",
    "And",
    "Or",
    "Not",
    "causal",
    "padding",
    "query_padding",
    "sliding_window",
    "prefix_lm",
    "document",
    "from_predicate",
    "from_tensor",
    "from_additive",
    "additive_to_bool",
    "to_mha",
    "from_mha",
    "from_hf",
    "to_hf",
    "from_tf",
    "from_tf_padding",
    "to_tf",
    "check_additive",
    "lint_polarity",
    "query_start",
    "BLOCK_THRESHOLD",
]

ALIGNMENTS = ("bottom_right", "top_left")

# Foreign additive masks use -inf, finfo.min, -1e9 or -1e4 for "blocked": anything at or below this
# counts as blocked when converting them (see from_additive).
BLOCK_THRESHOLD = -1e4


@dataclass(frozen=True)
class _Ctx:
    """What a predicate may need beyond the index tensors."""

    batch_size: int
    q_len: int
    kv_len: int
    q_start: int  # absolute position of query row 0
    device: torch.device


class Mask:
    """Base class: a boolean predicate over (batch, head, query position, key position).

    Subclasses implement ``_eval(ctx, b, h, q, kv)`` returning a bool tensor broadcastable to
    ``(B, 1, Tq, Tk)``. ``align`` is ``"bottom_right"``, ``"top_left"`` or ``None`` (no opinion).
    """

    align: str | None = None

    # -- algebra -------------------------------------------------------------------------------
    def __and__(self, other: Mask) -> Mask:
        return And(_as_mask(self), _as_mask(other))

    def __rand__(self, other) -> Mask:
        return And(_as_mask(other), self)

    def __or__(self, other: Mask) -> Mask:
        return Or(_as_mask(self), _as_mask(other))

    def __ror__(self, other) -> Mask:
        return Or(_as_mask(other), self)

    def __invert__(self) -> Mask:
        return Not(self)

    def parts(self) -> list[Mask]:
        """The conjunction's factors, flattened (``[self]`` for anything but ``And``)."""
        return [self]

    # -- evaluation ----------------------------------------------------------------------------
    def _eval(self, ctx: _Ctx, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        raise NotImplementedError

    def _device(self) -> torch.device | None:
        return None

    def _check(self, batch_size: int, q_len: int, kv_len: int) -> None:
        """Raise ValueError when the mask cannot describe a (batch_size, q_len, kv_len) problem."""

    def validate(
        self, batch_size: int, q_len: int, kv_len: int, q_offset: int = 0, *, device: torch.device | str | None = None
    ) -> int:
        """Run the linter for a ``(B, Tq, Tk)`` problem on ``device`` without materializing anything.

        Returns the absolute position of query row 0 (see "Positions and causal alignment").
        Raises ValueError/TypeError naming what is wrong.
        """
        for name, val in (("batch_size", batch_size), ("q_len", q_len), ("kv_len", kv_len)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise ValueError(f"{name} must be a non-negative int, got {val!r}")
        if not isinstance(q_offset, int) or isinstance(q_offset, bool) or q_offset < 0:
            raise ValueError(f"q_offset must be a non-negative int, got {q_offset!r}")
        for p in _walk(self):
            p._check(batch_size, q_len, kv_len)
            # A literal (Tq, Tk) tensor is moved by nobody behind the user's back: a silent copy per
            # layer is a performance trap, and across devices usually a mistake. Small index tensors
            # (lengths, keep, segment ids) are moved, as Hugging Face does.
            if isinstance(p, TensorMask) and device is not None and p.tensor.device != torch.device(device):
                raise ValueError(
                    f"mask tensor is on {p.tensor.device} but is needed on {torch.device(device)} (the queries' "
                    "device); move it with .to() before wrapping it"
                )
        return query_start(self, q_len, kv_len, q_offset)

    def to_bool(
        self,
        batch_size: int,
        q_len: int,
        kv_len: int,
        q_offset: int = 0,
        *,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """Materialize as a bool tensor of shape ``(B, 1, Tq, Tk)``, True = may attend.

        The result may be a broadcast (expanded) view: copy it before writing into it.
        """
        return _materialize(self, batch_size, q_len, kv_len, q_offset, device)

    def to_additive(
        self,
        batch_size: int,
        q_len: int,
        kv_len: int,
        dtype: torch.dtype = torch.float32,
        q_offset: int = 0,
        *,
        finite: bool = False,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """Materialize as an additive mask ``(B, 1, Tq, Tk)``: 0 where allowed, -inf where blocked.

        ``finite=True`` uses ``torch.finfo(dtype).min`` instead of ``-inf`` (what Hugging Face
        models expect); never a magic ``-1e9``, which overflows float16.
        """
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"to_additive needs a floating dtype (e.g. torch.float32), got {dtype}")
        allowed = self.to_bool(batch_size, q_len, kv_len, q_offset, device=device)
        blocked = torch.finfo(dtype).min if finite else float("-inf")
        out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return out.masked_fill_(~allowed, blocked)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _as_mask(m) -> Mask:
    if isinstance(m, Mask):
        return m
    if isinstance(m, Tensor):
        return from_tensor(m)
    raise TypeError(f"cannot combine a mask with {type(m).__name__}; expected an attnmask Mask or bool tensor")


def query_start(mask: Mask, q_len: int, kv_len: int, q_offset: int = 0) -> int:
    """Absolute position of query row 0 for ``mask`` in a ``(Tq, Tk)`` problem.

    ``Tk - Tq`` for bottom-right alignment, ``q_offset`` for top-left (see the module docstring).
    Raises ValueError when the mask mixes alignments, or combines bottom-right with ``q_offset``.
    """
    aligns = {p.align for p in _walk(mask) if p.align is not None}
    if len(aligns) > 1:
        raise ValueError(
            "mask combines bottom_right and top_left causal alignments; pick one "
            "(bottom_right: queries are the last Tq keys; top_left: query i is position q_offset + i)"
        )
    align = aligns.pop() if aligns else ("top_left" if q_offset else "bottom_right")
    if align == "top_left":
        return q_offset
    if q_offset:
        raise ValueError(
            f"q_offset={q_offset} with a bottom_right aligned mask: bottom_right already places the "
            f"Tq={q_len} queries at the last Tq of the Tk={kv_len} keys, expected q_offset=0; for queries "
            "at absolute positions q_offset.. (e.g. a preallocated cache) build the mask with align='top_left'"
        )
    return kv_len - q_len


def _walk(mask: Mask):
    yield mask
    for child in getattr(mask, "children", ()):
        yield from _walk(child)


def _materialize(mask: Mask, batch_size: int, q_len: int, kv_len: int, q_offset: int = 0, device=None) -> Tensor:
    """The one place where predicates become tensors: broadcast index ranges, never loop."""
    if device is None:
        device = next((d for d in (p._device() for p in _walk(mask)) if d is not None), torch.device("cpu"))
    device = torch.device(device)
    q_start = mask.validate(batch_size, q_len, kv_len, q_offset, device=device)
    ctx = _Ctx(batch_size, q_len, kv_len, q_start, device)
    b = torch.arange(batch_size, device=device).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)  # (1, 1, 1, 1)
    q = (q_start + torch.arange(q_len, device=device)).view(1, 1, -1, 1)  # (1, 1, Tq, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, -1)  # (1, 1, 1, Tk)
    out = mask._eval(ctx, b, h, q, kv)
    if not isinstance(out, Tensor) or out.dtype != torch.bool:
        got = out.dtype if isinstance(out, Tensor) else type(out).__name__
        raise TypeError(f"mask predicate must return a bool tensor, got {got}")
    if out.dim() > 4:
        raise ValueError(
            f"mask predicate returned shape {tuple(out.shape)}, expected broadcastable to "
            f"(B={batch_size}, 1, Tq={q_len}, Tk={kv_len})"
        )
    try:
        return out.to(device).expand(batch_size, 1, q_len, kv_len)  # (B, 1, Tq, Tk)
    except RuntimeError as e:
        raise ValueError(
            f"mask predicate returned shape {tuple(out.shape)}, expected broadcastable to "
            f"(B={batch_size}, 1, Tq={q_len}, Tk={kv_len})"
        ) from e


# ---------------------------------------------------------------------------------------------
# Combinators
# ---------------------------------------------------------------------------------------------
class And(Mask):
    def __init__(self, *children: Mask):
        self.children = tuple(children)

    def parts(self) -> list[Mask]:
        return [p for c in self.children for p in c.parts()]

    def _eval(self, ctx, b, h, q, kv):
        out = self.children[0]._eval(ctx, b, h, q, kv)
        for c in self.children[1:]:
            out = out & c._eval(ctx, b, h, q, kv)
        return out

    def __repr__(self):
        return " & ".join(f"({c!r})" for c in self.children)


class Or(Mask):
    def __init__(self, *children: Mask):
        self.children = tuple(children)

    def _eval(self, ctx, b, h, q, kv):
        out = self.children[0]._eval(ctx, b, h, q, kv)
        for c in self.children[1:]:
            out = out | c._eval(ctx, b, h, q, kv)
        return out

    def __repr__(self):
        return " | ".join(f"({c!r})" for c in self.children)


class Not(Mask):
    def __init__(self, child: Mask):
        self.children = (child,)

    def _eval(self, ctx, b, h, q, kv):
        return ~self.children[0]._eval(ctx, b, h, q, kv)

    def __repr__(self):
        return f"~({self.children[0]!r})"


# ---------------------------------------------------------------------------------------------
# Structured masks
# ---------------------------------------------------------------------------------------------
def _check_align(align: str) -> str:
    if align not in ALIGNMENTS:
        raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")
    return align


class Causal(Mask):
    """Look-ahead mask: query at position p sees keys ``j <= p`` (seed 000, eq. 1)."""

    def __init__(self, align: str = "bottom_right"):
        self.align = _check_align(align)

    def _eval(self, ctx, b, h, q, kv):
        return kv <= q

    def __repr__(self):
        return f"Causal(align={self.align!r})"


class SlidingWindow(Mask):
    """Causal local attention: query at position p sees keys ``p - size < j <= p``."""

    def __init__(self, size: int, align: str = "bottom_right"):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"sliding window size must be an int >= 1, got {size!r}")
        self.size = size
        self.align = _check_align(align)

    def _eval(self, ctx, b, h, q, kv):
        return (kv <= q) & (kv > q - self.size)

    def __repr__(self):
        return f"SlidingWindow(size={self.size}, align={self.align!r})"


def _lengths_tensor(lengths, name: str) -> Tensor:
    t = torch.as_tensor(lengths)
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise TypeError(f"{name} must be integers, got dtype {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must have shape (B,), got {tuple(t.shape)}")
    if (t < 0).any():
        raise ValueError(f"{name} must be >= 0, got {t.tolist()}")
    return t.long()


class _Padding(Mask):
    """Shared machinery of key and query padding: which positions along one axis are real."""

    axis_name = "key"

    def __init__(self, *, lengths=None, keep=None, side: str = "right"):
        if (lengths is None) == (keep is None):
            got = "both lengths= and keep=" if lengths is not None else "neither"
            raise ValueError(
                f"padding needs exactly one of lengths=(B,) ints, keep=(B, T) bool, or token_ids=; got {got}"
            )
        if side not in ("right", "left"):
            raise ValueError(f"padding side must be 'right' or 'left', got {side!r}")
        self.side = side
        self.lengths = _lengths_tensor(lengths, "lengths") if lengths is not None else None
        if keep is not None:
            keep = torch.as_tensor(keep)
            if keep.dtype != torch.bool:
                raise TypeError(
                    f"keep must be a bool tensor (True = real token), got dtype {keep.dtype}; "
                    "for Hugging Face 0/1 attention masks use masks.from_hf"
                )
            if keep.dim() != 2:
                raise ValueError(f"keep must have shape (B, T), got {tuple(keep.shape)}")
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
            raise ValueError(f"{self.axis_name} padding has batch size {self.batch_size}, expected {batch_size}")
        if self.lengths is not None:
            too_long = self.lengths > n
            if too_long.any():
                raise ValueError(
                    f"{self.axis_name} padding lengths {self.lengths.tolist()} exceed the sequence length {n}"
                )
        elif self.keep.shape[1] != n:
            raise ValueError(
                f"{self.axis_name} padding keep has shape {tuple(self.keep.shape)}, expected (B={batch_size}, T={n})"
            )

    def spans(self, batch_size: int, n: int) -> tuple[list[int], list[int]] | None:
        """Each row's real tokens as one interval ``[lo, hi)`` along the padded axis of length ``n``.

        Returns ``(lo, hi)`` lists of ``batch_size`` ints, or None when some row's real tokens are
        not contiguous (a ``keep`` with holes). Attention uses this to slice instead of masking.
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

    def _real(self, ctx: _Ctx, pos: Tensor, n: int, start: int) -> Tensor:
        """Whether absolute positions ``pos`` (any shape, last dims broadcast) are real tokens."""
        local = pos - start  # index along the padded axis
        if self.keep is not None:
            keep = self.keep.to(ctx.device)
            # pos is (1, 1, T, 1) or (1, 1, 1, T); gather along T for every batch row
            idx = local.reshape(-1).clamp(0, n - 1)
            vals = keep[:, idx]  # (B, T)
            return vals.view(vals.shape[0], 1, *[s for s in pos.shape[2:]])
        lengths = self.lengths.to(ctx.device).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
        if self.side == "right":
            return local < lengths
        return local >= n - lengths

    def __repr__(self):
        what = f"lengths={self.lengths.tolist()}" if self.lengths is not None else "keep=..."
        return f"{type(self).__name__}({what}, side={self.side!r})"


class KeyPadding(_Padding):
    """Blocks ``<PAD>`` keys (seed 004's padding mask); cross-attention uses it over encoder keys."""

    def _eval(self, ctx, b, h, q, kv):
        return self._real(ctx, kv, ctx.kv_len, 0)


class QueryPadding(_Padding):
    """Blocks whole query rows that are padding; their attention output is zero."""

    axis_name = "query"

    def _axis_len(self, q_len, kv_len):
        return q_len

    def _eval(self, ctx, b, h, q, kv):
        return self._real(ctx, q, ctx.q_len, ctx.q_start)


class PrefixLM(Mask):
    """Bidirectional over each row's prefix, causal after it (T5/UL2 prefix LM)."""

    def __init__(self, prefix_lengths, align: str = "bottom_right"):
        self.prefix_lengths = _lengths_tensor(prefix_lengths, "prefix_lengths")
        self.align = _check_align(align)

    def _device(self):
        return self.prefix_lengths.device

    def _check(self, batch_size, q_len, kv_len):
        if len(self.prefix_lengths) not in (1, batch_size):
            raise ValueError(f"prefix_lengths has {len(self.prefix_lengths)} rows, expected {batch_size}")

    def _eval(self, ctx, b, h, q, kv):
        prefix = self.prefix_lengths.to(ctx.device).view(-1, 1, 1, 1)
        return (kv <= q) | (kv < prefix)

    def __repr__(self):
        return f"PrefixLM(prefix_lengths={self.prefix_lengths.tolist()}, align={self.align!r})"


class Document(Mask):
    """Packed sequences: a query sees only keys of its own segment. ``segment_ids`` is (B, Tk)."""

    def __init__(self, segment_ids):
        seg = torch.as_tensor(segment_ids)
        if seg.dim() != 2 or seg.dtype.is_floating_point or seg.dtype == torch.bool:
            raise ValueError(f"segment_ids must be an integer tensor (B, T), got {seg.dtype} {tuple(seg.shape)}")
        self.segment_ids = seg

    def _device(self):
        return self.segment_ids.device

    def _check(self, batch_size, q_len, kv_len):
        B, T = self.segment_ids.shape
        if B not in (1, batch_size) or kv_len != T:
            raise ValueError(
                f"segment_ids has shape {(B, T)}, expected (B={batch_size}, Tk={kv_len}) covering every key"
            )

    def _eval(self, ctx, b, h, q, kv):
        seg = self.segment_ids.to(ctx.device)
        # A query's segment is the segment of the key at its position, so every query must sit on a key.
        first, last = ctx.q_start, ctx.q_start + ctx.q_len - 1
        if ctx.q_len and (first < 0 or last >= ctx.kv_len):
            raise ValueError(
                f"document mask: queries sit at positions {first}..{last} but segment_ids cover keys "
                f"0..{ctx.kv_len - 1}; expected every query position to be a key position (Tq <= Tk, and "
                "with align='top_left' q_offset + Tq <= Tk)"
            )
        seg_q = seg[:, q.reshape(-1)].view(seg.shape[0], 1, -1, 1)  # (B, 1, Tq, 1)
        seg_k = seg.view(seg.shape[0], 1, 1, -1)  # (B, 1, 1, Tk)
        return seg_q == seg_k

    def __repr__(self):
        return f"Document(segment_ids shape={tuple(self.segment_ids.shape)})"


class Predicate(Mask):
    """A user predicate ``fn(b, h, q_idx, kv_idx) -> bool tensor`` over broadcast index tensors."""

    def __init__(self, fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], align: str | None = None):
        if not callable(fn):
            raise TypeError(f"from_predicate needs a callable (b, h, q_idx, kv_idx) -> bool, got {type(fn).__name__}")
        self.fn = fn
        self.align = None if align is None else _check_align(align)

    def _eval(self, ctx, b, h, q, kv):
        out = self.fn(b, h, q, kv)
        if not isinstance(out, Tensor) or out.dtype != torch.bool:
            got = out.dtype if isinstance(out, Tensor) else type(out).__name__
            raise TypeError(f"mask predicate must return a bool tensor, got {got}")
        return out

    def __repr__(self):
        return f"Predicate({getattr(self.fn, '__name__', 'fn')})"


class TensorMask(Mask):
    """A literal bool tensor ``(Tq, Tk)`` or ``(B, 1, Tq, Tk)`` (any of B, Tq, Tk may be 1 to
    broadcast, e.g. a ``(B, 1, 1, Tk)`` padding mask); it ignores positions."""

    def __init__(self, t: Tensor):
        self.tensor = _lint_bool_tensor(t, "mask")

    def _device(self):
        return self.tensor.device

    def _check(self, batch_size, q_len, kv_len):
        t = self.tensor
        shape4 = t.shape if t.dim() == 4 else (1, 1, *t.shape)
        if any(got not in (1, want) for got, want in zip(shape4, (batch_size, 1, q_len, kv_len))):
            raise ValueError(
                f"mask has shape {tuple(t.shape)}, expected broadcastable to "
                f"(B={batch_size}, 1, Tq={q_len}, Tk={kv_len})"
            )

    def _eval(self, ctx, b, h, q, kv):
        t = self.tensor.to(ctx.device)
        return t if t.dim() == 4 else t.view(1, 1, *t.shape)

    def __repr__(self):
        return f"TensorMask(shape={tuple(self.tensor.shape)})"


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
            raise ValueError(f"padding needs exactly one of lengths=, keep=, token_ids=; got token_ids= and {extra}")
        if pad_id is None:
            raise ValueError("padding(token_ids=...) needs pad_id=<the id of <PAD>>")
        ids = torch.as_tensor(token_ids)
        if ids.dim() != 2:
            raise ValueError(f"token_ids must have shape (B, T), got {tuple(ids.shape)}")
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
    return PrefixLM(prefix_lengths, align)


def document(segment_ids) -> Document:
    return Document(segment_ids)


def from_predicate(fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], align: str | None = None) -> Predicate:
    return Predicate(fn, align)


def from_tensor(t: Tensor) -> TensorMask:
    """Wrap a bool tensor (True = may attend) of shape ``(Tq, Tk)`` or ``(B|1, 1, Tq, Tk)``.

    Raises TypeError for other dtypes (0/1 integers have unknown polarity: use :func:`from_hf` or
    :func:`from_tf`), ValueError for other shapes and for an inverted causal mask (see
    :func:`lint_polarity`).
    """
    mask = TensorMask(t)
    lint_polarity(mask.tensor, "mask")
    return mask


# ---------------------------------------------------------------------------------------------
# The linter: shape, dtype and polarity of raw tensors
# ---------------------------------------------------------------------------------------------
def _lint_bool_tensor(t, name: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or attnmask Mask, got {type(t).__name__}")
    if t.dtype != torch.bool:
        if t.dtype.is_floating_point:
            raise TypeError(
                f"{name} has dtype {t.dtype}; attnmask masks are bool (True = may attend). "
                "For an additive 0/-inf mask use masks.from_additive(t)"
            )
        vals = torch.unique(t)
        if len(vals) <= 2 and set(vals.tolist()) <= {0, 1}:
            raise TypeError(
                f"{name} is a 0/1 {t.dtype} tensor of unknown polarity; expected bool with True = may "
                "attend. Use masks.from_hf(t) if 1 = attend, masks.from_tf(t) if 1 = blocked"
            )
        raise TypeError(f"{name} has dtype {t.dtype}; expected bool (True = may attend)")
    if t.dim() == 3:
        raise ValueError(
            f"{name} has 3-D shape {tuple(t.shape)}: ambiguous. Expected 4-D (B, 1|H, Tq, Tk) or 2-D "
            f"(Tq, Tk); for a per-batch (B, Tq, Tk) mask use t.unsqueeze(1) -> "
            f"{(t.shape[0], 1, *t.shape[1:])}"
        )
    if t.dim() not in (2, 4):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected 4-D (B, 1|H, Tq, Tk) or 2-D (Tq, Tk)")
    if t.dim() == 4 and t.shape[1] != 1:
        raise ValueError(
            f"{name} has per-head shape {tuple(t.shape)}; attnmask Mask objects are shared across heads "
            "(B, 1, Tq, Tk). Pass per-head tensors straight to attention() instead"
        )
    return t


def lint_polarity(t: Tensor, name: str = "mask") -> None:
    """Raise on a bool mask that is exactly an *inverted* causal mask (True strictly above the
    diagonal, the last query seeing nothing): ``nn.MultiheadAttention``'s / TensorFlow's look-ahead
    mask (True = blocked) passed where attnmask expects True = may attend. Applied where users hand
    in raw bool tensors (:func:`from_tensor`, ``attention``), not to converters' outputs. Only
    square masks of 4 x 4 or more are judged, so that small hand-made masks are left alone."""
    n = t.shape[-1]
    if t.dim() < 2 or t.shape[-2] != n or n < 4:
        return
    future = torch.ones(n, n, dtype=torch.bool, device=t.device).triu(1)  # (T, T)
    if torch.equal(t, future.expand_as(t)):
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} is True exactly above the diagonal: an inverted causal "
            "mask (True = blocked, the nn.MultiheadAttention / TensorFlow convention)? attnmask masks are "
            "True = may attend: use masks.causal(), or masks.from_mha(t) to convert"
        )


def check_additive(t: Tensor, dtype: torch.dtype | None = None, name: str = "additive mask") -> None:
    """Raise if an additive mask cannot be represented in ``dtype`` (e.g. -1e9 in float16)."""
    if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{name} must be a floating tensor of 0 / -inf, got {got}")
    dtype = dtype or t.dtype
    finite = t[torch.isfinite(t)]
    if finite.numel() and finite.min().item() < torch.finfo(dtype).min:
        raise ValueError(
            f"{name} holds {finite.min().item():g}, which overflows {dtype} (min {torch.finfo(dtype).min:g}); "
            f"use -inf or torch.finfo({dtype}).min instead of a magic number"
        )
    if torch.isnan(t).any():
        raise ValueError(f"{name} contains NaN")


def additive_to_bool(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The bool form (True = may attend) of an additive mask of 0 (attend) and -inf, finfo.min or
    anything <= ``BLOCK_THRESHOLD`` (blocked), any shape. ``dtype`` is the dtype the scores will
    have; a value that overflows it is an error, and so is any other value (a soft bias, 0/1)."""
    check_additive(t, dtype)
    odd = (t != 0) & (t > BLOCK_THRESHOLD)
    if odd.any():
        if bool(((t == 0) | (t == 1)).all()):
            raise ValueError(
                "additive mask holds only 0 and 1: a 0/1 mask of unknown polarity, not an additive one "
                "(expected 0 = attend, -inf / finfo.min = blocked). Use masks.from_hf(t) if 1 = attend, "
                "masks.from_tf(t) if 1 = blocked"
            )
        raise ValueError(
            f"additive mask holds {t[odd][0].item():g}: expected only 0 (attend) and -inf / finfo.min "
            "(blocked); a soft bias is not a mask"
        )
    return t == 0


def from_additive(t: Tensor, dtype: torch.dtype | None = None) -> TensorMask:
    """From an additive mask ``(Tq, Tk)`` or ``(B, 1, Tq, Tk)`` (0 = attend; -inf, finfo.min or
    <= -1e4 = blocked). ``dtype`` is the dtype the scores will have; a value that overflows it is an
    error (e.g. -1e9 for float16)."""
    return TensorMask(additive_to_bool(t, dtype))


def to_mha(mask: Mask, batch_size: int, q_len: int, kv_len: int, num_heads: int) -> Tensor:
    """For ``nn.MultiheadAttention(attn_mask=...)``: bool ``(B*num_heads, Tq, Tk)``, True = *ignore*."""
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")
    allowed = mask.to_bool(batch_size, q_len, kv_len)  # (B, 1, Tq, Tk)
    blocked = (~allowed).expand(batch_size, num_heads, q_len, kv_len)  # (B, H, Tq, Tk)
    return blocked.reshape(batch_size * num_heads, q_len, kv_len)  # (B*H, Tq, Tk)


def from_mha(
    attn_mask: Tensor | None = None, key_padding_mask: Tensor | None = None, *, num_heads: int | None = None
) -> Mask:
    """From ``nn.MultiheadAttention`` conventions (bool, True = ignore; or float additive).

    ``attn_mask`` is ``(Tq, Tk)``, or ``(B*num_heads, Tq, Tk)`` with ``num_heads`` given and the
    same mask in every head (an attnmask Mask is shared across heads); ``key_padding_mask`` is
    ``(B, Tk)``.
    """
    parts: list[Mask] = []
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor) or not (
            attn_mask.dtype == torch.bool or attn_mask.dtype.is_floating_point
        ):
            got = attn_mask.dtype if isinstance(attn_mask, Tensor) else type(attn_mask).__name__
            raise TypeError(
                f"nn.MultiheadAttention attn_mask must be bool (True = ignore) or float additive, got {got}"
            )
        allowed = ~attn_mask if attn_mask.dtype == torch.bool else None
        if attn_mask.dim() == 3:
            if num_heads is None:
                raise ValueError(
                    f"attn_mask has 3-D shape {tuple(attn_mask.shape)}; nn.MultiheadAttention's 3-D masks are "
                    "(B*num_heads, Tq, Tk): pass num_heads= to split them"
                )
            N, Tq, Tk = attn_mask.shape
            if N % num_heads:
                raise ValueError(f"attn_mask has {N} rows, expected a multiple of num_heads={num_heads} (B*num_heads)")
            per_head = attn_mask.reshape(N // num_heads, num_heads, Tq, Tk)  # (B, H, Tq, Tk)
            if not torch.equal(per_head, per_head[:, :1].expand_as(per_head)):
                raise ValueError("attn_mask differs between heads; an attnmask Mask is the same in every head")
            attn_mask = per_head[:, :1]  # (B, 1, Tq, Tk)
            allowed = ~attn_mask if attn_mask.dtype == torch.bool else None
        elif attn_mask.dim() != 2:
            raise ValueError(
                f"attn_mask has shape {tuple(attn_mask.shape)}, expected (Tq, Tk) or (B*num_heads, Tq, Tk)"
            )
        parts.append(from_additive(attn_mask) if allowed is None else TensorMask(allowed))
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor):
            raise TypeError(f"key_padding_mask must be a tensor (B, Tk), got {type(key_padding_mask).__name__}")
        if key_padding_mask.dtype.is_floating_point:
            check_additive(key_padding_mask, name="key_padding_mask")
            keep = key_padding_mask == 0
        elif key_padding_mask.dtype == torch.bool:
            keep = ~key_padding_mask
        else:
            raise TypeError(f"key_padding_mask must be bool (True = ignore) or float, got {key_padding_mask.dtype}")
        parts.append(padding(keep=keep))
    if not parts:
        raise ValueError("from_mha needs attn_mask and/or key_padding_mask")
    return parts[0] if len(parts) == 1 else And(*parts)


def from_hf(attention_mask: Tensor) -> KeyPadding:
    """From a Hugging Face 2-D attention mask ``(B, T)`` of 0/1 (1 = real token, attend)."""
    t = torch.as_tensor(attention_mask)
    if t.dim() != 2:
        raise ValueError(f"Hugging Face attention_mask must be 2-D (B, T) of 0/1, got shape {tuple(t.shape)}")
    bad = (t != 0) & (t != 1)
    if bad.any():
        raise ValueError(f"Hugging Face attention_mask must hold only 0/1, got {t[bad][0].item()!r}")
    return padding(keep=t.bool())


def to_hf(mask: KeyPadding, batch_size: int, seq_len: int) -> Tensor:
    """To a Hugging Face 2-D attention mask ``(B, T)`` long, 1 = attend. Needs a key-padding mask."""
    if not isinstance(mask, KeyPadding):
        raise TypeError(f"to_hf converts key-padding masks only (Hugging Face 2-D masks cannot express {mask!r})")
    allowed = mask.to_bool(batch_size, 1, seq_len)  # (B, 1, 1, T)
    return allowed[:, 0, 0, :].long()


def from_tf(t: Tensor) -> TensorMask:
    """From a TensorFlow-style attention mask, 1 = blocked: ``(Tq, Tk)`` or ``(B, 1, Tq, Tk)``
    (``(B, 1, 1, Tk)`` for the TensorFlow tutorial's padding mask).

    For a ``(B, T)`` padding mask (1 = pad) use :func:`from_tf_padding`.
    """
    t = torch.as_tensor(t)
    bad = (t != 0) & (t != 1)
    if bad.any():
        raise ValueError(f"TensorFlow mask must hold only 0/1 (1 = blocked), got {t[bad][0].item()!r}")
    return TensorMask(t == 0)


def from_tf_padding(t: Tensor) -> KeyPadding:
    """From a TensorFlow-style padding mask ``(B, T)``, 1 = pad (blocked)."""
    t = torch.as_tensor(t)
    if t.dim() != 2:
        raise ValueError(f"TensorFlow padding mask must be (B, T), got {tuple(t.shape)}")
    return padding(keep=from_tf(t).tensor)


def to_tf(mask: Mask, batch_size: int, q_len: int, kv_len: int) -> Tensor:
    """To a TensorFlow-style float mask ``(B, 1, Tq, Tk)``: 1.0 = blocked, 0.0 = attend."""
    return (~mask.to_bool(batch_size, q_len, kv_len)).float()
