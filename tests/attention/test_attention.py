"""attnmask.attention: every backend against a float64 reference, gradients, the module."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

from attnmask import attention as A
from attnmask import masks
from attnmask.attention import BACKENDS, MultiHeadAttention, attention, backends, prepare_mask

BACKEND_NAMES = ("reference", "math", "sdpa", "sdpa_blocks", "tiles", "auto")
HALF_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
PROPS = settings(max_examples=40, deadline=None, derandomize=True)


def reference_attention(q, k, v, allowed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(QKᵀ/√D + M) V in float64, written independently of the library.

    ``allowed`` is bool broadcastable to (B, H, Tq, Tk); rows with nothing allowed give zero.
    Returns (out (B, H, Tq, D), weights (B, H, Tq, Tk)).
    """
    q, k, v = q.double(), k.double(), v.double()
    B, H, Tq, D = q.shape
    groups = H // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # (B, H, Tk, D): query head h reads kv head h // groups
    v = v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, Tq, Tk)
    if allowed is None:
        allowed = torch.ones_like(scores, dtype=torch.bool)
    allowed = allowed.expand_as(scores)
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).clamp_min(-1e300)  # finite even for empty rows
    e = torch.exp(scores - row_max) * allowed
    denom = e.sum(dim=-1, keepdim=True)
    weights = torch.where(denom > 0, e / denom.clamp_min(1e-300), torch.zeros_like(e))
    return weights @ v, weights


def qkv(B, H, Hkv, Tq, Tk, D, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=g)  # (B, H, Tq, D)
    k = torch.randn(B, Hkv, Tk, D, generator=g)  # (B, Hkv, Tk, D)
    v = torch.randn(B, Hkv, Tk, D, generator=g)
    return tuple(t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v))


# ---------------------------------------------------------------------------------------------
# Random problems and masks
# ---------------------------------------------------------------------------------------------
@st.composite
def problems(draw):
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 3))  # grouped-query when H > Hkv
    B, Tq, Tk, D = (
        draw(st.integers(1, 3)),
        draw(st.integers(1, 7)),
        draw(st.integers(1, 7)),
        draw(st.sampled_from([4, 8])),
    )
    align = draw(st.sampled_from(["bottom_right", "top_left"]))
    q_offset = draw(st.integers(0, 3)) if align == "top_left" else 0
    return B, H, Hkv, Tq, Tk, D, align, q_offset


@st.composite
def mask_for(draw, B, H, Tq, Tk, align, q_offset):
    """A mask of one of the forms attention takes, with its expected bool (B, 1|H, Tq, Tk)."""
    lengths = st.lists(st.integers(0, Tk), min_size=B, max_size=B)
    side = draw(st.sampled_from(["right", "left"]))
    kind = draw(
        st.sampled_from(
            [
                "none",
                "causal",
                "causal_padding",
                "padding",
                "query_padding",
                "window",
                "prefix",
                "keep_holes",
                "document",
                "bool_tensor",
                "per_head",
                "additive",
            ]
        )
    )
    if kind == "none":
        return None
    if kind == "causal":
        m = masks.causal(align)
    elif kind == "causal_padding":
        m = masks.causal(align) & masks.padding(lengths=draw(lengths), side=side)
    elif kind == "padding":
        m = masks.padding(lengths=draw(lengths), side=side)
    elif kind == "query_padding":
        q_lengths = draw(st.lists(st.integers(0, Tq), min_size=B, max_size=B))
        m = (
            masks.causal(align)
            & masks.query_padding(lengths=q_lengths, side=side)
            & masks.padding(lengths=draw(lengths))
        )
    elif kind == "window":
        m = masks.sliding_window(draw(st.integers(1, 4)), align) & masks.padding(lengths=draw(lengths), side=side)
    elif kind == "prefix":
        m = masks.prefix_lm(draw(lengths), align)
    elif kind == "keep_holes":
        bits = draw(st.lists(st.booleans(), min_size=B * Tk, max_size=B * Tk))
        m = masks.causal(align) & masks.padding(keep=torch.tensor(bits).view(B, Tk))
    elif kind == "document":
        seg = torch.tensor(sorted(draw(st.lists(st.integers(0, 2), min_size=Tk, max_size=Tk))))
        start = Tk - Tq if align == "bottom_right" else q_offset
        if start < 0 or start + Tq > Tk:  # queries must sit on keys; tested in test_masks
            m = masks.causal(align)
        else:
            m = masks.document(seg.expand(B, Tk)) & masks.causal(align)
    else:
        heads = H if kind == "per_head" else 1
        bits = draw(st.lists(st.booleans(), min_size=B * heads * Tq * Tk, max_size=B * heads * Tq * Tk))
        t = torch.tensor(bits).view(B, heads, Tq, Tk)
        if kind == "additive":
            return torch.zeros(t.shape).masked_fill(~t, float("-inf"))
        return t
    return m


