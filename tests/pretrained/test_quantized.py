"""Weights kept as GGUF blocks (:class:`attnmask.pretrained.quantized.BlockLinear`) compute the float32 product
with the dequantized matrix, up to summation order.

The claim is checked against a float64 reference: ``x @ W.T`` with ``W`` as ``gguf.dequantize``
gives it, computed in float64. Plain float32 (PyTorch's own ``x @ W.T``) misses that reference by
some rounding error; the block kernel may miss it by a small multiple of that, never more. Broken
kernels (nibbles swapped, the ``m`` term dropped, a wrong scale, rows permuted, activations rounded
to int8/bfloat16 as llama.cpp-style kernels do) miss it by 600x to 10^6x the float32 error; the
bound here is 4x.

Three levels: one layer on random blocks (both formats, odd block counts, full and partial groups
of the kernel's 4 rows, the PyTorch fallback), a tiny GGUF model written here
(``load(quantized=True)`` vs ``load()``), and the real SmolLM2-135M-Instruct (vs ``transformers``
in float32).
"""

from __future__ import annotations

import os
import platform
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from attnmask import decode, ops, pretrained
from attnmask.audit import audit
from attnmask.ops import blocks, native
from attnmask.ops.blocks import BLOCK_BYTES, dequantize_blocks
from attnmask.pretrained import build, load
from attnmask.pretrained import cache as weight_cache
from attnmask.pretrained.gguf_file import read_gguf
from attnmask.pretrained.quantized import BlockLinear, kernel_status
from tests.conftest import run_python
from tests.pretrained import test_pretrained
from tests.pretrained.test_pretrained import _prompts, _smollm2_path, write_tiny_gguf

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -e '.[hf]')")

# module-scoped fixtures of the float32 SmolLM2 tests, shared (pytest sets them up again for this module)
smol_reader = test_pretrained.smol_reader
smol_hf = test_pretrained.smol_hf

EPS32 = torch.finfo(torch.float32).eps
KINDS = ["Q4_1", "Q8_0"]
# (out_features, in_features): 3, 5 and 8 blocks per row (odd: Q4_1 pairs blocks; AVX-512 takes two pairs or
# two blocks at once, with an odd one left over or none), odd row counts, SmolLM2's 576
SHAPES = [(13, 96), (24, 160), (7, 256), (192, 576)]
ROWS = [1, 2, 3, 4, 5, 16, 17, 70]  # the kernel takes rows 4 at a time: full and partial groups


def qtype(kind: str):
    return gguf.GGMLQuantizationType[kind]


