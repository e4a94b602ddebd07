"""Padding-free chat batches: several conversations a row give the padded batch's loss and gradients.

Conversations are packed back to back, kept apart by ``causal() & document(segments)`` with
positions restarting per conversation; compared in float64 with one conversation a padded row, for
every attention backend, with labels only on some tokens (the assistant's).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.testing import assert_close

from attnmask.attention.backends import BACKENDS
from attnmask.data.chat import ChatExample
from attnmask.data.collate import IGNORE_INDEX, PAD_SEGMENT
from attnmask.data.packing import example_length, make_packed_lm_batch, make_padded_lm_batch
from attnmask.data.samplers import PackingBatcher
from attnmask.model import lm_loss
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def random_examples(n: int, seed: int = 0) -> list[ChatExample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randrange(2, 14)
        targets = [rng.random() < 0.5 for _ in range(length)]
        targets[-1] = True  # at least one target after the first token
        out.append(ChatExample([rng.randrange(3, 24) for _ in range(length)], targets))
    return out


def loss_and_grads(model, inputs, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    loss, _ = lm_loss(model(inputs, **kwargs).logits, labels, reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


BACKEND_NAMES = sorted(name for name in BACKENDS if name != "auto") + ["auto"]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_packed_chat_batch_gives_the_padded_loss_and_gradients(backend):
    model = tiny_model("decoder", positions="rotary", std=0.5, pad_id=None, attn_backend=backend)
    model = model.double().train()  # dropout is 0
    examples = random_examples(7, seed=3)
    inputs, labels, _ = make_padded_lm_batch(examples, pad_id=0)
    rows = [[0, 1, 2], [3, 4], [5, 6]]
    packed = make_packed_lm_batch(rows, examples, pad_id=0)
    assert packed.num_tokens == int((labels != IGNORE_INDEX).sum())
    assert packed.inputs.shape[0] == 3 and (packed.segments == PAD_SEGMENT).any()
    if backend == "flex":  # FlexAttention has no CPU backward: the forward loss alone
        with torch.no_grad():
            want, _ = lm_loss(model(inputs).logits, labels, reduction="sum")
            got, _ = lm_loss(model(packed.inputs, segments=packed.segments).logits, packed.labels, reduction="sum")
        assert_close(got, want, rtol=1e-8, atol=1e-10)
        return
    want, want_grads = loss_and_grads(model, inputs, labels)
    got, got_grads = loss_and_grads(model, packed.inputs, packed.labels, segments=packed.segments)
    assert_close(got, want, rtol=1e-8, atol=1e-10)
    assert want_grads.keys() == got_grads.keys()
    for name in want_grads:
        assert_close(got_grads[name], want_grads[name], rtol=1e-8, atol=1e-10, msg=name)


def test_packed_rows_keep_conversations_whole_and_pad_little():
    examples = random_examples(300, seed=5)
    lengths = [example_length(ex.ids) for ex in examples]
    batcher = PackingBatcher(lengths, 256, row_tokens=64, shuffle=True, seed=0)
    seen = sorted(i for batch in batcher.batches_for_epoch(0) for row in batch for i in row)
    assert seen == list(range(300))
    assert batcher.padding_fraction() <= 0.02
    batch = make_packed_lm_batch(batcher.batches_for_epoch(0)[0], examples, pad_id=0)
    assert batch.inputs.shape[1] <= 64
