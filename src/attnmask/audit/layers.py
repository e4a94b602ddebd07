"""Each decoder layer alone: what it got in one forward of the whole model, and a call of it by itself.

A model whose layers differ (Gemma 3: sliding-window layers beside full ones) has no single reach for
the whole stack, since one full layer makes the whole forward reach every earlier token. Each layer
is therefore measured alone, on its own input: :func:`record_layer_calls` runs the model once with a
hook on every layer, keeps what each layer received (its input ``X_i``, and the rest of its
arguments: masks, rotary positions), and returns one :class:`LayerCall` per layer, which computes that
layer's output from an input of the caller's choosing under the very same masks and positions.

:func:`decoder_layers` finds the decoder layers of a Hugging Face causal LM; :func:`hf_layer_windows`
reads each one's sliding window from its config, as ``transformers`` applies it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn

__all__ = ["LayerCall", "record_layer_calls", "decoder_layers", "hf_layer_windows"]


@dataclass
class LayerCall:
    """One decoder layer, as it ran in one forward of the whole model."""

    index: int  # position of the layer in the stack, from 0
    input: Tensor  # (B, T, C): the hidden states the layer received in that forward
    call: Callable[[Tensor], Tensor]  # (B, T, C) -> the layer's output (B, T, C), same masks and positions


def _hidden(out) -> Tensor:
    """A layer's output hidden states (Hugging Face layers may return a tuple)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def record_layer_calls(layers: Sequence[nn.Module], forward: Callable[[], object]) -> list[LayerCall]:
    """Run ``forward()`` once (the whole model) and return a :class:`LayerCall` for each of ``layers``.

    The hidden states are the layer's first positional argument, or its ``hidden_states`` keyword
    (Hugging Face); every other argument is kept as the layer received it and passed again on each call.
    """
    seen: dict[int, tuple[tuple, dict]] = {}

    def hook(i: int):
        def pre(_mod, args, kwargs):
            seen.setdefault(i, (args, kwargs))  # the first call: a layer run twice keeps its first inputs

        return pre

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        forward()
    finally:
        for h in handles:
            h.remove()
    calls = []
    for i, layer in enumerate(layers):
        if i not in seen:
            raise RuntimeError(f"decoder layer {i} did not run in the forward")
        args, kwargs = seen[i]

        def call(x: Tensor, layer=layer, args=args, kwargs=kwargs) -> Tensor:
            if args:
                return _hidden(layer(x, *args[1:], **kwargs))
            return _hidden(layer(*args, **{**kwargs, "hidden_states": x}))

        x = args[0] if args else kwargs["hidden_states"]
        calls.append(LayerCall(i, x.detach(), call))
    return calls


def decoder_layers(model) -> nn.ModuleList | None:
    """The decoder layers of a Hugging Face causal LM (``model.model.layers``, GPT-2's ``transformer.h``)."""
    for path in ("model.layers", "model.decoder.layers", "transformer.h"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList):
            return obj
    return None


def hf_layer_windows(config) -> list[int | None]:
    """The sliding window of each decoder layer of a Hugging Face config (None: full attention), as
    ``transformers`` applies it: a query at position i sees keys ``i - W < j <= i``."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None) or getattr(cfg, "num_layers", 0)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    if getattr(cfg, "use_sliding_window", True) is False:
        window = None
    return [window] * n
