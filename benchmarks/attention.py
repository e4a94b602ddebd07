"""Causal + padding attention: the seeds' formula vs SDPA vs ``attnmask.attention(backend="auto")``.

CPU (the default, ``--device cpu``): times one attention call, forward and forward+backward, in
float32 and bfloat16, for ``T`` in {64, ..., 2048} with 0%, 25% and 50% of the key positions
padding (right padding, the decoder-training case: seed 004's ``M_total`` = look-ahead + key
padding). Contenders:

    (a) formula   the seeds' formula in plain torch with a materialized additive 0/-inf mask:
                  softmax(q @ kᵀ / √D + M) @ v
    (b) sdpa+mask F.scaled_dot_product_attention with a materialized bool mask (B, 1, T, T)
    (c) is_causal F.scaled_dot_product_attention(is_causal=True): only correct without padding,
                  so "n/a" when there is padding
    (d) auto      attnmask.attention(q, k, v, mask, backend="auto") with the same structured
                  ``mask = masks.causal() & masks.padding(lengths=...)`` object on every call, as a
                  model's layers share one mask: it is linted, planned and materialized on the first
                  call for a problem shape and reused while its tensors are unchanged
    (e) auto new  the same with a new Mask object built on every call: pays for building, linting,
                  planning and materializing the mask every time
    (f) auto@REV  (with ``--baseline REV``) (d) run by attnmask as of git revision REV, loaded beside
                  this checkout in the same process, so that before and after share the machine's load
    (g)-(j)       each backend ``auto`` chooses from, forced by name with the same mask object:
                  ``math``, ``sdpa``, ``sdpa_blocks`` (the SDPA block plan) and ``tiles`` (block-sparse);
                  the table's "best" is the fastest of them and "best / auto" >= 1 means ``auto`` kept up

The masks of (a) and (b) are built once, outside the timed region (a model builds them once per
forward and shares them across layers). Every contender's output is checked against (a)'s (same
inputs and dtype, the dtype's tolerance), so that the table never reports the time of a wrong answer.

Times are the minimum over at least ``--repeats`` runs after one warm-up run, more for fast cells
(until 0.5 s or 30 runs), the contenders taking turns so that they share the machine's load; the
minimum is the least noisy estimate of what the code costs on a shared machine. A run longer than
2 s is timed once. On a 2-core machine shared with other jobs, ``--threads 1`` gives far steadier
numbers than two threads waiting on each other. Speed-up = t(a) / t(x).

    python benchmarks/attention.py                 # full table (about 10 minutes on 2 cores)
    python benchmarks/attention.py --quick         # smoke run
    python benchmarks/attention.py --threads 1 --repeats 5 --baseline HEAD --write-docs docs/benchmarks.md
    python benchmarks/attention.py --T 16,32,64,128,256 --tokens 4096   # a training batch of short rows

``--tokens N`` sets B = N // T (many short rows, as a training batch has) instead of B=4.

Long sequences (``--long``): one sequence of T in {1k, ..., 32k} (``--T`` to choose), 4 heads of 64,
float32 and bfloat16, forward and forward+backward, for three structured masks: a causal sliding
window of 256 keys, causal packed documents (lengths 256-2048, mean ~1.1k) and documents with the
window. Each cell runs in a fresh process, which reports the best time of its runs and the growth of
its peak resident memory (``resource.getrusage`` max RSS, after the inputs exist) over the whole
cell: ``auto``, ``tiles`` and, with ``--baseline REV``, ``auto`` at REV (SDPA with the dense mask before
``tiles`` existed; skipped where its ``T x T`` mask would not fit: above 16k forward, 8k backward).

    python benchmarks/attention.py --long --threads 1 --baseline HEAD~1

CUDA (``--device cuda``): bfloat16, forward and forward+backward, T in {512, ..., 8192}, D in {64, 128}
(H=16 at D=64, H=8 at D=128), B = 32768 // T (32k tokens a batch), 0/25/50% right key padding:
``auto``, ``flex`` (attnmask's FlexAttention backend), SDPA + bool mask, SDPA ``is_causal`` (no
padding only), FlexAttention used directly (``create_block_mask`` once, outside the timed region,
and ``torch.compile(flex_attention)``), and flash-attn's varlen kernel when ``flash_attn`` is
importable (unpadding included in its time). Every output is checked against float32 SDPA with the
bool mask; times in ms (CUDA events, min of the repeats) and TFLOP/s of useful work (allowed
query-key pairs only: 4·D flops each forward, 3.5× that forward+backward).

    python benchmarks/attention.py --device cuda --write-docs docs/benchmarks.md

``--write-docs`` rewrites the device's section (``## Attention`` for the CPU, ``### Attention on a
GPU`` inside it for CUDA) and leaves the rest alone; notes under a table are written by hand, so a
rerun drops them rather than leave stale claims under new numbers.
"""