def expected_allowed(mask, B, Tq, Tk, q_offset):
    if mask is None:
        return None
    if isinstance(mask, masks.Mask):
        return mask.to_bool(B, Tq, Tk, q_offset)
    return mask == 0 if mask.dtype.is_floating_point else mask


def run(q, k, v, mask, backend, q_offset):
    # a top_left mask needs q_offset; any other input ignores it only when it is 0
    return attention(q, k, v, mask, backend=backend, q_offset=q_offset)


def uses_offset(mask) -> bool:
    return isinstance(mask, masks.Mask)


# ---------------------------------------------------------------------------------------------
# Every backend equals the float64 reference
# ---------------------------------------------------------------------------------------------
@PROPS
@given(problems(), st.data())
def test_every_backend_equals_float64_reference_float32(problem, data):
    B, H, Hkv, Tq, Tk, D, align, q_offset = problem
    mask = data.draw(mask_for(B, H, Tq, Tk, align, q_offset))
    q_offset = q_offset if uses_offset(mask) else 0
    q, k, v = qkv(B, H, Hkv, Tq, Tk, D, seed=data.draw(st.integers(0, 2**16)))
    ref, ref_w = reference_attention(q, k, v, expected_allowed(mask, B, Tq, Tk, q_offset))
    for backend in BACKEND_NAMES:
        out = run(q, k, v, mask, backend, q_offset)
        assert out.shape == (B, H, Tq, D) and out.dtype == torch.float32
        assert_close(out, ref.float(), rtol=1e-5, atol=1e-5, msg=lambda m, b=backend: f"backend {b}: {m}")
    out, w = attention(q, k, v, mask, backend="reference", q_offset=q_offset, return_weights=True)
    assert_close(w, ref_w.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("Tq", [9, 4], ids=["self", "cross"])
def test_half_types_equal_reference_with_empty_rows(dtype, backend, Tq):
    B, H, Hkv, Tk, D = 3, 4, 2, 9, 8  # grouped-query: 2 query heads per key/value head
    q, k, v = qkv(B, H, Hkv, Tq, Tk, D, dtype=dtype, seed=1)
    # batch row 2 has no real key: all of its query rows are empty; row 1 has 2 pad queries
    mask = masks.causal() & masks.padding(lengths=[9, 4, 0]) & masks.query_padding(lengths=[Tq, Tq - 2, Tq])
    allowed = mask.to_bool(B, Tq, Tk)
    ref, _ = reference_attention(q, k, v, allowed)
    out = attention(q, k, v, mask, backend=backend)
    assert out.dtype == dtype
    assert not out.isnan().any()
    tol = HALF_TOL[dtype]
    assert_close(out.double(), ref, rtol=tol, atol=tol)
    assert (out[2] == 0).all() and (out[1, :, Tq - 2 :] == 0).all()


@settings(max_examples=15, deadline=None, derandomize=True)
@given(problems(), st.sampled_from([torch.bfloat16, torch.float16]), st.data())
def test_every_backend_equals_float64_reference_half_types(problem, dtype, data):
    B, H, Hkv, Tq, Tk, D, align, q_offset = problem
    mask = data.draw(mask_for(B, H, Tq, Tk, align, q_offset))
    q_offset = q_offset if uses_offset(mask) else 0
    q, k, v = qkv(B, H, Hkv, Tq, Tk, D, dtype=dtype, seed=data.draw(st.integers(0, 2**16)))
    ref, _ = reference_attention(q, k, v, expected_allowed(mask, B, Tq, Tk, q_offset))
    tol = HALF_TOL[dtype]
    for backend in BACKEND_NAMES:
        out = run(q, k, v, mask, backend, q_offset)
        assert out.dtype == dtype and not out.isnan().any()
        assert_close(out.double(), ref, rtol=tol, atol=tol, msg=lambda m, b=backend: f"backend {b}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("kind", ["mask", "bool_tensor", "additive"])
def test_fully_masked_rows_give_zero_output_and_zero_gradient(dtype, backend, kind):
    B, H, Hkv, T, D = 2, 4, 2, 6, 8
    q, k, v = qkv(B, H, Hkv, T, T, D, dtype=dtype, seed=2, requires_grad=True)
    mask = masks.causal() & masks.padding(lengths=[6, 0]) & masks.query_padding(lengths=[4, 6])
    allowed = mask.to_bool(B, T, T)
    empty = ~allowed.any(dim=-1)  # (B, 1, Tq)
    given_mask = {
        "mask": mask,
        "bool_tensor": allowed.contiguous(),
        "additive": mask.to_additive(B, T, T, dtype),
    }[kind]
    out = attention(q, k, v, given_mask, backend=backend)
    assert not out.isnan().any()
    empty_rows = empty[:, 0]  # (B, Tq)
    assert (out.detach()[empty_rows.nonzero(as_tuple=True)[0], :, empty_rows.nonzero(as_tuple=True)[1]] == 0).all()
    # gradient that flows *from* the empty rows into q, k, v is exactly zero
    g = torch.randn(out.shape, dtype=dtype)
    (out * g * empty[:, :, :, None]).sum().backward(retain_graph=True)
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.grad is not None and not t.grad.isnan().any(), name
        assert (t.grad == 0).all(), f"{backend}: gradient w.r.t. {name} flows from fully masked rows"
    # and the empty rows' own queries get zero gradient from any loss
    for t in (q, k, v):
        t.grad = None
    (out * g).sum().backward()
    assert not any(t.grad.isnan().any() for t in (q, k, v))
    assert (q.grad[1] == 0).all() and (q.grad[0, :, 4:] == 0).all()


def test_every_row_empty_still_backpropagates_zero():
    q, k, v = qkv(1, 2, 2, 3, 3, 4, requires_grad=True)
    for backend in BACKEND_NAMES:
        out = attention(q, k, v, masks.padding(lengths=[0]), backend=backend)
        assert (out == 0).all()
        out.sum().backward()
        assert all((t.grad == 0).all() for t in (q, k, v))
        for t in (q, k, v):
            t.grad = None


# ---------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize(
    "mask",
    [
        masks.causal() & masks.padding(lengths=[5, 0]) & masks.query_padding(lengths=[3, 5]),
        masks.causal("top_left") & masks.padding(lengths=[4, 2], side="left"),
        masks.sliding_window(2) & masks.padding(lengths=[5, 1]),
    ],
    ids=["causal_padding_empty_rows", "top_left_left_padding", "window"],
)
def test_gradcheck_double(backend, mask):
    q, k, v = qkv(2, 2, 1, 5, 5, 3, dtype=torch.float64, seed=3, requires_grad=True)
    pm = prepare_mask(mask, 2, 2, 5, 5, q_offset=1 if "top_left" in repr(mask) else 0)  # built once

    def f(q, k, v):
        return attention(q, k, v, pm, backend=backend)

    # fast mode checks random vector-Jacobian products; the tiny full check is below
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-5, fast_mode=True)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_gradcheck_full_jacobian_with_empty_rows(backend):
    q, k, v = qkv(2, 2, 1, 3, 3, 2, dtype=torch.float64, seed=13, requires_grad=True)
    pm = prepare_mask(masks.causal() & masks.padding(lengths=[3, 0]) & masks.query_padding(lengths=[2, 3]), 2, 2, 3, 3)
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention(q, k, v, pm, backend=backend), (q, k, v), eps=1e-6, atol=1e-5
    )


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_gradcheck_cross_attention_decode_shape(backend):
    # Tq = 2 new tokens over Tk = 5 cached keys, bottom-right causal + padding (a decoding step)
    q, k, v = qkv(2, 2, 2, 2, 5, 3, dtype=torch.float64, seed=4, requires_grad=True)
    mask = masks.causal() & masks.padding(lengths=[5, 3], side="left")
    pm = prepare_mask(mask, 2, 2, 2, 5)
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention(q, k, v, pm, backend=backend), (q, k, v), eps=1e-6, atol=1e-5, fast_mode=True
    )


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_gradients_equal_reference_float32(backend):
    q, k, v = qkv(2, 4, 2, 6, 6, 8, seed=5, requires_grad=True)
    mask = masks.causal() & masks.padding(lengths=[6, 3])
    g = torch.randn(2, 4, 6, 8)
    (attention(q, k, v, mask, backend=backend) * g).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = reference_attention(q2, k2, v2, mask.to_bool(2, 6, 6))
    (ref * g.double()).sum().backward()
    for a, b in zip(got, (q2.grad, k2.grad, v2.grad)):
        assert_close(a, b.float(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# SDPA agreement, the causal fast path, the block plan
# ---------------------------------------------------------------------------------------------
@PROPS
@given(problems(), st.data())
def test_mask_equals_sdpa_with_its_materialized_bool_mask(problem, data):
    B, H, Hkv, Tq, Tk, D, align, q_offset = problem
    mask = data.draw(mask_for(B, H, Tq, Tk, align, q_offset))
    if not isinstance(mask, masks.Mask):
        return
    allowed = mask.to_bool(B, Tq, Tk, q_offset)
    if not allowed.any(dim=-1).all():  # SDPA itself gives NaN on empty rows; tested above
        return
    q, k, v = qkv(B, H, Hkv, Tq, Tk, D, seed=7)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=Hkv != H)
    for backend in ("sdpa", "sdpa_blocks", "auto"):
        assert_close(attention(q, k, v, mask, backend=backend, q_offset=q_offset), expected, rtol=1e-5, atol=1e-6)


class SDPASpy:
    """Records the keyword arguments of every F.scaled_dot_product_attention call."""

    def __init__(self, monkeypatch):
        self.calls: list[dict] = []
        real = F.scaled_dot_product_attention

        def spy(q, k, v, **kw):
            self.calls.append({"q": tuple(q.shape), "k": tuple(k.shape), **kw})
            return real(q, k, v, **kw)

        monkeypatch.setattr(backends.F, "scaled_dot_product_attention", spy)


@pytest.mark.parametrize(
    "mask, Tq, Tk, q_offset, fast",
    [
        (masks.causal(), 5, 5, 0, True),
        (masks.causal("top_left"), 5, 5, 0, True),
        (masks.causal() & masks.causal(), 5, 5, 0, True),
        (masks.causal(), 3, 5, 0, False),  # bottom-right with Tq < Tk is not SDPA's top-left
        (masks.causal("top_left"), 3, 5, 0, False),
        (masks.causal("top_left"), 5, 5, 2, False),  # query row 0 at position 2
        (masks.causal() & masks.padding(lengths=[5, 5]), 5, 5, 0, False),
        (masks.sliding_window(2), 5, 5, 0, False),
        (masks.causal() | masks.padding(lengths=[1, 2]), 5, 5, 0, False),
    ],
)
def test_is_causal_only_when_exactly_right(monkeypatch, mask, Tq, Tk, q_offset, fast):
    pm = prepare_mask(mask, 2, 2, Tq, Tk, q_offset=q_offset)
    assert pm.is_causal is fast
    spy = SDPASpy(monkeypatch)
    q, k, v = qkv(2, 2, 2, Tq, Tk, 4, seed=8)
    out = attention(q, k, v, mask, backend="sdpa", q_offset=q_offset)
    assert spy.calls[-1]["is_causal"] is fast
    assert (spy.calls[-1]["attn_mask"] is None) is fast
    ref, _ = reference_attention(q, k, v, mask.to_bool(2, Tq, Tk, q_offset))
    assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)


