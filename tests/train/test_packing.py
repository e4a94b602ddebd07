"""Padding-free training: packed rows give the padded batch's loss and gradients, and train end to end.

A packed row holds several sentence pairs back to back; ``document`` masks keep them apart
(self-attention within a sentence, cross-attention from each target sentence to its own source)
and positions restart at every sentence. Compared in float64 against the same pairs as a padded,
length-bucketed batch, for every position encoding and both architectures.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.testing import assert_close

from attnmask.data import (
    IGNORE_INDEX,
    PAD_SEGMENT,
    PackingBatcher,
    TokenBucketBatcher,
    make_lm_batch,
    make_packed_translation_batch,
    make_translation_batch,
)
from attnmask.data.files import DataError
from attnmask.model import lm_loss, segment_positions
from attnmask.train import train
from attnmask.train.rundir import load_run
from attnmask.train.tasks import packs_on
from tests.conftest import tiny_model
from tests.train.test_loop import quiet, tiny

pytestmark = pytest.mark.usefixtures("one_thread")

PAD, SOS, EOS = 0, 1, 2


def random_pairs(n: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    src = [[rng.randrange(3, 24) for _ in range(rng.randrange(0, 9))] for _ in range(n)]
    tgt = [[rng.randrange(3, 24) for _ in range(rng.randrange(0, 9))] for _ in range(n)]
    return src, tgt


def loss_and_grads(model, *args, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed token loss and its gradients (the trainer divides by the global token count)."""
    model.zero_grad(set_to_none=True)
    labels = kwargs.pop("labels")
    logits = model(*args, **kwargs).logits
    loss, _ = lm_loss(logits, labels, reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("positions", ["rotary", "learned", "sinusoidal"])
def test_packed_translation_batch_gives_the_padded_loss_and_gradients(positions):
    model = tiny_model("encoder_decoder", positions=positions, std=0.5).double().train()  # dropout is 0
    src, tgt = random_pairs(7, seed=1)
    padded = make_translation_batch(src, tgt, pad_id=PAD, sos_id=SOS, eos_id=EOS)
    rows = [[0, 3, 5], [1, 2], [4, 6]]  # three rows of different lengths: a padded tail in two of them
    packed = make_packed_translation_batch(rows, src, tgt, pad_id=PAD, sos_id=SOS, eos_id=EOS)
    assert packed.num_tokens == padded.num_tokens
    assert (packed.segments == PAD_SEGMENT).any()  # the test covers a padded tail
    ref_loss, ref_grads = loss_and_grads(model, padded.tgt_in, padded.src, labels=padded.labels)
    loss, grads = loss_and_grads(
        model, packed.tgt_in, packed.src, labels=packed.labels, segments=packed.segments,
        src_segments=packed.src_segments,
    )  # fmt: skip
    assert_close(loss, ref_loss, rtol=1e-10, atol=1e-10)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert_close(grads[name], g, rtol=1e-8, atol=1e-10, msg=name)


def test_packed_documents_in_a_decoder_only_model_give_the_padded_loss_and_gradients():
    model = tiny_model("decoder", positions="rotary", std=0.5).double().train()
    docs = [[SOS, *d, EOS] for d in random_pairs(5, seed=2)[0]]
    padded = make_lm_batch(docs, pad_id=PAD)
    ref_loss, ref_grads = loss_and_grads(model, padded.input_ids, labels=padded.labels)
    # docs 0..2 in one row, 3..4 in another; each document's inputs are doc[:-1], its labels doc[1:]
    ids, labels, segs = [], [], []
    for row in ([0, 1, 2], [3, 4]):
        ids.append([t for k in row for t in docs[k][:-1]])
        labels.append([t for k in row for t in docs[k][1:]])
        segs.append([j for j, k in enumerate(row) for _ in docs[k][:-1]])
    T = max(map(len, ids))
    ids = torch.tensor([r + [PAD] * (T - len(r)) for r in ids])
    labels = torch.tensor([r + [IGNORE_INDEX] * (T - len(r)) for r in labels])
    segs = torch.tensor([r + [PAD_SEGMENT] * (T - len(r)) for r in segs])
    loss, grads = loss_and_grads(model, ids, labels=labels, segments=segs)
    assert_close(loss, ref_loss, rtol=1e-10, atol=1e-10)
    for name, g in ref_grads.items():
        assert_close(grads[name], g, rtol=1e-8, atol=1e-10, msg=name)


def test_a_pair_in_a_packed_row_is_blind_to_its_neighbours():
    """Changing one pair changes no other pair's logits: no attention across sentences."""
    model = tiny_model("encoder_decoder", std=0.5).double()
    src, tgt = random_pairs(3, seed=3)
    src[1], tgt[1] = [5, 6, 7], [8, 9]
    a = make_packed_translation_batch([[0, 1, 2]], src, tgt, pad_id=PAD, sos_id=SOS, eos_id=EOS)
    src[1], tgt[1] = [9, 9, 9], [4, 4]
    b = make_packed_translation_batch([[0, 1, 2]], src, tgt, pad_id=PAD, sos_id=SOS, eos_id=EOS)
    la = model(a.tgt_in, a.src, segments=a.segments, src_segments=a.src_segments).logits
    lb = model(b.tgt_in, b.src, segments=b.segments, src_segments=b.src_segments).logits
    others = a.segments[0] != 1
    assert_close(la[0, others], lb[0, others], rtol=0, atol=1e-12)
    assert not torch.allclose(la[0, ~others], lb[0, ~others])


def test_segment_positions_restart_at_every_segment():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 1, 1, 1, 1, 1, 1, 1]])
    assert segment_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]


