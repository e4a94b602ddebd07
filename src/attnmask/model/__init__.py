"""Transformer models built from one config: encoder-decoder (translation) and decoder-only.

- :mod:`.config`: :class:`ModelConfig`, one spelling per field;
- :mod:`.layers`: norms, the MLP, sinusoidal and rotary positions;
- :mod:`.transformer`: the Transformer layer and model, the loss, fused projections;
- :mod:`.loss`: the training loss through ``W_pred`` in chunks, without the whole logits;
- :mod:`.cache`: the paged KV cache that decoding fills (:class:`~attnmask.model.cache.PagedKVCache`).
"""

from attnmask.model.config import (  # noqa: F401
    ACTIVATIONS,
    ARCHS,
    NORM_POSITIONS,
    NORMS,
    POSITIONS,
    ROPE_SCALING_KEYS,
    ModelConfig,
    check_rope_scaling,
)
from attnmask.model.layers import (  # noqa: F401
    MLP,
    RMSNorm,
    Rotary,
    make_norm,
    scale_rope_frequencies,
    sinusoidal_table,
)
from attnmask.model.loss import head_loss  # noqa: F401
from attnmask.model.transformer import (  # noqa: F401
    ModelOutput,
    Transformer,
    TransformerLayer,
    fuse_projections_,
    lm_loss,
    segment_positions,
)
