"""Float32 matrix products on the CPU through the faster of the two libraries inside PyTorch.

PyTorch computes a float32 ``F.linear`` on the CPU in the BLAS it was built with (MKL on x86), and
MKL runs its AVX2 code on AMD processors: on a Zen 5 core about 100 GFLOP/s, where oneDNN, which
PyTorch also carries (it serves the bfloat16 products and inductor's frozen graphs), reaches about
235 for the same float32 product (``docs/benchmarks.md``). :class:`Linear` is ``nn.Linear`` whose
float32 CPU products go to oneDNN where this machine measures oneDNN faster, forward and backward;
everything else (CUDA, bfloat16 or float64 tensors, autocast, products too small to amortize
oneDNN's ~10 us a call) is ``F.linear`` unchanged. Both compute in float32 with float32 sums; only
the order of the additions differs (results agree to float32 rounding, not bit for bit).

Which library: ``$ATTNMASK_MATMUL`` = ``auto`` (the default: time both once per process on a
``(256, 512) x (512, 512)`` product and take oneDNN if it is at least :data:`MIN_SPEEDUP` times
faster), ``onednn`` or ``blas``; :func:`set_engine` overrides it in code, :func:`engine` says which.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnmask.errors import UserError

__all__ = ["ENGINES", "LIBRARIES", "Linear", "engine", "engine_reason", "linear", "set_engine"]

ENGINES = ("auto", "onednn", "blas")
LIBRARIES = {"onednn": "oneDNN", "blas": "the BLAS"}  # what a log calls each engine
MIN_SPEEDUP = 1.15  # oneDNN must beat the BLAS by this much to be chosen by ``auto``
# oneDNN costs ~10 us more a call than the BLAS (Zen 5): below this many multiply-adds, or with
# fewer rows, the BLAS is as fast (measured: 4 rows of 512 x 2048 1.4x faster in oneDNN, 2 rows slower)
MIN_ROWS = 4
MIN_MACS = 1 << 21

_engine: str | None = None  # "onednn" or "blas" once decided
_reason = ""


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


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
    """BLAS time / oneDNN time of a float32 ``(rows, dim) x (dim, dim)`` product (best of ``reps``)."""
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
    """Decide which library computes float32 CPU products: ``auto``, ``onednn`` or ``blas``.
    Returns the one taken (``auto`` and ``onednn`` give ``blas`` where PyTorch has no oneDNN)."""
    global _engine, _reason
    if name not in ENGINES:
        raise UserError(f"unknown matmul engine {name!r}: expected one of {', '.join(ENGINES)}")
    if name != "blas" and not _onednn_available():
        _engine, _reason = "blas", "this PyTorch has no oneDNN"
    elif name == "auto":
        speedup = measure_speedup()
        _engine = "onednn" if speedup >= MIN_SPEEDUP else "blas"
        _reason = f"auto: oneDNN measured {speedup:.1f}x the BLAS's speed on this CPU"
    else:
        _engine, _reason = name, "as requested"
    return _engine


def engine() -> str:
    """``onednn`` or ``blas``: the library float32 CPU products use (decided on first call, from
    ``$ATTNMASK_MATMUL``, default ``auto``)."""
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


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, in oneDNN where :func:`engine` chose it and the product is a
    large enough float32 one on the CPU (see the module's docstring)."""
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
