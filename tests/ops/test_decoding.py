"""The decoding step's operators (:mod:`attnmask.ops.decoding`): each against its PyTorch definition
computed in float64, rows independent of the batch and of the thread count, the cache written in
place, clear refusals, and decoding running a Llama-style model's step in one ``packed_step`` call with
the logits of the general forward pass."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from attnmask import decode, masks, ops
from attnmask.decode import steps
from attnmask.decode.step import Seq2SeqPlan, packed_forward
from attnmask.model import fuse_projections_
from attnmask.model.cache import PagedKVCache
from attnmask.ops import blocks, decoding
from tests.conftest import run_python, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True, scope="module")
def _built():
    if shutil.which(os.environ.get("CXX", "c++")) is None or not ops.available():
        pytest.skip(f"no native build of the operators here: {ops.status().why}")


def _close(got: torch.Tensor, want64: torch.Tensor, what: str = "") -> None:
    """float32 against a float64 reference: within a few float32 roundings of the result's scale."""
    scale = want64.abs().max().clamp(min=1.0)
    torch.testing.assert_close(got.double(), want64, atol=2e-6 * scale, rtol=0, msg=lambda m: f"{what}: {m}")


def _randn(*shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (2, 3, 96), (4, 7)])
def test_norms_and_silu_match_their_definitions(shape):
    x, delta, w = _randn(*shape, seed=1), _randn(*shape, seed=2), _randn(shape[-1], seed=3)
    _close(decoding.rms_norm(x, w, 1e-5), decoding.rms_norm_reference(x.double(), w.double(), 1e-5), "rms_norm")
    total, normed = decoding.add_rms_norm(x, delta, w, 1e-6)
    want_total, want_normed = decoding.add_rms_norm_reference(x.double(), delta.double(), w.double(), 1e-6)
    assert torch.equal(total, x + delta)  # one float32 addition, as PyTorch's
    _close(normed, want_normed, "add_rms_norm")
    gate_up = _randn(*shape[:-1], 2 * shape[-1], seed=4) * 4
    _close(decoding.silu_mul(gate_up), decoding.silu_mul_reference(gate_up.double()), "silu_mul")


