"""Incremental decoding equals full recomputation (seed 000: the logits of decoded positions never
change, so their keys and values can be kept): the packed step over the paged cache, 100+ one-token
steps after a padded prefix, against the model's forward over the whole padded sequence, for every
position kind, decoder-only and encoder-decoder; the encoder's keys and values computed once; rows
reordered as beam search does; bfloat16 autocast."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnmask import decode, masks
from attnmask.data.tokenizer import SOS_ID
from attnmask.decode import step as decode_step
from attnmask.errors import UserError
from attnmask.model import Transformer
from tests.conftest import tiny_model

STEPS = 104  # tokens fed one at a time after the prefix
VOCAB = 40

pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(arch: str, positions: str = "sinusoidal", *, seed: int = 0) -> Transformer:
    """A small model whose logits are O(1), so a wrong mask would show up far above 1e-5.
    Grouped-query (2 of 4 heads): the cache stores Hkv heads. Id 0 is its pad."""
    model = tiny_model(arch, vocab=VOCAB, seed=seed, std=0.3, n_kv_heads=2, max_seq_len=128, positions=positions)
    assert model.config.pad_id == 0
    return model


def padded_prefix(side: str, B: int = 3, P: int = 6, seed: int = 1):
    """Ids ``(B, P)`` whose rows hold P, P-2, P-4 real tokens padded (id 0) on ``side``, and ``keep``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (B, P), generator=g)  # (B, P)
    lengths = torch.tensor([P - 2 * b for b in range(B)])  # (B,)
    cols = torch.arange(P)[None]  # (1, P)
    keep = cols >= P - lengths[:, None] if side == "left" else cols < lengths[:, None]  # (B, P)
    return ids.masked_fill(~keep, 0), keep


def positions_of(keep: torch.Tensor) -> torch.Tensor:
    """Each row counts positions from its first real token (pads get 0 or repeat the last)."""
    return (keep.cumsum(1) - 1).clamp(min=0)  # (B, T)


def fed_tokens(B: int, n: int = STEPS, seed: int = 3) -> torch.Tensor:
    return torch.randint(4, VOCAB, (B, n), generator=torch.Generator().manual_seed(seed))  # (B, n)


def packed_logits(model, fed: torch.Tensor, **inputs) -> torch.Tensor:
    """``decode.start`` on ``inputs``, then ``fed (B, n)`` one column a step through ``decode_step``:
    the first logits and every step's, ``(B, 1 + n, V)``."""
    with torch.inference_mode():
        state, first, _ = decode.start(model, max_new_tokens=fed.shape[1] + 1, **inputs)
        steps = [decode.decode_step(model, state, fed[:, t]) for t in range(fed.shape[1])]
        state.release()
    return torch.stack([first, *steps], dim=1)


def decoder_reference(model, prefix, keep, fed, *, padding: bool = True) -> torch.Tensor:
    """The forward over each padded row + ``fed``, at its last real prefix column and every fed
    column, ``(B, 1 + n, V)``; ``padding=False`` forgets the key padding (the control)."""
    ids = torch.cat([prefix, fed], dim=1)  # (B, P + n)
    keep = torch.cat([keep, torch.ones_like(fed, dtype=torch.bool)], dim=1)  # (B, P + n)
    mask = masks.causal() & masks.padding(keep=keep) if padding else masks.causal()
    with torch.no_grad():
        full = model.decode(ids, mask=mask, positions=positions_of(keep))  # (B, P + n, V)
    n_real = keep[:, : prefix.shape[1]].sum(1)  # (B,)
    rows = [full[b, keep[b].nonzero().squeeze(1)[n_real[b] - 1 :]] for b in range(ids.shape[0])]
    return torch.stack(rows)  # (B, 1 + n, V)


def source(side: str, B: int = 3):
    """Source ids ``(B, 7)`` padded on ``side`` and their key padding."""
    src, src_keep = padded_prefix(side, B=B, P=7, seed=2)
    return src, masks.padding(keep=src_keep)


def encoder_decoder_reference(model, src, src_mask, fed) -> torch.Tensor:
    """The forward over ``<sos>`` + ``fed`` with the encoder's output of ``src``: ``(B, 1 + n, V)``."""
    ids = torch.cat([torch.full((fed.shape[0], 1), SOS_ID), fed], dim=1)  # (B, 1 + n)
    with torch.no_grad():
        return model.decode(ids, model.encode(src, src_mask), memory_mask=src_mask, mask=masks.causal())


