"""The serving engine's paged key/value cache: :class:`~attnmask.model.cache.PagedKVCache` and its
reference-counted :class:`~attnmask.model.cache.BlockPool` (defined with the model's caches, where every
decoding path, not only the engine, runs on them), and the engine's sizing rule
:func:`~attnmask.model.cache.blocks_for_memory`."""

from attnmask.model.cache import BlockPool, PagedKVCache, blocks_for_memory

__all__ = ["BlockPool", "PagedKVCache", "blocks_for_memory"]
