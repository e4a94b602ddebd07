"""Decoding: greedy exactly as seed 000, batches where each row stops at its own <eos>, left-padded
prompts, sampling, beam search, streaming, and the text-level translate/generate."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from attnmask import decode, masks
from attnmask.data import make_translation_batch
from attnmask.data.tokenizer import EOS_ID, SOS_ID, Tokenizer
from attnmask.decode.beam import beam_search, best_tokens
from attnmask.decode.sampling import filter_logits, sample
from attnmask.model import ModelConfig, Transformer
from tests.conftest import tiny_model

KINDS = ["decoder", "encoder_decoder"]
INPUTS = [[5, 6, 7, 8, 9], [10, 11], [4, 5, 6], [7], [8, 9, 10, 11, 4, 5]]  # prompts or sources


pytestmark = pytest.mark.usefixtures("one_thread")


def random_model(
    arch: str, *, vocab: int = 12, seed: int = 0, std: float = 0.5, eos_bias: float = 1.0, **kw
) -> Transformer:
    """Random weights large enough that the arg-max depends on the whole prefix, and a bias on
    <eos> so that rows end at different steps."""
    return tiny_model(
        arch, vocab=vocab, seed=seed, std=std, eos_bias=eos_bias, max_seq_len=64, lm_head_bias=True,
        tie_embeddings=False, **kw,
    )  # fmt: skip


def inputs_of(model, rows):
    return {"src": rows} if model.is_encoder_decoder else {"prompts": rows}


# ---------------------------------------------------------------------------------------------
# Seed 000's greedy decoding, written out without a cache: the reference
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def seed_greedy(model, row: list[int], max_new: int) -> list[int]:
    """From <sos> (or the prompt): run the whole sequence, arg-max of the last logits, append,
    stop at <eos> or after max_new tokens. Every fed token is real, even a generated <pad>, so the
    mask is the look-ahead mask alone."""
    memory = None
    if model.is_encoder_decoder:
        memory = model.encode(torch.tensor([row]))
        ids = torch.tensor([[SOS_ID]])
    else:
        ids = torch.tensor([row])
    out = []
    for _ in range(max_new):
        token = int(model.decode(ids, memory, mask=masks.causal())[0, -1].argmax())
        if token == EOS_ID:
            break
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


@pytest.mark.parametrize("arch", KINDS)
@pytest.mark.parametrize("seed", [1, 2])
def test_greedy_is_seed_000_greedy(arch, seed):
    model = random_model(arch, seed=seed)
    got = decode.greedy(model, **inputs_of(model, INPUTS), max_new_tokens=25)
    want = [seed_greedy(model, row, 25) for row in INPUTS]
    assert got == want
    assert any(len(g) < 25 for g in got)  # some row met <eos>: the stopping rule was exercised


@pytest.mark.parametrize("arch", KINDS)
def test_greedy_batched_equals_one_by_one(arch):
    model = random_model(arch, seed=3)
    batched = decode.greedy(model, **inputs_of(model, INPUTS), max_new_tokens=30)
    alone = [decode.greedy(model, **inputs_of(model, [row]), max_new_tokens=30)[0] for row in INPUTS]
    assert batched == alone


def test_left_padded_prompt_decodes_as_alone_with_every_position_kind():
    for positions in ("sinusoidal", "learned", "rotary"):
        model = random_model("decoder", seed=4, positions=positions)
        batched = decode.greedy(model, prompts=INPUTS, max_new_tokens=20)
        alone = [seed_greedy(model, row, 20) for row in INPUTS]
        assert batched == alone, positions


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_rmsnorm_swiglu_decoders_without_rotary_decode_as_seed_000_fused_or_not(positions):
    from attnmask.decode.step import fused_plan
    from attnmask.model import fuse_projections_
    from attnmask.ops import available

    kw = dict(positions=positions, norm="rmsnorm", activation="swiglu", n_kv_heads=2)
    for fused in (False, True):
        model = random_model("decoder", seed=5, **kw)
        if fused:
            fuse_projections_(model)
            assert (fused_plan(model) is not None) == available()  # the one native call, where it is built
        got = decode.greedy(model, prompts=INPUTS, max_new_tokens=15)
        assert got == [seed_greedy(model, row, 15) for row in INPUTS], (positions, fused)


# ---------------------------------------------------------------------------------------------
# Models whose <eos> steps are known
# ---------------------------------------------------------------------------------------------
def chain_lm(vocab: int = 24, last: int = 20) -> Transformer:
    """Decoder-only: every block's output zeroed, one-hot embeddings, so the logits depend on the
    current token only: t -> t + 1 for 4 <= t < last, and last -> <eos>."""
    cfg = ModelConfig(
        vocab_size=vocab, dim=vocab, n_layers=1, n_heads=4, max_seq_len=64, positions="learned",
        final_norm=False, tie_embeddings=False,
    )  # fmt: skip
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (
                name.endswith(("o_proj.weight", "o_proj.bias", "down_proj.weight", "down_proj.bias"))
                or "pos_embed" in name
            ):
                p.zero_()
        model.embed.weight.copy_(torch.eye(vocab))
        W = torch.zeros(vocab, vocab)
        for t in range(4, last):
            W[t + 1, t] = 10.0
        W[EOS_ID, last] = 10.0
        model.lm_head.weight.copy_(W)
    return model


def chain_translator(vocab: int = 24, src_vocab: int = 16) -> Transformer:
    """Encoder-decoder whose output is <sos> -> 4 -> 5 -> ... and whose <eos> comes later for
    smaller source tokens: fed token t with source token 4 + s predicts <eos> once t - 4 + s + 0.5 > 10,
    i.e. the output is 4 .. 14 - s (11 - s tokens). Blocks are zeroed except cross-attention, which
    copies the (single) source token's one-hot embedding into the residual stream."""
    dim = vocab + src_vocab
    cfg = ModelConfig(
        vocab_size=vocab, src_vocab_size=src_vocab, arch="encoder_decoder", dim=dim, n_layers=1, n_heads=4,
        max_seq_len=64, positions="learned", final_norm=False, tie_embeddings=False,
    )  # fmt: skip
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            zero = name.endswith(("o_proj.weight", "o_proj.bias", "down_proj.weight", "down_proj.bias"))
            if zero or "pos_embed" in name or "k_proj" in name:  # k = 0: uniform attention over the source
                p.zero_()
        model.embed.weight.copy_(torch.eye(vocab, dim))
        model.src_embed.weight.copy_(torch.eye(dim)[vocab:])  # source token s -> one-hot at vocab + s
        cross = model.layers[0].cross_attn
        cross.v_proj.weight.copy_(torch.eye(dim))
        cross.o_proj.weight.copy_(torch.eye(dim))
        W = torch.zeros(vocab, dim)
        W[4, SOS_ID] = 10.0
        for t in range(4, vocab - 1):
            W[t + 1, t] = 10.0
            W[EOS_ID, t] = t - 4.0
        for s in range(src_vocab - 4):
            W[EOS_ID, vocab + 4 + s] = s + 0.5
        model.lm_head.weight.copy_(W)
    return model


