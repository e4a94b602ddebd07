"""The Transformer of attnmask.model: masks in training, the loss over real tokens, options.

Equalities are checked in float64 so that "unchanged" means unchanged up to rounding, not up to
a loose float32 tolerance that could hide a leak.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from attnmask.data import IGNORE_INDEX
from attnmask.model import ModelConfig, Transformer, lm_loss
from tests.conftest import tiny_model

PAD = 0
V = 23


pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(arch: str, **overrides) -> Transformer:
    return tiny_model(arch, vocab=V, **{"ffn_dim": 64, "max_seq_len": 32, "dropout": 0.0, **overrides}).double()


def random_ids(B: int, T: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, V, (B, T), generator=gen)  # (B, T): no specials, so no accidental pads


def grads(model: Transformer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_and_grads(model, inp, labels, src=None):
    model.zero_grad()
    out = model(inp, src, labels=labels)
    out.loss.backward()
    return out.loss.detach(), grads(model)


ARCHS = ("decoder", "encoder_decoder")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "rotary"])
def test_padding_changes_neither_loss_nor_gradients(arch, positions):
    model = make_model(arch, positions=positions)
    inp = random_ids(2, 6, seed=1)  # (B, T)
    labels = random_ids(2, 6, seed=2)  # (B, T)
    inp[1, 4:], labels[1, 4:] = PAD, IGNORE_INDEX  # row 1 is shorter
    src = random_ids(2, 5, seed=3) if arch == "encoder_decoder" else None
    if src is not None:
        src[0, 3:] = PAD
    loss, g = loss_and_grads(model, inp, labels, src)

    extra = 3  # more padding on the right of every row, of decoder input and of the source
    inp_p = F.pad(inp, (0, extra), value=PAD)  # (B, T + 3)
    labels_p = F.pad(labels, (0, extra), value=IGNORE_INDEX)  # (B, T + 3)
    src_p = F.pad(src, (0, extra), value=PAD) if src is not None else None  # (B, S + 3)
    loss_p, g_p = loss_and_grads(model, inp_p, labels_p, src_p)

    assert_close(loss_p, loss)
    assert g.keys() == g_p.keys()
    for name in g:
        assert_close(g_p[name], g[name], msg=lambda m, name=name: f"gradient of {name}: {m}")


def test_padding_test_can_fail_without_the_padding_mask():
    """The same comparison with the key-padding mask dropped must see a difference."""
    model = make_model("decoder")
    inp = random_ids(1, 5, seed=4)
    labels = random_ids(1, 5, seed=5)
    ref = model(inp, labels=labels).loss
    padded = F.pad(inp, (2, 0), value=PAD)  # left padding: real tokens see the pads unless masked
    padded_labels = F.pad(labels, (2, 0), value=IGNORE_INDEX)
    from attnmask import masks

    unmasked = model.decode(padded, mask=masks.causal())  # look-ahead only, pads visible
    leaky, _ = lm_loss(unmasked, padded_labels)
    assert not torch.allclose(leaky, ref)


@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=12, deadline=None)
@given(j=st.integers(0, 7), seed=st.integers(0, 1000), positions=st.sampled_from(["sinusoidal", "learned", "rotary"]))
def test_perturbing_token_j_leaves_earlier_logits_unchanged(arch, j, seed, positions):
    model = make_model(arch, positions=positions, n_kv_heads=2)
    ids = random_ids(2, 8, seed=seed)  # (B, T)
    src = random_ids(2, 5, seed=seed + 1) if arch == "encoder_decoder" else None
    logits = model(ids, src).logits  # (B, T, V)
    changed = ids.clone()
    changed[:, j] = 4 + (changed[:, j] - 4 + 1) % (V - 4)  # another real token
    logits2 = model(changed, src).logits
    assert_close(logits2[:, :j], logits[:, :j])
    # and the change is visible from position j on (the test can fail)
    assert not torch.allclose(logits2[:, j:], logits[:, j:])


def test_lm_loss_averages_over_real_tokens_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7, dtype=torch.float64)
    labels = torch.tensor([[1, 2, 3, IGNORE_INDEX], [4, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]])
    loss, n = lm_loss(logits, labels)
    logp = logits.log_softmax(-1)
    real = [(0, 0, 1), (0, 1, 2), (0, 2, 3), (1, 0, 4)]
    expected = -sum(logp[b, t, y] for b, t, y in real) / len(real)  # seed 000, eq. 11
    assert n == 4
    assert_close(loss, expected)
    total, n_sum = lm_loss(logits, labels, reduction="sum")
    assert_close(total, expected * 4)
    assert n_sum == 4


def test_label_smoothing_matches_its_formula():
    torch.manual_seed(0)
    logits = torch.randn(1, 3, 5, dtype=torch.float64)
    labels = torch.tensor([[1, 4, IGNORE_INDEX]])
    eps = 0.1
    loss, _ = lm_loss(logits, labels, label_smoothing=eps)
    logp = logits.log_softmax(-1)[0, :2]  # (2, V): the real positions
    target = torch.full((2, 5), eps / 5, dtype=torch.float64)
    target[0, 1] += 1 - eps
    target[1, 4] += 1 - eps
    assert_close(loss, -(target * logp).sum(-1).mean())


def test_lm_loss_rejects_misaligned_labels():
    with pytest.raises(ValueError, match=r"logits \(1, 3, 5\) and labels \(1, 4\)"):
        lm_loss(torch.zeros(1, 3, 5), torch.zeros(1, 4, dtype=torch.long))


def test_encode_then_decode_equals_forward():
    model = make_model("encoder_decoder")
    src = random_ids(2, 6, seed=7)
    src[1, 4:] = PAD
    ids = random_ids(2, 5, seed=8)
    memory_mask = model.source_mask(src)
    memory = model.encode(src, memory_mask)  # (B, S, C)
    assert memory.shape == (2, 6, 32)
    assert_close(model.decode(ids, memory, memory_mask=memory_mask), model(ids, src).logits)


def test_source_padding_does_not_reach_the_decoder():
    """Changing the ids under source padding changes nothing (the encoder and cross-attention mask it)."""
    model = make_model("encoder_decoder")
    src = random_ids(2, 6, seed=9)
    src[:, 4:] = PAD
    ids = random_ids(2, 5, seed=10)
    ref = model(ids, src).logits
    # Pads are id 0; a different "padding" id under the mask would be visible, so compare against
    # an equally padded but longer source instead.
    longer = F.pad(src, (0, 4), value=PAD)
    assert_close(model(ids, longer).logits, ref)


# Every value of every option, and every pair of positions x (norm, placement, activation) values.
OPTION_SETS = [
    ("sinusoidal", "layernorm", "pre", "relu"),
    ("sinusoidal", "rmsnorm", "post", "swiglu"),
    ("learned", "layernorm", "post", "gelu"),
    ("learned", "rmsnorm", "pre", "swiglu"),
    ("rotary", "rmsnorm", "pre", "gelu"),
    ("rotary", "layernorm", "post", "relu"),
]


@pytest.mark.parametrize(("positions", "norm", "norm_position", "activation"), OPTION_SETS)
def test_every_option_combination_runs_and_learns_a_step(positions, norm, norm_position, activation):
    for arch in ARCHS:
        model = make_model(arch, positions=positions, norm=norm, norm_position=norm_position, activation=activation)
        model.train()
        ids = random_ids(2, 5, seed=11)
        src = random_ids(2, 4, seed=12) if arch == "encoder_decoder" else None
        out = model(ids, src, labels=ids)
        assert out.logits.shape == (2, 5, V)
        assert math.isfinite(out.loss.item())
        out.loss.backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_grouped_query_heads_and_tied_embeddings():
    model = make_model("encoder_decoder", n_heads=4, n_kv_heads=1)
    attn = model.layers[0].self_attn
    assert attn.k_proj.out_features == model.config.head_dim  # one key/value head
    assert model.lm_head.weight is model.embed.weight  # W_pred tied to the target embedding
    assert model.src_embed is model.embed  # shared vocabulary: one embedding
    untied = make_model("decoder", tie_embeddings=False)
    assert untied.lm_head.weight is not untied.embed.weight


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"positions": "alibi"}, r"positions='alibi', expected one of"),
        ({"n_heads": 4, "n_kv_heads": 3}, r"n_heads=4 must be a multiple of n_kv_heads=3"),
        ({"dim": 30, "n_heads": 4}, r"dim=30 must be divisible by n_heads=4"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ],
)
def test_config_errors_name_the_value_and_the_expectation(overrides, message):
    cfg = dict(vocab_size=V, dim=32, n_heads=4)
    cfg.update(overrides)
    with pytest.raises(ValueError, match=message):
        ModelConfig(**cfg)


def test_encoder_decoder_needs_a_source():
    model = make_model("encoder_decoder")
    with pytest.raises(ValueError, match="needs src_ids"):
        model(random_ids(1, 3, seed=0))


# ---------------------------------------------------------------------------------------------
# fuse_projections_: one q/k/v product and one gate/up product, same function
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activation", ["swiglu", "geglu_tanh"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_projections_compute_the_same_logits(arch, activation):
    import copy

    from attnmask import decode
    from attnmask.model import fuse_projections_

    model = make_model(arch, activation=activation, positions="rotary", n_kv_heads=2)
    fused = fuse_projections_(copy.deepcopy(model))
    keys = set(fused.state_dict())
    assert "layers.0.self_attn.qkv_proj.weight" in keys and "layers.0.mlp.gate_up_proj.weight" in keys
    assert not any(k.endswith(("self_attn.q_proj.weight", "mlp.gate_proj.weight")) for k in keys)
    inp = random_ids(2, 9, seed=1)
    src = random_ids(2, 7, seed=2) if arch == "encoder_decoder" else None
    assert_close(fused(inp, src).logits, model(inp, src).logits, rtol=0, atol=1e-12)  # float64
    kwargs = {"src": src} if src is not None else {"prompts": inp[:, :3].tolist()}
    assert decode.greedy(fused, max_new_tokens=12, eos_id=None, **kwargs) == decode.greedy(
        model, max_new_tokens=12, eos_id=None, **kwargs
    )
    if arch == "encoder_decoder":  # cross-attention keeps its own projections: it reads the encoder
        assert fused.layers[0].cross_attn.qkv_proj is None and fused.layers[0].cross_attn.k_proj is not None


def test_a_fused_attention_refuses_a_context():
    from attnmask.model import fuse_projections_

    model = fuse_projections_(make_model("decoder"))
    attn = model.layers[0].self_attn
    x = torch.randn(1, 3, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="fused"):
        attn(x, context=x)
    with pytest.raises(ValueError, match="fused"):
        attn.project_kv(x)
