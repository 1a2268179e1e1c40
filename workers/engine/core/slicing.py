"""Slicing a dense GLU FFN into MoE modules: the build step every partition method shares.

A partition method (``methods.expertweaver``, ``methods.cmoe``) plans each layer (``LayerPlan``)
and partitions its neurons (``LayerExperts``); ``convert_partition`` runs that per layer with
progress and slices the dense weights into one runtime ``MoeFFN`` per layer (EW Eqs. 7–8, CM
Eq. 5). The AbsTopK-GLU baseline (EW Eq. 2) is built here too, from the same dense weights.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..models import ModelAdapter
from ..progress import NO_PROGRESS, Progress
from ..runtime.export import build_moe_model
from ..runtime.modeling_moelab import AbsTopKGLU, MoeFFN
from ..runtime.param_count import parameter_counts
from .allocation import LayerPlan, summarize
from .params import ConversionError, MethodParams
from .partition import LayerExperts

#: ``(row, gate_w, up_w) -> LayerExperts``: one method's expert construction for one layer
#: (``gate_w``/``up_w``: the layer's dense weights as float32 numpy, ``[d_ffn, d_model]``).
LayerBuilder = Callable[[LayerPlan, np.ndarray, np.ndarray], LayerExperts]


def check_compatible(adapter: ModelAdapter, profile: Any) -> None:
    m = profile.manifest
    if m["n_layers"] != adapter.n_layers or list(m["d_ffn"]) != [lay.d_ffn for lay in adapter.layers]:
        raise ConversionError(
            f"profile {profile.path} was made on a model with {m['n_layers']} layers and d_ffn {m['d_ffn'][0]}, "
            f"but the loaded model has {adapter.n_layers} layers and d_ffn {adapter.d_ffn}: profile this model first"
        )
    for lay in adapter.layers:
        if lay.gate_bias() is not None or lay.up_bias() is not None or lay.down_proj.bias is not None:
            raise ConversionError(f"layer {lay.index}: MLPs with biases are not supported by the MoE runtime")


def dense_weights(adapter: ModelAdapter, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer ``i``'s ``W_gate``, ``W_up`` ``[d_ffn, d_model]`` and ``W_down`` ``[d_model, d_ffn]``."""
    lay = adapter.layers[i]
    return lay.gate_weight().detach(), lay.up_weight().detach(), lay.down_weight().detach()


def partition_layers(adapter: ModelAdapter, profile: Any, rows: list[LayerPlan], build_layer: LayerBuilder,
                     progress: Progress = NO_PROGRESS) -> list[LayerExperts]:
    """Partition every layer's neurons as ``rows`` plan (clustering is the slow part: per-layer progress)."""
    check_compatible(adapter, profile)
    experts = []
    progress.update("cluster experts", 0, len(rows))
    for i, row in enumerate(rows):
        gate_w, up_w, _ = (w.float().cpu().numpy() for w in dense_weights(adapter, i))
        experts.append(build_layer(row, gate_w, up_w))
        progress.update("cluster experts", i + 1, len(rows))
    return experts


def build_modules(adapter: ModelAdapter, experts: list[LayerExperts], combine: str = "sum") -> dict[int, nn.Module]:
    """One ``MoeFFN`` per layer, sliced from the dense weights (EW Eqs. 7–8, CM Eq. 5)."""
    modules: dict[int, nn.Module] = {}
    for e in experts:
        gate_w, up_w, down_w = dense_weights(adapter, e.layer)
        router_weights = {k: torch.as_tensor(v, dtype=gate_w.dtype, device=gate_w.device) for k, v in e.router_weights.items()}
        modules[e.layer] = MoeFFN.from_dense(
            gate_w, up_w, down_w, adapter.activation, e.shared, e.routed, e.top_k, e.router, combine, **router_weights
        )
    return modules


def needs_fitting(params: MethodParams) -> bool:
    """The ridge router and the budget plan are fitted on calibration tokens (``core.fitting``)."""
    return getattr(params, "router", None) == "ridge" or getattr(params, "plan", "paper") == "budget"


def partition_modules(adapter: ModelAdapter, profile: Any, params: MethodParams, rows: list[LayerPlan],
                      build_layer: LayerBuilder, progress: Progress = NO_PROGRESS, data_dir: Any = None,
                      calib: Any = None) -> tuple[list[LayerPlan], list[LayerExperts], dict[int, nn.Module], dict[str, Any]]:
    """Plan → experts (→ fitted routers and budget plan, ``core.fitting``) → one ``MoeFFN`` per layer;
    returns ``(rows, experts, modules, fit record)``. ``calib``: calibration inputs already collected."""
    experts = partition_layers(adapter, profile, rows, build_layer, progress)
    fit: dict[str, Any] = {}
    if needs_fitting(params):
        from .fitting import fit_layers

        rows, experts, fit = fit_layers(adapter, profile, params, rows, experts, data_dir, progress, calib)
    return rows, experts, build_modules(adapter, experts, params.combine), fit  # type: ignore[attr-defined]


def convert_partition(adapter: ModelAdapter, profile: Any, params: MethodParams, rows: list[LayerPlan],
                      build_layer: LayerBuilder, progress: Progress = NO_PROGRESS, data_dir: Any = None,
                      ) -> tuple[Any, dict[str, Any]]:
    """``partition_modules`` → ``MoelabForCausalLM``; returns ``(moe_model, record)``. The dense model
    is converted in place."""
    t0 = time.perf_counter()
    before = parameter_counts(adapter.model)
    rows, experts, modules, fit = partition_modules(adapter, profile, params, rows, build_layer, progress, data_dir)
    t1 = time.perf_counter()
    moe = build_moe_model(adapter, modules, provenance={"method": params.method, "router": params.router})  # type: ignore[attr-defined]
    after = parameter_counts(moe)
    summary = {
        **summarize(rows), "method": params.method, "n_layers": adapter.n_layers,
        "dense_total_params": before["total"], "dense_active_params": before["active"],
        "total_params": after["total"], "active_params": after["active"],
    }
    record = {
        "params": params.to_dict(),
        "summary": summary,
        "layers": [{**asdict(p), **e.summary()} for p, e in zip(rows, experts)],
        "timings": {"build_s": t1 - t0, "total_s": time.perf_counter() - t0},
        **({"fit": fit} if fit else {}),
    }
    return moe, record


def build_partition(inputs: Any, params: MethodParams, plan_for: Callable[[Any, Any], list[LayerPlan]],
                    layer_builder: Callable[[Any, Any], LayerBuilder], progress: Progress = NO_PROGRESS
                    ) -> tuple[Any, Any, dict[str, Any]]:
    """The build step of a partition method (``Method.build``): load the dense model, plan every layer
    from the profile, partition and slice; returns ``(moe_model, tokenizer, record)``."""
    adapter = inputs.load_dense()
    profile = inputs.profile
    moe, record = convert_partition(adapter, profile, params, plan_for(profile, params), layer_builder(profile, params),
                                    progress, inputs.data_dir)
    return moe, adapter.tokenizer, record


def abstopk_modules(adapter: ModelAdapter, active_fraction: float) -> dict[int, nn.Module]:
    """EW Eq. 2 baseline: per token keep the ``round(active_fraction · d_ffn)`` largest |act(gate)|."""
    out = {}
    for lay in adapter.layers:
        k = max(1, int(round(active_fraction * lay.d_ffn)))
        out[lay.index] = AbsTopKGLU.from_dense(*dense_weights(adapter, lay.index), adapter.activation, k)
    return out