def test_every_row_stops_at_its_own_eos_decoder_only():
    model = chain_lm()
    prompts = [[5], [7, 8, 9], [4, 12], [19]]
    want = [list(range(6, 21)), list(range(10, 21)), list(range(13, 21)), [20]]
    assert decode.greedy(model, prompts=prompts, max_new_tokens=40) == want
    steps = torch.stack(list(decode.stream(model, prompts=prompts, max_new_tokens=40)), dim=1)  # (B, steps)
    assert steps.shape == (4, 16)  # the longest row: 15 tokens and <eos>
    for row, w in zip(steps.tolist(), want):
        n = len(w)
        assert row[:n] == w and row[n] == EOS_ID and set(row[n + 1 :]) <= {0}  # then <pad>


def test_every_row_stops_at_its_own_eos_encoder_decoder():
    model = chain_translator()
    src = [[4 + s] for s in (1, 7, 3, 5)]
    want = [list(range(4, 15 - s)) for s in (1, 7, 3, 5)]  # 10, 4, 8, 6 tokens
    assert decode.greedy(model, src=src, max_new_tokens=40) == want
    steps = torch.stack(list(decode.stream(model, src=src, max_new_tokens=40)), dim=1)  # (B, steps)
    for row, w in zip(steps.tolist(), want):
        assert row[: len(w) + 1] == w + [EOS_ID] and set(row[len(w) + 1 :]) <= {0}
    for K in (1, 2, 3):
        assert best_tokens(beam_search(model, src=src, beam_size=K, max_new_tokens=40)) == want


