"""Which converted layouts llama.cpp expresses exactly, read from a conversion's ``config.json``.

Pure Python (no torch, no llama.cpp): the API answers "does this conversion export to GGUF, and
why not" without loading a model, and the model card says it. The mapping and why each part of
it is exact: ``gguf_export`` (module docstring).
"""

from __future__ import annotations

import math
from typing import Any

#: ``--type`` -> the converter's ``--outtype`` (and llama.cpp's file type for re-typing a .gguf)
GGUF_TYPES = ("f32", "f16", "q8_0")
#: source families whose attention and norms are llama.cpp's deepseek (Llama) ones
GGUF_FAMILIES = ("llama", "mistral")
#: router kinds scoring ``x W^T`` with no offset: a stock softmax gate
GGUF_ROUTERS = ("softmax", "centroid")
EXPORTABLE_ROUTE = (
    "GGUF needs one expert count, expert size and top-k in every MoE layer, dense layers only before the first MoE "
    "layer, a softmax or centroid router and the weighted combine: convert with --recipe portable and recover it "
    "(moelab finetune --mode expertweaver), or use --format moelab"
)


class GgufExportError(ValueError):
    """The model's layout has no exact llama.cpp equivalent, or the GGUF tools are missing."""


def _kind(spec: dict | None) -> str:
    return (spec or {}).get("kind", "moe") if spec else "dense"


