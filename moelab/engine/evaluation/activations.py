"""A dense model's FFN neurons on any text: per token, the activation of chosen neurons of one layer.

The quantity is the profiler's ``h = act(x W_gate) ⊙ (x W_up)`` (CM Eq. 1), the down projection's
input, read by the same tap the profiler's top tokens use (a forward pre-hook on ``down_proj``),
so a token the profile lists among a neuron's top tokens shows the same value here when it is in
the same context. One forward pass over the text; it stops right after the requested layer (the
layers above, and the LM head, never run).
"""

from __future__ import annotations

from typing import Any

import torch

from .probes import token_pieces

#: tokens of text an activation probe reads at most (one forward pass; the card shows every token)
MAX_ACTIVATION_TOKENS = 512
#: neurons one probe reports at most (one row each in the result)
MAX_ACTIVATION_NEURONS = 64


class _Stop(Exception):
    """Raised by the hook once the layer's h is read: the rest of the forward pass is not needed."""


def check_activation_request(d_ffn: list[int], layer: int, neurons: list[int]) -> None:
    """ValueError, saying what to fix, when ``layer`` or a neuron does not exist or too many are asked.
    ``d_ffn``: every layer's FFN width (a profile's manifest, or the loaded model's)."""
    if not 0 <= layer < len(d_ffn):
        raise ValueError(f"layer: the model has layers 0 … {len(d_ffn) - 1} (got {layer})")
    if not neurons:
        raise ValueError("neurons: give at least one neuron")
    if len(neurons) > MAX_ACTIVATION_NEURONS:
        raise ValueError(f"neurons: at most {MAX_ACTIVATION_NEURONS} per probe (got {len(neurons)})")
    bad = [n for n in neurons if not 0 <= n < d_ffn[layer]]
    if bad:
        raise ValueError(f"neurons: layer {layer} has {d_ffn[layer]} neurons, use 0 … {d_ffn[layer] - 1} (got {bad[:5]})")


def encode_text(tokenizer: Any, text: str, max_tokens: int = MAX_ACTIVATION_TOKENS) -> list[int]:
    """The text's token ids as the profiler tokenises a sample (special tokens included); refused,
    not truncated, past ``max_tokens``: a cut text would show activations of a different text."""
    ids = tokenizer(text)["input_ids"]
    if not ids:
        raise ValueError("the text tokenises to nothing: give at least one word")
    if len(ids) > max_tokens:
        raise ValueError(f"the text is {len(ids)} tokens long; an activation probe reads at most {max_tokens}: shorten it")
    return list(ids)


@torch.inference_mode()
def neuron_activations(adapter: Any, text: str, layer: int, neurons: list[int],
                       max_tokens: int = MAX_ACTIVATION_TOKENS) -> dict[str, Any]:
    """h of ``neurons`` of ``layer`` on every token of ``text`` (``adapter``: a loaded ``ModelAdapter``).

    Returns ``{"tokens": [piece, …], "token_ids": […], "layer", "neurons": [n, …],
    "activations": [[h per token] per neuron]}`` (float32 values as Python floats).
    """
    check_activation_request([lay.d_ffn for lay in adapter.layers], layer, neurons)
    ids = encode_text(adapter.tokenizer, text, max_tokens)
    index = torch.tensor(neurons, dtype=torch.long)
    got: dict[str, torch.Tensor] = {}

    def read_h(_module: Any, args: tuple[Any, ...]) -> None:
        got["h"] = args[0][0].index_select(-1, index.to(args[0].device)).float().cpu()  # [seq, n]
        raise _Stop

    handle = adapter.layers[layer].down_proj.register_forward_pre_hook(read_h)
    try:
        adapter.decoder()(input_ids=torch.tensor([ids], device=adapter.device))
    except _Stop:
        pass
    finally:
        handle.remove()
    return {"tokens": token_pieces(adapter.tokenizer, ids), "token_ids": ids, "layer": layer, "neurons": list(neurons),
            "activations": got["h"].T.tolist()}


def profile_reference(profile: Any, layer: int, neurons: list[int]) -> list[dict[str, Any]]:
    """Per neuron, what its profile says, to scale a probe's values: ``top_value`` (its signed h at
    its calibration token of largest |h|; None when the profile keeps no top tokens), ``gate_mean``
    (μ_j: the mean of act(x W_gate), EW §3.1, not of h) and ``rate`` (ATopK, CM Eq. 4)."""
    table = profile.neurons
    rows = table[table["layer"] == layer].set_index("neuron")
    top = profile.top_tokens(layer)[0] if profile.has_top_tokens else None
    out = []
    for n in neurons:
        value = None
        if top is not None and top.shape[1]:
            value = float(top[n][abs(top[n]).argmax()])
        out.append({"neuron": n, "top_value": value, "gate_mean": float(rows.loc[n, "mean"]),
                    "rate": float(rows.loc[n, "rate"])})
    return out