from __future__ import annotations

import argparse
import importlib
import io
import itertools
import json
import math
import os
import platform
import re
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from attnmask import masks
from attnmask.attention import attention, backends

H, D = 8, 64
SECTION = "## Attention"
GPU_SECTION = "### Attention on a GPU"
SLOW_S = 2.0  # a run longer than this is timed once, its warm-up being negligible
BUDGET_S, MAX_REPEATS = 0.5, 30  # fast cells repeat (beyond --repeats) until 0.5 s or 30 runs
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Case:
    dtype: torch.dtype
    backward: bool
    T: int
    B: int
    pad: float  # mean fraction of padded key positions


def batch_for(T: int) -> int:
    """B=4 up to T=512, then fewer rows so that the quadratic formula (a) finishes in seconds."""
    return max(1, 4 * 512 // max(T, 512))


def lengths_for(B: int, T: int, pad: float) -> list[int]:
    """Real lengths with mean padding ``pad``: row b is padded by ``pad * 2(b+1)/(B+1)`` of T."""
    return [max(1, round(T * (1 - pad * 2 * (b + 1) / (B + 1)))) for b in range(B)]


def machine(device: str = "cpu") -> str:
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        return f"{name}, torch {torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads, "
        f"{torch.backends.cpu.get_cpu_capability()}), Python {platform.python_version()}"
    )


def load_baseline(rev: str):
    """attnmask as of git revision ``rev``, imported as ``attnmask_base`` beside this checkout:
    returns its ``(masks, attention)``."""
    data = subprocess.run(["git", "archive", rev, "src/attnmask"], cwd=REPO, capture_output=True, check=True).stdout
    root = Path(tempfile.mkdtemp(prefix="attnmask_base_"))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(root, filter="data")
    pkg = root / "attnmask_base"
    (root / "src" / "attnmask").rename(pkg)
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\battnmask(?=[. ])", "attnmask_base", text))
    sys.path.insert(0, str(root))
    base_masks = importlib.import_module("attnmask_base.masks")
    return base_masks, importlib.import_module("attnmask_base.attention").attention


def contenders(case: Case, q, k, v, lengths: list[int], baseline=None):
    """The attention calls of one case, as zero-argument functions returning ``(B, H, T, D)``."""
    B, T = case.B, case.T
    keep = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
    allowed = (
        torch.ones(T, T, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
    ).contiguous()  # (B, 1, T, T)
    additive = torch.zeros(B, 1, T, T, dtype=case.dtype).masked_fill_(~allowed, float("-inf"))  # (B, 1, T, T)
    mask = masks.causal() & masks.padding(lengths=lengths)
    padded = any(L < T for L in lengths)

    def formula():
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D) + additive, dim=-1) @ v  # (B, H, T, D)

    def sdpa_mask():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    def sdpa_causal():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def auto():
        return attention(q, k, v, mask, backend="auto")

    def auto_new():
        return attention(q, k, v, masks.causal() & masks.padding(lengths=lengths), backend="auto")

    fns = {
        "formula": formula,
        "sdpa+mask": sdpa_mask,
        "is_causal": None if padded else sdpa_causal,
        "auto": auto,
        "auto new": auto_new,
    }
    for name in BACKEND_NAMES:
        fns[name] = lambda name=name: attention(q, k, v, mask, backend=name)
    if baseline is not None:
        base_masks, base_attention = baseline
        base_mask = base_masks.causal() & base_masks.padding(lengths=lengths)
        fns["auto@base"] = lambda: base_attention(q, k, v, base_mask, backend="auto")
    return fns


