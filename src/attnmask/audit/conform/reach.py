"""The ``layer reach`` scenario: how far back each decoder layer of a Hugging Face model attends.

A model whose layers differ (Gemma 3: five of six layers see the last W keys, the sixth every earlier
one) has no single reach for the whole stack, so each layer is measured alone, inside the model's
own forward (its own masks, under the implementation being tested): a first forward records every
layer's input ``X_i`` and output ``Y_i``; a second one feeds each layer ``X_i + Δ`` instead of what
the layer below produced (so each layer sees its own perturbation only) and records its output.

With ``T = W + 8`` tokens and the last position ``q = T - 1`` as the query:

- ``far``: ``Δ`` on every position at least ``W`` back (``j <= q - W``): a sliding layer's output at
  ``q`` must not move (beyond the ``"unchanged"`` tolerance); a full layer's must;
- ``near``: ``Δ`` on position ``q - W + 1`` alone, the oldest key in the window: every layer's output
  at ``q`` must move.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnmask.audit.conform.report import ConformResult
from attnmask.audit.layers import decoder_layers
from attnmask.audit.tolerance import Tolerance

__all__ = ["decoder_layers", "layer_reach"]


def _hidden(out) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def _run(model, ids: Tensor, layers: nn.ModuleList, delta: Tensor | None, inputs: list[Tensor]) -> list[Tensor]:
    """Every layer's output of one forward; with ``delta``, layer i's input is ``inputs[i] + delta``."""
    outputs: list[Tensor | None] = [None] * len(layers)
    handles = []
    for i, layer in enumerate(layers):

        def pre(_mod, args, kwargs, i=i):
            x = args[0] if args else kwargs["hidden_states"]
            if delta is None:
                inputs.append(x.clone())
                return None
            x = inputs[i] + delta
            return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

        def post(_mod, _args, out, i=i):
            outputs[i] = _hidden(out).clone()

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post))
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return outputs


def layer_reach(model, impl: str, windows: list[int | None], *, vocab: int, seed: int, dtype) -> ConformResult:
    """One ``layer reach`` result for ``impl``: every layer measured as the module docstring says."""
    layers = decoder_layers(model)
    if layers is None or len(layers) != len(windows):
        return ConformResult("layer reach", impl, True, skipped="the decoder layers were not found")
    if all(w is None for w in windows):
        return ConformResult("layer reach", impl, True, skipped="no sliding window")
    W = max(w for w in windows if w is not None)
    T = W + 8
    q = T - 1
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (1, T), generator=gen).to(device)  # (1, T)
    inputs: list[Tensor] = []
    base = _run(model, ids, layers, None, inputs)
    C = inputs[0].shape[-1]
    noise = torch.randn(1, T, C, generator=gen).to(device=device, dtype=inputs[0].dtype)  # (1, T, C)
    scale = inputs[0].abs().amax()  # perturbations on the scale of the hidden states
    tol = Tolerance.for_dtype(dtype)

    def moved(positions: Tensor) -> list[float]:
        delta = torch.zeros_like(noise)
        delta[:, positions] = noise[:, positions] * scale
        out = _run(model, ids, layers, delta, inputs)
        return [float(tol.ratio((o[0, q] - b[0, q]).abs(), b[0, q]).max()) for o, b in zip(out, base)]

    far = moved(torch.arange(0, q - W + 1))  # every key at least W back (W = the widest window)
    near = [moved(torch.tensor([q - w + 1]))[i] if w else 2.0 for i, w in enumerate(windows)]
    bad = []
    for i, w in enumerate(windows):
        if w is not None and w == W and far[i] > 1:
            bad.append(f"sliding layer {i} moves with keys {W} or more back ({far[i]:.1f}x the tolerance)")
        if w is None and far[i] <= 1:
            bad.append(f"full layer {i} ignores keys {W} or more back")
        if w is not None and near[i] <= 1:
            bad.append(f"layer {i} ignores the oldest key of its window ({w - 1} back)")
    sliding = [i for i, w in enumerate(windows) if w is not None]
    full = [i for i, w in enumerate(windows) if w is None]
    res = ConformResult(
        "layer reach",
        impl,
        passed=not bad,
        max_deviation=max((far[i] for i in sliding), default=0.0),
        tolerance=f"{tol} (deviation in multiples of it)",
    )
    res.detail = (
        "; ".join(bad[:3])
        if bad
        else f"sliding layers {sliding}: reach {W - 1} back, keys {W} back have no effect; full layers {full}: "
        f"reach every earlier key (T={T}, query {q})"
    )
    return res
