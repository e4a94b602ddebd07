"""The decoding step's work between its matrix products, and its float32 products, as PyTorch operators.

A decoding step of a pre-norm RMSNorm / rotary / SwiGLU decoder (Llama, SmolLM2) does, per layer,
four matrix products and between them ~30 small operations on a few hundred floats a row: norms, a
residual, rotary on the new queries and keys, cache writes, attention, SiLU. Eager PyTorch dispatches
each of them separately, and at batch 1 that dispatching costs as much as the products; these
operators do the same work in one call each (figures: the SmolLM2 sections of ``docs/benchmarks.md``):

- ``torch.ops.attnmask.rms_norm(x, weight, eps)``: ``weight * x / sqrt(mean(x^2) + eps)`` per row;
- ``torch.ops.attnmask.add_rms_norm(x, delta, weight, eps)`` -> ``(x + delta, rms_norm(x + delta))``:
  a residual and the next sublayer's norm;
- ``torch.ops.attnmask.silu_mul(gate_up)``: ``silu(gate) * up`` for the halves of each row;
- ``torch.ops.attnmask.linear_panels(x, panels, bias, n)``: ``x W^T + b`` for rows ``x (M, K)`` and
  ``W (n, K)`` packed once by ``torch.ops.attnmask.pack_panels(weight)`` (:func:`panels` keeps the packed
  copy of a weight; ``csrc/rows.cpp``): register tiles of rows of ``x`` against panels of ``W``'s rows,
  each output one chain of multiply-adds over ``k`` in order whatever the number of rows
  (batch-invariant), the panels split over PyTorch's threads; ``linear_rows(x, weight, bias)`` is the
  same product, bit for bit, for a row-major ``W`` packed at each call;
- ``torch.ops.attnmask.head_argmax(h, weight, bias, estimates, bound)``: each row's arg-max of ``h W^T + b``
  as ``linear_panels`` computes it (the first of equal largest), exactly, from estimates of every output, a
  proven bound on how far each can be from the exact output, and the exact outputs of the few rows that can
  still win (:func:`screen` keeps a weight's screen, its copy in 8-bit blocks, and bounds;
  :func:`argmax_rows` the whole: greedy decoding's head, from about a quarter of its bytes);
  ``screen_argmax(h, weight, bias, screen, bound, norms)`` the same from the screen's int8 estimates, each
  compared as it is made and never stored (many rows); ``block_head_argmax(h, panels, norms, out_features)``
  for a head in 8-bit block panels; ``first_largest(x)``: ``x.max(dim=-1).indices`` in one vector pass;
- ``torch.ops.attnmask.paged_attend(q, k_pool, v_pool, tables, row_seq, row_pos, window, heads, scale)``:
  packed rows of several sequences, each attending to its own sequence's cached keys up to its own
  position (and within ``window``), read through a block table: the serving engine's attention
  (:mod:`attnmask.decode.step`), and the source attention of encoder-decoder models (each source one
  block, read whole);
- ``torch.ops.attnmask.packed_step(x, cos, signed_sin, layer_rope, norms, eps, products, kinds,
  activation, k_pools, v_pools, tables, layer_group, windows, row_seq, row_pos, logit_rows, heads,
  kv_heads, scale)``: a whole step over packed rows of several sequences, every layer (rotary, cache
  writes, ``paged_attend``) and the head on the rows that sample, making the calls above (and the
  block product of :mod:`attnmask.ops.blocks` for block layers) from C++: one call a step instead of a
  few hundred from Python (see :func:`attnmask.decode.step.packed_forward`). Llama's layers and Gemma
  3's: a layer's optional parts (q/k norms over each head, norms of the sublayers' outputs before the
  residual), a rotary table, a window and a group of block tables per layer, a SiLU- or tanh-GELU-gated
  MLP, q/k/v and gate/up in one product or several, every block format of :mod:`attnmask.ops.blocks`
  (:data:`NORMS` / :data:`PRODUCTS` slots a layer, :func:`packed_step_reference`).

Each operator has its PyTorch definition here (``*_reference``, any dtype and device), registered as
the kernel every device runs where no faster one is; ``csrc/decoding.cpp`` registers the float32
CPU kernels (other dtypes are refused there with a message naming them) when the native library is
built (:mod:`attnmask.ops.native`). Rows are computed independently of each other and of the thread
count, so a row's result does not depend on the batch it comes in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.weak
from torch import Tensor

from attnmask.ops import blocks  # packed_step multiplies by block weights (csrc/blocks.h in C++)

__all__ = [
    "add_rms_norm",
    "add_rms_norm_reference",
    "bias_operand",
    "gated_reference",
    "linear_panels",
    "linear_panels_reference",
    "linear_rows",
    "linear_rows_reference",
    "pack_panels",
    "pack_panels_reference",
    "panels",
    "argmax_rows",
    "block_argmax_rows",
    "block_head_argmax",
    "block_head_argmax_reference",
    "block_norms",
    "BLOCK_SCREEN_MIN_ROWS",
    "estimates_fast",
    "first_largest",
    "first_largest_reference",
    "head_argmax",
    "head_argmax_reference",
    "screen",
    "screen_argmax",
    "screen_argmax_reference",
    "screen_estimates",
    "screens",
    "packed_step",
    "packed_step_reference",
    "paged_attend",
    "paged_attend_reference",
    "rms_norm",
    "rms_norm_reference",
    "seq2seq_step",
    "seq2seq_step_reference",
    "silu_mul",
    "silu_mul_reference",
    "unpack_panels",
]

# packed_step's product kinds: a float32 weight in panels and its bias (n,), or an empty (n, 0) for none; a
# block layer's weight in the kernel's 4-bit layout (Q4_1, Q4_K), its 8-bit layout (Q8_0, Q5_0) or its 8-bit
# layout with a scale per 16 weights (Q6_K), as its panels (blocks.pack_block_panels) and an empty (n, 0);
# INT8 + each of those: the layer's buffers (codes, d, and m for the 4-bit layout), multiplied with int8
# activations (blocks.block_matmul_i8); NONE: no product in an optional slot
NONE, DENSE, Q4_1, Q8_0, Q6_K, INT8 = -1, 0, 1, 2, 3, 3
# The slots of each layer in packed_step's lists: its norms (an empty weight where it has none of an
# optional one: q_norm, k_norm, post_self_norm, post_mlp_norm), then the final norm; its products (NONE
# for k and v when the first slot holds the fused q/k/v product, for up when GATE_UP holds gate and up),
# then the head
SELF_NORM, Q_NORM, K_NORM, POST_SELF_NORM, MLP_NORM, POST_MLP_NORM, NORMS = range(7)
QKV, K, V, O, GATE_UP, UP, DOWN, PRODUCTS = range(8)


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


PANEL_WIDTH = 16  # the panels pack_panels_reference makes; the native build's width is its own (csrc/rows.h)


def pack_panels_reference(weight: Tensor) -> Tensor:
    """``weight (N, K)`` as ``(P, K, width)`` panels: ``panels[p, k, j] = weight[p * width + j, k]``, zeros past N."""
    n, k = weight.shape
    padded = torch.cat([weight, weight.new_zeros((-n) % PANEL_WIDTH, k)])
    return padded.reshape(-1, PANEL_WIDTH, k).transpose(1, 2).contiguous()


def unpack_panels(panels: Tensor, n: int) -> Tensor:
    """The row-major ``(n, K)`` weight of panels of any width."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n]


