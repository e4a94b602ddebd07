"""Products with weights kept in llama.cpp's block formats (Q4_1, Q8_0), as two PyTorch operators.

A GGUF weight such as SmolLM2's ``Q4_1`` keeps 32 weights in 20 bytes (a float16 scale ``d`` and
minimum ``m``, then 4-bit codes ``q``): weight = ``d * q + m``; ``Q8_0`` keeps a float16 ``d`` and 32
signed bytes: weight = ``d * q``. :func:`repack` moves a GGUF tensor's bytes once into the layout the
kernel reads without byte shuffles (4-bit or 8-bit codes in lane order, ``d`` and ``m`` as float32;
the values are unchanged, :func:`unpack` inverts it exactly).

The operators, each with its PyTorch definition registered for every device (what runs where the
native library is not built) and a C implementation for float32 CPU tensors (``csrc/blocks.cpp``
over ``csrc/blocks_kernel.c``: AVX-512, AVX2/FMA or portable C, rows of W split over PyTorch's
threads with OpenMP):

- ``torch.ops.attnmask.block_matmul(codes, d, m, x, kind, in_features)``: ``x (rows, K) @ W^T``,
  each block's sum regrouped (``d * sum q x + m * sum x``) rather than approximated: activations
  stay float32 and are never quantized, so the result equals the float32 product with the
  dequantized matrix up to summation order. Each output element is computed by the same
  operations in the same order whatever the number of rows and threads (threads split W's rows,
  not the sum), so a row's result does not depend on the batch it comes in, bit for bit;
- ``torch.ops.attnmask.block_dequantize(codes, d, m, kind, in_features)``: the float32 weight.

Both check every buffer before the kernel reads it (:func:`check_buffers`; the C++ checks say the
same words), so nothing reaches a raw pointer that could make it read past an end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnmask.errors import UserError

__all__ = [
    "BLOCK_BYTES",
    "KINDS",
    "QK",
    "block_dequantize",
    "block_matmul",
    "check_buffers",
    "dequantize_blocks",
    "repack",
    "unpack",
]

QK = 32  # weights per block
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # bytes per block in a GGUF file
KINDS = tuple(BLOCK_BYTES)


# ---------------------------------------------------------------------------------------------
# GGUF bytes <-> the kernel's layout (see csrc/blocks_kernel.c), and dequantization in PyTorch
# ---------------------------------------------------------------------------------------------
def _halves(raw: Tensor) -> Tensor:
    """Little-endian float16 pairs of bytes ``(..., 2)`` -> float32."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def dequantize_blocks(blocks: Tensor, kind: str, in_features: int) -> Tensor:
    """Float32 ``(out, in)`` weight of GGUF ``blocks`` (uint8 ``(out, in / 32 * BLOCK_BYTES[kind])``):
    the values ``gguf.dequantize`` gives, ``d * q + m`` (Q4_1) or ``d * q`` (Q8_0) in float32."""
    return unpack(repack(blocks, kind, in_features), kind, in_features)


def repack(blocks: Tensor, kind: str, in_features: int) -> dict[str, Tensor]:
    """GGUF bytes -> the kernel's tensors: ``codes`` (uint8 rows), ``d`` (and ``m`` for Q4_1) float32
    ``(out, blocks)``. Values are moved, not changed: :func:`unpack` inverts it exactly."""
    n, nb = blocks.shape[0], in_features // QK
    b = blocks.reshape(n, nb, BLOCK_BYTES[kind])
    if kind == "Q4_1":
        nbp = nb + nb % 2  # blocks in pairs; a zero block (d = m = 0) pads an odd count
        d, m, qs = _halves(b[..., 0:2]), _halves(b[..., 2:4]), b[..., 4:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1)  # (n, nb, 32) codes in weight order
        if nbp != nb:
            q, d, m = F.pad(q, (0, 0, 0, 1)), F.pad(d, (0, 1)), F.pad(m, (0, 1))
        q = q.reshape(n, nbp // 2, 4, 2, 8)  # weight 8k + i of a pair, k = 2c + h: (pair, c, h, i)
        lanes = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 1, 3, 2)  # byte c of lane i: (pair, i, c)
        return {"codes": lanes.reshape(n, nbp * 16).contiguous(), "d": d.contiguous(), "m": m.contiguous()}
    d, qs = _halves(b[..., 0:2]), b[..., 2:]
    lanes = qs.reshape(n, nb, 4, 8).transpose(2, 3)  # byte k of lane i = weight 8k + i
    return {"codes": lanes.reshape(n, nb * QK).contiguous(), "d": d.contiguous()}


