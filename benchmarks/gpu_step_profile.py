"""Where a decoding step's time goes on a GPU: attnmask's engine at batch 1 and 16, profiled.

A model of SmolLM2-135M's shape (30 layers, width 576, 9 query heads over 3 key/value heads of 64,
MLP 1536, vocabulary 49,152, tied head) with random weights, built in ``transformers`` and converted
(:func:`attnmask.pretrained.hf.transformer_from_hf_model`), in bfloat16 on the GPU: the work of a step
does not depend on the weights' values, so no model file is needed. The engine decodes greedily with
end-of-sequence off; each level is run once untimed (compilation, FlexAttention's shapes) and then
timed. Printed:

1. milliseconds per step at each level (wall time over the new tokens of one request);
2. for batch 1, ``torch.profiler`` over a few steps: the operators with the most host time and the
   most device time, the step's host time against its device time (a step far longer than its device
   time is bound by launching work from Python, not by the GPU);
3. the share of a step spent building the FlexAttention ``BlockMask`` (timed around
   ``_FlexMasks.__call__`` with the device synchronized).

Run on a CUDA machine: ``python benchmarks/gpu_step_profile.py``. On a CPU it runs in float32 as a
smoke test (``--tokens`` small). Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import time

import torch

from attnmask.decode import step as step_module
from attnmask.engine import Engine, RequestParams
from attnmask.model import fuse_projections_
from attnmask.pretrained.hf import transformer_from_hf_model


def smollm2_shape(device: str, dtype: torch.dtype):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=100000.0,
    )  # fmt: skip
    hf = tf.LlamaForCausalLM(cfg).eval()
    return transformer_from_hf_model(hf, dtype=torch.float32).eval().to(device=device, dtype=dtype)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_level(model, level: int, tokens: int, prompt_len: int) -> float:
    """Milliseconds per step for ``level`` requests decoding ``tokens`` each (after one untimed run)."""
    g = torch.Generator().manual_seed(level)
    prompts = [torch.randint(1, 49152, (prompt_len,), generator=g).tolist() for _ in range(level)]
    params = RequestParams(max_tokens=tokens, ignore_eos=True)
    for timed in (False, True):
        engine = Engine(model, kv_cache_mib=1024, max_seqs=level, max_batch_tokens=2048)
        for p in prompts:
            engine.add_request(p, params)
        engine.step()  # the prefill
        sync()
        start = time.perf_counter()
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
        sync()
        if timed:
            return (time.perf_counter() - start) * 1e3 / max(steps, 1)
    raise AssertionError("unreachable")


def mask_share(model, tokens: int) -> tuple[float, float]:
    """(ms building BlockMasks a step, ms a step) at batch 1, the device synchronized around each build."""
    built = [0.0]
    original = step_module._FlexMasks.__call__

    def timed_call(self, group, window):
        if (group, window) in self.built:
            return original(self, group, window)
        sync()
        start = time.perf_counter()
        out = original(self, group, window)
        sync()
        built[0] += time.perf_counter() - start
        return out

    step_module._FlexMasks.__call__ = timed_call
    try:
        ms = timed_level(model, 1, tokens, 32)
    finally:
        step_module._FlexMasks.__call__ = original
    return built[0] * 1e3 / tokens, ms


def profile_batch1(model, steps: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    engine = Engine(model, kv_cache_mib=1024, max_seqs=1, max_batch_tokens=2048)
    engine.add_request(torch.randint(1, 49152, (32,)).tolist(), RequestParams(max_tokens=steps + 8, ignore_eos=True))
    for _ in range(4):  # prefill and warm steps
        engine.step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) if torch.cuda.is_available() else 0.0
    print(f"\nbatch 1, {steps} profiled steps: {wall * 1e3 / steps:.2f} ms a step (with the profiler), "
          f"device busy {device_us / 1e3 / steps:.2f} ms a step")  # fmt: skip
    print("\nby host time (self):")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    if torch.cuda.is_available():
        print("\nby device time (self):")
        print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--levels", default="1,16", help="comma-separated numbers of requests decoded at once")
    p.add_argument("--tokens", type=int, default=64, help="new tokens a request")
    p.add_argument("--profile-steps", type=int, default=10, help="batch-1 steps under torch.profiler")
    p.add_argument("--fuse", action="store_true", help="q/k/v and gate/up as one product each, as `attnmask serve` "
                   "loads a model (default: apart, as transformers' conversion gives them)")  # fmt: skip
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"# {name}, torch {torch.__version__}, {dtype}; SmolLM2-135M's shape, random weights, greedy")
    model = smollm2_shape(device, dtype)
    if args.fuse:
        fuse_projections_(model)
    with torch.inference_mode():
        for level in [int(x) for x in args.levels.split(",")]:
            ms = timed_level(model, level, args.tokens, 32)
            print(f"level {level:3}: {ms:.2f} ms a step, {level * 1e3 / ms:.1f} tok/s")
        if device == "cuda":
            masks_ms, ms = mask_share(model, args.tokens)
            print(f"batch 1: BlockMask builds {masks_ms:.2f} ms of a {ms:.2f} ms step (the device synchronized)")
        profile_batch1(model, args.profile_steps)


if __name__ == "__main__":
    main()
