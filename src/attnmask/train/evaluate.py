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
from torch import Tensor

from attnmask.data import make_translation_batch
from attnmask.data.batching import iter_eval_blocks
from attnmask.data.tokenizer import Tokenizer
from attnmask.model import Transformer, lm_loss
from attnmask.train import distributed
from attnmask.train.tasks import LMCorpus, TranslationCorpus


def source_tensor(src_ids: list[list[int]], tokenizer: Tokenizer) -> Tensor:
    """``(B, S)`` encoder input exactly as training builds it (ids + ``<eos>``, right padded)."""
    t = tokenizer
    empty_targets = [[] for _ in src_ids]
    return make_translation_batch(src_ids, empty_targets, pad_id=t.pad_id, sos_id=t.sos_id, eos_id=t.eos_id).src


@torch.no_grad()
def greedy_translate(model: Transformer, src: Tensor, *, max_len: int, sos_id: int, eos_id: int) -> list[list[int]]:
    """Greedy decoding without a cache (seed 000, eq. 9): the whole prefix is re-run every step.

    ``src (B, S)`` padded sources -> one id list per row, without ``<sos>``, up to (excluding)
    ``<eos>``. Simple and obviously right; :mod:`attnmask.decode` has the cached version.
    """
    memory_mask = model.source_mask(src)
    memory = model.encode(src, memory_mask)  # (B, S, C)
    B = src.shape[0]
    ys = torch.full((B, 1), sos_id, dtype=torch.long, device=src.device)  # (B, 1)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)  # (B,)
    pad = model.config.pad_id
    for _ in range(max_len):
        logits = model.decode(ys, memory, memory_mask=memory_mask, last_only=True)  # (B, 1, V)
        nxt = logits[:, -1].argmax(dim=-1)  # (B,)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)  # finished rows are padded
        ys = torch.cat([ys, nxt[:, None]], dim=1)  # (B, t + 1)
        done |= nxt == eos_id
        if bool(done.all()):
            break
    out = []
    for row in ys[:, 1:].tolist():
        out.append(row[: row.index(eos_id)] if eos_id in row else [i for i in row if i != pad])
    return out


def translate_ids(
    model: Transformer,
    src_ids: list[list[int]],
    tokenizer: Tokenizer,
    src_tokenizer: Tokenizer,
    *,
    device: torch.device,
    batch_size: int = 64,
    autocast: Callable = contextlib.nullcontext,
) -> list[list[int]]:
    """Greedy translations of tokenized sources (ids without specials), in their order.

    Uses the cached :func:`attnmask.decode.greedy` when that module is present, else
    :func:`greedy_translate`. Each row may generate ``1.5 * len(source + <eos>) + 10`` tokens at
    most (fairseq's rule), within the model's ``max_seq_len``.
    """
    try:
        from attnmask.decode import greedy as cached_greedy
    except ImportError:  # the decoding module is optional for training
        cached_greedy = None
    limit = model.config.max_seq_len - 1
    order = sorted(range(len(src_ids)), key=lambda i: len(src_ids[i]))
    out: list[list[int] | None] = [None] * len(src_ids)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            rows = [src_ids[i][: limit - 1] for i in idx]
            limits = [min(limit, int(1.5 * (len(r) + 1)) + 10) for r in rows]
            with autocast():
                if cached_greedy is not None:
                    src_rows = [r + [src_tokenizer.eos_id] for r in rows]  # as make_translation_batch builds them
                    hyps = cached_greedy(model, src=src_rows, max_new_tokens=limits, sos_id=tokenizer.sos_id,
                                         eos_id=tokenizer.eos_id)  # fmt: skip
                else:
                    src = source_tensor(rows, src_tokenizer).to(device)  # (b, S)
                    hyps = greedy_translate(model, src, max_len=max(limits), sos_id=tokenizer.sos_id,
                                            eos_id=tokenizer.eos_id)  # fmt: skip
                    hyps = [h[:n] for h, n in zip(hyps, limits)]
            for i, h in zip(idx, hyps):
                out[i] = h
    finally:
        model.train(was_training)
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
    corpus: TranslationCorpus,
    ctx: distributed.Dist,
    *,
    batch_tokens: int,
    max_sentences: int,
    autocast: Callable = contextlib.nullcontext,
) -> dict:
    """Validation loss over all validation pairs, BLEU/chrF/exact match over the first ``max_sentences``."""
    was_training = model.training
    model.eval()
    try:
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
                device=ctx.device, autocast=autocast,
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
    finally:
        model.train(was_training)


@torch.no_grad()
def evaluate_lm(
    model: Transformer,
    corpus: LMCorpus,
    ctx: distributed.Dist,
    *,
    block_size: int,
    batch_size: int,
    max_tokens: int | None = None,
    autocast: Callable = contextlib.nullcontext,
) -> dict:
    """Mean loss and perplexity over consecutive validation blocks (the first ``max_tokens`` if set)."""
    ids = corpus.valid_ids if max_tokens is None else corpus.valid_ids[: max_tokens + 1]
    was_training = model.training
    model.eval()
    try:
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
    finally:
        model.train(was_training)
