"""attnmask's operators with native kernels: every C/C++ source of the project and its Python face.

- :mod:`.blocks`: products with GGUF block weights (Q4_1, Q8_0, Q5_0, Q4_K, Q6_K) as stored,
  ``block_matmul`` and ``block_dequantize``, the layouts the kernel reads (``repack`` / ``unpack``), and
  the float32 product from a weight packed once (``pack_block_panels``, ``block_panels_matmul``);
- :mod:`.decoding`: the packed decoding step's operators (norms, SwiGLU, few-row products,
  ``paged_attend``: attention through a paged cache's block tables, ``packed_step``: the whole step
  in one call);
- :mod:`.native`: the one native library holding their CPU kernels (``csrc/``), built on first use
  (:func:`available`, :func:`load`, :func:`status`); ``attnmask kernels`` shows and builds it;
- :mod:`.build`: the loader (``load_library``: content-hashed name, atomic publish, a notice before
  a build, the compiler's first error and a build log on failure, older builds pruned) and
  :func:`cache_dir`, the folder for compiled kernels and converted weights.

Every operator is a ``torch.library`` operator with its PyTorch definition registered for all
devices, so it works (and ``torch.compile`` traces it) with or without the native build; the CPU
kernels, where built, compute the same function. Operators depend on each other through declared
imports (``decoding`` imports ``blocks``; ``csrc/decoding.cpp`` includes ``csrc/blocks.h``), never by
looking a name up in the dispatcher.
"""

from attnmask.ops import blocks, decoding  # noqa: F401  (defines the operators' schemas)
from attnmask.ops.blocks import (  # noqa: F401
    BLOCK_BYTES,
    QK,
    block_dequantize,
    block_matmul,
    block_panels_matmul,
    check_buffers,
    dequantize_blocks,
    pack_block_panels,
    repack,
    unpack,
)
from attnmask.ops.build import BuildError, cache_dir, load_library  # noqa: F401
from attnmask.ops.native import OPERATORS, Status, available, load, status  # noqa: F401
