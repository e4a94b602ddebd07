"""The mask linter: every check a user can trip raises ValueError/TypeError naming what it got
and what it expected. One test per error path of masks.py and attention.py."""

from __future__ import annotations

import pytest
import torch

from attnmask import masks
from attnmask.attention import MultiHeadAttention, PreparedMask, attention, prepare_mask


def qkv(B=2, H=2, Hkv=2, Tq=3, Tk=3, D=4, dtype=torch.float32, device="cpu"):
    return (
        torch.randn(B, H, Tq, D, dtype=dtype, device=device),
        torch.randn(B, Hkv, Tk, D, dtype=dtype, device=device),
        torch.randn(B, Hkv, Tk, D, dtype=dtype, device=device),
    )


# ---------------------------------------------------------------------------------------------
# Shape
# ---------------------------------------------------------------------------------------------
def test_3d_mask_to_attention_is_ambiguous():
    mask = torch.ones(2, 3, 3, dtype=torch.bool)  # (N, L, S): per batch or per batch*head?
    with pytest.raises(
        ValueError, match=r"mask has 3-D shape \(2, 3, 3\): ambiguous\. Expected 4-D \(B=2, H=2 or 1, Tq=3, Tk=3\)"
    ):
        attention(*qkv(), mask)


def test_3d_mask_to_from_tensor_suggests_unsqueeze():
    with pytest.raises(ValueError, match=r"3-D shape \(2, 3, 3\).*t\.unsqueeze\(1\) -> \(2, 1, 3, 3\)"):
        masks.from_tensor(torch.ones(2, 3, 3, dtype=torch.bool))