def test_auto_slices_padding_away_for_long_padded_batches(monkeypatch):
    B, H, T, D = 2, 2, 512, 8
    mask = masks.causal() & masks.padding(lengths=[512, 128])
    pm = prepare_mask(mask, B, H, T, T)
    # batch row 0: one causal block over everything; row 1: a causal 128 x 128 block, then the pad
    # queries 128.. see all 128 real keys
    assert sorted((b.rows, b.q0, b.q1, b.k0, b.k1, b.diag) for b in pm.blocks) == [
        ((0,), 0, 512, 0, 512, 0),
        ((1,), 0, 128, 0, 128, 0),
        ((1,), 128, 512, 0, 128, None),
    ]
    spy = SDPASpy(monkeypatch)
    q, k, v = qkv(B, H, H, T, T, D, seed=9)
    out = attention(q, k, v, pm, backend="auto")
    assert len(spy.calls) == 3 and all(c["attn_mask"] is None for c in spy.calls)
    assert_close(out, reference_attention(q, k, v, mask.to_bool(B, T, T))[0].float(), rtol=1e-5, atol=1e-5)


def test_auto_keeps_one_dense_call_for_short_sequences(monkeypatch):
    spy = SDPASpy(monkeypatch)
    q, k, v = qkv(4, 2, 2, 8, 8, 8, seed=10)
    attention(q, k, v, masks.causal() & masks.padding(lengths=[8, 6, 5, 2]), backend="auto")
    assert len(spy.calls) == 1 and spy.calls[0]["attn_mask"] is not None


