"""Which precision a run computes in: ``fp32``, ``bf16`` (autocast), or ``auto``, decided from what
the device can do rather than from its name.

``auto`` takes bf16 on a CUDA device that supports it, and on a CPU when it has native bf16
instructions (AVX512-BF16 or AMX, as oneDNN reports: :func:`attnmask.linear.fast_bf16_products`, the
one place that fact is read for training). The rule reads what the CPU can do and times
nothing, so the same command takes the same precision whatever else the machine is doing (it once
also timed a product, which made the choice depend on the load). Measured: bf16 products 4.7x
float32's on Zen 5, whole training steps 1.5-2x on Zen 4 and Zen 5 (docs/benchmarks.md). On CPUs
without native bf16 (AVX2-only), emulated bf16 is slower than fp32, so ``auto`` stays in fp32 there.
:func:`matmul_speedup` is the measurement, kept for the benchmarks.
"""

from __future__ import annotations

import time

import torch

from attnmask import linear as products
from attnmask.linear import linear


def matmul_speedup(threads: int | None = None, n: int = 768, reps: int = 5) -> float:
    """fp32 time / bf16 time of an ``(n, n) x (n, n)`` product on the CPU (best of ``reps``), float32
    through the library attnmask's layers use for it (:func:`attnmask.linear.engine`)."""
    g = torch.Generator().manual_seed(0)  # not the global generator: deciding must not change a seeded run
    a32, b32 = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:

        def best(a, b) -> float:
            linear(a, b)  # warm-up (oneDNN picks its kernel on first use)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                linear(a, b)
                times.append(time.perf_counter() - t0)
            return min(times)

        return best(a32, b32) / max(best(a16, b16), 1e-9)
    finally:
        torch.set_num_threads(before)


def choose(precision: str, device: torch.device) -> tuple[str, str]:
    """``(fp32 | bf16, why)`` for a requested ``precision`` (``fp32``, ``bf16`` or ``auto``)."""
    if precision != "auto":
        return precision, "as requested"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", f"auto: {torch.cuda.get_device_name(device)} supports bfloat16"
        return "fp32", f"auto: {torch.cuda.get_device_name(device)} has no bfloat16"
    if device.type != "cpu":
        return "fp32", f"auto: no bfloat16 rule for {device.type}"
    if not products.fast_bf16_products():
        return "fp32", "auto: this CPU has no native bfloat16 (AVX512-BF16/AMX)"
    return "bf16", "auto: this CPU has native bfloat16 products (AVX512-BF16/AMX)"
