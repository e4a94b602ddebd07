"""Pictures: mask grids, audited dependencies, recorded attention weights and the attention CLI."""

import pytest
import torch

from attnmask import masks
from attnmask.audit.faults import tiny_model
from attnmask.cli import main
from attnmask.viz import (
    mask_grid,
    record_attention,
    save_attention_png,
    save_dependency_png,
    save_mask_png,
)

PNG = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_thread")


def test_mask_grid_is_seed_000_look_ahead():
    grid = mask_grid(masks.causal().to_bool(1, 3, 3)[0, 0], ["I", "am", "good"])
    rows = [line.split("│")[1].split() for line in grid.splitlines()[2:]]
    assert rows == [["0", "-∞", "-∞"], ["0", "0", "-∞"], ["0", "0", "0"]]
    with pytest.raises(ValueError, match="2 query and 2 key labels for a mask of shape"):
        mask_grid(torch.ones(3, 3, dtype=torch.bool), ["a", "b"])


def test_save_mask_png(tmp_path):
    path = save_mask_png(tmp_path / "m.png", [("causal", masks.causal().to_bool(1, 2, 2)[0, 0])], ["a", "b"])
    assert path.read_bytes()[:8] == PNG


# ---------------------------------------------------------------------------------------------
# Recording attention weights
# ---------------------------------------------------------------------------------------------
def test_record_attention_gives_the_masked_weights_and_changes_nothing():
    model = tiny_model("encoder_decoder")
    src = torch.tensor([[5, 6, 7, 8, 0, 0]])  # two source pads
    tgt = torch.tensor([[1, 9, 10, 11, 0]])  # one target pad
    with torch.no_grad():
        plain = model(tgt, src).logits
        with record_attention(model) as rec:
            recorded = model(tgt, src).logits
    torch.testing.assert_close(recorded, plain)
    assert [len(rec[k]) for k in ("encoder", "decoder", "cross")] == [2, 2, 2]
    assert tuple(rec["encoder"][0].shape) == (1, 4, 6, 6)
    assert tuple(rec["decoder"][0].shape) == (1, 4, 5, 5)
    assert tuple(rec["cross"][0].shape) == (1, 4, 5, 6)
    dec = rec["decoder"][1][0]  # (H, T, T)
    allowed = model.target_mask(tgt).to_bool(1, 5, 5)[0, 0]
    torch.testing.assert_close(dec[:, ~allowed], torch.zeros(4, int((~allowed).sum())))  # nothing masked is seen
    torch.testing.assert_close(dec.sum(-1), torch.ones(4, 5))  # every row has a real key here
    cross = rec["cross"][0][0]
    torch.testing.assert_close(cross[..., 4:], torch.zeros(4, 5, 2))  # source pads get no weight
    # restored: the class's forward and the configured kernel
    attn = model.layers[0].self_attn
    assert "forward" not in vars(attn) and attn.backend == "auto"


def test_record_attention_restores_on_error():
    model = tiny_model("decoder")
    with pytest.raises(RuntimeError, match="boom"), record_attention(model):
        raise RuntimeError("boom")
    assert all("forward" not in vars(layer.self_attn) for layer in model.layers)


def test_record_attention_with_the_sdpa_kernel():
    model = tiny_model("decoder")
    for layer in model.layers:
        layer.self_attn.backend = "sdpa"  # cannot return weights: recording switches kernels
    ids = torch.tensor([[4, 5, 6]])
    with torch.no_grad(), record_attention(model) as rec:
        model(ids)
    assert len(rec["decoder"]) == 2
    assert model.layers[0].self_attn.backend == "sdpa"


def test_save_attention_png(tmp_path):
    w = torch.rand(2, 3, 4, 4).softmax(-1)  # (L, H, T, T)
    labels = ["a", "b", "c", "d"]
    mask = masks.causal().to_bool(1, 4, 4)[0, 0]
    path = save_attention_png(tmp_path / "x" / "att.png", list(w), labels, labels, mask=mask, title="t")
    assert path.read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match=r"layer 0 weights have shape \(3, 4, 4\), expected \(H, Tq=4, Tk=3\)"):
        save_attention_png(tmp_path / "bad.png", list(w), labels, labels[:3])
    with pytest.raises(ValueError, match="no attention weights"):
        save_attention_png(tmp_path / "bad.png", [], labels, labels)


def test_save_dependency_png(tmp_path):
    intended = torch.ones(4, 4, dtype=torch.bool).tril()
    measured = torch.rand(4, 4) * intended
    path = save_dependency_png(tmp_path / "d.png", intended, [("perturbation", measured)], leaks=[(0, 1)], title="t")
    assert path.read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match=r"measured matrix 'g' has shape \(3, 3\), expected \(4, 4\)"):
        save_dependency_png(tmp_path / "d.png", intended, [("g", torch.zeros(3, 3))])


# ---------------------------------------------------------------------------------------------
# attnmask attention --run DIR "sentence"
# ---------------------------------------------------------------------------------------------
def make_run(path, task: str):
    from attnmask.data.tokenizer import Tokenizer
    from attnmask.train.checkpoint import save_weights
    from attnmask.train.rundir import TOKENIZER, WEIGHTS, write_config

    tok = Tokenizer.train_chars(["hello world", "the cat sat"])
    arch = "encoder_decoder" if task == "translation" else "decoder"
    model = tiny_model(arch, vocab_size=tok.vocab_size)
    tok.save(path / TOKENIZER)
    write_config(path, task=task, model=model.config, train={}, src_tokenizer=False)
    save_weights(path / WEIGHTS, model, metadata={"step": "1"})
    return path


