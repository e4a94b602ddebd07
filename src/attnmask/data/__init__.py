"""Data: text files, tokenizers, teacher-forcing batches, batch samplers and synthetic tasks.

- :mod:`.files`: UTF-8 / gzip corpora read with errors that name the file and line;
- :mod:`.tokenizer`: BPE or character tokenizers (Hugging Face ``tokenizers``);
- :mod:`.collate`: padded and packed teacher-forcing batches (labels = target shifted by one, pads ignored);
- :mod:`.samplers`: which examples form a batch (token budgets, length buckets, LM streams);
- :mod:`.synthetic`: generated tasks that need no download (dates to ISO 8601)."""

from attnmask.data.collate import (  # noqa: F401
    IGNORE_INDEX,
    PAD_SEGMENT,
    LMBatch,
    PackedTranslationBatch,
    TranslationBatch,
    make_lm_batch,
    make_packed_translation_batch,
    make_translation_batch,
    translation_lengths,
)
from attnmask.data.files import (  # noqa: F401
    DataError,
    LinesResult,
    ParallelResult,
    read_lines,
    read_parallel,
    read_text,
)
from attnmask.data.samplers import (  # noqa: F401
    Lengths,
    LMStream,
    PackingBatcher,
    TokenBucketBatcher,
    iter_eval_blocks,
    padding_fraction,
)
from attnmask.data.synthetic import (  # noqa: F401
    DATE_TEMPLATES,
    SPLITS,
    TWO_DIGIT_YEAR_WINDOW,
    Task,
    date_fields,
    format_date,
    get_task,
    make_date_pairs,
    ordinal_suffix,
    ordinal_words,
    split_of,
    task_registry,
)
from attnmask.data.tokenizer import (  # noqa: F401
    MIN_BPE_VOCAB_SIZE,
    SPECIAL_TOKENS,
    TOKENIZER_FILENAME,
    Tokenizer,
)
