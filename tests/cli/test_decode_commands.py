"""``attnmask translate``, ``generate`` and ``eval`` on tiny random runs, and their one-line errors."""

from __future__ import annotations

import io
import sys
import types

import pytest
import sacrebleu

from attnmask import decode
from attnmask.cli import main
from attnmask.data.tokenizer import Tokenizer
from attnmask.train.checkpoint import save_weights
from attnmask.train.rundir import TOKENIZER, WEIGHTS, load_run, write_config
from tests.conftest import tiny_model

TEXT = "a man rides a horse. ein Mann reitet ein Pferd! two dogs play in the snow, zwei Hunde spielen im Schnee."
SENTENCES = ["a man rides", "zwei Hunde", "the snow"]


pytestmark = pytest.mark.usefixtures("one_thread")


def make_run(path, task: str):
    """A run directory as `attnmask train` writes it, holding a tiny random model."""
    tok = Tokenizer.train_chars([TEXT])
    arch = "encoder_decoder" if task == "translation" else "decoder"
    model = tiny_model(
        arch, vocab=tok.vocab_size, std=0.5, eos_bias=2.0, max_seq_len=48, lm_head_bias=True, tie_embeddings=False
    )  # rows end at different lengths
    write_config(path, task=task, model=model.config, train={}, src_tokenizer=False)
    tok.save(path / TOKENIZER)
    save_weights(path / WEIGHTS, model, {"step": "0"})
    return path


@pytest.fixture(scope="module")
def mt_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("mt"), "translation")


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("lm"), "lm")


def expected_translations(run_dir, sentences, beam=1):
    run = load_run(run_dir)
    return decode.translate(run.model, run.src_tokenizer, run.tokenizer, sentences, beam=beam)


def check_one_line_error(capsys, argv, match: str):
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and match in err[0], captured.err
    assert "Traceback" not in captured.err
    return err[0]


# ---------------------------------------------------------------------------------------------
# translate
# ---------------------------------------------------------------------------------------------
def test_translate_arguments(mt_run, capsys):
    assert main(["translate", "--run", str(mt_run), *SENTENCES]) == 0
    out = capsys.readouterr().out
    assert out == "".join(t + "\n" for t in expected_translations(mt_run, SENTENCES))


def test_translate_stdin_keeps_blank_lines(mt_run, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("a man rides\n\nthe snow\n"))
    assert main(["translate", "--run", str(mt_run), "--batch-size", "1"]) == 0
    lines = capsys.readouterr().out.split("\n")
    want = expected_translations(mt_run, ["a man rides", "the snow"])
    assert lines == [want[0], "", want[1], ""]


def test_translate_files_and_beam(mt_run, tmp_path, capsys):
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    argv = ["translate", "--run", str(mt_run), "--input", str(src), "--output", str(out), "--beam", "3"]
    assert main(argv) == 0
    assert capsys.readouterr().out == ""
    assert out.read_text(encoding="utf-8").splitlines() == expected_translations(mt_run, SENTENCES, beam=3)


