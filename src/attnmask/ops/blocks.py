"""Products with weights kept in llama.cpp's block formats (Q4_1, Q8_0, Q5_0, Q4_K, Q6_K), as two PyTorch operators.

A GGUF weight such as SmolLM2's ``Q4_1`` keeps 32 weights in 20 bytes (a float16 scale ``d`` and
minimum ``m``, then 4-bit codes ``q``): weight = ``d * q + m``; ``Q8_0`` keeps a float16 ``d`` and 32
signed bytes: weight = ``d * q``; ``Q5_0`` a float16 ``d``, 32 high bits and 16 bytes of low
nibbles: weight = ``d * (q - 16)``. The K-quants keep 256 weights in a super-block with float16
``d`` (and ``dmin``) and a scale per sub-block: ``Q4_K`` 8 sub-blocks of 32 with 6-bit scales ``sc``
and offsets ``mn``, weight = ``(d * sc) * q - dmin * mn``; ``Q6_K`` 16 sub-blocks of 16 with int8
scales, 6-bit codes, weight = ``(d * sc) * (q - 32)``.

:func:`repack` moves a GGUF tensor's bytes once into one of three layouts the kernel reads without
byte shuffles (:data:`LAYOUT`): **4-bit** codes in lane order with float32 ``d`` and ``m`` per 32
weights (Q4_1; Q4_K with ``d = d * sc`` and ``m = -(dmin * mn)``), **8-bit** signed codes in planes
of 8 weights, two blocks side by side, with a float32 ``d`` per 32 weights (Q8_0; Q5_0 as ``q - 16``)
and **8-bit/16**, the same with
a ``d`` per 16 weights (Q6_K: ``q - 32`` and ``d * sc``). The values are unchanged: the K-quants'
scale products are taken once per sub-block in float32, as ``gguf.dequantize`` takes them, and
:func:`unpack` gives back the weight ``gguf.dequantize`` gives, bit for bit. (The 8-bit layout
spends a byte on each 5- or 6-bit code, and the 4-bit one 8 bytes of float32 scales per 32 Q4_K
weights: memory traded for one kernel per layout.)

The operators, each with its PyTorch definition registered for every device (what runs where the
native library is not built) and a C implementation for float32 CPU tensors (``csrc/blocks.cpp``
over ``csrc/blocks_kernel.c``: AVX-512, AVX2/FMA or portable C, rows of W split over PyTorch's
threads with OpenMP):

- ``torch.ops.attnmask.block_matmul(codes, d, m, x, kind, in_features)``: ``x (rows, K) @ W^T``,
  each block's (sub-block's) sum regrouped (``d * sum q x + m * sum x``) rather than approximated: activations
  stay float32 and are never quantized, so the result equals the float32 product with the
  dequantized matrix up to summation order. Each output element is computed by the same
  operations in the same order whatever the number of rows and threads (threads split W's rows,
  not the sum), so a row's result does not depend on the batch it comes in, bit for bit;
- ``torch.ops.attnmask.block_matmul_i8(codes, d, m, x, kind, in_features)``: the same product in
  llama.cpp's arithmetic, an opt-in (:func:`quantize_activations`): each row of ``x`` rounded to 8
  bits per block of 32 (a float scale ``dx`` a block), then ``d * dx * sum q_w q_x`` per block with
  the integer sums exact (``+ m * dx * sum q_x`` for the 4-bit layout): the product of the dequantized
  weight with the rounded activations. Not the float32 product: the activations are rounded (about
  1e-2 relative on a product's outputs). Each output element is again computed by the same operations in the same order
  whatever the rows and threads, so a row's result does not depend on its batch, bit for bit;
- ``torch.ops.attnmask.block_dequantize(codes, d, m, kind, in_features)``: the float32 weight;
- ``torch.ops.attnmask.pack_block_panels(codes, d, m, kind, in_features, half_scales=True)`` and
  ``torch.ops.attnmask.block_panels_matmul(panels, x, out_features)``: ``block_matmul``'s float32
  product in two parts, the weight moved once into panels (its rows 16 at a time side by side, one unit
  of bytes per block: :data:`PANEL_UNIT`; the scales in float16 where the format stores them so,
  :data:`PANEL_LAYOUT`), then the product from them, the same bits as
  ``block_matmul``, which packs for each call. The panels are a second copy of the codes and scales,
  what a layer keeps to decode (:class:`attnmask.pretrained.quantized.BlockLinear`): with the weight's
  rows in vector lanes, a block's products are multiply-adds against one broadcast activation, with no
  sums across lanes (``csrc/blocks_kernel.c``).

They check every buffer before the kernel reads it (:func:`check_buffers`; the C++ checks say the
same words), so nothing reaches a raw pointer that could make it read past an end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnmask.errors import UserError

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_WEIGHTS",
    "KINDS",
    "LAYOUT",
    "QK",
    "QK_K",
    "block_dequantize",
    "block_matmul",
    "block_matmul_i8",
    "block_panels_estimate",
    "block_panels_matmul",
    "check_buffers",
    "dequantize_blocks",
    "float16_scales",
    "pack_block_panels",
    "quantize_activations",
    "repack",
    "unpack",
    "unpack_block_panels",
]

QK = 32  # weights per block of Q4_1, Q5_0 and Q8_0, and per scale of the kernel's 4-bit and 8-bit layouts
QK_K = 256  # weights per super-block of Q4_K and Q6_K
BLOCK_WEIGHTS = {"Q4_1": QK, "Q5_0": QK, "Q8_0": QK, "Q4_K": QK_K, "Q6_K": QK_K}  # weights per GGUF block
BLOCK_BYTES = {"Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}  # bytes per block in a GGUF file
KINDS = tuple(BLOCK_BYTES)
# The layout each format is repacked into, and so the loops that multiply by it (csrc/blocks_kernel.c):
# "4-bit" codes 0..15 with a scale d and an offset m per 32 weights, "8-bit" signed codes with a scale
# per 32 weights, "8-bit/16" signed codes with a scale per 16 weights.
LAYOUT = {"Q4_1": "4-bit", "Q4_K": "4-bit", "Q8_0": "8-bit", "Q5_0": "8-bit", "Q6_K": "8-bit/16"}


# ---------------------------------------------------------------------------------------------
# GGUF bytes <-> the kernel's layout (see csrc/blocks_kernel.c), and dequantization in PyTorch
# ---------------------------------------------------------------------------------------------
def _halves(raw: Tensor) -> Tensor:
    """Little-endian float16 pairs of bytes ``(..., 2)`` -> float32."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _bits(raw: Tensor, shifts: list[int], mask: int) -> Tensor:
    """``(raw[..., None, :] >> shift) & mask`` for each shift: ``(..., len(shifts), bytes)``."""
    return (raw[..., None, :] >> torch.tensor(shifts, dtype=torch.uint8)[:, None]) & mask


