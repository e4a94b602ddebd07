"""The packed step (:mod:`attnmask.engine.step`) and its attention operator ``paged_attend``.

- The native kernel against its PyTorch definition in float64, and against the mask algebra: the
  reference attention over every sequence's gathered keys with :func:`packed_mask` materialised
  (``document & causal`` with each sequence's own offset, ``& sliding_window``): random block
  tables, sequence lengths, row positions, grouped-query head counts, windows.
- Row invariance: a row alone gives the bits it gives in any pack, in any order, on 1 or 2 threads.
- Out-of-range positions, sequences and blocks are refused with a message naming them.
- :func:`packed_forward` over several sequences packed at different offsets (in one step, and
  chunked over two) gives the model's own full forward logits.

Every slot of the pools that holds no key of a sequence is NaN, so a kernel that reads one
(a wrong block, an off-by-one past a row's position) shows NaN instead of passing by chance.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnmask import masks, ops
from attnmask.attention import attention
from attnmask.decode.step import logical_blocks, paged_mask
from attnmask.engine import PagedKVCache, packed_forward, packed_mask
from attnmask.engine.step import slots_of
from attnmask.model import fuse_projections_
from attnmask.ops import decoding
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def built():
    """The native operators (built on first use, into the test run's cache), or a skip naming why not."""
    if not ops.available():
        pytest.skip(f"no native build of the operators here: {ops.status().why}")


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def paged_problem(lengths, S, Hkv, G, D, seed=0, spare=3):
    """Sequences of ``lengths`` keys in a pool of ``S``-position blocks, each holding its blocks in a
    random order (block 0, the null block, never); every slot that is no sequence's key is NaN.

    Returns ``(k_pool, v_pool, tables, keys)`` with ``keys[s]``: ``(k, v)`` of sequence ``s``,
    ``(len, Hkv, D)`` each, in position order."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // S) for n in lengths]
    P = 1 + sum(need) + spare
    ids = (torch.randperm(P - 1, generator=g) + 1).tolist()  # blocks 1..P-1, shuffled
    W = max(need)
    tables = torch.zeros(len(lengths), W, dtype=torch.long)  # unused entries: the null block
    k_pool = torch.full((P, S, Hkv, D), float("nan"))  # (P, S, Hkv, D)
    v_pool = torch.full((P, S, Hkv, D), float("nan"))
    keys = []
    for s, n in enumerate(lengths):
        tables[s, : need[s]] = torch.tensor([ids.pop() for _ in range(need[s])])
        k, v = torch.randn(n, Hkv, D, generator=g), torch.randn(n, Hkv, D, generator=g)  # (n, Hkv, D)
        t = torch.arange(n)
        k_pool.view(-1, Hkv, D)[tables[s, t // S] * S + t % S] = k
        v_pool.view(-1, Hkv, D)[tables[s, t // S] * S + t % S] = v
        keys.append((k, v))
    return k_pool, v_pool, tables, keys


@st.composite
def problems(draw):
    Hkv, G = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    D = draw(st.sampled_from([4, 8, 16, 20]))  # 20: a tail past the kernel's vector loop
    S = draw(st.sampled_from([1, 2, 3, 4, 8]))
    lengths = draw(st.lists(st.integers(1, 30), min_size=1, max_size=4))
    pairs = sorted({(s, p) for s, n in enumerate(lengths) for p in range(n)})
    rows = draw(st.lists(st.sampled_from(pairs), min_size=1, max_size=12, unique=True))
    window = draw(st.sampled_from([0, 0, 1, 2, 5, 17]))
    return dict(lengths=lengths, S=S, Hkv=Hkv, G=G, D=D, rows=rows, window=window, seed=draw(st.integers(0, 99)))


def build(p):
    k_pool, v_pool, tables, keys = paged_problem(p["lengths"], p["S"], p["Hkv"], p["G"], p["D"], seed=p["seed"])
    H, D = p["Hkv"] * p["G"], p["D"]
    row_seq = torch.tensor([s for s, _ in p["rows"]], dtype=torch.long)  # (N,)
    row_pos = torch.tensor([t for _, t in p["rows"]], dtype=torch.long)  # (N,)
    q = _randn(len(p["rows"]), H * D, seed=p["seed"] + 1)  # (N, H D)
    return q, k_pool, v_pool, tables, row_seq, row_pos, keys


def _close(got: torch.Tensor, want64: torch.Tensor, what: str) -> None:
    """float32 against a float64 result: within a few float32 roundings."""
    assert got.dtype == torch.float32 and not got.isnan().any(), f"{what}: NaN (a slot outside the rows' keys read)"
    torch.testing.assert_close(got.double(), want64, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def by_mask_algebra(q, keys, row_seq, row_pos, H, D, window, scale):
    """The reference attention of the packed rows over all sequences' keys, gathered into one row of
    keys, with the engine's mask from the algebra, in float64: ``(N, H D)``."""
    key_seq = torch.cat([torch.full((len(k),), s) for s, (k, _) in enumerate(keys)])  # (K,)
    key_pos = torch.cat([torch.arange(len(k)) for k, _ in keys])  # (K,)
    k = torch.cat([k for k, _ in keys]).transpose(0, 1)[None].double()  # (1, Hkv, K, D)
    v = torch.cat([v for _, v in keys]).transpose(0, 1)[None].double()
    N, K = len(row_seq), len(key_seq)
    mask = packed_mask(row_seq, row_pos, key_seq, key_pos, window).to_bool(1, N, K)  # (1, 1, N, K)
    # the mask is the ranges the kernel reads: [pos - window + 1, pos] of the row's own sequence
    first = (row_pos - window + 1).clamp(min=0) if window > 0 else torch.zeros_like(row_pos)
    ranges = (key_seq[None] == row_seq[:, None]) & (key_pos[None] <= row_pos[:, None]) & (key_pos >= first[:, None])
    assert torch.equal(mask[0, 0], ranges)
    qh = q.double().view(N, H, D).transpose(0, 1)[None]  # (1, H, N, D)
    out = attention(qh, k, v, mask, backend="reference", scale=scale)  # (1, H, N, D)
    return out[0].transpose(0, 1).reshape(N, H * D)


@pytest.mark.usefixtures("built")
@settings(max_examples=60, deadline=None)
@given(problems())
def test_paged_attend_matches_its_definition_and_the_mask_algebra(p):
    q, k_pool, v_pool, tables, row_seq, row_pos, keys = build(p)
    H, D, window, scale = p["Hkv"] * p["G"], p["D"], p["window"], p["D"] ** -0.5
    got = decoding.paged_attend(q, k_pool, v_pool, tables, row_seq, row_pos, window, H, scale)  # (N, H D)
    assert got.shape == q.shape
    want = decoding.paged_attend_reference(
        q.double(), k_pool.double(), v_pool.double(), tables, row_seq, row_pos, window, H, scale
    )
    _close(got, want, "against paged_attend_reference")
    _close(got, by_mask_algebra(q, keys, row_seq, row_pos, H, D, window, scale), "against the mask algebra")


@settings(max_examples=25, deadline=None)
@given(problems())
def test_the_reference_is_the_mask_algebra(p):
    """The PyTorch definition (what runs without the native build) computes the same attention."""
    q, k_pool, v_pool, tables, row_seq, row_pos, keys = build(p)
    H, D, window, scale = p["Hkv"] * p["G"], p["D"], p["window"], p["D"] ** -0.5
    k64, v64 = k_pool.double(), v_pool.double()
    got = decoding.paged_attend_reference(q.double(), k64, v64, tables, row_seq, row_pos, window, H, scale)
    want = by_mask_algebra(q, keys, row_seq, row_pos, H, D, window, scale)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def _threads(n: int):
    class Threads:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)

    return Threads()


