"""The fixed-shape decoding step (:mod:`attnmask.decode.static`): the logits of the general forward
pass, the same tokens compiled or not, every row on its own, and a one-line fallback without a compiler.

Compiled runs use ``backend="eager"`` here (Dynamo traces the whole step as one graph, fullgraph=True,
and runs it without generating code): that checks what compiling needs (no graph break, no Python
branch on a tensor, the bucketed mask, rows that stay) in seconds. Inductor itself is exercised by
the ``slow`` test at the end.
"""

from __future__ import annotations

import pytest
import torch

from attnmask import decode, masks
from attnmask.decode.static import CompiledStep, auto_compile, bucket, decode_one
from attnmask.model import KVCache, fuse_projections_
from tests.conftest import tiny_model

INPUTS = [[5, 6, 7, 8, 9], [10, 11], [4, 5, 6], [7], [8, 9, 10, 11, 4, 5]]

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANTS = {
    "rotary-gqa": {"positions": "rotary", "n_heads": 4, "n_kv_heads": 2, "norm": "rmsnorm", "activation": "swiglu"},
    "rotary-gqa-fused": {
        "positions": "rotary", "n_heads": 4, "n_kv_heads": 2, "norm": "rmsnorm", "activation": "swiglu", "fuse": True,
    },
    "learned-post-norm": {"positions": "learned", "norm_position": "post"},
    "sinusoidal": {"positions": "sinusoidal"},
}  # fmt: skip


def model_of(arch: str, variant: str, seed: int = 0, eos_bias: float = 1.0, max_seq_len: int = 64):
    kw = dict(VARIANTS[variant])
    fuse = kw.pop("fuse", False)
    if arch == "encoder_decoder" and fuse:
        pytest.skip("fused projections are for decoder-only models")
    model = tiny_model(
        arch, vocab=24, seed=seed, std=0.5, eos_bias=eos_bias, max_seq_len=max_seq_len, lm_head_bias=True,
        tie_embeddings=False,
        **kw,
    )  # fmt: skip
    return fuse_projections_(model) if fuse else model


def inputs_of(model, rows):
    return {"src": rows} if model.is_encoder_decoder else {"prompts": rows}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_decode_one_gives_the_full_forward_logits(arch, variant):
    """Prefill, then steps of decode_one, against the whole sequence through Transformer.decode
    (no cache), left padding (decoder) or source padding (encoder-decoder) included."""
    model = model_of(arch, variant)
    g = torch.Generator().manual_seed(0)
    steps = torch.randint(4, 24, (len(INPUTS), 6), generator=g)  # (B, 6) tokens fed after the prefill
    with torch.inference_mode():
        state, _, _ = decode.start(model, **inputs_of(model, INPUTS), max_new_tokens=8)
        got = []
        for t in range(steps.shape[1]):
            got.append(decode.decode_step(model, state, steps[:, t]))  # (B, V)
        got = torch.stack(got, 1)  # (B, 6, V)
    for b, row in enumerate(INPUTS):  # each row alone, unpadded, no cache
        with torch.no_grad():
            if model.is_encoder_decoder:
                memory = model.encode(torch.tensor([row]))
                ids = torch.tensor([[decode.steps.SOS_ID] + steps[b].tolist()])
                want = model.decode(ids, memory, mask=masks.causal())[0, 1:]
            else:
                ids = torch.tensor([row + steps[b].tolist()])
                want = model.decode(ids, mask=masks.causal())[0, len(row) :]
        scale = want.abs().max()
        torch.testing.assert_close(got[b], want, atol=1e-5 * scale, rtol=0)


def test_decode_one_checks_rows_and_capacity():
    model = model_of("decoder", "rotary-gqa")
    with torch.inference_mode():
        state, _, _ = decode.start(model, prompts=[[5, 6]], max_new_tokens=1)
        with pytest.raises(ValueError, match="cache holding 1 rows"):
            decode_one(model, state.cache, torch.tensor([4, 4]), state.next_pos.repeat(2), None, None)
        decode_one(model, state.cache, torch.tensor([4]), state.next_pos, None, None)  # fills the cache
        with pytest.raises(ValueError, match="overflow"):
            decode_one(model, state.cache, torch.tensor([4]), state.next_pos, None, None)


@pytest.mark.parametrize("variant", ["rotary-gqa-fused", "learned-post-norm"])
@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_compiled_step_gives_the_same_tokens(arch, variant):
    """Compiled rows stay in the batch (fixed shapes); each still stops at its own <eos>, and the
    results equal eager decoding one by one."""
    model = model_of(arch, variant, seed=2 if arch == "decoder" else 3, eos_bias=1.0 if arch == "decoder" else 2.5)
    step = CompiledStep(model, backend="eager")
    eager = decode.greedy(model, **inputs_of(model, INPUTS), max_new_tokens=30)
    assert any(len(r) < 30 for r in eager) and len({len(r) for r in eager}) > 1  # rows end at different steps
    assert decode.greedy(model, **inputs_of(model, INPUTS), max_new_tokens=30, compile=step) == eager
    alone = [decode.greedy(model, **inputs_of(model, [r]), max_new_tokens=30, compile=step)[0] for r in INPUTS]
    assert alone == eager
    assert step.failed is None


