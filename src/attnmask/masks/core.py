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

from dataclasses import dataclass

import torch
from torch import Tensor

from attnmask.errors import UserError, UserTypeError
from attnmask.masks.lint import _lint_bool_tensor, lint_polarity

ALIGNMENTS = ("bottom_right", "top_left")


@dataclass(frozen=True)
class _Ctx:
    """What a predicate may need beyond the index tensors.

    ``dense``: the index tensors broadcast over the whole ``(B, 1, Tq, Tk)`` problem (materializing);
    False inside a ``mask_mod``, where FlexAttention calls the predicate on (vmapped) scalar indices.
    Lengths are None in a ``mask_mod`` built without them.
    """

    batch_size: int | None
    q_len: int | None
    kv_len: int | None
    q_start: int  # absolute position of query row 0
    device: torch.device | None
    dense: bool = True

    def on_device(self, t: Tensor) -> Tensor:
        return t if self.device is None else t.to(self.device)


def _batch_index(b: Tensor, rows: int) -> Tensor:
    """Index into a per-batch tensor of ``rows`` rows: ``b`` itself, or 0 for a broadcast row."""
    return b.clamp(0, rows - 1)


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
                raise UserError(f"{name} must be a non-negative int, got {val!r}")
        if not isinstance(q_offset, int) or isinstance(q_offset, bool) or q_offset < 0:
            raise UserError(f"q_offset must be a non-negative int, got {q_offset!r}")
        for p in _walk(self):
            p._check(batch_size, q_len, kv_len)
            # A literal (Tq, Tk) tensor is moved by nobody behind the user's back: a silent copy per
            # layer is a performance trap, and across devices usually a mistake. Small index tensors
            # (lengths, keep, segment ids) are moved, as Hugging Face does.
            if isinstance(p, TensorMask) and device is not None and p.tensor.device != torch.device(device):
                raise UserError(
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
            raise UserTypeError(f"to_additive needs a floating dtype (e.g. torch.float32), got {dtype}")
        allowed = self.to_bool(batch_size, q_len, kv_len, q_offset, device=device)
        blocked = torch.finfo(dtype).min if finite else float("-inf")
        out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return out.masked_fill_(~allowed, blocked)

    # -- per-query key spans (block-sparse kernels) ---------------------------------------------
    def key_spans(
        self, batch_size: int, q_len: int, kv_len: int, q_start: int, *, device: torch.device | str | None = None
    ) -> list[tuple[Tensor, Tensor]]:
        """Where each query row may attend, as a union of key intervals: a list of ``(lo, hi)`` long
        tensors broadcastable to ``(B, Tq)``, query row ``i`` of batch row ``b`` seeing keys only in
        the union of ``[lo[b, i], hi[b, i])``. A superset of the allowed keys (exact for causal,
        windows, padding, prefix LM and contiguous documents and their ``&``); ``|`` gives the list
        of both sides, and what the algebra cannot bound (``~``, tensors, predicates) gives every key.
        Bounds may fall outside ``[0, Tk]``; ``lo >= hi`` means no key. Nothing ``Tq x Tk`` is built.
        """
        device = None if device is None else torch.device(device)
        ctx = _Ctx(batch_size, q_len, kv_len, q_start, device, dense=False)
        pos = (q_start + torch.arange(q_len, device=device)).view(1, -1)  # (1, Tq) query positions
        return self._spans(ctx, pos)

    def _spans(self, ctx: _Ctx, pos: Tensor) -> list[tuple[Tensor, Tensor]]:
        zero = torch.zeros(1, 1, dtype=torch.long, device=pos.device)  # (1, 1)
        return [(zero, zero + ctx.kv_len)]  # every key

    def evaluate(
        self,
        batch_size: int,
        q_len: int,
        kv_len: int,
        q_start: int,
        q_pos: Tensor,
        kv_pos: Tensor,
        *,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """The mask at chosen positions: ``q_pos`` and ``kv_pos`` are long tensors of absolute query
        and key positions, broadcastable against each other and against ``(B, 1, 1, 1)`` batch rows
        (e.g. ``(1, n, bq, 1)`` and ``(1, n, 1, bk)`` for ``n`` tiles). Returns bool, True = may
        attend, of the broadcast shape with the batch leading (``B`` or 1). Element-wise, like a
        ``mask_mod``: a tile costs its own size, never ``Tq x Tk``."""
        device = None if device is None else torch.device(device)
        ctx = _Ctx(batch_size, q_len, kv_len, q_start, device, dense=False)
        b = torch.arange(batch_size, device=device).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
        h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)  # masks are the same in every head
        return self._eval(ctx, b, h, q_pos, kv_pos)

    # -- lowering to FlexAttention ------------------------------------------------------------
    def _batch_free(self) -> bool:
        """True when the mask is the same for every batch row (FlexAttention then broadcasts it)."""
        return False

    def mask_mod(
        self,
        q_len: int | None = None,
        kv_len: int | None = None,
        q_offset: int = 0,
        *,
        device: torch.device | str | None = None,
    ):
        """This mask as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

        ``q_idx`` is the query *row* (0..Tq-1) and ``kv_idx`` the key column, as FlexAttention passes
        them; the mask_mod places row ``q_idx`` at absolute position ``q_start + q_idx`` (see
        "Positions and causal alignment"). With ``q_len`` and ``kv_len`` given it is exact for that
        ``(Tq, Tk)`` problem; without them it assumes ``Tq == Tk`` (query row i at position
        ``q_offset + i``), and a left-padded ``lengths=`` mask, which needs the padded length, raises.
        ``device``: where the mask's index tensors (lengths, keep, segment ids) are moved once, i.e.
        the device of the attention call. Pure tensor code, no host reads: usable under ``vmap`` and
        ``torch.compile``, e.g. ``create_block_mask(mask.mask_mod(Tq, Tk), B, None, Tq, Tk, device=...)``
        (what :meth:`block_mask` does).
        """
        if (q_len is None) != (kv_len is None):
            raise UserError("mask_mod needs both q_len and kv_len, or neither (then Tq == Tk is assumed)")
        q_start = query_start(self, q_len or 0, kv_len or 0, q_offset)
        ctx = _Ctx(None, q_len, kv_len, q_start, None if device is None else torch.device(device), dense=False)
        root = self

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return root._eval(ctx, b, h, q_idx + q_start, kv_idx)

        mask_mod.__name__ = f"attnmask_{type(self).__name__.lower()}"
        return mask_mod

    def block_mask(
        self,
        batch_size: int,
        q_len: int,
        kv_len: int,
        *,
        device: torch.device | str | None = None,
        q_offset: int = 0,
        block_size: int | tuple[int, int] = 128,
    ):
        """A FlexAttention ``BlockMask`` for a ``(B, Tq, Tk)`` problem, shared by every head.

        Built by ``torch.nn.attention.flex_attention.create_block_mask`` on ``device`` (default: the
        device of the mask's own tensors, else the CPU -- never CUDA behind your back); compiled on
        CUDA, where building it eagerly would materialize ``B x Tq x Tk``. Build it once per batch
        shape and reuse it in every layer, as attnmask's ``flex`` backend does. Validates the mask
        for the problem first (shapes, alignment, devices), so errors name the mask, not a kernel.
        """
        if device is None:
            device = next((d for d in (p._device() for p in _walk(self)) if d is not None), torch.device("cpu"))
        device = torch.device(device)
        self.validate(batch_size, q_len, kv_len, q_offset, device=device)
        mod = self.mask_mod(q_len, kv_len, q_offset, device=device)
        B = None if self._batch_free() else batch_size
        return _create_block_mask(mod, B, q_len, kv_len, device, block_size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


_COMPILED_BUILDER = None
# Compiled variants of one function a process may hold before dynamo gives up on it: dynamo keeps one
# cache per function (create_block_mask, flex_attention) for every caller in the process, ours and the
# user's own torch.compile of it, and at its default limit of 8 falls back, with a warning only, to the
# eager function: create_block_mask then evaluates the mask over the whole B x Tq x Tk grid, flex_attention
# materialises Tq x Tk (measured on an H200: a benchmark's ninth variant ran 15-50x slower). attnmask's
# compiled calls run under this limit, raised only while the call runs (:func:`call_compiled`).
RECOMPILE_LIMIT = 64


def call_compiled(fn, *args, limit: int = RECOMPILE_LIMIT, **kwargs):
    """``fn(*args, **kwargs)`` (a ``torch.compile`` result) with dynamo's recompile limit at least
    ``limit`` while it runs; the process's own setting is back when it returns or raises. Inside a
    ``torch.compile`` trace ``fn`` is traced as it is (the caller's compilation has its own limit)."""
    if torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    config = torch._dynamo.config
    before = config.recompile_limit
    config.recompile_limit = max(before, limit)
    try:
        return fn(*args, **kwargs)
    finally:
        config.recompile_limit = before


def _create_block_mask(mod, B: int | None, q_len: int, kv_len: int, device: torch.device, block_size, heads=None):
    """``create_block_mask`` on ``device``: compiled on accelerators (eagerly it vmaps the mask_mod
    over the whole ``B x Tq x Tk`` grid), eager on the CPU, traced as is inside ``torch.compile``."""
    global _COMPILED_BUILDER
    from torch.nn.attention.flex_attention import create_block_mask

    H = None if heads in (None, 1) else heads
    if device.type != "cpu" and not torch.compiler.is_compiling():
        if _COMPILED_BUILDER is None:
            # automatic dynamic shapes: a second batch size or length compiles once more and then stays
            # dynamic (static, a training run whose packed batches had 16, 9, 16, 12 rows recompiled for
            # each new count, 5-10 s each on an H200)
            _COMPILED_BUILDER = torch.compile(create_block_mask, dynamic=None)
        return call_compiled(_COMPILED_BUILDER, mod, B, H, q_len, kv_len, device=device, BLOCK_SIZE=block_size)
    return create_block_mask(mod, B, H, q_len, kv_len, device=device, BLOCK_SIZE=block_size)


def _as_mask(m) -> Mask:
    if isinstance(m, Mask):
        return m
    if isinstance(m, Tensor):
        return from_tensor(m)
    raise UserTypeError(f"cannot combine a mask with {type(m).__name__}; expected an attnmask Mask or bool tensor")


def query_start(mask: Mask, q_len: int, kv_len: int, q_offset: int = 0) -> int:
    """Absolute position of query row 0 for ``mask`` in a ``(Tq, Tk)`` problem.

    ``Tk - Tq`` for bottom-right alignment, ``q_offset`` for top-left (see the module docstring).
    Raises ValueError when the mask mixes alignments, or combines bottom-right with ``q_offset``.
    """
    aligns = {p.align for p in _walk(mask) if p.align is not None}
    if len(aligns) > 1:
        raise UserError(
            "mask combines bottom_right and top_left causal alignments; pick one "
            "(bottom_right: queries are the last Tq keys; top_left: query i is position q_offset + i)"
        )
    align = aligns.pop() if aligns else ("top_left" if q_offset else "bottom_right")
    if align == "top_left":
        return q_offset
    if q_offset:
        raise UserError(
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
        raise UserTypeError(f"mask predicate must return a bool tensor, got {got}")
    if out.dim() > 4:
        raise UserError(
            f"mask predicate returned shape {tuple(out.shape)}, expected broadcastable to "
            f"(B={batch_size}, 1, Tq={q_len}, Tk={kv_len})"
        )
    try:
        return out.to(device).expand(batch_size, 1, q_len, kv_len)  # (B, 1, Tq, Tk)
    except RuntimeError as e:
        raise UserError(
            f"mask predicate returned shape {tuple(out.shape)}, expected broadcastable to "
            f"(B={batch_size}, 1, Tq={q_len}, Tk={kv_len})"
        ) from e


# ---------------------------------------------------------------------------------------------
# Combinators
# ---------------------------------------------------------------------------------------------
_MAX_SPANS = 8  # intervals per query kept by key_spans before they are bounded by one


def _hull(spans: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """One interval holding every non-empty interval of ``spans`` (empty ones are left out)."""
    big = torch.iinfo(torch.long).max
    lo = hi = None
    for a, z in spans:
        a, z = torch.broadcast_tensors(a, z)
        a, z = a.masked_fill(a >= z, big), z.masked_fill(a >= z, -big)
        lo = a if lo is None else torch.minimum(lo, a)
        hi = z if hi is None else torch.maximum(hi, z)
    return lo, hi


class And(Mask):
    def __init__(self, *children: Mask):
        self.children = tuple(children)

    def parts(self) -> list[Mask]:
        return [p for c in self.children for p in c.parts()]

    def _batch_free(self):
        return all(c._batch_free() for c in self.children)

    def _eval(self, ctx, b, h, q, kv):
        out = self.children[0]._eval(ctx, b, h, q, kv)
        for c in self.children[1:]:
            out = out & c._eval(ctx, b, h, q, kv)
        return out

    def _spans(self, ctx, pos):
        out = self.children[0]._spans(ctx, pos)
        for c in self.children[1:]:
            other = c._spans(ctx, pos)
            if len(out) * len(other) > _MAX_SPANS:  # bound each side by one interval first
                out, other = [_hull(out)], [_hull(other)]
            out = [(torch.maximum(a, c_), torch.minimum(z, d)) for a, z in out for c_, d in other]
        return out

    def __repr__(self):
        return " & ".join(f"({c!r})" for c in self.children)


class Or(Mask):
    def __init__(self, *children: Mask):
        self.children = tuple(children)

    def _batch_free(self):
        return all(c._batch_free() for c in self.children)

    def _eval(self, ctx, b, h, q, kv):
        out = self.children[0]._eval(ctx, b, h, q, kv)
        for c in self.children[1:]:
            out = out | c._eval(ctx, b, h, q, kv)
        return out

    def _spans(self, ctx, pos):
        out = [span for c in self.children for span in c._spans(ctx, pos)]
        return out if len(out) <= _MAX_SPANS else [_hull(out)]

    def __repr__(self):
        return " | ".join(f"({c!r})" for c in self.children)


class Not(Mask):
    def __init__(self, child: Mask):
        self.children = (child,)

    def _batch_free(self):
        return self.children[0]._batch_free()

    def _eval(self, ctx, b, h, q, kv):
        return ~self.children[0]._eval(ctx, b, h, q, kv)

    def __repr__(self):
        return f"~({self.children[0]!r})"


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
            raise UserError(
                f"mask has shape {tuple(t.shape)}, expected broadcastable to "
                f"(B={batch_size}, 1, Tq={q_len}, Tk={kv_len})"
            )

    def _batch_free(self):
        return self.tensor.dim() == 2 or self.tensor.shape[0] == 1

    def _eval(self, ctx, b, h, q, kv):
        t = ctx.on_device(self.tensor)
        t = t if t.dim() == 4 else t.view(1, 1, *t.shape)  # (B|1, 1, Tq|1, Tk|1)
        if ctx.dense:
            return t
        # a mask_mod: gather the element, broadcast dimensions (size 1) read index 0
        row = q - ctx.q_start
        return t[_batch_index(b, t.shape[0]), 0, row.clamp(0, t.shape[2] - 1), kv.clamp(0, t.shape[3] - 1)]

    def __repr__(self):
        return f"TensorMask(shape={tuple(self.tensor.shape)})"


def from_tensor(t: Tensor) -> TensorMask:
    """Wrap a bool tensor (True = may attend) of shape ``(Tq, Tk)`` or ``(B|1, 1, Tq, Tk)``.

    Raises TypeError for other dtypes (0/1 integers have unknown polarity: use :func:`from_hf` or
    :func:`from_tf`), ValueError for other shapes and for an inverted causal mask (see
    :func:`lint_polarity`).
    """
    mask = TensorMask(t)
    lint_polarity(mask.tensor, "mask")
    return mask
