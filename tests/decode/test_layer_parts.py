"""The packed step with per-layer windows and Gemma 3's optional layer parts, set by hand on a tiny
model (q/k norms over each head, norms of the sublayers' outputs, a rotary per layer, a gated MLP
whose activation is not SiLU): its logits are the model's own full forward, through the one-call step
and operation by operation. Beams share their prefix's cache blocks."""

from __future__ import annotations

import pytest
import torch

from attnmask import decode, masks, ops
from attnmask.decode import steps
from attnmask.decode.step import fused_plan
from attnmask.model import RMSNorm, Rotary, fuse_projections_
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [4, 5, 6, 7]]


def _model(**parts):
    model = fuse_projections_(
        tiny_model(
            "decoder", vocab=24, std=0.5, positions="rotary", n_kv_heads=2, norm="rmsnorm", activation="swiglu",
            max_seq_len=64, sliding_window=parts.pop("window", 0), tie_embeddings=False,
        )
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    D = model.config.head_dim
    with torch.no_grad():
        for layer in model.layers:
            if parts.get("qk_norm"):
                for name in ("q_norm", "k_norm"):
                    norm = RMSNorm(D)
                    norm.weight.copy_(1 + 0.5 * torch.randn(D, generator=g))
                    setattr(layer.self_attn, name, norm)
            if parts.get("post_norms"):
                for name in ("post_self_norm", "post_mlp_norm"):
                    norm = RMSNorm(model.config.dim)
                    norm.weight.copy_(1 + 0.5 * torch.randn(model.config.dim, generator=g))
                    setattr(layer, name, norm)
    if parts.get("gelu"):
        for layer in model.layers:
            layer.mlp.activation = "geglu_tanh"  # MLP.act: tanh-GELU
    return model


def _reference(model, row: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits at the new tokens, the parts computed as the definition says, layer by layer."""
    cfg = model.config
    ids = torch.tensor([row + tokens])
    T = ids.shape[1]
    x = model._embed(ids, torch.arange(T)[None], source=False)  # (1, T, C)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        h = layer.self_norm(x)
        q, k, v = attn.qkv_proj(h).split([H * D, Hkv * D, Hkv * D], -1)
        q, k, v = q.view(1, T, H, D), k.view(1, T, Hkv, D), v.view(1, T, Hkv, D)
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        rotary = model.layer_rotary(i) if hasattr(model, "layer_rotary") else model.rotary
        cos, sin = rotary.cos_sin(torch.arange(T)[None])  # (1, 1, T, D)
        q = Rotary.rotate(q.transpose(1, 2), cos, sin)  # (1, H, T, D)
        k = Rotary.rotate(k.transpose(1, 2), cos, sin).repeat_interleave(H // Hkv, 1)
        v = v.transpose(1, 2).repeat_interleave(H // Hkv, 1)
        mask = masks.causal()
        if cfg.layer_window(i):
            mask = mask & masks.sliding_window(cfg.layer_window(i))
        allowed = mask.to_bool(1, T, T)  # (1, 1, T, T)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        out = attn.o_proj(a.transpose(1, 2).reshape(1, T, H * D))
        post = getattr(layer, "post_self_norm", None)
        x = x + (post(out) if post is not None else out)
        gate, up = layer.mlp.gate_up_proj(layer.mlp_norm(x)).chunk(2, -1)
        act = getattr(layer.mlp, "act", torch.nn.functional.silu)
        out = layer.mlp.down_proj(act(gate) * up)
        post = getattr(layer, "post_mlp_norm", None)
        x = x + (post(out) if post is not None else out)
    return model.lm_head(model.norm(x))[0, len(row) - 1 :]  # (1 + len(tokens), V)


@pytest.mark.parametrize(
    "parts",
    [dict(qk_norm=True), dict(post_norms=True), dict(gelu=True), dict(window=3), dict(qk_norm=True, post_norms=True)],
    ids=["qk-norm", "post-norms", "gelu-gate", "window", "qk-and-post"],
)
@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "per-operation"])
def test_packed_step_computes_the_parts(parts, one_call, monkeypatch):
    model = _model(**parts)
    assert (fused_plan(model) is not None) == ops.available()  # the one-call step, where the kernels are built
    if not one_call:
        monkeypatch.setattr(steps, "fused_plan", lambda model: None)
    fed = torch.randint(4, 24, (len(PROMPTS), 4), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        state, first, _ = decode.start(model, prompts=PROMPTS, max_new_tokens=6)
        got = torch.stack([first] + [decode.decode_step(model, state, fed[:, t]) for t in range(4)], 1)
    for b, row in enumerate(PROMPTS):
        with torch.no_grad():
            want = _reference(model, row, fed[b].tolist())
        torch.testing.assert_close(got[b], want, atol=1e-5 * want.abs().max(), rtol=0)


def test_per_layer_windows_reach_each_layer():
    """A window on one layer of two (layer_types): not the window of every layer, nor none."""
    model = _model(window=2)
    model.config.layer_types = ("sliding", "full")
    assert [model.config.layer_window(i) for i in range(2)] == [2, 0]
    if ops.available():
        assert fused_plan(model).windows == [2, 0]  # one call, each layer its window
    fed = torch.randint(4, 24, (1, 3), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        state, first, _ = decode.start(model, prompts=PROMPTS[:1], max_new_tokens=4)
        got = torch.stack([first] + [decode.decode_step(model, state, fed[:, t]) for t in range(3)], 1)[0]
    with torch.no_grad():
        want = _reference(model, PROMPTS[0], fed[0].tolist())
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max(), rtol=0)


def test_beams_share_their_prefix_blocks():
    """Forked rows hold the prompt's blocks together; a write into a shared block copies it first, so
    the other holder's keys stay as they were."""
    model = _model()
    prompt = list(range(4, 22))  # 18 tokens: one full block of 16 and a partial one
    with torch.inference_mode():
        state, first, _ = decode.start(model, prompts=[prompt], max_new_tokens=4, beams=2)
        pool = state.cache.pool
        used = pool.used
        state.select(torch.tensor([0, 0]))  # two beams of one prompt
        rows = state.tables[0]  # the one layer group's table of each row
        assert pool.used == used and rows[0] == rows[1]
        assert all(pool.refs(b) == 2 for b in rows[0])
        a = decode.decode_step(model, state, torch.tensor([5, 9]))  # each beam writes position 18
        assert rows[0][0] == rows[1][0]  # the full block stays shared
        assert rows[0][1] != rows[1][1]  # the partial one was copied for one beam
        assert pool.used == used + 1
    with torch.no_grad():
        for r, t in enumerate([5, 9]):
            want = model.decode(torch.tensor([prompt + [t]]), mask=masks.causal())[0, -1]
            torch.testing.assert_close(a[r], want, atol=1e-5 * want.abs().max(), rtol=0)
