"""Masked multi-head attention: ``softmax(QKᵀ/√D + M) V`` behind one function and a backend registry.

- :mod:`.plan`: :class:`PreparedMask`, a mask prepared once per forward for every layer, and the
  :class:`SdpaCall` plan a structured mask decomposes into;
- :mod:`.backends`: :func:`attention` and the kernels it can pick (reference, SDPA, SDPA calls, auto);
- :mod:`.modules`: :class:`MultiHeadAttention`, the projections around it.
"""

from attnmask.attention.backends import BACKENDS, Backend, attention, register_backend
from attnmask.attention.modules import MultiHeadAttention
from attnmask.attention.plan import PreparedMask, SdpaCall, prepare_mask

__all__ = [
    "attention",
    "prepare_mask",
    "PreparedMask",
    "SdpaCall",
    "MultiHeadAttention",
    "BACKENDS",
    "Backend",
    "register_backend",
]
