"""A decoder run one layer at a time: the arguments the model's own forward gives each decoder layer.

The model's forward is run once per batch with every decoder layer replaced by a ``LayerCatcher``, which records
its call (causal mask, rotary position embeddings, position ids, a per-layer attention type) and passes the hidden
states on unchanged; the last one stops the forward before the final norm and head. Each layer can then run over
every batch in turn with the recorded arguments (``streaming.profile``: one layer's weights in memory at a time;
``core.fitting.layerwise_inputs``: one layer's calibration activations at a time). This is the model's own code path,
so families that scale embeddings (Gemma) or alternate sliding and full attention (Gemma 2/3, Qwen2) need nothing
special.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .models import ModelAdapter

#: per layer index, the ``(args, kwargs)`` its forward received; ``"input"``: the first layer's hidden states
LayerCalls = dict[Any, Any]


class LayerCatcher(nn.Module):
    """Stands in for decoder layer ``index``: records the arguments the model's forward gives it."""

    class Done(Exception):
        pass

    def __init__(self, index: int, last: bool, calls: LayerCalls, original: nn.Module) -> None:
        super().__init__()
        self.index, self.last, self.calls = index, last, calls
        if hasattr(original, "attention_type"):  # read by some decoders' loops
            self.attention_type = original.attention_type

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.index == 0:
            self.calls["input"] = hidden_states
        self.calls[self.index] = (args, kwargs)
        if self.last:
            raise self.Done  # the final norm and head are not needed
        return hidden_states


def layer_list_name(adapter: ModelAdapter) -> str:
    """The decoder layers' module list, named from the decoder (``layers`` for most families)."""
    decoder = adapter.decoder()
    return next(n for n, m in decoder.named_modules() if m is adapter.layers[0].block).rsplit(".", 1)[0]


def catch_calls(decoder: nn.Module, name: str, n_layers: int, **inputs: Any) -> LayerCalls:
    """Run ``decoder(**inputs, use_cache=False)`` with a ``LayerCatcher`` in each of its ``n_layers`` layers (the
    module list ``name``), the layers put back afterwards; returns what they caught."""
    calls: LayerCalls = {}
    originals = decoder.get_submodule(name)
    decoder.set_submodule(name, nn.ModuleList(
        LayerCatcher(i, i == n_layers - 1, calls, originals[i]) for i in range(n_layers)))
    try:
        decoder(**inputs, use_cache=False)
    except LayerCatcher.Done:
        pass
    finally:
        decoder.set_submodule(name, originals)
    return calls


def run_layer(block: nn.Module, hidden: torch.Tensor, call: tuple[Any, Any]) -> torch.Tensor:
    """Decoder layer ``block`` on ``hidden`` with a caught call's arguments: its output hidden states."""
    args, kwargs = call
    out = block(hidden, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out