def test_block_plan_with_partial_causal_block():
    # top_left causal with q_offset=2 and key padding: query row 0 sees keys 0..2 (diag 2)
    mask = masks.causal("top_left") & masks.padding(lengths=[6])
    pm = prepare_mask(mask, 1, 1, 3, 8, q_offset=2)
    assert [(b.q0, b.q1, b.k0, b.k1, b.diag) for b in pm.blocks] == [(0, 3, 0, 5, 2)]
    q, k, v = qkv(1, 1, 1, 3, 8, 4, seed=11)
    ref, _ = reference_attention(q, k, v, mask.to_bool(1, 3, 8, 2))
    assert_close(attention(q, k, v, mask, backend="sdpa_blocks", q_offset=2), ref.float(), rtol=1e-5, atol=1e-5)


def test_keep_with_holes_has_no_block_plan():
    keep = torch.tensor([[True, False, True]])
    assert prepare_mask(masks.causal() & masks.padding(keep=keep), 1, 1, 3, 3).blocks is None
    assert prepare_mask(masks.sliding_window(2), 1, 1, 3, 3).blocks is None


def test_prepared_mask_is_built_once_and_shared():
    mask = masks.causal() & masks.sliding_window(3)
    pm = prepare_mask(mask, 2, 2, 4, 4)
    first = pm.allowed
    assert first is pm.allowed and first.shape == (2, 1, 4, 4)
    q, k, v = qkv(2, 2, 2, 4, 4, 4)
    assert_close(attention(q, k, v, pm), attention(q, k, v, mask))