def test_finished_rows_leave_the_batch():
    model = chain_lm()
    sizes = []  # rows through the prediction head: the prefill, then every step
    model.lm_head.register_forward_hook(lambda module, args, out: sizes.append(args[0].shape[0]))
    decode.greedy(model, prompts=[[5], [19], [17]], max_new_tokens=40)
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 1  # 3 rows, then 2, then the longest alone


def test_length_limit_per_row_and_at_the_model_maximum():
    model = chain_lm()
    assert decode.greedy(model, prompts=[[5], [5]], max_new_tokens=[3, 5]) == [[6, 7, 8], [6, 7, 8, 9, 10]]
    lm = random_model("decoder", seed=5, positions="learned")
    out = decode.greedy(lm, prompts=[[4] * 60, [5] * 10], eos_id=None)  # no <eos>: run to the limit
    assert [len(o) for o in out] == [64 - 60 + 1, 64 - 10 + 1]  # the last token is never fed back


def greedy_to_the_maximum(model, rows: list[list[int]]) -> tuple[list[list[int]], int, int]:
    """Every row greedy to the model's maximum (no <eos>) by hand over ``start`` and ``decode_step``:
    ``(tokens of each row, blocks in use at the last step, the pool's capacity)``."""
    with torch.inference_mode():
        state, logits, limits = decode.start(model, prompts=rows)
        tokens = [logits.argmax(-1)]  # (B,)
        for _ in range(int(limits.max()) - 1):
            tokens.append(decode.decode_step(model, state, tokens[-1]).argmax(-1))
        used, capacity = state.cache.pool.used, state.cache.pool.capacity
        state.release()
    return torch.stack(tokens, 1).tolist(), used, capacity


@pytest.mark.parametrize("window", [0, 8])
def test_a_long_greedy_batch_fits_a_cache_of_each_rows_blocks_once(window):
    """Greedy rows never share a block (only beams fork rows), so ``start`` gives each row its blocks
    once: nine prompts of 60 tokens (two prefill chunks) decoded to the model's maximum of 64
    positions fill that cache and decode as each row alone; with a window on one layer of two, the
    window group's blocks are freed as the rows advance."""
    model = random_model("decoder", seed=6, positions="rotary", sliding_window=window)
    if window:
        model.config.layer_types = ("sliding", "full")
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randint(3, 12, (60,), generator=gen).tolist() for _ in range(9)]  # 540 tokens > PREFILL_TOKENS
    got, used, capacity = greedy_to_the_maximum(model, rows)
    assert got == [decode.greedy(model, prompts=[r], eos_id=None)[0] for r in rows]
    assert [len(g) for g in got] == [64 - 60 + 1] * 9
    blocks = 64 // decode.steps.BLOCK_SIZE  # each row's 64 positions
    if window:  # two groups: the full one holds all its blocks, the window one those still in reach
        assert capacity == 2 * 9 * blocks and 9 * blocks < used < capacity
    else:
        assert used == capacity == 9 * blocks  # every block in use: none left over for forks


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------
def test_top_k_and_top_p_keep_the_expected_tokens():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    keep = lambda x: torch.isfinite(x)[0].tolist()  # noqa: E731
    assert keep(filter_logits(logits, top_k=2)) == [True, True, False, False]
    assert keep(filter_logits(logits, top_p=0.8)) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert keep(filter_logits(logits, top_p=0.81)) == [True, True, True, False]
    assert keep(filter_logits(logits, top_p=0.1)) == [True, False, False, False]  # the top token always stays


def test_sample_frequencies_follow_the_tempered_softmax():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4)
    g = torch.Generator().manual_seed(0)
    draws = sample(logits, temperature=1.0, generator=g)
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)
    hot = sample(logits, temperature=2.0, generator=g)
    want = probs.sqrt() / probs.sqrt().sum()  # softmax(log p / 2)
    torch.testing.assert_close(torch.bincount(hot, minlength=4).float() / hot.numel(), want, atol=0.015, rtol=0)


@pytest.mark.parametrize("arch", KINDS)
def test_sampling_is_reproducible_with_a_seed(arch):
    model = random_model(arch, vocab=40, std=0.1)

    def run(seed, **kw):
        g = torch.Generator().manual_seed(seed)
        return decode.generate_ids(
            model, **inputs_of(model, INPUTS), max_new_tokens=20, temperature=1.0, generator=g, **kw
        )

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert run(7, top_k=5, top_p=0.9) == run(7, top_k=5, top_p=0.9)
    greedy = decode.greedy(model, **inputs_of(model, INPUTS), max_new_tokens=20)
    assert run(7, top_k=1) == greedy
    assert decode.generate_ids(model, **inputs_of(model, INPUTS), max_new_tokens=20, temperature=0.0) == greedy


