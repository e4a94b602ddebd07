"""The decoding step's operators (:mod:`attnmask.ops.decoding`): each against its PyTorch definition
computed in float64, rows independent of the batch and of the thread count, the cache written in
place, no NaN on rows with nothing to attend to, clear refusals, and ``decode_one`` running through
them with the logits of the general forward pass."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from attnmask import decode, masks, ops
from attnmask.decode import static
from attnmask.model import fuse_projections_
from attnmask.ops import decoding
from tests.conftest import run_python, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True, scope="module")
def _built():
    if shutil.which(os.environ.get("CXX", "c++")) is None or not ops.available():
        pytest.skip(f"no native build of the operators here: {ops.status().why}")


def _close(got: torch.Tensor, want64: torch.Tensor, what: str = "") -> None:
    """float32 against a float64 reference: within a few float32 roundings of the result's scale."""
    scale = want64.abs().max().clamp(min=1.0)
    torch.testing.assert_close(got.double(), want64, atol=2e-6 * scale, rtol=0, msg=lambda m: f"{what}: {m}")


def _randn(*shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (2, 3, 96), (4, 7)])
def test_norms_and_silu_match_their_definitions(shape):
    x, delta, w = _randn(*shape, seed=1), _randn(*shape, seed=2), _randn(shape[-1], seed=3)
    _close(decoding.rms_norm(x, w, 1e-5), decoding.rms_norm_reference(x.double(), w.double(), 1e-5), "rms_norm")
    total, normed = decoding.add_rms_norm(x, delta, w, 1e-6)
    want_total, want_normed = decoding.add_rms_norm_reference(x.double(), delta.double(), w.double(), 1e-6)
    assert torch.equal(total, x + delta)  # one float32 addition, as PyTorch's
    _close(normed, want_normed, "add_rms_norm")
    gate_up = _randn(*shape[:-1], 2 * shape[-1], seed=4) * 4
    _close(decoding.silu_mul(gate_up), decoding.silu_mul_reference(gate_up.double()), "silu_mul")


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("k", [576, 100, 7])
def test_linear_rows_matches_its_definition(rows, k):
    """Row lengths with and without a tail past the vector loop; with and without a bias."""
    x, w, b = _randn(rows, k, seed=1), _randn(40, k, seed=2), _randn(40, seed=3)
    with_bias, without = decoding.linear_rows(x, w, b), decoding.linear_rows(x, w, None)
    assert with_bias.shape == without.shape == (rows, 40) and with_bias.dtype == torch.float32
    _close(with_bias, decoding.linear_rows_reference(x.double(), w.double(), b.double()), "with bias")
    _close(without, decoding.linear_rows_reference(x.double(), w.double(), None), "no bias")
    assert (with_bias - without - b).abs().max() <= 1e-5 * with_bias.abs().max()  # the bias is added once


