"""Serving: many requests decoded together, each answer independent of who else is in the batch.

- :mod:`.cache`: the paged key/value cache (reference-counted block pool, block tables, one per layer
  group where the model's layers have several windows), defined in :mod:`attnmask.model.cache`, where
  every decoding path runs on it;
- :mod:`.step`: the one forward step over a packed batch of sequences that every decoding path runs
  (:mod:`attnmask.decode.step`: the mask algebra's ``document & causal`` with per-sequence offsets,
  lowered to the native ``paged_attend``; one native ``packed_step`` call for Llama-style and Gemma 3 decoders);
- :mod:`.scheduler`: continuous batching, chunked prefill, admission by free blocks, preemption;
- :mod:`.engine`: :class:`Engine` (``add_request``, ``step``, ``cancel``, ``run``, ``generate``).
"""

from attnmask.decode.grammar import Grammar  # noqa: F401  (what RequestParams takes)
from attnmask.decode.sampling import Penalties, Sampling  # noqa: F401
from attnmask.engine.cache import BlockPool, LayerGroup, PagedKVCache, Paging, blocks_for_memory, layer_groups  # noqa: F401
from attnmask.engine.engine import Completion, Engine, EngineStats, Logprob, RequestParams, TokenEvent  # noqa: F401
from attnmask.engine.scheduler import Chunk, PrefixCache, Scheduler, Sequence  # noqa: F401
from attnmask.engine.step import packed_forward, packed_mask  # noqa: F401
