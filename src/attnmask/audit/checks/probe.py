"""What every check of the leak audit shares: one :class:`Probe` of the model under audit.

The probe validates the audit's sizes, draws the random base sequences once (seeded: the same seed
gives the same report), picks the tolerance for the logits' dtype, and makes the forward calls the
checks are written in: logits of any batch in float64 (:meth:`Probe.call`), padding a batch
(:meth:`Probe.pad`), and how much each output moves when given input positions get other ids
(:meth:`Probe.sensitivity`, the perturbation measurement behind causality and padding).

Each check is a function ``check(probe) -> CheckResult``; what a check measures beyond pass or
fail (the dependency and gradient matrices, notes) it leaves on the probe for the report.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from attnmask import masks
from attnmask.audit.subjects import Subject
from attnmask.audit.tolerance import Tolerance
from attnmask.errors import UserError, UserTypeError

__all__ = ["Probe", "as_logits", "MAX_AUDIT_LENGTH", "MAX_AUDIT_DRAWS"]

MAX_AUDIT_LENGTH = 65_536  # tokens per audited sequence, where the model itself sets no limit
MAX_AUDIT_DRAWS = 4_096  # random base sequences, and random tokens tried per perturbed position


class Probe:
    """One model under audit, its random inputs, its tolerance, and the calls the checks make.

    Raises (on construction):
        ValueError: sizes out of range or beyond the model's longest sequence, a vocabulary with
            fewer than 2 ordinary ids, logits of the wrong shape. TypeError: ``intended`` is not a mask.
    """

    def __init__(
        self,
        subject: Subject,
        *,
        length: int,
        src_length: int,
        seed: int,
        n_sequences: int,
        n_replacements: int,
        pad_amounts: Sequence[int],
        intended,
        rtol: float | None,
        atol: float | None,
        chunk_size: int,
    ):
        for name, val, low, high in (
            ("length", length, 2, MAX_AUDIT_LENGTH),
            ("src_length", src_length, 1, MAX_AUDIT_LENGTH),
            ("n_sequences", n_sequences, 1, MAX_AUDIT_DRAWS),
            ("n_replacements", n_replacements, 1, MAX_AUDIT_DRAWS),
            ("chunk_size", chunk_size, 1, None),
        ):
            if not isinstance(val, int) or val < low:
                raise UserError(f"audit {name} must be an int >= {low}, got {val!r}")
            if high is not None and val > high:
                raise UserError(
                    f"audit {name}={val} is more than {high}: the audit runs n_sequences x length x "
                    f"n_replacements forward passes; expected {low}..{high}"
                )
        for name, n in (("length", length), ("src_length", src_length if subject.encoder_decoder else 0)):
            if subject.max_len is not None and n > subject.max_len:
                raise UserError(f"audit {name}={n} exceeds the model's longest sequence {subject.max_len}")
        bad = [p for p in pad_amounts if not isinstance(p, int) or p < 1]
        if bad:
            raise UserError(f"pad_amounts must be ints >= 1, got {list(pad_amounts)}")
        self.subject = subject
        self.T, self.S = length, src_length  # target and source lengths
        self.seed, self.N, self.K = seed, n_sequences, n_replacements
        self.pad_amounts = sorted(set(pad_amounts))
        self.chunk = chunk_size  # most rows per forward call
        self.device = subject.device
        self.gen = torch.Generator().manual_seed(seed)
        self.intended = _intended_matrix(intended, length)  # (T, T) bool, True = may depend
        self.allowed = _allowed_ids(subject.vocab_size, subject.special_ids)  # (V',) ids drawn at random
        self.src_allowed = _allowed_ids(subject.source_vocab_size, subject.special_ids)  # (Vs',)
        self.tgt = self.draw(self.allowed, (self.N, self.T))  # (N, T)
        self.src = self.draw(self.src_allowed, (self.N, self.S)) if subject.encoder_decoder else None  # (N, S)
        self.dtype = subject.dtype or self._logits_dtype()
        self.tol = Tolerance.for_dtype(self.dtype, rtol, atol)
        # what the checks measured beyond pass or fail, for the report
        self.dependency: Tensor | None = None  # (T, T) max |Δ logits_i| when token j is replaced
        self.gradient: Tensor | None = None  # (T, T) max ‖∂(r·logits_i)/∂embeds_j‖
        self.layer_reach: list | None = None  # one LayerReach per decoder layer
        self.notes: list[str] = list(subject.notes)

    # -- random ids ------------------------------------------------------------------------------
    def draw(self, allowed: Tensor, shape: tuple[int, ...]) -> Tensor:
        """Random ids from ``allowed``, of ``shape``, on the model's device."""
        idx = torch.randint(len(allowed), shape, generator=self.gen)
        return allowed[idx].to(self.device)

    def _draw_other(self, current: Tensor, allowed: Tensor) -> Tensor:
        """A random allowed id different from ``current`` (elementwise)."""
        new = self.draw(allowed, tuple(current.shape))
        same = new == current
        while same.any():
            new[same] = self.draw(allowed, (int(same.sum()),))
            same = new == current
        return new

    # -- forward calls ---------------------------------------------------------------------------
    @torch.no_grad()
    def _logits_dtype(self) -> torch.dtype:
        ones = self.ones(1, self.T)
        if self.subject.encoder_decoder:
            out = self.subject.forward(self.src[:1], self.ones(1, self.S), self.tgt[:1], ones)
        else:
            out = self.subject.forward(self.tgt[:1], ones)
        return as_logits(out, (1, self.T)).dtype

    def ones(self, n: int, t: int) -> Tensor:
        """An all-real 0/1 mask ``(n, t)``."""
        return torch.ones(n, t, dtype=torch.long, device=self.device)  # (n, t)

    @torch.no_grad()
    def call(
        self,
        tgt: Tensor,
        tgt_mask: Tensor,
        src: Tensor | None = None,
        src_mask: Tensor | None = None,
        *,
        cached: bool = False,
    ) -> Tensor:
        """Logits ``(B, T, V)`` in float64, at most ``chunk_size`` rows per forward; ``cached``: through
        the subject's ``cached_forward`` (token by token, as it generates)."""
        forward = self.subject.cached_forward if cached else self.subject.forward
        outs = []
        for a in range(0, tgt.shape[0], self.chunk):
            b = a + self.chunk
            if self.subject.encoder_decoder:
                out = forward(src[a:b], src_mask[a:b], tgt[a:b], tgt_mask[a:b])
            else:
                out = forward(tgt[a:b], tgt_mask[a:b])
            outs.append(as_logits(out, tgt[a:b].shape).double().cpu())
        return torch.cat(outs)  # (B, T, V)

    def run_target(self, rows: Tensor, owner: Tensor, mask: Tensor, *, cached: bool = False) -> Tensor:
        """Logits of target ``rows`` (M, T) with ``mask``; encoder-decoders get each row's unpadded source."""
        if not self.subject.encoder_decoder:
            return self.call(rows, mask, cached=cached)
        return self.call(rows, mask, self.src[owner], self.ones(len(rows), self.S), cached=cached)

    def pad(self, ids: Tensor, p: int, side: str) -> tuple[Tensor, Tensor, Tensor]:
        """``ids (N, L)`` with ``p`` pads on ``side``: ``(padded (N, L+p), mask (N, L+p), real index (L,))``."""
        N, L = ids.shape
        pads = torch.full((N, p), self.subject.pad_id, dtype=ids.dtype, device=ids.device)  # (N, p)
        zeros, ones = torch.zeros_like(pads), self.ones(N, L)
        if side == "left":
            return torch.cat([pads, ids], 1), torch.cat([zeros, ones], 1), torch.arange(p, p + L)
        return torch.cat([ids, pads], 1), torch.cat([ones, zeros], 1), torch.arange(L)

    # -- the perturbation measurement ------------------------------------------------------------
    def _perturbed_rows(self, ids: Tensor, positions: Sequence[int], allowed: Tensor):
        """K random replacements at each of ``positions`` in each row of ``ids`` (N, L).

        Returns rows ``(N*P*K, L)``, the base row of each ``(N*P*K,)`` and its position column ``(N*P*K,)``.
        """
        N, P, K = ids.shape[0], len(positions), self.K
        pos = torch.tensor(list(positions), dtype=torch.long, device=ids.device)  # (P,)
        rows = ids.repeat_interleave(P * K, dim=0).clone()  # (N*P*K, L)
        owner = torch.arange(N, device=ids.device).repeat_interleave(P * K)  # (N*P*K,)
        col = torch.arange(P, device=ids.device).repeat_interleave(K).repeat(N)  # (N*P*K,)
        r = torch.arange(rows.shape[0], device=ids.device)
        rows[r, pos[col]] = self._draw_other(rows[r, pos[col]], allowed)
        return rows, owner, col

    def sensitivity(
        self,
        run: Callable[[Tensor, Tensor], Tensor],
        base_ids: Tensor,
        positions: Sequence[int],
        allowed: Tensor,
        tol: Tolerance,
    ) -> tuple[Tensor, Tensor]:
        """How much each output position moves when each of ``positions`` gets other ids.

        ``run(ids_rows, base_row_index) -> logits (M, Tout, V)``. Returns ``(dev, ratio)``, both
        ``(Tout, P)``: the max ``|Δ logits|`` and the max ``|Δ| / tolerance`` over rows and vocabulary.
        """
        N = base_ids.shape[0]
        base = run(base_ids, torch.arange(N, device=base_ids.device))  # (N, Tout, V)
        rows, owner, col = self._perturbed_rows(base_ids, positions, allowed)
        M, Tout = rows.shape[0], base.shape[1]
        dev = torch.empty(M, Tout, dtype=torch.float64)  # (M, Tout)
        ratio = torch.empty(M, Tout, dtype=torch.float64)  # (M, Tout)
        for a in range(0, M, self.chunk):
            sl = slice(a, a + self.chunk)
            out = run(rows[sl], owner[sl])  # (m, Tout, V)
            ref = base[owner[sl].cpu()]  # (m, Tout, V)
            delta = torch.nan_to_num((out - ref).abs(), nan=float("inf"))
            dev[sl] = delta.amax(-1)
            ratio[sl] = tol.ratio(delta, ref).amax(-1)
        # rows are ordered (base row, position, replacement): reduce over base rows and replacements
        shape = (N, len(positions), self.K, Tout)
        dev = dev.view(shape).amax(dim=(0, 2))  # (P, Tout)
        ratio = ratio.view(shape).amax(dim=(0, 2))  # (P, Tout)
        return dev.T, ratio.T  # (Tout, P)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def _intended_matrix(intended, T: int) -> Tensor:
    if intended is None:
        intended = masks.causal()
    if isinstance(intended, masks.Mask):
        return intended.to_bool(1, T, T)[0, 0].cpu()  # (T, T)
    if isinstance(intended, Tensor) and intended.dtype == torch.bool and intended.shape == (T, T):
        return intended.cpu()
    got = f"{intended.dtype} {tuple(intended.shape)}" if isinstance(intended, Tensor) else type(intended).__name__
    raise UserTypeError(f"intended must be an attnmask Mask or a bool ({T}, {T}) tensor (True = may depend), got {got}")


def _allowed_ids(vocab_size: int, special_ids: Sequence[int]) -> Tensor:
    keep = torch.ones(vocab_size, dtype=torch.bool)
    keep[[i for i in special_ids if 0 <= i < vocab_size]] = False
    allowed = keep.nonzero().flatten()  # (V',)
    if len(allowed) < 2:
        raise UserError(f"a vocabulary of {vocab_size} ids less specials {list(special_ids)} leaves fewer than 2 ids")
    return allowed


def as_logits(out, shape: torch.Size) -> Tensor:
    """Accept a tensor or an object with ``.logits`` (Hugging Face outputs); check ``(B, T, V)``."""
    logits = getattr(out, "logits", out)
    if not isinstance(logits, Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(shape):
        got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise UserError(f"the model returned {got}, expected logits (B={shape[0]}, T={shape[1]}, V)")
    return logits
