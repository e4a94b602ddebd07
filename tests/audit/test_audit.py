"""The audit catches each kind of leak, names the first leaking pair exactly, and passes clean models."""

import json

import pytest
import torch

from attnmask import masks
from attnmask.audit import CHECKS, Subject, Tolerance, audit, from_callable
from attnmask.audit.faults import FAULTS, inject, tiny_model
from attnmask.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


T = 10


def statuses(report) -> dict[str, str]:
    return {c.name: c.status for c in report.checks}


def pairs(report, check: str) -> set[tuple[int, int | None]]:
    return {(lk.i, lk.j) for lk in report.check(check).leaks}


def first(report) -> tuple:
    lk = report.first_leak
    return (lk.check, lk.i, lk.j, lk.context) if lk else None


FUTURE = {(i, j) for i in range(T) for j in range(T) if j > i}


# ---------------------------------------------------------------------------------------------
# Clean models pass
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "arch, positions",
    [("decoder", "sinusoidal"), ("decoder", "rotary"), ("encoder_decoder", "learned"), ("encoder_decoder", "rotary")],
)
def test_clean_attnmask_models_pass_every_check(arch, positions):
    report = audit(tiny_model(arch, positions=positions), length=T, src_length=8)
    expected = [c for c in CHECKS if arch == "encoder_decoder" or c != "source padding"]
    assert [c.name for c in report.checks] == expected
    assert statuses(report) == dict.fromkeys(expected, "PASS")
    assert report.passed and report.exit_code == 0
    assert report.leaks == [] and report.first_leak is None
    # the measured dependency matrix *is* the look-ahead mask: every allowed pair used, no other
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert bool((report.dependency[causal] > 0).all())
    torch.testing.assert_close(report.dependency[~causal], torch.zeros(int((~causal).sum())))
    torch.testing.assert_close(report.gradient[~causal], torch.zeros(int((~causal).sum())))


def test_source_padding_amount_is_checked_on_the_sides_the_encoder_supports():
    learned = audit(
        tiny_model("encoder_decoder", positions="learned"), length=6, src_length=6, checks=["source padding"]
    )
    details = " ".join(learned.check("source padding").details)
    assert "source left padding x1: (amount not checked" in details
    assert "source right padding x1: amount and" in details
    rotary = audit(tiny_model("encoder_decoder", positions="rotary"), length=6, src_length=6, checks=["source padding"])
    assert "not checked" not in " ".join(rotary.check("source padding").details)


# ---------------------------------------------------------------------------------------------
# Each broken model is caught, and the first leak is named exactly
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_bidirectional_decoder(arch):
    report = audit(inject(tiny_model(arch), "bidirectional"), length=T, src_length=8)
    assert first(report) == ("causality", 0, 1, "")
    assert pairs(report, "causality") == FUTURE  # every future pair, nothing else
    assert pairs(report, "gradient") == FUTURE
    assert statuses(report)["padding"] == "PASS"  # its key padding is intact
    assert statuses(report)["cache parity"] == "FAIL"  # training and cached decoding disagree
    assert report.exit_code == 1


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_off_by_one_look_ahead(arch):
    report = audit(inject(tiny_model(arch), "off_by_one"), length=T, src_length=8)
    assert first(report) == ("causality", 0, 1, "")
    # j <= i + 1 in each of the 2 layers: output i reaches token i + 2 through token i + 1
    reach = {(i, j) for i in range(T) for j in range(i + 1, min(i + 3, T))}
    assert pairs(report, "gradient") == reach
    causal_pairs = pairs(report, "causality")
    assert {(i, i + 1) for i in range(T - 1)} <= causal_pairs <= reach
    assert not report.passed


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_padding_that_leaks_into_real_tokens(arch):
    report = audit(inject(tiny_model(arch), "padding"), length=T, src_length=8)
    # look-ahead intact; the first real token after one left pad sees it
    assert statuses(report)["causality"] == "PASS" and statuses(report)["gradient"] == "PASS"
    assert first(report) == ("padding", 1, 0, "left padding x1")
    leaks = report.check("padding").leaks
    # right pads hide behind the look-ahead mask; every leak is a real token seeing an earlier pad
    assert all(lk.context.startswith("left") for lk in leaks)
    assert all(lk.j is None or lk.j < lk.i for lk in leaks)
    x3 = {(lk.i, lk.j) for lk in leaks if lk.context == "left padding x3"}
    assert {(i, j) for i in range(3, T) for j in range(3)} <= x3


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_cumulative_sum_over_the_future(arch):
    report = audit(inject(tiny_model(arch), "cumsum"), length=T, src_length=8)
    assert first(report) == ("causality", 0, 1, "")
    assert pairs(report, "gradient") == FUTURE  # a suffix sum reaches every later token
    assert pairs(report, "causality") == FUTURE
    # it also sums the right pads into the real tokens before them
    assert (0, T - 1) in pairs(report, "padding")


