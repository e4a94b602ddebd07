"""Gemma 3's step in one native call (``packed_step``): a tiny random Gemma 3 (q/k norms, post-sublayer
norms, a rotary base and a window on its sliding layers, a tanh-GELU gate, the embedding scaled, layers
in several groups of block tables), in float32 and in the GGUF block formats of the real file (Q5_0,
Q8_0, Q4_K, Q6_K), against the same step operation by operation from Python: the same logits up to
float32 rounding (the tanh-GELU is the one operation computed differently), the same greedy tokens, every
row's bits independent of the rows packed with it; and Gemma 3 270M itself where its file is installed."""

from __future__ import annotations

import math

import pytest
import torch

from attnmask import decode, masks, ops
from attnmask.decode import steps
from attnmask.decode.step import fused_plan, packed_forward
from attnmask.model import fuse_projections_
from attnmask.model.cache import PagedKVCache
from attnmask.ops import decoding
from attnmask.pretrained.quantized import BlockLinear
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15], [4, 5, 6, 7, 30, 31]]
V = 64


@pytest.fixture(autouse=True, scope="module")
def _built():
    if not ops.available():
        pytest.skip(f"no native build of the operators here: {ops.status().why}")


def _gemma(blocks: bool = False, seed: int = 0):
    """A tiny Gemma 3: 4 layers (sliding, sliding, full, sliding; window 3), 4 query heads over 1 key/value
    head of 64, norm weights away from 1. ``blocks``: every product in a block format as the real file
    mixes them (q/k Q5_0 and v Q8_0 fused into one 8-bit product, o Q4_K, gate/up Q5_0, down Q6_K or
    Q4_K, the head Q8_0), each scaled to weights of about 1 / sqrt(in_features)."""
    model = tiny_model(
        "decoder", vocab=V, seed=seed, std=0.05, dim=256, n_layers=4, n_heads=4, n_kv_heads=1, head_dim=64,
        ffn_dim=512, max_seq_len=64, positions="rotary", norm="rmsnorm", activation="geglu_tanh",
        sliding_window=3, layer_types=("sliding", "sliding", "full", "sliding"), rope_theta=1e6,
        rope_local_theta=1e4, qk_norm=True, post_norms=True, embed_scale=True, tie_embeddings=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    if blocks:
        from tests.ops.test_blocks import layer_of

        def block(kind: str, linear) -> BlockLinear:
            n, k = linear.weight.shape
            layer = layer_of(kind, n, k, seed=int(torch.randint(0, 10_000, (1,), generator=g)))
            with torch.no_grad():  # the same format, smaller values
                f = float(k**-0.5 / layer.dequantize().std())
                layer.d.mul_(f)
                if layer.m is not None:
                    layer.m.mul_(f)
            return layer

        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            attn.q_proj, attn.k_proj = block("Q5_0", attn.q_proj), block("Q5_0", attn.k_proj)
            attn.v_proj, attn.o_proj = block("Q8_0", attn.v_proj), block("Q4_K", attn.o_proj)
            mlp.gate_proj, mlp.up_proj = block("Q5_0", mlp.gate_proj), block("Q5_0", mlp.up_proj)
            mlp.down_proj = block("Q6_K" if i % 2 == 0 else "Q4_K", mlp.down_proj)
        model.lm_head = block("Q8_0", model.lm_head)
    return fuse_projections_(model)


def _decoded(model, fed: torch.Tensor) -> torch.Tensor:
    """Logits of the prefill of PROMPTS and of ``fed (B, T)`` decoded one token a step: ``(B, 1 + T, V)``."""
    with torch.inference_mode():
        state, first, _ = decode.start(model, prompts=PROMPTS, max_new_tokens=fed.shape[1] + 2)
        return torch.stack([first] + [decode.decode_step(model, state, fed[:, t]) for t in range(fed.shape[1])], 1)


def _greedy(model, n: int = 8) -> list[list[int]]:
    with torch.inference_mode():
        out = decode.greedy(model, prompts=PROMPTS, max_new_tokens=n, eos_id=None)
    return [list(map(int, row)) for row in out]


@pytest.mark.parametrize("blocks", [False, True], ids=["float32", "blocks"])
def test_gemma_step_is_one_call_with_the_per_operation_logits(blocks, monkeypatch):
    model = _gemma(blocks)
    plan = fused_plan(model)
    assert plan is not None and plan.activation == "gelu_tanh"
    assert plan.windows == [3, 3, 0, 3] and plan.layer_rope == [0, 0, 1, 0]  # the full layer: its own rotary
    if blocks:
        assert set(plan.kinds) == {decoding.NONE, decoding.Q4_1, decoding.Q8_0, decoding.Q6_K}
    fed = torch.randint(4, V, (len(PROMPTS), 5), generator=torch.Generator().manual_seed(2))
    calls = []
    real = decoding.packed_step
    monkeypatch.setattr(decoding, "packed_step", lambda *a: calls.append(1) or real(*a))
    whole = _decoded(model, fed)
    assert len(calls) == 1 + fed.shape[1]  # the prefill and each token: one native call
    tokens = _greedy(model)
    monkeypatch.setattr(steps, "fused_plan", lambda model: None)
    calls.clear()
    by_calls = _decoded(model, fed)
    assert not calls  # operation by operation from Python
    torch.testing.assert_close(whole, by_calls, atol=1e-5 * by_calls.abs().max(), rtol=0)
    assert _greedy(model) == tokens


def test_gemma_step_is_the_models_forward():
    """float32: every decoded position's logits are the model's full forward over the sequence (each layer's
    window and rotary as the mask algebra and the model say)."""
    model = _gemma()
    assert fused_plan(model) is not None  # the one native call is what decodes here
    fed = torch.randint(4, V, (len(PROMPTS), 5), generator=torch.Generator().manual_seed(3))
    got = _decoded(model, fed)
    assert all(bool(torch.isfinite(g).all()) for g in got)
    for b, row in enumerate(PROMPTS):
        with torch.no_grad():
            want = model.decode(torch.tensor([row + fed[b].tolist()]), mask=masks.causal())[0, len(row) - 1 :]
        torch.testing.assert_close(got[b], want, atol=2e-5 * want.abs().max(), rtol=0)


def test_gemma_step_is_its_definition_call_by_call(monkeypatch):
    """The operator's PyTorch definition (packed_step_reference) makes the calls the C++ makes."""
    model = _gemma(blocks=True)
    assert fused_plan(model) is not None
    fed = torch.randint(4, V, (len(PROMPTS), 3), generator=torch.Generator().manual_seed(4))
    whole = _decoded(model, fed)
    assert bool(torch.isfinite(whole).all())
    monkeypatch.setattr(decoding, "packed_step", decoding.packed_step_reference)
    torch.testing.assert_close(_decoded(model, fed), whole, atol=1e-5 * whole.abs().max(), rtol=0)


def _rows(model, seqs: list[list[int]], chunks: list[list[int]], S: int = 2) -> list[torch.Tensor]:
    """Feed ``seqs`` through packed steps over a cache with the model's window groups; step ``j`` takes
    ``chunks[j][s]`` more tokens of sequence ``s`` (0: none), packed in reverse order. Every row's logits,
    per sequence in position order."""
    cache = PagedKVCache.for_model(model, num_blocks=64, block_size=S, by_window=True)
    W = math.ceil(max(map(len, seqs)) / S)
    tables = [torch.zeros(len(seqs), W, dtype=torch.long) for _ in cache.groups]
    free = iter(range(1, 64))
    for t in tables:  # no block freed: every group's table covers every position
        for s, seq in enumerate(seqs):
            for j in range(math.ceil(len(seq) / S)):
                t[s, j] = next(free)
    plan = fused_plan(model)
    done, out = [0] * len(seqs), [[] for _ in seqs]
    for step in chunks:
        order = [s for s in reversed(range(len(seqs))) if step[s]]
        tokens = torch.cat([torch.tensor(seqs[s][done[s] : done[s] + step[s]]) for s in order])
        positions = torch.cat([torch.arange(done[s], done[s] + step[s]) for s in order])
        row_seq = torch.cat([torch.full((step[s],), s) for s in order])
        with torch.inference_mode():
            logits = packed_forward(model, cache, tokens, positions, row_seq, tables, torch.arange(len(tokens)), plan)
        at = 0
        for s in order:
            out[s].append(logits[at : at + step[s]])
            at += step[s]
            done[s] += step[s]
    return [torch.cat(o) for o in out]


@pytest.mark.parametrize("blocks", [False, True], ids=["float32", "blocks"])
def test_a_gemma_row_keeps_its_bits_in_any_pack_and_chunking(blocks):
    """A sequence alone in one step, or chunked and packed with two others at other offsets, past its
    sliding layers' window: its logits bit for bit."""
    model = _gemma(blocks)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(4, V, (n,), generator=g).tolist() for n in (9, 4, 7)]
    alone = _rows(model, seqs[:1], [[9]])[0]
    packed = _rows(model, seqs, [[3, 4, 2], [1, 0, 5], [5, 0, 0]])[0]
    assert torch.equal(alone, packed)
    one_by_one = _rows(model, seqs[:1], [[1]] * 9)[0]
    assert torch.equal(alone, one_by_one)


