"""Float32 matrix products on the CPU in either of the two libraries inside PyTorch.

PyTorch computes a float32 ``F.linear`` on the CPU in the BLAS it was built with (MKL on x86), and
MKL runs its AVX2 code on AMD processors. oneDNN, which PyTorch also carries (it serves the bfloat16
products and inductor's frozen graphs), runs AVX-512 there. :class:`Linear` is ``nn.Linear`` whose
float32 CPU products go to oneDNN when :func:`engine` says so, forward and backward; everything else
(CUDA, bfloat16 or float64 tensors, autocast, products too small to amortize oneDNN's ~10 us a call)
is ``F.linear`` unchanged. Both compute in float32 with float32 sums; only the order of the
additions differs, so results agree to float32 rounding, not bit for bit.

Which library: ``$ATTNMASK_MATMUL`` =

- ``auto`` (the default): a fixed rule from what the CPU is, never a timing, so the same command on
  the same machine computes the same sums whatever the load (:func:`auto_rule`). oneDNN where its
  edge is large: an AMD CPU of family 26 (Zen 5) or later with AVX-512, whose full-width 512-bit
  datapath MKL's AVX2 code leaves half idle. The BLAS everywhere else: on Zen 4 (family 25, AVX-512
  executed in two halves) oneDNN's edge is small, on Intel MKL runs AVX-512 itself, and without
  AVX-512 there is nothing to gain. Figures: ``docs/benchmarks.md``, "Matrix products".
- ``onednn`` or ``blas``: that library (``onednn`` falls back to the BLAS, saying why, where this
  PyTorch's oneDNN product is missing or fails its check).
- ``measure``: time both once per process on a ``(256, 512) x (512, 512)`` product and take oneDNN
  if it is at least :data:`MIN_SPEEDUP` times faster. Faster on some machines, but the choice, and
  with it the last bits of every product, can change with the machine's load: opt in knowingly.

:func:`set_engine` overrides it in code, :func:`engine` says which, :func:`engine_reason` why.

bfloat16 products (bfloat16 tensors, or bfloat16 autocast) on a CPU whose PyTorch multiplies
bfloat16 slowly (:func:`fast_bf16_products`: no oneDNN bfloat16, an AVX2-only CPU) are computed as
autocast defines them -- bfloat16 operands, float32 sums, a bfloat16 result -- by the BLAS's float32
product on the operands rounded to bfloat16 (:class:`_Bf16ByFloat32`), at float32's speed instead of
8x slower. Results equal PyTorch's own bfloat16 product up to the order of the float32 sums.

Raises :class:`~attnmask.errors.UserError` for an engine name not in :data:`ENGINES`.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnmask.errors import UserError

__all__ = [
    "ENGINES",
    "LIBRARIES",
    "CpuInfo",
    "Linear",
    "auto_rule",
    "cpu_info",
    "engine",
    "engine_reason",
    "fast_bf16_products",
    "linear",
    "measure_speedup",
    "set_engine",
]

ENGINES = ("auto", "onednn", "blas", "measure")
LIBRARIES = {"onednn": "oneDNN", "blas": "the BLAS"}  # what a log calls each engine
MIN_SPEEDUP = 1.15  # oneDNN must beat the BLAS by this much to be chosen by ``measure``
FIRST_FULL_WIDTH_AMD_FAMILY = 26  # 0x1A, Zen 5: AVX-512 on a full 512-bit datapath (Zen 4, 0x19, splits it)
# oneDNN costs ~10 us more a call than the BLAS (Zen 5): below this many multiply-adds, or with
# fewer rows, the BLAS is as fast (measured: 4 rows of 512 x 2048 1.4x faster in oneDNN, 2 rows slower)
MIN_ROWS = 4
MIN_MACS = 1 << 21

_engine: str | None = None  # "onednn" or "blas" once decided
_reason = ""
_onednn_checked: tuple[bool, str] | None = None  # (works, why not) once checked


@dataclass(frozen=True)
class CpuInfo:
    """What :func:`auto_rule` needs to know of a CPU (the first processor of ``/proc/cpuinfo``)."""

    vendor: str  # "AuthenticAMD", "GenuineIntel", ... ("" when unknown)
    family: int | None  # x86 "cpu family" in decimal (26 = 0x1A, Zen 5); None when unknown
    flags: frozenset[str] = field(default_factory=frozenset)  # "avx2", "avx512f", ...


def cpu_info(text: str | None = None) -> CpuInfo | None:
    """This machine's :class:`CpuInfo` from ``/proc/cpuinfo`` (or from ``text`` in its format);
    ``None`` off Linux or where the file cannot be read."""
    if text is None:
        if platform.system() != "Linux":
            return None
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough: the others are the same CPU
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    family = fields.get("cpu family", "")
    return CpuInfo(
        vendor=fields.get("vendor_id", ""),
        family=int(family) if family.isdigit() else None,
        flags=frozenset(fields.get("flags", "").split()),
    )


def auto_rule(cpu: CpuInfo | None, *, onednn: bool) -> tuple[str, str]:
    """``(engine, reason)`` that ``auto`` takes for ``cpu`` (``None``: unknown) given whether this
    PyTorch's oneDNN product works. A pure function of its arguments: no timing."""
    if not onednn:
        return "blas", "auto: this PyTorch has no working oneDNN product"
    if cpu is None:
        return "blas", "auto: CPU unknown (no /proc/cpuinfo)"
    if cpu.vendor != "AuthenticAMD":
        return "blas", f"auto: {cpu.vendor or 'an unknown vendor'}'s CPU, not AMD's: the BLAS runs its best code here"
    if cpu.family is None or cpu.family < FIRST_FULL_WIDTH_AMD_FAMILY:
        return "blas", (
            f"auto: AMD family {cpu.family}, before Zen 5 (family {FIRST_FULL_WIDTH_AMD_FAMILY}): "
            "oneDNN's edge is too small to leave the BLAS"
        )
    if "avx512f" not in cpu.flags:
        return "blas", f"auto: AMD family {cpu.family} without AVX-512 (no avx512f): nothing to gain"
    return "onednn", f"auto: AMD family {cpu.family} (Zen 5 or later) with AVX-512, where MKL runs its AVX2 code"