def _attend_inputs(B=3, H=6, Hkv=2, D=16, T=12, col=7, seed=0):
    qkv = _randn(B, (H + 2 * Hkv) * D, seed=seed)
    angles = _randn(B, D // 2, seed=seed + 1) * 3
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    signed = torch.cat([-angles.sin(), angles.sin()], -1)
    k_cache, v_cache = _randn(B, Hkv, T, D, seed=seed + 2), _randn(B, Hkv, T, D, seed=seed + 3)
    return qkv, cos, signed, k_cache, v_cache, col


@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("bias_rows", [None, 1, 3])
def test_rope_attend_matches_its_definition(rotary, bias_rows):
    """Grouped-query heads (6 over 2), rotary or none, no bias / one bias for every row / one per row,
    against the definition in float64; the caches' column ``col`` holds the new key and value."""
    qkv, cos, signed, k_cache, v_cache, col = _attend_inputs()
    if not rotary:
        cos = signed = torch.empty(0)
    keys = col + 1
    bias = None
    if bias_rows is not None:
        allowed = torch.rand(bias_rows, 1, 1, 12, generator=torch.Generator().manual_seed(5)) < 0.7
        allowed[..., col] = True
        bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    k64, v64 = k_cache.double(), v_cache.double()
    want = decoding.rope_attend_reference(
        qkv.double(), cos.double(), signed.double(), k64, v64, col, keys, None if bias is None else bias.double(), 6, 2,
        0.25,
    )  # fmt: skip
    got = decoding.rope_attend(qkv, cos, signed, k_cache, v_cache, col, keys, bias, 6, 2, 0.25)
    _close(got, want, "rope_attend")
    _close(k_cache, k64, "the key written into the cache")
    _close(v_cache, v64, "the value written into the cache")
    assert torch.equal(v_cache[:, :, col], qkv.view(3, 10, 16)[:, 8:])  # values are copied, not rounded


def test_rope_attend_rows_with_nothing_to_attend_to_are_zero_not_nan():
    qkv, cos, signed, k_cache, v_cache, col = _attend_inputs()
    bias = torch.zeros(3, 1, 1, 12)
    bias[1] = float("-inf")  # row 1 sees no key at all
    got = decoding.rope_attend(qkv, cos, signed, k_cache, v_cache, col, col + 1, bias, 6, 2, 0.25)
    assert not got.isnan().any()
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_rows_do_not_depend_on_the_batch_or_the_threads():
    """Every operator gives a row the same bits alone or in a batch of three, with one or two threads."""
    qkv, cos, signed, k_cache, v_cache, col = _attend_inputs(T=300, col=250)
    bias = torch.zeros(3, 1, 1, 300)
    bias[0, ..., :40] = float("-inf")  # a left-padded row

    def run(rows, threads):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            kc, vc = k_cache[rows].clone(), v_cache[rows].clone()
            out = decoding.rope_attend(qkv[rows], cos[rows], signed[rows], kc, vc, col, col + 1, bias[rows], 6, 2, 0.25)
            normed = decoding.add_rms_norm(qkv[rows], qkv[rows] * 0.5, qkv[0], 1e-6)[1]
            product = decoding.linear_rows(qkv[rows], k_cache.reshape(-1, 160)[:300], None)  # 300 weight rows
            return out, kc, normed, decoding.silu_mul(qkv[rows]), product
        finally:
            torch.set_num_threads(before)

    whole = run(slice(0, 3), 1)
    for threads in (1, 2):
        for b in range(3):
            alone = run(slice(b, b + 1), threads)
            for got, want in zip(alone, whole):
                assert torch.equal(got[0], want[b])


def test_the_operators_refuse_what_they_cannot_compute():
    qkv, cos, signed, k_cache, v_cache, col = _attend_inputs()
    with pytest.raises(ValueError, match=r"rms_norm: x must be a float32 CPU tensor; got Double"):
        decoding.rms_norm(torch.ones(2, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match=r"rms_norm: weight has shape \[5\]; expected \(4,\)"):
        decoding.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-6)
    with pytest.raises(ValueError, match=r"silu_mul: gate_up has shape \[2, 5\]; expected \(\.\.\., 2 \* F\)"):
        decoding.silu_mul(torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"linear_rows: weight must be contiguous"):
        decoding.linear_rows(torch.ones(1, 4), torch.ones(4, 3).t(), None)  # column-major: the BLAS's business
    with pytest.raises(ValueError, match=r"linear_rows: x has shape \[1, 4\] and weight \[3, 5\]; expected \(M, K\)"):
        decoding.linear_rows(torch.ones(1, 4), torch.ones(3, 5), None)
    with pytest.raises(ValueError, match=r"rope_attend: column 12 and 13 keys do not fit a cache of 12"):
        decoding.rope_attend(qkv, cos, signed, k_cache, v_cache, 12, 13, None, 6, 2, 0.25)
    with pytest.raises(ValueError, match=r"rope_attend: qkv has shape \[3, 159\]; expected \(3, 160\)"):
        decoding.rope_attend(qkv[:, 1:].contiguous(), cos, signed, k_cache, v_cache, col, col + 1, None, 6, 2, 0.25)
    with pytest.raises(ValueError, match=r"rope_attend: bias has shape \[2, 1, 1, 12\]; expected \(3 or 1, 1, 1"):
        decoding.rope_attend(qkv, cos, signed, k_cache, v_cache, col, col + 1, torch.zeros(2, 1, 1, 12), 6, 2, 0.25)
    with pytest.raises(ValueError, match=r"rope_attend: 5 query heads over 2 key/value heads"):
        decoding.rope_attend(qkv, cos, signed, k_cache, v_cache, col, col + 1, None, 5, 2, 0.25)


def _fused_model():
    return fuse_projections_(
        tiny_model(
            "decoder", vocab=24, std=0.5, positions="rotary", n_heads=4, n_kv_heads=2, norm="rmsnorm",
            activation="swiglu", lm_head_bias=True, tie_embeddings=False,
        )
    )  # fmt: skip


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [4]]
STEPS = torch.randint(4, 24, (3, 5), generator=torch.Generator().manual_seed(0))  # fed after the prefill


def _counted(monkeypatch, *names):
    """Count the calls decode_one makes to these operators of attnmask.ops.decoding."""
    calls = {name: 0 for name in names}
    for name in names:
        real = getattr(decoding, name)

        def counting(*args, name=name, real=real):
            calls[name] += 1
            return real(*args)

        monkeypatch.setattr(decoding, name, counting)
    return calls


def _decoded(model) -> torch.Tensor:
    with torch.inference_mode():
        state, _, _ = decode.start(model, prompts=PROMPTS, max_new_tokens=6)
        return torch.stack([decode.decode_step(model, state, STEPS[:, t]) for t in range(5)], 1)  # (B, 5, V)


def test_decode_one_runs_a_step_in_one_call(monkeypatch):
    """A pre-norm RMSNorm / rotary / SwiGLU decoder with fused projections decodes each token in one
    decoder_step call, left padding included, with the logits of the general forward pass."""
    model = _fused_model()
    calls = _counted(monkeypatch, "decoder_step", "rope_attend")
    got = _decoded(model)
    assert calls == {"decoder_step": 5, "rope_attend": 0}
    for b, row in enumerate(PROMPTS):
        with torch.no_grad():
            want = model.decode(torch.tensor([row + STEPS[b].tolist()]), mask=masks.causal())[0, len(row) :]
        torch.testing.assert_close(got[b], want, atol=1e-5 * want.abs().max(), rtol=0)