def test_reference_weights_follow_seed_000_normalization():
    # seed 000, eq. (6): the row of "good" normalizes over I, am, good only (future tokens add 0)
    q, k, v = qkv(1, 1, 1, 6, 6, 4, seed=12)
    _, w = attention(q, k, v, masks.causal(), backend="reference", return_weights=True)
    scores = (q @ k.transpose(-2, -1))[0, 0, 2] / 2.0  # row 2, scale 1/sqrt(4)
    expected = torch.cat([torch.softmax(scores[:3], dim=0), torch.zeros(3)])
    assert_close(w[0, 0, 2], expected)
    assert_close(w.sum(-1), torch.ones(1, 1, 6))


def test_auto_returns_weights_through_the_reference_kernel():
    q, k, v = qkv(1, 2, 2, 3, 3, 4)
    out, w = attention(q, k, v, masks.causal(), backend="auto", return_weights=True)
    assert w.shape == (1, 2, 3, 3) and (w.triu(1) == 0).all()
    assert_close(out, attention(q, k, v, masks.causal(), backend="reference"))


def test_register_backend_is_used_by_name():
    calls = []

    def custom(q, k, v, pm, *, scale, dropout_p, return_weights):
        calls.append(pm)
        return BACKENDS["reference"](q, k, v, pm, scale=scale, dropout_p=dropout_p, return_weights=return_weights)

    A.register_backend("custom_test", custom)
    try:
        q, k, v = qkv(1, 1, 1, 2, 2, 4)
        assert_close(attention(q, k, v, masks.causal(), backend="custom_test"), attention(q, k, v, masks.causal()))
        assert len(calls) == 1
    finally:
        del BACKENDS["custom_test"]