def _onednn_works() -> tuple[bool, str]:
    """Whether ``torch.ops.mkldnn._linear_pointwise`` (private to PyTorch) exists and computes a
    tiny product as ``F.linear`` does; checked once a process. ``(False, why)`` otherwise."""
    global _onednn_checked
    if _onednn_checked is None:
        _onednn_checked = _check_onednn()
    return _onednn_checked


def _check_onednn() -> tuple[bool, str]:
    if not torch.backends.mkldnn.is_available():
        return False, "this PyTorch has no oneDNN"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False, "this PyTorch has no torch.ops.mkldnn._linear_pointwise"
    g = torch.Generator().manual_seed(0)  # not the global generator: checking must not change a seeded run
    x, w, b = torch.randn(8, 16, generator=g), torch.randn(12, 16, generator=g), torch.randn(12, generator=g)
    try:
        got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    except Exception as err:  # a changed signature, an unsupported CPU: PyTorch's own product instead
        return False, f"torch.ops.mkldnn._linear_pointwise failed ({type(err).__name__}: {err})"
    want = F.linear(x, w, b)  # (8, 12)
    if tuple(got.shape) != tuple(want.shape) or not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        return False, "torch.ops.mkldnn._linear_pointwise disagrees with F.linear"
    return True, ""


def _onednn_available() -> bool:
    return _onednn_works()[0]


