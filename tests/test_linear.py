"""attnmask.linear: float32 CPU products in oneDNN or the BLAS, forward and backward, against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnmask import linear as L
from attnmask.errors import UserError

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
    with pytest.raises(UserError, match="unknown matmul engine 'mkl'.*auto, onednn, blas, measure"):
        L.set_engine("mkl")
    L._engine = None
    monkeypatch.setenv("ATTNMASK_MATMUL", "fast")
    with pytest.raises(UserError, match="ATTNMASK_MATMUL='fast'.*auto, onednn, blas, measure"):
        L.engine()
    monkeypatch.setenv("ATTNMASK_MATMUL", "blas")
    assert L.engine() == "blas" and L.engine_reason() == "as requested"


def proc_cpuinfo(vendor: str, family: int, model: int, flags: str) -> str:
    """One processor's block of /proc/cpuinfo as Linux writes it (the flags cut to those that matter)."""
    return f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\nflags\t\t: {flags}\n\n"


ZEN5 = proc_cpuinfo("AuthenticAMD", 26, 2, "fpu avx2 avx512f avx512bw")  # EPYC 9005
ZEN4 = proc_cpuinfo("AuthenticAMD", 25, 17, "fpu avx2 avx512f avx512bw")  # EPYC 9004: AVX-512 in two halves
ZEN3 = proc_cpuinfo("AuthenticAMD", 25, 1, "fpu avx avx2")
AMD_AVX2 = proc_cpuinfo("AuthenticAMD", 26, 68, "fpu avx avx2")  # family 26, AVX-512 absent (or masked by a VM)
INTEL = proc_cpuinfo("GenuineIntel", 6, 143, "fpu avx2 avx512f avx512bw")  # Sapphire Rapids
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n\n"


def test_cpuinfo_is_read_from_the_first_processor():
    two = ZEN5 + ZEN5.replace("processor\t: 0", "processor\t: 1").replace("26", "99")
    assert L.cpu_info(two) == L.CpuInfo("AuthenticAMD", 26, frozenset({"fpu", "avx2", "avx512f", "avx512bw"}))
    assert L.cpu_info(ARM) == L.CpuInfo("", None, frozenset())


@pytest.mark.parametrize(
    "cpuinfo, onednn, chosen, why",
    [
        (ZEN5, True, "onednn", "auto: AMD family 26 (Zen 5 or later) with AVX-512"),
        (ZEN5, False, "blas", "auto: this PyTorch has no working oneDNN product"),
        (ZEN4, True, "blas", "auto: AMD family 25, before Zen 5 (family 26)"),
        (ZEN3, True, "blas", "auto: AMD family 25, before Zen 5"),
        (INTEL, True, "blas", "auto: GenuineIntel's CPU, not AMD's"),
        (AMD_AVX2, True, "blas", "auto: AMD family 26 without AVX-512 (no avx512f)"),
        (ARM, True, "blas", "auto: an unknown vendor's CPU"),
        (None, True, "blas", "auto: CPU unknown"),
    ],
    ids=["zen5", "zen5-no-onednn", "zen4", "zen3", "intel", "amd-avx2-only", "arm", "unknown"],
)
def test_the_auto_rule_follows_the_cpu(cpuinfo, onednn, chosen, why):
    cpu = None if cpuinfo is None else L.cpu_info(cpuinfo)
    engine, reason = L.auto_rule(cpu, onednn=onednn)
    assert engine == chosen
    assert reason.startswith(why), reason


@pytest.mark.parametrize("name", ["auto", "onednn", "blas"])
def test_no_engine_but_measure_times_anything(name, engine_restored, monkeypatch):
    def timing(*args, **kwargs):
        raise AssertionError(f"{name} timed the two libraries")

    monkeypatch.setattr(L, "measure_speedup", timing)
    assert L.set_engine(name) in ("onednn", "blas")
    L._engine = None
    monkeypatch.setenv("ATTNMASK_MATMUL", name)
    L.engine()  # the environment's default path too


def test_auto_applies_the_rule_to_this_machine(engine_restored, monkeypatch):
    zen5, zen4 = L.cpu_info(ZEN5), L.cpu_info(ZEN4)
    monkeypatch.setattr(L, "cpu_info", lambda: zen5)
    monkeypatch.setattr(L, "_onednn_checked", (True, ""))
    assert L.set_engine("auto") == "onednn"
    assert L.engine_reason().startswith("auto: AMD family 26 (Zen 5 or later)")
    monkeypatch.setattr(L, "cpu_info", lambda: zen4)
    assert L.set_engine("auto") == "blas"
    assert L.engine_reason().startswith("auto: AMD family 25")
    # the same answer every time: a rule, not a measurement
    assert {L.set_engine("auto") for _ in range(5)} == {"blas"}