def linear_panels_reference(x: Tensor, panels: Tensor, bias: Tensor | None, n: int) -> Tensor:
    return F.linear(x, unpack_panels(panels, n), bias)


def head_argmax_reference(h: Tensor, weight: Tensor, bias: Tensor | None, estimates: Tensor, bound: Tensor) -> Tensor:
    """What ``head_argmax`` answers: the first largest output of each row of ``h W^T + b``, from the whole
    product (the estimates and bounds unread)."""
    return linear_rows_reference(h, weight, bias).max(dim=-1).indices


def block_head_argmax_reference(h: Tensor, panels: Tensor, norms: Tensor, out_features: int) -> Tensor:
    """What ``block_head_argmax`` answers: the first largest output of each row of ``block_panels_matmul``,
    from the whole product (the norms unread)."""
    return blocks.block_panels_matmul(panels, h, out_features).max(dim=-1).indices


def screen_argmax_reference(
    h: Tensor, weight: Tensor, bias: Tensor | None, screen: Tensor, bound: Tensor, norms: Tensor
) -> Tensor:
    """What ``screen_argmax`` answers: the first largest output of each row of ``h W^T + b``, from the whole
    product (the screen unread)."""
    return linear_rows_reference(h, weight, bias).max(dim=-1).indices


def first_largest_reference(x: Tensor) -> Tensor:
    """What ``first_largest`` answers: ``x.max(dim=-1).indices`` (each row's first NaN, else its first largest)."""
    return x.max(dim=-1).indices


_PANELS = torch.utils.weak.WeakIdKeyDictionary()  # weight -> ((version, address, shape), its panels)


def panels(weight: Tensor) -> Tensor:
    """``weight (N, K)`` in panels for :func:`linear_panels`, packed once and kept while ``weight`` lives: a
    second copy of it, packed again when it changes (an optimizer step, a load), as the step's product
    reads it. One chain per output makes the panel product fast (72-90 GMAC/s on an Intel Xeon core at
    64-256 rows) and batch-invariant (``csrc/rows.cpp``)."""
    key = (weight._version, weight.data_ptr(), tuple(weight.shape))
    held = _PANELS.get(weight)
    if held is not None and held[0] == key:
        return held[1]
    packed = pack_panels(weight.detach())
    _PANELS[weight] = (key, packed)
    return packed


def bias_operand(weight: Tensor, bias: Tensor | None) -> Tensor:
    """A float32 product's bias as ``packed_step`` takes it: the bias, or an empty ``(N, 0)`` giving N."""
    return weight.new_empty(weight.shape[0], 0) if bias is None else bias


def _first_tensors(kinds: list[int]) -> list[int]:
    """Where each product's tensors start in a step's list (``kinds[i]``: NONE none, DENSE panels and
    bias, Q4_1 / Q8_0 / Q6_K block panels and an empty ``(N, 0)``, their INT8 kinds codes and d (and m
    for Q4_1)), and the end."""
    first = [0]
    for kind in kinds:
        first.append(first[-1] + (0 if kind == NONE else 3 if kind == Q4_1 + INT8 else 2))
    return first


def _outputs(products: list[Tensor], kinds: list[int], i: int) -> int:
    """Product ``i``'s output features, from its tensors."""
    first = _first_tensors(kinds)[i]
    return products[first + 1].shape[0] if kinds[i] <= Q6_K else products[first].shape[0]