def test_dropout_only_changes_the_output_when_asked():
    q, k, v = qkv(1, 2, 2, 8, 8, 4)
    torch.manual_seed(0)
    for backend in BACKEND_NAMES:
        dropped = attention(q, k, v, masks.causal() & masks.padding(lengths=[0]), backend=backend, dropout_p=0.5)
        assert (dropped == 0).all()  # empty rows stay zero under dropout
        plain = attention(q, k, v, masks.causal(), backend=backend)
        assert not torch.allclose(attention(q, k, v, masks.causal(), backend=backend, dropout_p=0.5), plain)


# ---------------------------------------------------------------------------------------------
# The module: self-attention, cross-attention, GQA, hooks, nn.MultiheadAttention parity
# ---------------------------------------------------------------------------------------------
def test_module_matches_nn_multihead_attention_with_to_mha():
    torch.manual_seed(0)
    B, T, C, H = 2, 5, 16, 4
    ours = MultiHeadAttention(dim=C, num_heads=H, bias=False)
    theirs = nn.MultiheadAttention(C, H, bias=False, batch_first=True)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        theirs.out_proj.weight.copy_(ours.o_proj.weight)
    x = torch.randn(B, T, C)
    mask = masks.causal() & masks.padding(lengths=[5, 3])
    expected, _ = theirs(x, x, x, attn_mask=masks.to_mha(mask, B, T, T, H), need_weights=False)
    for backend in BACKEND_NAMES:
        ours.backend = backend
        assert_close(ours(x, mask=mask), expected, rtol=1e-5, atol=1e-5)


def test_module_cross_attention_with_encoder_padding():
    torch.manual_seed(0)
    B, Tq, S, C = 2, 3, 6, 16
    mha = MultiHeadAttention(dim=C, num_heads=4, num_kv_heads=2)
    x, memory = torch.randn(B, Tq, C), torch.randn(B, S, C)
    src_pad = masks.padding(lengths=[6, 2])  # cross-attention padding = key padding over the encoder
    out = mha(x, context=memory, mask=src_pad)
    assert out.shape == (B, Tq, C)
    k, v = mha.project_kv(memory)  # (B, Hkv, S, D): what decoding keeps of each source
    assert k.shape == v.shape == (B, 2, S, 4)
    q = mha.q_proj(x).view(B, Tq, 4, 4).transpose(1, 2)  # (B, H, Tq, D)
    assert_close(mha.o_proj(attention(q, k, v, src_pad).transpose(1, 2).reshape(B, Tq, C)), out)
    # padded encoder positions have no influence
    memory2 = memory.clone()
    memory2[1, 2:] = 100.0
    assert_close(mha(x, context=memory2, mask=src_pad)[1], out[1])


