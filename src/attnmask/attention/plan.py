"""Masks as a kernel sees them.

:class:`PreparedMask` is built once per forward and shared by all layers;
:class:`SdpaCall` is one step of the SDPA call plan a structured mask decomposes into.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnmask import masks as M
from attnmask.masks.lint import _lint_bool_tensor


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


class PreparedMask:
    """A mask resolved for one ``(B, H, Tq, Tk)`` problem: built once per forward, shared by layers.

    What kernels read:

    - ``is_causal``: pure causal with ``Tq == Tk``, query row ``i`` at position ``i`` and nothing
      else masked -- exactly SDPA's ``is_causal=True`` (``allowed`` is then None);
    - ``allowed``: bool, broadcastable to ``(B, H, Tq, Tk)``, True = may attend; None when nothing
      is masked or ``is_causal``. For a structured mask it is materialized on first use only;
    - ``empty_rows``: bool ``(B|1, H|1, Tq, 1)``, query rows that may attend to nothing, or None;
    - ``blocks``: the mask as :class:`SdpaCall` calls needing no mask tensor, or None when the mask is
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
        blocks: tuple[SdpaCall, ...] | None = None,
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


def _plan_blocks(parts: list[M.Mask], B: int, Tq: int, Tk: int, q_start: int) -> tuple[SdpaCall, ...] | None:
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
        _lint_bool_tensor(t, "mask")  # raises the polarity / dtype error
        raise AssertionError("unreachable")
    return allowed.reshape(shape4)  # (B|1, H|1, Tq, Tk); reshape: the mask may be a non-contiguous view
