"""Conformance (attnmask.audit.conform): clean implementations pass, every known-bad kernel is
caught and named (scenario + implementation), the CLI gives one verdict, and bad arguments one line."""

from __future__ import annotations

import json
import time

import pytest
import torch

pytest.importorskip("transformers")

from attnmask.audit import conform  # noqa: E402
from attnmask.audit.conform.models import implementations, load_model, reach  # noqa: E402
from attnmask.cli import main  # noqa: E402
from tests.audit.conform_fixtures import registered  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# transformers 5.x: an explicit 2-D attention_mask turns off the detection of packed sequences from
# restarting position_ids, so every implementation lets packed samples see each other then.
ALL_ONES_PACKED = "packed (all-ones mask)"


def failed(report) -> set[tuple[str, str]]:
    return {(r.scenario, r.implementation) for r in report.failures}


@pytest.fixture(scope="module")
def llama():
    return load_model("llama")[0]


@pytest.fixture(scope="module")
def mistral():
    return load_model("mistral")[0]


# ---------------------------------------------------------------------------------------------
# Clean implementations pass
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2"])
def test_clean_decoders_pass_every_scenario_but_the_all_ones_packed_batch(name):
    model, desc = load_model(name)
    report = conform(model, ["eager", "sdpa"], name=desc)
    assert failed(report) == {(ALL_ONES_PACKED, "eager"), (ALL_ONES_PACKED, "sdpa")}, report.to_text()
    # samples 5 + 4 + 3 tokens: the second sample's first token (5) sees the first sample's first token
    assert report.result(ALL_ONES_PACKED, "sdpa").first == {"query": 5, "key": 0}
    ran = {r.scenario for r in report.results if not r.skipped}
    assert {"causality", "left padding", "right padding", "packed (no mask)", "cache parity", "batched greedy"} <= ran


def test_sliding_window_reach_is_measured_and_clean_windows_pass(mistral):
    assert reach(mistral.config) == 6  # 2 layers x (window 4 - 1)
    report = conform(mistral, ["eager", "sdpa"], scenarios=["causality", "sliding window", "float64 reference"])
    assert report.passed, report.to_text()
    res = report.result("sliding window", "sdpa")
    assert not res.skipped and "reaches exactly 6 tokens back" in res.detail
    assert report.result("float64 reference", "eager").max_deviation < 1e-5  # attnmask's window, same weights


@pytest.mark.parametrize("name", ["marian", "t5"])
def test_encoder_decoders_pass(name):
    model, _ = load_model(name)
    report = conform(model, ["eager", "sdpa"])
    assert report.passed, report.to_text()
    assert {"causality", "right padding", "source padding", "fully padded rows"} <= set(report.scenarios)
    assert "packed (no mask)" not in report.scenarios  # a decoder-only scenario
    ref = report.result("float64 reference", "sdpa")
    assert bool(ref.skipped) == (name == "t5")  # attnmask imports Marian, not T5


# ---------------------------------------------------------------------------------------------
# Known-bad kernels are caught and named
# ---------------------------------------------------------------------------------------------
def test_a_window_one_too_wide_is_named(mistral):
    with registered("wide_window"):
        report = conform(mistral, ["sdpa", "wide_window"])
    assert ("sliding window", "wide_window") in failed(report)
    assert ("sliding window", "sdpa") not in failed(report)
    res = report.result("sliding window", "wide_window")
    # window 5 instead of 4 over 2 layers: output 7 reaches token 0, 7 > 6 tokens back
    assert res.first == {"query": 7, "key": 0}
    assert "more than 6 back" in res.detail


def test_a_window_one_too_narrow_is_named_too(mistral):
    with registered("narrow_window"):
        report = conform(mistral, ["narrow_window"], scenarios=["causality", "sliding window"])
    res = report.result("sliding window", "narrow_window")
    assert not res.passed and "too narrow" in res.detail
    assert report.result("causality", "narrow_window").passed
    # window 3 instead of 4: output 6 no longer reaches token 0, 6 tokens back
    assert res.first == {"query": 6, "key": 0}


def test_pads_leaking_under_left_padding_are_named(llama):
    with registered("pad_leak"):
        report = conform(llama, ["sdpa", "pad_leak"])
    bad = failed(report)
    assert ("left padding", "pad_leak") in bad and ("batched greedy", "pad_leak") in bad
    assert ("right padding", "pad_leak") not in bad  # right pads hide behind the look-ahead mask
    assert not any(impl == "sdpa" and s != ALL_ONES_PACKED for s, impl in bad)
    # 3 pads on the left: the first real token (3) sees pad 0
    assert report.result("left padding", "pad_leak").first == {"query": 3, "key": 0}


def test_cross_sample_attention_in_a_packed_batch_is_named(llama):
    with registered("pack_leak"):
        report = conform(llama, ["sdpa", "pack_leak"])
    assert failed(report) - {(ALL_ONES_PACKED, "sdpa"), (ALL_ONES_PACKED, "pack_leak")} == {
        ("packed (no mask)", "pack_leak")
    }
    assert report.result("packed (no mask)", "pack_leak").first == {"query": 5, "key": 0}


def test_cache_differing_from_no_cache_is_named(llama, tmp_path):
    with registered("topleft_cache"):
        report = conform(llama, ["sdpa", "topleft_cache"], png_dir=tmp_path)
    bad = failed(report)
    assert ("cache parity", "topleft_cache") in bad and ("batched greedy", "topleft_cache") in bad
    assert ("causality", "topleft_cache") not in bad
    res = report.result("cache parity", "topleft_cache")
    assert res.first == {"position": 1}  # the first cached step: token 1 sees only key 0
    # a picture per failure: the cached path's measured dependency beside the intended mask
    assert res.png == str(tmp_path / "cache-parity-topleft-cache.png")
    assert (tmp_path / "cache-parity-topleft-cache.png").stat().st_size > 1000