# ---------------------------------------------------------------------------------------------
# Parity: the packed step == full recomputation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "rotary"])
def test_decoder_steps_equal_full_recomputation(side, positions):
    model = make_model("decoder", positions)
    prefix, keep = padded_prefix(side)
    fed = fed_tokens(prefix.shape[0])
    # left-padded prompts may come as the padded tensor; right-padded ones as their real tokens
    prompts = prefix if side == "left" else [row[k].tolist() for row, k in zip(prefix, keep)]
    got = packed_logits(model, fed, prompts=prompts)
    want = decoder_reference(model, prefix, keep, fed)
    scale = float(want.abs().max())
    assert got.shape == (3, 1 + STEPS, VOCAB) and scale > 1.0  # O(1) logits: a few ulps of the largest is not trivial
    # float32 sums in another order (one query against the whole block): ~1e-5 of the largest logit
    torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "rotary"])
@pytest.mark.parametrize("rows", [True, False], ids=["rows-encoder", "general-encoder"])
def test_encoder_decoder_steps_equal_full_recomputation(monkeypatch, side, positions, rows):
    """The sources encoded row by row (the CPU's native path) or by the general forward (elsewhere: packed
    under a document mask, or padded): the same logits as the full forward, up to float32 rounding."""
    if not rows:
        monkeypatch.setattr(decode_step, "_rows_encoder", lambda model: False)
    model = make_model("encoder_decoder", positions)
    src, src_mask = source(side)
    fed = fed_tokens(src.shape[0])
    got = packed_logits(model, fed, src=src)
    want = encoder_decoder_reference(model, src, src_mask, fed)
    scale = float(want.abs().max())
    assert got.shape == (3, 1 + STEPS, VOCAB) and scale > 1.0
    torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=0)


def test_parity_check_catches_a_missing_padding_mask():
    """The comparison above can fail: a reference that forgets the key padding is far off."""
    model = make_model("decoder")
    prefix, keep = padded_prefix("left")
    fed = fed_tokens(prefix.shape[0], 8)
    got = packed_logits(model, fed, prompts=prefix)
    wrong = decoder_reference(model, prefix, keep, fed, padding=False)
    assert (got[1:] - wrong[1:]).abs().max() > 1e-2  # rows 1 and 2 are padded
    torch.testing.assert_close(got[0], wrong[0], atol=1e-4, rtol=0)  # row 0 has no pads


def test_logits_of_decoded_positions_never_change():
    """Seed 000: re-running the growing sequence leaves every earlier position's logits unchanged."""
    model = make_model("decoder")
    prefix, keep = padded_prefix("left")
    ids = torch.cat([prefix, fed_tokens(3, 40)], dim=1)  # (B, 46)
    keep = torch.cat([keep, torch.ones(3, 40, dtype=torch.bool)], dim=1)

    def full(t: int) -> torch.Tensor:
        with torch.no_grad():
            mask = masks.causal() & masks.padding(keep=keep[:, :t])
            return model.decode(ids[:, :t], mask=mask, positions=positions_of(keep[:, :t]))  # (B, t, V)

    previous = full(7)
    for t in range(8, 46):
        now = full(t)
        torch.testing.assert_close(now[:, : t - 1], previous, atol=1e-5, rtol=0)
        previous = now


def test_logits_would_change_without_the_look_ahead_mask():
    """Control for the test above: with a bidirectional mask, earlier logits do change."""
    model = make_model("decoder")
    ids = fed_tokens(3, 11)
    with torch.no_grad():
        short = model.decode(ids[:, :10], mask=masks.padding(keep=torch.ones(3, 10, dtype=torch.bool)))
        longer = model.decode(ids, mask=masks.padding(keep=torch.ones(3, 11, dtype=torch.bool)))
    assert (longer[:, :10] - short).abs().max() > 1e-2


@st.composite
def padded_batches(draw):
    """Rows of any real length, each padded on either side, then some one-token steps."""
    B = draw(st.integers(1, 4))
    P = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, P), min_size=B, max_size=B))
    left = draw(st.lists(st.booleans(), min_size=B, max_size=B))
    steps = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**16))
    return lengths, left, P, steps, seed


