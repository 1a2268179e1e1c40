"""Native export: a converted model as a stock transformers MoE architecture (no remote code).

A moelab export needs ``trust_remote_code=True`` (its bundled ``modeling_moelab.py``); serving
stacks implement known architectures with fused MoE kernels and refuse or ignore custom code.
When a converted model's layout is *exactly* expressible by a transformers architecture, this
module writes it as that architecture, loadable with ``AutoModelForCausalLM.from_pretrained(dir)``
and ``trust_remote_code=False``, computing the same logits (fp32, up to summation order).

Targets and why each mapping is exact
-------------------------------------
``qwen2_moe`` (sources: Llama, Qwen2, Mistral)
    * Attention: Qwen2-MoE's attention is Llama's (RoPE from ``rope_parameters``, scaling
      ``head_dim**-0.5``, GQA) with q/k/v biases switched by ``qkv_bias`` (Llama's
      ``attention_bias``, always on for Qwen2) and no o_proj bias (a Llama source with an
      o_proj bias is refused). ``head_dim`` is read with ``getattr(config, "head_dim", …)`` and
      is written to config.json explicitly. Sliding-window layers (Mistral: all of them when
      ``sliding_window`` is set; Qwen2: its ``layer_types``) are copied into Qwen2-MoE's explicit
      ``layer_types`` with the same ``sliding_window``.
    * Router: ``Qwen2MoeTopKRouter`` takes ``softmax(x W_gate^T)`` over all experts, the top-k
      of those probabilities and, with ``norm_topk_prob=False``, weights each selected expert
      by its probability: moelab's ``softmax`` router with the ``weighted`` combine (EW Eq. 11,
      D2 §2.1). Softmax is monotone, so the same experts are selected. The ``centroid`` router
      scores with the same ``x W^T`` (EW Eq. 9), so it maps identically; the ``normalized``
      combine (softmax over the selected scores) is ``norm_topk_prob=True``. The ``ridge``
      router's offset has no place in a bias-free gate.
    * Experts: transformers 5 stacks them like moelab's ``MoeExperts`` (``gate_up_proj
      [E, 2m, d]`` gate rows first, ``down_proj [E, d, m]``): copied as they are.
    * Shared part: moelab's shared expert is always on with weight 1; Qwen2-MoE multiplies its
      ``shared_expert`` by ``sigmoid(x w_gate)``. With ``w_gate = 0`` that is exactly 0.5
      (a power of two), so the shared down projection is stored × 2: exact in floating point.
      ``d_shared = 0`` becomes a zero-width shared expert (contributes exactly 0).
    * Layers left dense (all of their neurons kept) are ``mlp_only_layers`` with the dense
      ``intermediate_size``.
``qwen2_moe`` from Gemma (v1)
    Gemma's attention is Llama's; what differs is exact to rewrite in fp32: its RMSNorm computes
    ``norm(x) * (1 + w)`` in float32, stored here as the weight ``1 + w`` (the same float32 sum);
    its embedding output is multiplied by ``sqrt(hidden_size)`` (cast to the weight dtype), stored
    here pre-multiplied (the same single product per element), so the embeddings are untied and
    ``lm_head`` keeps the original matrix. Gemma 2/3 (post-norms, soft-capping) are refused.
``qwen3_moe`` (source: Qwen3)
    Qwen3's per-head q/k RMSNorm exists in Qwen3-MoE but not in Qwen2-MoE; Qwen3-MoE has the
    same router, experts and ``mlp_only_layers`` but no shared expert, so only layouts without
    a shared part (``d_shared = 0`` in every MoE layer) export.

Anything else is refused with ``NativeExportError`` (a ``ValueError``) naming the blocking
layer or setting and the plan/route that would export: per-layer expert counts, sizes, top-k
or shared widths (Qwen2-MoE has one of each for the model), the unweighted ``sum`` combine and
the ``normalized``/``scaled`` combines, the centroid/representative/gate_mass/ridge routers,
Dense2MoE's grouped copies, the skipped-expert compensation, AbsTopK, MIDAS low-rank and hierarchical layers, and source
families whose attention or norms differ (Gemma 2/3's post-norms and soft-capping, OLMo's norms,
Phi-3's fused projections…).

The weights are put into a freshly built ``Qwen2MoeForCausalLM``/``Qwen3MoeForCausalLM`` and
written by that class's own ``save_pretrained``, so the checkpoint layout is whatever the
installed transformers writes for that architecture (including its weight converters).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..atomic import atomic_directory, write_json_atomic
from .modeling_moelab import MoelabForCausalLM, decoder_layers
from .moelab_routers import ROUTERS

#: base model_type -> native architecture it maps onto exactly
SOURCE_TARGETS = {"llama": "qwen2_moe", "qwen2": "qwen2_moe", "mistral": "qwen2_moe", "gemma": "qwen2_moe",
                  "qwen3": "qwen3_moe"}

EXPORTABLE_ROUTE = (
    "native export needs a uniform plan (ExpertWeaver --alpha-min A --alpha-max A --plan paper, or one "
    "Dense2MoE layer) and a softmax router with a weighted combine: fine-tune in mode expertweaver first "
    "(or convert with --combine weighted; Dense2MoE: --combine weighted or normalized, no copies)"
)


#: routers whose scores are ``x W^T`` (a bias-free linear gate, ``Router.native``) and the combines a stock gate computes
NATIVE_ROUTERS = tuple(name for name, kind in ROUTERS.items() if kind.native)
NATIVE_COMBINES = ("weighted", "normalized")


class NativeExportError(ValueError):
    """The converted model's layout has no exact stock transformers equivalent."""


