"""The ``cross-request`` check: requests served together never see each other.

Several random sequences of different lengths run together through the serving engine's packed step
(:func:`attnmask.engine.step.packed_forward`: one packed row, one paged cache, prefill in chunks):

- replacing every token of one request must leave every *other* request's logits exactly as they
  were, at every position: not within a tolerance, bit for bit (anything else means one request's
  answer depends on who else is in the batch, through the mask or through a kernel);
- each request's logits must equal its logits when it runs alone, and when its prompt is fed in
  chunks of another size, bit for bit;
- requests that begin alike, answered in turn by the serving engine with prefix caching (the later
  ones start from the cache blocks an earlier one computed, another request's keys and values), must
  get the answers they get without it: tokens and log-probabilities, bit for bit.

Skipped for a model the engine cannot serve (encoder-decoders, foreign models).
"""

from __future__ import annotations

import torch

from attnmask.audit.checks.probe import Probe
from attnmask.audit.report import CheckResult

__all__ = ["check_cross_request"]

CHUNKS = (3, 1)  # prefill chunk sizes: the packed run, then another chunking for the solo runs


@torch.no_grad()
def check_cross_request(probe: Probe) -> CheckResult:
    run = probe.subject.packed_forward
    if run is None:
        return CheckResult("cross-request", passed=True, skipped="the model is not served by the packed step")
    T = probe.T
    # three requests of different lengths, so they sit at different offsets of the packed row
    lengths = [T, max(2, T - 3), max(2, T // 2)]
    seqs = [probe.draw(probe.allowed, (n,)).tolist() for n in lengths]
    together = run(seqs, CHUNKS[0])
    problems, details, worst = [], [], 0.0
    for i in range(len(seqs)):
        other = list(seqs)
        other[i] = probe._draw_other(torch.tensor(seqs[i]), probe.allowed).tolist()  # every token replaced
        moved = run(other, CHUNKS[0])
        for j in range(len(seqs)):
            if j == i:
                continue
            delta = float((moved[j].double() - together[j].double()).abs().max())
            worst = max(worst, delta)
            if not torch.equal(moved[j], together[j]):
                first = int((moved[j] != together[j]).any(-1).nonzero()[0, 0])
                problems.append(
                    f"replacing request {i}'s tokens moved request {j}'s logits (first at position {first}, "
                    f"max |Δ| {delta:.3g}): requests served together see each other"
                )
        details.append(f"request {i} replaced: {len(seqs) - 1} others unchanged")
    for j, seq in enumerate(seqs):
        alone = run([seq], CHUNKS[1])[0]
        if not torch.equal(alone, together[j]):
            delta = float((alone.double() - together[j].double()).abs().max())
            worst = max(worst, delta)
            problems.append(
                f"request {j} alone (chunks of {CHUNKS[1]}) differs from request {j} packed with others "
                f"(chunks of {CHUNKS[0]}): max |Δ| {delta:.3g}; its answer depends on the batch"
            )
    details.append(f"each request alone = packed, bit for bit ({len(seqs)} requests, lengths {lengths})")
    if probe.subject.engine_answers is not None:
        # a shared start of T tokens, then each request's own 2: the later ones reuse the first's blocks
        prompts = [seqs[0] + seq[:2] for seq in seqs]
        cached, found = probe.subject.engine_answers(prompts, True)
        fresh, _ = probe.subject.engine_answers(prompts, False)
        for j, (got, want) in enumerate(zip(cached, fresh)):
            if got != want:
                what = f"tokens {got[0]} where it answers {want[0]}" if got[0] != want[0] else "other log-probabilities"
                problems.append(
                    f"request {j}, started from another request's kept cache blocks (prefix caching), answers with "
                    f"{what} computing them itself: reused blocks are not its own bits"
                )
        if found == 0:
            problems.append("prefix caching found nothing kept: the requests' shared start was not reused")
        details.append(f"requests starting from another's kept blocks answer as alone, bit for bit ({found} "
                       "prompt positions reused)")  # fmt: skip
    return CheckResult(
        "cross-request",
        passed=not problems,
        max_deviation=worst,
        tolerance="bitwise",
        problems=problems,
        details=details,
    )
