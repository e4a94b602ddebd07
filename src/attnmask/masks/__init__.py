"""Attention masks: one polarity (bool, **True = may attend**, broadcastable to ``(B, H|1, Tq, Tk)``),
structured and composable with ``& | ~``.

- :mod:`.core`: the :class:`Mask` predicate, its algebra, and where masks become tensors;
- :mod:`.structured`: causal, padding, sliding window, prefix LM, document, predicates;
- :mod:`.foreign`: named converters to and from nn.MultiheadAttention, additive, Hugging Face and
  TensorFlow conventions;
- :mod:`.lint`: the checks that reject ambiguous raw tensors where they enter the API.
"""

from attnmask.masks.core import (
    ALIGNMENTS,
    And,
    Mask,
    Not,
    Or,
    TensorMask,
    from_tensor,
    query_start,
)
from attnmask.masks.foreign import from_additive, from_hf, from_mha, from_tf, from_tf_padding, to_hf, to_mha, to_tf
from attnmask.masks.lint import BLOCK_THRESHOLD, additive_to_bool, check_additive, lint_polarity
from attnmask.masks.structured import (
    Causal,
    Document,
    KeyPadding,
    Predicate,
    PrefixLM,
    QueryPadding,
    SlidingWindow,
    causal,
    document,
    from_predicate,
    padding,
    prefix_lm,
    query_padding,
    sliding_window,
)

__all__ = [
    "Mask", "Causal", "KeyPadding", "QueryPadding", "SlidingWindow", "PrefixLM", "Document", "Predicate",
    "TensorMask", "And", "Or", "Not", "causal", "padding", "query_padding", "sliding_window", "prefix_lm",
    "document", "from_predicate", "from_tensor", "from_additive", "additive_to_bool", "to_mha", "from_mha",
    "from_hf", "to_hf", "from_tf", "from_tf_padding", "to_tf", "check_additive", "lint_polarity", "query_start",
    "BLOCK_THRESHOLD", "ALIGNMENTS",
]  # fmt: skip