def dequantize_blocks(blocks: Tensor, kind: str, in_features: int) -> Tensor:
    """Float32 ``(out, in)`` weight of GGUF ``blocks`` (uint8 ``(out, in / BLOCK_WEIGHTS[kind] *
    BLOCK_BYTES[kind])``): the values ``gguf.dequantize`` gives, bit for bit (``d * q + m`` for Q4_1,
    ``d * q`` for Q8_0, ``d * (q - 16)`` for Q5_0, ``(d * sc) * q - dmin * m`` for Q4_K,
    ``(d * sc) * (q - 32)`` for Q6_K, each product in float32)."""
    return unpack(repack(blocks, kind, in_features), kind, in_features)


def _codes(blocks: Tensor, kind: str, in_features: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """GGUF bytes -> ``(q, d, m)``: the codes in weight order, uint8 ``(n, K / 32, 32)`` (4-bit layout)
    or int8 (8-bit layouts), and their float32 scales (and offsets) per 32 (Q6_K: 16) weights; the
    weight is ``d * q + m`` (4-bit) or ``d * q``, in float32, as ``gguf.dequantize`` computes it."""
    n = blocks.shape[0]
    b = blocks.reshape(n, in_features // BLOCK_WEIGHTS[kind], BLOCK_BYTES[kind])
    if kind == "Q4_1":
        qs = b[..., 4:]
        return torch.cat([qs & 15, qs >> 4], dim=-1), _halves(b[..., 0:2]), _halves(b[..., 2:4])
    if kind == "Q8_0":
        return b[..., 2:].view(torch.int8), _halves(b[..., 0:2]), None
    if kind == "Q5_0":  # d, 32 high bits (bit j: weight j), 16 bytes of low nibbles (weights j and j + 16)
        high = _bits(b[..., 2:6], list(range(8)), 1).transpose(-1, -2)  # bit i of byte c: weight 8c + i
        high = high.reshape(n, -1, QK)
        q = torch.cat([b[..., 6:] & 15, b[..., 6:] >> 4], dim=-1) | (high << 4)
        return q.view(torch.int8) - 16, _halves(b[..., 0:2]), None
    if kind == "Q4_K":  # d, dmin, 12 bytes of 6-bit scales and offsets, 128 bytes of nibbles
        d, dmin, s = _halves(b[..., 0:2]), _halves(b[..., 2:4]), b[..., 4:16].reshape(n, -1, 3, 4)
        sc = torch.cat([s[..., 0, :] & 63, (s[..., 2, :] & 15) | ((s[..., 0, :] >> 2) & 48)], dim=-1)  # (n, nsb, 8)
        mn = torch.cat([s[..., 1, :] & 63, (s[..., 2, :] >> 4) | ((s[..., 1, :] >> 2) & 48)], dim=-1)
        q = _bits(b[..., 16:].reshape(n, -1, 4, 32), [0, 4], 15)  # chunk c: sub-blocks 2c (low), 2c + 1 (high)
        ds, dm = d[..., None] * sc.float(), dmin[..., None] * mn.float()  # float32, once per sub-block
        return q.reshape(n, -1, QK), ds.reshape(n, -1), -dm.reshape(n, -1)  # d q - dm = d q + (-dm), exactly
    if kind == "Q6_K":  # 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales, d
        low = _bits(b[..., :128].reshape(n, -1, 2, 64), [0, 4], 15)  # (n, nsb, 2, 2, 64): weights 128h + 64s + l
        high = _bits(b[..., 128:192].reshape(n, -1, 2, 32), [0, 2, 4, 6], 3)  # (n, nsb, 2, 4, 32): 128h + 32s + l
        q = low.reshape(n, -1, 2, 128) | (high.reshape(n, -1, 2, 128) << 4)
        sc = b[..., 192:208].view(torch.int8).float()  # (n, nsb, 16)
        ds = _halves(b[..., 208:210])[..., None] * sc  # float32, once per sub-block of 16
        return q.view(torch.int8).reshape(n, -1, QK) - 32, ds.reshape(n, -1), None
    raise UserError(f"block format {kind!r} is not supported; expected one of {sorted(BLOCK_BYTES)}")


def repack(blocks: Tensor, kind: str, in_features: int) -> dict[str, Tensor]:
    """GGUF bytes -> the kernel's tensors: ``codes`` (uint8 rows), ``d`` (and ``m`` for the 4-bit
    layout) float32 ``(out, scales)``. Values are moved, not changed (the K-quants' scale products
    ``d * sc`` and ``dmin * m`` are taken once, in float32, as ``gguf.dequantize`` takes them):
    :func:`unpack` gives the weight ``gguf.dequantize`` gives, bit for bit."""
    q, d, m = _codes(blocks, kind, in_features)
    n, nb = q.shape[0], q.shape[1]
    if LAYOUT[kind] == "4-bit":
        nbp = nb + nb % 2  # blocks in pairs; a zero block (d = m = 0) pads an odd count
        if nbp != nb:
            q, d, m = F.pad(q, (0, 0, 0, 1)), F.pad(d, (0, 1)), F.pad(m, (0, 1))
        q = q.reshape(n, nbp // 2, 4, 2, 8)  # weight 8k + i of a pair, k = 2c + h: (pair, c, h, i)
        lanes = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 1, 3, 2)  # byte c of lane i: (pair, i, c)
        return {"codes": lanes.reshape(n, nbp * 16).contiguous(), "d": d.contiguous(), "m": m.contiguous()}
    q, pairs = q.view(torch.uint8), nb // 2 * 2
    planes = q[:, :pairs].reshape(n, nb // 2, 2, 4, 8).transpose(2, 3)  # plane k: weights 8k..8k + 7 of both blocks
    codes = torch.cat([planes.reshape(n, -1), q[:, pairs:].reshape(n, -1)], dim=1)  # an odd last block in order
    return {"codes": codes.contiguous(), "d": d.contiguous()}


def _weight_codes(packed: dict[str, Tensor], kind: str, in_features: int) -> Tensor:
    """The codes of :func:`repack`'s tensors in weight order: ``(out, in / 32, 32)``, uint8 (4-bit layout)
    or int8."""
    codes = packed["codes"]
    n, nb = codes.shape[0], in_features // QK
    if LAYOUT[kind] == "4-bit":
        nbp = nb + nb % 2
        lanes = codes.reshape(n, nbp // 2, 8, 4).transpose(2, 3)  # (pair, c, i)
        return torch.stack([lanes & 15, lanes >> 4], dim=3).reshape(n, nbp, QK)[:, :nb]
    pairs = nb // 2 * 2
    planes = codes[:, : pairs * QK].reshape(n, nb // 2, 4, 2, 8).transpose(2, 3)  # (pair, block, k, i)
    q = torch.cat([planes.reshape(n, pairs, QK), codes[:, pairs * QK :].reshape(n, -1, QK)], dim=1)
    return q.view(torch.int8)


def unpack(packed: dict[str, Tensor], kind: str, in_features: int) -> Tensor:
    """Float32 ``(out, in)`` weight of :func:`repack`'s tensors, in PyTorch (any device)."""
    q, d = _weight_codes(packed, kind, in_features), packed["d"]
    n, nb = q.shape[0], in_features // QK
    if LAYOUT[kind] == "4-bit":
        w = d[:, :nb, None] * q.float() + packed["m"][:, :nb, None]
    else:
        per = d.shape[1] // nb  # scales per block: 1, or 2 (Q6_K: weights 0..15 and 16..31)
        w = q.reshape(n, nb * per, QK // per).float() * d[:, :, None]
    return w.reshape(n, in_features)


# Panels (csrc/blocks_kernel.c): weight rows PANEL_COLUMNS at a time, one unit of bytes per group and block:
# 4-bit 4 x 64 bytes of codes (vector j, lane l: weight 8j + i of row l in bits 4i..4i+3), d[16], m[16];
# 8-bit 32 x 16 signed bytes (row k, lane l: weight k of row l), d[16]; 8-bit/16 (blocks of 16) the same
# with 16 rows of codes, d[16] and 16 bytes of padding (every unit size its own: the product tells the
# layout by it). Scales float32, or float16 in the "/f16" layouts: the formats whose GGUF blocks store
# them as float16 (PANEL_LAYOUT), the same values in fewer bytes (a Q4_1 unit 320 bytes instead of 384).
# PANEL_UNIT: bytes per unit; PANEL_BLOCK: weights per unit along K.
PANEL_COLUMNS = 16
PANEL_UNIT = {"4-bit": 384, "8-bit": 576, "8-bit/16": 336, "4-bit/f16": 320, "8-bit/f16": 544}
PANEL_BLOCK = {"4-bit": QK, "8-bit": QK, "8-bit/16": 16, "4-bit/f16": QK, "8-bit/f16": QK}
PANEL_LAYOUT = {"Q4_1": "4-bit/f16", "Q4_K": "4-bit", "Q8_0": "8-bit/f16", "Q5_0": "8-bit/f16", "Q6_K": "8-bit/16"}


def _panel_layout(kind: str, half_scales: bool) -> str:
    """The panels' layout ``pack_block_panels`` writes for ``kind`` (float32 scales unless ``half_scales``)."""
    return PANEL_LAYOUT[kind] if half_scales else PANEL_LAYOUT[kind].removesuffix("/f16")


def _float_bytes(t: Tensor) -> Tensor:
    """float32 (or float16) ``(..., 16)`` -> its bytes ``(..., 64)`` (``(..., 32)``)."""
    return t.contiguous().view(torch.uint8)


def pack_block_panels_reference(
    codes: Tensor, d: Tensor, m: Tensor | None, kind: str, in_features: int, half_scales: bool = True
) -> Tensor:
    """What ``pack_block_panels`` computes, in PyTorch: :func:`repack`'s tensors in panels, uint8
    ``(ceil(out / 16), in / block, unit)``, rows past ``out`` zero, in the layout :data:`PANEL_LAYOUT`
    names (ValueError where a float16 layout's scale is not a float16 value: scales changed by hand).
    ``half_scales=False``: the float32-scale layout of the same codes (``"4-bit"``, ``"8-bit"``), which any
    scales fit, the same products bit for bit (:func:`float16_scales` says which a layer's take)."""
    if codes.device.type == "cpu":
        check_buffers(codes, d, m, kind, in_features)
    layout = _panel_layout(kind, half_scales)
    if layout.endswith("/f16") and not float16_scales(d, m):
        raise UserError(
            f"pack_block_panels: a {kind} scale is not a float16 value (a GGUF {kind} block stores its "
            f"scales as float16); expected d{' and m' if m is not None else ''} from "
            "attnmask.ops.blocks.repack, or half_scales=False"
        )
    packed = {"codes": codes, "d": d} | ({"m": m} if m is not None else {})
    q = _weight_codes(packed, kind, in_features).view(torch.uint8)  # (n, nb, 32)
    n, blk = q.shape[0], PANEL_BLOCK[layout]
    rows = -(-n // PANEL_COLUMNS) * PANEL_COLUMNS
    nblk = in_features // blk
    q = F.pad(q.reshape(n, nblk, blk), (0, 0, 0, 0, 0, rows - n)).reshape(-1, PANEL_COLUMNS, nblk, blk)

    def scale(t: Tensor) -> Tensor:  # (n, nblk) float32 -> (groups, nblk, 64 or 32) bytes
        t = t.half() if layout.endswith("/f16") else t
        return _float_bytes(F.pad(t[:, :nblk], (0, 0, 0, rows - n)).reshape(-1, PANEL_COLUMNS, nblk).transpose(1, 2))

    if layout.startswith("4-bit"):  # byte c of lane l in vector j: weights 8j + 2c (low nibble) and 8j + 2c + 1
        q = q.reshape(-1, PANEL_COLUMNS, nblk, 4, 4, 2)
        lanes = (q[..., 0] | (q[..., 1] << 4)).permute(0, 2, 3, 1, 4)  # (group, block, j, lane, byte)
        parts = [lanes.reshape(-1, nblk, 256), scale(d), scale(m)]
    else:
        parts = [q.permute(0, 2, 3, 1).reshape(-1, nblk, blk * PANEL_COLUMNS), scale(d)]
        if layout == "8-bit/16":
            parts.append(parts[0].new_zeros(parts[0].shape[0], nblk, 16))  # the padding
    return torch.cat(parts, dim=-1).contiguous()


def float16_scales(d: Tensor, m: Tensor | None = None) -> bool:
    """Whether every scale is a float16 value (a GGUF Q4_1, Q8_0 or Q5_0 block's always are; scales
    changed by hand may not be): ``pack_block_panels``' ``half_scales``."""
    return all(t is None or torch.equal(t.half().float(), t) for t in (d, m))


def unpack_block_panels(panels: Tensor, out_features: int) -> Tensor:
    """Float32 ``(out_features, K)`` weight of panels, in PyTorch (any device)."""
    layout = {unit: name for name, unit in PANEL_UNIT.items()}.get(panels.shape[-1])
    if panels.dim() != 3 or layout is None or panels.shape[0] != -(-out_features // PANEL_COLUMNS):
        raise UserError(
            f"panels of shape {tuple(panels.shape)} do not hold {out_features} outputs; expected "
            f"(ceil(out_features / {PANEL_COLUMNS}), blocks, {' | '.join(map(str, PANEL_UNIT.values()))})"
        )
    groups, nblk, blk = panels.shape[0], panels.shape[1], PANEL_BLOCK[layout]
    code_bytes = 256 if layout.startswith("4-bit") else blk * PANEL_COLUMNS
    width, dtype = (32, torch.float16) if layout.endswith("/f16") else (64, torch.float32)
    floats = lambda at: panels[..., at : at + width].contiguous().view(dtype).float()  # noqa: E731 (g, nblk, 16)
    d = floats(code_bytes)
    if layout.startswith("4-bit"):
        lanes = panels[..., :256].reshape(groups, nblk, 4, PANEL_COLUMNS, 4)  # (g, b, j, lane, byte)
        q = torch.stack([lanes & 15, lanes >> 4], dim=-1).reshape(groups, nblk, 4, PANEL_COLUMNS, 8)
        q = q.permute(0, 3, 1, 2, 4).reshape(groups, PANEL_COLUMNS, nblk, blk).float()
        w = d.transpose(1, 2)[..., None] * q + floats(code_bytes + width).transpose(1, 2)[..., None]
    else:
        q = panels[..., :code_bytes].reshape(groups, nblk, blk, PANEL_COLUMNS).view(torch.int8)
        w = q.permute(0, 3, 1, 2).float() * d.transpose(1, 2)[..., None]
    return w.reshape(groups * PANEL_COLUMNS, nblk * blk)[:out_features]


# ---------------------------------------------------------------------------------------------
# Checks: what the kernel reads through raw pointers
# ---------------------------------------------------------------------------------------------
def _shapes(kind: str, in_features: int) -> tuple[int, int]:
    """(code bytes, scales) per row of the kernel's layout for ``kind``."""
    nb = in_features // QK
    if LAYOUT[kind] == "4-bit":
        nbp = nb + nb % 2  # pads an odd block count
        return nbp * 16, nbp
    return in_features, nb * (2 if LAYOUT[kind] == "8-bit/16" else 1)


def check_buffers(codes: Tensor, d: Tensor, m: Tensor | None, kind: str, in_features: int, x: Tensor | None = None):
    """Raise ValueError unless every buffer is what the C kernel reads through its raw pointer:
    on the CPU, contiguous, of the right dtype and exactly the right shape (so no read goes past
    an end). ``x``, when given, must be float32 ``(rows, in_features)``, contiguous."""
    if kind not in BLOCK_BYTES:
        raise UserError(f"block format {kind!r} is not supported; expected one of {sorted(BLOCK_BYTES)}")
    size = BLOCK_WEIGHTS[kind]
    if in_features <= 0 or in_features % size:
        raise UserError(f"in_features={in_features} is not a positive multiple of the block size {size}")
    n = codes.shape[0] if codes.dim() == 2 else -1
    code_bytes, scales = _shapes(kind, in_features)
    want = [("codes", codes, torch.uint8, (n, code_bytes)), ("d", d, torch.float32, (n, scales))]
    if LAYOUT[kind] == "4-bit":
        if m is None:
            raise UserError(f"{kind} needs the block minimums m; got None")
        want.append(("m", m, torch.float32, (n, scales)))
    elif m is not None:
        raise UserError(f"{kind} has no block minimums; got an m tensor")
    if x is not None:
        want.append(("x", x, torch.float32, (x.shape[0] if x.dim() == 2 else -1, in_features)))
    for name, t, dtype, shape in want:
        if t.device.type != "cpu":
            raise UserError(f"block kernel: {name} is on {t.device}; the kernel reads CPU memory")
        if t.dtype != dtype:
            raise UserError(f"block kernel: {name} is {t.dtype}; the kernel reads {dtype}")
        if tuple(t.shape) != shape or n < 0:
            raise UserError(f"block kernel: {name} has shape {tuple(t.shape)}; expected {shape} for {kind}")
        if not t.is_contiguous():
            raise UserError(f"block kernel: {name} is not contiguous")


# ---------------------------------------------------------------------------------------------
# The operators. Schemas and shape rules here, with torch.library.Library rather than @custom_op
# (no autograd wrapper: a few microseconds less a call, and a SmolLM2 step makes 121 of them).
# The PyTorch definitions are the CompositeExplicitAutograd kernels: what runs on every device
# where no faster kernel is registered; csrc/blocks.cpp registers the CPU ones.
# ---------------------------------------------------------------------------------------------
def block_matmul_reference(codes: Tensor, d: Tensor, m: Tensor | None, x: Tensor, kind: str, in_features: int):
    """What ``block_matmul`` computes, in PyTorch: the float32 product with the dequantized weight."""
    if x.device.type == "cpu":
        check_buffers(codes, d, m, kind, in_features, x)
    packed = {"codes": codes, "d": d} | ({"m": m} if m is not None else {})
    return F.linear(x, unpack(packed, kind, in_features).to(x.dtype))


def block_panels_matmul_reference(panels: Tensor, x: Tensor, out_features: int) -> Tensor:
    """What ``block_panels_matmul`` computes, in PyTorch: the float32 product with the weight the panels hold."""
    return F.linear(x, unpack_block_panels(panels, out_features).to(x.dtype))


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x (rows, K)`` float32 -> ``(q, dx)``: ``block_matmul_i8``'s 8-bit activations, ``q`` float32
    integers ``(rows, K)`` in -127..127 and ``dx`` float32 ``(rows, K / 32)``, ``x ~ dx * q`` per block
    of 32: ``dx = max|x| / 127``, ``q = x * (127 / max|x|)`` rounded to the nearest integer, ties to
    even (a block whose ``max|x| < 2^-120``: ``q = 0``), each step in float32 as the C kernel takes it."""
    rows, k = x.shape
    xb = x.float().reshape(rows, k // QK, QK)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax >= 2.0**-120, 127.0 / amax.clamp_min(2.0**-120), 0.0)  # below, 127 / amax could overflow
    return torch.round(xb * inv[..., None]).reshape(rows, k), amax / 127.0


def block_matmul_i8_reference(codes: Tensor, d: Tensor, m: Tensor | None, x: Tensor, kind: str, in_features: int):
    """What ``block_matmul_i8`` computes, in PyTorch: the product of the dequantized weight with the
    8-bit activations of :func:`quantize_activations` scaled back (``dx * q``); for the 4-bit layout the
    ``m`` term apart, ``m * (dx * sum q)``, as the kernel takes it. Equal to the kernel's up to the
    order and rounding of its float sums."""
    if x.device.type == "cpu":
        check_buffers(codes, d, m, kind, in_features, x)
    q, dx = quantize_activations(x)
    nb = in_features // QK
    xq = (q.reshape(x.shape[0], nb, QK) * dx[..., None]).reshape(x.shape)
    if m is None:
        return F.linear(xq, unpack({"codes": codes, "d": d}, kind, in_features)).to(x.dtype)
    w = unpack({"codes": codes, "d": d, "m": torch.zeros_like(m)}, kind, in_features)  # d * q alone
    sums = q.reshape(x.shape[0], nb, QK).sum(-1) * dx  # (rows, nb): dx * sum q, the integer sum exact
    return (F.linear(xq, w) + sums @ m[:, :nb].t()).to(x.dtype)


def block_panels_estimate_reference(panels: Tensor, x: Tensor, out_features: int) -> tuple[Tensor, Tensor]:
    """What ``block_panels_estimate`` computes, in PyTorch: the product of the 8-bit panels' weight with the
    8-bit activations of :func:`quantize_activations` scaled back (``dx * q``), and each row's
    ``||x - dx q||`` in float64. Equal to the kernel's up to the order and rounding of its float sums."""
    q, dx = quantize_activations(x)
    rows, k = x.shape
    xq = (q.reshape(rows, k // QK, QK) * dx[..., None]).reshape(rows, k)
    xerr = (x.double() - (q.double().reshape(rows, k // QK, QK) * dx.double()[..., None]).reshape(rows, k)).norm(dim=1)
    return F.linear(xq, unpack_block_panels(panels, out_features).to(x.dtype)), xerr


def block_dequantize_reference(codes: Tensor, d: Tensor, m: Tensor | None, kind: str, in_features: int) -> Tensor:
    """What ``block_dequantize`` computes, in PyTorch."""
    if codes.device.type == "cpu":
        check_buffers(codes, d, m, kind, in_features)
    packed = {"codes": codes, "d": d} | ({"m": m} if m is not None else {})
    return unpack(packed, kind, in_features)


_LIBRARY = torch.library.Library("attnmask", "FRAGMENT")
_LIBRARY.define("block_matmul(Tensor codes, Tensor d, Tensor? m, Tensor x, str kind, int in_features) -> Tensor")
_LIBRARY.define("block_matmul_i8(Tensor codes, Tensor d, Tensor? m, Tensor x, str kind, int in_features) -> Tensor")
_LIBRARY.define("block_dequantize(Tensor codes, Tensor d, Tensor? m, str kind, int in_features) -> Tensor")
_LIBRARY.impl("block_matmul", block_matmul_reference, "CompositeExplicitAutograd")
_LIBRARY.impl("block_matmul_i8", block_matmul_i8_reference, "CompositeExplicitAutograd")
_LIBRARY.impl("block_dequantize", block_dequantize_reference, "CompositeExplicitAutograd")
_LIBRARY.define(
    "pack_block_panels(Tensor codes, Tensor d, Tensor? m, str kind, int in_features, bool half_scales=True) -> Tensor"
)
_LIBRARY.define("block_panels_matmul(Tensor panels, Tensor x, int out_features) -> Tensor")
_LIBRARY.impl("pack_block_panels", pack_block_panels_reference, "CompositeExplicitAutograd")
_LIBRARY.impl("block_panels_matmul", block_panels_matmul_reference, "CompositeExplicitAutograd")
_LIBRARY.define("block_panels_estimate(Tensor panels, Tensor x, int out_features) -> (Tensor, Tensor)")
_LIBRARY.impl("block_panels_estimate", block_panels_estimate_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("attnmask::block_matmul", lib=_LIBRARY)
def _(codes, d, m, x, kind, in_features):
    torch._check(x.dim() == 2 and x.shape[1] == in_features)
    return x.new_empty(x.shape[0], codes.shape[0])


@torch.library.register_fake("attnmask::block_matmul_i8", lib=_LIBRARY)
def _(codes, d, m, x, kind, in_features):
    torch._check(x.dim() == 2 and x.shape[1] == in_features)
    return x.new_empty(x.shape[0], codes.shape[0])


@torch.library.register_fake("attnmask::block_dequantize", lib=_LIBRARY)
def _(codes, d, m, kind, in_features):
    return d.new_empty(codes.shape[0], in_features)


@torch.library.register_fake("attnmask::pack_block_panels", lib=_LIBRARY)
def _(codes, d, m, kind, in_features, half_scales=True):
    layout = _panel_layout(kind, half_scales)
    groups = -(-codes.shape[0] // PANEL_COLUMNS)
    return codes.new_empty(groups, in_features // PANEL_BLOCK[layout], PANEL_UNIT[layout])


@torch.library.register_fake("attnmask::block_panels_matmul", lib=_LIBRARY)
def _(panels, x, out_features):
    return x.new_empty(x.shape[0], out_features)


@torch.library.register_fake("attnmask::block_panels_estimate", lib=_LIBRARY)
def _(panels, x, out_features):
    return x.new_empty(x.shape[0], out_features), x.new_empty(x.shape[0], dtype=torch.float64)


block_matmul = torch.ops.attnmask.block_matmul.default
block_matmul_i8 = torch.ops.attnmask.block_matmul_i8.default
block_dequantize = torch.ops.attnmask.block_dequantize.default
pack_block_panels = torch.ops.attnmask.pack_block_panels.default
block_panels_matmul = torch.ops.attnmask.block_panels_matmul.default
block_panels_estimate = torch.ops.attnmask.block_panels_estimate.default
