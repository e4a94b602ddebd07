"""Mask.key_spans and Mask.evaluate: per-query key intervals and the mask on chosen positions."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnmask import masks


def covered(mask: masks.Mask, B: int, Tq: int, Tk: int, q_offset: int = 0) -> torch.Tensor:
    """The keys the spans hold, as bool (B, Tq, Tk)."""
    start = masks.query_start(mask, Tq, Tk, q_offset)
    kv = torch.arange(Tk)
    out = torch.zeros(B, Tq, Tk, dtype=torch.bool)
    for lo, hi in mask.key_spans(B, Tq, Tk, start):
        lo, hi = (t.expand(B if t.shape[0] > 1 else 1, Tq) for t in torch.broadcast_tensors(lo, hi))
        out |= (kv >= lo[..., None]) & (kv < hi[..., None])
    return out


SEG = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3], [5, 5, 5, 5, 5, 5, 1, 1, 1, 1]])


def test_interval_masks_have_exact_spans():
    exact = [
        masks.causal(),
        masks.sliding_window(3),
        masks.padding(lengths=[7, 10]),
        masks.padding(lengths=[7, 10], side="left"),
        masks.query_padding(lengths=[4, 10]),
        masks.prefix_lm([3, 5]),
        masks.document(SEG),
        masks.document(SEG) & masks.sliding_window(3) & masks.padding(lengths=[8, 9]),
    ]
    for m in exact:
        assert torch.equal(covered(m, 2, 10, 10), m.to_bool(2, 10, 10)[:, 0]), m


def test_window_spans_are_literal():
    ((lo, hi),) = masks.sliding_window(3).key_spans(1, 4, 6, 2)  # queries at positions 2..5
    assert lo.tolist() == [[0, 1, 2, 3]] and hi.tolist() == [[3, 4, 5, 6]]


def test_or_keeps_both_intervals():
    m = masks.sliding_window(2) | masks.prefix_lm(2)
    assert len(m.key_spans(1, 10, 10, 0)) == 2
    assert torch.equal(covered(m, 1, 10, 10), m.to_bool(1, 10, 10)[:, 0])


def test_what_the_algebra_cannot_bound_is_every_key():
    m = ~masks.causal()
    assert covered(m, 1, 5, 5).all()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.integers(1, 3),
    st.integers(1, 12),
    st.integers(0, 6),
    st.integers(1, 5),
    st.integers(0, 5),
    st.integers(0, 10_000),
)
def test_spans_hold_every_allowed_key_and_evaluate_equals_to_bool(B, Tk, dq, w, which, seed):
    Tq = max(1, Tk - dq)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, Tk + 1, (B,), generator=g).tolist()
    seg = torch.randint(0, 3, (B, Tk), generator=g)  # documents need not be contiguous
    keep = torch.rand(B, Tk, generator=g) < 0.6
    m = [
        masks.sliding_window(w) & masks.padding(lengths=lengths, side="left"),
        masks.document(seg) & masks.causal(),
        masks.document(seg) | masks.sliding_window(w),
        masks.prefix_lm(lengths) & masks.padding(keep=keep),
        masks.causal() & masks.query_padding(lengths=[min(n, Tq) for n in lengths]),
        (masks.sliding_window(w) | masks.prefix_lm(lengths)) & masks.padding(lengths=lengths),
    ][which]
    allowed = m.to_bool(B, Tq, Tk)[:, 0]  # (B, Tq, Tk)
    assert not (allowed & ~covered(m, B, Tq, Tk)).any()
    start = masks.query_start(m, Tq, Tk)
    q_pos = (start + torch.arange(Tq)).view(1, 1, Tq, 1)
    got = m.evaluate(B, Tq, Tk, start, q_pos, torch.arange(Tk).view(1, 1, 1, Tk))
    assert torch.equal(got.expand(B, 1, Tq, Tk)[:, 0], allowed)