def test_translate_errors(mt_run, lm_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n  \n"))
    assert check_one_line_error(capsys, ["translate", "--run", str(mt_run)], "empty input: no sentences given")
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    assert check_one_line_error(capsys, ["translate", "--run", str(mt_run), "--input", str(empty)], "has no text")
    assert check_one_line_error(capsys, ["translate", "--run", str(tmp_path / "nope"), "hi"], "not a run directory")
    assert check_one_line_error(capsys, ["translate", "--run", str(tmp_path), "hi"], "not a run directory")
    assert check_one_line_error(
        capsys, ["translate", "--run", str(mt_run), "a" * 48], "longer than the model's maximum of 48"
    )
    assert check_one_line_error(capsys, ["translate", "--run", str(lm_run), "hi"], "is a 'lm' run")
    assert check_one_line_error(capsys, ["translate", "--run", str(mt_run), "--beam", "0", "hi"], "--beam must be >= 1")
    vocab = load_run(mt_run).model.config.vocab_size
    for beam in (vocab + 1, 10**9):  # 10**9 beams once asked for a 2.5 TB KV cache
        assert check_one_line_error(
            capsys, ["translate", "--run", str(mt_run), "--beam", str(beam), "hi"], f"expected 1..{vocab}"
        )
    assert main(["translate", "--run", str(mt_run), "--beam", str(vocab), "hi"]) == 0


def test_translate_input_file_keeps_line_numbers_and_names_bad_bytes(mt_run, tmp_path, capsys, monkeypatch):
    src = tmp_path / "in.txt"
    src.write_bytes("\ufeffa man rides\r\n\r\nthe snow\n".encode())  # a BOM, CRLF and a blank line
    assert main(["translate", "--run", str(mt_run), "--input", str(src)]) == 0
    want = expected_translations(mt_run, ["a man rides", "the snow"])
    assert capsys.readouterr().out.split("\n") == [want[0], "", want[1], ""]
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("a man\ncaf\xe9\n".encode("latin-1"))
    assert check_one_line_error(
        capsys, ["translate", "--run", str(mt_run), "--input", str(latin1)], "invalid UTF-8 at line 2, byte offset 9"
    )
    assert check_one_line_error(capsys, ["translate", "--run", str(mt_run), "--input", str(tmp_path)], "Is a directory")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), encoding="utf-8"))
    assert check_one_line_error(capsys, ["translate", "--run", str(mt_run)], "stdin is not UTF-8 text")
    assert check_one_line_error(
        capsys, ["translate", "--run", str(mt_run), "a", "--length-penalty", "nan"], "--length-penalty nan: expected"
    )


# ---------------------------------------------------------------------------------------------
# eval
# ---------------------------------------------------------------------------------------------
def test_eval_prints_bleu_and_chrf(mt_run, tmp_path, capsys):
    refs = ["a man rides a horse", "two dogs", "the snow"]
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    ref.write_text("\n".join(refs) + "\n", encoding="utf-8")
    assert main(["eval", "--run", str(mt_run), "--src", str(src), "--ref", str(ref), "--beam", "2"]) == 0
    out = capsys.readouterr().out
    hyps = expected_translations(mt_run, SENTENCES, beam=2)
    assert str(sacrebleu.corpus_bleu(hyps, [refs])) in out
    assert str(sacrebleu.corpus_chrf(hyps, [refs])) in out
    assert "3 sentences, beam 2" in out


def test_eval_errors(mt_run, tmp_path, capsys):
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("one\ntwo\n", encoding="utf-8")
    ref.write_text("one\n", encoding="utf-8")
    assert check_one_line_error(
        capsys, ["eval", "--run", str(mt_run), "--src", str(src), "--ref", str(ref)], "expected aligned"
    )
    missing = str(tmp_path / "missing.txt")
    assert check_one_line_error(
        capsys, ["eval", "--run", str(mt_run), "--src", missing, "--ref", str(ref)], "No such file"
    )
    assert check_one_line_error(
        capsys, ["eval", "--run", str(tmp_path / "x"), "--src", str(src), "--ref", str(src)], "not a run"
    )
    argv = ["eval", "--run", str(mt_run), "--src", str(ref), "--ref", str(ref), "--output", str(tmp_path)]
    assert check_one_line_error(capsys, argv, f"Is a directory: '{tmp_path}'")