def test_a_watched_module_takes_the_same_calls_from_python(monkeypatch):
    """A hook on a product (as benchmarks/smollm2.py --breakdown sets): the step makes decoder_step's calls
    one by one from Python, so that the hook sees its module called."""
    model = _fused_model()
    whole = _decoded(model)
    seen = []
    model.layers[1].mlp.down_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    calls = _counted(monkeypatch, "decoder_step", "rope_attend", "linear_rows")
    by_calls = _decoded(model)
    # per step: every layer's attention, and 4 L + 1 products of which the watched one is the module's call
    assert calls == {"decoder_step": 0, "rope_attend": 5 * len(model.layers), "linear_rows": 5 * 4 * len(model.layers)}
    assert len(seen) == 1 + 5  # the prefill and the five steps
    torch.testing.assert_close(by_calls, whole, atol=1e-5 * whole.abs().max(), rtol=0)  # one product on the BLAS


def test_one_call_is_the_calls_one_by_one_bit_for_bit(monkeypatch):
    """decoder_step makes from C++ the calls the step otherwise makes from Python, in the same order."""
    model = _fused_model()
    whole = _decoded(model)
    monkeypatch.setattr(static, "_step_operands", lambda *args: None)  # every step by calls from Python
    calls = _counted(monkeypatch, "decoder_step", "rope_attend")
    assert torch.equal(_decoded(model), whole)
    assert calls == {"decoder_step": 0, "rope_attend": 5 * len(model.layers)}


def test_other_models_keep_the_general_step():
    """Unfused projections, LayerNorm, an encoder-decoder, bfloat16 weights: not the fused step."""
    cases = [
        tiny_model("decoder", positions="rotary", norm="rmsnorm", activation="swiglu"),  # projections not fused
        fuse_projections_(tiny_model("decoder", positions="rotary", norm="layernorm", activation="swiglu")),
        tiny_model("encoder_decoder", positions="rotary", norm="rmsnorm", activation="swiglu"),
    ]
    bf16 = _fused_model().to(torch.bfloat16)  # all else fits, but the weights are not float32
    with torch.inference_mode():
        state, _, _ = decode.start(bf16, prompts=[[5]])
        k_bufs, _, cross = static._buffers(bf16, state.cache, 1)
    assert not static._fusable(bf16, static._layer_parts(bf16), [k.float() for k in k_bufs], cross)
    for model in cases:
        with torch.inference_mode():
            state, _, _ = decode.start(model, **({"src": [[5, 6]]} if model.is_encoder_decoder else {"prompts": [[5]]}))
            k_bufs, _, cross = static._buffers(model, state.cache, 1)
        assert not static._fusable(model, static._layer_parts(model), k_bufs, cross)


@pytest.mark.slow  # builds the native library twice more (a minute or so each on 2 cores)
@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_the_other_builds_match_their_definitions_too(capability):
    """The AVX2 and portable builds (what other CPUs get: the flags follow PyTorch's CPU capability,
    which ATEN_CPU_CAPABILITY lowers), in a fresh process: the definition tests above, again."""
    if capability == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU does not run AVX2")
    code = (
        "import sys, pytest\n"
        "from attnmask import ops\n"
        "print(ops.load().why)\n"
        f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {__file__!r}, '-k', 'matches_its_definition']))\n"
    )
    lines = run_python(code, timeout=600, ATEN_CPU_CAPABILITY=capability)
    assert lines[0].startswith(f"C/C++, {'AVX2' if capability == 'avx2' else 'portable C'}, "), lines[0]
    assert " passed" in lines[-1] and "skipped" not in lines[-1], lines[-1]


def test_without_a_cxx_compiler_decoding_says_so_once_and_gives_the_same_logits(tmp_path):
    """A fresh process (a loaded operator library cannot be unloaded) whose $CXX does not exist: one
    warning naming the compiler, the step on PyTorch's operations (not the operators' slow
    definitions), and the logits of the native step up to rounding."""
    code = (
        "import warnings, torch\n"
        "from attnmask import ops\n"
        "from attnmask.ops import decoding\n"
        "from tests.ops.test_decoding import _decoded, _fused_model\n"
        "calls = []\n"
        "decoding.decoder_step = decoding.rope_attend = lambda *a: calls.append(a)\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    print(ops.available(), ops.available())\n"
        f"    torch.save(_decoded(_fused_model()), {str(tmp_path / 'logits.pt')!r})\n"
        "print(len(seen), str(seen[0].message))\n"
        "print(len(calls))\n"
    )
    available, warning, calls = run_python(code, CXX=str(tmp_path / "no-such-c++"), ATTNMASK_CACHE=str(tmp_path))
    assert available == "False False"
    assert warning.startswith("1 attnmask: native kernels unavailable") and "no-such-c++" in warning, warning
    assert calls == "0"
    fallback, native = torch.load(tmp_path / "logits.pt"), _decoded(_fused_model())
    torch.testing.assert_close(fallback, native, atol=1e-5 * native.abs().max(), rtol=0)
