"""Autoregressive decoding with a KV cache (seed 000): greedy, sampling, beam search, streaming.

- :mod:`.steps`: start (encode / prefill), one decode step, the loop, greedy and sampled ids;
- :mod:`.static`: the one-token step itself over a preallocated cache, where each variant lives:
  ``decode_one`` (eager: ``_step`` in PyTorch operations, or ``_fused_step`` through the operators of
  :mod:`attnmask.ops.decoding`, which make the whole step one ``decoder_step`` call in C++ where every
  product allows) and ``CompiledStep`` (``torch.compile``); ``Transformer.decode`` is the general
  forward the audits and the prefill use;
- :mod:`.sampling`: the frozen :class:`Sampling` settings; arg-max or a draw with temperature,
  top-k, top-p and an explicit generator;
- :mod:`.beam`: beam search on the same steps;
- :mod:`.text`: text in, text out (``translate``, ``generate``).
"""

from attnmask.decode.beam import (  # noqa: F401
    Hypothesis,
    beam_search,
    best_tokens,
)
from attnmask.decode.sampling import (  # noqa: F401
    DEFAULT_TEMPERATURE,
    GREEDY,
    Sampling,
    check_sampling,
    filter_logits,
    sample,
)
from attnmask.decode.steps import (  # noqa: F401
    DEFAULT_NEW_TOKENS,
    DecodeState,
    Ids,
    StopIds,
    decode_step,
    default_max_len,
    default_max_new_tokens,
    eval_mode,
    generate_ids,
    greedy,
    is_stop,
    pad_batch,
    source_ids,
    start,
    stop_set,
    stream,
)
from attnmask.decode.text import (  # noqa: F401
    generate,
    translate,
)