def _refuse(what: str) -> NativeExportError:
    return NativeExportError(f"{what}: {EXPORTABLE_ROUTE}")


def _refuse_layer_kinds(specs: list[dict | None]) -> None:
    """Layer kinds that no stock architecture has, whatever the source family or the router."""
    why = {"lowrank_moe": "is a MIDAS low-rank MoE (factorised experts, renormalised top-k gate): no stock architecture "
                          "stores low-rank experts",
           "hierarchical": "is hierarchical (sub-experts inside every expert): no stock architecture nests experts",
           "abstopk": "is an AbsTopK-GLU (per-neuron top-k), not an MoE layer",
           "teal": "is a TEAL activation-sparse GLU (thresholds on inputs), not an MoE layer"}
    for i, s in enumerate(specs):
        kind = (s or {}).get("kind", "moe") if s else "dense"
        if kind in why:  # no other conversion setting would export it: the moelab format is the way out
            raise NativeExportError(f"layer {i} {why[kind]}; use --format moelab (trust_remote_code=True), or convert "
                                    "the dense model with expertweaver, cmoe or dense2moe for a native layout")


def native_layout(moe: MoelabForCausalLM) -> dict[str, Any]:
    """The native target of ``moe`` and its MoE hyper-parameters, or ``NativeExportError``.

    Returns ``{"model_type", "moe_layers", "dense_layers", "num_experts", "expert_size",
    "top_k", "d_shared", "act", "norm_topk_prob"}``. Checks every condition the module docstring lists."""
    base = moe.config.base_config
    specs = list(moe.config.moe_layers)
    _refuse_layer_kinds(specs)  # what no architecture expresses comes first: no other change would export it
    family = getattr(base, "model_type", "?")
    target = SOURCE_TARGETS.get(family)
    if target is None:
        raise NativeExportError(
            f"source family {family!r} cannot be written as a stock MoE architecture exactly (its attention, "
            f"norms or logit soft-capping differ from Qwen2-MoE/Qwen3-MoE; exportable families: "
            f"{', '.join(sorted(SOURCE_TARGETS))}); use --format moelab (trust_remote_code=True)")
    if target == "qwen3_moe" and any(t != "full_attention" for t in (getattr(base, "layer_types", None) or [])):
        raise NativeExportError("the Qwen3 source uses sliding-window attention layers; use --format moelab")
    if getattr(base, "mlp_bias", False):
        raise NativeExportError("the source's MLPs have biases (mlp_bias): Qwen2-MoE experts have none; use --format moelab")
    n_layers = len(decoder_layers(moe.model))
    specs += [{"kind": "dense"}] * (n_layers - len(specs))
    moe_layers, dense = [], []
    for i, s in enumerate(specs):
        kind = (s or {}).get("kind", "moe") if s else "dense"
        if kind == "dense":
            dense.append(i)
            continue
        if kind != "moe":
            raise _refuse(f"layer {i} has kind {kind!r}")
        router, combine = s.get("router", "centroid"), s.get("combine", "sum")
        if router not in NATIVE_ROUTERS or combine not in NATIVE_COMBINES:
            why = f" ({ROUTERS[router].native_refusal})" if router in ROUTERS and router not in NATIVE_ROUTERS else ""
            raise _refuse(
                f"layer {i} routes with the {router!r} router and the {combine!r} combine{why}; a stock MoE gate is "
                "softmax(x W) with each selected expert weighted by its probability (router 'softmax' or 'centroid', "
                "combine 'weighted', or 'normalized' over the selected experts)")
        if s.get("skip_mean"):
            raise _refuse(f"layer {i} adds the means of the experts a token skips (compensation 'skipped_mean'): a stock "
                          "sparse-MoE block has no such term; convert with compensation 'none'")
        if float(s.get("down_keep", 1)) < 1:
            raise _refuse(f"layer {i} runs only part of each active expert's down projection (down_keep "
                          f"{s['down_keep']}): a stock sparse-MoE block runs its experts whole; convert with down_keep 1")
        if s.get("expert_groups") is not None and len(set(s["expert_groups"])) != len(s["expert_groups"]):
            raise _refuse(f"layer {i} holds grouped expert copies (at most one copy of an MLP per token)")
        if int(s.get("top_k", 0)) < 1 or int(s.get("n_routed", s.get("n_experts", 0))) < 1:
            raise _refuse(f"layer {i} runs no routed expert (top_k 0): a static prune, not an MoE layer")
        moe_layers.append(i)
    if not moe_layers:
        raise NativeExportError("no MoE layer: the model is dense; export the source model itself")
    keys = (("n_routed", "routed experts"), ("expert_size", "neurons per expert"), ("top_k", "active experts (top_k)"),
            ("d_shared", "shared neurons"), ("act", "activation"), ("combine", "combine"))
    first = specs[moe_layers[0]]
    for key, words in keys:
        for i in moe_layers[1:]:
            a, b = first.get(key, 0), specs[i].get(key, 0)
            if a != b:
                raise _refuse(f"layer {moe_layers[0]} has {a} {words} and layer {i} has {b}")
    act = first.get("act", "silu")
    if act != getattr(base, "hidden_act", act):
        raise NativeExportError(f"MoE layers use {act!r} but the dense layers {base.hidden_act!r}; use --format moelab")
    if target == "qwen3_moe" and int(first.get("d_shared", 0)) > 0:
        raise NativeExportError(
            f"layer {moe_layers[0]} has a shared part of {first['d_shared']} neurons: a Qwen3 source exports as "
            "Qwen3-MoE (Qwen3's q/k norms), which has no shared expert; convert with --alpha-min 0 --alpha-max 0 "
            "(no shared neurons) or use --format moelab")
    for i, block in enumerate(decoder_layers(moe.model)):
        attn = getattr(block, "self_attn", None)
        if attn is None or getattr(getattr(attn, "o_proj", None), "bias", None) is not None:
            raise NativeExportError(f"layer {i}: attention without a bias-free o_proj; use --format moelab")
    return {"model_type": target, "moe_layers": moe_layers, "dense_layers": dense,
            "num_experts": int(first.get("n_routed", first.get("n_experts", 0))),
            "expert_size": int(first["expert_size"]), "top_k": int(first["top_k"]),
            "d_shared": int(first.get("d_shared", 0)), "act": act,
            "norm_topk_prob": first.get("combine") == "normalized"}


