"""The one tolerance table: deviations scaled by the row, one entry per purpose, dtype by dtype."""

import pytest
import torch

from attnmask.audit import AGREEMENT_TOLERANCE, CACHE_TOLERANCE_FACTOR, TOLERANCES, Tolerance
from attnmask.audit import conform as conform_fn
from attnmask.audit.conform import AGREEMENT_TOLERANCE as CONFORM_AGREEMENT


def test_tolerance_is_scaled_by_the_row():
    tol = Tolerance.for_dtype(torch.float32)
    assert (tol.rtol, tol.atol) == (1.3e-6, 1e-5)
    ref = torch.tensor([[100.0, 0.0]])
    # 1e-4 on a logit of 0 is rounding noise next to a logit of 100 (tolerance 1e-5 + 1.3e-4)
    assert float(tol.ratio(torch.tensor([[0.0, 1e-4]]), ref).max()) < 1
    assert float(tol.ratio(torch.tensor([[0.0, 1e-3]]), ref).max()) > 1
    assert float(tol.ratio(torch.tensor([[float("nan"), 0.0]]), ref).max()) == float("inf")
    assert Tolerance.for_dtype(torch.float64).rtol == 1e-7


def test_one_table_two_purposes():
    assert set(TOLERANCES) == {"unchanged", "agreement"}
    # unchanged: torch.testing.assert_close's defaults
    assert TOLERANCES["unchanged"] == {
        torch.float64: (1e-7, 1e-7),
        torch.float32: (1.3e-6, 1e-5),
        torch.float16: (1e-3, 1e-5),
        torch.bfloat16: (1.6e-2, 1e-5),
    }
    # agreement: two computations of the same logits; conformance's AGREEMENT_TOLERANCE is this entry
    assert AGREEMENT_TOLERANCE is TOLERANCES["agreement"] is CONFORM_AGREEMENT
    agree = Tolerance.for_dtype(torch.float32, purpose="agreement")
    assert (agree.rtol, agree.atol) == (1e-4, 1e-4)
    assert str(agree) == "|Δ| <= 0.0001 + 0.0001·max|ref|"
    assert callable(conform_fn)  # attnmask.audit.conform is still the function


def test_overrides_unknown_dtypes_and_purposes():
    assert Tolerance.for_dtype(torch.float16, rtol=0.5) == Tolerance(0.5, 1e-5)
    assert Tolerance.for_dtype(torch.int64) == Tolerance.for_dtype(torch.float32)  # not listed: as float32
    cached = Tolerance.for_dtype(torch.float32).scaled(CACHE_TOLERANCE_FACTOR)
    assert cached.rtol == pytest.approx(1.3e-5) and cached.atol == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="unknown tolerance purpose 'close'"):
        Tolerance.for_dtype(torch.float32, purpose="close")