@pytest.mark.usefixtures("built")
@settings(max_examples=30, deadline=None)
@given(problems(), st.randoms(use_true_random=False))
def test_a_row_alone_is_the_row_in_any_pack_bit_for_bit(p, rnd):
    q, k_pool, v_pool, tables, row_seq, row_pos, _ = build(p)
    H, window, scale = p["Hkv"] * p["G"], p["window"], p["D"] ** -0.5
    with _threads(1):
        packed = decoding.paged_attend(q, k_pool, v_pool, tables, row_seq, row_pos, window, H, scale)
    order = list(range(len(row_seq)))
    rnd.shuffle(order)
    perm = torch.tensor(order)
    for threads in (1, 2):
        with _threads(threads):
            shuffled = decoding.paged_attend(
                q[perm], k_pool, v_pool, tables, row_seq[perm], row_pos[perm], window, H, scale
            )
            assert torch.equal(shuffled, packed[perm]), f"{threads} threads: a row's bits depend on its place"
            for r in range(len(row_seq)):
                one = slice(r, r + 1)
                alone = decoding.paged_attend(
                    q[one], k_pool, v_pool, tables, row_seq[one], row_pos[one], window, H, scale
                )
                assert torch.equal(alone[0], packed[r]), f"{threads} threads: row {r} alone differs from the pack"