def native_config(moe: MoelabForCausalLM, layout: dict[str, Any]) -> Any:
    """The ``Qwen2MoeConfig``/``Qwen3MoeConfig`` of the export (attention, norms and embeddings
    from the source config; MoE sizes from ``layout``)."""
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    base = moe.config.base_config
    heads = base.num_attention_heads
    common = dict(
        vocab_size=base.vocab_size, hidden_size=base.hidden_size, intermediate_size=base.intermediate_size,
        num_hidden_layers=base.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(base, "num_key_value_heads", None) or heads,
        hidden_act=layout["act"], max_position_embeddings=base.max_position_embeddings,
        initializer_range=getattr(base, "initializer_range", 0.02), rms_norm_eps=base.rms_norm_eps,
        tie_word_embeddings=bool(getattr(base, "tie_word_embeddings", False)) and base.model_type != "gemma",
        rope_parameters=copy.deepcopy(getattr(base, "rope_parameters", None)),
        attention_dropout=getattr(base, "attention_dropout", 0.0),
        decoder_sparse_step=1, moe_intermediate_size=layout["expert_size"], num_experts_per_tok=layout["top_k"],
        num_experts=layout["num_experts"], norm_topk_prob=layout["norm_topk_prob"], mlp_only_layers=list(layout["dense_layers"]),
        pad_token_id=base.pad_token_id, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
        head_dim=getattr(base, "head_dim", None) or base.hidden_size // heads,
    )
    if layout["model_type"] == "qwen2_moe":
        qkv_bias = True if base.model_type == "qwen2" else bool(getattr(base, "attention_bias", False))
        config = Qwen2MoeConfig(**common, shared_expert_intermediate_size=layout["d_shared"], qkv_bias=qkv_bias,
                                **_sliding(base))
    else:
        config = Qwen3MoeConfig(**common, attention_bias=bool(getattr(base, "attention_bias", False)), use_sliding_window=False)
    config.architectures = ["Qwen2MoeForCausalLM" if layout["model_type"] == "qwen2_moe" else "Qwen3MoeForCausalLM"]
    return config


