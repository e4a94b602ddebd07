"""The serving engine's paged key/value cache: :class:`~attnmask.model.cache.PagedKVCache`, its
reference-counted :class:`~attnmask.model.cache.BlockPool`, the layer groups of models with several
windows and the rules of their block tables (:class:`~attnmask.model.cache.Paging`), all defined with
the model's caches, where every decoding path, not only the engine, runs on them; and the engine's
sizing rule :func:`~attnmask.model.cache.blocks_for_memory`."""

from attnmask.model.cache import BlockPool, LayerGroup, PagedKVCache, Paging, blocks_for_memory, layer_groups

__all__ = ["BlockPool", "LayerGroup", "PagedKVCache", "Paging", "blocks_for_memory", "layer_groups"]