def test_user_registered_kernels_are_discovered_and_a_clean_one_passes(llama):
    with registered("clean_sdpa"):
        usable, unavailable = implementations(llama)
        assert usable[0] == "eager" and {"sdpa", "clean_sdpa"} <= set(usable)
        assert "paged|eager" in unavailable and "flash_attention_2" in unavailable
        report = conform(llama, ["sdpa", "clean_sdpa"])
    assert failed(report) == {(ALL_ONES_PACKED, "sdpa"), (ALL_ONES_PACKED, "clean_sdpa")}
    assert report.result("implementations agree", "clean_sdpa").max_deviation == 0.0
    assert "clean_sdpa" not in implementations(llama)[0]  # unregistered again
    assert llama.config._attn_implementation == "sdpa"  # conform restored it


def test_report_dict_shape(llama):
    report = conform(llama, ["sdpa"], scenarios=["causality", ALL_ONES_PACKED])
    d = report.to_dict()
    assert d["passed"] is False and report.exit_code == 1
    assert [(r["scenario"], r["implementation"], r["passed"]) for r in d["results"]] == [
        ("causality", "sdpa", True),
        (ALL_ONES_PACKED, "sdpa", False),
    ]
    assert {"scenario", "implementation", "passed", "detail", "first", "max_deviation"} <= set(d["results"][0])
    assert "✗" in report.to_text() and "✓" in report.to_text()


def test_bad_python_arguments(llama):
    with pytest.raises(ValueError, match="unknown attention implementation 'nope'"):
        conform(llama, ["nope"])
    with pytest.raises(ValueError, match="flash_attention_2.*not available"):
        conform(llama, ["flash_attention_2"])
    with pytest.raises(ValueError, match="unknown scenarios"):
        conform(llama, ["sdpa"], scenarios=["bogus"])
    with pytest.raises(TypeError, match="PreTrainedModel"):
        conform(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------
def test_cli_json_is_the_report_dict(capsys, tmp_path):
    argv = ["conform", "llama", "--impl", "sdpa", "--scenarios", f"causality,{ALL_ONES_PACKED}", "--json"]
    assert main([*argv, "--png-dir", str(tmp_path)]) == 1
    printed = json.loads(capsys.readouterr().out)
    model, desc = load_model("llama")
    expected = conform(model, ["sdpa"], scenarios=["causality", ALL_ONES_PACKED], png_dir=tmp_path, name=desc)
    assert printed == json.loads(expected.to_json())
    png = printed["results"][1]["png"]
    assert png.endswith("packed-all-ones-mask-sdpa.png") and (tmp_path / "packed-all-ones-mask-sdpa.png").is_file()


def test_cli_table_and_exit_code_zero(capsys, tmp_path):
    rc = main(["conform", "gpt2", "--impl", "eager,sdpa", "--skip", ALL_ONES_PACKED, "--png-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "causality" in out and "✓" in out and "✗" not in out and "PASSED" in out
    assert not list(tmp_path.iterdir())  # no failure, no picture


@pytest.mark.parametrize(
    "argv, message",
    [
        (["conform", "nope"], "is not a tiny config"),
        (["conform", "/no/such/dir"], "no such checkpoint directory"),
        (["conform", "llama", "--impl", "flash_attention_2"], "not available"),
        (["conform", "llama", "--impl", "bogus"], "unknown attention implementation"),
        (["conform", "llama", "--scenarios", "bogus"], "unknown ['bogus']"),
        (["conform", "llama", "--length", "3"], "expected an int >= 8"),
    ],
)
def test_cli_bad_arguments_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


# ---------------------------------------------------------------------------------------------
# SmolLM2 (shipped GGUF), eager and sdpa, on the CPU
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_eager_and_sdpa(tmp_path):
    from attnmask.pretrained.registry import locate

    try:
        locate("smollm2")
    except (ValueError, FileNotFoundError) as e:
        pytest.skip(str(e))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the figure the docs give: 2 cores
    try:
        start = time.perf_counter()
        model, desc = load_model("smollm2")
        report = conform(model, ["eager", "sdpa"], png_dir=tmp_path, name=desc)
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    print(report.to_text(), f"\n{seconds:.1f} s")
    assert failed(report) == {(ALL_ONES_PACKED, "eager"), (ALL_ONES_PACKED, "sdpa")}, report.to_text()
    assert report.result("float64 reference", "sdpa").max_deviation < 1e-3


def test_an_implementation_that_raises_is_a_failed_verdict_not_a_crash(llama):
    """A kernel that crashes (as torch 2.13's CPU FlexAttention did on SmolLM2: an inductor
    'index out of bounds') is reported as failing every scenario it breaks; the suite goes on."""
    from transformers import AttentionInterface

    def exploding(module, query, key, value, attention_mask, **kwargs):
        raise RuntimeError("index out of bounds: 0 <= tmp20 < cur_qSplitSize\nC++ detail")

    AttentionInterface.register("exploding_test_kernel", exploding)
    try:
        report = conform(llama, ["eager", "exploding_test_kernel"], scenarios=["causality", "right padding"])
    finally:
        AttentionInterface._global_mapping.pop("exploding_test_kernel", None)
    bad = [r for r in report.results if r.implementation == "exploding_test_kernel"]
    good = [r for r in report.results if r.implementation == "eager"]
    assert bad and all(not r.passed and r.error for r in bad)
    assert all(r.passed for r in good)
    assert "raised RuntimeError: index out of bounds" in bad[0].detail and "C++ detail" not in bad[0].detail
    assert report.exit_code == 1 and "✗ error" in report.to_text()