def test_5d_mask_is_rejected():
    with pytest.raises(ValueError, match=r"mask has shape \(1, 1, 1, 3, 3\), expected 4-D"):
        attention(*qkv(), torch.ones(1, 1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask has shape \(3,\); expected 4-D \(B, 1\|H, Tq, Tk\) or 2-D"):
        masks.from_tensor(torch.ones(3, dtype=torch.bool))


def test_mask_with_wrong_batch_or_length_names_the_dimension():
    with pytest.raises(
        ValueError,
        match=r"mask has shape \(3, 1, 3, 3\), expected broadcastable to \(B=2, H=2 or 1, Tq=3, Tk=3\) \(B differs\)",
    ):
        attention(*qkv(), torch.ones(3, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(Tk differs\)"):
        attention(*qkv(), torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(H differs\)"):
        attention(*qkv(), torch.ones(2, 3, 3, 3, dtype=torch.bool))


def test_tensor_mask_wrong_shape_for_problem():
    m = masks.from_tensor(torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask has shape \(3, 4\), expected broadcastable to \(B=1, 1, Tq=3, Tk=3\)"):
        m.to_bool(1, 3, 3)


def test_per_head_tensor_cannot_become_a_shared_mask():
    with pytest.raises(ValueError, match=r"per-head shape \(1, 2, 3, 3\).*Pass per-head tensors straight to attention"):
        masks.from_tensor(torch.ones(1, 2, 3, 3, dtype=torch.bool))


def test_padding_of_wrong_batch():
    with pytest.raises(ValueError, match=r"key padding has batch size 3, expected 2"):
        attention(*qkv(), masks.padding(lengths=[1, 2, 3]))
    with pytest.raises(ValueError, match=r"query padding has batch size 3, expected 2"):
        masks.query_padding(lengths=[1, 2, 3]).to_bool(2, 3, 3)


def test_lengths_longer_than_the_sequence():
    with pytest.raises(ValueError, match=r"key padding lengths \[2, 5\] exceed the sequence length 3"):
        attention(*qkv(), masks.causal() & masks.padding(lengths=[2, 5]))
    with pytest.raises(ValueError, match=r"query padding lengths \[4, 1\] exceed the sequence length 3"):
        masks.query_padding(lengths=[4, 1]).to_bool(2, 3, 3)


def test_keep_of_wrong_length():
    with pytest.raises(ValueError, match=r"key padding keep has shape \(2, 4\), expected \(B=2, T=3\)"):
        masks.padding(keep=torch.ones(2, 4, dtype=torch.bool)).to_bool(2, 3, 3)


def test_keep_and_token_ids_must_be_2d():
    with pytest.raises(ValueError, match=r"keep must have shape \(B, T\), got \(3,\)"):
        masks.padding(keep=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"token_ids must have shape \(B, T\), got \(3,\)"):
        masks.padding(token_ids=torch.tensor([1, 2, 0]), pad_id=0)


def test_lengths_must_be_1d_nonnegative_integers():
    with pytest.raises(TypeError, match=r"lengths must be integers, got dtype torch.float32"):
        masks.padding(lengths=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"lengths must have shape \(B,\), got \(1, 2\)"):
        masks.padding(lengths=[[1, 2]])
    with pytest.raises(ValueError, match=r"lengths must be >= 0, got \[1, -1\]"):
        masks.padding(lengths=[1, -1])
    with pytest.raises(ValueError, match=r"prefix_lengths must be >= 0"):
        masks.prefix_lm([-2])


def test_padding_needs_exactly_one_source():
    with pytest.raises(ValueError, match=r"exactly one of lengths=.*got neither"):
        masks.padding()
    with pytest.raises(ValueError, match=r"exactly one of lengths=.*got both lengths= and keep="):
        masks.padding(lengths=[1], keep=torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"got token_ids= and lengths="):
        masks.padding(lengths=[1], token_ids=torch.ones(1, 1, dtype=torch.long), pad_id=0)
    with pytest.raises(ValueError, match=r"padding\(token_ids=\.\.\.\) needs pad_id="):
        masks.padding(token_ids=torch.ones(1, 1, dtype=torch.long))


def test_padding_side():
    with pytest.raises(ValueError, match=r"padding side must be 'right' or 'left', got 'top'"):
        masks.padding(lengths=[1], side="top")


def test_prefix_lengths_of_wrong_batch():
    with pytest.raises(ValueError, match=r"prefix_lengths has 3 rows, expected 2"):
        masks.prefix_lm([1, 1, 1]).to_bool(2, 3, 3)


def test_document_segment_ids():
    with pytest.raises(ValueError, match=r"segment_ids must be an integer tensor \(B, T\), got torch.float32 \(1, 3\)"):
        masks.document(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"segment_ids must be an integer tensor \(B, T\), got torch.int64 \(3,\)"):
        masks.document(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"segment_ids has shape \(1, 4\), expected \(B=1, Tk=3\) covering every key"):
        masks.document(torch.zeros(1, 4, dtype=torch.long)).to_bool(1, 3, 3)
    with pytest.raises(ValueError, match=r"queries sit at positions 3\.\.4 but segment_ids cover keys 0\.\.3"):
        masks.document(torch.zeros(1, 4, dtype=torch.long)).to_bool(1, 2, 4, q_offset=3)


def test_problem_sizes_and_offset():
    with pytest.raises(ValueError, match=r"q_len must be a non-negative int, got -1"):
        masks.causal().to_bool(1, -1, 3)
    with pytest.raises(ValueError, match=r"batch_size must be a non-negative int, got 2.0"):
        masks.causal().to_bool(2.0, 3, 3)
    with pytest.raises(ValueError, match=r"q_offset must be a non-negative int, got -2"):
        masks.causal("top_left").to_bool(1, 3, 3, q_offset=-2)


def test_predicate_returning_wrong_shape():
    m = masks.from_predicate(lambda b, h, q, kv: torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(
        ValueError, match=r"mask predicate returned shape \(5, 5\), expected broadcastable to \(B=1, 1, Tq=3, Tk=3\)"
    ):
        m.to_bool(1, 3, 3)


# ---------------------------------------------------------------------------------------------
# Alignment and windows
# ---------------------------------------------------------------------------------------------
def test_bad_align():
    with pytest.raises(ValueError, match=r"align must be one of \('bottom_right', 'top_left'\), got 'left'"):
        masks.causal(align="left")
    with pytest.raises(ValueError, match=r"got 'center'"):
        masks.sliding_window(2, align="center")
    with pytest.raises(ValueError, match=r"got 'x'"):
        masks.from_predicate(lambda b, h, q, kv: kv <= q, align="x")


def test_mixed_alignments():
    with pytest.raises(ValueError, match=r"combines bottom_right and top_left causal alignments; pick one"):
        (masks.causal("top_left") & masks.sliding_window(2)).to_bool(1, 2, 4)


def test_q_offset_with_bottom_right_mask():
    with pytest.raises(
        ValueError, match=r"q_offset=2 with a bottom_right aligned mask.*expected q_offset=0.*align='top_left'"
    ):
        attention(*qkv(Tq=2, Tk=5), masks.causal(), q_offset=2)


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_bad_window_size(size):
    with pytest.raises(ValueError, match=rf"sliding window size must be an int >= 1, got {size!r}"):
        masks.sliding_window(size)


# ---------------------------------------------------------------------------------------------
# Dtype and polarity
# ---------------------------------------------------------------------------------------------
def test_minus_1e9_in_a_float16_additive_mask():
    q, k, v = qkv(dtype=torch.float16)
    bad = torch.zeros(3, 3).masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), -1e9)
    with pytest.raises(
        ValueError, match=r"holds -1e\+09, which overflows torch.float16 \(min -65504\); use -inf or torch.finfo"
    ):
        attention(q, k, v, bad)
    with pytest.raises(ValueError, match=r"overflows torch.float16"):
        masks.check_additive(bad, torch.float16)
    with pytest.raises(ValueError, match=r"overflows torch.float16"):
        masks.from_additive(bad, torch.float16)
    # the same mask is fine for float32 scores
    assert attention(*qkv(), bad).isfinite().all()


def test_additive_mask_with_soft_values_or_nan():
    with pytest.raises(
        ValueError, match=r"additive mask holds -3: expected only 0 \(attend\) and -inf / finfo.min \(blocked\)"
    ):
        attention(*qkv(), torch.tensor([[0.0, -3.0, 0.0]] * 3))
    with pytest.raises(ValueError, match=r"additive mask contains NaN"):
        masks.from_additive(torch.tensor([[0.0, float("nan")]]))
    with pytest.raises(TypeError, match=r"additive mask must be a floating tensor of 0 / -inf, got torch.int64"):
        masks.check_additive(torch.zeros(2, 2, dtype=torch.long))


def test_float_0_1_mask_has_unknown_polarity():
    with pytest.raises(ValueError, match=r"holds only 0 and 1: a 0/1 mask of unknown polarity.*from_hf.*from_tf"):
        attention(*qkv(), torch.ones(3, 3).tril())


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.int32])
def test_integer_0_1_mask_has_unknown_polarity(dtype):
    t = torch.ones(3, 3, dtype=dtype).tril()
    with pytest.raises(
        TypeError, match=rf"mask is a 0/1 {dtype} tensor of unknown polarity; expected bool with True = may attend"
    ):
        attention(*qkv(), t)
    with pytest.raises(
        TypeError, match=r"unknown polarity.*masks.from_hf\(t\) if 1 = attend, masks.from_tf\(t\) if 1 = blocked"
    ):
        masks.from_tensor(t)


def test_other_integer_or_float_mask_dtypes():
    with pytest.raises(TypeError, match=r"mask has dtype torch.int64; expected bool \(True = may attend\)"):
        masks.from_tensor(torch.full((3, 3), 7))
    with pytest.raises(TypeError, match=r"mask has dtype torch.float32; attnmask masks are bool.*from_additive"):
        masks.from_tensor(torch.zeros(3, 3))
    with pytest.raises(TypeError, match=r"mask must be a torch.Tensor or attnmask Mask, got list"):
        masks.from_tensor([[True]])


def test_inverted_causal_mask_is_caught():
    mha_style = torch.ones(4, 4, dtype=torch.bool).triu(1)  # nn.MultiheadAttention: True = blocked
    with pytest.raises(
        ValueError, match=r"is True exactly above the diagonal: an inverted causal mask.*masks.from_mha"
    ):
        attention(*qkv(Tq=4, Tk=4), mha_style)
    with pytest.raises(ValueError, match=r"inverted causal mask"):
        masks.from_tensor(mha_style)
    # through the converter it is what it should be
    assert masks.from_mha(mha_style).to_bool(1, 4, 4)[0, 0].tolist() == torch.ones(4, 4).tril().bool().tolist()


def test_predicate_must_return_bool():
    m = masks.from_predicate(lambda b, h, q, kv: (kv <= q).int())
    with pytest.raises(TypeError, match=r"mask predicate must return a bool tensor, got torch.int32"):
        m.to_bool(1, 3, 3)
    with pytest.raises(TypeError, match=r"mask predicate must return a bool tensor, got bool"):
        masks.from_predicate(lambda b, h, q, kv: True).to_bool(1, 3, 3)
    with pytest.raises(TypeError, match=r"from_predicate needs a callable \(b, h, q_idx, kv_idx\) -> bool, got int"):
        masks.from_predicate(3)


def test_keep_must_be_bool():
    with pytest.raises(
        TypeError, match=r"keep must be a bool tensor \(True = real token\), got dtype torch.int64.*from_hf"
    ):
        masks.padding(keep=torch.ones(1, 3, dtype=torch.long))


def test_to_additive_needs_a_floating_dtype():
    with pytest.raises(TypeError, match=r"to_additive needs a floating dtype \(e.g. torch.float32\), got torch.int64"):
        masks.causal().to_additive(1, 2, 2, torch.int64)


def test_combining_with_something_that_is_not_a_mask():
    with pytest.raises(TypeError, match=r"cannot combine a mask with int; expected an attnmask Mask or bool tensor"):
        masks.causal() & 3


def test_mask_of_unknown_type():
    with pytest.raises(TypeError, match=r"mask must be None, an attnmask Mask, or a tensor .* got list"):
        attention(*qkv(), [[True]])


# ---------------------------------------------------------------------------------------------
# Device
# ---------------------------------------------------------------------------------------------
def test_mask_on_another_device():
    meta_mask = torch.ones(3, 3, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"mask is on meta but the queries are on cpu; move it with .to\(\)"):
        attention(*qkv(), meta_mask)
    with pytest.raises(ValueError, match=r"mask tensor is on meta but is needed on cpu \(the queries' device\)"):
        attention(*qkv(), masks.causal() & masks.from_tensor(meta_mask))


def test_qkv_on_different_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q, k, v devices differ: cpu, meta, cpu"):
        attention(q, k.to("meta"), v)


# ---------------------------------------------------------------------------------------------
# q, k, v and the call
# ---------------------------------------------------------------------------------------------
def test_qkv_must_be_4d_floating_tensors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q has shape \(2, 3, 4\), expected 4-D \(B, H, Tq, D\)"):
        attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"k has shape \(2, 3, 4\), expected 4-D \(B, Hkv, Tk, D\)"):
        attention(q, k[0], v)
    with pytest.raises(TypeError, match=r"q has dtype torch.int64, expected a floating dtype"):
        attention(q.long(), k, v)
    with pytest.raises(TypeError, match=r"v must be a tensor, got list"):
        attention(q, k, [1])


def test_mismatched_qkv_shapes():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k has shape \(2, 2, 3, 4\) but v has \(2, 2, 5, 4\); expected equal"):
        attention(q, k, torch.randn(2, 2, 5, 4))
    with pytest.raises(ValueError, match=r"q \(2, 2, 3, 8\) and k \(2, 2, 3, 4\) disagree on batch or head dim"):
        attention(torch.randn(2, 2, 3, 8), k, v)
    with pytest.raises(ValueError, match=r"q \(1, 2, 3, 4\) and k \(2, 2, 3, 4\) disagree on batch or head dim"):
        attention(q[:1], k, v)


def test_grouped_query_head_mismatch():
    with pytest.raises(ValueError, match=r"query heads H=3 must be a multiple of key/value heads Hkv=2"):
        attention(*qkv(H=3, Hkv=2))


def test_mixed_qkv_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"q, k, v dtypes differ: torch.float32, torch.float16, torch.float32"):
        attention(q, k.half(), v)


def test_unknown_backend():
    with pytest.raises(
        ValueError,
        match=r"unknown attention backend 'flash9'; expected one of \['auto', 'flex', 'math', 'reference', 'sdpa'",
    ):
        attention(*qkv(), backend="flash9")
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash9'"):
        MultiHeadAttention(dim=8, num_heads=2, backend="flash9")


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_blocks", "flex"])
def test_return_weights_needs_the_reference_kernel(backend):
    with pytest.raises(
        ValueError, match=rf"backend '{backend}' cannot return attention weights; use backend='reference'"
    ):
        attention(*qkv(), masks.causal(), backend=backend, return_weights=True)


@pytest.mark.parametrize("p", [-0.1, 1.0])
def test_dropout_out_of_range(p):
    with pytest.raises(ValueError, match=rf"dropout_p must be in \[0, 1\), got {p}"):
        attention(*qkv(), dropout_p=p)


def test_prepared_mask_for_another_problem():
    pm = prepare_mask(masks.causal(), 2, 2, 4, 4)
    with pytest.raises(ValueError, match=r"prepared mask is for \(Tq=4, Tk=4\), attention has \(3, 3\)"):
        attention(*qkv(), pm)
    with pytest.raises(ValueError, match=r"is_causal=True takes no allowed tensor"):
        PreparedMask(torch.ones(1, 1, 2, 2, dtype=torch.bool), is_causal=True)


def test_module_configuration_and_inputs():
    with pytest.raises(ValueError, match=r"num_heads=4 must be a multiple of num_kv_heads=3"):
        MultiHeadAttention(dim=8, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"dim=10 is not divisible by num_heads=4; pass head_dim explicitly"):
        MultiHeadAttention(dim=10, num_heads=4)
    assert MultiHeadAttention(dim=10, num_heads=4, head_dim=2).q_proj.out_features == 8
    with pytest.raises(ValueError, match=r"MultiHeadAttention num_heads must be an int >= 1, got 0"):
        MultiHeadAttention(dim=8, num_heads=0)
    mha = MultiHeadAttention(dim=8, num_heads=2)
    with pytest.raises(ValueError, match=r"x has shape \(2, 3, 6\), expected \(B, Tq, C=8\)"):
        mha(torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match=r"context has shape \(1, 5, 8\), expected \(B=2, Tk, C=8\)"):
        mha(torch.randn(2, 3, 8), context=torch.randn(1, 5, 8))


# ---------------------------------------------------------------------------------------------
# Converters
# ---------------------------------------------------------------------------------------------
def test_hf_mask_must_be_2d_0_1():
    with pytest.raises(
        ValueError, match=r"Hugging Face attention_mask must be 2-D \(B, T\) of 0/1, got shape \(1, 1, 3\)"
    ):
        masks.from_hf(torch.ones(1, 1, 3))
    with pytest.raises(ValueError, match=r"Hugging Face attention_mask must hold only 0/1, got 2"):
        masks.from_hf(torch.tensor([[1, 2]]))
    with pytest.raises(TypeError, match=r"to_hf converts key-padding masks only"):
        masks.to_hf(masks.causal(), 1, 3)


def test_tf_masks_must_be_0_1():
    with pytest.raises(ValueError, match=r"TensorFlow mask must hold only 0/1 \(1 = blocked\), got 0.5"):
        masks.from_tf(torch.tensor([[0.0, 0.5]]))
    with pytest.raises(ValueError, match=r"TensorFlow padding mask must be \(B, T\), got \(3,\)"):
        masks.from_tf_padding(torch.tensor([0, 0, 1]))


def test_mha_converter_errors():
    with pytest.raises(ValueError, match=r"from_mha needs attn_mask and/or key_padding_mask"):
        masks.from_mha()
    with pytest.raises(TypeError, match=r"attn_mask must be bool \(True = ignore\) or float additive, got torch.int64"):
        masks.from_mha(torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attn_mask has 3-D shape \(4, 3, 3\); .*pass num_heads="):
        masks.from_mha(torch.zeros(4, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask has 4 rows, expected a multiple of num_heads=3"):
        masks.from_mha(torch.zeros(4, 3, 3, dtype=torch.bool), num_heads=3)
    per_head = torch.zeros(2, 3, 3, dtype=torch.bool)
    per_head[1, 0, 0] = True
    with pytest.raises(ValueError, match=r"attn_mask differs between heads"):
        masks.from_mha(per_head, num_heads=2)
    with pytest.raises(
        ValueError, match=r"attn_mask has shape \(3,\), expected \(Tq, Tk\) or \(B\*num_heads, Tq, Tk\)"
    ):
        masks.from_mha(torch.zeros(3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"key_padding_mask must be bool \(True = ignore\) or float, got torch.int64"):
        masks.from_mha(key_padding_mask=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"num_heads must be an int >= 1, got 0"):
        masks.to_mha(masks.causal(), 1, 2, 2, 0)


def test_custom_mask_subclass_must_return_bool_of_at_most_4_dims():
    class IntMask(masks.Mask):
        def _eval(self, ctx, b, h, q, kv):
            return (kv <= q).long()

    with pytest.raises(TypeError, match=r"mask predicate must return a bool tensor, got torch.int64"):
        IntMask().to_bool(1, 2, 2)
    five_d = masks.from_predicate(lambda b, h, q, kv: (kv <= q)[None])
    with pytest.raises(ValueError, match=r"mask predicate returned shape \(1, 1, 1, 2, 2\), expected broadcastable"):
        five_d.to_bool(1, 2, 2)


def test_key_padding_mask_must_be_a_tensor():
    with pytest.raises(TypeError, match=r"key_padding_mask must be a tensor \(B, Tk\), got list"):
        masks.from_mha(key_padding_mask=[[True]])


# ---------------------------------------------------------------------------------------------
# Hardening (issue 16, item 7): silent wrong answers that the linter now catches
# ---------------------------------------------------------------------------------------------
def inverted_additive(T: int) -> torch.Tensor:
    """-inf where a causal mask allows (on and below the diagonal), 0 where it blocks: inverted."""
    return torch.zeros(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))


@pytest.mark.parametrize("blocked", [float("-inf"), torch.finfo(torch.float32).min])
def test_inverted_additive_mask_is_caught_like_the_bool_one(blocked):
    bad = inverted_additive(4).clamp_min(blocked)
    message = r"is 0 \(attend\) exactly above the diagonal and -inf \(blocked\) on and below it: an inverted causal"
    with pytest.raises(ValueError, match=message):
        attention(*qkv(Tq=4, Tk=4), bad)
    with pytest.raises(ValueError, match=message):
        masks.from_additive(bad)
    with pytest.raises(ValueError, match=message):
        masks.lint_polarity(bad)
    with pytest.raises(ValueError, match=message):
        attention(*qkv(B=1, Tq=4, Tk=4), bad[None, None])  # (1, 1, T, T)
    # the right polarity passes all three
    good = masks.causal().to_additive(1, 4, 4)[0, 0]
    assert masks.lint_polarity(good) is None
    assert masks.from_additive(good).to_bool(1, 4, 4).equal(masks.causal().to_bool(1, 4, 4))
    assert attention(*qkv(Tq=4, Tk=4), good).isfinite().all()


def test_lint_polarity_rejects_what_attention_rejects():
    zero_one = torch.ones(4, 4).tril()  # float 0/1: unknown polarity
    with pytest.raises(ValueError, match=r"holds only 0 and 1: a 0/1 mask of unknown polarity") as by_attention:
        attention(*qkv(Tq=4, Tk=4), zero_one)
    with pytest.raises(ValueError, match=r"holds only 0 and 1: a 0/1 mask of unknown polarity") as by_lint:
        masks.lint_polarity(zero_one)
    assert str(by_lint.value) == str(by_attention.value)
    with pytest.raises(ValueError, match=r"a soft bias is not a mask"):
        masks.lint_polarity(torch.full((4, 4), -3.0))
    with pytest.raises(TypeError, match=r"0/1 torch.int64 tensor of unknown polarity"):
        masks.lint_polarity(torch.ones(4, 4, dtype=torch.long).tril())
    assert masks.lint_polarity(torch.ones(4, 4, dtype=torch.bool).tril()) is None


def test_prefix_lm_longer_than_the_sequence_is_rejected():
    with pytest.raises(ValueError, match=r"prefix_lengths \[2, 7\] exceed the sequence length 5 \(the keys\)"):
        masks.prefix_lm([2, 7]).to_bool(2, 5, 5)
    with pytest.raises(ValueError, match=r"exceed the sequence length 5"):
        attention(*qkv(Tq=5, Tk=5), masks.prefix_lm([2, 7]))
    assert masks.prefix_lm([2, 5]).to_bool(2, 5, 5)[1, 0].all()  # the whole sequence is a prefix: fine


def test_prefix_lm_takes_a_plain_int_for_every_row():
    one = masks.prefix_lm(3)
    assert one.to_bool(2, 5, 5).equal(masks.prefix_lm([3, 3]).to_bool(2, 5, 5))
    with pytest.raises(ValueError, match=r"exceed the sequence length 2"):
        one.to_bool(1, 2, 2)
    with pytest.raises(TypeError, match=r"prefix_lengths must be integers, got dtype torch.float32"):
        masks.prefix_lm(3.0)
    # padding lengths are per row: a plain int says so instead of "got ()"
    with pytest.raises(ValueError, match=r"lengths must have shape \(B,\), got \(\) \(a plain int is not allowed"):
        masks.padding(lengths=3)