def test_compiled_step_compiles_once_per_bucket_and_batch_size():
    """Prompts of other lengths and shorter generations reuse the graphs: the cache keeps one length."""
    model = model_of("decoder", "rotary-gqa", seed=2, max_seq_len=256)
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    step = CompiledStep(model, backend=counting_backend)
    decode.greedy(model, prompts=[[5, 6, 7]], max_new_tokens=70, eos_id=None, compile=step)  # buckets 64, 128
    assert len(graphs) == 2
    for prompt, n in [([5], 10), ([4, 5, 6, 7, 8, 9], 30), ([7, 7], 66)]:
        decode.greedy(model, prompts=[prompt], max_new_tokens=n, eos_id=None, compile=step)
    assert len(graphs) == 2


def test_compiled_sampling_and_streaming_match_eager():
    model = model_of("decoder", "rotary-gqa", seed=3)
    step = CompiledStep(model, backend="eager")

    def draw(**kw):
        s = decode.Sampling(temperature=1.0, top_k=8, generator=torch.Generator().manual_seed(5))
        return decode.generate_ids(model, prompts=INPUTS, max_new_tokens=20, sampling=s, **kw)

    assert draw(compile=step) == draw()
    eager = [t.tolist() for t in decode.stream(model, prompts=INPUTS, max_new_tokens=12)]
    assert [t.tolist() for t in decode.stream(model, prompts=INPUTS, max_new_tokens=12, compile=step)] == eager


def test_a_compiler_that_fails_gives_one_notice_and_eager_results():
    model = model_of("decoder", "rotary-gqa")

    def broken_backend(gm, example_inputs):
        raise RuntimeError("no C++ compiler found\nsecond line")

    notices = []
    step = CompiledStep(model, backend=broken_backend, notice=notices.append)
    want = decode.greedy(model, prompts=INPUTS, max_new_tokens=10)
    assert decode.greedy(model, prompts=INPUTS, max_new_tokens=10, compile=step) == want
    assert decode.greedy(model, prompts=INPUTS, max_new_tokens=10, compile=step) == want
    assert len(notices) == 1 and "\n" not in notices[0] and "no C++ compiler found" in notices[0]


def test_compile_defaults_and_buckets():
    model = model_of("decoder", "sinusoidal")
    assert auto_compile(model) is False  # CPU: compiling does not pay for itself by default
    assert [bucket(n) for n in (1, 64, 65, 128, 129, 1000)] == [64, 64, 128, 128, 256, 1024]
    other = model_of("decoder", "rotary-gqa")
    with pytest.raises(ValueError, match="another model"):
        decode.greedy(model, prompts=INPUTS, max_new_tokens=2, compile=CompiledStep(other, backend="eager"))


def test_cuda_path_uses_cuda_graphs_mode():
    """No GPU here: only the choice of mode is checked (the CUDA path itself is unmeasured)."""
    model = model_of("decoder", "sinusoidal")
    assert CompiledStep(model).mode == "default"
    assert CompiledStep(model, mode="reduce-overhead").mode == "reduce-overhead"


@pytest.mark.slow
def test_inductor_compiled_step_gives_the_same_tokens():
    model = model_of("decoder", "rotary-gqa-fused", seed=2)
    step = CompiledStep(model)
    eager = decode.greedy(model, prompts=INPUTS, max_new_tokens=20)
    assert decode.greedy(model, prompts=INPUTS, max_new_tokens=20, compile=step) == eager
    assert step.failed is None, step.failed


def test_the_prefill_fills_the_models_own_cache():
    """decode.start keeps the keys and values in the model package's KVCache (no copy of the class
    of its own): the same tensors a KVCache filled by the model's forward holds, at the same position."""
    model = model_of("decoder", "rotary-gqa-fused", seed=3)
    prompt = INPUTS[0]
    with torch.inference_mode():
        state, _, _ = decode.start(model, prompts=[prompt], max_new_tokens=4)
        cache = KVCache.for_model(model, 1, max_len=state.cache.max_len)
        model.decode(torch.tensor([prompt]), mask=masks.causal(), cache=cache)
    assert type(state.cache) is KVCache
    assert state.cache.pos == cache.pos == len(prompt)
    for ours, theirs in zip(state.cache.layers, cache.layers):
        torch.testing.assert_close(ours.k[:, :, : len(prompt)], theirs.k[:, :, : len(prompt)], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.v[:, :, : len(prompt)], theirs.v[:, :, : len(prompt)], rtol=0, atol=1e-6)
