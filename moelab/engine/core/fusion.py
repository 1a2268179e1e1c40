"""Model surgery for layer fusion (D2 Eq. 6): remove decoder blocks from a Hugging Face causal LM
and build the MoE FFN whose experts are copies of several blocks' MLPs. ``methods.dense2moe``
chooses what to fuse; this module only performs it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..models import ModelAdapter
from ..runtime.modeling_moelab import MoeFFN, decoder_layers
from .empty_module import empty_module
from .params import ConversionError

#: Block attributes that normalise the MLP output (Gemma2/3, OLMo2 …): refused, see methods.dense2moe.
POST_MLP_NORMS = ("post_feedforward_layernorm", "post_mlp_layernorm", "post_ffn_norm", "post_ffw_norm")
#: Config lists with one entry per decoder layer, filtered to the kept layers on removal.
PER_LAYER_CONFIG_LISTS = (
    "layer_types", "mlp_layer_types", "layers_block_type", "layer_rope_theta", "no_rope_layers",
    "num_attention_heads_per_layer", "num_key_value_heads_per_layer",
)


def check_fusable(adapter: ModelAdapter, layers: Sequence[int]) -> None:
    """Refuse blocks Eq. 6 does not describe: MLP-output norms, MLP biases, unequal widths."""
    for i in layers:
        lay = adapter.layers[i]
        norms = [n for n in POST_MLP_NORMS if getattr(lay.block, n, None) is not None]
        if norms:
            raise ConversionError(
                f"model type {adapter.family!r} normalises each MLP's output ({norms[0]}): fusing MLPs into one "
                "block would put every expert behind that block's norm, which D2 Eq. 6 does not cover; "
                "use a family with plain pre-norm blocks (Llama, Mistral, Qwen2/3, Gemma, OLMo, Phi-3)"
            )
        if lay.gate_bias() is not None or lay.up_bias() is not None or lay.down_proj.bias is not None:
            raise ConversionError(f"layer {i}: MLPs with biases are not supported by the MoE runtime")
    widths = {adapter.layers[i].d_ffn for i in layers}
    if len(widths) > 1:
        raise ConversionError(
            f"layers {list(layers)} have different FFN widths {sorted(widths)}: experts must be equal-sized"
        )


def remove_decoder_layers(model: nn.Module, drop: Sequence[int]) -> list[int]:
    """Remove decoder blocks ``drop`` from a Hugging Face causal LM, in place; returns the kept
    original indices. Everything that depends on the layer count follows: the ModuleList, each
    kept block's ``layer_idx`` (KV-cache slot), ``config.num_hidden_layers`` and the per-layer
    config lists (``layer_types`` … : sliding/full attention stays with its block)."""
    layers = decoder_layers(model)
    L = len(layers)
    drop_set = {int(i) for i in drop}
    if any(not 0 <= i < L for i in drop_set):
        raise ConversionError(f"layers {sorted(drop_set)} out of range (model has {L} layers)")
    kept = [i for i in range(L) if i not in drop_set]
    if not kept:
        raise ConversionError("cannot remove every decoder layer")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    others = [
        k for k, v in vars(config).items()
        if "layer" in k and isinstance(v, (list, tuple)) and v and k not in PER_LAYER_CONFIG_LISTS
    ]
    if others:
        raise ConversionError(f"config field(s) {others} list layers; removing decoder layers would leave them stale")
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError):
        decoder = model.model
    decoder.layers = nn.ModuleList([layers[i] for i in kept])
    for new_i, block in enumerate(decoder.layers):
        for mod in block.modules():  # the block and its attention both carry layer_idx in HF code
            if isinstance(getattr(mod, "layer_idx", None), int):
                mod.layer_idx = new_i
    config.num_hidden_layers = len(kept)
    for name in PER_LAYER_CONFIG_LISTS:
        values = getattr(config, name, None)
        if isinstance(values, (list, tuple)) and len(values) == L:
            setattr(config, name, [values[i] for i in kept])
    return kept


@torch.no_grad()
def fused_ffn(adapter: ModelAdapter, layer: int, n_fused: int, params: Any) -> MoeFFN:
    """D2 Eq. 6's MoE for block ``layer``: experts = N copies of MLP^(l*) then M copies of each
    MLP^(l*+k), k = 1 … n*; no shared expert; softmax router (D2 §2.1), seeded N(0, σ²) init.
    With copies (N or M > 1) the spec's ``expert_groups`` (= source layers) makes the runtime
    select at most one copy of an MLP per token."""
    sources = [layer] * params.own_copies + [
        layer + k for k in range(1, n_fused + 1) for _ in range(params.fused_copies)
    ]
    first = adapter.layers[layer]
    d_model, d_ffn = adapter.d_model, first.d_ffn
    like = first.down_proj.weight
    spec = {
        "kind": "moe", "d_model": d_model, "act": adapter.activation, "d_shared": 0,
        "n_routed": len(sources), "expert_size": d_ffn, "top_k": params.top_k, "router": "softmax",
        "combine": params.combine, "method": "dense2moe", "expert_source_layers": sources,
    }
    if len(set(sources)) < len(sources):
        spec["expert_groups"] = sources
    mod = empty_module(MoeFFN, spec, like)
    gate_up, down = mod.experts.gate_up_proj, mod.experts.down_proj
    for e, src in enumerate(sources):  # one copy per expert: a handful, not a hot loop
        lay = adapter.layers[src]
        gate_up[e, :d_ffn].copy_(lay.gate_weight())
        gate_up[e, d_ffn:].copy_(lay.up_weight())
        down[e].copy_(lay.down_weight())
    config = adapter.model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    std = float(getattr(config, "initializer_range", 0.02) or 0.02)
    gen = torch.Generator().manual_seed(params.seed)
    router = torch.randn(len(sources), d_model, generator=gen, dtype=torch.float32) * std
    mod.router_weight.copy_(router.to(device=like.device, dtype=like.dtype))
    return mod