@pytest.mark.usefixtures("built")
def test_long_rows_split_over_threads_keep_their_bits():
    """Rows long enough (300 keys of 64) that two threads share the (row, head) pairs of one call."""
    rows = [(0, 299), (1, 256), (0, 17), (1, 255), (0, 298), (1, 0), (0, 150), (1, 200)]
    p = dict(lengths=[300, 257], S=16, Hkv=2, G=3, D=64, rows=rows, window=0, seed=3)
    q, k_pool, v_pool, tables, row_seq, row_pos, keys = build(p)
    for window in (0, 100):
        with _threads(1):
            one = decoding.paged_attend(q, k_pool, v_pool, tables, row_seq, row_pos, window, 6, 0.125)
        with _threads(2):
            two = decoding.paged_attend(q, k_pool, v_pool, tables, row_seq, row_pos, window, 6, 0.125)
            alone = [
                decoding.paged_attend(q[r : r + 1], k_pool, v_pool, tables, row_seq[r : r + 1], row_pos[r : r + 1],
                                      window, 6, 0.125)[0]
                for r in range(len(rows))
            ]  # fmt: skip
        assert torch.equal(one, two) and torch.equal(torch.stack(alone), one)
        _close(one, by_mask_algebra(q, keys, row_seq, row_pos, 6, 64, window, 0.125), f"window {window}")


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("D", [256, 40])
def test_one_unit_shared_by_the_threads_keeps_its_bits(D):
    """Gemma 3's shape at batch 1 (4 query heads over 1 key/value head): fewer units than threads, so the
    threads share one unit's key blocks, heads and lanes; each row's bits are those of a packed call."""
    rows = [(0, 699), (0, 640), (0, 33), (0, 0)]
    p = dict(lengths=[700], S=16, Hkv=1, G=4, D=D, rows=rows, window=0, seed=5)
    q, k_pool, v_pool, tables, row_seq, row_pos, keys = build(p)
    for window in (0, 512):
        with _threads(1):
            packed = decoding.paged_attend(q, k_pool, v_pool, tables, row_seq, row_pos, window, 4, D**-0.5)
        for threads in (1, 2, 3):
            with _threads(threads):
                for r in range(len(rows)):
                    one = slice(r, r + 1)
                    alone = decoding.paged_attend(
                        q[one], k_pool, v_pool, tables, row_seq[one], row_pos[one], window, 4, D**-0.5
                    )
                    assert torch.equal(alone[0], packed[r]), f"{threads} threads, window {window}: row {r} differs"
        _close(packed, by_mask_algebra(q, keys, row_seq, row_pos, 4, D, window, D**-0.5), f"window {window}")