def test_model_refuses_half_a_packing():
    model = tiny_model("encoder_decoder")
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="both segments"):
        model(ids, ids, segments=torch.zeros(1, 3, dtype=torch.long))


# --- the packing sampler -------------------------------------------------------------------------


def skewed_lengths(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = min(60, max(2, int(rng.lognormvariate(2.6, 0.45))))
        out.append((s, min(60, max(2, int(s * rng.uniform(0.7, 1.2))))))
    return out


def test_packing_batcher_places_every_example_once_within_its_rows():
    lengths = skewed_lengths(3000)
    sampler = PackingBatcher(lengths, 1024, row_tokens=128, seed=3)
    for epoch in (0, 1):
        batches = sampler.batches_for_epoch(epoch)
        seen = sorted(i for batch in batches for row in batch for i in row)
        assert seen == list(range(len(lengths)))
        for batch in batches:
            assert len(batch) <= 1024 // 128
            for row in batch:
                assert sum(lengths[i][0] for i in row) <= 128 and sum(lengths[i][1] for i in row) <= 128
    assert sampler.batches_for_epoch(0) != sampler.batches_for_epoch(1)  # reshuffled per epoch
    bucketed = TokenBucketBatcher(lengths, 1024, seed=3)
    assert sampler.padding_fraction() < 0.75 * bucketed.padding_fraction()  # 4.5% against 8.2% here


def test_packing_batcher_resumes_where_it_stopped_and_refuses_another_row_length():
    lengths = skewed_lengths(500)
    a = PackingBatcher(lengths, 512, row_tokens=64, seed=1)
    it = iter(a)
    [next(it) for _ in range(3)]
    state = a.state_dict()
    rest = [next(it) for _ in range(4)]
    b = PackingBatcher(lengths, 512, row_tokens=64, seed=1)
    b.load_state_dict(state)
    assert [x for x, _ in zip(iter(b), range(4))] == rest
    with pytest.raises(ValueError, match="row_tokens: saved 64, now 96"):
        PackingBatcher(lengths, 512, row_tokens=96, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="longer than a packed row of 8 tokens"):
        PackingBatcher(lengths, 512, row_tokens=8)


def test_batching_choice():
    assert not packs_on("auto", torch.device("cpu"))  # measured a wash on the CPU: padded buckets
    assert packs_on("pack", torch.device("cpu")) and not packs_on("pad", torch.device("cuda"))


# --- end to end -----------------------------------------------------------------------------------


def test_training_with_packed_batches_learns_and_saves_a_loadable_run(tmp_path):
    packed = train(tiny(tmp_path / "pack", batching="pack", pack_length=64, max_steps=30, dropout=0.0), log=quiet)
    padded = train(tiny(tmp_path / "pad", batching="pad", max_steps=30, dropout=0.0), log=quiet)
    assert packed.losses[-1] < 0.75 * packed.losses[0]  # 4.12 -> 2.74 when written
    assert abs(packed.losses[-1] - padded.losses[-1]) < 0.1 * padded.losses[0]  # the same task, as well learned
    run = load_run(tmp_path / "pack")
    assert run.config["train"]["data"]["batching"] == "pack"


# --- the compiled step ----------------------------------------------------------------------------


def test_rounding_lengths_keeps_the_loss():
    from attnmask.train.loop import round_lengths
    from attnmask.train.tasks import Batch

    model = tiny_model("encoder_decoder", std=0.5).double()
    src, tgt = random_pairs(4, seed=5)
    b = make_translation_batch(src, tgt, pad_id=PAD, sos_id=SOS, eos_id=EOS)
    batch = Batch(b.tgt_in, b.src, b.labels, 0.0, b.num_tokens)
    rounded = round_lengths(batch, 16, PAD)
    assert rounded.inputs.shape[1] == 16 and rounded.src.shape[1] == 16 and rounded.labels.shape[1] == 16
    loss = lm_loss(model(rounded.inputs, rounded.src).logits, rounded.labels, reduction="sum")[0]
    ref = lm_loss(model(batch.inputs, batch.src).logits, batch.labels, reduction="sum")[0]
    assert_close(loss, ref, rtol=1e-10, atol=1e-10)


def test_rounding_stops_at_the_position_tables_end():
    from attnmask.train.loop import round_lengths
    from attnmask.train.tasks import Batch

    model = tiny_model("encoder_decoder", std=0.5).double()
    src, tgt = random_pairs(4, seed=5)
    b = make_translation_batch(src, tgt, pad_id=PAD, sos_id=SOS, eos_id=EOS)
    batch = Batch(b.tgt_in, b.src, b.labels, 0.0, b.num_tokens)
    T, S = batch.inputs.shape[1], batch.src.shape[1]
    limit = max(T, S) + 1  # short of the next multiple of 128
    rounded = round_lengths(batch, 128, PAD, limit=limit)
    assert rounded.inputs.shape[1] == limit and rounded.src.shape[1] == limit
    assert round_lengths(batch, 128, PAD, limit=1).inputs.shape[1] == T  # never shorter than it was
    assert limit <= model.config.max_seq_len
    loss = lm_loss(model(rounded.inputs, rounded.src).logits, rounded.labels, reduction="sum")[0]
    ref = lm_loss(model(batch.inputs, batch.src).logits, batch.labels, reduction="sum")[0]
    assert_close(loss, ref, rtol=1e-10, atol=1e-10)


def test_off_the_cpu_lengths_round_to_flex_attentions_block():
    # packed rows end wherever their last conversation does: without rounding a GPU step would see a
    # new length (a FlexAttention kernel and BlockMask compile) almost every step
    from attnmask.train.loop import length_multiple

    assert length_multiple(torch.device("cpu"), compiled=False) == 0
    assert length_multiple(torch.device("cpu"), compiled=True) == 16
    assert length_multiple(torch.device("cuda"), compiled=False) == 128
    assert length_multiple(torch.device("cuda"), compiled=True) == 128


def test_a_compiler_that_fails_gives_one_notice_and_trains_eagerly(tmp_path, monkeypatch):
    def broken_compile(fn, *args, **kwargs):
        def call(*a, **k):
            raise RuntimeError("no C++ compiler found\nmore detail")

        return call

    monkeypatch.setattr(torch, "compile", broken_compile)
    lines = []
    result = train(tiny(tmp_path / "run", compile=True, max_steps=3), log=lines.append)
    assert result.step == 3
    notices = [line for line in lines if "torch.compile unavailable" in line]
    assert notices == ["attnmask: torch.compile unavailable, training without it (RuntimeError: no C++ compiler found)"]


@pytest.mark.slow
def test_compiled_training_gives_the_eager_losses(tmp_path):
    """--compile with inductor on the CPU: the same losses as eager, up to float32 rounding."""
    eager = train(tiny(tmp_path / "eager", max_steps=4, dropout=0.0, deterministic=False), log=quiet)
    lines = []
    compiled = train(tiny(tmp_path / "compiled", max_steps=4, dropout=0.0, deterministic=False, compile=True),
                     log=lines.append)  # fmt: skip
    assert not [line for line in lines if "unavailable" in line], lines
    assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), rtol=1e-4, atol=1e-4)
