"""The ``gradient`` check: no output has a gradient with respect to a blocked token's embedding.

``G[i, j] = ‖∂(r · logits_i) / ∂ embeds_j‖`` for a random vector r. Masked attention gives exactly
zero there, so any blocked pair with ``G[i, j] > 1e-6 ε G.max()`` is a leak: this check catches
structural leaks however weak (e.g. a look-ahead of one position reaching two positions through two
layers), where the perturbation check reports only leaks that move the logits beyond rounding.
Skipped for a model that offers no input embeddings (``Subject.forward_with_embeds``).
"""

from __future__ import annotations

import torch

from attnmask.audit.checks.probe import Probe, as_logits
from attnmask.audit.report import CheckResult, Leak

__all__ = ["check_gradient", "GRADIENT_EPS_FACTOR"]

GRADIENT_EPS_FACTOR = 1e-6  # a gradient above this times eps times the largest one is not zero


def check_gradient(probe: Probe) -> CheckResult:
    subject = probe.subject
    if subject.forward_with_embeds is None:
        return CheckResult("gradient", passed=True, skipped="the model offers no input embeddings to differentiate")
    T = probe.T
    r = torch.randn(subject.vocab_size, generator=probe.gen, dtype=torch.float64)  # (V,)
    grad = torch.zeros(T, T, dtype=torch.float64)  # (T, T)
    diag = torch.arange(T)
    for n in range(probe.N):
        rows = probe.tgt[n].expand(T, T).clone()  # (T, T): row i is read at position i
        args = (rows, probe.ones(T, T))
        if subject.encoder_decoder:
            args = (probe.src[n].expand(T, probe.S), probe.ones(T, probe.S), *args)
        with torch.enable_grad():
            logits, embeds = subject.forward_with_embeds(*args)
            logits = as_logits(logits, rows.shape)
            picked = logits[diag, diag].double()  # (T, V): output i of row i
            (g,) = torch.autograd.grad((picked * r.to(picked.device)).sum(), embeds)  # (T, T, C)
        grad = torch.maximum(grad, g.detach().double().norm(dim=-1).cpu())
    probe.gradient = grad.float()
    blocked = ~probe.intended
    threshold = GRADIENT_EPS_FACTOR * torch.finfo(probe.dtype).eps * float(grad.max())
    over = ((grad > threshold) & blocked).nonzero().tolist()
    leaks = [Leak("gradient", i, j, float(grad[i, j])) for i, j in over]
    return CheckResult(
        "gradient",
        passed=not leaks,
        max_deviation=float(grad[blocked].max()) if blocked.any() else 0.0,
        tolerance=f"‖∂‖ <= {GRADIENT_EPS_FACTOR:g}·eps·max = {threshold:.2g}: exactly zero",
        leaks=leaks,
        details=[f"{probe.N} sequences, one backward pass each over {T} copies"],
    )
