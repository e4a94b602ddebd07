"""The block kernel's products (``attnmask::block_panels_matmul``, ``csrc/blocks_kernel.c``) by layout, shape and rows.

For each GGUF format, weight shape ``(N, K)`` and row count ``M``: the best of ``--repeats`` timings
(each the mean of about twice the calls that take 20 ms: ``rows_stream.best_seconds``) of the kernel
on random blocks (valid float16 scales, every code), in GMAC/s (``M * N * K`` multiply-adds a call);
beside it PyTorch's ``F.linear`` on the same weight dequantized to float32 (its BLAS: the product a
float32 model of these weights would run, without the batch invariance the kernel keeps). The weights
are small enough to stay in the caches (L2 for most shapes): the figures are the loops' arithmetic,
not memory's; a decoding step, whose weights stream from memory, is timed by
``benchmarks/packed_step.py``.

The shapes are SmolLM2-135M's (576 wide, FFN 1536) and Gemma 3 270M's (640 wide, FFN 2048); the rows
1 (a decoding step), 16 (16 streams decoding) and 512 (a prompt's chunk).

Run: ``python benchmarks/blocks_matmul.py [--threads 1] [--rows 1 16 512] [--activations float32|int8]``.
To compare two commits, run it with ``PYTHONPATH=<worktree>/src ATTNMASK_CACHE=<dir>`` for the other one.
Nothing is asserted.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from attnmask.ops import blocks, native
from matmul import cpu_name  # benchmarks/, run as a script
from rows_stream import best_seconds

SHAPES = [
    # (kind, N, K, what)
    ("Q4_1", 1536, 576, "SmolLM2 gate/up"),
    ("Q4_1", 576, 1536, "SmolLM2 down"),
    ("Q8_0", 1536, 576, "8-bit, 576 wide"),
    ("Q5_0", 2048, 640, "Gemma 3 gate/up"),
    ("Q4_K", 640, 2048, "Gemma 3 down (4-bit)"),
    ("Q6_K", 640, 2048, "Gemma 3 down (8-bit/16)"),
]


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The kernel's tensors for an (n, k) weight of random GGUF blocks: every byte random, then the
    float16 scales (and Q4_1's minimums, the K-quants' super-block scales) set to small finite values."""
    g = torch.Generator().manual_seed(seed)
    nb = k // blocks.BLOCK_WEIGHTS[kind]
    raw = torch.randint(0, 256, (n, nb, blocks.BLOCK_BYTES[kind]), dtype=torch.uint8, generator=g)
    halves = lambda count: (torch.rand(n, nb, count, generator=g) * 0.01).half().view(torch.uint8)  # noqa: E731
    if kind == "Q4_1":
        raw[..., 0:4] = halves(2)
    elif kind in ("Q8_0", "Q5_0"):
        raw[..., 0:2] = halves(1)
    elif kind == "Q4_K":
        raw[..., 0:4] = halves(2)
    elif kind == "Q6_K":
        raw[..., 208:210] = halves(1)
    return blocks.repack(raw.reshape(n, -1), kind, k)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 512])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--activations", choices=("float32", "int8"), default="float32")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    status = native.load()
    if not status.native:
        raise SystemExit(f"the native kernels are not available here: {status.why}")
    print(f"# {cpu_name()}; kernels: {status.why}")
    print(f"# {args.threads} thread(s), torch {torch.__version__}, {args.activations} activations")
    print(f"# GMAC/s, best of {args.repeats}")
    print("| format | N x K | what | rows | attnmask GMAC/s | F.linear float32 GMAC/s |")
    print("|---|---|---|---:|---:|---:|")
    for kind, n, k, what in SHAPES:
        packed = random_blocks(kind, n, k)
        codes, d, m = packed["codes"], packed["d"], packed.get("m")
        weight = blocks.unpack(packed, kind, k)
        if args.activations == "float32":  # the panels a layer keeps (BlockLinear.panels), packed once
            panels = blocks.pack_block_panels(codes, d, m, kind, k)
            product = lambda x, panels=panels, n=n: blocks.block_panels_matmul(panels, x, n)  # noqa: E731
        else:
            product = lambda x, codes=codes, d=d, m=m, kind=kind, k=k: blocks.block_matmul_i8(codes, d, m, x, kind, k)  # noqa: E731
        for rows in args.rows:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            ours = best_seconds(lambda x=x, product=product: product(x), args.repeats)
            theirs = best_seconds(lambda x=x: F.linear(x, weight), args.repeats)  # noqa: B023
            macs = rows * n * k / 1e9
            print(f"| {kind} | {n} x {k} | {what} | {rows} | {macs / ours:.1f} | {macs / theirs:.1f} |")


if __name__ == "__main__":
    main()
