"""Total and per-token active parameter counts of a (converted) model.

A module replacing an MLP reports how many of its own parameters one token uses through
``active_param_count()``; everything else (attention, norms, embeddings, dense MLPs) is used by
every token. Tied tensors are counted once. The LM head and the input embedding are both
counted in ``total``; ``active`` counts the embedding too (a lookup), as model cards usually do.
"""

from __future__ import annotations

from torch import nn


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """``{"total": …, "active": …}`` for ``model``: ``active`` replaces each module that defines
    ``active_param_count()`` by that count (outermost such module wins)."""
    seen: set[int] = set()

    def unique(params) -> int:
        n = 0
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        return n

    inactive = 0
    claimed: set[str] = set()
    for name, mod in model.named_modules():
        if any(name.startswith(c + ".") for c in claimed):
            continue
        count = getattr(mod, "active_param_count", None)
        if callable(count):
            claimed.add(name)
            own = sum(p.numel() for p in mod.parameters())
            inactive += own - int(count())
    total = unique(model.parameters())
    return {"total": int(total), "active": int(total - inactive)}


def ffn_macs_per_token(model: nn.Module) -> list[int]:
    """Multiply-adds one token spends in each decoder layer's FFN, router and expert scoring included.

    Every FFN weight a token uses is one multiply-add (a linear map ``y = W x`` costs ``W.numel()``),
    so this is each layer's ``parameter_counts(mlp)["active"]``: a dense GLU costs ``3·d·d_ffn``,
    a ``MoeFFN`` its shared part, ``top_k`` routed experts and its router (the gate-mass router
    computes the gate of every routed neuron: ``d·m·(E + 2k)``). Element-wise work (activations,
    the products of a GLU, softmax, top-k) is not counted: it is O(d_ffn), not O(d·d_ffn).
    A sparse-MoE block of an original MoE model counts all its experts here; its callers use
    ``moe_experts.moe_parameter_counts`` for that model instead.
    """
    from .modeling_moelab import decoder_layers

    return [parameter_counts(block.mlp)["active"] for block in decoder_layers(model)]


def ffn_flops_fraction(model: nn.Module, dense_ffn_macs: int) -> float:
    """FFN multiply-adds per token of ``model`` over ``dense_ffn_macs``, the dense model's (all of
    its layers: blocks a conversion removed, as Dense2MoE does, count as zero in the numerator)."""
    if dense_ffn_macs <= 0:
        raise ValueError("the dense FFN cost must be positive")
    return float(sum(ffn_macs_per_token(model)) / dense_ffn_macs)
