"""Linear layers whose weights stay in llama.cpp's block formats (Q4_1, Q8_0), exactly as a GGUF file stores them.

A GGUF weight such as SmolLM2's ``Q4_1`` keeps 32 weights in 20 bytes (a float16 scale ``d`` and
minimum ``m``, then 4-bit codes ``q``): weight = ``d * q + m``. :func:`attnmask.pretrained.gguf_file.read_gguf`
dequantizes every block to float32, which is the function the file defines, and reads all 4 bytes
of every weight in every decoding step. :class:`BlockLinear` keeps the file's codes instead
(repacked once into a layout the kernel reads without byte shuffles; the values are unchanged)
and multiplies by them directly, regrouping each block's sum (``d * sum q x + m * sum x``) rather
than approximating it: activations stay float32 and are never quantized, so the result equals
the float32 product with the dequantized matrix up to rounding order (tested against a float64
reference). A one-token step then reads 0.75 bytes per Q4_1 weight (4-bit codes, and ``d`` and
``m`` as float32 per 32 weights) instead of 4.

The products run in a small C kernel (``_quantized.c``: AVX-512 or AVX2/FMA, whichever PyTorch
finds the CPU runs, portable C otherwise, rows split over PyTorch's thread count with OpenMP). It
is compiled with the system C compiler the first time it is needed and kept in
``<cache_dir>/kernels`` (see :func:`attnmask.pretrained.cache_dir`), and linked with
``_quantized_op.cpp`` (``$CXX``, PyTorch's headers) into the CPU implementation of the operator
``torch.ops.attnmask.block_matmul``, which eager code and compiled graphs call for ~5 us; without a
C++ compiler the operator runs in Python. Without a C compiler, or with ``ATTNMASK_QUANT_KERNEL=0``,
each layer decodes its blocks once and keeps the float32 weight (``F.linear``): correct, as fast
and as large as plain float32 weights.

Every float32 input goes through the kernel, whatever its number of rows: each output element is
computed by the same operations in the same order whether its row comes alone or in a batch, and
whatever the thread count (threads split the weight's rows, not the sum), so a row's logits do
not depend on what else is in the batch, bit for bit. That costs long prompts some speed: at 256
rows the kernel takes ~1.6x the time of decoding the matrix and calling the float32 BLAS (measured
on a 1536x576 matrix); up to ~64 rows it is faster. Inputs that need a gradient, and other dtypes,
use the decoded matrix and ``F.linear``.

Inference only: the block weights are buffers, not parameters, and have no gradient.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnmask import native
from attnmask.errors import UserError

__all__ = ["BlockLinear", "BLOCK_BYTES", "block_matmul", "check_buffers", "dequantize_blocks", "kernel_status"]

QK = 32  # weights per block
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
_SOURCE = Path(__file__).with_name("_quantized.c")
_OP_SOURCE = Path(__file__).with_name("_quantized_op.cpp")
_lock = threading.Lock()
_state: dict[str, object] = {}
# The C++ operator library this process loaded, if any: a kernel registration cannot be undone,
# so one library serves the process (a second build, e.g. another compiler, runs through ctypes).
_loaded_operator: dict[str, Path] = {}


# ---------------------------------------------------------------------------------------------
# The compiled kernel
# ---------------------------------------------------------------------------------------------
def _flags() -> list[str]:
    return ["-O3", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off", "-fopenmp", *native.simd_flags()]


def _compile(target: Path, flags: list[str], compiler: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        attempts = [flags, [f for f in flags if f != "-fopenmp"]]  # no OpenMP runtime: one thread
        for attempt in attempts:
            try:
                native.run([compiler, *attempt, "-o", str(out), str(_SOURCE)], _SOURCE.name)
            except OSError as err:
                error = err
                continue
            os.replace(out, target)  # atomic: concurrent processes see a whole library or none
            return
        raise error


def _load_kernel():
    """The ctypes library, built on first use; None (after one warning) when it cannot be built.
    Also loads the C++ operator (:func:`_load_operator`) when it can be built."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        lib = None
        _state["operator"] = False
        if os.environ.get("ATTNMASK_QUANT_KERNEL", "1") == "0":
            _state["why"] = "disabled by ATTNMASK_QUANT_KERNEL=0"
        else:
            flags = _flags()
            compiler = native.compiler()
            target = native.cache_dir() / "kernels" / _kernel_name(flags, *compiler)
            try:
                if not target.is_file():
                    _compile(target, flags, compiler[0])
                lib = ctypes.CDLL(str(target))
                _declare(lib)
                simd = {512: "AVX-512", 256: "AVX2"}.get(lib.attnmask_blocks_simd(), "portable C")
                operator = _load_operator(flags, compiler)
                _state["operator"] = operator == ""
                _state["why"] = f"compiled kernel {target} ({simd}); operator {operator or 'in C++'}"
            except (OSError, subprocess.SubprocessError) as err:
                lib = None
                _state["why"] = f"no compiled kernel ({err}); using PyTorch"
                warnings.warn(
                    f"attnmask: block-weight kernel unavailable, falling back to PyTorch (slower): {err}", stacklevel=3
                )
        _state["lib"] = lib
        return lib