def random_blocks(kind: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """GGUF bytes of a random (n, k) weight quantized by ``gguf``, and the float32 weight they encode."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.2 + rng.uniform(-0.3, 0.3, (n, 1)).astype(np.float32)
    raw = gguf.quantize(w, qtype(kind))
    return raw, torch.from_numpy(gguf.dequantize(raw, qtype(kind)).astype(np.float32))


def random_bytes_blocks(kind: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Blocks of random bytes with finite float16 scales: every code occurs (all 16 nibbles of Q4_1,
    -128..127 for Q8_0, which ``gguf.quantize`` never writes), scales and minimums of both signs."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 32, BLOCK_BYTES[kind]), dtype=np.uint8)
    halves = 2 if kind == "Q4_1" else 1  # d (and m)
    scales = (rng.standard_normal((n, k // 32, halves)) * 0.02).astype(np.float16)
    raw[..., : 2 * halves] = scales.view(np.uint8)
    raw = raw.reshape(n, -1)
    return raw, torch.from_numpy(gguf.dequantize(raw, qtype(kind)).astype(np.float32))


def float32_error_bound(x: torch.Tensor, w: torch.Tensor, factor: float = 4.0) -> tuple[torch.Tensor, float]:
    """(float64 ``x @ w.T``, the largest error allowed against it): ``factor`` times plain float32's
    own largest error, or one float32 ulp of the largest ``|x| @ |w|.T`` where that error is smaller."""
    ref = x.double() @ w.double().T
    plain = (x @ w.T).double()
    floor = EPS32 * (x.double().abs() @ w.double().abs().T).max().item()
    return ref, factor * max((plain - ref).abs().max().item(), floor)


def assert_float32_accurate(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: str = "") -> None:
    ref, bound = float32_error_bound(x, w)
    assert got.shape == ref.shape, what
    assert got.dtype == x.dtype, what
    err = (got.double() - ref).abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3g} vs float64, allowed {bound:.3g} (4x float32's own)"


@pytest.fixture
def threads():
    """Restores torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# One layer
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("blocks", [random_blocks, random_bytes_blocks], ids=["quantized", "random-bytes"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_2d_equals_float32_product(kind, shape, blocks):
    n, k = shape
    raw, w = blocks(kind, n, k, seed=n + k)
    layer = BlockLinear.from_numpy(raw, kind, k)
    g = torch.Generator().manual_seed(k)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        with torch.no_grad():
            assert_float32_accurate(layer(x), x, w, f"{kind} {n}x{k}, {rows} rows")


@pytest.mark.parametrize("lead", [(1, 1), (2, 1), (2, 3), (4, 4), (3, 6)], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_forward_3d_equals_float32_product(kind, lead):
    raw, w = random_blocks(kind, 40, 160, seed=7)
    layer = BlockLinear.from_numpy(raw, kind, 160)
    x = torch.randn(*lead, 160, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y = layer(x)
    assert y.shape == (*lead, 40)
    assert_float32_accurate(y, x, w, f"{kind} input {tuple(x.shape)}")


@pytest.mark.parametrize("kind", KINDS)
def test_forward_strided_and_float64_inputs(kind):
    raw, w = random_blocks(kind, 24, 96, seed=11)
    layer = BlockLinear.from_numpy(raw, kind, 96)
    g = torch.Generator().manual_seed(0)
    for rows in (3, 17):
        x = torch.randn(96, rows, generator=g).T  # (rows, 96), not contiguous
        assert not x.is_contiguous()
        with torch.no_grad():
            assert_float32_accurate(layer(x), x, w, f"transposed input, {rows} rows")
            wide = torch.randn(rows, 2 * 96, generator=g)[:, ::2]  # every other column
            assert_float32_accurate(layer(wide), wide, w, f"strided input, {rows} rows")
            x64 = torch.randn(rows, 96, generator=g, dtype=torch.float64)
            y64 = layer(x64)
        # float64 inputs keep their dtype; the product is at least as accurate as float32's
        assert y64.dtype == torch.float64
        ref = x64 @ w.double().T
        floor = EPS32 * (x64.abs() @ w.double().abs().T).max().item()
        plain_err = ((x64.float() @ w.T).double() - ref).abs().max().item()
        assert (y64 - ref).abs().max().item() <= 4 * max(plain_err, floor), f"float64 input, {rows} rows"


@pytest.mark.parametrize("kind", KINDS)
def test_forward_with_two_threads(kind, threads):
    raw, w = random_blocks(kind, 576, 1536, seed=5)
    layer = BlockLinear.from_numpy(raw, kind, 1536)
    x = torch.randn(16, 1536, generator=torch.Generator().manual_seed(5))
    torch.set_num_threads(1)
    with torch.no_grad():
        one = layer(x)
    torch.set_num_threads(2)
    assert torch.get_num_threads() == 2
    with torch.no_grad():
        for rows in (1, 5, 16):
            two = layer(x[:rows])
            assert_float32_accurate(two, x[:rows], w, f"2 threads, {rows} rows")
            _, bound = float32_error_bound(x[:rows], w)
            assert (two - one[:rows]).abs().max().item() <= 2 * bound  # both within the bound of float64
        assert torch.equal(layer.dequantize(), w)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k", [(200, 576), (203, 1536)])  # SmolLM2's widths; 203: a task ends on an odd row
def test_a_row_does_not_depend_on_the_batch_or_the_thread_count(kind, threads, n, k):
    """Bit for bit: each output element is computed the same way alone, in any batch, on any number
    of threads (so padding rows or batch neighbours can never change a real row's logits). A row alone
    takes the kernel's one-row path (weight rows two at a time), a batch the several-row one."""
    raw, _ = random_blocks(kind, n, k, seed=21)
    layer = BlockLinear.from_numpy(raw, kind, k)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(21))
    torch.set_num_threads(1)
    with torch.no_grad():
        alone = torch.cat([layer(row[None]) for row in x])
        assert alone.shape == (70, n)
        assert torch.equal(layer(x), alone)
        assert torch.equal(layer(x[3:10]), alone[3:10])
        torch.set_num_threads(2)
        assert torch.equal(layer(x), alone)
        assert torch.equal(layer(x.view(7, 10, k)), alone.view(7, 10, n))


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_flows_to_the_input_not_the_blocks(kind):
    raw, w = random_blocks(kind, 13, 96, seed=2)
    layer = BlockLinear.from_numpy(raw, kind, 96)
    assert list(layer.parameters()) == []  # buffers: inference weights
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(2), requires_grad=True)
    y = layer(x)
    assert_float32_accurate(y.detach(), x.detach(), w)
    y.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, 96))


@pytest.mark.parametrize("blocks", [random_blocks, random_bytes_blocks], ids=["quantized", "random-bytes"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_equals_gguf_exactly(kind, shape, blocks):
    n, k = shape
    raw, w = blocks(kind, n, k, seed=n * k)
    layer = BlockLinear.from_numpy(raw, kind, k)
    assert (layer.in_features, layer.out_features, layer.kind) == (k, n, kind)
    assert layer.dequantize().dtype == torch.float32
    assert torch.equal(layer.dequantize(), w)
    assert torch.equal(layer.weight, w)
    assert torch.equal(dequantize_blocks(torch.from_numpy(raw), kind, k), w)


@pytest.mark.parametrize("kind", KINDS)
def test_concat_stacks_rows(kind):
    parts = [random_blocks(kind, n, 160, seed=n) for n in (24, 8, 8)]  # like q, k, v with 5 blocks per row
    fused = BlockLinear.concat([BlockLinear.from_numpy(raw, kind, 160) for raw, _ in parts])
    w = torch.cat([w for _, w in parts])
    assert (fused.kind, fused.in_features, fused.out_features) == (kind, 160, 40)
    assert torch.equal(fused.dequantize(), w)
    g = torch.Generator().manual_seed(0)
    for rows in ROWS:
        x = torch.randn(rows, 160, generator=g)
        with torch.no_grad():
            assert_float32_accurate(fused(x), x, w, f"fused, {rows} rows")
    other = "Q8_0" if kind == "Q4_1" else "Q4_1"
    mixed = [
        BlockLinear.from_numpy(parts[0][0], kind, 160),
        BlockLinear.from_numpy(random_blocks(other, 8, 160, 0)[0], other, 160),
    ]
    with pytest.raises(ValueError, match="only layers of one format and input size concatenate"):
        BlockLinear.concat(mixed)


# ---------------------------------------------------------------------------------------------
# Which implementation runs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_pytorch_fallback_gives_the_same_values(kind, monkeypatch):
    raw, w = random_blocks(kind, 24, 160, seed=9)
    layer = BlockLinear.from_numpy(raw, kind, 160)
    xs = [torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows)) for rows in ROWS]
    with torch.no_grad():
        kernel = [layer(x) for x in xs]
    monkeypatch.setattr(native, "_status", native.Status("unloaded", ""))
    monkeypatch.setenv("ATTNMASK_KERNELS", "0")
    assert "decoded once" in kernel_status() and "ATTNMASK_KERNELS=0" in kernel_status(), kernel_status()
    fresh = BlockLinear.from_numpy(raw, kind, 160)
    for x, y in zip(xs, kernel):
        with torch.no_grad():
            fallback = layer(x)
            assert torch.equal(fresh(x), fallback)
        assert_float32_accurate(fallback, x, w, f"fallback, {x.shape[0]} rows")
        _, bound = float32_error_bound(x, w)
        assert (fallback - y).abs().max().item() <= 2 * bound
    assert torch.equal(layer.dequantize(), w)
    assert torch.equal(fresh.weight, w)


@pytest.mark.slow  # builds attnmask's kernels three times, a minute or so each on 2 cores
@pytest.mark.parametrize("flavour", ["native", "avx2", "portable"])
def test_kernel_is_built_into_the_cache_folder(tmp_path, flavour):
    """A fresh build in a fresh process (``$ATTNMASK_CACHE/kernels``): the CPU's own kernel, the AVX2 one
    an AVX-512 CPU would otherwise never run, and the portable C one that machines without AVX2/FMA
    get, forced here with a compiler wrapper that turns those instructions off; each against the
    float64 reference."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C/C++ compiler: the kernels cannot be built here")
    off = {"avx2": "-mno-avx512f", "portable": "-mno-avx512f -mno-avx2 -mno-fma -mno-f16c"}
    env = {"ATTNMASK_CACHE": str(tmp_path)}
    if flavour in off:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            pytest.skip("the native build is the portable one on this machine")
        if flavour == "avx2" and torch.backends.cpu.get_cpu_capability() != "AVX512":
            pytest.skip("the native build is the AVX2 (or portable) one on this CPU")
        wrapper = tmp_path / f"cc-{flavour}"
        wrapper.write_text(f'#!/bin/sh\nexec "{compiler}" "$@" {off[flavour]}\n')
        wrapper.chmod(0o755)
        env["CC"] = str(wrapper)
    code = (
        "import sys, pytest\n"
        "from attnmask.pretrained.quantized import kernel_status\n"
        "print(kernel_status())\n"
        f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {__file__!r}, '-k', 'kernel_matches_the_reference']))\n"
    )
    lines = run_python(code, timeout=900, **env)
    status = lines[0]
    assert status.startswith("block kernel in C"), status
    assert {"avx2": "AVX2,", "portable": "portable C,"}.get(flavour, "C/C++,") in status, status
    built = list((tmp_path / "kernels").glob("*.so"))
    assert len(built) == 1 and str(built[0]) in status, (built, status)
    assert " passed" in lines[-1] and "skipped" not in lines[-1] and "failed" not in lines[-1], lines[-1]


def test_kernel_matches_the_reference():
    """Every shape and row count of the kernel against the float64 reference, and its dequantization
    exact (run again by the build test above in processes with other builds)."""
    for kind in KINDS:
        for n, k in SHAPES:
            raw, w = random_blocks(kind, n, k, seed=n)
            layer = BlockLinear.from_numpy(raw, kind, k)
            assert torch.equal(layer.dequantize(), w), f"{kind} {n}x{k}"
            g = torch.Generator().manual_seed(k)
            for rows in ROWS:
                x = torch.randn(rows, k, generator=g)
                with torch.no_grad():
                    assert_float32_accurate(layer(x), x, w, f"{kind} {n}x{k}, {rows} rows")


def test_without_a_compiler_warns_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_status", native.Status("unloaded", ""))
    monkeypatch.delenv("ATTNMASK_KERNELS", raising=False)
    monkeypatch.setenv("ATTNMASK_CACHE", str(tmp_path))  # no kernel built earlier
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.warns(UserWarning, match="native kernels unavailable, using PyTorch's") as seen:
        status = kernel_status()
    assert len(seen) == 1
    assert "decoded once" in status and "no-such-cc" in status, status
    raw, w = random_blocks("Q8_0", 24, 160, seed=1)
    x = torch.randn(3, 160, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_float32_accurate(BlockLinear.from_numpy(raw, "Q8_0", 160)(x), x, w)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
def test_constructor_errors():
    q41 = torch.zeros(4, 3 * 20, dtype=torch.uint8)  # 4 rows of 96 Q4_1 weights
    with pytest.raises(
        ValueError, match=r"'Q4_0' is not supported; expected one of \['Q4_1', 'Q4_K', 'Q5_0', 'Q6_K', 'Q8_0'\]"
    ):
        BlockLinear(q41, "Q4_0", 96)
    with pytest.raises(ValueError, match="in_features=100 is not a multiple of the block size 32"):
        BlockLinear(q41, "Q4_1", 100)
    with pytest.raises(
        ValueError, match=r"Q8_0 blocks for in_features=96 must be uint8 \(out_features, 102\); got \(4, 60\)"
    ):
        BlockLinear(q41, "Q8_0", 96)  # Q4_1 bytes named Q8_0
    with pytest.raises(ValueError, match=r"must be uint8 \(out_features, 60\); got \(4, 60\) torch\.int8"):
        BlockLinear(q41.to(torch.int8), "Q4_1", 96)
    with pytest.raises(ValueError, match=r"must be uint8 \(out_features, 60\); got \(240,\)"):
        BlockLinear(q41.flatten(), "Q4_1", 96)
    with pytest.raises(ValueError, match=r"must be uint8 \(out_features, 40\); got \(4, 60\)"):
        BlockLinear.from_numpy(q41.numpy(), "Q4_1", 64)


def test_forward_rejects_wrong_feature_count():
    raw, _ = random_blocks("Q4_1", 8, 96, seed=0)
    layer = BlockLinear.from_numpy(raw, "Q4_1", 96)
    for x in (torch.zeros(2, 95), torch.zeros(17, 95), torch.zeros(96, 2)):
        with pytest.raises(ValueError, match=rf"input has {x.shape[-1]} features; this layer expects 96"):
            layer(x)


def test_quantized_load_needs_float32(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", tied=True)
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(ValueError, match=r"float32 activations; got dtype=torch\.b?float16, expected float32"):
            load(tmp_path / "tiny.gguf", quantized=True, dtype=dtype)
    with pytest.raises(
        ValueError, match=r"activations='int8' is a setting of the GGUF block layers; it needs quantized"
    ):
        load(tmp_path / "tiny.gguf", activations="int8")
    with pytest.raises(ValueError, match=r"activations='int4' is not one of \['float32', 'int8'\]"):
        load(tmp_path / "tiny.gguf", quantized=True, activations="int4")


# ---------------------------------------------------------------------------------------------
# A tiny GGUF model: Q4_1 linear layers, Q8_0 token embedding (tied) or output
# ---------------------------------------------------------------------------------------------
def network_error_bound(
    got: torch.Tensor, plain: torch.Tensor, ref: torch.Tensor, factor: float
) -> tuple[float, float]:
    """(max error of ``got`` vs the float64 ``ref``, ``factor`` x the float32 model's own max error)."""
    floor = EPS32 * ref.abs().max().item()
    plain_err = (plain.double() - ref).abs().max().item()
    return (got.double() - ref).abs().max().item(), factor * max(plain_err, floor)


def linear_weight_count(model: nn.Module) -> int:
    return sum(m.out_features * m.in_features for m in model.modules() if isinstance(m, (nn.Linear, BlockLinear)))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tiny_gguf_quantized_equals_float32(tmp_path, tied):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tied=tied)  # Q4_1 linear layers; Q8_0 token_embd, output and attn_output
    blocks = read_gguf(path, keep_blocks=True).blocks
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert {name.rsplit(".", 2)[-2] for name in blocks if name.startswith("layers.")} == set(projections)
    assert len(blocks) == 2 * len(projections) + 1
    assert blocks["lm_head.weight"][0] == "Q8_0"  # token_embd when tied, output otherwise
    assert blocks["layers.1.mlp.up_proj.weight"][0] == "Q4_1"
    # the blocks decode to the float32 loader's weights, query/key rows un-permuted the same way
    dense = read_gguf(path).state_dict
    for name, (kind, raw) in blocks.items():
        expected = dense["embed.weight" if tied and name == "lm_head.weight" else name]
        assert torch.equal(BlockLinear(raw, kind, expected.shape[1]).dequantize(), expected), name

    model, tok, _ = load(path, quantized=True, cache=tmp_path / "cache")
    plain, _, _ = load(path, cache=False)
    # the blocks are cached in a file of their own; a second load reads it, not the GGUF file
    cached = pretrained.cache_file(path, tmp_path / "cache", quantized=True)
    assert cached.is_file() and not pretrained.cache_file(path, tmp_path / "cache").exists()
    path.write_bytes(b"")  # the cache is named by the file's hash: keep the name, lose the content
    with pytest.raises(ValueError):
        load(path, quantized=True, cache=tmp_path / "cache")
    again = weight_cache._read_cache(cached)
    assert {k: (kind, raw.shape) for k, (kind, raw) in again.blocks.items()} == {
        k: (kind, raw.shape) for k, (kind, raw) in blocks.items()
    }
    assert all(torch.equal(again.blocks[k][1], raw) for k, (_, raw) in blocks.items())
    assert not [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]  # all BlockLinear
    assert isinstance(model.lm_head, BlockLinear) and model.lm_head.kind == "Q8_0"
    assert linear_weight_count(model) == linear_weight_count(plain) > 0
    assert torch.equal(model.lm_head.weight, plain.lm_head.weight)
    assert model.embed.weight.dtype == torch.float32  # the lookup table is float32, W_pred keeps the blocks
    assert torch.equal(model.embed.weight, plain.embed.weight)

    prompts = [tok.encode("The capital of France is"), tok.encode("def add(a, b):\n    return a + b\n")]
    with torch.no_grad():
        assert decode.greedy(model, prompts=prompts, max_new_tokens=16, eos_id=None) == decode.greedy(
            plain, prompts=prompts, max_new_tokens=16, eos_id=None
        )
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, tok.vocab_size, shape, generator=g) for shape in [(1, 5), (2, 7), (2, 40)]]
        got, expected = [model.decode(ids) for ids in batches], [plain.decode(ids) for ids in batches]
        reference = plain.double()
        for ids, q, f in zip(batches, got, expected):
            ref = reference.decode(ids)
            assert ref.dtype == torch.float64
            err, bound = network_error_bound(q, f, ref, factor=4.0)
            assert err <= bound, f"{tuple(ids.shape)}: quantized error {err:.3g}, allowed {bound:.3g}"
            torch.testing.assert_close(q, f, rtol=0, atol=1e-4)
    # the leak audit passes the quantized model as it passes the float32 one: causality, gradients,
    # padding, cache parity, and fully padded batch neighbours that change nothing (bit for bit here)
    report = audit(model, length=12)
    assert [(c.name, c.passed) for c in report.checks] == [(c.name, True) for c in audit(plain, length=12).checks]


