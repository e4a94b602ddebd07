"""Teacher-forced training: config, the loop, task adapters, evaluation and the run directory.

- :mod:`.config`: ``TrainConfig`` split by concern (data, model, optimisation, run);
- :mod:`.loop`: the trainer and ``train``;
- :mod:`.tasks`: translation and language-model tasks behind one protocol;
- :mod:`.chat`: the chat fine-tuning task (conversations in a pretrained model's template, packed
  rows, the loss on the assistant's tokens);
- :mod:`.init`: ``--init MODEL``, the pretrained model, tokenizer and chat template a fine-tuning
  run starts from;
- :mod:`.evaluate`: validation loss, BLEU / chrF / exact match, perplexity;
- :mod:`.rundir`: the run directory's layout and ``load_run``;
- :mod:`.checkpoint`, :mod:`.distributed`: atomic files and exact resume; DDP with torchrun;
- :mod:`.fsdp`: ``--fsdp``, FSDP2 under torchrun, sharded checkpoints that resume on any number of
  processes;
- :mod:`.export`: a trained decoder (LoRA adapters merged) as a Hugging Face directory or a GGUF
  file (``attnmask export``).
"""

from attnmask.train.checkpoint import (  # noqa: F401
    atomic_write,
    atomic_write_bytes,
    atomic_write_text,
    load_torch,
    load_weights,
    remove_stale_temporaries,
    rng_state,
    save_torch,
    save_weights,
    set_rng_state,
)
from attnmask.train.config import (  # noqa: F401
    MODEL_PRESETS,
    PRECISIONS,
    RESUME_OVERRIDES,
    DataConfig,
    ModelSettings,
    OptimConfig,
    RunConfig,
    TrainConfig,
    resume_config,
)
from attnmask.train.distributed import (  # noqa: F401
    Dist,
    all_gather_objects,
    all_reduce_sum,
    barrier,
    setup,
    teardown,
)
from attnmask.train.evaluate import (  # noqa: F401
    evaluate_lm,
    evaluate_translation,
    translate_ids,
    translation_scores,
)
from attnmask.train.logger import TrainLogger  # noqa: F401
from attnmask.train.loop import (  # noqa: F401
    StepHook,
    Trainer,
    TrainResult,
    learning_rate,
    param_groups,
    train,
)
from attnmask.train.rundir import (  # noqa: F401
    CONFIG,
    FORMAT_VERSION,
    LOSS_PLOT,
    METRICS,
    SRC_TOKENIZER,
    TASKS,
    TENSORBOARD,
    TOKENIZER,
    TRAINER_STATE,
    WEIGHTS,
    Run,
    RunDir,
    load_run,
    load_tokenizers,
    plot_losses,
    read_config,
    read_metrics,
    truncate_metrics,
    write_config,
)
from attnmask.train.tasks import (  # noqa: F401
    HOLDOUT_FRACTION,
    HOLDOUT_MAX,
    Batch,
    LMTask,
    TrainingTask,
    TranslationTask,
    build_task,
    build_tokenizer,
    lm_task,
    translation_task,
)
