"""Beam search on the cached decoder, for both model kinds.

Each source (or prompt) keeps ``beam_size`` running hypotheses, scored by the sum of their
tokens' log-probabilities. Every step extends each hypothesis by every token, keeps the
``2 * beam_size`` best candidates of the row, turns the ``<eos>`` ones that rank among the best
``beam_size`` into finished hypotheses (as fairseq and Hugging Face do, so ``beam_size=1`` *is*
greedy decoding), and continues with the ``beam_size`` best others. Each survivor's rows are then a
fork of its parent's (:meth:`attnmask.decode.steps.DecodeState.select`): the same cache blocks, shared
and reference-counted, nothing copied but the last, partly written block of a parent with several
children, copied on the child's first write into it.

A finished hypothesis of ``n`` generated tokens (``<eos>`` included) scores
``logprob / n ** length_penalty``; ``length_penalty > 0`` favours longer outputs, ``0`` compares raw
log-probabilities. A row is done when it holds ``beam_size`` finished hypotheses and none of its
running ones can beat the worst of them (Hugging Face's default, ``early_stopping=False``), or at
its length limit, where its running hypotheses count as unfinished results. Done rows leave the
batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attnmask.data.tokenizer import EOS_ID, SOS_ID
from attnmask.decode.steps import Ids, StopIds, decode_step, eval_mode, is_stop, start, stop_set
from attnmask.errors import UserError

__all__ = ["Hypothesis", "beam_search", "best_tokens"]


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]  # generated ids, without <eos>
    logprob: float  # sum of the log-probabilities of the generated tokens (<eos> included)
    score: float  # logprob / length ** length_penalty, the ranking key
    finished: bool  # ended with <eos> (False: cut at the length limit)


def _length_norm(n: int, length_penalty: float) -> float:
    return n**length_penalty


def _add(hyps: list[Hypothesis], hyp: Hypothesis, beam_size: int) -> None:
    """Insert ``hyp``, keeping the ``beam_size`` best by score (best first)."""
    hyps.append(hyp)
    hyps.sort(key=lambda h: -h.score)
    del hyps[beam_size:]


@torch.inference_mode()
def beam_search(
    model,
    *,
    src: Ids | None = None,
    prompts: Ids | None = None,
    beam_size: int = 4,
    max_new_tokens: int | Sequence[int] | None = None,
    length_penalty: float = 1.0,
    n_best: int = 1,
    eos_id: StopIds = EOS_ID,
    sos_id: int = SOS_ID,
) -> list[list[Hypothesis]]:
    """Beam search; returns the ``n_best`` best hypotheses of each row, best first.

    Inputs as for :func:`attnmask.decode.start` (``src=`` for encoder-decoder models, ``prompts=``
    for decoder-only ones).

    Raises ValueError for ``beam_size < 1`` or ``n_best`` outside ``[1, beam_size]``.
    """
    if not isinstance(beam_size, int) or beam_size < 1:
        raise UserError(f"beam_size must be an int >= 1, got {beam_size!r}")
    if not isinstance(n_best, int) or not 1 <= n_best <= beam_size:
        raise UserError(f"n_best must be an int in [1, beam_size={beam_size}], got {n_best!r}")
    K = beam_size
    stops = stop_set(eos_id)
    with eval_mode(model):
        state, logits, limits = start(
            model, src=src, prompts=prompts, max_new_tokens=max_new_tokens, beams=K, sos_id=sos_id
        )
        B, V = logits.shape
        device = logits.device
        # every row's K beams start as copies of the prefilled row; only beam 0 is alive at first
        state.select(torch.arange(B, device=device).repeat_interleave(K))
        logp = logits.float().log_softmax(dim=-1).repeat_interleave(K, dim=0)  # (B*K, V)
        beam_logp = torch.full((B, K), float("-inf"), device=device)  # (B, K)
        beam_logp[:, 0] = 0.0
        max_steps = int(limits.max())
        history = torch.zeros(B, K, max_steps, dtype=torch.long, device=device)  # (b, K, steps)
        hyps: list[list[Hypothesis]] = [[] for _ in range(B)]
        rows = torch.arange(B, device=device)  # (b,) original row of each running row
        rank = torch.arange(2 * K, device=device)  # (2K,)

        for step in range(max_steps):
            b = rows.shape[0]
            row_ids = rows.tolist()
            length = step + 1
            norm = _length_norm(length, length_penalty)
            cand = beam_logp[:, :, None] + logp.view(b, K, V)  # (b, K, V)
            top_lp, top_idx = cand.view(b, K * V).topk(min(2 * K, K * V), dim=1)  # (b, 2K)
            parent, token = top_idx // V, top_idx % V  # (b, 2K)
            is_eos = is_stop(token, stops)  # (b, 2K)

            # <eos> among the K best candidates -> finished hypotheses
            finishing = is_eos[:, :K] & (top_lp[:, :K] > float("-inf"))  # (b, K)
            if bool(finishing.any()):
                for i, k in finishing.nonzero().tolist():
                    lp = float(top_lp[i, k])
                    toks = history[i, parent[i, k], :step].tolist()
                    _add(hyps[row_ids[i]], Hypothesis(toks, lp, lp / norm, True), K)

            # the K best candidates that are not <eos> continue (<eos> sorts after every other)
            order = (is_eos.long() * rank.numel() + rank).argsort(dim=1)[:, :K]  # (b, K)
            beam_logp = top_lp.gather(1, order)  # (b, K), best first
            parents = parent.gather(1, order)  # (b, K)
            tokens = token.gather(1, order)  # (b, K)
            history = history.gather(1, parents[:, :, None].expand(b, K, max_steps)).clone()  # (b, K, steps)
            history[:, :, step] = tokens

            at_limit = (limits[rows] <= length).tolist()
            best_alive = (beam_logp[:, 0] / norm).tolist()
            running = []
            for i in range(b):
                row_hyps = hyps[row_ids[i]]
                if at_limit[i]:
                    for k in range(K):
                        lp = float(beam_logp[i, k])
                        if lp > float("-inf"):
                            _add(row_hyps, Hypothesis(history[i, k, :length].tolist(), lp, lp / norm, False), K)
                elif not (len(row_hyps) == K and row_hyps[-1].score >= best_alive[i]):
                    running.append(i)
            if not running:
                break

            keep = torch.tensor(running, device=device)  # (b',)
            # cache row of each surviving beam: its parent, within the same source row
            index = (keep[:, None] * K + parents[keep]).view(-1)  # (b'*K,)
            state.select(index, cross=len(running) != b)
            rows, beam_logp, history = rows[keep], beam_logp[keep], history[keep]
            logits = decode_step(model, state, tokens[keep].view(-1))  # (b'*K, V)
            logp = logits.float().log_softmax(dim=-1)  # (b'*K, V)

    return [h[:n_best] for h in hyps]


def best_tokens(results: list[list[Hypothesis]]) -> list[list[int]]:
    """The best hypothesis's tokens of each row."""
    return [r[0].tokens if r else [] for r in results]