def test_attention_cli_translation(tmp_path, capsys):
    run = make_run(tmp_path / "run", "translation")
    out = tmp_path / "pics"
    argv = ["attention", "--run", str(run), "hello cat", "--out", str(out), "--max-new-tokens", "5", "--max-heads", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("translation: ")
    for name in ("encoder_self", "decoder_self", "cross"):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG
        assert f"wrote {out / name}.png" in printed


def test_attention_cli_language_model(tmp_path, capsys):
    run = make_run(tmp_path / "run", "lm")
    out = tmp_path / "pics"
    assert main(["attention", "--run", str(run), "the cat", "--out", str(out), "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("continuation: ")
    assert sorted(p.name for p in out.iterdir()) == ["decoder_self.png"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["attention", "--run", "/nonexistent", "hi"], "not a run directory"),
        (["attention", "--run", "RUN", "   "], "the sentence is empty"),
        (["attention", "--run", "RUN", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ],
)
def test_attention_cli_user_errors(tmp_path, capsys, argv, message):
    run = make_run(tmp_path, "lm")
    argv = [str(run) if a == "RUN" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


# ---------------------------------------------------------------------------------------------
# Size caps: long sequences give bounded pictures (downsampled), not a 24 GiB figure
# ---------------------------------------------------------------------------------------------
def png_size(path) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG header."""
    data = path.read_bytes()
    assert data[:8] == PNG
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_long_mask_picture_is_capped(tmp_path):
    T = 150  # drawn cell by cell before the cap: an 11,000 x 33,000 px figure
    labels = [f"t{i}" for i in range(T)]
    causal = masks.causal().to_bool(1, T, T)[0, 0]
    grids = [("causal", causal), ("window", masks.sliding_window(8).to_bool(1, T, T)[0, 0]), ("all", causal | True)]
    width, height = png_size(save_mask_png(tmp_path / "m.png", grids, labels))
    assert max(width, height) <= 6000 and min(width, height) >= 200


def test_attention_picture_of_a_long_sequence_is_downsampled_and_capped(tmp_path):
    T = 300  # > 256 cells per axis: averaged in blocks
    w = torch.rand(1, 2, T, T).softmax(-1)  # (L, H, T, T)
    labels = [f"w{i}" for i in range(T)]
    mask = masks.causal().to_bool(1, T, T)[0, 0]
    width, height = png_size(save_attention_png(tmp_path / "a.png", list(w), labels, labels, mask=mask))
    assert max(width, height) <= 6000


def test_attention_picture_with_too_many_panels_is_refused(tmp_path):
    w = torch.rand(40, 40, 3, 3).softmax(-1)  # 40 layers x 40 heads
    with pytest.raises(ValueError, match="panels do not fit a readable picture"):
        save_attention_png(tmp_path / "a.png", list(w), list("abc"), list("abc"))
    assert not (tmp_path / "a.png").exists()


def test_dependency_picture_of_a_long_sequence_keeps_leaks_visible(tmp_path):
    T = 600
    intended = torch.ones(T, T, dtype=torch.bool).tril()
    measured = torch.zeros(T, T)
    measured[5, 590] = 1.0  # one leak, far above the diagonal
    path = save_dependency_png(tmp_path / "d.png", intended, [("perturbation", measured)], leaks=[(5, 590)])
    assert max(png_size(path)) <= 6000


def test_pooled_max_keeps_a_single_leak():
    from attnmask.viz import _pooled

    m = torch.zeros(600, 600)
    m[5, 590] = 1.0
    pooled, sq, sk = _pooled(m)
    assert (sq, sk) == (3, 3) and tuple(pooled.shape) == (200, 200)
    torch.testing.assert_close(pooled[1, 196], torch.tensor(1 / 9, dtype=torch.float64))  # block mean
    assert int((pooled > 0).sum()) == 1


def _columns(line: str) -> int:
    """Terminal columns of ``line``, counted independently of attnmask.viz."""
    import unicodedata

    return sum(
        0 if unicodedata.category(c) in ("Mn", "Me", "Cf") else 2 if unicodedata.east_asian_width(c) in "WF" else 1
        for c in line
    )


def test_mask_grid_aligns_wide_labels():
    labels = ["🙂", "日本", "a", "dog"]
    grid = mask_grid(masks.causal().to_bool(1, 4, 4)[0, 0], labels)
    lines = grid.splitlines()
    assert len({_columns(line) for line in lines}) == 1, grid  # every row as wide as the header
    bar = {_columns(line.split("│")[0]) for line in lines if "│" in line}
    assert len(bar) == 1, grid  # the separator in one column


def test_mask_grid_refuses_a_grid_too_wide_to_read():
    T = 500
    with pytest.raises(ValueError, match=r"text grid of \(500, 500\) tokens is too wide to read"):
        mask_grid(torch.ones(T, T, dtype=torch.bool), [str(i) for i in range(T)])


def test_a_failed_write_leaves_no_half_picture(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    def full_disk(self, path, **kwargs):
        with open(path, "wb") as f:
            f.write(PNG)  # a few bytes, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_mask_png(tmp_path / "m.png", [("causal", masks.causal().to_bool(1, 2, 2)[0, 0])], ["a", "b"])
    assert not (tmp_path / "m.png").exists()
