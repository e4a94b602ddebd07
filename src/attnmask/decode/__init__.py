"""Autoregressive decoding over a paged KV cache (seed 000): greedy, sampling, beam search, streaming.

- :mod:`.step`: the one forward step every decoding path runs (and the serving engine): a packed batch
  of sequences, each a prefill chunk or one new token at its own offset in a paged cache, with
  cross-attention to each sequence's own source for encoder-decoder models; one native
  ``packed_step`` call for Llama-style and Gemma 3 decoders;
- :mod:`.steps`: start (encode / prefill), one decode step, the loop, greedy and sampled ids;
- :mod:`.sampling`: the frozen :class:`Sampling` settings; arg-max or a draw with temperature,
  top-k, top-p and an explicit generator; :class:`Penalties` (presence, frequency, repetition, logit
  bias) applied to a row before the choice;
- :mod:`.grammar`: structured output, a :class:`Grammar` (JSON, a JSON schema, a regex, a choice, Lark)
  held token by token with llguidance's masks;
- :mod:`.beam`: beam search on the same steps, beams sharing their prefix's cache blocks;
- :mod:`.text`: text in, text out (``translate``, ``generate``).
"""

from attnmask.decode.beam import (  # noqa: F401
    Hypothesis,
    beam_search,
    best_tokens,
)
from attnmask.decode.grammar import Grammar  # noqa: F401
from attnmask.decode.sampling import (  # noqa: F401
    DEFAULT_TEMPERATURE,
    GREEDY,
    NO_PENALTIES,
    Penalties,
    Sampling,
    TokenHistory,
    check_sampling,
    filter_logits,
    penalize,
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