# ---------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------
def test_generate_streams_the_continuation(lm_run, capsys):
    argv = ["generate", "--run", str(lm_run), "--prompt", "a man", "--max-new-tokens", "20", "--seed", "3"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first  # same seed, same text
    run = load_run(lm_run)
    want = decode.generate(run.model, run.tokenizer, "a man", max_new_tokens=20, seed=3)  # same default temperature
    assert first == "a man" + want + "\n"
    assert main(["generate", "--run", str(lm_run), "--prompt", "a man", "--temperature", "0"]) == 0
    greedy = decode.generate(run.model, run.tokenizer, "a man", max_new_tokens=200, temperature=0.0)
    assert capsys.readouterr().out == "a man" + greedy + "\n"


def test_generate_penalties_are_the_engines(lm_run, capsys):
    """--repetition-penalty, --presence-penalty, --frequency-penalty: the text the serving engine gives
    with the same penalties (the decode loop and the engine choose each token from the same row), not
    the plain greedy text."""
    from attnmask.engine import Engine, Penalties, RequestParams

    run = load_run(lm_run)
    argv = ["generate", "--run", str(lm_run), "--prompt", "a man", "--temperature", "0", "--max-new-tokens", "24"]
    assert main([*argv, "--repetition-penalty", "1.5", "--presence-penalty", "0.5", "--frequency-penalty", "1"]) == 0
    got = capsys.readouterr().out
    prompt = run.tokenizer.encode("a man")
    engine = Engine(run.model, kv_cache_mib=4, eos_ids=[run.tokenizer.eos_id])
    want = engine.generate([prompt], RequestParams(max_tokens=24, penalties=Penalties(0.5, 1.0, 1.5)))[0].tokens
    want = [t for t in want if t != run.tokenizer.eos_id]
    assert got == "a man" + run.tokenizer.decode(want) + "\n"
    assert main(argv) == 0
    assert capsys.readouterr().out != got


def test_generate_structured_output_is_the_engines(lm_run, tmp_path, capsys):
    """--regex, --choice hold the text to a grammar; the text is the serving engine's answer with the same
    grammar (the decode loop and the engine mask each row the same way). This run's characters have no
    braces: JSON is a one-line error."""
    from attnmask.decode.grammar import Grammar
    from attnmask.engine import Engine, RequestParams

    run = load_run(lm_run)
    base = ["generate", "--run", str(lm_run), "--prompt", "a man", "--temperature", "0", "--max-new-tokens", "30"]
    engine = Engine(run.model, kv_cache_mib=4, eos_ids=[run.tokenizer.eos_id], tokenizer=run.tokenizer)
    prompt = run.tokenizer.encode("a man")
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], '
                      '"additionalProperties": false, "x-guidance": {"whitespace_flexible": false}}')  # fmt: skip
    cases = [(["--regex", "[a-e]{2,6} man"], Grammar.regex("[a-e]{2,6} man")),
             (["--choice", "yes", "--choice", "no"], Grammar.choice(["yes", "no"]))]  # fmt: skip
    for flags, grammar in cases:
        assert main([*base, *flags]) == 0
        got = capsys.readouterr().out
        want = engine.generate([prompt], RequestParams(max_tokens=30, grammar=grammar))[0].tokens
        text = run.tokenizer.decode([t for t in want if t != run.tokenizer.eos_id])
        assert got == "a man" + text + "\n"
    assert got in ("a manyes\n", "a manno\n")
    assert main([*base, "--json-schema", str(schema)]) == 2  # a warning names the missing characters, then the error
    err = capsys.readouterr().err.strip().splitlines()
    assert "cannot go on with this tokenizer" in err[-1] and "'{'" in err[0] and "Traceback" not in "".join(err)
    assert check_one_line_error(capsys, [*base, "--regex", "(["], "the regex grammar is not valid")
    assert check_one_line_error(capsys, [*base, "--json-schema", str(tmp_path / "nope.json")], "cannot read")


