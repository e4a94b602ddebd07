"""Serving: many requests decoded together, each answer independent of who else is in the batch.

- :mod:`.cache`: the paged key/value cache (block pool, block tables);
- :mod:`.step`: one forward step over a packed batch of sequences (the mask algebra's
  ``document & causal`` with per-sequence offsets, lowered to the native ``paged_attend``);
- :mod:`.scheduler`: continuous batching, chunked prefill, admission by free blocks, preemption;
- :mod:`.engine`: :class:`Engine` (``add_request``, ``step``, ``cancel``, ``run``, ``generate``).
"""

from attnmask.engine.cache import BlockPool, PagedKVCache, blocks_for_memory  # noqa: F401
from attnmask.engine.engine import Completion, Engine, EngineStats, RequestParams, TokenEvent  # noqa: F401
from attnmask.engine.scheduler import Chunk, Scheduler, Sequence  # noqa: F401
from attnmask.engine.step import packed_forward, packed_mask  # noqa: F401
