"""Whether a conversion being planned will export to GGUF (llama.cpp / Ollama) and native
transformers, from its planned parameters alone (pure Python, no torch, no I/O): the API answers it
(``POST /methods/{method}/export-plan``) and the designer says it before anything is converted. The converted model's own check (``ConversionOut.gguf``, from its
config.json) stays the word that counts; this one reads the rules those exports apply
(``gguf_export.gguf_layout``, ``native_export``) back onto the parameters that decide them:

* one expert count, expert size and top-k in every MoE layer: ExpertWeaver's ``plan`` ``leading``
  (one shared count, leading layers dense), or ``paper`` with ``alpha_min == alpha_max`` (Eq. 5
  gives every layer the same α); any other plan (``budget``, or one this module does not know)
  gives layers their own;
* a bias-free linear router with the weighted combine: recovery fine-tuning in mode expertweaver
  (EW Eq. 11) makes the training-free ``sum`` combine that, whatever the router; a ``weighted``
  combine with the ``centroid`` or ``softmax`` router is that already;
* no skipped-expert compensation, and whole experts (``down_keep`` 1);
* a source family whose attention llama.cpp's deepseek (GGUF: Llama, Mistral) or transformers'
  Qwen MoE classes (native: also Qwen2, Qwen3, Gemma) compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .gguf_layout import GGUF_FAMILIES, GGUF_ROUTERS

AFTER_RECOVERY = "exportable after recovery (moelab finetune --mode expertweaver)"
#: source families a native (transformers) MoE class computes exactly: ``native_export.SOURCE_TARGETS``'s keys
#: (that module imports torch; a test keeps the two equal)
NATIVE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma")
#: ExpertWeaver's parameters these rules read
RULE_PARAMS = ("plan", "alpha_min", "alpha_max", "compensation", "combine", "router", "down_keep")


def _ew_defaults() -> dict[str, Any]:
    """ExpertWeaver's declared defaults of :data:`RULE_PARAMS`, for parameters left unset."""
    from ..methods.expertweaver import ExpertWeaverParams

    defaults = ExpertWeaverParams()
    return {name: getattr(defaults, name) for name in RULE_PARAMS}


def planned_export(method: str | None, params: Mapping[str, Any] | None, family: str | None = None) -> tuple[str, str]:
    """``(verdict, sentence)``: verdict ``after_recovery``, ``as_converted`` or ``no``; the sentence says
    which formats and, when not, what blocks it and what would export."""
    if method != "expertweaver":
        return "no", (f"GGUF / native export: not planned for {method or 'this method'}: only ExpertWeaver conversions "
                      "with one plan for every layer (--recipe portable) export, after recovery "
                      "(moelab finetune --mode expertweaver); this one exports with --format moelab")
    p = {**_ew_defaults(), **{k: v for k, v in (params or {}).items() if v is not None and v != ""}}
    why = _blocker(p)
    if why:
        return "no", f"GGUF / native export: not exportable: {why}"
    ready = p["combine"] == "weighted" and p["router"] in GGUF_ROUTERS
    verdict, head = ("as_converted", "exportable as converted") if ready else ("after_recovery", AFTER_RECOVERY)
    if family and family not in NATIVE_FAMILIES:
        return "no", (f"GGUF / native export: not exportable: the source family {family!r} has no exact llama.cpp or "
                      "transformers MoE architecture (GGUF: Llama, Mistral; native also Qwen2, Qwen3, Gemma)")
    if family and family not in GGUF_FAMILIES:
        return verdict, (f"GGUF / native export: {head}, to native transformers only: GGUF exports Llama and Mistral "
                         f"sources, this model is {family}")
    return verdict, f"GGUF / native export: {head}, to GGUF (llama.cpp / Ollama) and native transformers"


def _blocker(p: Mapping[str, Any]) -> str | None:
    """What in ExpertWeaver's parameters blocks an exact export (None: nothing)."""
    plan = p["plan"]
    if plan == "paper":
        if _num(p["alpha_min"]) != _num(p["alpha_max"]):
            return (f"alpha_min {p['alpha_min']} ≠ alpha_max {p['alpha_max']} gives layers different shared and routed "
                    "expert counts (EW Eq. 5), and GGUF / native have one for the model: set them equal, or use plan "
                    "leading (recipe portable)")
    elif plan != "leading":
        return (f"plan {plan!r} gives layers their own expert counts or top-k, and GGUF / native have one for the model: "
                "use plan leading (recipe portable), or paper with alpha_min = alpha_max")
    if p["compensation"] != "none":
        return (f"compensation {p['compensation']!r} adds the skipped experts' means, which llama.cpp and transformers "
                "do not compute: use compensation none")
    if _num(p["down_keep"]) != 1:
        return (f"down_keep {p['down_keep']} runs only part of each active expert's down projection, and llama.cpp and "
                "transformers run experts whole: use down_keep 1")
    if p["combine"] != "sum" and not (p["combine"] == "weighted" and p["router"] in GGUF_ROUTERS):
        return (f"combine {p['combine']!r} with the {p['router']!r} router is neither a stock softmax gate nor what recovery "
                "in mode expertweaver starts from (combine sum): use combine sum")
    return None


def _num(value: Any) -> Any:
    try:
        return round(float(value), 9)
    except (TypeError, ValueError):
        return value