# ---------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_q(one_thread, tmp_path_factory):
    """SmolLM2 as ``load("smollm2", quantized=True)`` gives it: (model, tokenizer)."""
    _smollm2_path()  # skips when the weights are not installed
    model, tok, _ = load("smollm2", quantized=True, cache=tmp_path_factory.mktemp("cache"))
    return model, tok


@pytest.fixture(scope="module")
def smol_f64(smol_reader):
    """attnmask's SmolLM2 with the file's dequantized weights, in float64: the reference."""
    ckpt = read_gguf(smol_reader)
    return build(ckpt.config, ckpt.state_dict).eval().double()


@pytest.mark.slow  # the real SmolLM2-135M file, compared with transformers
def test_smollm2_quantized_layers(smol_q):
    model, _ = smol_q
    assert not [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]  # all BlockLinear
    kinds = [m.kind for m in model.modules() if isinstance(m, BlockLinear)]
    assert kinds.count("Q8_0") == 1 and model.lm_head.kind == "Q8_0" and set(kinds) == {"Q4_1", "Q8_0"}
    # every weight of the 30 layers' 7 projections, and W_pred (tied to the 49152 x 576 embedding)
    assert linear_weight_count(model) == 30 * (576 * (576 + 2 * 192 + 576) + 3 * 576 * 1536) + 49152 * 576
    assert model.embed.weight.dtype == torch.float32