@pytest.mark.parametrize("threads", [1, 2])
def test_the_row_wise_operators_are_the_same_bits_in_any_batch(threads):
    """Norms and SiLU give each row the bits it has alone, when a batch is long enough to be shared among
    the threads (16 rows of 576 and 1,536, a decoding step's) and when it is not."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows, c in ((16, 576), (3, 576), (64, 64), (40, 7)):
            x, delta, w = _randn(rows, c, seed=1), _randn(rows, c, seed=2), _randn(c, seed=3)
            gate_up = _randn(rows, 2 * c, seed=4) * 4
            each = [decoding.add_rms_norm(x[i : i + 1], delta[i : i + 1], w, 1e-6) for i in range(rows)]
            total, normed = decoding.add_rms_norm(x, delta, w, 1e-6)
            assert torch.equal(total, torch.cat([t for t, _ in each])), (rows, c)
            assert torch.equal(normed, torch.cat([n for _, n in each])), (rows, c)
            alone = torch.cat([decoding.rms_norm(x[i : i + 1], w, 1e-5) for i in range(rows)])
            assert torch.equal(decoding.rms_norm(x, w, 1e-5), alone), (rows, c)
            alone = torch.cat([decoding.silu_mul(gate_up[i : i + 1]) for i in range(rows)])
            assert torch.equal(decoding.silu_mul(gate_up), alone), (rows, c)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("k", [576, 100, 7])
def test_linear_rows_matches_its_definition(rows, k):
    """Row lengths with and without a tail past the vector loop; with and without a bias."""
    x, w, b = _randn(rows, k, seed=1), _randn(40, k, seed=2), _randn(40, seed=3)
    with_bias, without = decoding.linear_rows(x, w, b), decoding.linear_rows(x, w, None)
    assert with_bias.shape == without.shape == (rows, 40) and with_bias.dtype == torch.float32
    _close(with_bias, decoding.linear_rows_reference(x.double(), w.double(), b.double()), "with bias")
    _close(without, decoding.linear_rows_reference(x.double(), w.double(), None), "no bias")
    assert (with_bias - without - b).abs().max() <= 1e-5 * with_bias.abs().max()  # the bias is added once


@pytest.mark.parametrize("rows", [1, 3])
def test_an_empty_sum_is_the_bias(rows):
    """K = 0: every output is its bias (or zero), as F.linear gives."""
    x, w, b = torch.empty(rows, 0), torch.empty(5, 0), _randn(5, seed=1)
    assert torch.equal(decoding.linear_rows(x, w, b), b.expand(rows, 5))
    assert torch.equal(decoding.linear_panels(x, decoding.pack_panels(w), None, 5), torch.zeros(rows, 5))


@pytest.mark.parametrize("n", [1, 47, 48, 49, 130])
def test_panels_are_the_weight_and_their_product_is_linear_rows(n):
    """pack_panels holds W whatever N is against the build's panel width (zeros past N), and linear_panels
    on the panels gives linear_rows' bits on the row-major W: one arithmetic, packed once or at each call."""
    k = 37
    x, w, b = _randn(5, k, seed=1), _randn(n, k, seed=2), _randn(n, seed=3)
    panels = decoding.pack_panels(w)
    width = panels.shape[2]
    assert panels.shape == ((n + width - 1) // width, k, width)
    assert torch.equal(decoding.unpack_panels(panels, n), w)
    assert not panels.transpose(1, 2).reshape(-1, k)[n:].any()
    assert torch.equal(decoding.linear_panels(x, panels, b, n), decoding.linear_rows(x, w, b))
    assert torch.equal(decoding.linear_panels(x, panels, None, n), decoding.linear_rows(x, w, None))
    _close(decoding.linear_panels(x, panels, b, n), decoding.linear_rows_reference(x.double(), w.double(), b.double()),
           "panels")  # fmt: skip
    with pytest.raises(ValueError, match="from pack_panels"):
        decoding.linear_panels(x, panels, b, n + width)


def test_panels_are_packed_again_when_the_weight_changes():
    """decoding.panels keeps one packed copy per weight, and packs again after an in-place change (an
    optimizer step) or a new tensor under the same module."""
    layer = torch.nn.Linear(20, 30)
    first = decoding.panels(layer.weight)
    assert decoding.panels(layer.weight) is first
    with torch.no_grad():
        layer.weight.mul_(2)
    again = decoding.panels(layer.weight)
    assert again is not first and torch.equal(decoding.unpack_panels(again, 30), layer.weight.detach())


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_product_is_the_same_bits_in_any_batch(threads):
    """Each row of linear_panels is the same alone, in any batch size and place, at every thread count:
    row counts across the tile heights, a K long enough for several blocks."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in (5, 600, 2100):
            x, w, b = _randn(37, k, seed=4), _randn(100, k, seed=5), _randn(100, seed=6)
            panels = decoding.pack_panels(w)
            alone = torch.cat([decoding.linear_panels(x[i : i + 1], panels, b, 100) for i in range(37)])
            for rows in (2, 7, 8, 9, 17, 37):
                assert torch.equal(decoding.linear_panels(x[:rows], panels, b, 100), alone[:rows]), (k, rows)
            assert torch.equal(decoding.linear_panels(x[3:20], panels, b, 100), alone[3:20])
    finally:
        torch.set_num_threads(before)


def _first_largest(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The arg-max of the exact float32 logits, as greedy decoding takes it without the screen."""
    return decoding.linear_panels(h, decoding.panels(w), b, w.shape[0]).max(dim=-1).indices


def _screened(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """head_argmax on the estimates of w's screen."""
    panels, bound = decoding.screen(w)
    return decoding.head_argmax(h, w, b, blocks.block_panels_matmul(panels, h, w.shape[0]), bound)


@pytest.mark.parametrize(("n", "k"), [(50, 32), (1000, 64), (3001, 640)])
def test_the_screened_arg_max_matches_its_definition_bit_for_bit(n, k):
    """head_argmax answers each row's first largest output of linear_panels, on random rows, rows that
    tie exactly (the first wins), rows that differ in the last bit (the screen cannot tell them apart),
    and a row of x along one of the weight's rows; without a bias and with one."""
    w, h = _randn(n, k, seed=7), _randn(9, k, seed=8)
    w[n // 2] = w[3]  # an exact tie with an earlier row
    w[n - 1] = torch.nextafter(w[5], torch.full_like(w[5], torch.inf))  # above row 5 in the last bit only
    h[1] = w[3] * 3
    h[2], h[3] = w[5].clamp(min=0), w[n - 1]
    want = _first_largest(h, w)
    assert torch.equal(_screened(h, w), want)
    assert int(want[1]) == 3, "the exact tie goes to the first row"
    b = _randn(n, seed=12)  # with a bias: added to the estimates, and after each exact chain
    b[n // 2] = b[3]
    assert torch.equal(_screened(h, w, b), _first_largest(h, w, b))


@pytest.mark.parametrize("scale", [1.0, 1e-6, 3e4])
def test_the_screens_estimates_stay_within_their_bounds(scale):
    """Each estimate from the 8-bit screen lies within bound * ||x|| of the exact output, at scales where
    the float16 block scales round coarsely or go subnormal, and on rows of outliers."""
    w, h = _randn(2000, 640, seed=13) * scale, _randn(16, 640, seed=14)
    w[::7, ::33] *= 40  # outliers: a block's scale set by one weight
    w[5, :32] = 0.0  # a block of zeros
    panels, bound = decoding.screen(w)
    est = blocks.block_panels_matmul(panels, h, 2000).double()
    exact = decoding.linear_panels(h, decoding.panels(w), None, 2000).double()
    reach = bound[None] * h.double().norm(dim=1, keepdim=True)
    assert bool(((est - exact).abs() <= reach).all())
    assert float(((est - exact).abs() / reach).max()) > 1e-3, "the bound should not be vacuous either"


@pytest.fixture
def int8_estimates(monkeypatch):
    """argmax_rows reads the screen with int8 estimates above SCREEN_MAX_ROWS rows in every build (where the
    kernels have no vector loop for them, the portable loop's: the same values, only slower)."""
    monkeypatch.setattr(decoding, "estimates_fast", lambda: True)
    monkeypatch.setattr(decoding, "ESTIMATE_MIN_WEIGHTS", 0)


@pytest.mark.parametrize("scale", [1.0, 1e-6, 3e4])
def test_the_int8_estimates_stay_within_their_bounds(scale):
    """Above SCREEN_MAX_ROWS rows, screen_estimates rounds the rows to 8 bits: each estimate still lies within
    bound * ||x|| of the exact output, on rows of outliers, tiny rows and a row of zeros."""
    w, h = _randn(2000, 640, seed=13) * scale, _randn(16, 640, seed=14)
    w[::7, ::33] *= 40
    h[3, ::17] *= 300  # a row of outliers: its blocks' roundings coarse
    h[4] *= 1e-30  # tiny: its blocks round to zero
    h[5] = 0.0
    est, bound = decoding.screen_estimates(h, w)
    exact = decoding.linear_panels(h, decoding.panels(w), None, 2000).double()
    reach = bound[None] * h.double().norm(dim=1, keepdim=True)
    assert bool(((est.double() - exact).abs() <= reach).all())
    assert float(((est.double() - exact).abs() / reach)[:3].max()) > 1e-3, "the bound should not be vacuous either"


@pytest.mark.parametrize("rows", [9, 40])
def test_the_int8_screened_arg_max_matches_its_definition_bit_for_bit(int8_estimates, rows):
    """argmax_rows through the int8 estimates: each row's first largest output of linear_panels, with exact
    ties (the first wins) and rows that differ in the last bit, without a bias and with one."""
    n, k = 3001, 640
    w, h = _randn(n, k, seed=7), _randn(rows, k, seed=8)
    w[n // 2] = w[3]
    w[n - 1] = torch.nextafter(w[5], torch.full_like(w[5], torch.inf))
    h[1] = w[3] * 3
    h[2], h[3] = w[5].clamp(min=0), w[n - 1]
    want = _first_largest(h, w)
    assert torch.equal(decoding.argmax_rows(h, w), want)
    assert int(want[1]) == 3
    b = _randn(n, seed=12)
    b[n // 2] = b[3]
    assert torch.equal(decoding.argmax_rows(h, w, b), _first_largest(h, w, b))


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0"])
def test_a_block_heads_screened_arg_max_is_its_products(kind):
    """block_argmax_rows (a block head in 8-bit panels, read through int8 estimates): each row's first
    largest output of block_panels_matmul, with an exact tie between two rows of the head (the first wins)
    and rows along the head's own rows, at 9 and 16 rows; the estimates within their bound."""
    from tests.ops.test_blocks import layer_of

    n, k = 3001, 640
    layer = layer_of(kind, n, k, seed=3)
    codes, d = layer.codes.clone(), layer.d.clone()
    codes[n // 2], d[n // 2] = codes[3], d[3]  # row n // 2 the same weights as row 3
    layer.codes.copy_(codes)
    layer.d.copy_(d)
    panels, w = layer.panels()[0], layer.dequantize()
    for rows in (9, 16):
        h = _randn(rows, k, seed=rows) * torch.rand(rows, 1, generator=torch.Generator().manual_seed(1)) * 3
        h[1] = w[3] * 3
        h[2] = w[7].clamp(min=0)
        h[3] = 0.0  # every output 0: the first row wins
        want = blocks.block_panels_matmul(panels, h, n).max(dim=-1).indices
        assert torch.equal(decoding.block_argmax_rows(h, panels, n), want)
        assert int(want[1]) == 3 and int(want[3]) == 0
        norms = decoding.block_norms(panels, n)
        assert torch.equal(decoding.block_head_argmax_reference(h, panels, norms, n), want)
    est, xerr = blocks.block_panels_estimate(panels, h, n)
    exact = blocks.block_panels_matmul(panels, h, n).double()
    size = h.double().norm(dim=1, keepdim=True)
    gamma = 2 * k * 2.0**-24 / (1 - 2 * k * 2.0**-24)
    reach = decoding.block_norms(panels, n)[None] * (xerr[:, None] * (1 + gamma) + 2 * gamma * size)
    assert bool(((est.double() - exact).abs() <= reach).all())


def test_a_block_heads_screen_answers_rows_it_cannot_screen_whole():
    """block_head_argmax computes whole, and answers as PyTorch's max does, the rows it cannot screen: a NaN or an
    infinity in the row, and a row every output of which is a candidate (all equal); the other rows of the
    batch keep their screened answers, with 1 and 2 threads."""
    from tests.ops.test_blocks import layer_of

    n, k = 2000, 256
    layer = layer_of("Q8_0", n, k, seed=5)
    panels = layer.panels()[0]
    h = _randn(12, k, seed=6)
    h[2, 7] = float("nan")
    h[5, 0] = float("inf")
    h[8] = 0.0
    want = blocks.block_panels_matmul(panels, h, n).max(dim=-1).indices
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = decoding.block_head_argmax(h, panels, decoding.block_norms(panels, n), n)
            assert torch.equal(got, want), threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("n", [1, 15, 16, 33, 63, 64, 65, 127, 200, 4099])
def test_first_largest_is_maxs_index(n):
    """first_largest (greedy decoding's choice) against ``max(dim=-1).indices`` on rows with exact ties, a NaN
    (several: the first wins), a row of -inf, signed zeros, the largest value last, and lengths around the
    vector's 16 and the four vectors' 64."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(8, n, generator=g).round()  # many ties
    x[7, -1] = 1e3
    x[1, torch.randint(0, n, (2,), generator=g)] = float("nan")
    x[2] = float("-inf")
    x[3] = -1.0
    x[3, 0], x[3, -1] = -0.0, 0.0
    x[4, -1] = float("inf")
    x[5] = 2.0
    got = decoding.first_largest(x)
    assert torch.equal(got, x.max(dim=-1).indices)
    assert torch.equal(decoding.first_largest_reference(x), got)
    assert int(got[1]) == int(x[1].isnan().nonzero()[0]) and int(got[5]) == 0


def test_the_screens_one_pass_answers_every_row(int8_estimates):
    """screen_argmax (argmax_rows above SCREEN_MAX_ROWS rows) answers, as PyTorch's max does, the rows it cannot
    screen (a NaN, an infinity, a row of zeros: every output a candidate) with every other row's screened
    answer, with a bias and without, on 1 and 2 threads."""
    n, k = 2500, 256
    w, h = _randn(n, k, seed=21), _randn(12, k, seed=22)
    h[2, 7] = float("nan")
    h[5, 0] = float("inf")
    h[8] = 0.0
    bias = _randn(n, seed=23)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for b in (None, bias):
                want = decoding.linear_panels(h, decoding.panels(w), b, n).max(dim=-1).indices
                screen, bound, norms = decoding._screen(w)
                assert torch.equal(decoding.screen_argmax(h, w, b, screen, bound, norms), want), (threads, b is None)
                assert torch.equal(decoding.argmax_rows(h, w, b), want)
    finally:
        torch.set_num_threads(before)


def test_the_bound_keeps_a_row_the_estimates_rank_lower():
    """Estimates within their bounds that rank row 1 above row 2 while the exact outputs rank row 2 first:
    head_argmax answers 2, and 1 with zero bounds (so the answer comes from the bound)."""
    w, h = _randn(3, 64, seed=15), _randn(1, 64, seed=16)
    exact = decoding.linear_panels(h, decoding.panels(w), None, 3)[0]
    order = exact.argsort(descending=True)  # the winner, the runner-up, the last
    est = exact.clone()
    gap = float(exact[order[0]] - exact[order[1]])
    est[order[0]] -= 0.6 * gap
    est[order[1]] += 0.6 * gap  # the runner-up now estimated first
    bound = torch.full((3,), gap / float(h.norm()), dtype=torch.float64)  # covers the 0.6 gap moved
    assert int(decoding.head_argmax(h, w, None, est[None], bound)[0]) == int(order[0])
    assert int(decoding.head_argmax(h, w, None, est[None], torch.zeros_like(bound))[0]) == int(order[1])


def test_rows_the_screen_leaves_open_are_answered_from_the_whole_head():
    """Non-finite inputs: head_argmax answers -1 and argmax_rows the whole product's arg-max."""
    w, h = _randn(5000, 64, seed=10), _randn(3, 64, seed=11)
    h[1, 5] = torch.inf
    found = _screened(h, w)
    assert found[1] == -1 and found[0] >= 0 and found[2] >= 0
    torch.testing.assert_close(decoding.argmax_rows(h, w), _first_largest(h, w), rtol=0, atol=0)


def _fused_model():
    return fuse_projections_(
        tiny_model(
            "decoder", vocab=24, std=0.5, positions="rotary", n_heads=4, n_kv_heads=2, norm="rmsnorm",
            activation="swiglu", lm_head_bias=True, tie_embeddings=False,
        )
    )  # fmt: skip


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [4]]
STEPS = torch.randint(4, 24, (3, 5), generator=torch.Generator().manual_seed(0))  # fed after the prefill


def _counted(monkeypatch, *names):
    """Count the calls that decoding (decode.start, decode.decode_step) makes to these operators of
    attnmask.ops.decoding."""
    calls = {name: 0 for name in names}
    for name in names:
        real = getattr(decoding, name)

        def counting(*args, name=name, real=real):
            calls[name] += 1
            return real(*args)

        monkeypatch.setattr(decoding, name, counting)
    return calls


def _decoded(model) -> torch.Tensor:
    with torch.inference_mode():
        state, _, _ = decode.start(model, prompts=PROMPTS, max_new_tokens=6)
        return torch.stack([decode.decode_step(model, state, STEPS[:, t]) for t in range(5)], 1)  # (B, 5, V)


def test_decoding_runs_a_step_in_one_call(monkeypatch):
    """A pre-norm RMSNorm / rotary / SwiGLU decoder with fused projections runs the prefill and each
    decoded token in one packed_step call, ragged prompts included, with the logits of the general
    forward pass."""
    model = _fused_model()
    calls = _counted(monkeypatch, "packed_step", "paged_attend")
    got = _decoded(model)
    assert calls == {"packed_step": 1 + 5, "paged_attend": 0}
    for b, row in enumerate(PROMPTS):
        with torch.no_grad():
            want = model.decode(torch.tensor([row + STEPS[b].tolist()]), mask=masks.causal())[0, len(row) :]
        torch.testing.assert_close(got[b], want, atol=1e-5 * want.abs().max(), rtol=0)


def test_a_step_refuses_two_rows_that_write_one_cache_slot():
    """The step writes its rows' keys and values from several threads: two rows naming one cache slot (one
    position of a sequence twice) are refused, never raced."""
    model = _fused_model()
    cache = PagedKVCache.for_model(model, num_blocks=4, block_size=4)
    tokens, positions, row_seq = torch.tensor([3, 4, 5]), torch.tensor([0, 1, 1]), torch.tensor([0, 0, 0])
    with torch.inference_mode(), pytest.raises(ValueError, match="two rows write cache slot 5 .block 1"):
        packed_forward(model, cache, tokens, positions, row_seq, torch.tensor([[1]]), torch.tensor([2]),
                       steps.fused_plan(model))  # fmt: skip


def test_a_watched_module_takes_the_same_calls_from_python(monkeypatch):
    """A hook on a product (as benchmarks/smollm2.py --breakdown sets): the step makes packed_step's calls
    one by one from Python, so that the hook sees its module called."""
    model = _fused_model()
    whole = _decoded(model)
    seen = []
    model.layers[1].mlp.down_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    calls = _counted(monkeypatch, "packed_step", "paged_attend", "linear_panels")
    by_calls = _decoded(model)
    # per forward (the prefill and five steps): every layer's attention, and 4 L + 1 products of which
    # the watched one is the module's call
    L = len(model.layers)
    assert calls == {"packed_step": 0, "paged_attend": 6 * L, "linear_panels": 6 * 4 * L}
    assert len(seen) == 1 + 5  # the prefill and the five steps
    torch.testing.assert_close(by_calls, whole, atol=1e-5 * whole.abs().max(), rtol=0)  # one product on the BLAS


def test_one_call_is_its_definition_call_by_call(monkeypatch):
    """packed_step makes from C++ the calls its definition makes from Python, in the same order, and
    its own arithmetic between them (rotary, cache writes) rounds as PyTorch's does: the same bits."""
    model = _fused_model()
    whole = _decoded(model)
    monkeypatch.setattr(decoding, "packed_step", decoding.packed_step_reference)
    calls = _counted(monkeypatch, "paged_attend")
    by_calls = _decoded(model)
    assert torch.equal(by_calls, whole), f"differ by up to {(by_calls - whole).abs().max():.3g}"
    assert calls == {"paged_attend": 6 * len(model.layers)}


def test_greedy_decoding_takes_the_screened_arg_max_and_the_tokens_of_the_logits(monkeypatch):
    """Greedy decoding without penalties or grammars asks the step for arg-max tokens: packed_step ends at
    the final norm's rows and head_argmax picks each token (made to screen this small head too), the tokens
    that the logits' arg-max gives, in one call a step and through the step's definition alike. Sampling
    still gets logits."""
    model = tiny_model("decoder", vocab=300, std=0.3, positions="rotary", n_heads=4, n_kv_heads=2, norm="rmsnorm",
                       activation="swiglu", tie_embeddings=False)  # fmt: skip
    prompts = [[5, 6, 7, 8, 9], [10, 11], [4]]
    want = decode.greedy(model, prompts=prompts, max_new_tokens=12, eos_id=None)  # a small head: the logits' max
    monkeypatch.setattr(decoding, "SCREEN_MIN_WEIGHTS", 0)
    calls = _counted(monkeypatch, "head_argmax", "packed_step")
    assert decode.greedy(model, prompts=prompts, max_new_tokens=12, eos_id=None) == want
    assert calls == {"head_argmax": 12, "packed_step": 12}  # the prefill and 11 steps, 3 rows each
    monkeypatch.setattr(decoding, "packed_step", decoding.packed_step_reference)
    assert decode.greedy(model, prompts=prompts, max_new_tokens=12, eos_id=None) == want
    calls["head_argmax"] = 0
    decode.generate_ids(model, prompts=prompts, max_new_tokens=3, eos_id=None, temperature=0.7,
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert calls["head_argmax"] == 0


SOURCES = [[5, 6, 7, 8, 9, 2], [10, 11, 2], [4, 2]]


def _seq2seq_models():
    """Encoder-decoders of each kind seq2seq_step makes: post-norm LayerNorm (the original Transformer,
    Marian) with a plain SiLU MLP; pre-norm LayerNorm without biases, GELU, learned positions; pre-norm
    RMSNorm with a fused gate/up (SwiGLU) and fused q/k/v and 2 key/value heads; post-norm tanh-GELU-gated
    with separate gate and up; rotary RMSNorm SwiGLU (attnmask's default)."""
    common = {"vocab": 24, "std": 0.5, "lm_head_bias": True, "tie_embeddings": False}
    return {
        "post-layernorm-silu": tiny_model("encoder_decoder", norm_position="post", activation="silu", **common),
        "pre-layernorm-gelu": tiny_model(
            "encoder_decoder", norm_position="pre", activation="gelu", positions="learned", bias=False, **common
        ),
        "pre-rmsnorm-swiglu-fused": fuse_projections_(
            tiny_model("encoder_decoder", norm="rmsnorm", activation="swiglu", n_kv_heads=2, **common)
        ),
        "post-geglu-tanh": tiny_model("encoder_decoder", norm_position="post", activation="geglu_tanh", **common),
        "rotary-rmsnorm-swiglu": tiny_model(  # attnmask's own translation models (attnmask demo, train)
            "encoder_decoder", positions="rotary", norm="rmsnorm", activation="swiglu", **common
        ),
    }


def _translated(model, sources=SOURCES) -> torch.Tensor:
    """The logits of the first step and of five tokens fed after it, (B, 6, V)."""
    with torch.inference_mode():
        state, first, _ = decode.start(model, src=sources, max_new_tokens=7)
        return torch.stack([first] + [decode.decode_step(model, state, STEPS[:, t]) for t in range(5)], 1)


@pytest.mark.parametrize("kind", list(_seq2seq_models()))
def test_an_encoder_decoder_step_is_one_call_with_the_bits_of_its_operations(monkeypatch, kind):
    """An encoder-decoder's decoder runs each step in one seq2seq_step call (norms before or after the
    sublayers, LayerNorm or RMSNorm, source attention, a plain or gated MLP), making from C++ the operators
    the per-operation step makes from Python, in the same order: the same bits as that step and as the
    operator's definition, and the logits of the general forward pass."""
    model = _seq2seq_models()[kind]
    assert isinstance(steps.fused_plan(model), Seq2SeqPlan)
    calls = _counted(monkeypatch, "seq2seq_step", "paged_attend")
    whole = _translated(model)
    assert calls == {"seq2seq_step": 6, "paged_attend": len(model.encoder_layers)}  # the decoder's: none
    monkeypatch.setattr(decoding, "seq2seq_step", decoding.seq2seq_step_reference)
    by_definition = _translated(model)
    monkeypatch.setattr(steps, "fused_plan", lambda model: None)
    by_operations = _translated(model)
    for other, what in [(by_definition, "the definition"), (by_operations, "the per-operation step")]:
        assert torch.equal(other, whole), f"{what} differs by up to {(other - whole).abs().max():.3g}"
    for b, source in enumerate(SOURCES):
        with torch.no_grad():
            memory = model.encode(torch.tensor([source]))
            want = model.decode(torch.tensor([[1, *STEPS[b].tolist()]]), memory, mask=masks.causal())[0]  # (6, V)
        torch.testing.assert_close(whole[b], want, atol=1e-5 * want.abs().max(), rtol=0)


@pytest.mark.parametrize("kind", ["post-layernorm-silu", "rotary-rmsnorm-swiglu"])
def test_an_encoder_decoders_greedy_step_screens_its_head(int8_estimates, monkeypatch, kind):
    """Where argmax_rows screens the head (here at any row count), greedy translation's seq2seq_step stops at
    the final norm's rows (a head of kind NONE) and argmax_rows picks each token: the tokens of the logits'
    arg-max, from the native step and from the operator's definition."""
    model = _seq2seq_models()[kind]
    with torch.inference_mode():
        want = decode.greedy(model, src=SOURCES, max_new_tokens=8, eos_id=None)
    monkeypatch.setattr(decoding, "SCREEN_MAX_ROWS", 0)
    calls = _counted(monkeypatch, "argmax_rows", "screen_argmax")
    with torch.inference_mode():
        assert decode.greedy(model, src=SOURCES, max_new_tokens=8, eos_id=None) == want
        assert calls["argmax_rows"] == 8 and calls["screen_argmax"] == 8
        monkeypatch.setattr(decoding, "seq2seq_step", decoding.seq2seq_step_reference)
        assert decode.greedy(model, src=SOURCES, max_new_tokens=8, eos_id=None) == want


def test_an_encoder_decoder_row_is_the_same_bits_alone_and_in_a_batch():
    """The encoder's packed rows and seq2seq_step compute each row alone: a sentence's logits are the bits
    it has when translated alone."""
    model = _seq2seq_models()["post-layernorm-silu"]
    together = _translated(model)
    for b, source in enumerate(SOURCES):
        with torch.inference_mode():
            state, first, _ = decode.start(model, src=[source], max_new_tokens=7)
            alone = [first[0]] + [decode.decode_step(model, state, STEPS[b : b + 1, t])[0] for t in range(5)]
        assert torch.equal(torch.stack(alone), together[b]), f"sentence {b}"


def test_other_models_keep_the_per_operation_step():
    """LayerNorm, an MLP without a gate, bfloat16 weights, a watched norm: not one call (unfused projections
    are: each product in a slot of its own)."""
    watched = _fused_model()
    watched.layers[0].self_norm.register_forward_hook(lambda *args: None)
    cases = [
        fuse_projections_(tiny_model("decoder", positions="rotary", norm="layernorm", activation="swiglu")),
        tiny_model("decoder", positions="rotary", norm="rmsnorm", activation="gelu"),  # no gate
        _fused_model().to(torch.bfloat16),  # all else fits, but the weights are not float32
        watched,
    ]
    assert steps.fused_plan(_fused_model()) is not None
    assert steps.fused_plan(tiny_model("decoder", positions="rotary", norm="rmsnorm", activation="swiglu")) is not None
    assert [steps.fused_plan(m) for m in cases] == [None] * len(cases)


@pytest.mark.slow  # builds the native library twice more (a minute or so each on 2 cores)
@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_the_other_builds_match_their_definitions_too(capability):
    """The AVX2 and portable builds (what other CPUs get: the flags follow PyTorch's CPU capability,
    which ATEN_CPU_CAPABILITY lowers), in a fresh process: the definition, panel and batch tests above,
    again; and the float32 rows product gives the bits of this process's build (one chain of
    multiply-adds an output in every build)."""
    if capability == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU does not run AVX2")
    tests = "matches_its_definition or panels or same_bits_in_any_batch"
    code = (
        "import sys, pytest, torch\n"
        "from attnmask import ops\n"
        "from tests.ops.test_decoding import _rows_product_bits\n"
        "print(ops.load().why)\n"
        "print(_rows_product_bits())\n"
        f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {__file__!r}, '-k', {tests!r}]))\n"
    )
    lines = run_python(code, timeout=600, ATEN_CPU_CAPABILITY=capability)
    assert lines[0].startswith(f"C/C++, {'AVX2' if capability == 'avx2' else 'portable C'}, "), lines[0]
    assert lines[1] == _rows_product_bits(), "the rows product's bits differ between builds"
    assert " passed" in lines[-1] and "skipped" not in lines[-1], lines[-1]


def _rows_product_bits() -> str:
    """A digest of linear_rows' bits on fixed inputs (several row tiles, a K past a block, a partial panel),
    made of integers (torch.randn's own bits follow the CPU capability)."""
    import hashlib

    def values(n: int, seed: int) -> torch.Tensor:
        return ((torch.arange(n, dtype=torch.int64) * 7919 + seed) % 1009 - 504).float() / 256

    x, w, b = values(19 * 1100, 1).view(19, 1100), values(101 * 1100, 2).view(101, 1100), values(101, 3)
    return hashlib.sha256(decoding.linear_rows(x, w, b).numpy().tobytes()).hexdigest()


def test_without_a_cxx_compiler_decoding_says_so_once_and_gives_the_same_logits(tmp_path):
    """A fresh process (a loaded operator library cannot be unloaded) whose $CXX does not exist: one
    warning naming the compiler, the step on PyTorch's operations (not the operators' slow
    definitions), and the logits of the native step up to rounding."""
    code = (
        "import warnings, torch\n"
        "from attnmask import ops\n"
        "from attnmask.ops import decoding\n"
        "from tests.ops.test_decoding import _decoded, _fused_model\n"
        "calls = []\n"
        "decoding.packed_step = decoding.paged_attend = lambda *a: calls.append(a)\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    print(ops.available(), ops.available())\n"
        f"    torch.save(_decoded(_fused_model()), {str(tmp_path / 'logits.pt')!r})\n"
        "print(len(seen), str(seen[0].message))\n"
        "print(len(calls))\n"
    )
    available, warning, calls = run_python(code, CXX=str(tmp_path / "no-such-c++"), ATTNMASK_CACHE=str(tmp_path))
    assert available == "False False"
    assert warning.startswith("1 attnmask: native kernels unavailable") and "no-such-c++" in warning, warning
    assert calls == "0"
    fallback, native = torch.load(tmp_path / "logits.pt"), _decoded(_fused_model())
    torch.testing.assert_close(fallback, native, atol=1e-5 * native.abs().max(), rtol=0)
