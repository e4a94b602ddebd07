"""attnmask.masks: the seeds' matrices (golden), brute-force equivalence, algebra, converters."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from attnmask import masks

INF = float("-inf")
PROPS = settings(max_examples=60, deadline=None, derandomize=True)

# seed 004's vocabulary, <PAD> = 0
VOCAB = {"<PAD>": 0, "Hello": 1, "How": 2, "are": 3, "you": 4, "Good": 5, "morning": 6}


def ids(*sentences: str) -> torch.Tensor:
    return torch.tensor([[VOCAB[w] for w in s.split()] for s in sentences])  # (B, T)


# ---------------------------------------------------------------------------------------------
# The seeds' matrices, written literally
# ---------------------------------------------------------------------------------------------
def test_look_ahead_mask_4x4_is_seed_000():
    expected = torch.tensor(
        [
            [0.0, INF, INF, INF],
            [0.0, 0.0, INF, INF],
            [0.0, 0.0, 0.0, INF],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    assert_close(masks.causal().to_additive(1, 4, 4)[0, 0], expected, rtol=0, atol=0)
    assert_close(masks.causal("top_left").to_additive(1, 4, 4)[0, 0], expected, rtol=0, atol=0)


def test_padding_masks_of_seed_004():
    pad = masks.padding(token_ids=ids("Hello <PAD> <PAD>", "How are you"), pad_id=VOCAB["<PAD>"])
    got = pad.to_additive(2, 3, 3)  # (B, 1, Tq, Tk)
    hello = torch.tensor(
        [
            [0.0, INF, INF],
            [0.0, INF, INF],
            [0.0, INF, INF],
        ]
    )
    how_are_you = torch.tensor(
        [
            [0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0],
        ]
    )
    assert got.shape == (2, 1, 3, 3)
    assert_close(got[0, 0], hello, rtol=0, atol=0)
    assert_close(got[1, 0], how_are_you, rtol=0, atol=0)


def test_look_ahead_mask_for_how_are_you_is_seed_004():
    expected = torch.tensor(
        [
            [0.0, INF, INF],
            [0.0, 0.0, INF],
            [0.0, 0.0, 0.0],
        ]
    )
    assert_close(masks.causal().to_additive(1, 3, 3)[0, 0], expected, rtol=0, atol=0)


def test_m_total_for_good_morning_pad_is_seed_004():
    tokens = ids("Good morning <PAD>")
    m_pad = masks.padding(token_ids=tokens, pad_id=VOCAB["<PAD>"])
    m_look = masks.causal()
    pad_expected = torch.tensor(
        [
            [0.0, 0.0, INF],
            [0.0, 0.0, INF],
            [0.0, 0.0, INF],
        ]
    )
    total_expected = torch.tensor(
        [
            [0.0, INF, INF],
            [0.0, 0.0, INF],
            [0.0, 0.0, INF],
        ]
    )
    assert_close(m_pad.to_additive(1, 3, 3)[0, 0], pad_expected, rtol=0, atol=0)
    assert_close((m_look & m_pad).to_additive(1, 3, 3)[0, 0], total_expected, rtol=0, atol=0)
    # the seed's own construction: M_total = M_pad + M_look (additive, -inf + -inf = -inf)
    summed = m_pad.to_additive(1, 3, 3) + m_look.to_additive(1, 3, 3)
    assert_close(summed[0, 0], total_expected, rtol=0, atol=0)
    # the same mask from lengths, and as bool (True = may attend)
    from_lengths = masks.causal() & masks.padding(lengths=[2])
    assert from_lengths.to_bool(1, 3, 3)[0, 0].tolist() == [
        [True, False, False],
        [True, True, False],
        [True, True, False],
    ]


def test_to_additive_finite_uses_finfo_min_never_minus_1e9():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        add = masks.causal().to_additive(1, 2, 2, dtype, finite=True)
        assert add.dtype == dtype
        assert add[0, 0, 0, 1].item() == torch.finfo(dtype).min
        assert add[0, 0, 1, 0].item() == 0.0


# ---------------------------------------------------------------------------------------------
# Brute force: every structured mask equals a Python loop over its definition
# ---------------------------------------------------------------------------------------------
def start_of(align: str, Tq: int, Tk: int, q_offset: int) -> int:
    """Absolute position of query row 0, as the masks module documents it."""
    return Tk - Tq if align == "bottom_right" else q_offset


@st.composite
def problems(draw, need_queries_on_keys: bool = False):
    B = draw(st.integers(1, 3))
    Tk = draw(st.integers(1, 7))
    Tq = draw(st.integers(1, Tk if need_queries_on_keys else 7))
    align = draw(st.sampled_from(["bottom_right", "top_left"]))
    max_off = (Tk - Tq) if need_queries_on_keys else 4
    q_offset = draw(st.integers(0, max_off)) if align == "top_left" else 0
    return B, Tq, Tk, align, q_offset


def loop_mask(B, Tq, Tk, allowed) -> torch.Tensor:
    """Bool (B, 1, Tq, Tk) from a Python predicate allowed(b, i, j) over row/column indices."""
    return torch.tensor([[[[bool(allowed(b, i, j)) for j in range(Tk)] for i in range(Tq)]] for b in range(B)])


def lengths_st(B, n):
    return st.lists(st.integers(0, n), min_size=B, max_size=B)


@PROPS
@given(problems(), st.data())
def test_structured_masks_equal_brute_force(problem, data):
    B, Tq, Tk, align, q_offset = problem
    s = start_of(align, Tq, Tk, q_offset)
    size = data.draw(st.integers(1, 5))
    k_len = data.draw(lengths_st(B, Tk))
    q_len = data.draw(lengths_st(B, Tq))
    side = data.draw(st.sampled_from(["right", "left"]))
    prefix = data.draw(lengths_st(B, Tk))  # longer than the keys is an error (test_lint)
    keep = data.draw(st.lists(st.lists(st.booleans(), min_size=Tk, max_size=Tk), min_size=B, max_size=B))

    def key_real(b, j):
        return j < k_len[b] if side == "right" else j >= Tk - k_len[b]

    def query_real(b, i):
        return i < q_len[b] if side == "right" else i >= Tq - q_len[b]

    cases = {
        "causal": (masks.causal(align), lambda b, i, j: j <= s + i),
        "window": (masks.sliding_window(size, align), lambda b, i, j: s + i - size < j <= s + i),
        "prefix_lm": (masks.prefix_lm(prefix, align), lambda b, i, j: j <= s + i or j < prefix[b]),
        "padding": (
            masks.padding(lengths=k_len, side=side) & masks.causal(align),
            lambda b, i, j: key_real(b, j) and j <= s + i,
        ),
        "padding_keep": (
            masks.padding(keep=torch.tensor(keep)) & masks.causal(align),
            lambda b, i, j: keep[b][j] and j <= s + i,
        ),
        "query_padding": (
            masks.query_padding(lengths=q_len, side=side) & masks.causal(align),
            lambda b, i, j: query_real(b, i) and j <= s + i,
        ),
        "predicate": (
            masks.from_predicate(lambda b, h, q, kv: (q + 2 * kv + b) % 3 != 0, align),
            lambda b, i, j: (s + i + 2 * j + b) % 3 != 0,
        ),
    }
    for name, (mask, rule) in cases.items():
        got = mask.to_bool(B, Tq, Tk, q_offset)
        assert got.shape == (B, 1, Tq, Tk) and got.dtype == torch.bool, name
        assert_close(got, loop_mask(B, Tq, Tk, rule), msg=lambda m, n=name: f"{n}: {m}")


@PROPS
@given(problems(need_queries_on_keys=True), st.data())
def test_document_mask_equals_brute_force(problem, data):
    B, Tq, Tk, align, q_offset = problem
    s = start_of(align, Tq, Tk, q_offset)
    seg = data.draw(st.lists(st.lists(st.integers(0, 2), min_size=Tk, max_size=Tk), min_size=B, max_size=B))
    seg = [sorted(row) for row in seg]  # packed documents are contiguous runs
    mask = masks.document(torch.tensor(seg)) & masks.causal(align)
    expected = loop_mask(B, Tq, Tk, lambda b, i, j: seg[b][s + i] == seg[b][j] and j <= s + i)
    assert_close(mask.to_bool(B, Tq, Tk, q_offset), expected)


def test_document_mask_refuses_queries_off_the_keys():
    seg = torch.tensor([[0, 0, 1]])
    with pytest.raises(ValueError, match=r"queries sit at positions -1\.\.2 but segment_ids cover keys 0\.\.2"):
        masks.document(seg).to_bool(1, 4, 3, q_offset=0)  # bottom_right with Tq > Tk: positions -1..2
    with pytest.raises(ValueError, match=r"queries sit at positions 2\..3"):
        masks.document(seg).to_bool(1, 2, 3, q_offset=2)


@PROPS
@given(problems(need_queries_on_keys=True))  # Tq <= Tk: queries last means offset Tk - Tq >= 0
def test_top_left_with_offset_equals_bottom_right_when_queries_are_last(problem):
    B, Tq, Tk, _, _ = problem
    assert Tq <= Tk
    for make in (masks.causal, lambda a: masks.sliding_window(2, a), lambda a: masks.prefix_lm([1] * B, a)):
        assert_close(make("top_left").to_bool(B, Tq, Tk, q_offset=Tk - Tq), make("bottom_right").to_bool(B, Tq, Tk))


@PROPS
@given(problems(), st.data())
def test_padding_does_not_depend_on_positions(problem, data):
    B, Tq, Tk, _, q_offset = problem
    keep = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=Tk, max_size=Tk), min_size=B, max_size=B)))
    qkeep = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=Tq, max_size=Tq), min_size=B, max_size=B)))
    m = masks.padding(keep=keep) & masks.query_padding(keep=qkeep)
    expected = qkeep[:, None, :, None] & keep[:, None, None, :]  # (B, 1, Tq, Tk)
    assert_close(m.to_bool(B, Tq, Tk, q_offset), expected)
    # under a top_left causal mask with an offset the padding part is still indexed by row / column
    mc = m & masks.causal("top_left")
    causal = masks.causal("top_left").to_bool(B, Tq, Tk, q_offset)
    assert_close(mc.to_bool(B, Tq, Tk, q_offset), expected & causal)


def test_token_ids_padding_equals_keep_and_lengths():
    tokens = ids("Hello <PAD> <PAD>", "How are you", "Good morning <PAD>")
    by_ids = masks.padding(token_ids=tokens, pad_id=0).to_bool(3, 3, 3)
    by_keep = masks.padding(keep=tokens != 0).to_bool(3, 3, 3)
    by_lengths = masks.padding(lengths=[1, 3, 2]).to_bool(3, 3, 3)
    assert_close(by_ids, by_keep)
    assert_close(by_ids, by_lengths)


def test_left_padding_lengths():
    got = masks.padding(lengths=[1, 3], side="left").to_bool(2, 1, 3)[:, 0, 0]
    assert got.tolist() == [[False, False, True], [True, True, True]]


def test_bottom_right_cross_shape_has_empty_top_rows():
    # Tq > Tk, bottom-right: queries are positions Tk - Tq .. Tk - 1, the first ones see no key
    got = masks.causal().to_bool(1, 4, 2)[0, 0]
    assert got.tolist() == [[False, False], [False, False], [True, False], [True, True]]
    assert (
        masks.causal("top_left").to_bool(1, 4, 2)[0, 0].tolist() == [[True, False], [True, True]] + [[True, True]] * 2
    )


# ---------------------------------------------------------------------------------------------
# Algebra
# ---------------------------------------------------------------------------------------------
@st.composite
def mask_trees(draw, B, Tq, Tk, depth=3):
    """A random expression of &, |, ~ over leaves, all bottom_right (alignments may not mix)."""
    if depth == 0 or draw(st.booleans()):
        kind = draw(st.sampled_from(["causal", "window", "padding", "qpad", "tensor", "prefix"]))
        if kind == "causal":
            return masks.causal()
        if kind == "window":
            return masks.sliding_window(draw(st.integers(1, 4)))
        if kind == "padding":
            return masks.padding(lengths=draw(lengths_st(B, Tk)), side=draw(st.sampled_from(["left", "right"])))
        if kind == "qpad":
            return masks.query_padding(lengths=draw(lengths_st(B, Tq)))
        if kind == "prefix":
            return masks.prefix_lm(draw(lengths_st(B, Tk)))
        bits = draw(st.lists(st.booleans(), min_size=Tq * Tk, max_size=Tq * Tk))
        return masks.from_tensor(torch.tensor(bits).view(Tq, Tk))
    op = draw(st.sampled_from(["and", "or", "not"]))
    a = draw(mask_trees(B, Tq, Tk, depth - 1))
    if op == "not":
        return ~a
    b = draw(mask_trees(B, Tq, Tk, depth - 1))
    return a & b if op == "and" else a | b


def evaluate(tree, B, Tq, Tk) -> torch.Tensor:
    """Elementwise evaluation of the tree from its leaves' tensors (the algebra's specification)."""
    if isinstance(tree, masks.And):
        out = evaluate(tree.children[0], B, Tq, Tk)
        for c in tree.children[1:]:
            out = out & evaluate(c, B, Tq, Tk)
        return out
    if isinstance(tree, masks.Or):
        out = evaluate(tree.children[0], B, Tq, Tk)
        for c in tree.children[1:]:
            out = out | evaluate(c, B, Tq, Tk)
        return out
    if isinstance(tree, masks.Not):
        return ~evaluate(tree.children[0], B, Tq, Tk)
    return tree.to_bool(B, Tq, Tk)


@PROPS
@given(st.integers(1, 3), st.integers(1, 5), st.integers(1, 5), st.data())
def test_algebra_is_elementwise(B, Tq, Tk, data):
    tree = data.draw(mask_trees(B, Tq, Tk))
    assert_close(tree.to_bool(B, Tq, Tk), evaluate(tree, B, Tq, Tk))


def test_algebra_with_bool_tensors_on_either_side():
    t = torch.tensor([[True, False], [False, True]])
    c = masks.causal()
    assert_close((c & t).to_bool(1, 2, 2), (t & c).to_bool(1, 2, 2))
    assert (t & c).to_bool(1, 2, 2)[0, 0].tolist() == [[True, False], [False, True]]
    assert (t | c).to_bool(1, 2, 2)[0, 0].tolist() == [[True, False], [True, True]]
    assert (~c).to_bool(1, 2, 2)[0, 0].tolist() == [[False, True], [False, False]]


def test_parts_flattens_conjunctions_only():
    c, p, w = masks.causal(), masks.padding(lengths=[1]), masks.sliding_window(2)
    assert (c & p & w).parts() == [c, p, w]
    assert len((c | p).parts()) == 1


def test_spans_of_contiguous_padding():
    keep = torch.tensor([[True, True, False, False], [False, True, True, False], [False, False, False, False]])
    assert masks.padding(keep=keep).spans(3, 4) == ([0, 1, 0], [2, 3, 0])
    assert masks.padding(lengths=[2, 4], side="left").spans(2, 4) == ([2, 0], [4, 4])
    holes = torch.tensor([[True, False, True]])
    assert masks.padding(keep=holes).spans(1, 3) is None


# ---------------------------------------------------------------------------------------------
# Converters: foreign conventions in and out, round trips
# ---------------------------------------------------------------------------------------------
@st.composite
def any_mask(draw):
    B, Tq, Tk = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 5))
    return B, Tq, Tk, draw(mask_trees(B, Tq, Tk, depth=2))


@PROPS
@given(any_mask(), st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]), st.booleans())
def test_additive_round_trip(problem, dtype, finite):
    B, Tq, Tk, m = problem
    allowed = m.to_bool(B, Tq, Tk)
    additive = m.to_additive(B, Tq, Tk, dtype, finite=finite)
    assert additive.dtype == dtype
    blocked = torch.finfo(dtype).min if finite else float("-inf")
    expected = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, blocked)
    assert_close(additive, expected, rtol=0, atol=0)
    assert_close(masks.from_additive(additive, dtype).to_bool(B, Tq, Tk), allowed)


@PROPS
@given(any_mask(), st.integers(1, 3))
def test_mha_round_trip(problem, H):
    B, Tq, Tk, m = problem
    mha = masks.to_mha(m, B, Tq, Tk, H)
    assert mha.shape == (B * H, Tq, Tk)
    assert_close(mha.view(B, H, Tq, Tk), (~m.to_bool(B, Tq, Tk)).expand(B, H, Tq, Tk))  # True = ignore
    assert_close(masks.from_mha(mha, num_heads=H).to_bool(B, Tq, Tk), m.to_bool(B, Tq, Tk))
    additive_mha = torch.zeros(B * H, Tq, Tk).masked_fill(mha, float("-inf"))
    assert_close(masks.from_mha(additive_mha, num_heads=H).to_bool(B, Tq, Tk), m.to_bool(B, Tq, Tk))


def test_from_mha_key_padding_and_2d_mask():
    kpm = torch.tensor([[False, False, True], [False, True, True]])  # True = ignore
    attn = torch.triu(torch.ones(3, 3, dtype=torch.bool), diagonal=1)  # True = ignore (future)
    got = masks.from_mha(attn, kpm).to_bool(2, 3, 3)
    expected = (masks.causal() & masks.padding(lengths=[2, 1])).to_bool(2, 3, 3)
    assert_close(got, expected)
    float_kpm = torch.zeros(2, 3).masked_fill(kpm, float("-inf"))
    assert_close(
        masks.from_mha(key_padding_mask=float_kpm).to_bool(2, 3, 3), masks.padding(lengths=[2, 1]).to_bool(2, 3, 3)
    )


@PROPS
@given(st.integers(1, 4), st.integers(1, 6), st.data())
def test_hf_round_trip(B, T, data):
    hf = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 1), min_size=T, max_size=T), min_size=B, max_size=B)))
    m = masks.from_hf(hf)
    assert_close(masks.to_hf(m, B, T), hf)
    assert_close(m.to_bool(B, 2, T), hf.bool()[:, None, None, :].expand(B, 1, 2, T))
    lengths = data.draw(lengths_st(B, T))
    assert_close(
        masks.from_hf(masks.to_hf(masks.padding(lengths=lengths), B, T)).to_bool(B, T, T),
        masks.padding(lengths=lengths).to_bool(B, T, T),
    )


@PROPS
@given(any_mask())
def test_tf_round_trip(problem):
    B, Tq, Tk, m = problem
    tf = masks.to_tf(m, B, Tq, Tk)  # 1.0 = blocked
    assert tf.dtype == torch.float32 and tf.shape == (B, 1, Tq, Tk)
    assert_close(tf, (~m.to_bool(B, Tq, Tk)).float())
    assert_close(masks.from_tf(tf).to_bool(B, Tq, Tk), m.to_bool(B, Tq, Tk))


@PROPS
@given(st.integers(1, 4), st.integers(1, 6), st.data())
def test_tf_padding_round_trip(B, T, data):
    tf_pad = torch.tensor(
        data.draw(st.lists(st.lists(st.integers(0, 1), min_size=T, max_size=T), min_size=B, max_size=B))
    )
    m = masks.from_tf_padding(tf_pad)  # 1 = pad
    assert_close(m.to_bool(B, 3, T), (tf_pad == 0)[:, None, None, :].expand(B, 1, 3, T))
    assert_close(masks.to_tf(m, B, 1, T)[:, 0, 0, :], tf_pad.float())


def test_tf_tutorial_masks():
    # the TensorFlow tutorial: look-ahead 1 = blocked (T, T); padding (B, 1, 1, T) or (B, T), 1 = pad
    look_ahead = 1 - torch.tril(torch.ones(3, 3))
    assert_close(masks.from_tf(look_ahead).to_bool(1, 3, 3), masks.causal().to_bool(1, 3, 3))
    pad = torch.tensor([[0.0, 0.0, 1.0]])
    assert_close(masks.from_tf_padding(pad).to_bool(1, 3, 3), masks.padding(lengths=[2]).to_bool(1, 3, 3))
    assert_close(masks.from_tf(pad[:, None, None, :]).to_bool(1, 3, 3), masks.padding(lengths=[2]).to_bool(1, 3, 3))


def test_from_tensor_broadcasts_like_sdpa():
    keep = torch.tensor([[True, False], [True, True]])  # (B, Tk)
    m = masks.from_tensor(keep[:, None, None, :])  # (B, 1, 1, Tk)
    assert_close(m.to_bool(2, 3, 2), masks.padding(keep=keep).to_bool(2, 3, 2))


def test_document_with_query_segments_is_cross_attention_within_a_pair():
    """Packed cross-attention: target sentence k (queries) sees exactly source sentence k (keys)."""
    src_seg = torch.tensor([[0, 0, 0, 1, 1, 2, -1]])  # three sources and a padded tail
    tgt_seg = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, -1]])
    got = masks.document(src_seg, query_segment_ids=tgt_seg).to_bool(1, 9, 7)[0, 0]
    ref = tgt_seg[0].view(-1, 1) == src_seg[0].view(1, -1)
    assert torch.equal(got, ref)
    assert got[2].tolist() == [False, False, False, True, True, False, False]
    with pytest.raises(ValueError, match=r"query_segment_ids has shape \(1, 9\), expected \(B=1, Tq=4"):
        masks.document(src_seg, query_segment_ids=tgt_seg).to_bool(1, 4, 7)
