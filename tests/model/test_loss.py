"""head_loss: W_pred and the summed cross-entropy in chunks equal the logits' lm_loss, value and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import attnmask.linear as products
from attnmask.data.collate import IGNORE_INDEX
from attnmask.model import ModelConfig, Transformer, head_loss, lm_loss
from attnmask.model import loss as loss_module


def problem(dtype=torch.float64, bias=True, B=3, T=7, C=16, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, C, generator=g, dtype=dtype).requires_grad_()
    head = nn.Linear(C, V, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, C, generator=g, dtype=dtype))
        if bias:
            head.bias.copy_(torch.randn(V, generator=g, dtype=dtype))
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 5:] = IGNORE_INDEX  # a padded tail
    labels[2, 0] = IGNORE_INDEX
    return hidden, head, labels


def grads(loss, hidden, head):
    params = [hidden, head.weight] + ([head.bias] if head.bias is not None else [])
    return torch.autograd.grad(loss, params)


def deviation_from_cross_entropy(hidden, head, labels, smoothing) -> float:
    """head_loss against F.cross_entropy of the float64 logits: the largest difference, relative to
    the reference's largest magnitude, over the value and the gradients of a scaled loss (the loop
    scales it by world size / tokens)."""
    expected = F.cross_entropy(
        head(hidden).reshape(-1, head.out_features), labels.reshape(-1), ignore_index=IGNORE_INDEX,
        reduction="sum", label_smoothing=smoothing,
    )  # fmt: skip
    got = head_loss(hidden, head, labels, label_smoothing=smoothing)
    pairs = [(got, expected), *zip(grads(got * 0.37, hidden, head), grads(expected * 0.37, hidden, head))]
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in ((a.detach(), b.detach()) for a, b in pairs))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk_scores", [1 << 22, 50 * 4])  # one chunk; chunks of 4 rows and a remainder
def test_equals_cross_entropy_of_the_logits_in_float64(smoothing, bias, chunk_scores, monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_SCORES", chunk_scores)
    assert deviation_from_cross_entropy(*problem(bias=bias), smoothing) < 1e-12


def test_ignored_rows_get_no_gradient():
    hidden, head, labels = problem()
    (gh, *_) = grads(head_loss(hidden, head, labels), hidden, head)
    assert gh[0, 5:].abs().max() == 0 and gh[2, 0].abs().max() == 0
    assert gh[1].abs().min() > 0


@pytest.mark.parametrize("fast_bf16", [True, False])  # False: bfloat16 products through float32 ones
def test_under_bf16_autocast_it_matches_lm_loss_there(fast_bf16, monkeypatch):
    monkeypatch.setattr(products, "fast_bf16_products", lambda: fast_bf16)
    monkeypatch.setattr(loss_module, "CHUNK_SCORES", 300 * 8)  # several chunks: operands rounded once for all
    hidden, head, labels = problem(dtype=torch.float32, C=64, V=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = head_loss(hidden, head, labels, label_smoothing=0.1)
        expected, _ = lm_loss(head(hidden), labels, label_smoothing=0.1, reduction="sum")
    assert got.dtype == torch.float32
    assert_close(got, expected, rtol=2e-3, atol=1e-2)
    for a, b in zip(grads(got, hidden, head), grads(expected, hidden, head)):
        assert a.dtype == b.dtype
        assert_close(a, b, rtol=5e-2, atol=5e-2)


def test_the_model_loss_from_hidden_states_equals_the_one_from_logits():
    torch.manual_seed(0)
    cfg = ModelConfig(arch="decoder", vocab_size=40, dim=32, n_layers=1, n_heads=2, ffn_dim=64, dropout=0.0)
    model = Transformer(cfg).double()
    ids = torch.randint(3, 40, (2, 9))
    labels = ids.roll(-1, dims=1)
    labels[1, 6:] = IGNORE_INDEX
    full = model(ids, labels=labels, label_smoothing=0.1)
    hidden = model(ids, labels=labels, label_smoothing=0.1, return_hidden=True)
    assert hidden.logits is None and hidden.hidden.shape == (2, 9, 32)
    assert hidden.num_tokens == full.num_tokens == 15
    assert_close(hidden.loss, full.loss, rtol=1e-12, atol=1e-12)


def test_shapes_are_checked():
    hidden, head, labels = problem()
    with pytest.raises(ValueError, match=r"hidden \(3, 7, 16\) and labels \(3, 6\) disagree"):
        head_loss(hidden, head, labels[:, :6])


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_ignored_rows_kept_in_place_as_on_a_gpu_or_when_compiled(smoothing, monkeypatch):
    # where reading labels back would sync (GPU, torch.compile) the ignored rows stay, masked
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(loss_module, "CHUNK_SCORES", 50 * 5)
    assert deviation_from_cross_entropy(*problem(), smoothing) < 1e-12
