"""How far two logit vectors may differ and still count as equal: one table, by dtype and purpose.

Deviations are judged per row, ``|Δ| <= atol + rtol · max|reference row|``: rounding noise scales
with the size of the logit vector, not of each logit.

Two purposes, two entries of :data:`TOLERANCES`, because they measure different things:

``"unchanged"``
    The same computation on inputs that differ only where the model must not look (a later
    token, a pad): rounding is all that may differ. ``torch.testing.assert_close``'s defaults
    (float32 ``1.3e-6`` and ``1e-5``). The leak audit's checks and conformance's perturbation
    scenarios use it; the audit's cache parity allows :data:`CACHE_TOLERANCE_FACTOR` times it.
``"agreement"``
    Two different computations of the same logits (padded vs not, cached vs not, batched vs
    alone, one attention implementation vs another or vs float64): conformance uses it. float32
    ``(1e-4, 1e-4)``: SmolLM2 (30 layers, logits up to ~30) differs by up to 4.7e-4 between such
    computations, rounding alone; assert_close's float32 default x10 was too tight for it. A
    masking error moves logits by 1e-1 and more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnmask.errors import UserError

__all__ = ["Tolerance", "TOLERANCES", "AGREEMENT_TOLERANCE", "CACHE_TOLERANCE_FACTOR"]

# purpose -> dtype -> (rtol, atol); a dtype not listed is judged as float32
TOLERANCES: dict[str, dict[torch.dtype, tuple[float, float]]] = {
    "unchanged": {  # torch.testing.assert_close's defaults
        torch.float64: (1e-7, 1e-7),
        torch.float32: (1.3e-6, 1e-5),
        torch.float16: (1e-3, 1e-5),
        torch.bfloat16: (1.6e-2, 1e-5),
    },
    "agreement": {  # measured: cached vs full, eager vs sdpa on SmolLM2 (docs/conformance.md)
        torch.float64: (1e-9, 1e-9),
        torch.float32: (1e-4, 1e-4),
        torch.float16: (5e-3, 1e-3),
        torch.bfloat16: (4e-2, 1e-2),
    },
}
AGREEMENT_TOLERANCE = TOLERANCES["agreement"]
# the leak audit's cache parity compares two computations at the tolerance in effect (user overrides
# included) times this: tiny models stay far inside it
CACHE_TOLERANCE_FACTOR = 10.0


@dataclass(frozen=True)
class Tolerance:
    """``|Δ| <= atol + rtol * max|reference row|`` counts as "no change"."""

    rtol: float
    atol: float

    @classmethod
    def for_dtype(
        cls,
        dtype: torch.dtype,
        rtol: float | None = None,
        atol: float | None = None,
        *,
        purpose: str = "unchanged",
    ) -> Tolerance:
        """The :data:`TOLERANCES` entry for ``purpose`` and ``dtype``; ``rtol`` / ``atol`` override it.

        Raises:
            ValueError: an unknown purpose.
        """
        if purpose not in TOLERANCES:
            raise UserError(f"unknown tolerance purpose {purpose!r}; expected one of {list(TOLERANCES)}")
        table = TOLERANCES[purpose]
        default = table.get(dtype, table[torch.float32])
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
