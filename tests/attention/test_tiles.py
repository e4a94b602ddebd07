"""attention/blocked.py: the block-sparse ``tiles`` backend against float64, its memory, and ``auto``'s use of it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from attnmask import attention as A
from attnmask import masks
from attnmask.attention import attention, backends, blocked
from tests.attention.test_attention import qkv, reference_attention

TOL = {torch.float32: 2e-5, torch.bfloat16: 4e-2}


def segments(B: int, T: int, seed: int) -> torch.Tensor:
    """Packed documents: (B, T) ids, a new document with probability 1/40 at each token."""
    g = torch.Generator().manual_seed(seed)
    return torch.cumsum(torch.rand(B, T, generator=g) < 1 / 40, dim=1)  # (B, T)


def mask_of(kind: str, B: int, Tq: int, Tk: int):
    seg = segments(B, Tk, 7)
    return {
        "causal": masks.causal(),
        "window": masks.sliding_window(37),
        "documents": masks.document(seg),
        "causal_documents": masks.document(seg) & masks.causal(),
        "documents_window": masks.document(seg) & masks.sliding_window(30) & masks.padding(lengths=[Tk - 9, Tk][:B]),
        "prefix_padding": masks.prefix_lm([50, 90][:B]) & masks.padding(lengths=[Tk - 40, Tk][:B]),
        "left_padding": masks.causal() & masks.padding(lengths=[Tk - 70, Tk][:B], side="left"),
        "query_padding": masks.causal()
        & masks.query_padding(lengths=[Tq // 2, Tq][:B])
        & masks.padding(lengths=[0, Tk][:B]),
        "window_or_prefix": masks.sliding_window(16) | masks.prefix_lm(12),
        "keep_holes": masks.sliding_window(64) & masks.padding(keep=torch.arange(Tk).expand(B, Tk) % 3 != 1),
        "not_causal": ~masks.causal(),
        "cross_documents": masks.document(seg, query_segment_ids=segments(B, Tq, 7)),
    }[kind]


KINDS = (
    "causal",
    "window",
    "documents",
    "causal_documents",
    "documents_window",
    "prefix_padding",
    "left_padding",
    "query_padding",
    "window_or_prefix",
    "keep_holes",
    "not_causal",
    "cross_documents",
)


def check_against_float64(q, k, v, mask, dtype, q_offset=0):
    B, _, Tq, _ = q.shape
    out = attention(q, k, v, mask, backend="tiles", q_offset=q_offset)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), g)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    allowed = mask.to_bool(B, Tq, k.shape[2], q_offset)  # (B, 1, Tq, Tk)
    ref, _ = reference_attention(q64, k64, v64, allowed)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    tol = TOL[dtype]
    assert out.dtype == dtype and not out.isnan().any()
    assert_close(out.double(), ref, rtol=tol, atol=tol)
    for name, got, want in zip("qkv", grads, ref_grads):
        assert not got.isnan().any(), name
        assert_close(got.double(), want, rtol=tol, atol=tol, msg=lambda m, n=name: f"d{n}: {m}")
    # the worst deviation in units of the tolerance (<= 1: within it), values and gradients
    pairs = [(out.double(), ref), *((g.double(), w) for g, w in zip(grads, ref_grads))]
    return max(float(((a - b).abs() / (tol + tol * b.abs())).max()) for a, b in pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_tiles_equal_float64_values_and_gradients(kind, dtype):
    B, H, Hkv, Tq, Tk, D = 2, 4, 2, 203, 203, 16  # grouped-query, T not a multiple of any block
    if kind == "cross_documents":
        Tq = 150
    q, k, v = qkv(B, H, Hkv, Tq, Tk, D, dtype=dtype, seed=1, requires_grad=True)
    assert check_against_float64(q, k, v, mask_of(kind, B, Tq, Tk), dtype) <= 1


@pytest.mark.parametrize("kind", ["causal_documents", "window", "prefix_padding"])
def test_key_segments_merge_by_online_softmax(kind, monkeypatch):
    """Blocks whose keys exceed MAX_KEYS run in segments merged by the log-sum-exp: same result."""
    monkeypatch.setattr(blocked, "MAX_KEYS", 32)
    B, H, T, D = 2, 2, 150, 8
    q, k, v = qkv(B, H, H, T, T, D, seed=4, requires_grad=True)
    mask = mask_of(kind, B, T, T)
    plan = blocked.plan_tiles(mask, B, H, T, T, 0)
    assert plan.segments > 1
    assert check_against_float64(q, k, v, mask, torch.float32) <= 1


@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_tiles_with_queries_off_the_first_keys(align):
    """Fewer queries than keys (a cache's chunk): bottom-right or at q_offset, windows follow them."""
    B, H, Tq, Tk, D = 2, 2, 70, 260, 8
    q, k, v = qkv(B, H, H, Tq, Tk, D, seed=5, requires_grad=True)
    mask = masks.sliding_window(50, align) & masks.padding(lengths=[200, 260])
    assert check_against_float64(q, k, v, mask, torch.float32, q_offset=120 if align == "top_left" else 0) <= 1


def problems():
    return st.tuples(
        st.integers(1, 2),  # B
        st.sampled_from([(1, 1), (2, 1), (4, 2)]),  # (H, Hkv)
        st.integers(1, 90),  # T
        st.integers(1, 40),  # window
        st.integers(0, 3),  # which mask
        st.integers(0, 10_000),  # seed
    )


@settings(max_examples=25, deadline=None, derandomize=True)
@given(problems())
def test_tiles_random_shapes_and_masks(problem):
    B, (H, Hkv), T, w, which, seed = problem
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g).tolist()
    seg = torch.sort(torch.randint(0, 3, (B, T), generator=g), dim=1).values  # (B, T)
    mask = [
        masks.sliding_window(w) & masks.padding(lengths=lengths),
        masks.document(seg) & masks.causal(),
        masks.document(seg) & masks.sliding_window(w) | masks.prefix_lm(lengths),
        masks.causal() & masks.query_padding(lengths=lengths),
    ][which]
    q, k, v = qkv(B, H, Hkv, T, T, 8, seed=seed, requires_grad=True)
    assert check_against_float64(q, k, v, mask, torch.float32) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_masked_rows_are_zero_with_zero_gradient(dtype):
    B, H, T, D = 2, 2, 300, 8
    q, k, v = qkv(B, H, H, T, T, D, dtype=dtype, seed=6, requires_grad=True)
    # row 1 sees no key at all; in row 0 the queries after 100 are padding
    mask = masks.sliding_window(40) & masks.padding(lengths=[300, 0]) & masks.query_padding(lengths=[100, 300])
    out = attention(q, k, v, mask, backend="tiles")
    assert not out.isnan().any()
    assert (out[1] == 0).all() and (out[0, :, 100:] == 0).all()
    out.sum().backward()
    assert not any(t.grad.isnan().any() for t in (q, k, v))
    assert (q.grad[1] == 0).all() and (q.grad[0, :, 100:] == 0).all()
    assert (k.grad[1] == 0).all() and (v.grad[1] == 0).all()