@pytest.mark.parametrize("kw", [{"temperature": -1.0}, {"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_sampling_settings_raise(kw):
    with pytest.raises(ValueError):
        sample(torch.zeros(1, 4), **kw)


def test_sampling_settings_are_one_frozen_checked_object():
    s = decode.Sampling(temperature=0.7, top_k=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.temperature = 1.0
    for bad in [{"temperature": -1.0}, {"temperature": float("nan")}, {"top_k": 0}, {"top_k": True}, {"top_p": 2.0}]:
        with pytest.raises(ValueError):
            decode.Sampling(**bad)
    assert decode.GREEDY.greedy and not decode.Sampling().greedy
    assert decode.Sampling().temperature == decode.DEFAULT_TEMPERATURE == 1.0
    with pytest.raises(TypeError, match="not both"):
        sample(torch.zeros(1, 4), s, temperature=1.0)
    with pytest.raises(TypeError, match="unexpected"):
        sample(torch.zeros(1, 4), temprature=1.0)


@pytest.mark.parametrize("arch", KINDS)
def test_sampling_object_and_keywords_give_the_same_draws(arch):
    model = random_model(arch, vocab=40, std=0.1)
    kw = {"max_new_tokens": 12, **inputs_of(model, INPUTS)}
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    settings = decode.Sampling(temperature=0.9, top_p=0.95, generator=g1)
    by_object = decode.generate_ids(model, sampling=settings, **kw)
    assert by_object == decode.generate_ids(model, temperature=0.9, top_p=0.95, generator=g2, **kw)
    assert decode.generate_ids(model, **kw) == decode.greedy(model, **kw)  # id loops default to greedy


@pytest.mark.parametrize("arch", KINDS)
def test_penalties_read_each_rows_own_tokens(arch):
    """Penalties in a batch give each row what it gets alone (its history is its own), from id lists or a
    padded tensor, and change the answer."""
    model = random_model(arch, vocab=40, std=0.1, eos_bias=-3.0)  # long answers: something to penalise
    penalties = decode.Penalties(presence=0.3, frequency=0.6, repetition=1.5, logit_bias=((7, 0.5),))
    kw = dict(max_new_tokens=16, penalties=penalties)
    together = decode.generate_ids(model, **inputs_of(model, INPUTS), **kw)
    assert together == [decode.generate_ids(model, **inputs_of(model, [row]), **kw)[0] for row in INPUTS]
    assert together != decode.generate_ids(model, **inputs_of(model, INPUTS), max_new_tokens=16)
    if not model.is_encoder_decoder:  # a padded tensor: its pads are not the prompt's tokens
        padded, _ = decode.pad_batch(INPUTS, model.config.pad_id, side="left")
        assert decode.generate_ids(model, prompts=padded, **kw) == together


def test_penalize_rows_changes_its_rows_only_as_alone_and_restores_them_exactly():
    from attnmask.decode.sampling import TokenHistory, penalize, penalize_rows

    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3
    raw = logits.clone()
    history = TokenHistory([1, 2, 3, 3])
    for t in (4, 4, 2, 9):
        history.add(t)
    assert history.prompt == [1, 2, 3] and history.fresh == [4, 9] and history.counts == {4: 2, 2: 1, 9: 1}
    p = decode.Penalties(presence=0.3, frequency=0.5, repetition=1.4, logit_bias=((7, 2.0), (4, -1.0)))
    alone = penalize(raw[2], p, history)
    want = raw[2].double().clone()  # the definitions, entry by entry
    want[7] += 2.0
    want[4] -= 1.0
    for t in (1, 2, 3, 4, 9):
        want[t] = want[t] / 1.4 if want[t] > 0 else want[t] * 1.4
    for t, n in history.counts.items():
        want[t] -= 0.5 * n + 0.3
    torch.testing.assert_close(alone.double(), want, atol=1e-5, rtol=0)
    changed = penalize_rows(logits, [2, 4], [p, decode.Penalties(repetition=2.0)], [history, TokenHistory([9])],
                            banned=[(), (0, 1)])  # fmt: skip
    assert torch.equal(logits[2], alone)  # bit for bit its own row's
    assert torch.equal(logits[[0, 1, 3]], raw[[0, 1, 3]])
    assert logits[4, 0] == logits[4, 1] == float("-inf") and logits[4, 9] != raw[4, 9]
    changed.restore()
    assert torch.equal(logits, raw)


def test_source_ids_is_tokens_then_eos_for_text_or_ids(chars):
    text = ["a cat", "the dog"]
    rows = decode.source_ids(chars, text)
    assert rows == [chars.encode(t) + [EOS_ID] for t in text]
    assert decode.source_ids(chars, [chars.encode(t) for t in text]) == rows  # already encoded
    batch = make_translation_batch([chars.encode(t) for t in text], [[], []], pad_id=0, sos_id=SOS_ID, eos_id=EOS_ID)
    assert [r[r != 0].tolist() for r in batch.src] == rows  # what the encoder saw in training


def test_default_max_new_tokens_is_one_rule():
    assert decode.default_max_new_tokens(4, 64) == 16  # 1.5 * 4 + 10
    assert decode.default_max_new_tokens(60, 64) == 64  # capped at the model's maximum
    model = random_model("encoder_decoder", eos_bias=-50.0)  # never stops early
    src = [[5] * 40, [6] * 3]
    out = decode.greedy(model, src=src, max_new_tokens=[decode.default_max_new_tokens(len(s), 64) for s in src])
    assert [len(o) for o in out] == [64, 14]  # the model's maximum is reachable: <sos> + 63 fed tokens


# ---------------------------------------------------------------------------------------------
# Beam search
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def reference_beam(model, row, K, max_new, alpha):
    """The rules of attnmask.decode.beam written out for one row, no cache, full recomputation."""
    memory = model.encode(torch.tensor([row])) if model.is_encoder_decoder else None
    start = [SOS_ID] if model.is_encoder_decoder else list(row)
    beams, finished = [([], 0.0)], []
    for step in range(max_new):
        n = step + 1
        cands = []
        for toks, lp in beams:
            logits = model.decode(torch.tensor([start + toks]), memory, mask=masks.causal())  # (1, T, V)
            logp = logits[0, -1].float().log_softmax(-1)
            cands += [(lp + float(logp[v]), toks, v) for v in range(logp.numel())]
        cands.sort(key=lambda c: -c[0])
        cands = cands[: 2 * K]
        for lp, toks, v in cands[:K]:
            if v == EOS_ID:
                finished.append((lp / n**alpha, toks, lp))
        finished = sorted(finished, key=lambda f: -f[0])[:K]
        beams = [(toks + [v], lp) for lp, toks, v in cands if v != EOS_ID][:K]
        if step + 1 == max_new:
            finished = sorted(finished + [(lp / n**alpha, t, lp) for t, lp in beams], key=lambda f: -f[0])[:K]
            break
        if len(finished) == K and finished[-1][0] >= beams[0][1] / n**alpha:
            break
    return finished


@pytest.mark.parametrize("arch", KINDS)
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_search_matches_the_written_out_rules(arch, alpha):
    model = random_model(arch, seed=6)
    got = beam_search(
        model, **inputs_of(model, INPUTS[:3]), beam_size=3, max_new_tokens=12, length_penalty=alpha, n_best=3
    )
    for row, hyps in zip(INPUTS[:3], got):
        want = reference_beam(model, row, 3, 12, alpha)
        assert [h.tokens for h in hyps] == [t for _, t, _ in want]
        torch.testing.assert_close(torch.tensor([h.score for h in hyps]), torch.tensor([s for s, _, _ in want]))


@pytest.mark.parametrize("arch", KINDS)
def test_beam_batched_equals_one_by_one(arch):
    model = random_model(arch, seed=7)
    batched = beam_search(model, **inputs_of(model, INPUTS), beam_size=4, max_new_tokens=20, n_best=4)
    alone = [
        beam_search(model, **inputs_of(model, [row]), beam_size=4, max_new_tokens=20, n_best=4)[0] for row in INPUTS
    ]
    assert [[h.tokens for h in r] for r in batched] == [[h.tokens for h in r] for r in alone]
    for r in batched:
        assert [h.score for h in r] == sorted((h.score for h in r), reverse=True)


@pytest.mark.parametrize("arch", KINDS)
@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
def test_beam_size_one_is_greedy(arch, alpha):
    model = random_model(arch, seed=8)
    greedy = decode.greedy(model, **inputs_of(model, INPUTS), max_new_tokens=25)
    beam = beam_search(model, **inputs_of(model, INPUTS), beam_size=1, max_new_tokens=25, length_penalty=alpha)
    assert best_tokens(beam) == greedy


def test_wide_beam_finds_the_most_probable_sequence():
    """With length_penalty 0 and a beam as wide as the search space, beam search is exact."""
    model = random_model("encoder_decoder", vocab=6, seed=9, std=0.6)
    L = 3
    src = torch.tensor([[4, 5, 4]])
    with torch.no_grad():
        memory = model.encode(src)

    @torch.no_grad()
    def logprob(seq):  # generated tokens, <eos> included if finished
        ids = torch.tensor([[SOS_ID] + seq[:-1]])
        logp = model.decode(ids, memory, mask=masks.causal())[0].log_softmax(-1)  # (len, V)
        return float(sum(logp[i, t] for i, t in enumerate(seq)))

    V = 6
    others = [v for v in range(V) if v != EOS_ID]
    space = [list(p) + [EOS_ID] for n in range(L) for p in itertools.product(others, repeat=n)]
    space += [list(p) for p in itertools.product(others, repeat=L)]  # cut at the limit
    best = max(space, key=logprob)
    hyp = beam_search(model, src=src, beam_size=V**L, max_new_tokens=L, length_penalty=0.0)[0][0]
    assert hyp.tokens == [t for t in best if t != EOS_ID]
    assert math.isclose(hyp.logprob, logprob(best), abs_tol=1e-4)


def test_beam_arguments_are_checked():
    model = random_model("decoder")
    with pytest.raises(ValueError, match="beam_size"):
        beam_search(model, prompts=[[4]], beam_size=0)
    with pytest.raises(ValueError, match="n_best"):
        beam_search(model, prompts=[[4]], beam_size=2, n_best=3)


# ---------------------------------------------------------------------------------------------
# Inputs that are wrong
# ---------------------------------------------------------------------------------------------
def test_input_errors_are_clear():
    lm, mt = random_model("decoder"), random_model("encoder_decoder")
    with pytest.raises(ValueError, match="longer than the model's maximum of 64"):
        decode.greedy(lm, prompts=[[4] * 65])
    with pytest.raises(ValueError, match="longer than the model's maximum of 64"):
        decode.greedy(mt, src=[[4] * 65])
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        decode.greedy(lm, prompts=[[4], []])
    with pytest.raises(ValueError, match="empty batch"):
        decode.greedy(lm, prompts=[])
    with pytest.raises(ValueError, match="not src="):
        decode.greedy(lm, src=[[4]])
    with pytest.raises(ValueError, match="not prompts="):
        decode.greedy(mt, prompts=[[4]])
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        decode.greedy(lm, prompts=[[4]], max_new_tokens=0)


def test_decoding_leaves_the_model_mode_alone():
    model = random_model("decoder", dropout=0.5).train()
    a = decode.greedy(model, prompts=INPUTS, max_new_tokens=10)
    assert model.training  # restored
    assert a == decode.greedy(model, prompts=INPUTS, max_new_tokens=10)  # no dropout while decoding


# ---------------------------------------------------------------------------------------------
# Text in, text out
# ---------------------------------------------------------------------------------------------
TEXT = "the quick brown fox jumps over the lazy dog. Der schnelle braune Fuchs springt!"


@pytest.fixture(scope="module")
def chars():
    return Tokenizer.train_chars([TEXT])


def test_generate_streams_what_it_returns(chars):
    model = random_model("decoder", vocab=chars.vocab_size, std=0.1)
    full = decode.generate(model, chars, "the fox", max_new_tokens=30, temperature=1.0, seed=3)
    pieces = list(decode.generate(model, chars, "the fox", max_new_tokens=30, temperature=1.0, seed=3, stream=True))
    assert "".join(pieces) == full and len(pieces) >= 20
    assert decode.generate(model, chars, "the fox", max_new_tokens=30, temperature=1.0, seed=4) != full
    both = decode.generate(model, chars, ["the fox", "a dog"], max_new_tokens=10, temperature=0.0)
    assert both[0] == decode.generate(model, chars, "the fox", max_new_tokens=10, temperature=0.0)
    with pytest.raises(ValueError, match="prompt 2 is empty"):
        decode.generate(model, chars, ["a", ""], max_new_tokens=5)
    with pytest.raises(ValueError, match="prompt 1 has 65 tokens, longer than the model's maximum of 64"):
        decode.generate(model, chars, "a" * 65, max_new_tokens=5)


def test_translate_keeps_order_and_matches_single_sentences(chars):
    model = random_model("encoder_decoder", vocab=chars.vocab_size, seed=11)
    sentences = ["the fox", "a lazy dog jumps", "over", "Der Fuchs springt"]
    for beam in (1, 3):
        out = decode.translate(model, chars, chars, sentences, beam=beam, batch_size=3)
        assert len(out) == 4
        assert out == [decode.translate(model, chars, chars, [s], beam=beam)[0] for s in sentences]
    ids = decode.source_ids(chars, sentences)
    assert decode.translate(model, chars, chars, sentences) == [
        chars.decode(t)
        for t in decode.greedy(model, src=ids, max_new_tokens=[decode.default_max_len(len(s), 64) for s in ids])
    ]


# ---------------------------------------------------------------------------------------------
# Against Hugging Face generate, same weights
# ---------------------------------------------------------------------------------------------
def hf_tokens(out: torch.Tensor, start: int) -> list[list[int]]:
    """Generated ids of each row of a ``generate`` output, up to (without) the first <eos>."""
    return [r[: r.index(EOS_ID)] if EOS_ID in r else r for r in out[:, start:].tolist()]


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_greedy_and_beam_match_hf_generate_on_a_llama(seed):
    """Left-padded prompts, rotary positions from the padding, grouped-query heads, per-row <eos>."""
    transformers = pytest.importorskip("transformers")
    from attnmask.pretrained.hf import transformer_from_hf

    cfg = transformers.LlamaConfig(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    ours = transformer_from_hf(hf.state_dict(), cfg).eval()
    ids, keep = decode.pad_batch(INPUTS, 0, side="left")
    for K in (1, 3):
        with torch.no_grad():
            out = hf.generate(
                input_ids=ids, attention_mask=keep.long(), num_beams=K, do_sample=False, max_new_tokens=15,
                length_penalty=1.0, early_stopping=False, pad_token_id=0, eos_token_id=EOS_ID,
            )  # fmt: skip
        mine = (
            decode.greedy(ours, prompts=INPUTS, max_new_tokens=15)
            if K == 1
            else best_tokens(beam_search(ours, prompts=INPUTS, beam_size=K, max_new_tokens=15))
        )
        assert mine == hf_tokens(out, ids.shape[1]), f"beam {K}"


def test_greedy_and_beam_match_hf_generate_on_a_marian():
    """Right-padded sources, cross-attention, post-norm; rows end at different steps."""
    transformers = pytest.importorskip("transformers")
    from attnmask.pretrained.hf import transformer_from_hf

    cfg = transformers.MarianConfig(
        vocab_size=16, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=EOS_ID, decoder_start_token_id=SOS_ID, forced_eos_token_id=None,
        scale_embedding=True, activation_function="swish",
    )  # fmt: skip
    torch.manual_seed(2)
    hf = transformers.MarianMTModel(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() > 1 and "embed_positions" not in name:
                p.normal_(0.0, 0.15)
        hf.final_logits_bias[0, EOS_ID] = 1.5
    ours = transformer_from_hf(hf.state_dict(), cfg).eval()
    src = [[5, 6, 7, 8, 2], [9, 10, 2], [11, 12, 13, 2], [14, 2], [4, 15, 4, 2]]
    ids, keep = decode.pad_batch(src, 0, side="right")
    lengths = set()
    for K in (1, 3):
        with torch.no_grad():
            out = hf.generate(
                input_ids=ids, attention_mask=keep.long(), num_beams=K, do_sample=False, max_new_tokens=20,
                length_penalty=1.0, early_stopping=False,
            )  # fmt: skip
        mine = (
            decode.greedy(ours, src=src, max_new_tokens=20)
            if K == 1
            else best_tokens(beam_search(ours, src=src, beam_size=K, max_new_tokens=20))
        )
        assert mine == hf_tokens(out, 1), f"beam {K}"
        lengths |= {len(m) for m in mine}
    assert len(lengths) >= 3  # rows stopped at several different steps
