"""The paged cache (:mod:`attnmask.engine.cache`): the block pool's bookkeeping (block 0 never
handed out), each layer's pools shaped and typed after the model, and the memory arithmetic."""

from __future__ import annotations

import pytest
import torch

from attnmask.engine import BlockPool, PagedKVCache, blocks_for_memory
from attnmask.errors import UserError
from tests.conftest import tiny_model


def test_the_pool_hands_out_blocks_and_takes_them_back():
    pool = BlockPool(5)
    assert (pool.free, pool.used, pool.capacity) == (4, 0, 4)
    a = pool.allocate(3)
    assert a == [1, 2, 3] and 0 not in a and (pool.free, pool.used) == (1, 3)
    with pytest.raises(MemoryError, match="asked for 2 cache blocks, 1 free"):
        pool.allocate(2)
    pool.release(a)
    assert (pool.free, pool.used) == (4, 0)
    assert pool.allocate(1) == [1]  # the most recently freed first
    with pytest.raises(UserError, match="at least 2 blocks"):
        BlockPool(1)


def test_the_cache_has_a_pool_per_layer_shaped_after_the_model():
    model = tiny_model("decoder", positions="rotary", n_heads=4, n_kv_heads=2, n_layers=3)  # head_dim 8
    cache = PagedKVCache.for_model(model, num_blocks=7, block_size=5)
    assert len(cache.k) == len(cache.v) == 3
    for t in (*cache.k, *cache.v):
        assert t.shape == (7, 5, 2, 8) and t.dtype == torch.float32 and t.eq(0).all()
    assert len({t.data_ptr() for t in (*cache.k, *cache.v)}) == 6  # no pool shared between layers
    assert (cache.block_size, cache.num_blocks, cache.pool.capacity) == (5, 7, 6)
    assert [cache.blocks_for(n) for n in (1, 5, 6, 10, 11)] == [1, 1, 2, 2, 3]
    assert cache.nbytes() == 2 * 3 * 7 * 5 * 2 * 8 * 4
    assert PagedKVCache.for_model(model.double(), num_blocks=2, block_size=1).k[0].dtype == torch.float64


def test_blocks_for_memory():
    # a block: 2 (k, v) x 3 layers x 16 positions x 2 heads x 8 x 4 bytes = 6 KiB
    assert blocks_for_memory(1, n_layers=3, kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32) == 170
    assert blocks_for_memory(1, n_layers=3, kv_heads=2, head_dim=8, block_size=16, dtype=torch.float16) == 341
    assert blocks_for_memory(0.001, n_layers=3, kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32) == 0