@pytest.mark.slow  # the real SmolLM2-135M file, compared with transformers
def test_smollm2_quantized_logits_as_accurate_as_float32(smol_q, smol_hf, smol_f64):
    model, tok = smol_q
    prompts = [tok.encode(p) for p in _prompts()[:3]]
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            got, hf32, ref = model.decode(ids), smol_hf(ids).logits, smol_f64.decode(ids)
        # each product output is one chain of multiply-adds (32 a block, then one a block: the panels'
        # batch-invariant order) rather than a BLAS's partial sums: measured 3.1x float32's own error at most
        err, bound = network_error_bound(got, hf32, ref, factor=4.0)
        assert err <= bound, f"{len(prompt)} tokens: quantized error {err:.3g}, float32 x4 {bound:.3g}"
        assert err <= 5e-4
        assert (got - hf32).abs().max().item() <= 5e-4


@pytest.mark.slow  # the real SmolLM2-135M file, compared with transformers
def test_smollm2_quantized_greedy_64_tokens_equal_transformers_generate(smol_q, smol_hf):
    model, tok = smol_q
    prompt = tok.encode("The capital of France is")
    with torch.no_grad():
        expected = smol_hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, pad_token_id=0)
    got = decode.greedy(model, prompts=[prompt], max_new_tokens=64, eos_id=None)
    assert got == expected[:, len(prompt) :].tolist()
    assert len(got[0]) == 64 and "Paris" in tok.decode(got[0])


