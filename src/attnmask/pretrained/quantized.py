"""Linear layers whose weights stay in llama.cpp's block formats (Q4_1, Q8_0, Q5_0, Q4_K, Q6_K), as GGUF stores them.

:func:`attnmask.pretrained.gguf_file.read_gguf` dequantizes every block to float32, which is the
function the file defines, and reads all 4 bytes of every weight in every decoding step.
:class:`BlockLinear` keeps the file's codes instead (repacked once into the layout the kernel reads;
the values are unchanged) and multiplies by them through the operator
:func:`attnmask.ops.blocks.block_panels_matmul`, from a copy packed once into panels (:meth:`BlockLinear.panels`;
``block_matmul``'s product, the same bits): each block's sum regrouped, activations float32 and never
quantized, so the result equals the float32 product with the dequantized matrix up to rounding
order (tested against a float64 reference), while a one-token step reads 0.75 bytes per Q4_1 weight
instead of 4.

Every float32 CPU input goes through the operator, whatever its number of rows: each output element
is computed by the same operations in the same order whether its row comes alone or in a batch,
and whatever the thread count, so a row's logits do not depend on what else is in the batch, bit
for bit. That costs long prompts some speed against the BLAS on a decoded matrix (figures:
``docs/benchmarks.md``, SmolLM2). Where the native kernels are not built
(:func:`attnmask.ops.available`), each layer decodes its blocks once and keeps the float32 weight
(``F.linear``): the same function, as fast and as large as plain float32 weights. Inputs that need
a gradient, and other dtypes, use the decoded matrix and ``F.linear``.

``activations="int8"`` (an opt-in: ``load(..., quantized=True, activations="int8")``, ``--activations
int8``) multiplies in llama.cpp's arithmetic instead (:func:`attnmask.ops.blocks.block_matmul_i8`):
each input row rounded to 8 bits per block of 32, integer dot products with the codes. Faster on a
CPU (fewer operations per weight), not the float32 function: the activations are rounded. Each row's
result still does not depend on its batch, bit for bit.

Inference only: the block weights are buffers, not parameters, and have no gradient.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnmask import ops
from attnmask.errors import UserError
from attnmask.ops.blocks import (
    BLOCK_BYTES,
    BLOCK_WEIGHTS,
    LAYOUT,
    block_dequantize,
    block_matmul_i8,
    block_panels_matmul,
    float16_scales,
    pack_block_panels,
    repack,
    unpack,
)

__all__ = ["ACTIVATIONS", "BlockLinear", "kernel_status"]

# How a block layer takes its input: "float32" (exact, the default) or "int8" (rounded per block of 32)
ACTIVATIONS = ("float32", "int8")


def kernel_status() -> str:
    """Which implementation :class:`BlockLinear` uses here (building the native kernels if needed)."""
    status = ops.load()
    if status.native:
        return f"block kernel in C ({status.why})"
    return f"float32 weights decoded once, F.linear ({status.why})"


# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------
class BlockLinear(nn.Module):
    """``y = x W^T`` with ``W`` held as GGUF blocks; a drop-in for a bias-free ``nn.Linear`` at inference.

    Args:
        blocks: uint8 ``(out_features, in_features / BLOCK_WEIGHTS[kind] * BLOCK_BYTES[kind])``, the tensor's bytes
            as the GGUF file stores them (rows may be reordered, as for the query/key permutation).
            They are repacked once into the kernel's layout (:func:`repack`); the values are unchanged.
        kind: ``"Q4_1"``, ``"Q8_0"``, ``"Q5_0"``, ``"Q4_K"`` or ``"Q6_K"``.
        in_features: K, a multiple of the block size (32; 256 for Q4_K and Q6_K).
        activations: ``"float32"`` (exact) or ``"int8"`` (llama.cpp's arithmetic, see the module
            docstring); the attribute of that name may be changed afterwards.
    """

    def __init__(self, blocks: Tensor, kind: str, in_features: int, activations: str = "float32"):
        super().__init__()
        if kind not in BLOCK_BYTES:
            raise UserError(f"block format {kind!r} is not supported; expected one of {sorted(BLOCK_BYTES)}")
        size = BLOCK_WEIGHTS[kind]
        if in_features % size:
            raise UserError(f"in_features={in_features} is not a multiple of the block size {size}")
        row_bytes = in_features // size * BLOCK_BYTES[kind]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes:
            raise UserError(
                f"{kind} blocks for in_features={in_features} must be uint8 (out_features, {row_bytes}); "
                f"got {tuple(blocks.shape)} {blocks.dtype}"
            )
        self._adopt(repack(blocks, kind, in_features), kind, in_features, activations)

    def _adopt(self, packed: dict[str, Tensor], kind: str, in_features: int, activations: str) -> None:
        self.kind, self.in_features, self.out_features = kind, in_features, packed["codes"].shape[0]
        self.activations = activations
        self._dense: Tensor | None = None  # the float32 weight, kept only when there is no kernel
        self._panels: tuple[tuple, Tensor, Tensor] | None = None  # (key, panels, empty (N, 0)): see panels()
        for name in ("codes", "d", "m"):
            self.register_buffer(name, packed.get(name))

    @property
    def activations(self) -> str:
        return self._activations

    @activations.setter
    def activations(self, value: str) -> None:
        if value not in ACTIVATIONS:
            raise UserError(f"activations={value!r} is not one of {list(ACTIVATIONS)}")
        self._activations = value

    @classmethod
    def concat(cls, layers: list[BlockLinear]) -> BlockLinear:
        """One layer computing ``cat([layer(x) for layer in layers], -1)`` in one product (rows stacked).

        Formats repacked into one layout stack too (Q5_0 with Q8_0, Q4_K with Q4_1: ``LAYOUT``), each row
        keeping its values; the fused layer is then named by the layout's first format (``Q8_0``,
        ``Q4_1``), whose kernel it runs. Each output is the same bits as in its own layer."""
        kinds, ins = {layer.kind for layer in layers}, {layer.in_features for layer in layers}
        activations = {layer.activations for layer in layers}
        if len(activations) != 1:
            raise UserError(f"only layers of one activations setting concatenate; got {sorted(activations)}")
        if len({LAYOUT[kind] for kind in kinds}) != 1 or len(ins) != 1:
            raise UserError(
                f"only layers of one format and input size concatenate (or formats of one layout: Q5_0 and "
                f"Q8_0, Q4_K and Q4_1); got {sorted(kinds)} and {sorted(ins)}"
            )
        layout = LAYOUT[next(iter(kinds))]
        kind = kinds.pop() if len(kinds) == 1 else next(k for k in LAYOUT if LAYOUT[k] == layout)
        packed = {name: torch.cat([layer._packed()[name] for layer in layers]) for name in layers[0]._packed()}
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused._adopt(packed, kind, ins.pop(), activations.pop())
        return fused

    @classmethod
    def from_numpy(cls, data: np.ndarray, kind: str, in_features: int) -> BlockLinear:
        return cls(torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8)), kind, in_features)

    @property
    def weight(self) -> Tensor:
        """The dequantized float32 weight ``(out, in)``, computed on each access."""
        return self.dequantize()

    def _packed(self) -> dict[str, Tensor]:
        return {name: t for name, t in (("codes", self.codes), ("d", self.d), ("m", self.m)) if t is not None}

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.half()``, ``.cuda()``...: the scales ``d`` and ``m`` follow the device but stay
        float32 (the kernel reads float32; float16/bfloat16 would also round them), codes stay uint8."""
        scales = {name: self._buffers.pop(name) for name in ("d", "m") if self._buffers.get(name) is not None}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, t in scales.items():
                self._buffers[name] = t
        if scales:
            device = fn(torch.empty(0, device=self.codes.device)).device  # where fn sends a float tensor
            for name, t in scales.items():
                self._buffers[name] = t.to(device=device, dtype=torch.float32)
        self._dense = self._panels = None
        return self

    def panels(self) -> tuple[Tensor, Tensor]:
        """The weight in panels (:func:`attnmask.ops.blocks.pack_block_panels`) and an empty ``(N, 0)``
        tensor giving N: what the float32 product reads, packed on first use and kept while the buffers
        stay the same (packed again after a load or an in-place change). A second copy of the codes and
        scales (about as large as they are), the price of the panels' speed."""
        b = self._buffers
        key = tuple((t.data_ptr(), t._version) for t in (b["codes"], b["d"], b["m"]) if t is not None)
        if self._panels is None or self._panels[0] != key:
            # float16 panels where every scale is a float16 value: a GGUF file's always are, scales changed by
            # hand may not be. Traced (torch.compile), the check would read data: the file's case is taken
            # there, and a layer with such scales is packed once before compiling (or refused, clearly).
            half = torch.compiler.is_compiling() or float16_scales(b["d"], b["m"])
            panels = pack_block_panels(b["codes"], b["d"], b["m"], self.kind, self.in_features, half)
            self._panels = (key, panels, b["d"].new_empty(self.out_features, 0))
        return self._panels[1], self._panels[2]

    def dequantize(self) -> Tensor:
        """The float32 weight ``(out, in)``, as ``gguf.dequantize`` gives it."""
        if self.codes.device.type != "cpu" or not ops.available():
            return unpack(self._packed(), self.kind, self.in_features)
        return block_dequantize(self.codes, self.d, self.m, self.kind, self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise UserError(f"input has {x.shape[-1]} features; this layer expects {self.in_features}")
        rows = x.numel() // self.in_features
        if self.activations == "int8":  # the operator (its PyTorch definition where the kernel is not built)
            ops.available()  # build and load the kernels on first use, as the float32 path below does
            xs = x.reshape(rows, self.in_features).float().contiguous()
            out = block_matmul_i8(self.codes, self.d, self.m, xs, self.kind, self.in_features)
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        if not ops.available() or x.device.type != "cpu":  # no kernel: decode the blocks once, keep float32
            if self._dense is None or self._dense.device != x.device:
                self._dense = self.dequantize().to(x.device)
            return F.linear(x, self._dense.to(x.dtype))
        if x.requires_grad or x.dtype != torch.float32:
            return F.linear(x, self.dequantize().to(x.dtype))  # other dtypes compute in their own
        xs = x.reshape(rows, self.in_features).contiguous()  # (rows, K)
        out = block_panels_matmul(self.panels()[0], xs, self.out_features)  # (rows, N), checked in C++
        return out.view(*x.shape[:-1], self.out_features)

    def matmul_rows(self, x: Tensor) -> Tensor:
        """:meth:`forward` for ``x (rows, K)``, float32, on the CPU, without its per-call checks where the
        native kernels are loaded (the operator checks every buffer itself): what the decoding step
        calls when it makes its calls from Python (``_product`` of :mod:`attnmask.decode.step`). Anything
        else goes through :meth:`forward`."""
        fits = x.dim() == 2 and x.is_cpu and x.dtype == torch.float32 and x.is_contiguous() and not x.requires_grad
        if fits and ops.available():
            if self._activations == "int8":
                b = self._buffers  # not self.codes...: nn.Module's __getattr__ costs ~0.6 us a lookup
                return block_matmul_i8(b["codes"], b["d"], b["m"], x, self.kind, self.in_features)
            return block_panels_matmul(self.panels()[0], x, self.out_features)
        return self(x)

    def decoder_operands(self) -> tuple[int, list[Tensor]] | None:
        """This layer as :func:`attnmask.ops.decoding.packed_step` multiplies by it: kind 1 for the 4-bit
        layout (Q4_1, and Q4_K repacked into it), 2 for the 8-bit one (Q8_0, Q5_0) and 3 for the 8-bit one
        with a scale per 16 weights (Q6_K), with ``[panels, empty (N, 0)]`` (:meth:`panels`); 3 more with
        int8 activations (4, 5, 6), with ``[codes, d(, m)]``; None where the kernels are not built (the
        layer then multiplies by its weight itself, which the step leaves to the module)."""
        b = self._buffers  # not self.codes...: nn.Module's __getattr__ costs ~0.6 us a lookup
        layout = LAYOUT[self.kind]
        if not ops.available() or not b["codes"].is_cpu:
            return None
        kind = 1 if layout == "4-bit" else 2 if layout == "8-bit" else 3
        if self._activations != "int8":
            return kind, list(self.panels())
        return kind + 3, [b["codes"], b["d"]] + ([b["m"]] if layout == "4-bit" else [])

    def extra_repr(self) -> str:
        extra = ", activations=int8" if self._activations == "int8" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}{extra}"
