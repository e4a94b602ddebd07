"""The ``layer reach`` check: no decoder layer reaches further back than its own declared window.

A whole forward says nothing about a sliding window once one layer attends to everything (Gemma 3:
every sixth layer), so each decoder layer is measured alone, on its own input in one forward of the
model (:class:`~attnmask.audit.layers.LayerCall`: its own masks and positions), at the last position
``q = T - 1`` of a random sequence a little longer than the widest window (``W +``
:data:`REACH_MARGIN` tokens; the audit's length when no layer has a window):

- gradient: ``G[j] = ‖∂(r · Y_q) / ∂X_j‖`` for a random vector r; the layer *reaches* ``q - j`` back
  for the farthest ``j`` with ``G[j]`` above ``1e-6 ε max G`` (masked keys give exactly zero);
- perturbation, without gradients (the path inference runs): noise on every key beyond the window
  (``j <= q - w``, each at its own scale) must leave ``Y_q`` unchanged within the dtype's tolerance;
  how far noise on the oldest key the layer may see (``q - w + 1``, or 0 for a full layer) moves it is
  reported (a note when it stays within the tolerance: a key may matter little without being masked).

A layer of window ``w`` (``ModelConfig.layer_window``) may reach ``w - 1`` back; a full layer every
earlier key. Findings name the layer: a reach beyond its window (gradient or perturbation: a leak), or a
gradient reach short of what the layer declares (its window disagrees with its mask). Skipped for a model that offers no
access to its decoder layers (``Subject.layer_calls``). Encoder-decoders: the decoder's layers, their
cross-attention over one fixed source.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnmask.audit.checks.gradient import GRADIENT_EPS_FACTOR
from attnmask.audit.checks.probe import Probe
from attnmask.audit.report import CheckResult, LayerReach

__all__ = ["check_layer_reach", "REACH_MARGIN"]

REACH_MARGIN = 16  # tokens beyond the widest window: keys the windowed layers must not reach


def reach_length(probe: Probe) -> int:
    """The sequence length measured: the audit's length, or ``W + REACH_MARGIN`` for a widest window W,
    no longer than the model takes."""
    windows = probe.subject.layer_windows or ()
    T = max([probe.T, *(w + REACH_MARGIN for w in windows if w)])
    return min(T, probe.subject.max_len) if probe.subject.max_len else T


def _gradient_profile(call, x: Tensor, q: int, gen: torch.Generator) -> Tensor:
    """``G[j] = ‖∂(r · Y_q) / ∂X_j‖`` of one layer, ``(T,)`` in float64."""
    X = x.detach().clone().requires_grad_(True)  # (1, T, C)
    r = torch.randn(x.shape[-1], generator=gen, dtype=torch.float64)  # (C,)
    with torch.enable_grad():
        y = call(X)  # (1, T, C)
        (g,) = torch.autograd.grad((y[0, q].double() * r.to(y.device)).sum(), X)  # (1, T, C)
    return g[0].double().norm(dim=-1).cpu()  # (T,)


@torch.no_grad()
def _moved(call, x: Tensor, base: Tensor, keys: Tensor, q: int, noise: Tensor, probe: Probe) -> tuple[float, float]:
    """``(max |Δ Y_q|, max |Δ| / tolerance)`` when noise is added to the inputs at ``keys``."""
    rms = x[0, keys].double().pow(2).mean(-1, keepdim=True).sqrt().clamp(min=1e-3)  # (K, 1): each key's own scale
    perturbed = x.clone()
    perturbed[0, keys] += (noise[keys] * rms).to(x.dtype).to(x.device)
    out = call(perturbed)[0, q].double().cpu()  # (C,)
    delta = torch.nan_to_num((out - base).abs(), nan=float("inf"))
    return float(delta.max()), float(probe.tol.ratio(delta, base).max())


def check_layer_reach(probe: Probe) -> CheckResult:
    subject = probe.subject
    if subject.layer_calls is None or not subject.layer_windows:
        return CheckResult("layer reach", passed=True, skipped="the model offers no access to its decoder layers")
    T = reach_length(probe)
    q = T - 1
    ids = probe.draw(probe.allowed, (1, T))  # (1, T)
    with torch.no_grad():
        args = (ids, probe.ones(1, T))
        if subject.encoder_decoder:  # the decoder's self-attention, over the first source sequence
            args = (probe.src[:1], probe.ones(1, probe.S), *args)
        calls = subject.layer_calls(*args)
    if len(calls) != len(subject.layer_windows):
        return CheckResult(
            "layer reach",
            passed=False,
            problems=[f"{len(calls)} decoder layers ran, but {len(subject.layer_windows)} declare windows"],
        )
    eps = torch.finfo(probe.dtype).eps
    problems, rows = [], []
    worst = 0.0  # the largest deviation beyond any window (should be zero)
    for lc, w in zip(calls, subject.layer_windows):
        allowed = min(w - 1, q) if w else q  # how far back the declared mask lets position q see
        grad = _gradient_profile(lc.call, lc.input, q, probe.gen)  # (T,)
        threshold = GRADIENT_EPS_FACTOR * eps * float(grad.max())
        reached = (grad[:q] > threshold).nonzero().flatten()  # earlier keys with a gradient
        reach = q - int(reached.min()) if len(reached) else 0
        noise = torch.randn(T, lc.input.shape[-1], generator=probe.gen, dtype=torch.float64)  # (T, C)
        with torch.no_grad():
            base = lc.call(lc.input)[0, q].double().cpu()  # (C,)
        far_dev = far_ratio = 0.0
        if allowed < q:  # keys beyond the window exist: none may move the output
            far_dev, far_ratio = _moved(lc.call, lc.input, base, torch.arange(0, q - allowed), q, noise, probe)
        _, edge_ratio = _moved(lc.call, lc.input, base, torch.tensor([q - allowed]), q, noise, probe)
        worst = max(worst, far_dev)
        kind = f"window {w}" if w else "full"
        n_problems = len(problems)
        if reach > allowed or far_ratio > 1:
            problems.append(
                f"layer {lc.index} ({kind}) reaches {max(reach, allowed + 1)} back, beyond its window "
                f"({allowed} back): gradient to {reach} back, keys beyond moved it {far_ratio:.3g}x the tolerance"
            )
        elif reach < allowed:
            declared = f"declares window {w} (reach {allowed} back)" if w else f"is full (reach {allowed} back)"
            problems.append(
                f"layer {lc.index} {declared} but its output at {q} has a gradient only {reach} back: "
                "its mask is narrower than declared"
            )
        elif edge_ratio <= 1:
            probe.notes.append(
                f"layer reach: noise on the oldest key layer {lc.index} may see ({allowed} back) moved its output "
                f"by {edge_ratio:.3g}x the tolerance only (its gradient there is {float(grad[q - allowed]):.3g})"
            )
        beyond = far_dev if allowed < q else None
        passed = len(problems) == n_problems
        rows.append(LayerReach(lc.index, w, allowed, reach, beyond, edge_ratio, passed, grad.float()))
    probe.layer_reach = rows
    windowed = sorted({w for w in subject.layer_windows if w})
    return CheckResult(
        "layer reach",
        passed=not problems,
        max_deviation=worst,
        tolerance=f"beyond a window: ‖∂‖ <= {GRADIENT_EPS_FACTOR:g}·eps·max, {probe.tol}",
        problems=problems,
        details=[
            f"{len(calls)} decoder layers, each alone on its own input, output at position {q} of T={T}",
            f"windows {windowed}" if windowed else "no layer has a window: each reaches every earlier key",
        ],
    )