ROUTES = {"_blocks": "sdpa_blocks", "tile_attention": "tiles", "_math": "math", "_sdpa": "sdpa"}


def auto_route(q, k, v, mask) -> str:
    """The backend ``auto`` runs for this call, seen by wrapping the kernels it may call once."""
    seen: list[str] = []
    originals = {name: getattr(backends, name) for name in ROUTES}

    def spy(name):
        def call(*args, **kwargs):
            seen.append(ROUTES[name])
            return originals[name](*args, **kwargs)

        return call

    try:
        for name in ROUTES:
            setattr(backends, name, spy(name))
        attention(q, k, v, mask, backend="auto")
    finally:
        for name, fn in originals.items():
            setattr(backends, name, fn)
    return seen[0]


def run_case(case: Case, repeats: int, baseline=None) -> dict[str, float | None]:
    """Best wall time in ms of each contender: one warm-up run each, then rounds that run every
    contender once in turn (so that all of them see the same load on a shared machine), at least
    ``repeats`` rounds and more for fast cells. A contender whose warm-up took over ``SLOW_S`` is
    timed by that run alone (the formula in bfloat16 takes seconds at T >= 512 on this CPU)."""
    g = torch.Generator().manual_seed(case.T)
    q, k, v = (
        torch.randn(case.B, H, case.T, D, generator=g).to(case.dtype).requires_grad_(case.backward) for _ in range(3)
    )  # (B, H, T, D)
    grad = torch.randn(case.B, H, case.T, D, generator=g).to(case.dtype)  # (B, H, T, D)
    lengths = lengths_for(case.B, case.T, case.pad)
    fns = contenders(case, q, k, v, lengths, baseline)
    route = auto_route(q, k, v, masks.causal() & masks.padding(lengths=lengths))

    def once(fn) -> tuple[float, torch.Tensor]:
        for t in (q, k, v):
            t.grad = None
        start = time.perf_counter()
        out = fn()
        if case.backward:
            out.backward(grad)
        return time.perf_counter() - start, out.detach()

    best, outs = {}, {}
    for name, fn in fns.items():
        if fn is not None:
            best[name], outs[name] = once(fn)
    fast = [name for name, t in best.items() if t <= SLOW_S]
    rounds, spent = 0, 0.0
    while fast and (rounds < repeats or (spent < BUDGET_S and rounds < MAX_REPEATS)):
        for name in fast:
            t, _ = once(fns[name])
            best[name] = t if rounds == 0 else min(best[name], t)  # the warm-up run does not count
            spent += t
        rounds += 1
    # never report the time of a wrong answer: every contender must agree with the formula (a)
    tol = 2e-2 if case.dtype == torch.bfloat16 else 1e-4
    for name, out in outs.items():
        torch.testing.assert_close(out, outs["formula"], rtol=tol, atol=tol, msg=lambda m, n=name: f"{n} is wrong: {m}")
    return {name: None if fn is None else best[name] * 1e3 for name, fn in fns.items()} | {"route": route}


BACKEND_NAMES = ("math", "sdpa", "sdpa_blocks", "tiles")  # what auto chooses from on the CPU
LETTERS = {
    "formula": "a",
    "sdpa+mask": "b",
    "is_causal": "c",
    "auto": "d",
    "auto new": "e",
    "auto@base": "f",
    "math": "g",
    "sdpa": "h",
    "sdpa_blocks": "i",
    "tiles": "j",
}


