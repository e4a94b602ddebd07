"""The optional layer parts (Gemma 3's): per-layer windows, per-layer rotary, q/k norms, post-norms, tanh-GeGLU."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from attnmask import decode, masks
from attnmask.errors import UserError
from attnmask.model import ModelConfig, Transformer


def _config(**kw) -> ModelConfig:
    base = dict(
        vocab_size=50,
        dim=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        ffn_dim=48,
        positions="rotary",
        norm="rmsnorm",
        bias=False,
        pad_id=None,
        max_seq_len=64,
    )
    return ModelConfig(**{**base, **kw})


def _gemma_like(**kw) -> ModelConfig:
    return _config(
        activation="geglu_tanh",
        qk_norm=True,
        post_norms=True,
        embed_scale=True,
        sliding_window=3,
        layer_types=("sliding", "full", "sliding"),
        rope_theta=1e6,
        rope_local_theta=1e4,
        **kw,
    )


def _model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # norms away from 1 so that a skipped norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def test_the_parts_are_absent_by_default():
    model = _model(_config())
    layer = model.layers[0]
    assert layer.self_attn.q_norm is None and layer.self_attn.k_norm is None
    assert layer.post_self_norm is None and layer.post_mlp_norm is None
    assert all(model.layer_rotary(i) is model.rotary for i in range(3))
    assert not any("q_norm" in n or "post_" in n for n in model.state_dict())


def test_layer_rotary_uses_the_local_base_on_sliding_layers():
    model = _model(_gemma_like())
    assert model.layer_rotary(0) is model.local_rotary and model.layer_rotary(2) is model.local_rotary
    assert model.layer_rotary(1) is model.rotary
    torch.testing.assert_close(model.local_rotary.inv_freq[1], torch.tensor(1e4 ** (-2 / 8)))
    torch.testing.assert_close(model.rotary.inv_freq[1], torch.tensor(1e6 ** (-2 / 8)))


def test_layer_masks_are_causal_and_the_window_from_the_algebra():
    model = _model(_gemma_like())
    prepared = model.layer_masks(masks.causal(), 1, 6, 6, "cpu")
    assert prepared[0] is prepared[2] and prepared[0] is not prepared[1]
    window = (masks.causal() & masks.sliding_window(3)).to_bool(1, 6, 6)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 1, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(window, expected)


@pytest.mark.parametrize("layer_type", ["sliding", "full"])
def test_a_sliding_layer_does_not_reach_past_its_window(layer_type):
    cfg = _config(n_layers=1, sliding_window=3, layer_types=(layer_type,))
    model = _model(cfg)
    ids = torch.randint(0, 50, (1, 8))
    changed = ids.clone()
    changed[0, 0] = (ids[0, 0] + 1) % 50
    with torch.no_grad():
        diff = (model(ids).logits - model(changed).logits).abs().amax(-1)[0]  # (T,)
    assert diff[2] > 0  # position 2 sees position 0 either way
    if layer_type == "sliding":
        assert torch.all(diff[3:] == 0)  # positions 3.. see 1.. only
    else:
        assert torch.all(diff[3:] > 0)


def test_qk_norms_and_post_norms_change_the_function_where_set():
    cfg = _gemma_like()
    model = _model(cfg)
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
        for attr in ("q_norm", "post_self_norm", "post_mlp_norm"):
            holder = model.layers[1].self_attn if attr == "q_norm" else model.layers[1]
            getattr(holder, attr).weight.mul_(2.0)
            assert (model(ids).logits - ref).abs().max() > 1e-4, attr
            getattr(holder, attr).weight.div_(2.0)
        torch.testing.assert_close(model(ids).logits, ref)


def test_geglu_tanh_is_gelu_tanh_of_the_gate_times_up():
    model = _model(_gemma_like())
    mlp = model.layers[0].mlp
    x = torch.randn(3, 32)
    with torch.no_grad():
        expected = mlp.down_proj(F.gelu(mlp.gate_proj(x), approximate="tanh") * mlp.up_proj(x))
        torch.testing.assert_close(mlp(x), expected)


def test_decoding_steps_equal_the_full_forward_past_the_window():
    model = _model(_gemma_like(), seed=1)  # pad_id None: every id is a token
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits  # (B, T, V)
    with torch.inference_mode():  # the packed step over the paged cache: a 5-token prompt, then one token a step
        state, first, _ = decode.start(model, prompts=ids[:, :5], max_new_tokens=8)
        steps = [first] + [decode.decode_step(model, state, ids[:, t]) for t in range(5, 12)]
    torch.testing.assert_close(torch.stack(steps, dim=1), full[:, 4:], rtol=1e-5, atol=1e-5)


def test_config_checks_the_new_fields():
    with pytest.raises(UserError, match="post_norms"):
        _config(post_norms=True, norm_position="post")
    with pytest.raises(UserError, match="rope_local_theta"):
        _config(rope_local_theta=0.0)
    cfg = _gemma_like()
    assert [cfg.layer_rope_theta(i) for i in range(3)] == [1e4, 1e6, 1e4]
    assert ModelConfig.from_dict(cfg.to_dict()) == dataclasses.replace(cfg)