def gguf_layout(config: dict[str, Any]) -> dict[str, Any]:
    """The deepseek (v1) hyper-parameters of a converted model from its ``config.json`` (a dict),
    or ``GgufExportError`` naming the first thing that blocks an exact GGUF.

    Returns ``{"n_layers", "leading_dense", "num_experts", "expert_size", "top_k", "n_shared_experts",
    "shared_padding"}``; ``shared_padding``: the zero neurons added per MoE layer (llama.cpp computes them)."""
    base = config.get("base_config") or {}
    family = base.get("model_type", "?")
    if family not in GGUF_FAMILIES:
        raise GgufExportError(
            f"source family {family!r} has no exact llama.cpp MoE architecture (GGUF exports {', '.join(GGUF_FAMILIES)} "
            "sources: Llama attention and norms); use --format moelab")
    for key, why in (("attention_bias", "attention biases"), ("mlp_bias", "MLP biases")):
        if base.get(key):
            raise GgufExportError(f"the source has {why}; llama.cpp's deepseek architecture has none; use --format moelab")
    window = base.get("sliding_window")
    if family == "mistral" and window and int(window) < int(base.get("max_position_embeddings") or 0):
        # a window at least as long as the context never slides: the attention is Llama's exactly
        raise GgufExportError(f"the source slides its attention window ({window} of {base['max_position_embeddings']} "
                              "positions); llama.cpp's deepseek architecture attends to the whole context; use --format moelab")
    rope = base.get("rope_parameters") or base.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise GgufExportError(f"the source scales RoPE ({rope.get('rope_type', rope.get('type'))}); the GGUF export "
                              "writes plain RoPE only; use --format moelab")
    heads, width = int(base["num_attention_heads"]), int(base["hidden_size"])
    if int(base.get("head_dim") or width // heads) * heads != width:
        raise GgufExportError("heads × head_dim differs from the hidden size; llama.cpp's deepseek output projection is square")
    n_layers = int(base["num_hidden_layers"])
    specs = list(config.get("moe_layers") or [])
    specs += [None] * (n_layers - len(specs))
    why_kind = {"lowrank_moe": "is a MIDAS low-rank MoE (factorised experts)", "hierarchical": "is hierarchical "
                "(sub-experts inside every expert)", "abstopk": "is an AbsTopK-GLU (per-neuron top-k), not an MoE layer",
                "teal": "is a TEAL activation-sparse GLU (thresholds on inputs), not an MoE layer"}
    for i, s in enumerate(specs):
        if _kind(s) in why_kind:
            raise GgufExportError(f"layer {i} {why_kind[_kind(s)]}: llama.cpp has no such layer; use --format moelab")
    moe_layers = [i for i, s in enumerate(specs) if _kind(s) != "dense"]
    if not moe_layers:
        raise GgufExportError("no MoE layer: the model is dense; export the dense source model itself")
    lead = moe_layers[0]
    late_dense = [i for i in range(lead, n_layers) if i not in moe_layers]
    if late_dense:
        raise GgufExportError(
            f"layer {late_dense[0]} is dense after MoE layer {lead}: llama.cpp keeps only the leading layers dense "
            f"(leading_dense_block_count): {EXPORTABLE_ROUTE}")
    first = specs[lead]
    for i in moe_layers:
        s = specs[i]
        if _kind(s) != "moe":
            raise GgufExportError(f"layer {i} has kind {_kind(s)!r}: {EXPORTABLE_ROUTE}")
        router, combine = s.get("router", "centroid"), s.get("combine", "sum")
        if router not in GGUF_ROUTERS:
            raise GgufExportError(f"layer {i} routes with the {router!r} router (not a bias-free linear gate): {EXPORTABLE_ROUTE}")
        if combine != "weighted":
            raise GgufExportError(
                f"layer {i} combines its experts with {combine!r}; llama.cpp's deepseek weights each selected expert by its "
                f"softmax probability over all experts (combine 'weighted'): {EXPORTABLE_ROUTE}")
        if s.get("skip_mean"):
            raise GgufExportError(f"layer {i} adds the means of the experts a token skips (compensation 'skipped_mean'): "
                                  f"{EXPORTABLE_ROUTE}")
        if float(s.get("down_keep", 1)) < 1:
            raise GgufExportError(f"layer {i} runs only part of each active expert's down projection (down_keep "
                                  f"{s['down_keep']}); llama.cpp's experts run whole: {EXPORTABLE_ROUTE}")
        groups = s.get("expert_groups")
        if groups is not None and len(set(groups)) != len(groups):
            raise GgufExportError(f"layer {i} holds grouped expert copies (at most one copy per token): {EXPORTABLE_ROUTE}")
        if int(s.get("top_k", 0)) < 1:
            raise GgufExportError(f"layer {i} runs no routed expert (top_k 0): a static prune, not an MoE layer")
        if s.get("act", "silu") != "silu" or base.get("hidden_act", "silu") != "silu":
            raise GgufExportError(f"layer {i} uses {s.get('act')!r}; llama.cpp's deepseek experts are SiLU-gated")
        for key, words in (("n_routed", "routed experts"), ("expert_size", "neurons per expert"), ("top_k", "active experts")):
            a, b = _count(first, key), _count(s, key)
            if a != b:
                raise GgufExportError(f"layer {lead} has {a} {words} and layer {i} has {b} (one per model in llama.cpp): "
                                      f"{EXPORTABLE_ROUTE}")
    m = int(first["expert_size"])
    widest = max(int(specs[i].get("d_shared", 0)) for i in moe_layers)
    n_shared = max(1, math.ceil(widest / m))
    return {"n_layers": n_layers, "leading_dense": lead, "num_experts": _count(first, "n_routed"), "expert_size": m,
            "top_k": int(first["top_k"]), "n_shared_experts": n_shared,
            "shared_padding": {i: n_shared * m - int(specs[i].get("d_shared", 0)) for i in moe_layers}}


def _count(spec: dict, key: str) -> int:
    if key == "n_routed":
        return int(spec.get("n_routed", spec.get("n_experts", 0)))
    return int(spec.get(key, 0))


def gguf_refusal(config: dict[str, Any]) -> str | None:
    """Why the converted model of ``config`` (its config.json) does not export to GGUF, or None."""
    try:
        gguf_layout(config)
    except GgufExportError as exc:
        return str(exc)
    return None


def check_type(gguf_type: str) -> str:
    if gguf_type not in GGUF_TYPES:
        raise GgufExportError(f"unknown GGUF type {gguf_type!r}; one of {', '.join(GGUF_TYPES)}")
    return gguf_type