@pytest.mark.usefixtures("built")
def test_paged_attend_refuses_rows_and_blocks_out_of_range():
    q, k_pool, v_pool, tables, row_seq, row_pos, _ = build(
        dict(lengths=[5, 3], S=2, Hkv=2, G=2, D=8, rows=[(0, 4), (1, 2)], window=0, seed=0)
    )  # tables (2, 3): 6 positions a sequence; a pool of 1 + 3 + 2 + 3 = 9 blocks

    def attend(tables=tables, row_seq=row_seq, row_pos=row_pos):
        return decoding.paged_attend(q, k_pool, v_pool, tables, row_seq, row_pos, 0, 4, 0.3)

    with pytest.raises(ValueError, match=r"paged_attend: row 1 is position 6 of sequence 1; the tables hold 2 "):
        attend(row_pos=torch.tensor([4, 6]))
    with pytest.raises(ValueError, match=r"row 0 is position -1 of sequence 0"):
        attend(row_pos=torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match=r"row 1 is position 2 of sequence 2; the tables hold 2 sequences"):
        attend(row_seq=torch.tensor([0, 2]))
    bad = tables.clone()
    bad[1, 1] = 9
    with pytest.raises(ValueError, match=r"paged_attend: sequence 1 names block 9 of a pool of 9"):
        attend(tables=bad)
    bad[1, 1] = -1
    with pytest.raises(ValueError, match=r"sequence 1 names block -1 of a pool of 9"):
        attend(tables=bad)
    bad = tables.clone()
    bad[1, 2] = 99  # past sequence 1's last row (position 2 is in its block 1): never read, so allowed
    assert torch.equal(attend(tables=bad), attend())
    with pytest.raises(ValueError, match=r"tables, row_seq and row_pos must be contiguous int64 CPU tensors"):
        attend(row_pos=torch.tensor([4, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"q has shape \[2, 32\]; expected \(N, 24\) for 3 heads of 8 over 2"):
        decoding.paged_attend(q, k_pool, v_pool, tables, row_seq, row_pos, 0, 3, 0.3)


def test_packed_mask_materialises_as_its_docstring_says():
    """``packed_mask(...)``: "Batch 1: ``to_bool(1, N, K)``" — two rows of two sequences, three keys."""
    row_seq, row_pos = torch.tensor([0, 1]), torch.tensor([1, 0])
    key_seq, key_pos = torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0])
    got = packed_mask(row_seq, row_pos, key_seq, key_pos).to_bool(1, 2, 3)[0, 0]
    assert got.tolist() == [[True, True, False], [False, False, True]]


# ---------------------------------------------------------------------------------------------
# packed_forward: the model's own forward pass
# ---------------------------------------------------------------------------------------------
MODELS = {
    "rotary-gqa": dict(positions="rotary", n_kv_heads=2, norm="rmsnorm", activation="swiglu"),
    "rotary-gqa-fused": dict(positions="rotary", n_kv_heads=2, norm="rmsnorm", activation="swiglu", fuse=True),
    "learned-layernorm-gelu": dict(positions="learned", norm="layernorm", activation="gelu"),
    "learned-post-norm": dict(positions="learned", norm_position="post"),
    "sinusoidal-tied": dict(positions="sinusoidal", tie_embeddings=True),
    # windows: two layers of three see their last 3 positions (three layer groups in the engine's cache,
    # their old blocks freed); every layer's window 4 (one group, freed, the one-call step where built)
    "rotary-windows": dict(
        positions="rotary",
        n_kv_heads=2,
        norm="rmsnorm",
        activation="swiglu",
        n_layers=3,
        sliding_window=3,
        layer_types=("sliding", "full", "sliding"),
    ),
    "rotary-fused-window": dict(
        positions="rotary", n_kv_heads=2, norm="rmsnorm", activation="swiglu", fuse=True, sliding_window=4
    ),
    # Gemma 3's layers: q/k norms, norms after the sublayers, a rotary base and a window on the sliding
    # layers, a tanh-GELU gate (gate and up two products), the embedding scaled: the one-call step
    "gemma-style": dict(
        positions="rotary",
        n_heads=4,
        n_kv_heads=1,
        norm="rmsnorm",
        activation="geglu_tanh",
        ffn_dim=40,  # not a whole number of vectors: each row's tail through the activation too
        n_layers=3,
        sliding_window=3,
        layer_types=("sliding", "full", "sliding"),
        rope_theta=1e6,
        rope_local_theta=1e4,
        qk_norm=True,
        post_norms=True,
        embed_scale=True,
        fuse=True,
    ),
}