def test_work_follows_the_mask_not_t_squared():
    T, w = 4096, 256
    plan = blocked.plan_tiles(masks.causal() & masks.sliding_window(w), 1, 4, T, T, 0)
    assert plan.scores() <= T * (w + 2 * plan.bq)  # per row: the window and at most two blocks' edge
    assert plan.scores() < T * T / 8


def test_never_allocates_t_by_t():
    """At T = 40,000 one float32 T x T tensor is 6.4 GB; the windowed work is a few MB. The profiler
    sees every allocation of every operator: none may come near T x T."""
    T, D = 40_000, 16
    q, k, v = qkv(1, 1, 1, T, T, D, seed=8, requires_grad=True)
    mask = masks.causal() & masks.sliding_window(32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = attention(q, k, v, mask, backend="tiles")
        out.sum().backward()
    largest = max(e.cpu_memory_usage for e in prof.key_averages())
    assert 0 < largest < 64 * 2**20, f"an operator allocated {largest / 2**20:.0f} MiB"
    assert out.shape == (1, 1, T, D) and torch.isfinite(q.grad).all()


def test_dropout_and_raw_tensors_run_as_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(backends, "tile_attention", lambda *a: calls.append(1))
    q, k, v = qkv(1, 2, 2, 40, 40, 8)
    allowed = masks.causal().to_bool(1, 40, 40)
    out = attention(q, k, v, allowed, backend="tiles")
    ref, _ = reference_attention(q, k, v, allowed)
    assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    attention(q, k, v, masks.sliding_window(8), backend="tiles", dropout_p=0.1)
    assert calls == []


def spy_tiles(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = backends.tile_attention

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(backends, "tile_attention", counted)
    return calls


@pytest.mark.parametrize("grad", [False, True])
def test_auto_takes_tiles_for_a_long_window(grad, monkeypatch):
    calls = spy_tiles(monkeypatch)
    q, k, v = qkv(1, 2, 2, 2048, 2048, 16, requires_grad=grad)
    mask = masks.causal() & masks.sliding_window(64)
    with torch.set_grad_enabled(grad):
        out = attention(q, k, v, mask)
    assert calls == [1]
    assert_close(out, attention(q, k, v, mask, backend="sdpa"), rtol=1e-5, atol=1e-5)


def test_auto_keeps_sdpa_where_tiles_cannot_save(monkeypatch):
    calls = spy_tiles(monkeypatch)
    q, k, v = qkv(2, 4, 4, 300, 300, 16)
    attention(q, k, v, masks.causal() & masks.padding(lengths=[300, 200]))  # float32: SDPA's kernels
    attention(q, k, v, masks.document(torch.zeros(2, 300, dtype=torch.long)))  # one document: dense
    attention(q, k, v, masks.sliding_window(8), dropout_p=0.1)  # dropout: not in the tiles
    assert calls == []


@pytest.mark.parametrize("native, expected", [(True, "tiles"), (False, "sdpa")])
def test_bfloat16_tiles_follow_the_cpus_bfloat16_instructions(native, expected, monkeypatch):
    """The rule reads what the CPU can do (avx512_bf16 / amx_bf16), never a clock."""
    monkeypatch.setattr(backends, "_native_bf16", lambda: native)
    q, k, v = qkv(1, 8, 8, 1024, 1024, 64, dtype=torch.bfloat16)
    pm = A.prepare_mask(masks.causal(), 1, 8, 1024, 1024)
    assert backends._cpu_choice(q, k, v, pm, 0.0) == expected
    assert backends._tile_cost_per_score(torch.bfloat16, True, False) > backends._tile_cost_per_score(
        torch.bfloat16, True, True
    )
