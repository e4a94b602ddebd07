"""Audits that prove no token peeks: causality, padding invariance, cache parity, no NaN.

The seeds' whole point is that no position may see a future token or a pad. These checks measure
it from the outside, on any model (see :mod:`attnmask.audit.subjects`): an attnmask Transformer or
run directory, a Hugging Face model, or a callable from ids to logits.

Checks, in the order they run and report:

``causality``
    For random sequences of length T, every token j is replaced by several random tokens in turn;
    ``D[i, j] = max |Δ logits_i|``. A pair the intended mask blocks (``j > i`` for the look-ahead
    mask) with a deviation beyond the dtype's tolerance is a leak.
``gradient``
    ``G[i, j] = ‖∂(r · logits_i) / ∂ embeds_j‖`` for a random vector r. Masked attention gives
    exactly zero there, so any blocked pair with ``G[i, j] > 1e-6 ε G.max()`` is a leak: this check
    catches structural leaks however weak (e.g. a look-ahead of one position reaching two positions
    through two layers), where the perturbation check reports only leaks that move the logits
    beyond rounding.
``padding``
    Real tokens padded on the left and/or right: their logits must equal the unpadded ones (leak
    ``(i, None)``), and must not change when other ids are written in the pad positions (leak
    ``(i, j)``, j the pad position).
``source padding`` (encoder-decoder)
    The same for the source: every target output against the amount of source padding and the
    ids in the source pads.
``cache parity``
    Logits computed token by token with a KV cache equal the full forward at real positions.
``fully padded rows``
    A row that is all padding gives finite logits and does not disturb the other rows.

Logit deviations are judged as ``|Δ| <= atol + rtol · max|reference row|``: rounding noise scales
with the size of the logit vector, not of each logit. ``rtol`` and ``atol`` are
``torch.testing.assert_close``'s defaults for the logits' dtype (float32: 1.3e-6 and 1e-5); cache
parity allows 10 times that, as it compares two different computations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from attnmask import masks
from attnmask.audit.report import AuditReport, CheckResult, Leak
from attnmask.audit.subjects import Subject, as_subject, from_callable, from_hf, from_run, from_transformer
from attnmask.errors import UserError, UserTypeError

__all__ = [
    "audit",
    "Tolerance",
    "CHECKS",
    "AuditReport",
    "CheckResult",
    "Leak",
    "Subject",
    "as_subject",
    "from_callable",
    "from_hf",
    "from_run",
    "from_transformer",
]

CHECKS = ("causality", "gradient", "padding", "source padding", "cache parity", "fully padded rows")

# torch.testing.assert_close's defaults: (rtol, atol)
_DEFAULT_TOLERANCE = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
}
CACHE_TOLERANCE_FACTOR = 10.0
MAX_AUDIT_LENGTH = 65_536  # tokens per audited sequence, where the model itself sets no limit
MAX_AUDIT_DRAWS = 4_096  # random base sequences, and random tokens tried per perturbed position
GRADIENT_EPS_FACTOR = 1e-6  # a gradient above this times eps times the largest one is not zero


@dataclass(frozen=True)
class Tolerance:
    """``|Δ| <= atol + rtol * max|reference row|`` counts as "no change"."""

    rtol: float
    atol: float

    @classmethod
    def for_dtype(cls, dtype: torch.dtype, rtol: float | None = None, atol: float | None = None) -> Tolerance:
        default = _DEFAULT_TOLERANCE.get(dtype, _DEFAULT_TOLERANCE[torch.float32])
        return cls(default[0] if rtol is None else rtol, default[1] if atol is None else atol)

    def scaled(self, factor: float) -> Tolerance:
        return Tolerance(self.rtol * factor, self.atol * factor)

    def ratio(self, delta: Tensor, reference: Tensor) -> Tensor:
        """``|Δ| / (atol + rtol max|ref|)`` over the last (vocabulary) dim: above 1 means changed.
        NaN counts as infinitely changed."""
        scale = reference.abs().amax(-1, keepdim=True)  # (..., 1)
        return torch.nan_to_num(delta / (self.atol + self.rtol * scale), nan=float("inf"))

    def __str__(self) -> str:
        return f"|Δ| <= {self.atol:.2g} + {self.rtol:.2g}·max|ref|"


def audit(
    model,
    *,
    length: int = 12,
    src_length: int = 10,
    seed: int = 0,
    n_sequences: int = 2,
    n_replacements: int = 3,
    pad_amounts: Sequence[int] = (1, 3),
    intended: masks.Mask | Tensor | None = None,
    checks: Sequence[str] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    chunk_size: int = 64,
    **subject_kwargs,
) -> AuditReport:
    """Audit ``model`` for leaks (see the module docstring).

    Args:
        model: an attnmask Transformer, a run directory, a Hugging Face model, a
            :class:`~attnmask.audit.subjects.Subject`, or a callable ``(input_ids, attention_mask)
            -> logits`` (then pass ``vocab_size=``, and ``encoder_decoder=True`` for a callable
            ``(src_ids, src_mask, tgt_ids, tgt_mask) -> logits``).
        length: target length T of the audited sequences; src_length: source length S.
        seed: seeds every random token; the same seed gives the same report.
        n_sequences: random base sequences; n_replacements: random tokens tried per position.
        pad_amounts: numbers of pad tokens tried on each side (each < T, resp. < S).
        intended: the decoder self-attention the model is meant to have, as a mask (True = may
            depend) or a ``(T, T)`` bool tensor; default the look-ahead mask ``masks.causal()``.
        checks: a subset of :data:`CHECKS` to run (default all that apply).
        rtol, atol: override the dtype's tolerance.
        chunk_size: most rows per forward call.
        subject_kwargs: passed to :func:`~attnmask.audit.subjects.as_subject`.

    Returns:
        an :class:`AuditReport`; ``report.passed`` / ``report.exit_code`` gate CI.

    Raises:
        ValueError: sizes the model cannot take, or an unknown check name.
    """
    subject = as_subject(model, **subject_kwargs)
    auditor = _Auditor(
        subject,
        length=length,
        src_length=src_length,
        seed=seed,
        n_sequences=n_sequences,
        n_replacements=n_replacements,
        pad_amounts=pad_amounts,
        intended=intended,
        rtol=rtol,
        atol=atol,
        chunk_size=chunk_size,
    )
    return auditor.run(checks)


# ---------------------------------------------------------------------------------------------
# The auditor
# ---------------------------------------------------------------------------------------------
class _Auditor:
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
        self.s = subject
        self.T, self.S = length, src_length
        self.seed, self.N, self.K = seed, n_sequences, n_replacements
        self.pad_amounts = sorted(set(pad_amounts))
        self.chunk = chunk_size
        self.device = subject.device
        self.gen = torch.Generator().manual_seed(seed)
        self.intended = _intended_matrix(intended, length)
        self.allowed = _allowed_ids(subject.vocab_size, subject.special_ids)
        self.src_allowed = _allowed_ids(subject.source_vocab_size, subject.special_ids)
        self.tgt = self._draw(self.allowed, (self.N, self.T))  # (N, T)
        self.src = self._draw(self.src_allowed, (self.N, self.S)) if subject.encoder_decoder else None  # (N, S)
        self.dtype = subject.dtype or self._logits_dtype()
        self.tol = Tolerance.for_dtype(self.dtype, rtol, atol)
        self.dependency: Tensor | None = None
        self.gradient: Tensor | None = None
        self.notes: list[str] = list(subject.notes)

    # -- plumbing --------------------------------------------------------------------------------
    def _draw(self, allowed: Tensor, shape: tuple[int, ...]) -> Tensor:
        idx = torch.randint(len(allowed), shape, generator=self.gen)
        return allowed[idx].to(self.device)

    def _draw_other(self, current: Tensor, allowed: Tensor) -> Tensor:
        """A random allowed id different from ``current`` (elementwise)."""
        new = self._draw(allowed, tuple(current.shape))
        same = new == current
        while same.any():
            new[same] = self._draw(allowed, (int(same.sum()),))
            same = new == current
        return new

    @torch.no_grad()
    def _logits_dtype(self) -> torch.dtype:
        ones = self._ones(1, self.T)
        if self.s.encoder_decoder:
            out = self.s.forward(self.src[:1], self._ones(1, self.S), self.tgt[:1], ones)
        else:
            out = self.s.forward(self.tgt[:1], ones)
        return _as_logits(out, (1, self.T)).dtype

    def _ones(self, n: int, t: int) -> Tensor:
        return torch.ones(n, t, dtype=torch.long, device=self.device)  # (n, t)

    @torch.no_grad()
    def _call(self, tgt: Tensor, tgt_mask: Tensor, src: Tensor | None = None, src_mask: Tensor | None = None) -> Tensor:
        """Logits ``(B, T, V)`` in float64, at most ``chunk_size`` rows per forward."""
        outs = []
        for a in range(0, tgt.shape[0], self.chunk):
            b = a + self.chunk
            if self.s.encoder_decoder:
                out = self.s.forward(src[a:b], src_mask[a:b], tgt[a:b], tgt_mask[a:b])
            else:
                out = self.s.forward(tgt[a:b], tgt_mask[a:b])
            outs.append(_as_logits(out, tgt[a:b].shape).double().cpu())
        return torch.cat(outs)  # (B, T, V)

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

    def _sensitivity(
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

    def _pad(self, ids: Tensor, p: int, side: str) -> tuple[Tensor, Tensor, Tensor]:
        """``ids (N, L)`` with ``p`` pads on ``side``: ``(padded (N, L+p), mask (N, L+p), real index (L,))``."""
        N, L = ids.shape
        pads = torch.full((N, p), self.s.pad_id, dtype=ids.dtype, device=ids.device)  # (N, p)
        zeros, ones = torch.zeros_like(pads), self._ones(N, L)
        if side == "left":
            return torch.cat([pads, ids], 1), torch.cat([zeros, ones], 1), torch.arange(p, p + L)
        return torch.cat([ids, pads], 1), torch.cat([ones, zeros], 1), torch.arange(L)

    # -- the checks ------------------------------------------------------------------------------
    def run(self, only: Sequence[str] | None) -> AuditReport:
        if only is not None:
            unknown = [c for c in only if c not in CHECKS]
            if unknown:
                raise UserError(f"unknown audit checks {unknown}; expected some of {list(CHECKS)}")
        wanted = [c for c in CHECKS if only is None or c in only]
        if not self.s.encoder_decoder and "source padding" in wanted:
            wanted.remove("source padding")
        methods = {
            "causality": self.check_causality,
            "gradient": self.check_gradient,
            "padding": self.check_padding,
            "source padding": self.check_source_padding,
            "cache parity": self.check_cache,
            "fully padded rows": self.check_fully_padded,
        }
        results = [methods[name]() for name in wanted]
        return AuditReport(
            model=self.s.name,
            encoder_decoder=self.s.encoder_decoder,
            dtype=str(self.dtype).removeprefix("torch."),
            length=self.T,
            src_length=self.S if self.s.encoder_decoder else None,
            seed=self.seed,
            checks=results,
            intended=self.intended,
            dependency=self.dependency,
            gradient=self.gradient,
            notes=self.notes,
        )

    def _run_target(self, rows: Tensor, owner: Tensor, mask: Tensor) -> Tensor:
        """Logits of target ``rows`` (M, T) with ``mask``; encoder-decoders get each row's unpadded source."""
        if not self.s.encoder_decoder:
            return self._call(rows, mask)
        return self._call(rows, mask, self.src[owner], self._ones(len(rows), self.S))

    def check_causality(self) -> CheckResult:
        T = self.T

        def run(rows, owner):
            return self._run_target(rows, owner, self._ones(len(rows), T))

        dev, ratio = self._sensitivity(run, self.tgt, range(T), self.allowed, self.tol)  # (T, T)
        self.dependency = dev.float()
        blocked = ~self.intended
        leaks = [Leak("causality", i, j, float(dev[i, j])) for i, j in ((ratio > 1) & blocked).nonzero().tolist()]
        unused = int((self.intended & (dev == 0)).sum())
        if unused:
            self.notes.append(
                f"{unused} allowed (i, j) pairs showed no dependence at all: the model may mask more than "
                "intended (e.g. a token that cannot see itself)"
            )
        n_rows = self.N * T * self.K
        return CheckResult(
            "causality",
            passed=not leaks,
            max_deviation=float(dev[blocked].max()) if blocked.any() else 0.0,
            tolerance=str(self.tol),
            leaks=leaks,
            details=[f"{self.N} sequences x {T} positions x {self.K} replacement tokens = {n_rows} perturbed rows"],
        )

    def check_gradient(self) -> CheckResult:
        if self.s.forward_with_embeds is None:
            return CheckResult("gradient", passed=True, skipped="the model offers no input embeddings to differentiate")
        T = self.T
        r = torch.randn(self.s.vocab_size, generator=self.gen, dtype=torch.float64)  # (V,)
        grad = torch.zeros(T, T, dtype=torch.float64)  # (T, T)
        diag = torch.arange(T)
        for n in range(self.N):
            rows = self.tgt[n].expand(T, T).clone()  # (T, T): row i is read at position i
            args = (rows, self._ones(T, T))
            if self.s.encoder_decoder:
                args = (self.src[n].expand(T, self.S), self._ones(T, self.S), *args)
            with torch.enable_grad():
                logits, embeds = self.s.forward_with_embeds(*args)
                logits = _as_logits(logits, rows.shape)
                picked = logits[diag, diag].double()  # (T, V): output i of row i
                (g,) = torch.autograd.grad((picked * r.to(picked.device)).sum(), embeds)  # (T, T, C)
            grad = torch.maximum(grad, g.detach().double().norm(dim=-1).cpu())
        self.gradient = grad.float()
        blocked = ~self.intended
        threshold = GRADIENT_EPS_FACTOR * torch.finfo(self.dtype).eps * float(grad.max())
        over = ((grad > threshold) & blocked).nonzero().tolist()
        leaks = [Leak("gradient", i, j, float(grad[i, j])) for i, j in over]
        return CheckResult(
            "gradient",
            passed=not leaks,
            max_deviation=float(grad[blocked].max()) if blocked.any() else 0.0,
            tolerance=f"‖∂‖ <= {GRADIENT_EPS_FACTOR:g}·eps·max = {threshold:.2g}: exactly zero",
            leaks=leaks,
            details=[f"{self.N} sequences, one backward pass each over {T} copies"],
        )

    def check_padding(self) -> CheckResult:
        configs = [(side, p) for side in ("left", "right") if side in self.s.pad_sides for p in self.pad_amounts]
        configs = [(side, p) for side, p in configs if p < self.T]
        if not configs:
            return CheckResult("padding", passed=True, skipped=f"no pad amount below the length {self.T}")
        run_src = self._run_target
        leaks, details, worst = [], [], 0.0
        for order, (side, p) in enumerate(configs):
            context = f"{side} padding x{p}"
            real = self.tgt[:, : self.T - p]  # (N, L)
            padded, mask, real_idx = self._pad(real, p, side)  # (N, T), (N, T), (L,)
            pad_idx = [j for j in range(self.T) if j not in set(real_idx.tolist())]
            owner = torch.arange(self.N, device=self.device)
            # 1. the amount of padding: padded vs unpadded, at the real positions
            ref = run_src(real, owner, self._ones(self.N, real.shape[1]))  # (N, L, V)
            out = run_src(padded, owner, mask)[:, real_idx]  # (N, L, V)
            delta = torch.nan_to_num((out - ref).abs(), nan=float("inf"))
            dev_amount = delta.amax(dim=(0, 2))  # (L,)
            bad = self.tol.ratio(delta, ref).amax(dim=(0, 2)) > 1  # (L,)
            leaks += [
                Leak("padding", int(real_idx[k]), None, float(dev_amount[k]), context, order)
                for k in bad.nonzero().flatten().tolist()
            ]
            # 2. the ids written in pad positions
            dev, ratio = self._sensitivity(
                lambda rows, own, m=mask: run_src(rows, own, m[own]), padded, pad_idx, self.allowed, self.tol
            )  # (T, p)
            dev, ratio = dev[real_idx], ratio[real_idx]  # (L, p)
            leaks += [
                Leak("padding", int(real_idx[k]), pad_idx[c], float(dev[k, c]), context, order)
                for k, c in (ratio > 1).nonzero().tolist()
            ]
            worst = max(worst, float(dev_amount.max()), float(dev.max()))
            details.append(f"{context}: amount and {self.K} other ids at each pad")
        return CheckResult(
            "padding", passed=not leaks, max_deviation=worst, tolerance=str(self.tol), leaks=leaks, details=details
        )

    def check_source_padding(self) -> CheckResult:
        configs = [(side, p) for side in ("left", "right") for p in self.pad_amounts if p < self.S]
        if not configs:
            return CheckResult("source padding", passed=True, skipped=f"no pad amount below the source length {self.S}")
        T, N = self.T, self.N
        tgt_mask = self._ones(N, T)
        leaks, details, worst = [], [], 0.0
        for order, (side, p) in enumerate(configs):
            context = f"source {side} padding x{p}"
            real = self.src[:, : self.S - p]  # (N, Ls)
            padded, mask, real_idx = self._pad(real, p, side)  # (N, S), (N, S), (Ls,)
            pad_idx = [j for j in range(self.S) if j not in set(real_idx.tolist())]
            if side in self.s.src_pad_sides:
                ref = self._call(self.tgt, tgt_mask, real, self._ones(N, real.shape[1]))  # (N, T, V)
                out = self._call(self.tgt, tgt_mask, padded, mask)  # (N, T, V)
                delta = torch.nan_to_num((out - ref).abs(), nan=float("inf"))
                dev_amount = delta.amax(dim=(0, 2))  # (T,)
                bad = self.tol.ratio(delta, ref).amax(dim=(0, 2)) > 1  # (T,)
                leaks += [
                    Leak("source padding", i, None, float(dev_amount[i]), context, order)
                    for i in bad.nonzero().flatten().tolist()
                ]
                worst = max(worst, float(dev_amount.max()))
                what = "amount and"
            else:
                what = "(amount not checked: the model numbers source positions from 0)"

            def run(rows, own, m=mask):
                return self._call(self.tgt[own], self._ones(len(rows), T), rows, m[own])

            dev, ratio = self._sensitivity(run, padded, pad_idx, self.src_allowed, self.tol)  # (T, p)
            leaks += [
                Leak("source padding", i, pad_idx[c], float(dev[i, c]), context, order)
                for i, c in (ratio > 1).nonzero().tolist()
            ]
            worst = max(worst, float(dev.max()))
            details.append(f"{context}: {what} {self.K} other ids at each source pad")
        return CheckResult(
            "source padding",
            passed=not leaks,
            max_deviation=worst,
            tolerance=str(self.tol),
            leaks=leaks,
            details=details,
        )

    def _variants(self) -> list[tuple[str, Tensor, Tensor, Tensor | None, Tensor | None]]:
        """Batches for cache parity: unpadded, and padded on each supported side (and source right)."""
        T, N = self.T, self.N
        p = max([a for a in self.pad_amounts if a < T], default=0)
        src, src_mask = (self.src, self._ones(N, self.S)) if self.s.encoder_decoder else (None, None)
        out = [("no padding", self.tgt, self._ones(N, T), src, src_mask)]
        for side in self.s.pad_sides if p else ():
            ids, mask, _ = self._pad(self.tgt[:, : T - p], p, side)
            out.append((f"{side} padding x{p}", ids, mask, src, src_mask))
        ps = max([a for a in self.pad_amounts if a < self.S], default=0)
        if self.s.encoder_decoder and ps:
            padded, mask, _ = self._pad(self.src[:, : self.S - ps], ps, "right")
            out.append((f"source right padding x{ps}", self.tgt, self._ones(N, T), padded, mask))
        return out

    @torch.no_grad()
    def check_cache(self) -> CheckResult:
        if self.s.cached_forward is None:
            return CheckResult("cache parity", passed=True, skipped="the model offers no KV-cache decoding")
        tol = self.tol.scaled(CACHE_TOLERANCE_FACTOR)
        problems, details, worst = [], [], 0.0
        for name, ids, mask, src, src_mask in self._variants():
            full = self._call(ids, mask, src, src_mask)  # (N, T, V)
            args = (src, src_mask, ids, mask) if self.s.encoder_decoder else (ids, mask)
            cached = _as_logits(self.s.cached_forward(*args), ids.shape).double().cpu()  # (N, T, V)
            real = mask.bool().cpu()  # (N, T)
            delta = torch.nan_to_num((cached - full).abs(), nan=float("inf"))[real]  # (R, V)
            ratio = tol.ratio(delta, full[real]).amax(-1)  # (R,)
            positions = real.nonzero()[:, 1]  # (R,)
            worst = max(worst, float(delta.max()))
            if (ratio > 1).any():
                first = int(positions[(ratio > 1).nonzero()[0, 0]])
                problems.append(
                    f"{name}: cached logits differ from the full forward at {int((ratio > 1).sum())} real positions "
                    f"(first at position {first}, max |Δ| {float(delta.max()):.3g})"
                )
            details.append(name)
        return CheckResult(
            "cache parity",
            passed=not problems,
            max_deviation=worst,
            tolerance=str(tol),
            problems=problems,
            details=details,
        )

    @torch.no_grad()
    def check_fully_padded(self) -> CheckResult:
        T = self.T
        real_ids = self.tgt[:1]  # (1, T)
        pad_ids = torch.full_like(real_ids, self.s.pad_id)  # (1, T)
        ones, zeros = self._ones(1, T), torch.zeros_like(real_ids)
        if self.s.encoder_decoder:
            src = self.src[:1]
            src_pad = torch.full_like(src, self.s.pad_id)
            s_ones, s_zeros = self._ones(1, self.S), torch.zeros_like(src)
            rows = [  # (name, src, src_mask, tgt, tgt_mask)
                ("real source, real target", src, s_ones, real_ids, ones),
                ("real source, padded target", src, s_ones, pad_ids, zeros),
                ("padded source, real target", src_pad, s_zeros, real_ids, ones),
                ("padded source, padded target", src_pad, s_zeros, pad_ids, zeros),
            ]
        else:
            rows = [("real row", None, None, real_ids, ones), ("padded row", None, None, pad_ids, zeros)]
        names = [r[0] for r in rows]
        tgt, tgt_mask = torch.cat([r[3] for r in rows]), torch.cat([r[4] for r in rows])
        src = torch.cat([r[1] for r in rows]) if self.s.encoder_decoder else None
        src_mask = torch.cat([r[2] for r in rows]) if self.s.encoder_decoder else None
        problems = []
        out = self._call(tgt, tgt_mask, src, src_mask)  # (R, T, V)
        outputs = [("forward", out)]
        if self.s.cached_forward is not None:
            args = (src, src_mask, tgt, tgt_mask) if self.s.encoder_decoder else (tgt, tgt_mask)
            outputs.append(("cached", _as_logits(self.s.cached_forward(*args), tgt.shape).double().cpu()))
        for how, logits in outputs:
            for k, name in enumerate(names):
                if not torch.isfinite(logits[k]).all():
                    problems.append(f"{how}: {name}: non-finite logits (NaN/inf)")
        # the padded rows must not disturb the real one next to them
        alone = self._call(rows[0][3], rows[0][4], rows[0][1], rows[0][2])  # (1, T, V)
        delta = torch.nan_to_num((out[:1] - alone).abs(), nan=float("inf"))
        if (self.tol.ratio(delta, alone) > 1).any():
            problems.append(
                f"fully padded rows in the batch changed the real row's logits (max |Δ| {float(delta.max()):.3g})"
            )
        return CheckResult(
            "fully padded rows",
            passed=not problems,
            max_deviation=float(delta.max()),
            tolerance=str(self.tol),
            problems=problems,
            details=[f"{how}: {', '.join(names)}" for how, _ in outputs],
        )


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


def _as_logits(out, shape: torch.Size) -> Tensor:
    """Accept a tensor or an object with ``.logits`` (Hugging Face outputs); check ``(B, T, V)``."""
    logits = getattr(out, "logits", out)
    if not isinstance(logits, Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(shape):
        got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise UserError(f"the model returned {got}, expected logits (B={shape[0]}, T={shape[1]}, V)")
    return logits