def table(rows: list[tuple[Case, dict]], base_rev: str | None = None) -> str:
    names = [n for n in LETTERS if n in rows[0][1]]
    label = {**{n: n for n in names}, "auto@base": f"auto@{base_rev}"}
    head = (
        "| dtype | pass | T | B | pad | "
        + " | ".join(f"({LETTERS[n]}) {label[n]} ms" for n in names)
        + " | "
        + " | ".join(f"({LETTERS[n]}) ×" for n in names[1:])
        + " |"
    )
    if "auto@base" in names:
        head += " t(b) / t(d) | t(f) / t(d) |"
    head += " best backend | best / auto | auto runs | best / that |"
    head += " best / auto@base |" if "auto@base" in names else ""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for case, t in rows:
        ms = [("n/a" if t[n] is None else f"{t[n]:.2f}") for n in names]
        speed = [("n/a" if t[n] is None else f"{t['formula'] / t[n]:.2f}") for n in names[1:]]
        if "auto@base" in names:
            speed += [f"{t['sdpa+mask'] / t['auto']:.2f}", f"{t['auto@base'] / t['auto']:.2f}"]
        best = min(BACKEND_NAMES, key=lambda n: t[n])
        speed += [best, f"{t[best] / t['auto']:.2f}", t["route"], f"{t[best] / t[t['route']]:.2f}"]
        if "auto@base" in names:
            speed.append(f"{t[best] / t['auto@base']:.2f}")
        dtype = str(case.dtype).removeprefix("torch.")
        pas = "fwd+bwd" if case.backward else "fwd"
        lines.append(f"| {dtype} | {pas} | {case.T} | {case.B} | {case.pad:.0%} | " + " | ".join(ms + speed) + " |")
    return "\n".join(lines)


def write_docs(path: str, header: str, body: str) -> None:
    """Replace (or add) the section ``header`` of ``path``, leaving every other section alone: the CPU
    section ends at the next ``## `` or at the GPU subsection, the GPU subsection at the next heading."""
    text = "# Benchmarks\n"
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == header), None)
    section = body.strip().splitlines()
    if start is None and header == GPU_SECTION:  # new: at the end of the CPU attention section
        cpu = next((i for i, line in enumerate(lines) if line.strip() == SECTION), None)
        if cpu is not None:
            end = next((i for i in range(cpu + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
            lines = [*lines[:end], *section, "", *lines[end:]]
            start = -1
    if start is None:
        lines = [*lines, "", *section]
    elif start >= 0:
        stops = ("## ", "### ") if header == GPU_SECTION else ("## ", GPU_SECTION)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(stops)), len(lines))
        lines = [*lines[:start], *section, "", *lines[end:]]
    with open(path, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")


# ---------------------------------------------------------------------------------------------
# Long sequences: structured masks, time and peak memory per cell in a fresh process
# ---------------------------------------------------------------------------------------------
LONG_TS = [1024, 2048, 4096, 8192, 16384, 32768]
LONG_MASKS = ("window", "documents", "docs+window")
LONG_H, WINDOW = 4, 256
DENSE_MAX_T = {False: 16384, True: 8192}  # the dense-mask baseline's largest T, forward / forward+backward


def long_mask(name: str, T: int, masks_mod=masks):
    """The structured mask of a long cell: a causal window of 256 keys, causal packed documents of
    256-2048 tokens (seeded by T), or both."""
    window = masks_mod.causal() & masks_mod.sliding_window(WINDOW)
    if name == "window":
        return window
    g = torch.Generator().manual_seed(T)
    lengths, total = [], 0
    while total < T:
        lengths.append(int(torch.randint(256, 2049, (1,), generator=g)))
        total += lengths[-1]
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:T]  # (T,) document ids
    docs = masks_mod.document(seg[None]) & masks_mod.causal()
    return docs if name == "documents" else docs & masks_mod.sliding_window(WINDOW)


def long_cell(spec: dict) -> dict:
    """One long cell in this process: the best time of its runs (ms) and the growth of the peak RSS
    over the cell (MB, ``resource.getrusage``), from after the inputs exist to the end."""
    torch.set_num_threads(spec["threads"])
    dtype, T, backward = getattr(torch, spec["dtype"]), spec["T"], spec["backward"]
    mask_mod, attend = masks, attention
    if spec["backend"] == "auto@base":
        mask_mod, attend = load_baseline(spec["baseline"])
    backend = "auto" if spec["backend"] == "auto@base" else spec["backend"]
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, LONG_H, T, D, generator=g).to(dtype).requires_grad_(backward) for _ in range(3))
    grad = torch.randn(1, LONG_H, T, D, generator=g).to(dtype)  # (1, H, T, D)
    mask = long_mask(spec["mask"], T, mask_mod)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    while len(times) < spec["repeats"] + 1 and (sum(times) < SLOW_S or len(times) < 2):
        for t in (q, k, v):
            t.grad = None
        start = time.perf_counter()
        out = attend(q, k, v, mask, backend=backend)  # (1, H, T, D)
        if backward:
            out.backward(grad)
        times.append(time.perf_counter() - start)
        # finite everywhere <=> a finite sum (outputs are averages of values: no overflow). Not
        # torch.isfinite(out).all(): its temporaries (|out| and three masks, ~25 MB at T = 16k) were
        # the largest part of the peak this cell measures
        if not bool(torch.isfinite(out.sum())):
            raise SystemExit(f"{spec} gave non-finite output")
        del out
        if times[0] > SLOW_S:
            break
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    best = min(times[1:]) if len(times) > 1 else times[0]
    return {"ms": best * 1e3, "first_ms": times[0] * 1e3, "mb": grown / 1024}