def model_of(variant: str, seed: int = 0):
    kw = dict(MODELS[variant])
    fuse = kw.pop("fuse", False)
    kw.setdefault("tie_embeddings", False)
    model = tiny_model("decoder", vocab=24, seed=seed, std=0.5, max_seq_len=64, lm_head_bias=True, **kw)
    if kw.get("post_norms"):  # norm weights away from 1, each norm its own (Gemma's are stored as 1 + w)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return fuse_projections_(model) if fuse else model


@pytest.mark.parametrize("flex", [False, True], ids=["paged_attend", "flex"])
@pytest.mark.parametrize("variant", list(MODELS))
def test_packed_forward_gives_the_full_forward_logits(variant, flex, monkeypatch):
    """Three sequences (7, 3 and 12 tokens) packed in one step, then the same chunked over two steps
    (the second sees the first's keys in the cache): every position's logits as the model's own
    forward over the whole sequence gives them. ``flex``: self-attention through FlexAttention's
    ``BlockMask`` of :func:`paged_mask` over the whole pool (the CUDA lowering; eager here)."""
    from attnmask.attention import backends

    if flex and not backends.flex_available():
        pytest.skip(f"FlexAttention is not in torch {torch.__version__}")
    monkeypatch.setattr(backends, "FLEX_COMPILE", False)
    model = model_of(variant)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 24, (n,), generator=g) for n in (7, 3, 12)]
    with torch.no_grad():
        want = [model.decode(s[None], mask=masks.causal())[0] for s in seqs]  # (n, V) each
    S = 4
    for cuts in ([0, 0, 0], [4, 1, 9]):  # one step; or positions < cut in a first step, the rest in a second
        cache = PagedKVCache.for_model(model, num_blocks=12, block_size=S)
        tables = torch.zeros(3, 3, dtype=torch.long)
        order = torch.randperm(11, generator=g) + 1  # the blocks in no particular order
        for s, n in enumerate(len(x) for x in seqs):
            tables[s, : -(-n // S)] = order[: -(-n // S)]
            order = order[-(-n // S) :]
        got = [[] for _ in seqs]
        for step in ("first", "second"):
            parts = [range(0, cut) if step == "first" else range(cut, len(s)) for s, cut in zip(seqs, cuts)]
            if not any(parts):
                continue
            order_of = [s for s in (2, 0, 1) if parts[s]]  # not in sequence order: offsets differ
            tokens = torch.cat([seqs[s][list(parts[s])] for s in order_of])  # (N,)
            positions = torch.cat([torch.tensor(list(parts[s]), dtype=torch.long) for s in order_of])
            row_seq = torch.cat([torch.full((len(parts[s]),), s) for s in order_of])
            with torch.inference_mode():
                logits = packed_forward(
                    model, cache, tokens, positions, row_seq, tables, torch.arange(len(tokens)), flex=flex
                )
            assert logits.shape == (len(tokens), 24)
            at = 0
            for s in order_of:
                got[s].append(logits[at : at + len(parts[s])])
                at += len(parts[s])
        for s, w in enumerate(want):
            torch.testing.assert_close(torch.cat(got[s]), w, atol=2e-5 * w.abs().max(), rtol=0)


@pytest.mark.parametrize("variant", ["rotary-gqa-fused", "learned-post-norm", "rotary-windows"])
def test_the_packed_step_off_the_cpu_reads_nothing_back(variant, monkeypatch):
    """The step as it runs on a GPU (FlexAttention over the pool, a ``BlockMask`` per layer group and
    window) on the ``meta`` device, where any read of a value back to the host raises: a step a CUDA
    graph could capture. The kernel and the compiled BlockMask builder are stand-ins that return the
    right shapes; everything around them runs as it is."""
    from types import SimpleNamespace

    from attnmask.decode import step as step_module
    from attnmask.masks import core

    built = []

    def builder(mod, B, H, q_len, kv_len, **kw):
        built.append((q_len, kv_len))
        return SimpleNamespace(shape=(1, 1, q_len, kv_len))

    monkeypatch.setattr(core, "_COMPILED_BUILDER", builder)
    monkeypatch.setattr(step_module, "flex_call", lambda q, k, v, **kw: q.new_zeros(q.shape))
    model = model_of(variant).to("meta")
    cache = PagedKVCache.for_model(model, num_blocks=8, block_size=4)
    assert cache.k[0].device.type == "meta"
    ids = lambda *shape: torch.empty(*shape, dtype=torch.long, device="meta")  # noqa: E731
    tables = [ids(2, 3) for _ in cache.groups]
    with torch.inference_mode():
        logits = packed_forward(model, cache, ids(5), ids(5), ids(5), tables, ids(2), flex=True)
    assert logits.shape == (2, 24)
    assert built and all(q_len == 128 and kv_len == 8 * 4 for q_len, kv_len in built)  # rows padded to 128


def test_packed_forward_computes_only_the_asked_rows_and_writes_every_key():
    model = model_of("rotary-gqa")
    cache = PagedKVCache.for_model(model, num_blocks=6, block_size=2)
    tokens, positions = torch.tensor([3, 4, 5, 6, 7]), torch.tensor([0, 1, 2, 0, 1])
    row_seq, tables = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([[5, 1], [3, 0]])
    with torch.inference_mode():
        every = packed_forward(model, cache, tokens, positions, row_seq, tables, torch.arange(5))
        two = packed_forward(model, cache, tokens, positions, row_seq, tables, torch.tensor([4, 2]))
    assert two.shape == (2, 24)
    assert torch.equal(two, every[[4, 2]])  # rows computed alone: the same bits
    slots = slots_of(tables, row_seq, positions, 2)
    assert slots.tolist() == [10, 11, 2, 6, 7]
    written = torch.zeros(12, dtype=torch.bool)
    written[slots] = True
    for pool in (*cache.k, *cache.v):
        flat = pool.view(12, -1)
        assert flat[slots].abs().sum(-1).gt(0).all() and flat[~written].eq(0).all()


@settings(max_examples=25, deadline=None)
@given(problems(), st.integers(0, 2**31 - 1))
def test_paged_mask_over_pool_slots_is_the_packed_mask(p, seed):
    """:func:`paged_mask` (FlexAttention's view: every slot of the pool) allows exactly the slots that hold
    keys of the row's own sequence at positions ``(pos - window, pos]``, read through its block table;
    a block shared by two sequences (beams forked from one prefix) is each one's."""
    k_pool, _, tables, _ = paged_problem(p["lengths"], p["S"], p["Hkv"], p["G"], p["D"], seed=p["seed"])
    S, P = p["S"], k_pool.shape[0]
    if len(p["lengths"]) > 1 and seed % 2:  # the second sequence's first block is the first's too
        tables[1, 0] = tables[0, 0]
    row_seq = torch.tensor([s for s, _ in p["rows"]])
    row_pos = torch.tensor([t for _, t in p["rows"]])
    logical = logical_blocks(tables, P)
    got = (
        paged_mask(row_seq, row_pos, logical, S, p["window"]).to_bool(1, len(row_seq), P * S).reshape(len(row_seq), -1)
    )
    want = torch.zeros(len(row_seq), P * S, dtype=torch.bool)
    for r, (s, pos) in enumerate(p["rows"]):
        first = max(0, pos - p["window"] + 1) if p["window"] else 0
        for t in range(first, pos + 1):
            want[r, int(tables[s, t // S]) * S + t % S] = True
    assert torch.equal(got, want)