@torch.library.custom_op("attnmask::onednn_linear", mutates_args=())
def _onednn_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """oneDNN's product as an operator of our own, for ``torch.compile``: inductor lowers
    ``mkldnn._linear_pointwise`` only for a weight frozen into the graph, and calls this one as is."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_onednn_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T + bias`` in oneDNN for a 2-D float32 ``x (M, K)`` and ``weight (N, K)``
    (any strides: a transposed view is read in place)."""
    if torch.compiler.is_compiling():
        return _onednn_op(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # no custom-op dispatch cost


def measure_speedup(rows: int = 256, dim: int = 512, reps: int = 5) -> float:
    """BLAS time / oneDNN time of a float32 ``(rows, dim) x (dim, dim)`` product (best of ``reps``).
    Used by ``measure`` alone: a timing depends on what else the machine is doing."""
    g = torch.Generator().manual_seed(0)  # not the global generator: deciding must not change a seeded run
    x, w = torch.randn(rows, dim, generator=g), torch.randn(dim, dim, generator=g)

    def best(fn) -> float:
        fn()  # warm-up: oneDNN builds its kernel on first use
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(lambda: F.linear(x, w)) / max(best(lambda: _onednn(x, w, None)), 1e-9)


def set_engine(name: str) -> str:
    """Decide which library computes float32 CPU products: ``auto``, ``onednn``, ``blas`` or
    ``measure`` (see the module's docstring). Returns the one taken, ``onednn`` or ``blas``.

    Raises:
        UserError: ``name`` is not one of :data:`ENGINES`.
    """
    global _engine, _reason
    if name not in ENGINES:
        raise UserError(f"unknown matmul engine {name!r}: expected one of {', '.join(ENGINES)}")
    if name == "blas":
        _engine, _reason = "blas", "as requested"
        return _engine
    works, why_not = _onednn_works()
    if name == "auto":
        _engine, _reason = auto_rule(cpu_info(), onednn=works)
    elif not works:
        _engine, _reason = "blas", f"{name} requested, but {why_not}"
    elif name == "measure":
        speedup = measure_speedup()
        _engine = "onednn" if speedup >= MIN_SPEEDUP else "blas"
        _reason = f"measure: oneDNN timed at {speedup:.1f}x the BLAS's speed (threshold {MIN_SPEEDUP}x)"
    else:
        _engine, _reason = name, "as requested"
    return _engine


def engine() -> str:
    """``onednn`` or ``blas``: the library float32 CPU products use (decided on first call, from
    ``$ATTNMASK_MATMUL``, default ``auto``).

    Raises:
        UserError: ``$ATTNMASK_MATMUL`` is not one of :data:`ENGINES`.
    """
    if _engine is None:
        name = os.environ.get("ATTNMASK_MATMUL", "auto").strip().lower() or "auto"
        if name not in ENGINES:
            raise UserError(f"ATTNMASK_MATMUL={name!r}: expected one of {', '.join(ENGINES)}")
        set_engine(name)
    return _engine


def engine_reason() -> str:
    """Why :func:`engine` chose what it did, for a run's log."""
    engine()
    return _reason


class _OneDNNLinear(torch.autograd.Function):
    """``y = x W^T + b`` with the forward product and both backward products in oneDNN.

    Backward: ``dx = dy W`` reads ``W`` transposed in place; ``dW = dy^T x`` needs one operand
    transposed in memory (oneDNN runs ~2x slower on a transposed input), so the narrower of ``x``
    and ``dy`` is copied transposed and the other read as the transposed "weight"."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # x (M, K)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)  # (M, N)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()  # (M, N)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(grad, weight.t(), None)  # (M, N) x (N, K)
        if ctx.needs_input_grad[1]:
            if x.shape[1] <= grad.shape[1]:  # K <= N: (K, M) x (M, N), then transposed
                grad_w = _onednn(x.t().contiguous(), grad.t(), None).t().contiguous()
            else:  # (N, M) x (M, K)
                grad_w = _onednn(grad.t().contiguous(), x.t(), None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)
        return grad_x, grad_w, grad_b


@functools.cache
def fast_bf16_products() -> bool:
    """Whether PyTorch multiplies bfloat16 matrices at speed on this CPU: through oneDNN, which needs
    AVX-512 (AVX512-BF16 or AMX natively). Without it (an AVX2-only CPU such as Zen 3) PyTorch's own
    bfloat16 product ran 8x slower than float32 (1,024 x 576 x 1,536, one thread: 191 against 24 ms).
    A fact of the machine, read once; never a timing."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _bf16_by_float32(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether this CPU product is a bfloat16 one (bfloat16 tensors, or bfloat16 autocast) that
    :class:`_Bf16ByFloat32` should compute: on a CPU without fast bfloat16 products, off compile."""
    if x.device.type != "cpu" or weight.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    if torch.is_autocast_enabled("cpu"):  # autocast casts float32 (not float64) operands
        halves = (torch.float32, torch.bfloat16)
        wanted = torch.get_autocast_dtype("cpu") == torch.bfloat16 and x.dtype in halves and weight.dtype in halves
    else:
        wanted = x.dtype == weight.dtype == torch.bfloat16
    return wanted and not fast_bf16_products()


class _Bf16ByFloat32(torch.autograd.Function):
    """A bfloat16 product on a CPU without fast bfloat16 products: the operands rounded to bfloat16,
    multiplied and summed in float32 by the BLAS, the result rounded to bfloat16 -- the function
    bfloat16 autocast computes (bfloat16 operands, float32 sums, a bfloat16 result), at float32's
    speed. Backward likewise: the incoming gradient in bfloat16, both products in float32, each
    gradient rounded to bfloat16 where autocast's would be, then cast to its input's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        with torch.autocast("cpu", enabled=False):
            xb, wb = x.to(torch.bfloat16), weight.to(torch.bfloat16)
            bb = None if bias is None else bias.to(torch.bfloat16).float()
            out = F.linear(xb.float(), wb.float(), bb).to(torch.bfloat16)
        ctx.save_for_backward(xb, wb)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        xb, wb = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        grad_x = grad_w = grad_b = None
        with torch.autocast("cpu", enabled=False):
            g = grad.to(torch.bfloat16).float()
            if ctx.needs_input_grad[0]:
                grad_x = (g @ wb.float()).to(torch.bfloat16).to(x_dtype)
            if ctx.needs_input_grad[1]:
                g2 = g.reshape(-1, g.shape[-1])
                grad_w = (g2.t() @ xb.reshape(-1, xb.shape[-1]).float()).to(torch.bfloat16).to(w_dtype)
            if b_dtype is not None and ctx.needs_input_grad[2]:
                grad_b = g.reshape(-1, g.shape[-1]).sum(0).to(torch.bfloat16).to(b_dtype)
        return grad_x, grad_w, grad_b


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, in oneDNN where :func:`engine` chose it and the product is a
    large enough float32 one on the CPU, and bfloat16 products through float32 ones on a CPU whose
    bfloat16 products are slow (:class:`_Bf16ByFloat32`; see the module's docstring)."""
    if _bf16_by_float32(x, weight, bias):
        return _Bf16ByFloat32.apply(x, weight, bias)
    if (
        x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or torch.is_autocast_enabled("cpu")
    ):
        return F.linear(x, weight, bias)
    rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
    if rows < MIN_ROWS or rows * weight.shape[0] * weight.shape[1] < MIN_MACS or engine() != "onednn":
        return F.linear(x, weight, bias)
    if bias is not None and bias.dtype != torch.float32:
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    return _OneDNNLinear.apply(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, ``state_dict`` and initialization) computing with :func:`linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