def test_packed_step_refuses_inconsistent_layer_lists():
    """Checked before any pointer is read: a k product without its v, a layer in a group without a table,
    a norm of the wrong width."""
    model = _gemma()
    plan = fused_plan(model)
    cache = PagedKVCache.for_model(model, num_blocks=4, block_size=4, by_window=True)
    x = torch.zeros(1, 256)
    tables = [torch.tensor([[1]]) for _ in cache.groups]
    one = torch.zeros(1, dtype=torch.long)

    def step(kinds=plan.kinds, products=plan.products, groups=cache.layer_group, norms=plan.norms):
        return decoding.packed_step(
            x, torch.empty(0), torch.empty(0), [0] * 4, norms, plan.eps, products, kinds, "gelu_tanh",
            cache.k, cache.v, tables, groups, plan.windows, one, one, one, 4, 1, 0.125,
        )  # fmt: skip

    assert step().shape == (1, V)
    kinds = list(plan.kinds)
    kinds[1] = decoding.DENSE  # layer 0 gets a k product but no v
    products = [*plan.products[:2], plan.products[0], plan.products[1], *plan.products[2:]]
    with pytest.raises(ValueError, match="one of its k and v products"):
        step(kinds=kinds, products=products)
    with pytest.raises(ValueError, match="is in group"):
        step(groups=[0, 0, len(cache.groups), 0])
    norms = list(plan.norms)
    norms[1] = torch.ones(256)  # a q norm over the model width, not a head
    with pytest.raises(ValueError, match=r"expected \(64,\)"):
        step(norms=norms)