_BLOCK_NAMES = {Q4_1: "Q4_1", Q8_0: "Q8_0", Q6_K: "Q6_K"}  # the layout's kernel for each block kind


def _projector(products: list[Tensor], kinds: list[int]):
    """``project(i, h)``: product ``i`` of a step's list, as ``packed_step`` makes it."""
    first = _first_tensors(kinds)

    def project(i: int, h: Tensor) -> Tensor:
        t = products[first[i] : first[i + 1]]
        if kinds[i] == DENSE:
            return linear_panels(h, t[0], t[1] if t[1].dim() == 1 else None, t[1].shape[0])
        if kinds[i] <= Q6_K:
            return blocks.block_panels_matmul(t[0], h, t[1].shape[0])
        layout = kinds[i] - INT8
        m = t[2] if layout == Q4_1 else None
        return blocks.block_matmul_i8(t[0], t[1], m, h, _BLOCK_NAMES[layout], h.shape[1])

    return project


def gated_reference(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    """``act(gate) * up`` for ``packed_step``'s activations: ``"silu"`` or ``"gelu_tanh"``."""
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


def paged_attend_reference(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    tables: Tensor,
    row_seq: Tensor,
    row_pos: Tensor,
    window: int,
    heads: int,
    scale: float,
) -> Tensor:
    """``paged_attend`` in PyTorch, one row at a time (so that a row's result, here too, does not
    depend on the rows packed with it): row ``r`` attends to the keys of sequence ``row_seq[r]`` at
    positions ``[max(0, row_pos[r] - window + 1), row_pos[r]]`` (``window`` 0: from 0), read through
    that sequence's block table."""
    N = q.shape[0]
    _, S, Hkv, D = k_pool.shape
    G = heads // Hkv
    out = q.new_zeros(N, heads * D)
    for r in range(N):
        seq, last = int(row_seq[r]), int(row_pos[r])
        first = max(0, last - window + 1) if window > 0 else 0
        t = torch.arange(first, last + 1, device=q.device)
        slots = tables[seq, t // S] * S + t % S  # (T,) rows of the flattened pool
        k = k_pool.reshape(-1, Hkv, D)[slots].transpose(0, 1)  # (Hkv, T, D)
        v = v_pool.reshape(-1, Hkv, D)[slots].transpose(0, 1)
        qh = q[r].reshape(Hkv, G, D)  # the G query heads of each key/value head
        weights = torch.softmax((qh @ k.transpose(-1, -2)) * scale, dim=-1)  # (Hkv, G, T)
        out[r] = (weights @ v).reshape(heads * D)
    return out


def packed_step_reference(
    x: Tensor,
    cos: Tensor,
    signed_sin: Tensor,
    layer_rope: list[int],
    norms: list[Tensor],
    eps: list[float],
    products: list[Tensor],
    kinds: list[int],
    activation: str,
    k_pools: list[Tensor],
    v_pools: list[Tensor],
    tables: list[Tensor],
    layer_group: list[int],
    windows: list[int],
    row_seq: Tensor,
    row_pos: Tensor,
    logit_rows: Tensor,
    heads: int,
    kv_heads: int,
    scale: float,
) -> Tensor:
    """``packed_step`` as operator calls from Python, in the same order. Per layer (``NORMS`` norm
    slots and ``PRODUCTS`` product slots; the optional ones empty / ``NONE`` where the layer has none):
    the self-attention norm; the q/k/v product (or three); each head of q and k normed (q_norm, k_norm);
    the layer's rotary table (``layer_rope``) on q and k; k and v written to the rows' slots in the
    layer's group of block tables (``layer_group``); ``paged_attend`` within the layer's window; the
    output product, its post norm, the residual and the MLP norm; ``act(gate) * up`` (one gate/up product
    or two), the down product, its post norm, the residual and the next norm; the head on
    ``logit_rows`` only."""
    L, N = len(k_pools), x.shape[0]
    _, S, Hkv, D = k_pools[0].shape
    H = heads
    project = _projector(products, kinds)
    slots = [t[row_seq, row_pos // S] * S + row_pos % S for t in tables]  # (N,) each group

    def norm(i: int, t: Tensor) -> Tensor:  # an optional norm: an empty weight is none
        return rms_norm(t.contiguous(), norms[i], eps[i]) if norms[i].numel() else t

    h = rms_norm(x, norms[SELF_NORM], eps[SELF_NORM])
    for layer in range(L):
        n, p, g = NORMS * layer, PRODUCTS * layer, layer_group[layer]
        if kinds[p + K] == NONE:
            q, k, v = project(p + QKV, h).split([H * D, Hkv * D, Hkv * D], dim=1)
        else:
            q, k, v = project(p + QKV, h), project(p + K, h), project(p + V, h)
        q = norm(n + Q_NORM, q.reshape(N * H, D)).reshape(N, H, D)
        k = norm(n + K_NORM, k.reshape(N * Hkv, D)).reshape(N, Hkv, D)
        if cos.numel():
            c, s = cos[layer_rope[layer]].reshape(N, 1, D), signed_sin[layer_rope[layer]].reshape(N, 1, D)
            q = q * c + q.roll(D // 2, dims=-1) * s
            k = k * c + k.roll(D // 2, dims=-1) * s
        k_pools[layer].view(-1, Hkv, D)[slots[g]] = k
        v_pools[layer].view(-1, Hkv, D)[slots[g]] = v.reshape(N, Hkv, D)
        out = paged_attend(q.reshape(N, H * D).contiguous(), k_pools[layer], v_pools[layer], tables[g], row_seq,
                           row_pos, windows[layer], H, scale)  # fmt: skip
        out = norm(n + POST_SELF_NORM, project(p + O, out))
        x, h = add_rms_norm(x, out, norms[n + MLP_NORM], eps[n + MLP_NORM])
        if kinds[p + UP] == NONE:
            both = project(p + GATE_UP, h)
            a = silu_mul(both) if activation == "silu" else gated_reference(*both.chunk(2, dim=-1), activation)
        else:
            a = gated_reference(project(p + GATE_UP, h), project(p + UP, h), activation)
        delta = norm(n + POST_MLP_NORM, project(p + DOWN, a.contiguous()))
        x, h = add_rms_norm(x, delta, norms[n + NORMS], eps[n + NORMS])
    h = h.index_select(0, logit_rows).contiguous()
    return h if kinds[PRODUCTS * L] == NONE else project(PRODUCTS * L, h)


# seq2seq_step's slots, per decoder layer: its norms (self-attention, cross-attention, MLP), each a
# (weight, bias) pair in the list (an empty bias: none), then the final norm's pair (an empty weight: none,
# a post-norm model's); its products (NONE for k and v when S_QKV holds the fused q/k/v product, for
# S_GATE in a plain MLP, for S_UP when S_GATE holds gate and up in one product), then the head
S2S_SELF, S2S_CROSS, S2S_MLP, S2S_NORMS = range(4)
S_QKV, S_K, S_V, S_O, S_CROSS_Q, S_CROSS_O, S_GATE, S_UP, S_DOWN, S2S_PRODUCTS = range(10)
_S2S_ACTIVATIONS = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


def seq2seq_step_reference(
    x: Tensor,
    cos: Tensor,
    signed_sin: Tensor,
    norms: list[Tensor],
    eps: list[float],
    pre: bool,
    rms: bool,
    products: list[Tensor],
    kinds: list[int],
    activation: str,
    k_pools: list[Tensor],
    v_pools: list[Tensor],
    tables: list[Tensor],
    layer_group: list[int],
    windows: list[int],
    memory_k: list[Tensor],
    memory_v: list[Tensor],
    memory_tables: Tensor,
    row_seq: Tensor,
    row_pos: Tensor,
    row_src: Tensor,
    src_last: Tensor,
    src_real: Tensor | None,
    logit_rows: Tensor,
    heads: int,
    kv_heads: int,
    scale: float,
) -> Tensor:
    """``seq2seq_step`` as operator calls from Python, in the same order: a step of an encoder-decoder's
    decoder over packed rows. Per layer, each sublayer ``f`` with its residual and norm, ``x + f(norm(x))``
    (``pre``) or ``norm(x + f(x))`` (post-norm: the original Transformer, Marian), the norms LayerNorm
    (or RMSNorm, ``rms``): self-attention (the q/k/v product or three; q and k rotated by the rows' factors
    ``cos``, ``signed_sin`` ``(N, D)`` where given; k and v written to the rows' slots in the layer's group
    of block tables; ``paged_attend`` within the layer's window; the output product),
    attention to each row's source (``memory_k/v[layer]`` ``(Q, S, Hkv, D)``, one block per source in
    ``memory_tables (Q, 1)``, row ``r`` reading source ``row_src[r]`` up to ``src_last[r]``; times
    ``src_real (N, 1)`` where given), the MLP (``down(act(up))``, or gated: ``act(gate) * up``, SiLU's
    fused halves through ``silu_mul``); then the final norm (where given) and the head on ``logit_rows``
    (a head of kind ``NONE``: the final norm's rows themselves, for :func:`argmax_rows`)."""
    L, N = len(k_pools), x.shape[0]
    _, S, Hkv, D = k_pools[0].shape
    H, act = heads, _S2S_ACTIVATIONS[activation]
    project = _projector(products, kinds)
    slots = [t[row_seq, row_pos // S] * S + row_pos % S for t in tables]  # (N,) each group

    def norm(i: int, t: Tensor) -> Tensor:
        w, b = norms[2 * i], norms[2 * i + 1]
        if rms:
            return rms_norm(t.contiguous(), w, eps[i])
        return F.layer_norm(t, (t.shape[-1],), w, b if b.numel() else None, eps[i])

    def sublayer(x: Tensor, i: int, fn) -> Tensor:
        return x + fn(norm(i, x)) if pre else norm(i, x + fn(x))

    for layer in range(L):
        n, p, g = S2S_NORMS * layer, S2S_PRODUCTS * layer, layer_group[layer]

        def attend(h: Tensor, p=p, layer=layer, g=g) -> Tensor:
            if kinds[p + S_K] == NONE:
                q, k, v = project(p + S_QKV, h).split([H * D, Hkv * D, Hkv * D], dim=1)
            else:
                q, k, v = project(p + S_QKV, h), project(p + S_K, h), project(p + S_V, h)
            q, k = q.reshape(N, H, D), k.reshape(N, Hkv, D)
            if cos.numel():
                c, s = cos[:, None], signed_sin[:, None]  # (N, 1, D)
                q = q * c + q.roll(D // 2, dims=-1) * s
                k = k * c + k.roll(D // 2, dims=-1) * s
            q = q.reshape(N, H * D)
            k_pools[layer].view(-1, Hkv, D)[slots[g]] = k
            v_pools[layer].view(-1, Hkv, D)[slots[g]] = v.reshape(N, Hkv, D)
            out = paged_attend(q.contiguous(), k_pools[layer], v_pools[layer], tables[g], row_seq, row_pos,
                               windows[layer], H, scale)  # fmt: skip
            return project(p + S_O, out)

        def cross(h: Tensor, p=p, layer=layer) -> Tensor:
            out = paged_attend(project(p + S_CROSS_Q, h), memory_k[layer], memory_v[layer], memory_tables, row_src,
                               src_last, 0, H, scale)  # fmt: skip
            return project(p + S_CROSS_O, out if src_real is None else out * src_real)

        def mlp(h: Tensor, p=p) -> Tensor:
            if kinds[p + S_GATE] == NONE:
                a = act(project(p + S_UP, h))
            elif kinds[p + S_UP] == NONE:
                both = project(p + S_GATE, h)
                gate, up = both.chunk(2, dim=1)
                a = silu_mul(both) if activation == "silu" else act(gate) * up
            else:
                a = act(project(p + S_GATE, h)) * project(p + S_UP, h)
            return project(p + S_DOWN, a.contiguous())

        x = sublayer(x, n + S2S_SELF, attend)
        x = sublayer(x, n + S2S_CROSS, cross)
        x = sublayer(x, n + S2S_MLP, mlp)
    h = x.index_select(0, logit_rows)
    if norms[2 * S2S_NORMS * L].numel():
        h = norm(S2S_NORMS * L, h)
    return h if kinds[S2S_PRODUCTS * L] == NONE else project(S2S_PRODUCTS * L, h.contiguous())


# ---------------------------------------------------------------------------------------------
# The operators: schemas, shape rules and PyTorch definitions here; csrc/decoding.cpp adds the
# float32 CPU kernels
# ---------------------------------------------------------------------------------------------
_LIBRARY = torch.library.Library("attnmask", "FRAGMENT")
_LIBRARY.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_LIBRARY.define("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)")
_LIBRARY.define("silu_mul(Tensor gate_up) -> Tensor")
_LIBRARY.define("linear_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.define("pack_panels(Tensor weight) -> Tensor")
_LIBRARY.define("linear_panels(Tensor x, Tensor panels, Tensor? bias, int n) -> Tensor")
_LIBRARY.define("head_argmax(Tensor h, Tensor weight, Tensor? bias, Tensor estimates, Tensor bound) -> Tensor")
_LIBRARY.define("block_head_argmax(Tensor h, Tensor panels, Tensor norms, int out_features) -> Tensor")
_LIBRARY.define("first_largest(Tensor x) -> Tensor")
_LIBRARY.define(
    "screen_argmax(Tensor h, Tensor weight, Tensor? bias, Tensor screen, Tensor bound, Tensor norms) -> Tensor"
)
_LIBRARY.define(
    "packed_step(Tensor x, Tensor cos, Tensor signed_sin, int[] layer_rope, Tensor[] norms, float[] eps, "
    "Tensor[] products, int[] kinds, str activation, Tensor(a!)[] k_pools, Tensor(b!)[] v_pools, "
    "Tensor[] tables, int[] layer_group, int[] windows, Tensor row_seq, Tensor row_pos, Tensor logit_rows, "
    "int heads, int kv_heads, float scale) -> Tensor"
)
_LIBRARY.define(
    "seq2seq_step(Tensor x, Tensor cos, Tensor signed_sin, Tensor[] norms, float[] eps, bool pre, bool rms, "
    "Tensor[] products, int[] kinds, str activation, Tensor(a!)[] k_pools, Tensor(b!)[] v_pools, Tensor[] tables, "
    "int[] layer_group, int[] windows, Tensor[] memory_k, Tensor[] memory_v, Tensor memory_tables, Tensor row_seq, "
    "Tensor row_pos, Tensor row_src, Tensor src_last, Tensor? src_real, Tensor logit_rows, int heads, int kv_heads, "
    "float scale) -> Tensor"
)
_LIBRARY.define(
    "paged_attend(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor row_seq, Tensor row_pos, int window, "
    "int heads, float scale) -> Tensor"
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


@torch.library.register_fake("attnmask::pack_panels", lib=_LIBRARY)
def _(weight):
    return pack_panels_reference(weight)


@torch.library.register_fake("attnmask::linear_panels", lib=_LIBRARY)
def _(x, panels, bias, n):
    return x.new_empty(x.shape[0], n)


@torch.library.register_fake("attnmask::head_argmax", lib=_LIBRARY)
def _(h, weight, bias, estimates, bound):
    return h.new_empty(h.shape[0], dtype=torch.long)


@torch.library.register_fake("attnmask::block_head_argmax", lib=_LIBRARY)
def _(h, panels, norms, out_features):
    return h.new_empty(h.shape[0], dtype=torch.long)


@torch.library.register_fake("attnmask::screen_argmax", lib=_LIBRARY)
def _(h, weight, bias, screen, bound, norms):
    return h.new_empty(h.shape[0], dtype=torch.long)


@torch.library.register_fake("attnmask::first_largest", lib=_LIBRARY)
def _(x):
    return x.new_empty(x.shape[0], dtype=torch.long)


@torch.library.register_fake("attnmask::packed_step", lib=_LIBRARY)
def _(x, cos, signed_sin, layer_rope, norms, eps, products, kinds, activation, k_pools, v_pools, tables, layer_group,
      windows, row_seq, row_pos, logit_rows, heads, kv_heads, scale):  # fmt: skip
    head = x.shape[1] if kinds[-1] == NONE else _outputs(products, kinds, len(kinds) - 1)  # NONE: the normed rows
    return x.new_empty(logit_rows.shape[0], head)


@torch.library.register_fake("attnmask::seq2seq_step", lib=_LIBRARY)
def _(x, cos, signed_sin, norms, eps, pre, rms, products, kinds, activation, k_pools, v_pools, tables, layer_group,
      windows, memory_k, memory_v, memory_tables, row_seq, row_pos, row_src, src_last, src_real, logit_rows, heads,
      kv_heads, scale):  # fmt: skip
    return x.new_empty(logit_rows.shape[0], _outputs(products, kinds, len(kinds) - 1))


@torch.library.register_fake("attnmask::paged_attend", lib=_LIBRARY)
def _(q, k_pool, v_pool, tables, row_seq, row_pos, window, heads, scale):
    return torch.empty_like(q)


for _name, _definition in [
    ("rms_norm", rms_norm_reference),
    ("add_rms_norm", add_rms_norm_reference),
    ("silu_mul", silu_mul_reference),
    ("linear_rows", linear_rows_reference),
    ("pack_panels", pack_panels_reference),
    ("linear_panels", linear_panels_reference),
    ("head_argmax", head_argmax_reference),
    ("block_head_argmax", block_head_argmax_reference),
    ("first_largest", first_largest_reference),
    ("screen_argmax", screen_argmax_reference),
    ("paged_attend", paged_attend_reference),
    ("packed_step", packed_step_reference),
    ("seq2seq_step", seq2seq_step_reference),
]:
    _LIBRARY.impl(_name, _definition, "CompositeExplicitAutograd")

rms_norm = torch.ops.attnmask.rms_norm.default
add_rms_norm = torch.ops.attnmask.add_rms_norm.default
silu_mul = torch.ops.attnmask.silu_mul.default
paged_attend = torch.ops.attnmask.paged_attend.default
packed_step = torch.ops.attnmask.packed_step.default
seq2seq_step = torch.ops.attnmask.seq2seq_step.default
linear_rows = torch.ops.attnmask.linear_rows.default
pack_panels = torch.ops.attnmask.pack_panels.default
linear_panels = torch.ops.attnmask.linear_panels.default
head_argmax = torch.ops.attnmask.head_argmax.default
block_head_argmax = torch.ops.attnmask.block_head_argmax.default
_first_largest = torch.ops.attnmask.first_largest.default
screen_argmax = torch.ops.attnmask.screen_argmax.default


def first_largest(x: Tensor) -> Tensor:
    """Each row's index of its first largest value, ``(M,)`` int64 for ``x (M, N)``, exactly as
    ``x.max(dim=-1).indices`` (a row with a NaN: its first NaN): greedy decoding's choice. A float32 CPU matrix goes
    through the operator (with the native kernels one vector pass: Gemma 3's 262,144 logits in ~60 us against
    max's ~220), anything else through ``max``."""
    if x.dim() == 2 and x.shape[1] and x.dtype == torch.float32 and x.is_cpu and x.is_contiguous():
        return _first_largest(x)
    return x.max(dim=-1).indices


SCREEN_MIN_WEIGHTS = 1 << 22  # heads smaller than this (4M weights, 16 MiB) are read whole: little to save
# more rows than this read the head whole: by 16 rows the products, not the reading, set the pace, and the
# screen's are a second set (Intel Xeon, 2 threads, benchmarks/greedy_head.py: SmolLM2's head at 16 rows
# 0.81x, at 8 rows 1.02x; Gemma 3's 1.28x and 1.99x)
SCREEN_MAX_ROWS = 8
# More rows than SCREEN_MAX_ROWS: where the kernels have the screen's int8 estimates (blocks.block_panels_estimate,
# AVX512-VNNI and VBMI), the screen is read with each row rounded to 8 bits, about 2.7x the float32 products'
# multiply-adds a second (Zen 4, one thread, 8,000 x 512 at 16-64 rows: 142-145 against 52-53 GMAC/s), and heads from
# ESTIMATE_MIN_WEIGHTS up are screened: by then the work, not the reading, is what the screen saves.
ESTIMATE_MIN_WEIGHTS = 1 << 20
# A block head (its own 8-bit panels: no smaller copy to read) is screened from this many rows: the one pass
# reads the panels' bytes as the product does, and pays once the rows' products outweigh the reading (Zen 4,
# medians of 30 calls on the models' own hidden rows, screen against whole: SmolLM2's Q8_0 head at 4 rows
# 1.19 against 1.47 ms with two threads, 2.65 against 3.22 with one; Gemma 3's 9.1 against 9.4 ms at 4 rows,
# 10.0 against 13.0 at 5; at one row Gemma 3's 5.8 against 4.1 ms)
BLOCK_SCREEN_MIN_ROWS = 4
# weight -> ((version, address, shape), (panels, bound, norms) or None)
_SCREENS = torch.utils.weak.WeakIdKeyDictionary()


def _gamma(k: int) -> float:
    """``gamma = 2K u / (1 - 2K u)``, ``u = 2^-24``: a bound on the relative rounding error of a sum of products
    that meets at most ``2K`` roundings (Higham's gamma_n)."""
    return 2 * k * 2.0**-24 / (1 - 2 * k * 2.0**-24)


def _rounding_ratio(h: Tensor, xerr: Tensor) -> float:
    """``rho (1 + gamma)``, rounded up: ``rho`` the largest ``xerr_m / ||h_m||`` over the rows of finite, non-zero
    norm (0 where there is none), how far ``block_panels_estimate``'s 8-bit rounding moved the rows, relative
    to them (a row with a NaN or an infinity is answered whole by the arg-max operators)."""
    size = h.double().norm(dim=1)
    ratio = xerr[size > 0] / size[size > 0]
    ratio = ratio[ratio.isfinite()]
    return float(ratio.max()) * (1 + _gamma(h.shape[1])) * (1 + 1e-9) if ratio.numel() else 0.0


def _answer_open(found: Tensor, whole) -> Tensor:
    """``found`` with its rows left open (-1) answered from ``whole(rows)``, those rows' whole product."""
    open_rows = (found < 0).nonzero().squeeze(1)
    if open_rows.numel():
        found[open_rows] = first_largest(whole(open_rows))
    return found


def screen(weight: Tensor) -> tuple[Tensor, Tensor] | None:
    """``weight (N, K)``'s screen for ``head_argmax``, made once and kept while ``weight`` lives (made again
    when it changes), as :func:`panels` keeps its panels; None where ``K`` is not a multiple of 32 or a
    row's values are too large for float16 scales.

    The screen is the weight in 8-bit blocks (Q8_0: a float16 scale ``d = max |w| / 127`` per 32 weights,
    ``q = round(w / d)``), in :mod:`~attnmask.ops.blocks`' panels (``block_panels_matmul`` gives the
    estimates): 1.06 bytes a weight (its float16 scales kept as such), a quarter of the float32 weight's,
    kept beside it and its panels.
    The bound of row ``n``, float64, rounded up: ``||w - d q|| + 3 gamma (||d q|| + ||w||)``, ``gamma =
    2K u / (1 - 2K u)``, ``u = 2^-24`` (no product meets more than ``32 + K / 32 + 1 <= 2K`` roundings in
    either sum); with ``||x||`` it bounds how far an estimate can be from the exact output
    (``csrc/decoding.cpp``)."""
    made = _screen(weight)
    return None if made is None else made[:2]


def _screen(weight: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """(panels, bound, norms): :func:`screen` and each screen row's norm ``||d q||`` (float64, rounded up)."""
    key = (weight._version, weight.data_ptr(), tuple(weight.shape))
    held = _SCREENS.get(weight)
    if held is not None and held[0] == key:
        return held[1]
    w = weight.detach()
    n, k = w.shape
    made = None
    if k % blocks.QK == 0 and 2 * k * 2.0**-24 < 0.5:
        gamma = _gamma(k)
        step = 2048  # rows at a time (a multiple of the panels' 16): the float64 copies stay small
        groups = -(-n // blocks.PANEL_COLUMNS)
        panels = torch.empty(groups, k // blocks.QK, blocks.PANEL_UNIT[blocks.PANEL_LAYOUT["Q8_0"]], dtype=torch.uint8)
        bound, norms = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
        for a in range(0, n, step):
            rows = w[a : a + step].reshape(-1, k // blocks.QK, blocks.QK)
            d = (rows.abs().amax(dim=-1, keepdim=True) / 127).half()  # (r, k / 32, 1)
            if not bool(d.isfinite().all()):
                break  # too large for float16 scales: no screen
            d32 = d.float()
            q = torch.where(d32 > 0, rows / d32, 0.0).round().clamp(-127, 127).to(torch.int8)
            raw = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1).reshape(rows.shape[0], -1)
            packed = blocks.repack(raw, "Q8_0", k)  # GGUF's Q8_0 bytes, as a block layer's
            g = a // blocks.PANEL_COLUMNS
            panels[g : g + -(-rows.shape[0] // blocks.PANEL_COLUMNS)] = blocks.pack_block_panels(
                packed["codes"], packed["d"], None, "Q8_0", k
            )
            s = (q.double() * d32.double()).reshape(rows.shape[0], k)  # exact: 8 and 11 significant bits
            exact = rows.reshape(-1, k).double()
            bound[a : a + step] = (exact - s).norm(dim=1) + 3 * gamma * (s.norm(dim=1) + exact.norm(dim=1))
            norms[a : a + step] = s.norm(dim=1)
        else:
            made = (panels, bound * (1 + 1e-9), norms * (1 + 1e-9))
    _SCREENS[weight] = (key, made)
    return made


def screens(weight: Tensor, rows: int) -> bool:
    """Whether :func:`argmax_rows` reads ``weight``'s screen for ``rows`` rows (else the whole head): a few rows of
    a large head (the bytes saved), or more rows where the int8 estimates run fast (the work saved)."""
    if rows <= SCREEN_MAX_ROWS:
        return weight.numel() >= SCREEN_MIN_WEIGHTS
    return weight.numel() >= ESTIMATE_MIN_WEIGHTS and estimates_fast()


def estimates_fast() -> bool:
    """Whether the native kernels are loaded here with ``block_panels_estimate``'s vector loop (its
    ``estimate_fast`` is registered by the library alone: before it is loaded, False)."""
    try:
        return bool(torch.ops.attnmask.estimate_fast())
    except (AttributeError, RuntimeError):
        return False


def screen_estimates(h: Tensor, weight: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(estimates (M, N) float32, bound (N,) float64)`` for ``h (M, K)`` from ``weight``'s :func:`screen` (None
    where it has none): each estimate within ``bound[n] ||h_m||`` of the exact output ``linear_panels`` computes.

    With ``SCREEN_MAX_ROWS`` rows or fewer, the screen's float32 product (``block_panels_matmul``) and the
    screen's bound. With more, each row rounded to 8 bits per block of 32 (``block_panels_estimate``), and the
    bound grows by the rounding's share: with ``s_n`` the screen's row and ``xerr_m = ||h_m - dx q||``, an
    estimate is within ``bound_n ||h_m|| + ||s_n|| xerr_m (1 + gamma)`` of the exact output (the integer sums
    are exact; the float sum of a row's block products meets at most ``K / 32 + 1`` roundings, inside
    ``bound``'s ``3 gamma ||s_n||``), which is at most ``(bound_n + ||s_n|| rho (1 + gamma)) ||h_m||`` for
    ``rho`` the largest ``xerr_m / ||h_m||`` of the rows (rows with a NaN or an infinity left out: head_argmax
    answers them from the whole head)."""
    made = _screen(weight)
    if made is None:
        return None
    screen_panels, bound, norms = made
    n = weight.shape[0]
    if h.shape[0] <= SCREEN_MAX_ROWS:
        return blocks.block_panels_matmul(screen_panels, h, n), bound
    estimates, xerr = blocks.block_panels_estimate(screen_panels, h, n)
    return estimates, bound + norms * _rounding_ratio(h, xerr)


def argmax_rows(h: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Each row's first largest output of ``h (M, K) weight (N, K)^T (+ bias)`` as ``linear_panels``
    computes it, ``(M,)`` int64, from the weight's screen where :func:`screens` says it pays (about a quarter
    of the weight's bytes, or with more rows a quarter of its work, and the exact outputs of the few rows that
    can still win), the whole product elsewhere. Up to ``SCREEN_MAX_ROWS`` rows: ``head_argmax`` on the
    screen's float32 products (:func:`screen_estimates`), the whole product for the rows it leaves open
    (non-finite values, too many rows within reach of the top). More: ``screen_argmax``, the screen's int8
    estimates each compared with its row's reach as it is made (:func:`screen_estimates` says how far they can
    be from the exact outputs; there each row has its own ``rho``), never stored. Call it with the native kernels
    loaded: without them the screen's product is the PyTorch definition's, slower than the whole head."""
    n = weight.shape[0]
    made = _screen(weight) if screens(weight, h.shape[0]) else None
    if made is None:
        return first_largest(linear_panels(h, panels(weight), bias, n))
    screen_panels, bound, norms = made
    if h.shape[0] > SCREEN_MAX_ROWS:
        return screen_argmax(h, weight, bias, screen_panels, bound, norms)
    found = head_argmax(h, weight, bias, blocks.block_panels_matmul(screen_panels, h, n), bound)
    return _answer_open(
        found, lambda rows: linear_panels(h.index_select(0, rows).contiguous(), panels(weight), bias, n)
    )


_BLOCK_NORMS = torch.utils.weak.WeakIdKeyDictionary()  # panels -> ((address, shape), row norms)


def block_norms(panels: Tensor, out_features: int) -> Tensor:
    """Each row's ``||w_n||`` (float64, rounded up) of a head in block panels, for :func:`block_argmax_rows`:
    computed once and kept while the panels live."""
    key = (panels.data_ptr(), tuple(panels.shape))  # panels are never changed in place (an inference tensor's
    held = _BLOCK_NORMS.get(panels)  # has no version counter): a block layer packs new ones
    if held is None or held[0] != key:
        step = 256  # groups at a time: 4,096 rows of float32 weights
        norms = torch.cat(
            [
                blocks.unpack_block_panels(panels[g : g + step], min(out_features - 16 * g, 16 * step))
                .double()
                .norm(dim=1)
                for g in range(0, panels.shape[0], step)
            ]
        )
        held = (key, norms * (1 + 1e-9))
        _BLOCK_NORMS[panels] = held
    return held[1]


def block_argmax_rows(h: Tensor, panels: Tensor, out_features: int) -> Tensor:
    """Each row's first largest output of ``block_panels_matmul(panels, h, out_features)`` for a head in 8-bit
    block panels (Q8_0's layout), ``(M,)`` int64, without computing every output: ``block_head_argmax`` makes the
    int8 estimates from the panels themselves (``block_panels_estimate``'s values) and compares each with its
    reach as it is made, then computes the exact outputs of the few rows that can win.

    The weight is the panels' own, so only the rows' rounding and the two float sums part an estimate from the
    exact output: with ``w_n`` the row's weight (``||w_n||`` float64, computed once per panels and kept) and
    ``xerr_m = ||h_m - dx q||``, ``|estimate - exact| <= ||w_n|| (xerr_m (1 + gamma) + 2 gamma ||h_m||)`` (the
    estimate's sum meets at most ``K / 32 + 1`` roundings and the exact chain ``32 + K / 32``, both within
    ``gamma = 2K u / (1 - 2K u)``). Rows with non-finite values or too many candidates are computed whole."""
    return block_head_argmax(h, panels, block_norms(panels, out_features), out_features)