def test_module_rope_hook_is_applied_to_q_and_k():
    mha = MultiHeadAttention(dim=8, num_heads=2)
    x = torch.randn(1, 3, 8)
    seen = []

    def rope(q, k):
        seen.append((q.shape, k.shape))
        return q * 0, k  # zero queries: uniform weights over allowed keys

    out = mha(x, mask=masks.causal(), rope=rope)
    assert seen == [((1, 2, 3, 4), (1, 2, 3, 4))]
    v = mha.project_kv(x)[1]  # (1, 2, 3, 4)
    uniform = torch.tril(torch.ones(3, 3)) / torch.arange(1, 4)[:, None]
    expected = mha.o_proj((uniform @ v).transpose(1, 2).reshape(1, 3, 8))
    assert_close(out, expected)


def test_module_returns_weights():
    mha = MultiHeadAttention(dim=8, num_heads=2, backend="reference")
    out, w = mha(torch.randn(2, 3, 8), mask=masks.causal(), return_weights=True)
    assert out.shape == (2, 3, 8) and w.shape == (2, 2, 3, 3)


def test_tensor_masks_may_be_views():
    q, k, v = qkv(1, 2, 2, 4, 4, 4)
    lower = torch.ones(4, 4, dtype=torch.bool).triu().t()  # a transposed, non-contiguous view
    assert not lower.is_contiguous()
    assert_close(attention(q, k, v, lower), attention(q, k, v, masks.causal()))


# ---------------------------------------------------------------------------------------------
# A mask object reused across calls: prepared once while its tensors are unchanged
# ---------------------------------------------------------------------------------------------
def test_a_reused_mask_is_prepared_once_and_an_in_place_edit_is_seen():
    lengths = torch.tensor([4, 2])
    mask = masks.causal() & masks.padding(lengths=lengths)
    first = prepare_mask(mask, 2, 2, 4, 4)
    assert prepare_mask(mask, 2, 2, 4, 4).allowed is first.allowed  # same problem: reused
    assert prepare_mask(mask, 2, 2, 3, 4).allowed.shape == (2, 1, 3, 4)  # another problem: rebuilt
    lengths[1] = 3  # an in-place edit of the mask's tensor
    q, k, v = qkv(2, 2, 2, 4, 4, 4, seed=13)
    ref, _ = reference_attention(q, k, v, masks.causal().to_bool(2, 4, 4) & (torch.arange(4) < 3))
    assert_close(attention(q, k, v, mask)[1], ref[1].float(), rtol=1e-5, atol=1e-5)


def test_inference_tensors_are_prepared_without_a_version_counter():
    with torch.inference_mode():
        ids = torch.tensor([[3, 4, 0], [3, 0, 0]])
        mask = masks.causal() & masks.padding(token_ids=ids, pad_id=0)
        q, k, v = qkv(2, 2, 2, 3, 3, 4, seed=14)
        out = attention(q, k, v, mask)
        again = attention(q, k, v, mask)
        raw = attention(q, k, v, mask.to_bool(2, 3, 3))
    assert_close(again, out)
    assert_close(raw, out)