# ---------------------------------------------------------------------------------------------
# Memory safety: every buffer the kernel reads through a raw pointer is checked first
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("convert", ["half", "bfloat16", "double"])
@pytest.mark.parametrize("kind", KINDS)
def test_dtype_casts_keep_the_scales_float32(kind, convert):
    """``.half()`` / ``.to(torch.bfloat16)`` on a model must not hand float16 scales to a kernel
    that reads float32 (it read past their end and returned values ~1e26 off)."""
    raw, w = random_bytes_blocks(kind, 24, 160, seed=3)
    layer = BlockLinear.from_numpy(raw, kind, 160)
    x = torch.randn(3, 160, generator=torch.Generator().manual_seed(1))
    want = layer(x)
    model = nn.Sequential(layer)
    model.half() if convert == "half" else model.to(getattr(torch, convert))
    assert layer.d.dtype == torch.float32 and (layer.m is None or layer.m.dtype == torch.float32)
    assert layer.codes.dtype == torch.uint8
    assert torch.equal(layer(x), want)  # float32 inputs: the same kernel, the same bits
    assert_float32_accurate(layer(x), x, w, f"{kind} after .{convert}")
    low = x.to(torch.bfloat16)  # other input dtypes compute in their own dtype, from float32 scales
    assert torch.equal(layer(low), torch.nn.functional.linear(low, w.to(torch.bfloat16)))


