"""The one-token decoding step as a few C++ operators: its work between the matrix products, and its float32 products.

A one-token step of a pre-norm RMSNorm / rotary / SwiGLU decoder (Llama, SmolLM2) does, per layer,
four matrix products and between them ~30 small operations on a few hundred floats: norms, a
residual, rotary on the new query and key, two cache writes, attention of one query per head,
SiLU. Eager PyTorch dispatches each of them (2-10 us apiece): a SmolLM2 step's framework work
took 4.0-4.5 ms a token on one Zen 5 core, and takes 1.95-2.3 ms with these operators, which do the
same work in one call each:

- ``torch.ops.attnmask.rms_norm(x, weight, eps)``: ``weight * x / sqrt(mean(x^2) + eps)`` per row;
- ``torch.ops.attnmask.add_rms_norm(x, delta, weight, eps)`` -> ``(x + delta, rms_norm(x + delta))``:
  a residual and the next sublayer's norm;
- ``torch.ops.attnmask.silu_mul(gate_up)``: ``silu(gate) * up`` for the halves of each row;
- ``torch.ops.attnmask.rope_attend(qkv, cos, signed_sin, k_cache, v_cache, col, keys, bias, heads,
  kv_heads, scale)``: the new query and key of every row rotated, the key and value written into
  cache column ``col`` (in place), and each query head attending to the first ``keys`` columns of
  its key/value head with ``bias`` (0 / -inf) added to its scores. Rows with nothing to attend to
  give zeros, never NaN;
- ``torch.ops.attnmask.linear_rows(x, weight, bias)``: ``x W^T + b`` for a few rows ``x (M, K)`` and a
  row-major ``W (N, K)``: a matrix-vector product that streams the weights with software prefetch and
  splits their rows over PyTorch's threads, where the BLAS reads them at ~60% of the rate and on one
  thread only (measured: 38 GB/s against 21-26 on one Zen 5 core; 46-52 against 21-26 on two).

- ``torch.ops.attnmask.decoder_step(x, cos, signed_sin, norms, eps, products, kinds, k_caches, v_caches,
  col, bias, heads, kv_heads, scale)``: a whole one-token step, every layer and the head, making the
  calls above (and ``attnmask::block_matmul`` for block layers) from C++: one call a token instead of
  ~210 from Python, each ~4 us of Python and dispatcher (see :func:`attnmask.decode.static._fused_step`).

The first four are what Llama's layers do between their products, the fifth their float32 products.
The operators are implemented in C++ for float32 CPU tensors only (``_fused.cpp``, built on first
use with ``$CXX`` against PyTorch's headers, see :mod:`attnmask.native`; other inputs are refused
with a message naming them). :func:`cpu_available` builds and loads them once, and says whether
they are there; ``ATTNMASK_FUSED=0`` turns them off. Where they are not,
:func:`attnmask.decode.static.decode_one` runs its PyTorch operations instead. ``*_reference`` is
each operator's definition in PyTorch, for any dtype and device: what the tests compare with. Rows
are computed independently of each other and of the thread count, so a row's result does not
depend on the batch it comes in.
"""

from __future__ import annotations

import os
import subprocess
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from attnmask import native

__all__ = [
    "add_rms_norm",
    "add_rms_norm_reference",
    "cpu_available",
    "decoder_step",
    "linear_rows",
    "linear_rows_reference",
    "rms_norm",
    "rms_norm_reference",
    "rope_attend",
    "rope_attend_reference",
    "silu_mul",
    "silu_mul_reference",
    "status",
]

_SOURCE = Path(__file__).with_name("_fused.cpp")
_lock = threading.Lock()
_state: dict[str, object] = {}


