"""The ``flex`` backend and the device-aware ``auto``.

FlexAttention runs here eagerly (``backends.FLEX_COMPILE = False``: the same BlockMask and maths,
unfused) for the property tests, and compiled once for a fixed problem, since each compilation
takes seconds on the CPU. The CPU has no FlexAttention backward: training there is refused with one
clear message. ``auto`` on an accelerator is checked for its choices on the ``meta`` device, where
any read of a mask value back to the host raises: the GPU path of ``prepare_mask`` and ``auto``
reads nothing back.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from attnmask import masks
from attnmask.attention import BACKENDS, attention, backends, prepare_mask
from tests.attention.test_attention import HALF_TOL, expected_allowed, mask_for, problems, qkv, reference_attention

PROPS = settings(max_examples=12, deadline=None, derandomize=True)


@pytest.fixture
def eager_flex(monkeypatch):
    monkeypatch.setattr(backends, "FLEX_COMPILE", False)


def test_flex_is_registered_and_matches_the_reference(eager_flex):
    import importlib.util

    has_flex = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    assert backends.flex_available() == has_flex  # the flag tells the torch build, not a hope
    assert "flex" in BACKENDS
    if not has_flex:
        pytest.skip(f"torch {torch.__version__} has no FlexAttention")
    # the registered entry, through the public call: causal & padding, one row padded, grouped heads
    mask = masks.causal() & masks.padding(lengths=[5, 3])
    q, k, v = qkv(2, 4, 2, 5, 5, 8, seed=1)
    with torch.no_grad():
        out = attention(q, k, v, mask, backend="flex")  # (B, H, Tq, D)
    expected, _ = reference_attention(q, k, v, mask.to_bool(2, 5, 5))
    assert out.shape == (2, 4, 5, 8)
    assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@PROPS
@given(problems(), st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), st.data())
def test_flex_equals_float64_reference(problem, dtype, data):
    backends.FLEX_COMPILE = False  # (a fixture would be shared by hypothesis' examples; reset below)
    try:
        B, H, Hkv, Tq, Tk, D, align, q_offset = problem
        mask = data.draw(mask_for(B, H, Tq, Tk, align, q_offset))
        q_offset = q_offset if isinstance(mask, masks.Mask) else 0
        q, k, v = qkv(B, H, Hkv, Tq, Tk, D, dtype=dtype, seed=3)
        expected, _ = reference_attention(q, k, v, expected_allowed(mask, B, Tq, Tk, q_offset))
        with torch.no_grad():
            out = attention(q, k, v, mask, backend="flex", q_offset=q_offset)
        tol = HALF_TOL.get(dtype, 1e-5)
        assert out.dtype == dtype
        assert_close(out.double(), expected, rtol=tol, atol=tol)
    finally:
        backends.FLEX_COMPILE = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_flex_fully_masked_rows_are_zero(eager_flex, dtype):
    mask = masks.causal() & masks.padding(lengths=[3, 0], side="left") & masks.query_padding(lengths=[4, 6])
    q, k, v = qkv(2, 2, 1, 6, 6, 8, dtype=dtype, seed=4)
    with torch.no_grad():
        out = attention(q, k, v, mask, backend="flex")
    empty = ~mask.to_bool(2, 6, 6).any(-1)  # (B, 1, Tq)
    assert empty.any() and out.isfinite().all()
    assert (out.masked_select(empty[..., None]) == 0).all()
    ref, _ = reference_attention(q, k, v, mask.to_bool(2, 6, 6))
    assert_close(out.double(), ref, rtol=HALF_TOL.get(dtype, 1e-5), atol=HALF_TOL.get(dtype, 1e-5))


def test_flex_per_head_tensor_mask_and_prepared_mask_shared_by_layers(eager_flex):
    q, k, v = qkv(2, 4, 2, 5, 7, 8, seed=5)
    per_head = torch.rand(2, 4, 5, 7, generator=torch.Generator().manual_seed(0)) > 0.4
    with torch.no_grad():
        out = attention(q, k, v, per_head, backend="flex")
    assert_close(out.double(), reference_attention(q, k, v, per_head)[0], rtol=1e-5, atol=1e-5)
    pm = prepare_mask(masks.causal() & masks.padding(lengths=[7, 3]), 2, 4, 5, 7)
    first = pm.block_mask("cpu")
    assert pm.block_mask("cpu") is first  # built once, every layer reuses it


def _spy_kernel(monkeypatch, seen: list):
    """``_flex_kernel`` replaced by eager FlexAttention that records the head size and dynamo's
    recompile limit of each call."""
    from torch.nn.attention.flex_attention import flex_attention

    def kernel(q, k, v, **kwargs):
        seen.append((q.shape[-1], torch._dynamo.config.recompile_limit))
        return flex_attention(q, k, v, **kwargs)

    monkeypatch.setattr(backends, "_flex_kernel", lambda q: kernel)


@pytest.mark.parametrize("D", [4, 8, 12, 16])
def test_flex_pads_head_sizes_under_16_with_the_true_scale(monkeypatch, D):
    """Triton's FlexAttention refuses D < 16 (a lowering error on CUDA, seen on an H200 with a tiny
    model): such heads are zero-padded to 16, which changes no score and no kept output column."""
    seen = []
    _spy_kernel(monkeypatch, seen)
    mask = masks.causal() & masks.sliding_window(3) & masks.padding(lengths=[6, 4])
    q, k, v = qkv(2, 4, 2, 6, 6, D, seed=7)
    with torch.no_grad():
        out = attention(q, k, v, mask, backend="flex")
    assert out.shape == (2, 4, 6, D)
    assert [d for d, _ in seen] == [16]
    assert_close(out.double(), reference_attention(q, k, v, mask.to_bool(2, 6, 6))[0], rtol=1e-5, atol=1e-5)


def test_flex_raises_dynamos_recompile_limit_only_while_its_call_runs(monkeypatch):
    """At dynamo's default limit of 8 compiled variants (shared with every other torch.compile of
    flex_attention in the process) a ninth shape fell back to the unfused path that materialises
    Tq x Tk, with a warning only: attnmask's calls run under ``masks.core.RECOMPILE_LIMIT``, and the process's
    own setting is back when the call returns or raises."""
    seen = []
    _spy_kernel(monkeypatch, seen)
    q, k, v = qkv(1, 2, 2, 5, 5, 16, seed=8)
    with torch._dynamo.config.patch(recompile_limit=8):  # the process's own setting (dynamo's default)
        with torch.no_grad():
            attention(q, k, v, masks.causal(), backend="flex")
        assert seen == [(16, masks.core.RECOMPILE_LIMIT)] and masks.core.RECOMPILE_LIMIT > 8
        assert torch._dynamo.config.recompile_limit == 8

        def broken(q, k, v, **kwargs):
            raise RuntimeError("kernel failed")

        monkeypatch.setattr(backends, "_flex_kernel", lambda q: broken)
        with torch.no_grad(), pytest.raises(RuntimeError, match="kernel failed"):
            attention(q, k, v, masks.causal(), backend="flex")
        assert torch._dynamo.config.recompile_limit == 8


def test_the_compiled_blockmask_builder_runs_under_the_same_limit(monkeypatch):
    """Off the CPU the BlockMask builder is ``torch.compile(create_block_mask)``, whose eager fallback
    past the limit evaluates the mask over the whole grid: it runs under ``RECOMPILE_LIMIT`` too."""
    from attnmask.masks import core

    seen = []
    monkeypatch.setattr(core, "_COMPILED_BUILDER", lambda *a, **k: seen.append(torch._dynamo.config.recompile_limit))
    with torch._dynamo.config.patch(recompile_limit=8):
        core._create_block_mask(lambda b, h, q, kv: q >= kv, 1, 256, 256, torch.device("meta"), 128)
        assert seen == [core.RECOMPILE_LIMIT] and torch._dynamo.config.recompile_limit == 8


@pytest.mark.slow  # one compilation: 15-30 s on 2 cores
def test_compiled_flex_on_the_cpu_equals_the_reference():
    """The fused kernel (torch.compile) for one problem with padding, empty rows and grouped heads."""
    mask = masks.causal() & masks.padding(lengths=[40, 0]) & masks.query_padding(lengths=[48, 33])
    q, k, v = qkv(2, 4, 2, 48, 48, 16, seed=6)
    with torch.no_grad():
        out = attention(q, k, v, mask, backend="flex")
    ref, _ = reference_attention(q, k, v, mask.to_bool(2, 48, 48))
    assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert (out[1] == 0).all()


def test_flex_on_the_cpu_refuses_training_with_one_clear_message(eager_flex):
    q, k, v = qkv(1, 2, 2, 4, 4, 8, requires_grad=True)
    with pytest.raises(ValueError, match=r"^backend 'flex' on the CPU is inference-only: FlexAttention in torch .* "
                       r"has no CPU backward\. Run it under torch\.no_grad\(\)"):  # fmt: skip
        attention(q, k, v, masks.causal(), backend="flex")
    with torch.no_grad():  # leaves that require grad are fine without autograd
        assert attention(q, k, v, masks.causal(), backend="flex").shape == (1, 2, 4, 8)


def test_flex_has_no_dropout():
    with pytest.raises(ValueError, match=r"backend 'flex' has no attention dropout"):
        attention(*qkv(1, 2, 2, 4, 4, 8), masks.causal(), backend="flex", dropout_p=0.1)


# ---------------------------------------------------------------------------------------------
# auto on an accelerator: never a loop of kernel launches, nothing read back to the host
# ---------------------------------------------------------------------------------------------
class Calls:
    """Spies on the kernels ``auto`` may pick; runs them on the meta device."""

    def __init__(self, monkeypatch):
        self.names: list[tuple[str, dict]] = []
        real_sdpa = F.scaled_dot_product_attention

        def sdpa(q, k, v, **kw):
            self.names.append(("sdpa", kw))
            return real_sdpa(q, k, v, **kw)

        def flex(q, k, v, pm, **kw):
            self.names.append(("flex", {"mask": pm.mask}))
            return q.new_empty(q.shape), None

        def blocks(*args, **kw):
            raise AssertionError("auto ran the block plan (a Python loop of SDPA calls) on an accelerator")

        monkeypatch.setattr(backends.F, "scaled_dot_product_attention", sdpa)
        monkeypatch.setattr(backends, "_flex", flex)
        monkeypatch.setattr(backends, "_blocks", blocks)


def meta_qkv(B=2, H=2, Tq=8, Tk=8, D=8):
    return tuple(torch.empty(B, H, T, D, device="meta") for T in (Tq, Tk, Tk))


@pytest.mark.parametrize(
    "make_mask, expect",
    [
        (lambda ids: masks.causal(), "is_causal"),
        (lambda ids: masks.causal() & masks.padding(token_ids=ids, pad_id=0), "flex"),
        (lambda ids: masks.padding(token_ids=ids, pad_id=0), "flex"),
        (lambda ids: masks.sliding_window(3) & masks.padding(token_ids=ids, pad_id=0), "flex"),
        (lambda ids: masks.prefix_lm([2, 3]), "flex"),  # lengths are checked where the mask is built
        (lambda ids: masks.document(ids) & masks.causal(), "flex"),
        (lambda ids: masks.from_predicate(lambda b, h, q, kv: kv <= q), "sdpa+mask"),
        (lambda ids: torch.ones(8, 8, dtype=torch.bool, device="meta"), "sdpa+mask"),
    ],
)
def test_auto_on_an_accelerator_picks_one_kernel_and_reads_nothing_back(monkeypatch, make_mask, expect):
    calls = Calls(monkeypatch)
    ids = torch.empty(2, 8, dtype=torch.long, device="meta")  # values unreadable: any host read raises
    q, k, v = meta_qkv()
    mask = make_mask(ids)
    if isinstance(mask, torch.Tensor):
        monkeypatch.setattr(masks, "lint_polarity", lambda t, name="mask": None)  # a raw tensor is linted: a read
    out = attention(q, k, v, mask, backend="auto")
    assert out.shape == q.shape and len(calls.names) == 1
    name, kw = calls.names[0]
    if expect == "flex":
        assert name == "flex"
    else:
        assert name == "sdpa" and kw["is_causal"] is (expect == "is_causal")
        assert (kw["attn_mask"] is None) is (expect == "is_causal")


def test_auto_on_an_accelerator_with_dropout_uses_sdpa_with_the_mask(monkeypatch):
    calls = Calls(monkeypatch)
    q, k, v = meta_qkv()
    mask = masks.causal() & masks.padding(token_ids=torch.empty(2, 8, dtype=torch.long, device="meta"), pad_id=0)
    attention(q, k, v, mask, backend="auto", dropout_p=0.1)
    assert [n for n, _ in calls.names] == ["sdpa"] and calls.names[0][1]["attn_mask"] is not None


def test_prepare_mask_on_an_accelerator_keeps_empty_rows_as_a_tensor():
    ids = torch.empty(2, 8, dtype=torch.long, device="meta")
    pm = prepare_mask(masks.causal() & masks.padding(token_ids=ids, pad_id=0), 2, 2, 8, 8, device="meta")
    assert pm.blocks is None  # the block plan reads the mask on the host: CPU only
    assert pm.empty_rows is not None and pm.empty_rows.device.type == "meta"
    assert pm.sdpa_mask(torch.bfloat16).dtype == torch.bool  # no additive copy off the CPU


@pytest.mark.parametrize(
    "config",
    [
        {"arch": "encoder_decoder", "positions": "sinusoidal"},
        {"arch": "decoder", "positions": "learned"},
        {"arch": "decoder", "positions": "rotary"},
        {  # Gemma 3's parts: grouped heads, q/k norms, a windowed and a global layer
            "arch": "decoder", "positions": "rotary", "n_kv_heads": 2, "qk_norm": True, "sliding_window": 3,
            "layer_types": ("sliding", "full"),
        },
    ],
)  # fmt: skip
def test_a_models_forward_off_the_cpu_reads_nothing_back(monkeypatch, config):
    """The whole forward on the ``meta`` device, where any read of a value back to the host raises: what
    the CUDA test below checks, without a GPU (it caught a ``max_seq_len`` check reading the positions'
    maximum back in every forward, found on an H200)."""
    from tests.conftest import tiny_model

    Calls(monkeypatch)
    model = tiny_model(pad_id=0, **config).to("meta")
    ids = torch.empty(2, 6, dtype=torch.long, device="meta")
    with torch.no_grad():
        out = model(ids, ids) if model.is_encoder_decoder else model(ids)
    assert out.logits.shape == (2, 6, model.config.vocab_size)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_forward_makes_no_device_to_host_copy():
    from tests.conftest import tiny_model

    model = tiny_model("encoder_decoder", pad_id=0).cuda()
    src = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]], device="cuda")
    tgt = torch.tensor([[1, 5, 0], [1, 5, 6]], device="cuda")
    with torch.no_grad():
        warm = model(tgt, src).logits  # warm up: compile FlexAttention and the BlockMask builder
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host copy now raises
    try:
        with torch.no_grad():
            logits = model(tgt, src).logits
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (2, 3, model.config.vocab_size)
    torch.testing.assert_close(logits, warm, rtol=0, atol=1e-5)  # the same function as the first forward