def _good_args(kind):
    raw, _ = random_blocks(kind, 13, 96, seed=4)
    layer = BlockLinear.from_numpy(raw, kind, 96)
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(2))
    return layer, [layer.codes, layer.d, layer.m, x, kind, 96]


@pytest.mark.parametrize("kind", KINDS)
def test_the_registered_operator_checks_every_buffer(kind):
    layer, args = _good_args(kind)
    op = torch.ops.attnmask.block_matmul
    torch.testing.assert_close(op(*args), layer(args[3]), rtol=0, atol=0)
    torch.library.opcheck(op, tuple(args))  # schema, fake (shape) rule, torch.compile-friendliness
    codes, d, m, x = args[:4]
    bad = {
        "d float16": (1, d.half()),
        "d too short": (1, d[:, :-1].contiguous()),
        "d not contiguous": (1, d.T.contiguous().T),
        "codes as int32": (0, codes.view(torch.int32)),
        "codes row short": (0, codes[:, :-4].contiguous()),
        "x float64": (3, x.double()),
        "x wrong width": (3, torch.randn(2, 64)),
        "x not contiguous": (3, torch.randn(96, 2).T),
        "x on meta": (3, x.to("meta")),  # (the operator hands meta tensors to its shape rule)
    }
    if kind == "Q4_1":
        bad["m missing"] = (2, None)
        bad["m bfloat16"] = (2, m.to(torch.bfloat16))
    else:
        bad["m given"] = (2, d)
    for what, (i, value) in bad.items():
        wrong = list(args)
        wrong[i] = value
        with pytest.raises(ValueError) as python:
            blocks.check_buffers(*wrong[:3], kind, 96, wrong[3])
        if what != "x on meta":
            with pytest.raises(ValueError, match="block kernel|Q4_1 needs|Q8_0 has no") as operator:
                op(*wrong)
            assert str(operator.value) == str(python.value), what  # the C++ checks say what Python's say