def unpack(packed: dict[str, Tensor], kind: str, in_features: int) -> Tensor:
    """Float32 ``(out, in)`` weight of :func:`repack`'s tensors, in PyTorch (any device)."""
    codes, d = packed["codes"], packed["d"]
    n, nb = codes.shape[0], in_features // QK
    if kind == "Q4_1":
        nbp = d.shape[1]
        lanes = codes.reshape(n, nbp // 2, 8, 4).transpose(2, 3)  # (pair, c, i)
        q = torch.stack([lanes & 15, lanes >> 4], dim=3).reshape(n, nbp, QK)[:, :nb]  # (n, nb, 32)
        w = d[:, :nb, None] * q.float() + packed["m"][:, :nb, None]
    else:
        q = codes.reshape(n, nb, 8, 4).transpose(2, 3).contiguous().view(torch.int8).reshape(n, nb, QK)
        w = q.float() * d[:, :, None]
    return w.reshape(n, in_features)


# ---------------------------------------------------------------------------------------------
# Checks: what the kernel reads through raw pointers
# ---------------------------------------------------------------------------------------------
def _blocks_per_row(kind: str, in_features: int) -> int:
    nb = in_features // QK
    return nb + nb % 2 if kind == "Q4_1" else nb  # Q4_1 pads an odd block count


def check_buffers(codes: Tensor, d: Tensor, m: Tensor | None, kind: str, in_features: int, x: Tensor | None = None):
    """Raise ValueError unless every buffer is what the C kernel reads through its raw pointer:
    on the CPU, contiguous, of the right dtype and exactly the right shape (so no read goes past
    an end). ``x``, when given, must be float32 ``(rows, in_features)``, contiguous."""
    if kind not in BLOCK_BYTES:
        raise UserError(f"block format {kind!r} is not supported; expected one of {sorted(BLOCK_BYTES)}")
    if in_features <= 0 or in_features % QK:
        raise UserError(f"in_features={in_features} is not a positive multiple of the block size {QK}")
    n, nb = codes.shape[0] if codes.dim() == 2 else -1, _blocks_per_row(kind, in_features)
    code_bytes = nb * 16 if kind == "Q4_1" else nb * QK
    want = [("codes", codes, torch.uint8, (n, code_bytes)), ("d", d, torch.float32, (n, nb))]
    if kind == "Q4_1":
        if m is None:
            raise UserError("Q4_1 needs the block minimums m; got None")
        want.append(("m", m, torch.float32, (n, nb)))
    elif m is not None:
        raise UserError("Q8_0 has no block minimums; got an m tensor")
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


def block_dequantize_reference(codes: Tensor, d: Tensor, m: Tensor | None, kind: str, in_features: int) -> Tensor:
    """What ``block_dequantize`` computes, in PyTorch."""
    if codes.device.type == "cpu":
        check_buffers(codes, d, m, kind, in_features)
    packed = {"codes": codes, "d": d} | ({"m": m} if m is not None else {})
    return unpack(packed, kind, in_features)


_LIBRARY = torch.library.Library("attnmask", "FRAGMENT")
_LIBRARY.define("block_matmul(Tensor codes, Tensor d, Tensor? m, Tensor x, str kind, int in_features) -> Tensor")
_LIBRARY.define("block_dequantize(Tensor codes, Tensor d, Tensor? m, str kind, int in_features) -> Tensor")
_LIBRARY.impl("block_matmul", block_matmul_reference, "CompositeExplicitAutograd")
_LIBRARY.impl("block_dequantize", block_dequantize_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("attnmask::block_matmul", lib=_LIBRARY)
def _(codes, d, m, x, kind, in_features):
    torch._check(x.dim() == 2 and x.shape[1] == in_features)
    return x.new_empty(x.shape[0], codes.shape[0])


@torch.library.register_fake("attnmask::block_dequantize", lib=_LIBRARY)
def _(codes, d, m, kind, in_features):
    return d.new_empty(codes.shape[0], in_features)


block_matmul = torch.ops.attnmask.block_matmul.default
block_dequantize = torch.ops.attnmask.block_dequantize.default
