"""Evaluation during training: validation loss, greedy translations scored with sacreBLEU, perplexity.

Every function takes the *unwrapped* model (not the DDP wrapper) and a :class:`~attnmask.train.distributed.Dist`:
each rank evaluates its share, and sums / translations are gathered, so every rank returns the
same numbers as a single process would.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import sacrebleu
import torch

from attnmask.data.samplers import iter_eval_blocks
from attnmask.data.tokenizer import Tokenizer
from attnmask.decode import default_max_new_tokens, eval_mode, greedy, source_ids
from attnmask.model import Transformer, lm_loss
from attnmask.train import distributed


def translate_ids(
    model: Transformer,
    src_ids: list[list[int]],
    tokenizer: Tokenizer,
    src_tokenizer: Tokenizer,
    *,
    batch_size: int = 64,
    autocast: Callable = contextlib.nullcontext,
) -> list[list[int]]:
    """Greedy translations of tokenized sources (ids without specials), in their order.

    Each row may generate ``1.5 * len(source + <eos>) + 10`` tokens at most (fairseq's rule,
    :func:`attnmask.decode.default_max_new_tokens`), within the model's ``max_seq_len``. Batches
    are formed from sources of similar length.
    """
    limit = model.config.max_seq_len
    order = sorted(range(len(src_ids)), key=lambda i: len(src_ids[i]))
    out: list[list[int] | None] = [None] * len(src_ids)
    with eval_mode(model):
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            src_rows = source_ids(src_tokenizer, [src_ids[i][: limit - 1] for i in idx])  # as in training
            limits = [default_max_new_tokens(len(r), limit) for r in src_rows]
            with autocast():
                hyps = greedy(model, src=src_rows, max_new_tokens=limits, sos_id=tokenizer.sos_id,
                              eos_id=tokenizer.eos_id)  # fmt: skip
            for i, h in zip(idx, hyps):
                out[i] = h
    return out  # type: ignore[return-value]


def translation_scores(hypotheses: list[str], references: list[str]) -> dict:
    """Corpus BLEU and chrF (sacreBLEU defaults, detokenized text) and exact match, in percent/fraction."""
    return {
        "bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score,
        "chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score,
        "exact_match": sum(h.strip() == r.strip() for h, r in zip(hypotheses, references)) / max(len(references), 1),
    }


@torch.no_grad()
def evaluate_translation(
    model: Transformer,
    corpus,
    ctx: distributed.Dist,
    *,
    batch_tokens: int,
    max_sentences: int,
    autocast: Callable = contextlib.nullcontext,
) -> dict:
    """Validation loss over all validation pairs, BLEU/chrF/exact match over the first ``max_sentences``.

    ``corpus``: a :class:`~attnmask.train.tasks.TranslationTask`.
    """
    with eval_mode(model):
        batches = corpus.valid_batches(batch_tokens)[ctx.rank :: ctx.world_size]
        total = count = 0.0
        for idx in batches:
            b = corpus.batch(idx, split="valid").to(ctx.device)
            with autocast():
                logits = model(b.tgt_in, b.src).logits  # (B, T, V)
            loss_sum, n = lm_loss(logits, b.labels, reduction="sum")
            total, count = total + float(loss_sum), count + n
        total, count = distributed.all_reduce_sum(ctx, [total, count])
        result = {"loss": total / max(count, 1), "tokens": int(count)}
        n = min(max_sentences, len(corpus.valid_pairs))
        if n > 0:
            mine = list(range(ctx.rank, n, ctx.world_size))
            hyps = translate_ids(
                model, [corpus.valid_src[i] for i in mine], corpus.tokenizer, corpus.src_tokenizer,
                autocast=autocast,
            )  # fmt: skip
            texts = dict(zip(mine, corpus.tokenizer.decode_batch(hyps)))
            merged: dict[int, str] = {}
            for part in distributed.all_gather_objects(ctx, texts):
                merged.update(part)
            hypotheses = [merged[i] for i in range(n)]
            references = [corpus.valid_pairs[i][1] for i in range(n)]
            result.update(translation_scores(hypotheses, references))
            result["sentences"] = n
        return result


@torch.no_grad()
def evaluate_lm(
    model: Transformer,
    corpus,
    ctx: distributed.Dist,
    *,
    block_size: int,
    batch_size: int,
    max_tokens: int | None = None,
    autocast: Callable = contextlib.nullcontext,
) -> dict:
    """Mean loss and perplexity over consecutive validation blocks (the first ``max_tokens`` if set).

    ``corpus``: an :class:`~attnmask.train.tasks.LMTask`.
    """
    ids = corpus.valid_ids if max_tokens is None else corpus.valid_ids[: max_tokens + 1]
    with eval_mode(model):
        total = count = 0.0
        for k, (x, y) in enumerate(iter_eval_blocks(ids, block_size, batch_size)):
            if k % ctx.world_size != ctx.rank:
                continue
            x, y = x.to(ctx.device), y.to(ctx.device)  # (b, T), (b, T)
            with autocast():
                logits = model(x).logits  # (b, T, V)
            loss_sum, n = lm_loss(logits, y, reduction="sum")
            total, count = total + float(loss_sum), count + n
        total, count = distributed.all_reduce_sum(ctx, [total, count])
        loss = total / max(count, 1)
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": int(count)}