_MODELS = {}


@settings(max_examples=25, deadline=None)
@given(batch=padded_batches(), arch=st.sampled_from(["decoder", "encoder_decoder"]))
def test_steps_equal_full_recomputation_for_any_padding(batch, arch):
    lengths, left, P, steps, seed = batch
    model = _MODELS.setdefault(arch, make_model(arch, "rotary"))
    g = torch.Generator().manual_seed(seed)
    cols = torch.arange(P)[None]  # (1, P)
    n = torch.tensor(lengths)[:, None]  # (B, 1)
    keep = torch.where(torch.tensor(left)[:, None], cols >= P - n, cols < n)  # (B, P): pads on either side
    ids = torch.randint(4, VOCAB, keep.shape, generator=g).masked_fill(~keep, 0)  # (B, P)
    fed = torch.randint(4, VOCAB, (len(lengths), steps), generator=g)  # (B, steps)
    if model.is_encoder_decoder:
        got = packed_logits(model, fed, src=ids)  # a tensor source: its pads (id 0) are dropped
        want = encoder_decoder_reference(model, ids, masks.padding(keep=keep), fed)
    else:
        got = packed_logits(model, fed, prompts=[row[k].tolist() for row, k in zip(ids, keep)])
        want = decoder_reference(model, ids, keep, fed)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# Sources, reordered rows, autocast
# ---------------------------------------------------------------------------------------------
def test_encoder_keys_values_are_computed_once_per_source():
    model = make_model("encoder_decoder")
    src, _ = source("right")
    calls = []
    for layer in model.layers:  # the source's keys: a hook sees each call of the product
        layer.cross_attn.k_proj.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[-2:]))
    packed_logits(model, fed_tokens(3, 5), src=src)
    # once per layer for all 3 sources, their real tokens packed in one row (no padding)
    assert calls == [(int((src != 0).sum()), model.config.dim)] * model.config.n_layers
    packed_logits(model, fed_tokens(3, 2), src=src)
    assert len(calls) == 2 * model.config.n_layers  # a new decoding run projects its sources again


def test_reordered_rows_decode_like_the_reordered_batch():
    """Beam search relies on this: a step after ``select`` == the permuted rows from scratch."""
    model = make_model("encoder_decoder", "rotary")
    src, src_mask = source("right")
    fed = fed_tokens(3, 6, seed=5)  # (B, 6)
    index = torch.tensor([2, 0, 2])
    with torch.inference_mode():
        state, _, _ = decode.start(model, src=src, max_new_tokens=8, beams=2)  # room for forked rows
        for t in range(5):
            decode.decode_step(model, state, fed[:, t])
        state.select(index)
        step = decode.decode_step(model, state, fed[index, 5])  # (3, V)
        state.release()
    keep = src_mask.keep[index]
    want = encoder_decoder_reference(model, src[index], masks.padding(keep=keep), fed[index])[:, -1]
    torch.testing.assert_close(step, want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"select index must hold rows in \[0, 3\), got \[0, 3\]"):
        state.select(torch.tensor([0, 3]))


def test_autocast_steps_follow_the_full_forward():
    """Training evaluation may decode under bfloat16 autocast: the steps follow the full forward there."""
    model = make_model("decoder", "rotary")
    prompt, fed = [[5, 6, 7]], torch.tensor([[8, 9, 10]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = packed_logits(model, fed, prompts=prompt)[0].float()  # (4, V)
        with torch.no_grad():
            full = model.decode(torch.tensor([[5, 6, 7, 8, 9, 10]]), mask=masks.causal())[0, 2:].float()
    assert full.dtype == torch.float32 and got.shape == full.shape
    torch.testing.assert_close(got, full, atol=0.1, rtol=0.05)


def test_a_source_longer_than_the_models_positions_is_refused_by_name():
    """The rows encoder checks positions as the general forward does: a clear error, not an index error."""
    model = tiny_model("encoder_decoder", max_seq_len=8)
    with pytest.raises(UserError, match="max_seq_len=8"):
        decode_step.SourceMemory.encode(model, torch.randint(4, 20, (2, 12)), None)