def test_source_padding_leak():
    report = audit(inject(tiny_model("encoder_decoder"), "source_padding"), length=T, src_length=8)
    assert [c.name for c in report.checks if not c.passed] == ["source padding"]
    assert first(report) == ("source padding", 0, 0, "source left padding x1")
    right = {(lk.i, lk.j) for lk in report.check("source padding").leaks if lk.context == "source right padding x1"}
    assert {(i, 7) for i in range(T)} | {(i, None) for i in range(T)} == right


def test_source_fault_needs_an_encoder():
    with pytest.raises(ValueError, match="encoder-decoder"):
        inject(tiny_model("decoder"), "source_padding")
    with pytest.raises(ValueError, match="unknown fault 'nope'"):
        inject(tiny_model("decoder"), "nope")
    assert set(FAULTS) == {"bidirectional", "off_by_one", "padding", "cumsum", "source_padding"}


def test_intended_mask_other_than_causal():
    # a causal model audited against a sliding window of 3: it uses tokens the window blocks
    report = audit(tiny_model("decoder"), length=8, intended=masks.sliding_window(3), checks=["causality", "gradient"])
    expected = {(i, j) for i in range(8) for j in range(i - 2)}
    assert pairs(report, "causality") == expected
    assert pairs(report, "gradient") == expected
    assert first(report) == ("causality", 3, 0, "")


def test_over_masking_is_noted_but_not_a_leak():
    class OnlyItself(type(tiny_model())):
        def target_mask(self, ids):  # a window of 1: nothing leaks, but no context is used either
            return masks.sliding_window(1) & masks.padding(token_ids=ids, pad_id=0)

    model = tiny_model()
    model.__class__ = OnlyItself
    report = audit(model, length=6, checks=["causality"])
    assert report.passed
    assert any("15 allowed (i, j) pairs showed no dependence" in n for n in report.notes)
    assert report.dependency_grid().splitlines()[3].split("│")[1].split() == ["○", "■", "·", "·", "·", "·"]


# ---------------------------------------------------------------------------------------------
# Any model: plain callables and Hugging Face decoders
# ---------------------------------------------------------------------------------------------
V = 11