def _sliding(base: Any) -> dict[str, Any]:
    """Qwen2-MoE's sliding-window settings reproducing the source's: Mistral slides every layer
    (``sliding_window`` set), Qwen2 the layers its ``layer_types`` say; Qwen2-MoE takes explicit
    ``layer_types``, so the per-layer choice is copied, not re-derived."""
    n = base.num_hidden_layers
    if base.model_type == "mistral" and getattr(base, "sliding_window", None):
        types = ["sliding_attention"] * n
    else:
        types = list(getattr(base, "layer_types", None) or ["full_attention"] * n)
    if "sliding_attention" not in types:
        return {"use_sliding_window": False}
    return {"use_sliding_window": True, "sliding_window": int(base.sliding_window), "layer_types": types,
            "max_window_layers": n}


@torch.no_grad()
def native_state_dict(moe: MoelabForCausalLM, layout: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The inner causal LM's state dict with moelab's MoE keys renamed to the target's:
    ``router_weight`` -> ``gate.weight``, ``shared_{gate,up,down}`` -> ``shared_expert.*``
    (down × 2 against the zero gate's sigmoid 0.5), ``shared_expert_gate.weight`` = 0."""
    sd = {k: v.detach() for k, v in moe.model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    moe_set = set(layout["moe_layers"])
    prefix = "model.layers."
    for key, t in sd.items():
        if key.startswith(prefix):
            i = int(key[len(prefix):].split(".", 1)[0])
            rest = key[len(prefix):].split(".", 1)[1]
            if i in moe_set and rest.startswith("mlp."):
                sub = rest[len("mlp."):]
                if sub == "router_weight":
                    out[f"{prefix}{i}.mlp.gate.weight"] = t
                elif sub in ("experts.gate_up_proj", "experts.down_proj"):
                    out[f"{prefix}{i}.mlp.{sub}"] = t
                elif sub.startswith(("shared_gate.", "shared_up.", "shared_down.")):
                    name = {"shared_gate": "gate_proj", "shared_up": "up_proj", "shared_down": "down_proj"}[sub.split(".")[0]]
                    out[f"{prefix}{i}.mlp.shared_expert.{name}.weight"] = t * 2 if name == "down_proj" else t
                else:
                    raise NativeExportError(f"layer {i}: parameter mlp.{sub} has no native counterpart")
                continue
        out[key] = t
    if moe.config.base_config.model_type == "gemma":
        _gemma_to_plain(moe, out)
    if layout["model_type"] == "qwen2_moe":
        d, ds = moe.config.base_config.hidden_size, layout["d_shared"]
        ref = next(iter(sd.values()))
        for i in moe_set:
            out[f"{prefix}{i}.mlp.shared_expert_gate.weight"] = ref.new_zeros(1, d)
            if ds == 0:
                out[f"{prefix}{i}.mlp.shared_expert.gate_proj.weight"] = ref.new_zeros(0, d)
                out[f"{prefix}{i}.mlp.shared_expert.up_proj.weight"] = ref.new_zeros(0, d)
                out[f"{prefix}{i}.mlp.shared_expert.down_proj.weight"] = ref.new_zeros(d, 0)
    return out


def _gemma_to_plain(moe: MoelabForCausalLM, state: dict[str, torch.Tensor]) -> None:
    """Gemma (v1) -> plain Llama-style tensors, in place: every ``(1 + w)`` RMSNorm weight becomes
    ``1 + w`` (float32 sum, as Gemma computes it), the embedding is pre-multiplied by its scale and
    ``lm_head`` keeps the unscaled matrix (untied)."""
    for name, mod in moe.model.named_modules():
        if type(mod).__name__ == "GemmaRMSNorm":
            key = f"{name}.weight"
            state[key] = (1.0 + state[key].float()).to(state[key].dtype)
    emb = moe.model.get_input_embeddings()
    scale = getattr(emb, "embed_scale", None)
    key = "model.embed_tokens.weight"
    state["lm_head.weight"] = state.get("lm_head.weight", state[key])
    if scale is not None:
        state[key] = state[key] * scale.to(state[key].dtype)
    else:  # older transformers scale in the model's forward by sqrt(hidden_size) in the hidden dtype
        hidden = moe.config.base_config.hidden_size
        state[key] = state[key] * torch.tensor(hidden**0.5, dtype=state[key].dtype)


def build_native_model(moe: MoelabForCausalLM) -> nn.Module:
    """A ``Qwen2MoeForCausalLM``/``Qwen3MoeForCausalLM`` holding ``moe``'s weights (copies)."""
    from transformers import AutoModelForCausalLM

    layout = native_layout(moe)
    config = native_config(moe, layout)
    dtype = next(moe.parameters()).dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = native_state_dict(moe, layout)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise NativeExportError(f"weights do not map onto {type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    if getattr(moe, "generation_config", None) is not None:
        model.generation_config = copy.deepcopy(moe.generation_config)
    return model.eval()


def export_native(moe: MoelabForCausalLM, out_dir: Path, tokenizer: Any = None, conversion: dict | None = None,
                  evaluation: dict | None = None) -> Path:
    """Write ``moe`` as a stock transformers architecture at ``out_dir`` (atomic), with its
    tokenizer, ``conversion.json`` (plus ``native`` = the layout) and the model card."""
    from .model_card import write_model_card

    layout = native_layout(moe)
    model = build_native_model(moe)
    record = dict(conversion or {})
    record["native"] = {k: layout[k] for k in ("model_type", "num_experts", "expert_size", "top_k", "d_shared",
                                                "moe_layers", "dense_layers", "norm_topk_prob")}
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        model.save_pretrained(tmp)
        if layout["expert_size"] % GROUPED_MM_ALIGN:
            pin_eager_experts(tmp / "config.json")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / "conversion.json", record)
        write_model_card(tmp, record, moe, fmt="native", evaluation=evaluation)
    return out_dir


#: transformers runs a MoE's experts with torch's grouped_mm by default, which needs every operand's row
#: stride in whole 16 bytes: an expert width that is a multiple of 8 works in fp32 and in 16-bit types
GROUPED_MM_ALIGN = 8


def pin_eager_experts(config_path: Path) -> None:
    """Make transformers load the model with its ``eager`` experts (a loop over the selected experts):
    grouped_mm fails ("strides should be multiple of 16 bytes") on experts whose width is not a multiple
    of ``GROUPED_MM_ALIGN``. ``experts_implementation`` is read from config.json by ``PretrainedConfig``
    but not written by ``save_pretrained``, hence written here."""
    config = json.loads(config_path.read_text())
    config["experts_implementation"] = "eager"
    write_json_atomic(config_path, config)


FORMATS = ("moelab", "native", "gguf")


def resolve_source(src: Path) -> Path:
    """The model directory of ``src``: a conversion directory, a fine-tuned model directory, or a
    fine-tuning work directory (its ``model/``)."""
    src = Path(src)
    if (src / "conversion.json").is_file():
        return src
    if (src / "model" / "conversion.json").is_file():
        return src / "model"
    raise FileNotFoundError(f"{src}: not a converted or fine-tuned model (no conversion.json); run `moelab convert` first")


def export_converted(src: Path | str, out: Path, fmt: str = "moelab", gguf_type: str = "f16",
                     data_dir: Path | None = None) -> dict[str, Any]:
    """``moelab export``: re-export the model in ``src`` (conversion or fine-tuned model directory)
    as ``fmt`` at ``out`` (atomic), with the model card including ``src``'s evaluation.json.

    ``moelab``: the current runtime's layout and bundled modeling file (trust_remote_code=True);
    ``native``: a stock transformers architecture, or ``NativeExportError`` naming what blocks it
    (checked before anything is written); ``gguf``: a llama.cpp file (``gguf_export``: also a dense
    ``src``: ``default``, a model directory or a .gguf, at ``gguf_type``). Returns
    ``{"format", "out", "model_type", ...}``."""
    import json

    from transformers import PreTrainedTokenizerFast

    from .export import export_model

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    if fmt == "gguf":
        from .gguf_export import export_gguf

        info = export_gguf(src, out, gguf_type, data_dir or Path(out).parent)
        return {**info, "model_type": info["architecture"]}
    src = resolve_source(src)
    if Path(out).resolve() == src.resolve():
        raise ValueError("--out must differ from the source directory")
    record = json.loads((src / "conversion.json").read_text())
    from .model_card import read_evaluation

    evaluation = read_evaluation(src)
    moe = MoelabForCausalLM.from_pretrained(str(src)).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(src)) if (src / "tokenizer.json").is_file() else None
    if fmt == "native":
        layout = native_layout(moe)  # refuses before anything is written
        export_native(moe, out, tokenizer, record, evaluation)
        return {"format": fmt, "out": str(out), "model_type": layout["model_type"], "source": str(src),
                **{k: layout[k] for k in ("num_experts", "expert_size", "top_k", "d_shared", "dense_layers")}}
    export_model(moe, out, tokenizer, record, evaluation)
    return {"format": fmt, "out": str(out), "model_type": "moelab", "source": str(src)}