def main_long(args) -> int:
    Ts = [int(t) for t in args.T.split(",")] if args.T else LONG_TS
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    names = ["auto", "tiles"] + (["auto@base"] if args.baseline else [])
    print(machine())
    print(f"B=1, H={LONG_H}, D={D}; a fresh process per cell; ms = best run, MB = peak RSS growth")
    rows = []
    for mask_name in LONG_MASKS:
        for dtype in dtypes:
            for backward in (False, True):
                for T in Ts:
                    res = {}
                    for name in names:
                        if name == "auto@base" and DENSE_MAX_T[backward] < T:
                            res[name] = None
                            continue
                        spec = {
                            "mask": mask_name,
                            "dtype": dtype,
                            "T": T,
                            "backward": backward,
                            "backend": name,
                            "baseline": args.baseline,
                            "threads": args.threads or torch.get_num_threads(),
                            "repeats": args.repeats or 3,
                        }
                        run = subprocess.run(
                            [sys.executable, __file__, "--long-cell", json.dumps(spec)],
                            capture_output=True,
                            text=True,
                        )
                        if run.returncode:
                            raise SystemExit(f"{spec}: {run.stderr[-2000:]}")
                        res[name] = json.loads(run.stdout.strip().splitlines()[-1])
                    rows.append((mask_name, dtype, backward, T, res))
                    cells = "  ".join(f"{n}={_long_cell_text(r)}" for n, r in res.items())
                    print(f"{mask_name} {dtype} {'fwd+bwd' if backward else 'fwd'} T={T}: {cells}")
                    sys.stdout.flush()
    print()
    print(long_table(rows, names, args.baseline))
    return 0


def _long_cell_text(r: dict | None) -> str:
    return "skipped" if r is None else f"{r['ms']:.1f}ms/{r['mb']:.0f}MB"