@pytest.mark.parametrize(
    "dtype, shape, grad, native, expected",  # shape: (B, H, Tq, Tk); native: the CPU multiplies bfloat16
    [
        (torch.bfloat16, (128, 4, 32, 32), True, True, True),  # bf16 training, short keys
        (torch.bfloat16, (128, 4, 32, 32), True, False, True),  # ... slow bf16: in float32, so math
        (torch.bfloat16, (128, 4, 32, 32), False, False, False),  # ... at inference: SDPA in bf16
        (torch.bfloat16, (8, 4, 256, 256), True, True, False),  # bf16 training, long keys: SDPA
        (torch.float32, (64, 8, 1, 32), False, False, True),  # a batch's one-token decoding step
        (torch.float32, (128, 4, 32, 32), True, False, True),  # float32 training, short keys
        (torch.float32, (32, 8, 96, 96), True, True, False),  # float32 training, longer keys: SDPA
        (torch.float32, (4, 4, 32, 32), True, True, False),  # float32 training, few problems: SDPA
        (torch.float32, (1, 9, 1, 200), False, True, False),  # one row's step: too few problems
    ],
)
def test_auto_takes_the_math_backend_for_many_short_problems_on_the_cpu(
    dtype, shape, grad, native, expected, monkeypatch
):
    """A rule on shapes, dtype and what the CPU can do (``avx512_bf16`` / ``amx_bf16``), never a clock."""
    import attnmask.linear as products

    monkeypatch.setattr(backends, "_native_bf16", lambda: native)
    monkeypatch.setattr(products, "fast_bf16_products", lambda: native)  # training there runs in float32
    calls = []
    original = backends._math

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(backends, "_math", counted)
    B, H, Tq, Tk = shape
    q = torch.randn(B, H, Tq, 16, dtype=dtype, requires_grad=grad)
    k, v = (torch.randn(B, H, Tk, 16, dtype=dtype, requires_grad=grad) for _ in range(2))
    mask = masks.causal() & masks.padding(
        lengths=torch.randint(1, Tk + 1, (B,), generator=torch.Generator().manual_seed(0))
    )
    with torch.set_grad_enabled(grad):
        out = attention(q, k, v, mask)  # causal aligned bottom-right: the queries are the last keys
    assert bool(calls) == expected
    ref = attention(q.double(), k.double(), v.double(), mask, backend="reference")
    assert_close(
        out.double(),
        ref,
        rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
        atol=2e-2 if dtype == torch.bfloat16 else 1e-5,
    )


@pytest.mark.parametrize("fast_bf16, grad, widened", [(False, True, True), (False, False, False), (True, True, False)])
def test_bfloat16_training_attention_runs_in_float32_where_the_cpus_bfloat16_is_slow(
    fast_bf16, grad, widened, monkeypatch
):
    """A rule on what the CPU can do (``linear.fast_bf16_products``), never a clock: with a backward
    pass and slow bfloat16 products, ``auto`` computes in float32 on the bfloat16 values."""
    import attnmask.linear as products

    monkeypatch.setattr(products, "fast_bf16_products", lambda: fast_bf16)
    # short bfloat16 rows take ``math`` on a CPU with native bfloat16 (``_native_bf16``, this CPU's
    # flags): not this test's subject, so every CPU goes on to the choice the widening decides
    monkeypatch.setattr(backends, "_math_suits", lambda *a: False)
    seen = []
    original = backends._cpu_choice
    monkeypatch.setattr(backends, "_cpu_choice", lambda q, *a: seen.append(q.dtype) or original(q, *a))
    q, k, v = qkv(3, 4, 2, 40, 40, 16, dtype=torch.bfloat16, seed=5, requires_grad=grad)
    mask = masks.causal() & masks.padding(lengths=[40, 31, 7])
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):  # as in training
        out = attention(q, k, v, mask)
    assert out.dtype == torch.bfloat16
    assert seen == [torch.float32 if widened else torch.bfloat16]
    if widened:  # bit for bit the float32 function of the same values, rounded once
        with torch.no_grad():
            assert torch.equal(out, attention(q.float(), k.float(), v.float(), mask).to(torch.bfloat16))
    ref = attention(q.double(), k.double(), v.double(), mask, backend="reference")
    assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    if grad:
        out.float().square().sum().backward()
        assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        attention(qd, kd, vd, mask, backend="reference").square().sum().backward()
        for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
            assert_close(got.double(), want, rtol=5e-2, atol=5e-2)