# ---------------------------------------------------------------------------------------------
# What each operator computes, in PyTorch (any dtype, any device): the tests' reference
# ---------------------------------------------------------------------------------------------
def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def add_rms_norm_reference(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    total = x + delta
    return total, rms_norm_reference(total, weight, eps)


def silu_mul_reference(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear_rows_reference(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight, bias)


def rope_attend_reference(
    qkv: Tensor,
    cos: Tensor,
    signed_sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    col: int,
    keys: int,
    bias: Tensor | None,
    heads: int,
    kv_heads: int,
    scale: float,
) -> Tensor:
    B, _, _, D = k_cache.shape
    q, k, v = qkv.reshape(B, heads + 2 * kv_heads, D).split([heads, kv_heads, kv_heads], dim=1)
    if cos.numel():
        cos, signed_sin = cos.reshape(B, 1, D), signed_sin.reshape(B, 1, D)
        q = q * cos + q.roll(D // 2, dims=-1) * signed_sin
        k = k * cos + k.roll(D // 2, dims=-1) * signed_sin
    k_cache[:, :, col] = k
    v_cache[:, :, col] = v
    qg = q.reshape(B, kv_heads, heads // kv_heads, D)  # the query heads of each key/value head as its queries
    scores = qg @ k_cache[:, :, :keys].transpose(-1, -2) * scale  # (B, Hkv, G, keys)
    if bias is not None:
        scores = scores + bias[..., :keys]
    top = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - top.clamp(min=torch.finfo(scores.dtype).min))  # no NaN when all are -inf
    total = weights.sum(-1, keepdim=True)
    out = (weights @ v_cache[:, :, :keys]) / torch.where(total > 0, total, 1.0)
    return out.reshape(B, heads * D)


# ---------------------------------------------------------------------------------------------
# The operators: schemas and shape rules here, the CPU float32 implementations in _fused.cpp
# ---------------------------------------------------------------------------------------------
_LIBRARY = torch.library.Library("attnmask", "FRAGMENT")
_LIBRARY.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_LIBRARY.define("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)")
_LIBRARY.define("silu_mul(Tensor gate_up) -> Tensor")
_LIBRARY.define("linear_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.define(
    "decoder_step(Tensor x, Tensor cos, Tensor signed_sin, Tensor[] norms, float[] eps, Tensor[] products, "
    "int[] kinds, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int col, Tensor? bias, int heads, int kv_heads, "
    "float scale) -> Tensor"
)
DENSE, Q4_1, Q8_0 = 0, 1, 2  # decoder_step's product kinds: a float32 weight and bias, block layers' buffers
_LIBRARY.define(
    "rope_attend(Tensor qkv, Tensor cos, Tensor signed_sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int col, "
    "int keys, Tensor? bias, int heads, int kv_heads, float scale) -> Tensor"
)


@torch.library.register_fake("attnmask::rms_norm", lib=_LIBRARY)
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.register_fake("attnmask::add_rms_norm", lib=_LIBRARY)
def _(x, delta, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.register_fake("attnmask::silu_mul", lib=_LIBRARY)
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.register_fake("attnmask::linear_rows", lib=_LIBRARY)
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.register_fake("attnmask::decoder_step", lib=_LIBRARY)
def _(x, cos, signed_sin, norms, eps, products, kinds, k_caches, v_caches, col, bias, heads, kv_heads, scale):
    head = products[-2 if kinds[-1] != Q4_1 else -3]  # the head's weight or codes: (V, ...)
    return x.new_empty(x.shape[0], head.shape[0])


@torch.library.register_fake("attnmask::rope_attend", lib=_LIBRARY)
def _(qkv, cos, signed_sin, k_cache, v_cache, col, keys, bias, heads, kv_heads, scale):
    return qkv.new_empty(k_cache.shape[0], heads * k_cache.shape[3])


rms_norm = torch.ops.attnmask.rms_norm.default
add_rms_norm = torch.ops.attnmask.add_rms_norm.default
silu_mul = torch.ops.attnmask.silu_mul.default
rope_attend = torch.ops.attnmask.rope_attend.default
linear_rows = torch.ops.attnmask.linear_rows.default
decoder_step = torch.ops.attnmask.decoder_step.default


# ---------------------------------------------------------------------------------------------
# The C++ build
# ---------------------------------------------------------------------------------------------
def cpu_available() -> bool:
    """Whether the C++ CPU implementations are loaded (building them on the first call; a warning,
    once, if they cannot be built). False with ``ATTNMASK_FUSED=0``."""
    if "loaded" in _state:
        return bool(_state["loaded"])
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = False
            if os.environ.get("ATTNMASK_FUSED", "1") == "0":
                _state["why"] = "disabled by ATTNMASK_FUSED=0"
            else:
                try:
                    _state["why"] = _load()
                    _state["loaded"] = True
                except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                    _state["why"] = f"PyTorch ({err})"
                    warnings.warn(
                        f"attnmask: fused decoding operators unavailable, decoding with PyTorch's (slower): {err}",
                        stacklevel=3,
                    )
    return bool(_state["loaded"])


def status() -> str:
    """Which implementation the fused operators use here (building the C++ one if needed)."""
    cpu_available()
    return str(_state["why"])


def _load() -> str:
    """Build (once, into the kernel cache) and load ``_fused.cpp``; returns what was loaded, in words."""
    cxx = native.compiler("CXX", "c++")
    source = _SOURCE.read_text(encoding="utf-8")
    # at::parallel_for is OpenMP in PyTorch's CPU builds: without -fopenmp it runs on one thread
    for flags in ([*native.simd_flags(), "-fopenmp"], native.simd_flags()):
        name = native.library_name("fused", source, *flags, *cxx, torch.__version__)
        target = native.cache_dir() / "kernels" / name
        try:
            if not target.is_file():
                native.build_operator(target, _SOURCE, cxx[0], flags=flags)
            break
        except OSError as err:
            error = err
    else:
        raise error
    torch.ops.load_library(str(target))
    simd = {"AVX512": "AVX-512", "AVX2": "AVX2"}.get(torch.backends.cpu.get_cpu_capability(), "portable C")
    return f"C++, {simd}, {'OpenMP threads' if '-fopenmp' in flags else 'one thread'} ({target})"