@needs_onednn
def test_measure_times_both_and_says_so(engine_restored, monkeypatch):
    monkeypatch.setattr(L, "measure_speedup", lambda: 1.3)
    assert L.set_engine("measure") == "onednn"
    assert L.engine_reason() == "measure: oneDNN timed at 1.3x the BLAS's speed (threshold 1.15x)"
    monkeypatch.setattr(L, "measure_speedup", lambda: 1.1)
    assert L.set_engine("measure") == "blas"
    monkeypatch.undo()
    assert L.set_engine("measure") in ("onednn", "blas")  # the real timing runs
    assert L.engine_reason().startswith("measure: oneDNN timed at ")


@pytest.mark.parametrize(
    "broken, why",
    [
        ("raises", "torch.ops.mkldnn._linear_pointwise failed (RuntimeError: unsupported)"),
        ("wrong", "torch.ops.mkldnn._linear_pointwise disagrees with F.linear"),
        ("missing", "this PyTorch has no torch.ops.mkldnn._linear_pointwise"),
    ],
)
def test_a_broken_private_op_falls_back_to_the_blas(broken, why, engine_restored, monkeypatch):
    class FakeOps:  # stands in for torch.ops.mkldnn
        if broken == "raises":

            @staticmethod
            def _linear_pointwise(x, w, b, *args):
                raise RuntimeError("unsupported")

        elif broken == "wrong":

            @staticmethod
            def _linear_pointwise(x, w, b, *args):
                return F.linear(x, w, b) + 1.0

    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.ops, "mkldnn", FakeOps())
    monkeypatch.setattr(L, "_onednn_checked", None)
    assert L._onednn_works() == (False, why)
    assert L.set_engine("onednn") == "blas"
    assert L.engine_reason() == f"onednn requested, but {why}"
    assert L.set_engine("auto") == "blas"
    assert L.engine_reason() == "auto: this PyTorch has no working oneDNN product"
    x, w = torch.randn(64, 256), torch.randn(512, 256)
    torch.testing.assert_close(L.linear(x, w), F.linear(x, w))  # the BLAS computes it; nothing raised


@needs_onednn
def test_the_check_passes_for_this_torchs_onednn(monkeypatch):
    monkeypatch.setattr(L, "_onednn_checked", None)
    assert L._onednn_works() == (True, "")


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


def bf16_reference(x, w, b, grad):
    """bfloat16 autocast's function in float64: bfloat16 operands and incoming gradient, exact sums."""
    r = lambda t: t.detach().to(torch.bfloat16).double()  # noqa: E731
    xd, wd = r(x).requires_grad_(), r(w).requires_grad_()
    bd = None if b is None else r(b).requires_grad_()
    y = F.linear(xd, wd, bd)
    y.backward(r(grad))
    return y, xd.grad, wd.grad, None if bd is None else bd.grad


def close_in_bf16(got, want):
    """Within one bfloat16 rounding of the float64 value (plus float32 sums' few ulps)."""
    assert got.dtype != torch.float64
    tol = want.abs() * 2.0**-8 + want.abs().max() * 2.0**-16
    assert ((got.double() - want).abs() <= tol).all(), (got.double() - want).abs().max()


@pytest.mark.parametrize("autocast", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_bfloat16_without_fast_bf16_products_is_autocasts_function_in_float32(autocast, bias, monkeypatch):
    monkeypatch.setattr(L, "fast_bf16_products", lambda: False)
    g = torch.Generator().manual_seed(3)
    dtype = torch.float32 if autocast else torch.bfloat16
    x = torch.randn(3, 40, 96, generator=g).to(dtype).requires_grad_()
    w = torch.randn(72, 96, generator=g).to(dtype).requires_grad_()
    b = torch.randn(72, generator=g).to(dtype).requires_grad_() if bias else None
    grad = torch.randn(3, 40, 72, generator=g)
    calls = []
    monkeypatch.setattr(
        L._Bf16ByFloat32, "apply", lambda *a, _apply=L._Bf16ByFloat32.apply: calls.append(1) or _apply(*a)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = L.linear(x, w, b)
    y.backward(grad.to(y.dtype))
    assert calls == [1] and y.dtype == torch.bfloat16
    y_ref, gx, gw, gb = bf16_reference(x, w, b, grad)
    close_in_bf16(y, y_ref)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        torchs = F.linear(x, w, b)  # PyTorch's own bfloat16 product: the same up to the sums' order
    assert (y != torchs).float().mean() < 0.01
    for got, want, like in ((x.grad, gx, x), (w.grad, gw, w), (None if b is None else b.grad, gb, b)):
        if like is not None:
            assert got.dtype == like.dtype
            close_in_bf16(got, want)


def test_bfloat16_with_fast_bf16_products_is_torchs_own(monkeypatch):
    monkeypatch.setattr(L, "fast_bf16_products", lambda: True)
    monkeypatch.setattr(L._Bf16ByFloat32, "apply", lambda *a: pytest.fail("widened where bf16 is fast"))
    layer = L.Linear(64, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(8, 64)).dtype == torch.bfloat16
    assert L.linear(torch.randn(8, 64, dtype=torch.bfloat16), layer.weight.bfloat16()).dtype == torch.bfloat16
