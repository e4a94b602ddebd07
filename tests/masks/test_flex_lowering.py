"""Masks lower to FlexAttention: ``mask.mask_mod()`` and ``mask.block_mask()`` equal the dense mask.

Every kind (causal in both alignments with offsets, padding by lengths or keep on either side,
query padding, sliding windows, prefix LM, documents, predicates, literal tensors) and random
``& | ~`` trees of them, evaluated three ways against :meth:`Mask.to_bool`:

- FlexAttention's own ``create_mask`` (``vmap`` over scalar indices, as its kernels call a mask_mod);
- the mask_mod called once on broadcast index tensors;
- the ``BlockMask`` from ``block_mask``: every block holding an allowed cell is computed, every
  block it calls full is all allowed, and its tensors live on the device asked for.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import _ordered_to_dense, create_mask

from attnmask import masks

PROPS = settings(max_examples=60, deadline=None, derandomize=True)


@st.composite
def problems(draw):
    B, Tq, Tk = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 9))
    align = draw(st.sampled_from(["bottom_right", "top_left"]))
    q_offset = draw(st.integers(0, 4)) if align == "top_left" else 0
    return B, Tq, Tk, align, q_offset


@st.composite
def leaves(draw, B, Tq, Tk, align, q_offset):
    start = Tk - Tq if align == "bottom_right" else q_offset
    kinds = ["causal", "window", "padding", "keep", "qpad", "prefix", "predicate", "tensor", "batch_tensor"]
    kinds.append("cross_doc")
    if start >= 0 and start + Tq <= Tk:
        kinds.append("document")  # a query's segment is that of the key at its position
    kind = draw(st.sampled_from(kinds))
    rows = draw(st.sampled_from([1, B]))  # per-row data, or one row broadcast to every batch row
    side = draw(st.sampled_from(["right", "left"]))
    if kind == "causal":
        return masks.causal(align)
    if kind == "window":
        return masks.sliding_window(draw(st.integers(1, 4)), align)
    if kind == "padding":
        return masks.padding(lengths=draw(st.lists(st.integers(0, Tk), min_size=rows, max_size=rows)), side=side)
    if kind == "keep":
        bits = draw(st.lists(st.booleans(), min_size=rows * Tk, max_size=rows * Tk))
        return masks.padding(keep=torch.tensor(bits).view(rows, Tk))
    if kind == "qpad":
        return masks.query_padding(lengths=draw(st.lists(st.integers(0, Tq), min_size=rows, max_size=rows)), side=side)
    if kind == "prefix":
        return masks.prefix_lm(draw(st.lists(st.integers(0, Tk), min_size=rows, max_size=rows)), align)
    if kind == "predicate":
        return masks.from_predicate(lambda b, h, q, kv: (q + 2 * kv + b) % 3 != 0, align)
    if kind == "document":
        seg = [sorted(draw(st.lists(st.integers(0, 2), min_size=Tk, max_size=Tk))) for _ in range(rows)]
        return masks.document(torch.tensor(seg))
    if kind == "cross_doc":  # queries carry their own segments (packed cross-attention)
        kseg = [sorted(draw(st.lists(st.integers(0, 2), min_size=Tk, max_size=Tk))) for _ in range(rows)]
        qrows = draw(st.sampled_from([1, B]))
        qseg = [sorted(draw(st.lists(st.integers(0, 2), min_size=Tq, max_size=Tq))) for _ in range(qrows)]
        return masks.document(torch.tensor(kseg), query_segment_ids=torch.tensor(qseg))
    shape = (Tq, Tk) if kind == "tensor" else (rows, 1, draw(st.sampled_from([1, Tq])), Tk)
    n = 1
    for s in shape:
        n *= s
    return masks.from_tensor(torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).view(shape))


@st.composite
def trees(draw, B, Tq, Tk, align, q_offset, depth=3):
    if depth == 0 or draw(st.booleans()):
        return draw(leaves(B, Tq, Tk, align, q_offset))
    op = draw(st.sampled_from(["and", "or", "not"]))
    a = draw(trees(B, Tq, Tk, align, q_offset, depth - 1))
    if op == "not":
        return ~a
    b = draw(trees(B, Tq, Tk, align, q_offset, depth - 1))
    return a & b if op == "and" else a | b


@PROPS
@given(problems(), st.data())
def test_mask_mod_under_vmap_equals_the_dense_mask(problem, data):
    B, Tq, Tk, align, q_offset = problem
    mask = data.draw(trees(B, Tq, Tk, align, q_offset))
    dense = mask.to_bool(B, Tq, Tk, q_offset)  # (B, 1, Tq, Tk)
    mod = mask.mask_mod(Tq, Tk, q_offset, device="cpu")
    assert torch.equal(create_mask(mod, B, 1, Tq, Tk, device="cpu"), dense)
    # the same mask_mod on broadcast index tensors (no vmap)
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    q = torch.arange(Tq).view(1, 1, Tq, 1)
    kv = torch.arange(Tk).view(1, 1, 1, Tk)
    assert torch.equal(mod(b, h, q, kv).expand(B, 1, Tq, Tk), dense)


@PROPS
@given(problems(), st.data())
def test_block_mask_covers_exactly_the_allowed_blocks(problem, data):
    B, Tq, Tk, align, q_offset = problem
    mask = data.draw(trees(B, Tq, Tk, align, q_offset))
    bq, bk = data.draw(st.sampled_from([(2, 2), (2, 4), (4, 2), (128, 128)]))
    bm = mask.block_mask(B, Tq, Tk, device="cpu", q_offset=q_offset, block_size=(bq, bk))
    assert bm.kv_num_blocks.device == torch.device("cpu") and bm.seq_lengths == (Tq, Tk)
    dense = mask.to_bool(B, Tq, Tk, q_offset)[:, 0]  # (B, Tq, Tk)
    nq, nk = -(-Tq // bq), -(-Tk // bk)
    padded = torch.zeros(B, nq * bq, nk * bk, dtype=torch.bool)
    padded[:, :Tq, :Tk] = dense
    inside = torch.zeros_like(padded)
    inside[:, :Tq, :Tk] = True
    blocks = padded.view(B, nq, bq, nk, bk)
    any_allowed = blocks.any(dim=(2, 4))  # (B, nq, nk)
    all_allowed = (blocks | ~inside.view(B, nq, bq, nk, bk)).all(dim=(2, 4))  # out-of-range cells don't count
    computed = bm.to_dense()[:, 0, :nq, :nk].bool().expand(B, nq, nk)  # partial or full blocks
    full = _ordered_to_dense(bm.full_kv_num_blocks, bm.full_kv_indices, bm.full_kv_indices.shape[-1])
    full = full[:, 0, :nq, :nk].bool().expand(B, nq, nk)
    assert not (any_allowed & ~computed).any(), "a block with an allowed cell is skipped"
    assert not (full & ~all_allowed).any(), "a block called full has a blocked cell"
    assert bm.shape[0] == (1 if mask._batch_free() else B)


def test_block_mask_names_its_device_and_defaults_to_the_masks_own():
    mask = masks.causal() & masks.padding(lengths=[3, 5])
    assert mask.block_mask(2, 5, 5).kv_num_blocks.device == torch.device("cpu")  # never CUDA behind your back
    assert mask.block_mask(2, 5, 5, device=torch.device("cpu")).kv_num_blocks.device.type == "cpu"
    with pytest.raises(ValueError, match=r"key padding has batch size 2, expected 3"):
        mask.block_mask(3, 5, 5)


def test_mask_mod_without_lengths_assumes_square_and_says_what_it_needs():
    mod = masks.causal().mask_mod()
    assert create_mask(mod, 1, 1, 4, 4, device="cpu")[0, 0].equal(torch.ones(4, 4, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match=r"left key padding by lengths needs the padded length"):
        create_mask(masks.padding(lengths=[2], side="left").mask_mod(), 1, 1, 4, 4, device="cpu")
    with pytest.raises(ValueError, match=r"needs both q_len and kv_len, or neither"):
        masks.causal().mask_mod(3)
    with pytest.raises(ValueError, match=r"q_offset=2 with a bottom_right aligned mask"):
        masks.causal().mask_mod(3, 5, 2)


def test_mask_mod_is_what_flex_attention_needs():
    """A user hands an attnmask mask to their own FlexAttention call: same output as SDPA with the
    dense mask (eager FlexAttention; the compiled kernel is tested in tests/attention/test_flex.py)."""
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, Tq, Tk, D = 2, 2, 6, 9, 8
    mask = masks.causal() & masks.padding(lengths=[9, 5]) | masks.prefix_lm([2, 0])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for T in (Tq, Tk, Tk))
    block_mask = create_block_mask(mask.mask_mod(Tq, Tk), B, None, Tq, Tk, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex_attention(q, k, v, block_mask=block_mask)
    allowed = mask.to_bool(B, Tq, Tk)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
