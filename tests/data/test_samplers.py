"""Tests for attnmask.data.samplers: token-budget batches, rank shards, resumable samplers."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from attnmask.data import DataError
from attnmask.data.samplers import LMStream, TokenBucketBatcher, iter_eval_blocks, padding_fraction


def random_lengths(n: int, seed: int = 0, low: int = 1, high: int = 60) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


def random_pairs(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(2, 40), rng.randint(2, 40)) for _ in range(n)]


# --- TokenBucketBatcher: coverage and budget --------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=30), min_size=1, max_size=200),
    max_tokens=st.integers(min_value=30, max_value=300),
    chunk_size=st.integers(min_value=1, max_value=64),
    epoch=st.integers(min_value=0, max_value=3),
)
def test_every_index_once_within_budget(lengths, max_tokens, chunk_size, epoch):
    batcher = TokenBucketBatcher(lengths, max_tokens, seed=7, chunk_size=chunk_size)
    batches = batcher.batches_for_epoch(epoch)
    assert sorted(itertools.chain.from_iterable(batches)) == list(range(len(lengths)))
    for batch in batches:
        assert batch, "no empty batches"
        assert len(batch) * max(lengths[i] for i in batch) <= max_tokens


def test_budget_is_tight_literal():
    # 4 * 5 = 20 fits, 5 * 5 = 25 does not, whether the budget is 20 or 24.
    for max_tokens in (20, 24):
        batcher = TokenBucketBatcher([5] * 10, max_tokens, shuffle=False)
        assert batcher.batches_for_epoch(0) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert TokenBucketBatcher([5] * 10, 25, shuffle=False).batches_for_epoch(0) == [
        [0, 1, 2, 3, 4],
        [5, 6, 7, 8, 9],
    ]


def test_pairs_budget_bounds_both_sides():
    lengths = random_pairs(500)
    batcher = TokenBucketBatcher(lengths, 400, seed=1)
    batches = list(batcher)
    assert sorted(itertools.chain.from_iterable(batches)) == list(range(500))
    for batch in batches:
        assert len(batch) * max(lengths[i][0] for i in batch) <= 400
        assert len(batch) * max(lengths[i][1] for i in batch) <= 400


def test_max_sentences_caps_batch_size():
    batcher = TokenBucketBatcher([1] * 50, 1000, max_sentences=8)
    assert max(len(b) for b in batcher.batches_for_epoch(0)) == 8


def test_no_shuffle_sorts_globally_and_is_fixed():
    lengths = random_lengths(300)
    batcher = TokenBucketBatcher(lengths, 200, shuffle=False)
    flat = list(itertools.chain.from_iterable(batcher.batches_for_epoch(0)))
    assert [lengths[i] for i in flat] == sorted(lengths)
    assert batcher.batches_for_epoch(0) == batcher.batches_for_epoch(5)


def test_bucketing_reduces_padding():
    lengths = random_lengths(2000, seed=3)
    batcher = TokenBucketBatcher(lengths, 512, seed=0)
    bucketed = batcher.padding_fraction()
    # Same batch sizes, but random membership: what batching without sorting would pay.
    perm = list(range(len(lengths)))
    random.Random(0).shuffle(perm)
    sizes = [len(b) for b in batcher.batches_for_epoch(0)]
    unsorted, start = [], 0
    for size in sizes:
        unsorted.append(perm[start : start + size])
        start += size
    assert bucketed < 0.1 < padding_fraction(unsorted, lengths)


def test_padding_fraction_literal():
    assert padding_fraction([[0, 1]], [2, 4]) == pytest.approx(0.25)  # 6 real of 2 * 4 slots
    # Pairs: src slots 2 * 3, tgt slots 2 * 5; real 3 + 1 + 5 + 5 = 14 of 16.
    assert padding_fraction([[0, 1]], [(3, 5), (1, 5)]) == pytest.approx(2 / 16)


# --- determinism ------------------------------------------------------------------------------


def test_deterministic_per_seed_and_epoch():
    lengths = random_lengths(400)
    a = TokenBucketBatcher(lengths, 256, seed=11)
    b = TokenBucketBatcher(lengths, 256, seed=11)
    assert a.batches_for_epoch(0) == b.batches_for_epoch(0)
    assert a.batches_for_epoch(1) == b.batches_for_epoch(1)
    assert a.batches_for_epoch(0) != a.batches_for_epoch(1)
    assert TokenBucketBatcher(lengths, 256, seed=12).batches_for_epoch(0) != a.batches_for_epoch(0)


def test_iteration_advances_epochs():
    lengths = random_lengths(100)
    batcher = TokenBucketBatcher(lengths, 128, seed=2)
    first = list(batcher)
    second = list(batcher)
    assert first == batcher.batches_for_epoch(0)
    assert second == batcher.batches_for_epoch(1)
    assert batcher.epoch == 1


def test_set_epoch():
    batcher = TokenBucketBatcher(random_lengths(100), 128, seed=2)
    batcher.set_epoch(3)
    assert list(batcher) == batcher.batches_for_epoch(3)
    batcher.set_epoch(4)
    it = iter(batcher)
    taken = [next(it), next(it)]
    batcher.set_epoch(4)  # same epoch: keeps the position (a resumed loop may call this)
    assert taken + list(batcher) == batcher.batches_for_epoch(4)
    with pytest.raises(ValueError, match="epoch=-1"):
        batcher.set_epoch(-1)


# --- data-parallel shards ---------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_drop_remainder(world_size):
    lengths = random_lengths(500, seed=world_size)
    plan = TokenBucketBatcher(lengths, 200, seed=5).batches_for_epoch(2)
    shards = [
        TokenBucketBatcher(lengths, 200, seed=5, rank=r, world_size=world_size).batches_for_epoch(2)
        for r in range(world_size)
    ]
    assert len({len(s) for s in shards}) == 1, "every rank must get the same number of batches"
    seen = list(itertools.chain.from_iterable(itertools.chain.from_iterable(shards)))
    assert len(seen) == len(set(seen)), "shards must be disjoint"
    kept = plan[: len(plan) - len(plan) % world_size]
    assert sorted(seen) == sorted(itertools.chain.from_iterable(kept))


@pytest.mark.parametrize("world_size", [2, 3, 7])
def test_ranks_repeat_remainder_covers_everything(world_size):
    lengths = random_lengths(300, seed=world_size)
    shards = [
        TokenBucketBatcher(lengths, 150, seed=5, rank=r, world_size=world_size, remainder="repeat").batches_for_epoch(0)
        for r in range(world_size)
    ]
    assert len({len(s) for s in shards}) == 1
    seen = list(itertools.chain.from_iterable(itertools.chain.from_iterable(shards)))
    assert set(seen) == set(range(300))
    assert len(seen) - 300 < world_size * max(len(b) for s in shards for b in s)


def test_too_few_batches_for_ranks():
    batcher = TokenBucketBatcher([1, 1], 100, world_size=4, rank=0)
    with pytest.raises(DataError, match="only 1 batches for world_size=4 ranks"):
        list(batcher)
    repeat = TokenBucketBatcher([1, 1], 100, world_size=4, rank=3, remainder="repeat")
    assert list(repeat) == [[0, 1]]


# --- resume -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stop_after", [0, 1, 5, 13])
def test_state_dict_resume_continues_with_next_batch(stop_after):
    lengths = random_pairs(400, seed=9)
    reference = TokenBucketBatcher(lengths, 300, seed=3, rank=1, world_size=2)
    reference.set_epoch(2)
    expected = list(reference) + list(reference)  # epochs 2 and 3

    interrupted = TokenBucketBatcher(lengths, 300, seed=3, rank=1, world_size=2)
    interrupted.set_epoch(2)
    head = list(itertools.islice(iter(interrupted), stop_after))
    state = interrupted.state_dict()
    assert (state["epoch"], state["position"]) == (2, stop_after)

    resumed = TokenBucketBatcher(lengths, 300, seed=3, rank=1, world_size=2)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # a resumed loop calling set_epoch for its epoch must not restart it
    tail = list(resumed) + list(resumed)
    assert head + tail == expected


def test_resume_at_epoch_end_starts_next_epoch():
    lengths = random_lengths(120)
    batcher = TokenBucketBatcher(lengths, 100, seed=4)
    list(batcher)
    resumed = TokenBucketBatcher(lengths, 100, seed=4)
    resumed.load_state_dict(batcher.state_dict())
    assert list(resumed) == batcher.batches_for_epoch(1)


def test_load_state_dict_rejects_other_data():
    state = TokenBucketBatcher([5, 6, 7], 100, seed=0).state_dict()
    with pytest.raises(ValueError, match=r"seed: saved 0, now 1"):
        TokenBucketBatcher([5, 6, 7], 100, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"lengths_digest"):
        TokenBucketBatcher([5, 6, 8], 100, seed=0).load_state_dict(state)


# --- errors -----------------------------------------------------------------------------------


def test_example_longer_than_budget():
    with pytest.raises(DataError, match=r"example 2 has length 90, longer than max_tokens=64"):
        TokenBucketBatcher([3, 4, 90, 5], 64)
    with pytest.raises(DataError, match=r"example 1 has length 70, longer than max_tokens=64"):
        TokenBucketBatcher([(3, 4), (5, 70)], 64)


def test_bad_arguments():
    with pytest.raises(DataError, match=r"example 1 has length 0"):
        TokenBucketBatcher([3, 0], 64)
    with pytest.raises(DataError, match="no examples"):
        TokenBucketBatcher([], 64)
    with pytest.raises(ValueError, match=r"rank=2, world_size=2"):
        TokenBucketBatcher([3], 64, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"max_tokens=0"):
        TokenBucketBatcher([3], 0)
    with pytest.raises(ValueError, match=r"remainder='pad'"):
        TokenBucketBatcher([3], 64, remainder="pad")


# --- LMStream and evaluation blocks -----------------------------------------------------------


def test_lm_stream_blocks_are_shifted_slices():
    data = torch.arange(100, 200)
    stream = LMStream(data, block_size=8, batch_size=4, seed=0)
    x, y = stream.next_batch()
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.long
    for row_x, row_y in zip(x, y):
        start = int(row_x[0]) - 100
        assert_close(row_x, data[start : start + 8])
        assert_close(row_y, data[start + 1 : start + 9])


def test_lm_stream_reaches_the_last_token():
    # Smallest legal stream: only start 0 is possible, so y must end on the last token.
    stream = LMStream(torch.arange(5), block_size=4, batch_size=2, seed=0)
    x, y = stream.next_batch()
    assert_close(x, torch.tensor([[0, 1, 2, 3]] * 2))
    assert_close(y, torch.tensor([[1, 2, 3, 4]] * 2))


def test_lm_stream_resume_is_exact():
    data = torch.randint(0, 50, (1000,), generator=torch.Generator().manual_seed(0))
    reference = LMStream(data, block_size=16, batch_size=3, seed=42)
    expected = [reference.next_batch() for _ in range(6)]

    interrupted = LMStream(data, block_size=16, batch_size=3, seed=42)
    for _ in range(2):
        interrupted.next_batch()
    state = interrupted.state_dict()
    interrupted.next_batch()  # advancing after saving must not affect the saved state

    resumed = LMStream(data, block_size=16, batch_size=3, seed=42)
    resumed.load_state_dict(state)
    assert resumed.steps == 2
    for want, got in zip(expected[2:], itertools.islice(iter(resumed), 4)):
        assert_close(got[0], want[0])
        assert_close(got[1], want[1])
    other_seed = LMStream(data, block_size=16, batch_size=3, seed=43).next_batch()[0]
    assert not torch.equal(other_seed, expected[0][0])


def test_lm_stream_errors():
    with pytest.raises(ValueError, match=r"token stream has 8 tokens; expected more than block_size=8"):
        LMStream(torch.arange(8), block_size=8, batch_size=1)
    with pytest.raises(ValueError, match=r"expected a 1-D stream"):
        LMStream(torch.zeros(2, 10), block_size=4, batch_size=1)
    state = LMStream(torch.arange(50), block_size=4, batch_size=2).state_dict()
    with pytest.raises(ValueError, match=r"block_size=4, this stream has 5"):
        LMStream(torch.arange(50), block_size=5, batch_size=2).load_state_dict(state)


def test_iter_eval_blocks_literal():
    batches = list(iter_eval_blocks(torch.arange(10), block_size=3, batch_size=2))
    assert len(batches) == 2
    assert_close(batches[0][0], torch.tensor([[0, 1, 2], [3, 4, 5]]))
    assert_close(batches[0][1], torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert_close(batches[1][0], torch.tensor([[6, 7, 8]]))
    assert_close(batches[1][1], torch.tensor([[7, 8, 9]]))
    with pytest.raises(ValueError, match="longer than block_size=10"):
        list(iter_eval_blocks(torch.arange(10), block_size=10, batch_size=2))