def test_generate_prints_as_tokens_arrive(lm_run, monkeypatch):
    """Each piece is written and flushed before the next token is computed."""
    writes = []

    class Spy(io.StringIO):
        def flush(self):
            writes.append(self.getvalue())

    monkeypatch.setattr(sys, "stdout", Spy())
    assert main(["generate", "--run", str(lm_run), "--prompt", "a", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    assert len(writes) >= 3 and all(a != b for a, b in zip(writes, writes[1:]))


def test_generate_errors(lm_run, mt_run, tmp_path, capsys):
    base = ["generate", "--run", str(lm_run)]
    assert check_one_line_error(
        capsys, [*base, "--prompt", "a" * 49], "prompt 1 has 49 tokens, longer than the model's maximum of 48"
    )
    assert check_one_line_error(capsys, [*base, "--prompt", ""], "empty prompt")
    assert check_one_line_error(
        capsys, ["generate", "--run", str(tmp_path / "nope"), "--prompt", "a"], "not a run directory"
    )
    assert check_one_line_error(capsys, ["generate", "--run", str(mt_run), "--prompt", "a"], "needs a language model")
    assert check_one_line_error(capsys, [*base, "--prompt", "a", "--top-p", "2"], "top_p must be in (0, 1]")
    assert check_one_line_error(
        capsys, [*base, "a", "--repetition-penalty", "0"], "repetition penalty must be a number > 0"
    )
    assert check_one_line_error(capsys, [*base, "a", "--frequency-penalty", "-2.5"], "must be a number in [-2, 2]")
    no_template = "has no chat template; give one with --chat-template"
    assert check_one_line_error(capsys, [*base, "--prompt", "a", "--chat"], no_template)


def test_generate_model_hook_applies_the_chat_template(lm_run, capsys, monkeypatch):
    run = load_run(lm_run)
    seen = []

    def chat(prompt):
        seen.append(prompt)
        return f"<{prompt}>"

    loads = []

    def load(name, quantized=False, activations="float32"):
        loads.append((name, quantized, activations))
        return run.model, run.tokenizer, chat

    fake = types.ModuleType("attnmask.pretrained")
    fake.load = load
    monkeypatch.setitem(sys.modules, "attnmask.pretrained", fake)
    argv = ["generate", "--model", "tiny", "a man", "--temperature", "0", "--max-new-tokens", "5"]
    assert main([*argv, "--chat"]) == 0
    want = decode.generate(run.model, run.tokenizer, "<a man>", max_new_tokens=5, temperature=0.0)
    assert seen == ["a man"] and capsys.readouterr().out == want + "\n"  # a chat reply: no echoed prompt
    # without --chat the prompt is continued as it is, and echoed first
    assert main(argv) == 0
    plain = decode.generate(run.model, run.tokenizer, "a man", max_new_tokens=5, temperature=0.0)
    assert seen == ["a man"] and capsys.readouterr().out == "a man" + plain + "\n"
    # --quantized asks the loader for the file's blocks
    assert main([*argv, "--quantized"]) == 0
    assert loads == [("tiny", False, "float32"), ("tiny", False, "float32"), ("tiny", True, "float32")]
    assert capsys.readouterr().out == "a man" + plain + "\n"
    # --activations int8 reaches the loader with the blocks
    assert main([*argv, "--quantized", "--activations", "int8"]) == 0
    assert loads[-1] == ("tiny", True, "int8")


def test_generate_quantized_errors(lm_run, capsys, monkeypatch):
    assert check_one_line_error(
        capsys, ["generate", "--run", str(lm_run), "a", "--quantized"], "--quantized applies to --model"
    )
    assert check_one_line_error(
        capsys, ["generate", "--model", "smollm2", "a", "--activations", "int8"], "a setting of the quantized blocks"
    )
    from attnmask.cli.common import ACTIVATIONS
    from attnmask.pretrained.quantized import ACTIVATIONS as LAYER_ACTIVATIONS

    assert ACTIVATIONS == LAYER_ACTIVATIONS  # the CLI names the layer's settings without importing it
    import attnmask.cli.generate

    monkeypatch.setattr(attnmask.cli.generate, "check_args", lambda args: None)  # as on a machine with CUDA
    assert check_one_line_error(
        capsys, ["generate", "--model", "smollm2", "a", "--quantized", "--device", "cuda"], "runs on the CPU"
    )


def test_generate_prompt_given_twice_is_one_line_error(lm_run, capsys):
    assert main(["generate", "--run", str(lm_run), "hello", "--prompt", "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give the prompt once" in err[0]