def bag_of_words(reverse: bool = False):
    """A causal model with no attention at all: logits_i = W · (count of each id in 0..i)."""
    w = torch.randn(V, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def forward(ids, attention_mask=None):
        onehot = torch.nn.functional.one_hot(ids, V).double()  # (B, T, V)
        if attention_mask is not None:
            onehot = onehot * attention_mask[..., None]
        counts = onehot.flip(1).cumsum(1).flip(1) if reverse else onehot.cumsum(1)  # (B, T, V)
        return counts @ w  # (B, T, V)

    return forward


def test_callable_decoder_passes_and_its_reverse_fails():
    report = audit(bag_of_words(), vocab_size=V, length=T)
    assert report.passed
    assert statuses(report) == {
        "causality": "PASS",
        "gradient": "SKIP",  # ids only: nothing to differentiate
        "padding": "PASS",
        "cache parity": "SKIP",
        "fully padded rows": "PASS",
    }
    assert report.dtype == "float64"  # taken from the logits: it picks the tolerance
    bad = audit(from_callable(bag_of_words(reverse=True), vocab_size=V, dtype=torch.float32), length=T)
    assert bad.dtype == "float32"
    assert first(bad) == ("causality", 0, 1, "")
    assert pairs(bad, "causality") == FUTURE


def test_callable_encoder_decoder_source_mask_ignored():
    w = torch.randn(V, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def make(honour_src_mask: bool):
        def forward(src, src_mask, tgt, tgt_mask):
            s = torch.nn.functional.one_hot(src, V).double()  # (B, S, V)
            if honour_src_mask:
                s = s * src_mask[..., None]
            t = torch.nn.functional.one_hot(tgt, V).double() * tgt_mask[..., None]  # (B, T, V)
            return (t.cumsum(1) + s.sum(1, keepdim=True)) @ w  # (B, T, V)

        return forward

    good = audit(make(True), vocab_size=V, encoder_decoder=True, length=6, src_length=5, pad_amounts=(2,))
    assert good.passed, good.to_text()
    bad = audit(make(False), vocab_size=V, encoder_decoder=True, length=6, src_length=5, pad_amounts=(2,))
    assert [c.name for c in bad.checks if not c.passed] == ["source padding"]
    # pads written with pad_id 0 still count as tokens: the amount of padding changes every output
    assert first(bad) == ("source padding", 0, 0, "source left padding x2")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_decoder_built_locally_passes(kind):
    pytest.importorskip("transformers")
    from attnmask.cli.audit import hf_model

    report = audit(hf_model(kind, seed=0), length=T)
    assert statuses(report) == {
        "causality": "PASS",
        "gradient": "PASS",
        "padding": "PASS",
        "cache parity": "PASS",
        "fully padded rows": "PASS",
    }
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert bool((report.dependency[causal] > 0).all())


def test_hugging_face_encoder_decoder_passes():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MarianConfig(
        vocab_size=64,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        pad_token_id=0,
        decoder_start_token_id=0,
    )
    report = audit(transformers.MarianMTModel(cfg), length=8, src_length=6)
    assert statuses(report) == {
        "causality": "PASS",
        "gradient": "PASS",
        "padding": "PASS",
        "source padding": "PASS",
        "cache parity": "SKIP",
        "fully padded rows": "PASS",
    }


def test_hugging_face_decoder_with_a_broken_mask_is_caught():
    pytest.importorskip("transformers")
    from attnmask.audit import from_hf
    from attnmask.cli.audit import hf_model

    model = hf_model("gpt2", seed=0)
    subject = from_hf(model)
    # the classic bug: a 4-D mask that blocks nothing, handed to the model, makes it bidirectional
    attend_all = torch.zeros(1, 1, T, T)  # additive: 0 everywhere = attend everywhere

    def forward(ids, attention_mask=None):
        return model(input_ids=ids, attention_mask=attend_all.expand(len(ids), 1, T, T)).logits

    broken = Subject(forward=forward, vocab_size=subject.vocab_size, name="gpt2 with an all-ones 4-D mask")
    report = audit(broken, length=T, checks=["causality"])
    if report.passed:  # this transformers version refuses custom 4-D masks in eager/sdpa: nothing to test
        pytest.skip("transformers ignored the custom 4-D mask")
    assert first(report) == ("causality", 0, 1, "")


# ---------------------------------------------------------------------------------------------
# The report: text, JSON, PNG; determinism; errors
# ---------------------------------------------------------------------------------------------
def test_report_outputs(tmp_path):
    report = audit(inject(tiny_model(), "off_by_one"), length=6)
    text = report.to_text()
    assert "first leak: [causality] (i=0, j=1): output 0 changes when token 1 is replaced" in text
    assert "FAIL  causality" in text and text.rstrip().endswith("FAILED")
    data = json.loads(report.to_json())
    assert data["passed"] is False
    assert (data["first_leak"]["i"], data["first_leak"]["j"]) == (0, 1)
    assert data["intended"][0] == [1, 0, 0, 0, 0, 0]
    assert data["checks"][0]["name"] == "causality" and data["checks"][0]["status"] == "FAIL"
    png = report.save_png(tmp_path / "dep.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    grid = report.dependency_grid().splitlines()
    assert grid[2].split("│")[1].split() == ["■", "✗", "✗", "·", "·", "·"]


def test_same_seed_same_report():
    a = audit(inject(tiny_model(), "cumsum"), length=6, seed=3).to_dict()
    b = audit(inject(tiny_model(), "cumsum"), length=6, seed=3).to_dict()
    assert a == b


def test_tolerance_is_scaled_by_the_row():
    tol = Tolerance.for_dtype(torch.float32)
    assert (tol.rtol, tol.atol) == (1.3e-6, 1e-5)
    ref = torch.tensor([[100.0, 0.0]])
    # 1e-4 on a logit of 0 is rounding noise next to a logit of 100 (tolerance 1e-5 + 1.3e-4)
    assert float(tol.ratio(torch.tensor([[0.0, 1e-4]]), ref).max()) < 1
    assert float(tol.ratio(torch.tensor([[0.0, 1e-3]]), ref).max()) > 1
    assert float(tol.ratio(torch.tensor([[float("nan"), 0.0]]), ref).max()) == float("inf")
    assert Tolerance.for_dtype(torch.float64).rtol == 1e-7


def test_usage_errors():
    with pytest.raises(ValueError, match="vocab_size="):
        audit(bag_of_words())
    with pytest.raises(ValueError, match="unknown audit checks"):
        audit(tiny_model(), checks=["causality", "speed"])
    with pytest.raises(ValueError, match="exceeds the model's longest sequence 64"):
        audit(tiny_model(), length=65)
    with pytest.raises(TypeError, match="cannot audit a int"):
        audit(3)
    with pytest.raises(ValueError, match=r"the model returned \(1, 4\), expected logits \(B=1, T=4, V\)"):
        audit(lambda ids, m=None: ids.float(), vocab_size=5, length=4)


# ---------------------------------------------------------------------------------------------
# The CLI: a CI gate
# ---------------------------------------------------------------------------------------------
def test_cli_exit_codes_and_json(capsys, tmp_path):
    assert main(["audit", "--tiny", "decoder", "--length", "6"]) == 0
    assert "PASSED: no leak found" in capsys.readouterr().out
    png = tmp_path / "a.png"
    code = main(["audit", "--tiny", "decoder", "--inject", "off_by_one", "--length", "6", "--json", "--png", str(png)])
    assert code == 1
    data = json.loads(capsys.readouterr().out)
    assert (data["first_leak"]["check"], data["first_leak"]["i"], data["first_leak"]["j"]) == ("causality", 0, 1)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_audits_a_run_directory(capsys, tmp_path):
    from attnmask.data.tokenizer import Tokenizer
    from attnmask.train.checkpoint import save_weights
    from attnmask.train.rundir import TOKENIZER, WEIGHTS, write_config

    tok = Tokenizer.train_chars(["abc def"])
    model = tiny_model("encoder_decoder", vocab_size=tok.vocab_size)
    tok.save(tmp_path / TOKENIZER)
    write_config(tmp_path, task="translation", model=model.config, train={}, src_tokenizer=False)
    save_weights(tmp_path / WEIGHTS, model, metadata={"step": "1"})
    assert main(["audit", "--run", str(tmp_path), "--length", "6", "--src-length", "5", "--pad", "2"]) == 0
    out = capsys.readouterr().out
    assert f"attnmask audit: run {tmp_path} (translation, encoder_decoder)" in out
    assert "PASS  source padding" in out


def test_cli_hf_config(capsys):
    pytest.importorskip("transformers")
    assert main(["audit", "--hf-config", "llama", "--length", "6"]) == 0
    assert "Hugging Face LlamaForCausalLM (llama, random)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["audit", "--tiny", "decoder", "--pad", "0"], "--pad '0': expected comma-separated ints >= 1"),
        (["audit", "--run", "/nonexistent/run"], "not a run directory"),
        (["audit", "--hf-config", "gpt2", "--inject", "padding"], "--inject breaks attnmask models only"),
        (["audit", "--tiny", "decoder", "--length", "1"], "audit length must be an int >= 2"),
    ],
)
def test_cli_user_errors_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