def _load_operator(flags: list[str], compiler: tuple[str, str]) -> str:
    """Build (once, into the kernel cache) and load ``_quantized_op.cpp``: the C++ CPU implementation
    of ``torch.ops.attnmask.block_matmul``, linked with this build of the kernel. Returns "" when
    loaded, else why the operator stays in Python (``$CXX`` missing, no PyTorch headers, ...)."""
    cxx = native.compiler("CXX", "c++")
    name = _kernel_name(flags, *compiler, *cxx, torch.__version__, _OP_SOURCE.read_text(encoding="utf-8"))
    target = native.cache_dir() / "kernels" / name.replace("quantized-", "quantized-op-")
    if _loaded_operator:
        loaded = _loaded_operator["path"]
        return "" if loaded == target else f"in Python (this process runs the C++ operator of {loaded.name})"
    try:
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                obj = Path(tmp) / "kernel.o"
                kernel = [f for f in flags if f != "-shared"]
                native.run([compiler[0], *kernel, "-c", str(_SOURCE), "-o", str(obj)], "the kernel object")
                openmp = ["-fopenmp"] if "-fopenmp" in flags else []
                native.build_operator(target, _OP_SOURCE, cxx[0], objects=[obj], flags=openmp)
        torch.ops.load_library(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        return f"in Python ({err})"
    _loaded_operator["path"] = target
    return ""


def _kernel_name(flags: list[str], compiler: str, version: str, *more: str) -> str:
    """File name of the compiled kernel: a hash of the source, the flags, the compiler and its version
    (and ``more``: what else the library is built from)."""
    source = _SOURCE.read_text(encoding="utf-8")
    return native.library_name("quantized", source, " ".join(flags), compiler, version, *more)


def _declare(lib) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.attnmask_q4_1_matmul.argtypes = [p, p, p, p, p, i64, i64, i64, i32]
    lib.attnmask_q8_0_matmul.argtypes = [p, p, p, p, i64, i64, i64, i32]
    lib.attnmask_q4_1_matmul.restype = lib.attnmask_q8_0_matmul.restype = i32
    lib.attnmask_q4_1_dequantize.argtypes = [p, p, p, p, i64, i64, i32]
    lib.attnmask_q8_0_dequantize.argtypes = [p, p, p, i64, i64, i32]
    lib.attnmask_q4_1_dequantize.restype = lib.attnmask_q8_0_dequantize.restype = None
    lib.attnmask_blocks_simd.restype = i32


@torch.compiler.assume_constant_result  # a compiled graph asks once, at trace time
def _kernel_loaded() -> bool:
    return _load_kernel() is not None


def kernel_status() -> str:
    """Which implementation :class:`BlockLinear` uses here (building the kernel if needed)."""
    _load_kernel()
    return str(_state["why"])


# ---------------------------------------------------------------------------------------------
# GGUF bytes <-> the kernel's layout (see _quantized.c), and dequantization in PyTorch
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
    """Float32 ``(out, in)`` weight of :func:`repack`'s tensors, in PyTorch (the fallback path)."""
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
# The kernel as a checked PyTorch operator
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


def _block_matmul(codes: Tensor, d: Tensor, m: Tensor | None, x: Tensor, kind: str, in_features: int) -> Tensor:
    """``x (rows, K) @ W^T`` through the C kernel, every buffer checked first."""
    check_buffers(codes, d, m, kind, in_features, x)
    lib = _state.get("lib") or _load_kernel()
    if lib is None:
        raise RuntimeError(f"the block kernel is not available: {_state['why']}")
    rows, n = x.shape[0], codes.shape[0]
    out = torch.empty(rows, n)
    threads = torch.get_num_threads()
    if kind == "Q4_1":
        status = lib.attnmask_q4_1_matmul(
            codes.data_ptr(), d.data_ptr(), m.data_ptr(), x.data_ptr(), out.data_ptr(), rows, n, in_features, threads
        )
    else:
        status = lib.attnmask_q8_0_matmul(
            codes.data_ptr(), d.data_ptr(), x.data_ptr(), out.data_ptr(), rows, n, in_features, threads
        )
    if status:
        raise MemoryError("the block kernel could not allocate its scratch buffer")
    return out


# The registered operator ``torch.ops.attnmask.block_matmul``: what ``torch.compile`` sees of the
# kernel (an opaque call with a shape rule), with the same buffer checks. Schema, shape rule and
# this Python implementation are defined here, with torch.library.Library rather than @custom_op (no
# autograd wrapper: ~9 us a call instead of ~15); _quantized_op.cpp adds the CPU implementation in
# C++ (~5 us) once the kernel is loaded. A decode step of SmolLM2 calls it 121 times a token.
_LIBRARY = torch.library.Library("attnmask", "DEF")
_LIBRARY.define("block_matmul(Tensor codes, Tensor d, Tensor? m, Tensor x, str kind, int in_features) -> Tensor")
_LIBRARY.impl("block_matmul", _block_matmul, "CompositeExplicitAutograd")


@torch.library.register_fake("attnmask::block_matmul", lib=_LIBRARY)
def _(codes, d, m, x, kind, in_features):
    torch._check(x.dim() == 2 and x.shape[1] == in_features)
    return x.new_empty(x.shape[0], codes.shape[0])


block_matmul = torch.ops.attnmask.block_matmul.default


# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------
class BlockLinear(nn.Module):
    """``y = x W^T`` with ``W`` held as GGUF blocks; a drop-in for a bias-free ``nn.Linear`` at inference.

    Args:
        blocks: uint8 ``(out_features, in_features / 32 * BLOCK_BYTES[kind])``, the tensor's bytes
            as the GGUF file stores them (rows may be reordered, as for the query/key permutation).
            They are repacked once into the kernel's layout (:func:`repack`); the values are unchanged.
        kind: ``"Q4_1"`` or ``"Q8_0"``.
        in_features: K, a multiple of 32.
    """

    def __init__(self, blocks: Tensor, kind: str, in_features: int):
        super().__init__()
        if kind not in BLOCK_BYTES:
            raise UserError(f"block format {kind!r} is not supported; expected one of {sorted(BLOCK_BYTES)}")
        if in_features % QK:
            raise UserError(f"in_features={in_features} is not a multiple of the block size {QK}")
        row_bytes = in_features // QK * BLOCK_BYTES[kind]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes:
            raise UserError(
                f"{kind} blocks for in_features={in_features} must be uint8 (out_features, {row_bytes}); "
                f"got {tuple(blocks.shape)} {blocks.dtype}"
            )
        self._adopt(repack(blocks, kind, in_features), kind, in_features)

    def _adopt(self, packed: dict[str, Tensor], kind: str, in_features: int) -> None:
        self.kind, self.in_features, self.out_features = kind, in_features, packed["codes"].shape[0]
        self._dense: Tensor | None = None  # the float32 weight, kept only when there is no kernel
        for name in ("codes", "d", "m"):
            self.register_buffer(name, packed.get(name))

    @classmethod
    def concat(cls, layers: list[BlockLinear]) -> BlockLinear:
        """One layer computing ``cat([layer(x) for layer in layers], -1)`` in one product (rows stacked)."""
        kinds, ins = {layer.kind for layer in layers}, {layer.in_features for layer in layers}
        if len(kinds) != 1 or len(ins) != 1:
            raise UserError(f"only layers of one format and input size concatenate; got {kinds} and {ins}")
        packed = {name: torch.cat([layer._packed()[name] for layer in layers]) for name in layers[0]._packed()}
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused._adopt(packed, kinds.pop(), ins.pop())
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
        self._dense = None
        return self

    def dequantize(self) -> Tensor:
        lib = _load_kernel()
        if lib is None or self.codes.device.type != "cpu":
            return unpack(self._packed(), self.kind, self.in_features)
        check_buffers(self.codes, self.d, self.m, self.kind, self.in_features)
        out = torch.empty(self.out_features, self.in_features)
        n, k, threads = self.out_features, self.in_features, torch.get_num_threads()
        if self.kind == "Q4_1":
            lib.attnmask_q4_1_dequantize(
                self.codes.data_ptr(), self.d.data_ptr(), self.m.data_ptr(), out.data_ptr(), n, k, threads
            )
        else:
            lib.attnmask_q8_0_dequantize(self.codes.data_ptr(), self.d.data_ptr(), out.data_ptr(), n, k, threads)
        return out

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise UserError(f"input has {x.shape[-1]} features; this layer expects {self.in_features}")
        rows = x.numel() // self.in_features
        if not _kernel_loaded() or x.device.type != "cpu":  # no kernel: decode the blocks once, keep float32
            if self._dense is None or self._dense.device != x.device:
                self._dense = self.dequantize().to(x.device)
            return F.linear(x, self._dense.to(x.dtype))
        if x.requires_grad or x.dtype != torch.float32:
            return F.linear(x, self.dequantize().to(x.dtype))  # other dtypes compute in their own
        xs = x.reshape(rows, self.in_features).contiguous()  # (rows, K)
        args = (self.codes, self.d, self.m, xs, self.kind, self.in_features)
        # compiled graphs call the registered operator; so does eager code where it is in C++ (~2 us a
        # call), else the same checked function without the dispatcher's few microseconds
        in_cxx = torch.compiler.is_compiling() or _state.get("operator")
        out = block_matmul(*args) if in_cxx else _block_matmul(*args)  # (rows, N)
        return out.view(*x.shape[:-1], self.out_features)

    def matmul_rows(self, x: Tensor) -> Tensor:
        """:meth:`forward` for ``x (rows, K)``, float32, on the CPU, without its per-call checks when the
        C++ operator is loaded (the operator checks every buffer itself): what the decoding step calls
        when it makes its calls from Python (:func:`attnmask.decode.static._project`). Anything else
        goes through :meth:`forward`."""
        fits = x.dim() == 2 and x.is_cpu and x.dtype == torch.float32 and x.is_contiguous() and not x.requires_grad
        if fits and _state.get("operator"):
            b = self._buffers  # not self.codes...: nn.Module's __getattr__ costs ~0.6 us a lookup
            return block_matmul(b["codes"], b["d"], b["m"], x, self.kind, self.in_features)
        return self(x)

    def decoder_operands(self) -> tuple[int, list[Tensor]] | None:
        """This layer as :func:`attnmask.decode.fused.decoder_step` multiplies by it: ``(kind, [codes,
        d(, m)])``, kind 1 for Q4_1 and 2 for Q8_0; None where the kernel is not built (the layer then
        multiplies by its dequantized weight, which the step leaves to the module)."""
        b = self._buffers  # not self.codes...: nn.Module's __getattr__ costs ~0.6 us a lookup
        lib = _state["lib"] if "lib" in _state else _load_kernel()
        if lib is None or not b["codes"].is_cpu:
            return None
        return (1, [b["codes"], b["d"], b["m"]]) if self.kind == "Q4_1" else (2, [b["codes"], b["d"]])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"