def test_the_operator_runs_the_native_kernel_where_it_is_built():
    if not ops.available():
        pytest.skip(f"no native kernels here: {ops.status().why}")
    assert kernel_status().startswith("block kernel in C"), kernel_status()
    layer, args = _good_args("Q4_1")
    x = args[3]
    assert torch.equal(torch.ops.attnmask.block_matmul(*args), layer(x))  # the module calls the operator
    # the PyTorch definition (what runs without the build) computes the same function
    _, bound = float32_error_bound(x, layer.dequantize())
    assert (blocks.block_matmul_reference(*args) - layer(x)).abs().max().item() <= 2 * bound
    assert torch.equal(blocks.block_dequantize_reference(*args[:3], "Q4_1", 96), layer.dequantize())


def test_an_int8_layer_called_first_loads_the_native_kernel():
    """A fresh process whose first product is an int8-activation layer's: the layer builds and loads the
    kernels as the float32 layer does (it used to run the operator's PyTorch definition, 100x slower,
    until something else had loaded them)."""
    if not ops.available():
        pytest.skip(f"no native kernels here: {ops.status().why}")
    code = (
        "import torch; from attnmask import ops; from attnmask.pretrained import quantized as q; "
        "layer = q.BlockLinear(torch.zeros(8, 20, dtype=torch.uint8), 'Q4_1', 32); layer.activations = 'int8'; "
        "layer(torch.ones(1, 32)); print(ops.status().native)"
    )
    assert run_python(code) == ["True"]


