"""Float32 matrix products on the CPU: PyTorch's ``F.linear`` (its BLAS) against ``attnmask.linear`` in oneDNN.

The shapes are the products attnmask's workloads run: translation decoding (64 rows through a
Marian-size model, C=512, FFN 2048, V=8000), the Multi30k training step (4,096 tokens through dim 256,
FFN 1024, V=8000; forward, and forward + backward), and SmolLM2's widths at a few rows. Each cell
is the best of ``--repeats`` timed runs of ``--inner`` calls, the two contenders taking turns; the
outputs are checked against a float64 product first. The header says what
``attnmask.linear.engine()`` takes on this machine (``ATTNMASK_MATMUL``, default ``auto``: a fixed
rule from the CPU's vendor, family and flags, never a timing) and why.

    python benchmarks/matmul.py [--threads 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F

from attnmask import linear as L

SHAPES = [
    # (rows, K, N, what)
    (64, 512, 1536, "translation step: q, k, v of 64 rows"),
    (64, 512, 2048, "translation step: FFN up"),
    (64, 2048, 512, "translation step: FFN down"),
    (64, 512, 8000, "translation step: W_pred"),
    (4096, 256, 1024, "training: FFN up, 4,096 tokens"),
    (4096, 1024, 256, "training: FFN down"),
    (4096, 256, 768, "training: q, k, v"),
    (4, 576, 1536, "SmolLM2: 4 rows, FFN up"),
    (16, 576, 1536, "SmolLM2: 16 rows, FFN up"),
]


def cpu_name() -> str:
    """The CPU's model name, family and model numbers and its widest vector extensions (/proc/cpuinfo):
    "AMD EPYC" alone does not say whether it is a Zen 2 or a Zen 5."""
    try:
        with open("/proc/cpuinfo") as f:
            first_cpu = f.read().split("\n\n")[0]
    except OSError:
        return platform.processor() or platform.machine()
    info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first_cpu.splitlines() if ":" in line)}
    flags = set(info.get("flags", "").split())
    vector = [f for f in ("avx512f", "avx512_bf16", "amx_tile", "avx2") if f in flags]
    family, model = info.get("cpu family", "?"), info.get("model", "?")
    return f"{info.get('model name', '?')} (family {family}, model {model}; {' '.join(vector)})"


def best_of(fn, repeats: int, inner: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--inner", type=int, default=10, help="calls per timed run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not L._onednn_available():
        raise SystemExit("this PyTorch has no oneDNN: nothing to compare")
    chosen = L.engine()
    print(f"# {cpu_name()}, {args.threads} threads, torch {torch.__version__}; "
          f"attnmask.linear.engine() = {chosen} ({L.engine_reason()})\n")  # fmt: skip
    print("| product (rows x K -> N) | what | pass | BLAS GFLOP/s | oneDNN GFLOP/s | oneDNN / BLAS |")
    print("|---|---|---|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for rows, k, n, what in SHAPES:
        for row in time_shape(rows, k, n, what, g, args.repeats, args.inner):
            print(row)


def time_shape(rows: int, k: int, n: int, what: str, g: torch.Generator, repeats: int, inner: int) -> list[str]:
    """Table rows for one product: forward, and for training shapes forward + both backward products."""
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    ref = x.double() @ w.double().t()
    contenders = {"BLAS": lambda: F.linear(x, w), "oneDNN": lambda: L._onednn(x, w, None)}
    for name, fn in contenders.items():
        err = (fn().double() - ref).abs().max().item()
        assert err < 1e-3, f"{name} {rows}x{k}->{n}: max error {err}"
    flops = 2 * rows * k * n
    blas, onednn = (best_of(fn, repeats, inner) for fn in contenders.values())
    out = [f"| {rows} x {k} -> {n} | {what} | forward | {flops / blas / 1e9:.0f} | {flops / onednn / 1e9:.0f} "
           f"| {blas / onednn:.2f}x |"]  # fmt: skip
    if rows >= 1024:  # training shapes: forward + both backward products
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        dy = torch.randn(rows, n, generator=g)
        steps = [lambda: F.linear(xg, wg).backward(dy), lambda: L._OneDNNLinear.apply(xg, wg, None).backward(dy)]
        blas, onednn = (best_of(fn, repeats, max(1, inner // 3)) for fn in steps)
        out.append(f"| {rows} x {k} -> {n} | {what} | forward + backward | {3 * flops / blas / 1e9:.0f} | "
                   f"{3 * flops / onednn / 1e9:.0f} | {blas / onednn:.2f}x |")  # fmt: skip
    return out


if __name__ == "__main__":
    main()
