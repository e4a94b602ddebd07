"""attnmask.linear: float32 CPU products in oneDNN or the BLAS, forward and backward, against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnmask import linear as L

needs_onednn = pytest.mark.skipif(not L._onednn_available(), reason="this PyTorch has no oneDNN")


@pytest.fixture
def engine_restored():
    saved = L._engine, L._reason
    yield
    L._engine, L._reason = saved


def reference(x, w, b, grad):
    """Output and gradients in float64."""
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    bd = None if b is None else b.detach().double().requires_grad_()
    y = F.linear(xd, wd, bd)
    y.backward(grad.double())
    return y, xd.grad, wd.grad, None if bd is None else bd.grad


def onednn_calls(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise")


@needs_onednn
@pytest.mark.parametrize("engine", ["onednn", "blas"])
@pytest.mark.parametrize(
    "lead, k, n, bias",
    [((4, 48), 96, 160, True), ((200,), 160, 96, False), ((3, 5, 7), 128, 256, True)],
    ids=["3d-k<n-bias", "2d-k>n", "4d-bias"],
)
def test_forward_and_backward_match_float64(engine, lead, k, n, bias, engine_restored):
    L.set_engine(engine)
    torch.manual_seed(0)
    layer = L.Linear(k, n, bias=bias)
    x = torch.randn(*lead, k, requires_grad=True)
    y = layer(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref, gx_ref, gw_ref, gb_ref = reference(x, layer.weight, layer.bias, grad)
    assert y.shape == (*lead, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), gx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad.double(), gw_ref, rtol=1e-5, atol=1e-4)
    assert layer.weight.grad.is_contiguous()
    if bias:
        torch.testing.assert_close(layer.bias.grad.double(), gb_ref, rtol=1e-5, atol=1e-4)


@needs_onednn
def test_the_chosen_engine_is_the_one_that_runs(engine_restored):
    layer = L.Linear(256, 512)
    x = torch.randn(64, 256, requires_grad=True)
    L.set_engine("onednn")
    assert onednn_calls(lambda: layer(x).sum().backward()) == 3  # forward, d input, d weight
    assert onednn_calls(lambda: layer(x[:2])) == 0  # two rows: the BLAS is as fast
    L.set_engine("blas")
    assert onednn_calls(lambda: layer(x).sum().backward()) == 0


@needs_onednn
def test_a_transposed_input_and_a_column_major_weight(engine_restored):
    L.set_engine("onednn")
    x = torch.randn(256, 96).t()  # (96, 256), not contiguous
    w = torch.randn(192, 256).t().contiguous().t()  # (192, 256) stored column-major
    torch.testing.assert_close(L.linear(x, w), (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-5)
    assert onednn_calls(lambda: L.linear(x, w)) == 1


@needs_onednn
def test_other_dtypes_and_autocast_keep_torchs_own_product(engine_restored):
    L.set_engine("onednn")
    layer = L.Linear(128, 256)
    x = torch.randn(32, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
        assert onednn_calls(lambda: layer(x)) == 0
    xd = x.double()
    assert L.linear(xd, layer.weight.double()).dtype == torch.float64


def test_engine_names_are_checked(engine_restored, monkeypatch):
    with pytest.raises(ValueError, match="unknown matmul engine 'mkl'.*auto, onednn, blas"):
        L.set_engine("mkl")
    L._engine = None
    monkeypatch.setenv("ATTNMASK_MATMUL", "fast")
    with pytest.raises(ValueError, match="ATTNMASK_MATMUL='fast'.*auto, onednn, blas"):
        L.engine()
    monkeypatch.setenv("ATTNMASK_MATMUL", "blas")
    assert L.engine() == "blas" and L.engine_reason() == "as requested"


@needs_onednn
def test_auto_times_both_and_says_so(engine_restored):
    chosen = L.set_engine("auto")
    assert chosen in ("onednn", "blas")
    assert L.engine_reason().startswith("auto: oneDNN measured ")


@needs_onednn
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_training_step_matches_eager(backend, engine_restored):
    # inductor lowers mkldnn's own op only for frozen weights: the product goes through attnmask's operator
    L.set_engine("onednn")
    torch.manual_seed(0)
    layer = L.Linear(128, 256)
    x = torch.randn(64, 128)

    def step(fn):
        layer.zero_grad()
        loss = fn(x).square().mean()
        loss.backward()
        return loss.detach(), layer.weight.grad.clone()

    eager = step(layer)
    fn = torch.compile(layer, backend=backend, fullgraph=True)
    compiled = step(fn)
    torch.testing.assert_close(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(fn)
    # the forward and d weight (x needs no gradient), under compile through attnmask's operator
    assert sum(e.count for e in prof.key_averages() if e.key == "attnmask::onednn_linear") == 2