def test_without_a_cxx_compiler_the_layer_decodes_its_weights_once(tmp_path):
    """A fresh process (a loaded operator library cannot be unloaded) whose $CXX does not exist."""
    code = (
        "import torch; from attnmask.pretrained import quantized as q; print(q.kernel_status()); "
        "layer = q.BlockLinear(torch.zeros(2, 20, dtype=torch.uint8), 'Q4_1', 32); "
        "print(layer(torch.ones(1, 32)).tolist())"
    )
    status, result = run_python(code, CXX=str(tmp_path / "no-such-c++"), ATTNMASK_CACHE=str(tmp_path))
    assert "decoded once" in status and "no-such-c++" in status, status
    assert result == "[[0.0, 0.0]]"  # zero scales and minimums: zero weights


def test_a_damaged_buffer_is_refused_not_read():
    """A buffer swapped for one of the wrong dtype behind the module's back: one clear error."""
    layer, args = _good_args("Q8_0")
    layer.d = layer.d.half()  # plain attribute assignment bypasses _apply
    with pytest.raises(ValueError, match="d is torch.float16"):
        layer(args[3])


def test_the_operator_composes_with_torch_compile():
    layer, args = _good_args("Q4_1")
    x = args[3]
    compiled = torch.compile(layer, backend="eager", fullgraph=True)  # fullgraph: no break around the kernel
    assert torch.equal(compiled(x), layer(x))


@pytest.mark.slow  # the real SmolLM2-135M file
def test_smollm2_quantized_step_in_one_call_is_the_calls_one_by_one(smol_q, monkeypatch):
    """packed_step (the block operator called from C++) against the per-operation packed step from
    Python, greedy with two rows of different lengths: the same logits up to float32 rounding."""
    from attnmask.decode import steps

    if not ops.available():
        pytest.skip(f"no native build of the operators here: {ops.status().why}")
    model, tok = smol_q
    prompts = [tok.encode("The capital of France is"), tok.encode("Hello")]

    def logits():
        with torch.inference_mode():
            state, first, _ = decode.start(model, prompts=prompts, max_new_tokens=8)
            out = [first]
            for _ in range(6):
                out.append(decode.decode_step(model, state, out[-1].argmax(-1)))
        return torch.stack(out, 1)

    assert steps.fused_plan(model) is not None  # the whole step is one native call
    whole = logits()
    monkeypatch.setattr(steps, "fused_plan", lambda model: None)
    torch.testing.assert_close(logits(), whole, rtol=1e-4, atol=1e-4)


def test_a_block_heads_greedy_batch_reads_its_screen_and_keeps_every_requests_tokens(tmp_path, monkeypatch):
    """Greedy engine steps of BLOCK_SCREEN_MIN_ROWS rows or more find each token from the Q8_0 head's int8 estimates
    (decoding.block_argmax_rows, taken here in every build: where the kernels have no vector loop for the
    estimates, the portable one's values): each request's tokens are the ones it gets alone."""
    from attnmask.engine import Engine, RequestParams
    from attnmask.ops import decoding

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tied=True)
    model, _, _ = load(path, quantized=True, cache=False)
    assert isinstance(model.lm_head, BlockLinear) and model.lm_head.kind == "Q8_0"
    monkeypatch.setattr(decoding, "estimates_fast", lambda: True)
    real, calls = decoding.block_argmax_rows, []

    def counting(h, *rest):
        calls.append(h.shape[0])
        return real(h, *rest)

    monkeypatch.setattr(decoding, "block_argmax_rows", counting)
    prompts = [[1 + (7 * i + j) % 50 for j in range(3 + i % 4)] for i in range(12)]
    params = RequestParams(max_tokens=6, ignore_eos=True)
    together = [c.tokens for c in Engine(model, kv_cache_mib=16).generate(prompts, params)]
    assert calls and max(calls) == 12, "the batch's steps read the head's screen"
    alone = [Engine(model, kv_cache_mib=16).generate([p], params)[0].tokens for p in prompts]
    assert together == alone
