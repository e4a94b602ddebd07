"""Masks as a kernel sees them.

:class:`PreparedMask` is built once per forward and shared by all layers;
:class:`SdpaCall` is one step of the SDPA call plan a structured mask decomposes into.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnmask import masks as M
from attnmask.errors import UserError, UserTypeError
from attnmask.masks.lint import _lint_bool_tensor, _lint_inverted


# ---------------------------------------------------------------------------------------------
# Masks as a kernel sees them
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SdpaCall:
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
_ADDITIVE_MAX = 256 * 256  # Tq * Tk up to which the CPU SDPA path gets an additive mask (see sdpa_mask)


def _host_readable(device: torch.device | None) -> bool:
    """Whether reading mask values back to Python is free: CPU tensors outside ``torch.compile``.
    Everywhere else (a GPU, a compiled graph) the prepared mask is built from device tensors only."""
    return (device is None or device.type == "cpu") and not torch.compiler.is_compiling()


class _State:
    """The forms of a prepared mask built so far. It holds tensors and plans only -- never the Mask
    -- so that a Mask may keep its last state (see :func:`prepare_mask`) without a reference cycle."""

    __slots__ = ("allowed", "empty", "blocks", "sdpa_masks", "choices")

    def __init__(self, allowed=_UNSET, empty=_UNSET, blocks=_UNSET):
        self.allowed, self.empty, self.blocks = allowed, empty, blocks
        self.sdpa_masks: dict[torch.dtype, Tensor | None] = {}
        self.choices: dict[tuple, object] = {}


class PreparedMask:
    """A mask resolved for one ``(B, H, Tq, Tk)`` problem: built once per forward, shared by layers.

    What kernels read (every form is built lazily, on first use, and then kept):

    - ``is_causal``: pure causal with ``Tq == Tk``, query row ``i`` at position ``i`` and nothing
      else masked -- exactly SDPA's ``is_causal=True`` (``allowed`` is then None);
    - ``allowed``: bool, broadcastable to ``(B, H, Tq, Tk)``, True = may attend; None when nothing
      is masked or ``is_causal``. For a structured mask it is materialized on first use only;
    - ``empty_rows``: bool ``(B|1, H|1, Tq, 1)``, query rows that may attend to nothing, or None.
      On the CPU it is None when no row is empty; elsewhere (GPU, ``torch.compile``) it is always the
      tensor, so that nothing is read back to the host;
    - ``blocks``: the mask as :class:`SdpaCall` calls needing no mask tensor, or None when the mask is
      not of that form (only causal, contiguous padding and packed documents are). Planned from values
      read on the host, so only for CPU tensors outside ``torch.compile`` (None elsewhere);
    - :meth:`sdpa_mask`: the ``attn_mask`` the SDPA backends pass;
    - :meth:`block_mask`: FlexAttention's ``BlockMask`` of the mask on a device;
    - ``choices``: decisions a backend made for this mask (e.g. ``auto``'s block plan or not).
    """

    def __init__(
        self,
        allowed: Tensor | None = None,
        is_causal: bool = False,
        empty_rows: Tensor | None = _UNSET,  # type: ignore[assignment]
        q_len: int = 0,
        kv_len: int = 0,
        *,
        blocks: tuple[SdpaCall, ...] | None = _UNSET,  # type: ignore[assignment]
        build: Callable[[], Tensor] | None = None,
        mask: M.Mask | None = None,
        batch_size: int | None = None,
        q_offset: int = 0,
        device: torch.device | str | None = None,
        state: _State | None = None,
    ):
        if is_causal and (allowed is not None or build is not None):
            raise UserError("PreparedMask: is_causal=True takes no allowed tensor (the causal mask is implied)")
        self.is_causal, self.q_len, self.kv_len = is_causal, q_len, kv_len
        self.mask, self.batch_size, self.q_offset = mask, batch_size, q_offset
        self.device = None if device is None else torch.device(device)
        if state is None:
            state = _State(_UNSET if build is not None else allowed, empty_rows, blocks)
        self._state, self._build = state, build
        self._block_masks: dict[torch.device, object] = {}  # not in the state: a BlockMask refers to the Mask

    @property
    def choices(self) -> dict[tuple, object]:
        return self._state.choices

    @property
    def allowed(self) -> Tensor | None:
        st = self._state
        if st.allowed is _UNSET:
            st.allowed = self._build() if self._build is not None else None
        return st.allowed

    @property
    def blocks(self) -> tuple[SdpaCall, ...] | None:
        st = self._state
        if st.blocks is _UNSET:
            st.blocks = None
            if self.mask is not None and self.batch_size is not None and _host_readable(self.device):
                q_start = M.query_start(self.mask, self.q_len, self.kv_len, self.q_offset)
                st.blocks = _plan_blocks(self.mask.parts(), self.batch_size, self.q_len, self.kv_len, q_start)
        return st.blocks

    @property
    def empty_rows(self) -> Tensor | None:
        st = self._state
        if st.empty is _UNSET:
            st.empty = None
            if self.is_causal:
                return None
            readable = _host_readable(self.device)
            if readable and self.blocks is not None and self.batch_size is not None:
                # with a block plan, a query row is empty exactly when no block covers it: no need
                # to scan the (B, Tq, Tk) tensor when every row is covered
                rows = sum(len(b.rows) * (b.q1 - b.q0) for b in self.blocks)
                if rows == self.batch_size * self.q_len:
                    return None
            allowed = self.allowed
            if allowed is not None:
                empty = ~allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, Tq|1, 1)
                readable = readable and empty.device.type == "cpu"
                st.empty = None if readable and not bool(empty.any()) else empty
        return st.empty

    def sdpa_mask(self, dtype: torch.dtype) -> Tensor | None:
        """The ``attn_mask`` for SDPA: ``allowed`` with empty rows opened (SDPA would give NaN there;
        the backend zeroes them after). On the CPU, for short sequences, an additive mask in the
        scores' dtype, built once and shared by every layer: SDPA turns a bool mask into one on every
        call, which costs ~2-3% of the call at T <= 256 (measured, benchmarks/attention.py)."""
        cache = self._state.sdpa_masks
        if dtype in cache:
            return cache[dtype]
        attn_mask, empty = self.allowed, self.empty_rows
        if attn_mask is not None and empty is not None:
            attn_mask = attn_mask | empty
        if (
            attn_mask is not None
            and attn_mask.device.type == "cpu"
            and self.q_len * self.kv_len <= _ADDITIVE_MAX
            and not torch.compiler.is_compiling()
        ):
            attn_mask = torch.zeros(attn_mask.shape, dtype=dtype).masked_fill_(~attn_mask, float("-inf"))
        cache[dtype] = attn_mask
        return attn_mask

    def block_mask(self, device: torch.device | str):
        """FlexAttention's ``BlockMask`` for this problem on ``device`` (None when nothing is masked),
        built on first use and shared by every layer: from the structured mask's ``mask_mod`` when
        there is one, else from the ``allowed`` tensor (which may differ per head)."""
        device = torch.device(device)
        if device in self._block_masks:
            return self._block_masks[device]
        B = self.batch_size
        if self.is_causal:
            bm = M.causal().block_mask(B or 1, self.q_len, self.kv_len, device=device)
        elif self.mask is not None:
            bm = self.mask.block_mask(B, self.q_len, self.kv_len, device=device, q_offset=self.q_offset)
        elif self.allowed is not None:
            allowed = self.allowed.to(device)  # (B|1, H|1, Tq, Tk)
            Bm, Hm, Tq, Tk = allowed.shape

            def mod(b, h, q_idx, kv_idx):
                return allowed[b.clamp(0, Bm - 1), h.clamp(0, Hm - 1), q_idx.clamp(0, Tq - 1), kv_idx.clamp(0, Tk - 1)]

            from attnmask.masks.core import _create_block_mask

            bm = _create_block_mask(mod, None if Bm == 1 else Bm, self.q_len, self.kv_len, device, 128, heads=Hm)
        else:
            bm = None
        self._block_masks[device] = bm
        return bm

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
        st = self._state
        kind = "causal" if self.is_causal else "none" if st.allowed is None and self._build is None else "dense"
        blocks = "" if st.blocks is _UNSET or st.blocks is None else f", {len(st.blocks)} blocks"
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

    A structured mask is checked here against the problem's sizes only (its values were checked
    where it was built); nothing is read back from the device, so this runs per forward on a GPU
    and under ``torch.compile`` without a sync or a graph break. A raw tensor is linted here
    (polarity, additive values: a host read), once per tensor while it is unchanged.
    """
    if isinstance(mask, PreparedMask):
        return mask
    if mask is None:
        return PreparedMask(q_len=q_len, kv_len=kv_len, batch_size=batch_size, device=device)
    if isinstance(mask, M.Mask):
        # A mask object passed again for the same problem (every layer of a model calling attention()
        # with it, say) reuses what was built for it: validation, block plan, dense tensors. The mask
        # keeps that _State only (no reference back to itself) while its tensors are unchanged.
        key = _cache_key(mask, batch_size, q_len, kv_len, q_offset, device)
        cached = getattr(mask, "_prepared", None)
        hit = key is not None and cached is not None and cached[0] == key
        if hit:
            is_causal, state = cached[1], cached[2]
        else:
            q_start = mask.validate(batch_size, q_len, kv_len, q_offset, device=device)
            parts = mask.parts()
            is_causal = all(isinstance(p, M.Causal) for p in parts) and q_len == kv_len and q_start == 0
            state = None
        if is_causal:
            pm = PreparedMask(
                is_causal=True, q_len=q_len, kv_len=kv_len, batch_size=batch_size, device=device, state=state
            )
        else:
            pm = PreparedMask(
                q_len=q_len,
                kv_len=kv_len,
                build=lambda: mask.to_bool(batch_size, q_len, kv_len, q_offset, device=device),  # (B, 1, Tq, Tk)
                mask=mask,
                batch_size=batch_size,
                q_offset=q_offset,
                device=device,
                state=state,
            )
        if key is not None and not hit:
            mask._prepared = (key, is_causal, pm._state)
        return pm
    if isinstance(mask, Tensor):
        allowed = _lint_tensor(mask, batch_size, num_heads, q_len, kv_len, device, dtype)
        return PreparedMask(allowed, q_len=q_len, kv_len=kv_len, batch_size=batch_size, device=device)
    raise UserTypeError(
        f"mask must be None, an attnmask Mask, or a tensor (bool True = may attend, or additive float), "
        f"got {type(mask).__name__}"
    )


def _cache_key(mask: M.Mask, B: int, Tq: int, Tk: int, q_offset: int, device) -> tuple | None:
    """What a mask's last PreparedMask was made for: the problem and the version counters of the
    mask's tensors (an in-place edit of lengths or keep invalidates it). None -- no caching -- under
    ``torch.compile``, for masks with user predicates (whose closures may change unseen) and for
    inference tensors (made under ``torch.inference_mode``: they have no version counter)."""
    if torch.compiler.is_compiling():
        return None
    versions = []
    for p in M.core._walk(mask):
        if isinstance(p, M.Predicate):
            return None
        for v in vars(p).values():
            if isinstance(v, Tensor):
                if v.is_inference():  # no version counter to tell an in-place edit: no caching
                    return None
                versions.append(v._version)
    return (B, Tq, Tk, q_offset, None if device is None else torch.device(device), tuple(versions))


def _plan_blocks(parts: list[M.Mask], B: int, Tq: int, Tk: int, q_start: int) -> tuple[SdpaCall, ...] | None:
    """Decompose ``causal & key padding & query padding`` (contiguous padding) ``& document`` (self-attention
    over packed rows, each segment one contiguous run) into blocks.

    Each batch row keeps one interval of queries and one of keys, cut by its segments; with a causal
    factor, query row ``i`` (position ``q_start + i``) sees keys ``[k_lo, min(k_hi, q_start + i + 1))``
    of its segment. Rows with the same blocks are grouped so that they share one call.
    """
    q_lo, q_hi, k_lo, k_hi = [0] * B, [Tq] * B, [0] * B, [Tk] * B
    causal, docs = False, None
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
        elif isinstance(p, M.Document) and docs is None and p.query_segment_ids is None and Tq == Tk and q_start == 0:
            docs = p.runs(B)  # self-attention over packed rows: query i is in key i's segment
            if docs is None:
                return None
        else:
            return None
    groups: dict[tuple[int, int, int, int, int | None], list[int]] = {}
    for b in range(B):
        if docs is None:
            spans = [(q_lo[b], q_hi[b], k_lo[b], k_hi[b])]
        else:  # a segment's queries are the rows at its positions
            spans = [(max(q_lo[b], s), min(q_hi[b], e), max(k_lo[b], s), min(k_hi[b], e)) for s, e in docs[b]]
        for q0, q1, k0, k1 in spans:
            for key in _row_blocks(q0, q1, k0, k1, q_start if causal else None):
                groups.setdefault(key, []).append(b)
    return tuple(SdpaCall(tuple(rows), *key) for key, rows in groups.items())


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
        raise UserError(f"mask is on {t.device} but the queries are on {torch.device(device)}; move it with .to()")
    if t.dim() == 3:
        raise UserError(
            f"mask has 3-D shape {tuple(t.shape)}: ambiguous. Expected 4-D {expected} or 2-D (Tq, Tk); "
            f"for a per-batch (B, Tq, Tk) mask use mask.unsqueeze(1)"
        )
    if t.dim() not in (2, 4):
        raise UserError(f"mask has shape {tuple(t.shape)}, expected 4-D {expected} or 2-D (Tq, Tk)")
    shape4 = t.shape if t.dim() == 4 else (1, 1, *t.shape)
    for got, want, name in zip(shape4, (B, H, Tq, Tk), ("B", "H", "Tq", "Tk")):
        if got not in (1, want):
            raise UserError(f"mask has shape {tuple(t.shape)}, expected broadcastable to {expected} ({name} differs)")
    if torch.compiler.is_compiling():  # shapes only: the values were linted where the tensor was made
        if t.dtype == torch.bool:
            return t.reshape(shape4)
        if t.dtype.is_floating_point:
            return (t == 0).reshape(shape4)
        _lint_bool_tensor(t, "mask")  # raises the polarity / dtype error
    if t.dtype == torch.bool:
        if _linted(t, None) is None:
            M.lint_polarity(t)
            _remember(t, None, t)
        allowed = t
    elif t.dtype.is_floating_point:
        allowed = _linted(t, dtype)
        if allowed is None:
            allowed = M.additive_to_bool(t, dtype)
            _lint_inverted(allowed, "mask", additive=True)
            _remember(t, dtype, allowed)
    else:
        _lint_bool_tensor(t, "mask")  # raises the polarity / dtype error
        raise AssertionError("unreachable")
    return allowed.reshape(shape4)  # (B|1, H|1, Tq, Tk); reshape: the mask may be a non-contiguous view


# Raw tensors linted lately, so that a mask passed to every layer (or every decoding step) is read
# on the host once while it is unchanged: id -> (weak reference, version counter, scores dtype, allowed).
_LINTED: dict[int, tuple] = {}
_LINTED_MAX = 16


def _linted(t: Tensor, dtype) -> Tensor | None:
    if t.is_inference():  # no version counter: linted every time
        return None
    entry = _LINTED.get(id(t))
    if entry is None:
        return None
    ref, version, want, allowed = entry
    return allowed if ref() is t and version == t._version and want == dtype else None


def _remember(t: Tensor, dtype, allowed: Tensor) -> None:
    if t.is_inference():
        return
    if len(_LINTED) >= _LINTED_MAX:
        _LINTED.pop(next(iter(_LINTED)))
    with contextlib.suppress(TypeError):  # a tensor subclass without weak references: linted every time
        _LINTED[id(t)] = (weakref.ref(t), t._version, dtype, allowed)