def long_table(rows, names: list[str], base_rev: str | None) -> str:
    label = {"auto": "auto", "tiles": "tiles", "auto@base": f"auto@{base_rev}"}
    head = "| mask | dtype | pass | T | " + " | ".join(f"{label[n]} ms | {label[n]} MB" for n in names) + " |"
    if "auto@base" in names:
        head += " time before / after | memory before / after |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for mask_name, dtype, backward, T, res in rows:
        cells = []
        for n in names:
            r = res[n]
            cells += ["skipped", "skipped"] if r is None else [f"{r['ms']:.1f}", f"{r['mb']:.0f}"]
        if "auto@base" in names:
            base, now = res["auto@base"], res["auto"]
            cells += (
                ["", ""]
                if base is None
                else [f"{base['ms'] / now['ms']:.1f}×", f"{base['mb'] / max(now['mb'], 1):.1f}×"]
            )
        pas = "fwd+bwd" if backward else "fwd"
        lines.append(f"| {mask_name} | {dtype} | {pas} | {T} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------
GPU_TOKENS = 32768  # B * T of every GPU case
GPU_HEADS = {64: 16, 128: 8}


def gpu_contenders(q, k, v, lengths: list[int], T: int, backward: bool):
    """The GPU suite's calls of one case as zero-argument functions returning ``(B, H, T, D)``."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    device = q.device
    B = q.shape[0]
    lens = torch.tensor(lengths, device=device)
    keep = torch.arange(T, device=device)[None, :] < lens[:, None]  # (B, T)
    allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None] & keep[:, None, None, :]
    mask = masks.causal() & masks.padding(lengths=lens)
    padded = any(L < T for L in lengths)

    def causal_padding(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx < lens[b])

    block_mask = create_block_mask(causal_padding, B, None, T, T, device=device)  # once, outside the timing
    flex = torch.compile(flex_attention)
    fns = {
        "auto": lambda: attention(q, k, v, mask, backend="auto"),
        "flex": lambda: attention(q, k, v, mask, backend="flex"),
        "sdpa+mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed),
        "is_causal": None if padded else (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "flex direct": lambda: flex(q, k, v, block_mask=block_mask),
    }
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    if flash_attn_varlen_func is not None and q.dtype in (torch.float16, torch.bfloat16):
        cu = torch.zeros(B + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(lens, 0)
        index = keep.reshape(-1).nonzero().squeeze(1)  # real tokens of the flattened (B*T) batch
        max_len = max(lengths)

        def flash_varlen():
            Hh, Dd = q.shape[1], q.shape[3]
            qs, ks, vs = (t.transpose(1, 2).reshape(B * T, Hh, Dd)[index] for t in (q, k, v))  # (N, H, D)
            out = flash_attn_varlen_func(qs, ks, vs, cu, cu, max_len, max_len, causal=True)  # (N, H, D)
            # pad queries see every real key in attnmask's mask: only real queries are compared
            full = torch.zeros(B * T, Hh, Dd, dtype=out.dtype, device=device).index_copy(0, index, out)
            return full.view(B, T, Hh, Dd).transpose(1, 2)

        fns["flash varlen"] = flash_varlen
    return fns, allowed, keep


def run_gpu_case(dtype, backward: bool, T: int, Dh: int, pad: float, repeats: int, device: str):
    Hh = GPU_HEADS.get(Dh, 8)
    B = max(1, GPU_TOKENS // T)
    lengths = lengths_for(B, T, pad)
    g = torch.Generator(device=device).manual_seed(T + Dh)
    q, k, v = (
        torch.randn(B, Hh, T, Dh, generator=g, device=device, dtype=dtype).requires_grad_(backward) for _ in range(3)
    )
    grad = torch.randn(B, Hh, T, Dh, generator=g, device=device, dtype=dtype)
    fns, allowed, keep = gpu_contenders(q, k, v, lengths, T, backward)
    cuda = torch.device(device).type == "cuda"

    def once(fn):
        for t in (q, k, v):
            t.grad = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = fn()
        if backward:
            out.backward(grad)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3, out.detach()
        return time.perf_counter() - t0, out.detach()

    with torch.no_grad():  # the reference: float32 SDPA with the bool mask
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=allowed).to(dtype)
    best = {}
    for name, fn in fns.items():
        if fn is None:
            best[name] = None
            continue
        once(fn)  # compile / warm up
        _, out = once(fn)
        rows = keep[:, None, :, None] if name == "flash varlen" else torch.ones_like(keep[:, None, :, None])
        tol = 3e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
        torch.testing.assert_close(
            out * rows, ref * rows, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n} is wrong: {m}"
        )
        best[name] = min(once(fn)[0] for _ in range(repeats)) * 1e3
    pairs = float(allowed.expand(B, 1, T, T).sum()) * Hh  # allowed (query, key) pairs over heads
    flops = 4 * Dh * pairs * (3.5 if backward else 1.0)
    return B, Hh, best, flops


GPU_NAMES = ["auto", "flex", "sdpa+mask", "is_causal", "flex direct", "flash varlen"]


def gpu_table(rows) -> str:
    names = [n for n in GPU_NAMES if any(n in r[-2] for r in rows)]
    head = (
        "| pass | T | D | B×H | pad | "
        + " | ".join(f"{n} ms" for n in names)
        + " | auto TFLOP/s | auto / flex direct | auto / sdpa+mask |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for backward, T, Dh, B, Hh, pad, best, flops in rows:
        ms = [("n/a" if best.get(n) is None else f"{best[n]:.2f}") for n in names]
        a = best["auto"]
        tflops = f"{flops / (a / 1e3) / 1e12:.3g}"
        vs_flex = f"{best['flex direct'] / a:.2f}×"
        vs_sdpa = f"{best['sdpa+mask'] / a:.2f}×"
        pas = "fwd+bwd" if backward else "fwd"
        lines.append(
            f"| {pas} | {T} | {Dh} | {B}×{Hh} | {pad:.0%} | " + " | ".join([*ms, tflops, vs_flex, vs_sdpa]) + " |"
        )
    return "\n".join(lines)


def main_gpu(args, argv) -> int:
    device = args.device
    Ts = [int(t) for t in args.T.split(",")] if args.T else [512, 1024, 2048, 4096, 8192]
    Ds = [int(d) for d in args.D.split(",")] if args.D else [64, 128]
    pads = [0.0, 0.25, 0.5]
    dtype = getattr(torch, args.dtypes.split(",")[0]) if args.dtypes != "float32,bfloat16" else torch.bfloat16
    passes = [False] if torch.device(device).type == "cpu" else [False, True]  # FlexAttention: no CPU backward
    repeats = args.repeats or 10
    print(machine(device))
    rows = []
    # every variant compiled in one process: "flex direct" (torch.compile(flex_attention) here) runs under
    # the recompile limit attnmask's own calls raise to, or past 8 variants it falls back to the unfused
    # path and times that (seen on an H200: D 128 forward+backward 15-50x slower in every flex column)
    limit = torch._dynamo.config.patch(recompile_limit=masks.core.RECOMPILE_LIMIT)
    for backward, Dh, T, pad in itertools.product(passes, Ds, Ts, pads):
        with limit:
            B, Hh, best, flops = run_gpu_case(dtype, backward, T, Dh, pad, repeats, device)
        rows.append((backward, T, Dh, B, Hh, pad, best, flops))
        cells = "  ".join(f"{n}={'n/a' if t is None else f'{t:.2f}ms'}" for n, t in best.items())
        print(f"{'fwd+bwd' if backward else 'fwd'} T={T} D={Dh} B={B} H={Hh} pad={pad:.0%}: {cells}")
        sys.stdout.flush()
    out = gpu_table(rows)
    print()
    print(out)
    if args.write_docs:
        cmd = "python benchmarks/attention.py " + " ".join(argv if argv is not None else sys.argv[1:])
        body = "\n".join(
            [
                GPU_SECTION,
                "",
                f"Causal + right key padding, {str(dtype).removeprefix('torch.')}, B·T = {GPU_TOKENS} tokens, H=16 at "
                "D=64 and H=8 at D=128; min of "
                f"{repeats} runs after a warm-up (compilation), CUDA events, in ms. TFLOP/s counts allowed "
                "query-key pairs only (4·D flops each forward, 3.5× that forward+backward). Every output is "
                "checked against float32 SDPA with the bool mask.",
                "",
                f"Machine: {machine(device)}.",
                "",
                f"Reproduce: `{cmd.replace(' --write-docs ' + args.write_docs, '').strip()}`",
                "",
                out,
            ]
        )
        write_docs(args.write_docs, GPU_SECTION, body)
        print(f"\nwrote the {GPU_SECTION!r} section of {args.write_docs}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (the CPU table) or cuda[:N] (the GPU suite)")
    p.add_argument("--quick", action="store_true", help="T in {64, 256}, 0%% and 50%% padding, 2 repeats")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per cell (default 3, --quick 2, GPU 10)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated torch dtypes (GPU: bfloat16)")
    p.add_argument("--T", default=None, help="comma-separated sequence lengths (default 64..2048; GPU 512..8192)")
    p.add_argument("--D", default=None, help="GPU: comma-separated head dims (default 64,128)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument(
        "--tokens", type=int, default=None, help="CPU: B = TOKENS // T (a training batch), instead of B=4 up to T=512"
    )
    p.add_argument("--baseline", metavar="REV", help="CPU: also time `auto` of attnmask at git revision REV")
    p.add_argument("--write-docs", metavar="FILE", help="write the table into FILE's attention section")
    p.add_argument("--gpu-suite", action="store_true", help="GPU suite on the CPU (forward only: a smoke test)")
    p.add_argument("--long", action="store_true", help="CPU: windows and documents at T = 1k..32k, time and memory")
    p.add_argument("--long-cell", metavar="JSON", help=argparse.SUPPRESS)  # one long cell, in a child process
    args = p.parse_args(argv)
    if args.long_cell:
        print(json.dumps(long_cell(json.loads(args.long_cell))))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.long:
        return main_long(args)
    if args.device != "cpu" or args.gpu_suite:
        return main_gpu(args, argv)
    if args.tokens and args.write_docs:
        raise SystemExit("--write-docs describes the default batch sizes (B=4); run --tokens without it")
    Ts = (
        [int(t) for t in args.T.split(",")]
        if args.T
        else ([64, 256] if args.quick else [64, 128, 256, 512, 1024, 2048])
    )
    pads = [0.0, 0.5] if args.quick else [0.0, 0.25, 0.5]
    repeats = args.repeats or (2 if args.quick else 3)
    dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",")]
    baseline = load_baseline(args.baseline) if args.baseline else None
    rows_for = (lambda T: max(1, args.tokens // T)) if args.tokens else batch_for
    cases = [Case(dt, bw, T, rows_for(T), pad) for dt in dtypes for bw in (False, True) for T in Ts for pad in pads]
    print(machine())
    print(f"B x H x T x D = B x {H} x T x {D}; causal + right key padding; min of {repeats} runs; × = t(a) / t(x)")
    rows = []
    for case in cases:
        t = run_case(case, repeats, baseline)
        rows.append((case, t))
        cells = "  ".join(
            f"{n}={'n/a' if v is None else v if isinstance(v, str) else f'{v:.2f}ms'}" for n, v in t.items()
        )
        print(f"{case.dtype} {'fwd+bwd' if case.backward else 'fwd'} T={case.T} B={case.B} pad={case.pad:.0%}: {cells}")
        sys.stdout.flush()
    out = table(rows, args.baseline)
    print()
    print(out)
    if args.write_docs:
        cmd = "python benchmarks/attention.py " + " ".join(argv if argv is not None else sys.argv[1:])
        base = (
            f", (f) `auto` of attnmask at git revision `{args.baseline}` in the same process (before this change)"
            if args.baseline
            else ""
        )
        body = "\n".join(
            [
                SECTION,
                "",
                "Causal + right key padding (seed 004's `M_total`), one attention call, "
                f"H={H}, D={D}, B shrinking with T (B=4 up to T=512, 2 at 1024, 1 at 2048); `pad` = mean "
                "fraction of padded keys. (a) the seeds' formula with a materialized additive mask, "
                "(b) SDPA with a materialized bool mask, (c) SDPA `is_causal=True` (correct only without "
                'padding), (d) `attnmask.attention(..., backend="auto")` given the same structured mask object on '
                "every call (linted, planned and materialized on the first call, then reused, as a model's layers "
                "share one mask), (e) the same with a new mask object built on every call (it pays for building, "
                f"linting, planning and materializing the mask each time){base}. Times: min of "
                f"{repeats} or more runs (fast cells: until {BUDGET_S:g} s or {MAX_REPEATS} runs) after a warm-up, "
                f"the contenders taking turns; runs over {SLOW_S:g} s timed once; in ms; × = speed-up over "
                "(a), t(a) / t(x). Every contender's output is checked against (a)'s.",
                "",
                f"Machine: {machine()}.",
                "",
                f"Reproduce: `{cmd.replace(' --write-docs ' + args.write_docs, '').strip()}`",
                "",
                out,
            ]
        )
        write_docs(args.write_docs, SECTION, body)
        print(f"\nwrote the {SECTION!r} section of {args.write_docs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