@pytest.mark.slow  # Gemma 3 270M's file, loaded twice
def test_gemma3_270m_one_call_gives_the_per_operation_tokens(monkeypatch):
    """The real file (blocks: Q5_0, Q8_0, Q4_K, Q6_K; 18 layers in six groups): 16 greedy tokens of two
    prompts through the one-call step equal the per-operation step's, logits within float32 rounding."""
    from attnmask.pretrained import load
    from attnmask.pretrained.registry import locate

    try:
        locate("gemma3")
    except (FileNotFoundError, ValueError) as e:
        pytest.skip(f"Gemma 3 270M is not installed: {e}")
    model, tok, _ = load("gemma3", quantized=True)
    plan = fused_plan(model)
    assert plan is not None and len(plan.rotaries) == 2 and plan.windows.count(0) == 3
    prompts = [tok.encode("The history of the printing press begins"), tok.encode("def fib(n):")]

    def run():
        with torch.inference_mode():
            state, first, _ = decode.start(model, prompts=prompts, max_new_tokens=17)
            out = [first]
            for _ in range(16):
                out.append(decode.decode_step(model, state, out[-1].argmax(-1)))
        return torch.stack(out, 1)  # (2, 17, V)

    whole = run()
    monkeypatch.setattr(steps, "fused_plan", lambda model: None)
    by_calls = run()
    assert torch.equal(whole.argmax(-1), by_calls.argmax(-1))
    torch.testing.assert_close(whole, by_calls, atol=1e-4 * by_calls.abs().max(), rtol=0)
