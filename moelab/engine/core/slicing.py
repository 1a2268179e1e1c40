"""Slicing a dense GLU FFN into MoE modules: the build step every partition method shares.

A partition method (``methods.expertweaver``, ``methods.cmoe``) plans each layer (``LayerPlan``)
and partitions its neurons (``LayerExperts``); ``convert_partition`` runs that per layer with
progress and slices the dense weights into one runtime ``MoeFFN`` per layer (EW Eqs. 7–8, CM
Eq. 5; ``moe_from_dense``). The AbsTopK-GLU baseline (EW Eq. 2) is built here too, from the same
dense weights (``abstopk_from_dense``). These builders run at conversion time only, so they live
here and not in the runtime an export carries.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..models import ModelAdapter, dense_weights
from ..progress import NO_PROGRESS, Progress
from ..runtime.export import build_moe_model
from ..runtime.modeling_moelab import AbsTopKGLU, MoeFFN
from ..runtime.param_count import parameter_counts
from .allocation import LayerPlan, summarize
from .empty_module import dense_glu_module, empty_module
from .fitting import fit_layers, profile_token_windows, refit_on_converted
from .params import ConversionError, MethodParams, needs_fitting
from .partition import LayerExperts

#: ``(row, gate_w, up_w) -> LayerExperts``: one method's expert construction for one layer
#: (``gate_w``/``up_w``: the layer's dense weights as float32 numpy, ``[d_ffn, d_model]``).
LayerBuilder = Callable[[LayerPlan, np.ndarray, np.ndarray], LayerExperts]
#: ``(layers, build_one, progress) -> experts in the order of layers``: runs ``build_one(i)`` for every
#: layer, here or elsewhere (``workers.fanout`` shares the layers with idle workers)
LayerMap = Callable[[list[int], Callable[[int], LayerExperts], Progress], list[LayerExperts]]


def _as_long(idx: Any) -> torch.Tensor:
    if isinstance(idx, torch.Tensor):
        return idx.detach().to(device="cpu", dtype=torch.long)
    return torch.as_tensor(idx, dtype=torch.long)


def expert_rows(block: MoeFFN) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of a ``MoeFFN``'s routed experts as separate matrices: gate rows ``[E, m, d]``, up rows
    ``[E, m, d]`` (halves of ``experts.gate_up_proj``) and ``experts.down_proj`` ``[E, d, m]``;
    writing into them writes the block's parameters."""
    gate_up, m = block.experts.gate_up_proj, block.expert_size
    return gate_up[:, :m], gate_up[:, m:], block.experts.down_proj


@torch.no_grad()
def moe_from_dense(
    gate_w: torch.Tensor,
    up_w: torch.Tensor,
    down_w: torch.Tensor,
    act: str,
    shared_idx: Any,
    routed_idx: Any,
    top_k: int,
    router: str,
    combine: str = "sum",
    router_weight: torch.Tensor | None = None,
    router_gate: torch.Tensor | None = None,
    router_up: torch.Tensor | None = None,
    router_offset: torch.Tensor | None = None,
    skip_mean: torch.Tensor | None = None,
    **extra: Any,
) -> MoeFFN:
    """Slice a dense GLU into a shared expert and routed experts (EW Eqs. 7-8, CMoE Eq. 5).

    ``gate_w``/``up_w``: ``[d_ffn, d_model]`` (nn.Linear layout); ``down_w``: ``[d_model, d_ffn]``.
    ``shared_idx``: neuron ids of the shared expert (may be empty); ``routed_idx``:
    ``[E, m]`` neuron ids of each routed expert. Neurons left out of both are pruned.
    Router parameters not given take their kind's default (``moelab_routers``: the expert
    centroids of the gate rows, EW Eq. 9; for the representative router the centroids of the
    gate and up rows — pass CMoE's representative-neuron rows to follow Eq. 18 exactly).
    ``skip_mean`` ``[E, d_model]``: the skipped experts' calibration means
    (``core.fitting.skipped_means``), added for the experts a token skips. ``extra``: further spec
    keys (``down_keep``, ``expert_groups`` …).
    """
    d_ffn, d_model = gate_w.shape
    if up_w.shape != gate_w.shape or down_w.shape != (d_model, d_ffn):
        raise ValueError(
            f"shapes gate {tuple(gate_w.shape)}, up {tuple(up_w.shape)}, down {tuple(down_w.shape)} "
            "do not form a GLU (gate/up [d_ffn, d_model], down [d_model, d_ffn])"
        )
    shared = _as_long(shared_idx).reshape(-1)
    routed = _as_long(routed_idx)
    if routed.numel() == 0:
        routed = routed.reshape(0, 0)
    if routed.dim() != 2:
        raise ValueError(f"routed_idx must be [n_routed, expert_size], got shape {tuple(routed.shape)}")
    used = torch.cat([shared, routed.reshape(-1)])
    if used.numel() and (used.min() < 0 or used.max() >= d_ffn):
        raise ValueError(f"neuron index out of range [0, {d_ffn})")
    if torch.unique(used).numel() != used.numel():
        raise ValueError("a neuron is assigned twice (shared/routed indices overlap)")
    E, m = routed.shape
    spec = {
        "kind": "moe", "d_model": int(d_model), "act": str(act), "d_shared": int(shared.numel()),
        "n_routed": int(E), "expert_size": int(m), "top_k": int(top_k), "router": router,
        "combine": combine, **({"skip_mean": True} if skip_mean is not None else {}), **extra,
    }
    dev = gate_w.device
    mod = empty_module(MoeFFN, spec, gate_w)
    sh, rt = shared.to(dev), routed.to(dev)
    if mod.d_shared:
        mod.shared_gate.weight.copy_(gate_w.index_select(0, sh))
        mod.shared_up.weight.copy_(up_w.index_select(0, sh))
        mod.shared_down.weight.copy_(down_w.index_select(1, sh))
    flat = rt.reshape(-1)
    gate_rows, up_rows, down = expert_rows(mod)
    gate_rows.copy_(gate_w.index_select(0, flat).reshape(E, m, d_model))
    up_rows.copy_(up_w.index_select(0, flat).reshape(E, m, d_model))
    # down_w[:, routed] is [d, E, m] -> [E, d, m]
    down.copy_(down_w.index_select(1, flat).reshape(d_model, E, m).permute(1, 0, 2))
    given = {"router_weight": router_weight, "router_gate": router_gate, "router_up": router_up,
             "router_offset": router_offset}
    given = {k: torch.as_tensor(v) for k, v in given.items() if v is not None}
    for name, value in mod.router.scorer.init(E, d_model, gate_rows, up_rows, given).items():
        if value is not None:
            getattr(mod, name).copy_(value)
    if mod.combine == "scaled":  # to_empty left them uninitialised
        mod.router_scale.zero_()
        mod.router_bias.zero_()
    if skip_mean is not None:
        if tuple(skip_mean.shape) != (E, d_model):
            raise ValueError(f"skip_mean must be [n_routed={E}, d_model={d_model}], got {tuple(skip_mean.shape)}")
        mod.skip_mean.copy_(skip_mean)
    return mod


@torch.no_grad()
def abstopk_from_dense(gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor, act: str, k: int,
                       **extra: Any) -> AbsTopKGLU:
    """EW Eq. 2's AbsTopK-GLU over the whole dense GLU (its weights copied as they are)."""
    d_ffn, d_model = gate_w.shape
    spec = {"kind": "abstopk", "d_model": int(d_model), "d_ffn": int(d_ffn), "act": act, "k": int(k), **extra}
    return dense_glu_module(AbsTopKGLU, spec, gate_w, up_w, down_w)


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


def build_one_layer(adapter: ModelAdapter, rows: list[LayerPlan], build_layer: LayerBuilder) -> Callable[[int], LayerExperts]:
    """``i -> LayerExperts`` of layer ``i`` (its dense gate/up weights as float32 numpy)."""
    def one(i: int) -> LayerExperts:
        gate_w, up_w, _ = (w.float().cpu().numpy() for w in dense_weights(adapter, i))
        return build_layer(rows[i], gate_w, up_w)
    return one


def map_in_process(layers: list[int], build_one: Callable[[int], LayerExperts], progress: Progress) -> list[LayerExperts]:
    """The default ``LayerMap``: one layer after the other in this process."""
    experts = []
    progress.update("cluster experts", 0, len(layers))
    for n, i in enumerate(layers):
        experts.append(build_one(i))
        progress.update("cluster experts", n + 1, len(layers))
    return experts


def partition_layers(adapter: ModelAdapter, profile: Any, rows: list[LayerPlan], build_layer: LayerBuilder,
                     progress: Progress = NO_PROGRESS, map_layers: LayerMap | None = None) -> list[LayerExperts]:
    """Partition every layer's neurons as ``rows`` plan (clustering is the slow part: per-layer progress).
    Layers are independent given the profile, so ``map_layers`` may build them anywhere."""
    check_compatible(adapter, profile)
    return (map_layers or map_in_process)(list(range(len(rows))), build_one_layer(adapter, rows, build_layer), progress)


def build_modules(adapter: ModelAdapter, experts: list[LayerExperts], params: Any = None) -> dict[int, nn.Module]:
    """One ``MoeFFN`` per layer, sliced from the dense weights (EW Eqs. 7–8, CM Eq. 5); a layer whose
    experts hold every neuron as shared and none routed (``allocation.dense_plan``) keeps its dense MLP.
    ``params``: the conversion's, for its ``combine`` (default ``sum``) and ``down_keep`` (default 1)."""
    combine = getattr(params, "combine", "sum")
    down_keep = getattr(params, "down_keep", 1.0)
    extra = {"down_keep": down_keep} if down_keep < 1 else {}
    modules: dict[int, nn.Module] = {}
    for e in experts:
        gate_w, up_w, down_w = dense_weights(adapter, e.layer)
        if not len(e.routed) and len(e.shared) == gate_w.shape[0]:
            continue
        router_weights = {k: torch.as_tensor(v, dtype=gate_w.dtype, device=gate_w.device) for k, v in e.router_weights.items()}
        modules[e.layer] = moe_from_dense(
            gate_w, up_w, down_w, adapter.activation, e.shared, e.routed, e.top_k, e.router, combine, **router_weights,
            **extra)
    return modules


def partition_modules(adapter: ModelAdapter, profile: Any, params: MethodParams, rows: list[LayerPlan],
                      build_layer: LayerBuilder, progress: Progress = NO_PROGRESS, data_dir: Any = None,
                      calib: Any = None, map_layers: LayerMap | None = None,
                      ) -> tuple[list[LayerPlan], list[LayerExperts], dict[int, nn.Module], dict[str, Any]]:
    """Plan → experts (→ fitted routers and budget plan, ``core.fitting``) → one ``MoeFFN`` per layer;
    returns ``(rows, experts, modules, fit record)``. ``calib``: calibration inputs already collected."""
    experts = partition_layers(adapter, profile, rows, build_layer, progress, map_layers)
    fit: dict[str, Any] = {}
    if needs_fitting(params):
        rows, experts, fit = fit_layers(adapter, profile, params, rows, experts, data_dir, progress, calib)
    modules = build_modules(adapter, experts, params)
    if getattr(params, "refit", "none") == "converted_inputs":
        windows = profile_token_windows(adapter, profile, params.fit_tokens, data_dir)  # type: ignore[attr-defined]
        fit |= refit_on_converted(adapter, params, experts, modules, windows, progress)
        modules = build_modules(adapter, experts, params)
    return rows, experts, modules, fit


def convert_partition(adapter: ModelAdapter, profile: Any, params: MethodParams, rows: list[LayerPlan],
                      build_layer: LayerBuilder, progress: Progress = NO_PROGRESS, data_dir: Any = None,
                      map_layers: LayerMap | None = None) -> tuple[Any, dict[str, Any]]:
    """``partition_modules`` → ``MoelabForCausalLM``; returns ``(moe_model, record)``. The dense model
    is converted in place."""
    t0 = time.perf_counter()
    before = parameter_counts(adapter.model)
    rows, experts, modules, fit = partition_modules(adapter, profile, params, rows, build_layer, progress, data_dir,
                                                    map_layers=map_layers)
    t1 = time.perf_counter()
    moe = build_moe_model(adapter, modules, provenance={"method": params.method, "router": params.router})  # type: ignore[attr-defined]
    record = partition_record(params, rows, experts, adapter.n_layers, before, parameter_counts(moe),
                              {"build_s": t1 - t0, "total_s": time.perf_counter() - t0})
    add_fit(record, fit)
    # which dense neurons each expert holds (not JSON: ``run_conversion`` writes it as PARTITION_FILE)
    record["partition"] = partition_arrays(experts)
    return moe, record


def partition_record(params: MethodParams, rows: list[LayerPlan], experts: list[LayerExperts], n_layers: int,
                     before: dict[str, int], after: dict[str, int], timings: dict[str, Any]) -> dict[str, Any]:
    """``conversion.json`` of a partition conversion: parameters, plan summary, parameter counts, per-layer rows."""
    return {
        "params": params.to_dict(),
        "summary": {
            **summarize(rows), "method": params.method, "n_layers": n_layers,
            "dense_total_params": before["total"], "dense_active_params": before["active"],
            "total_params": after["total"], "active_params": after["active"],
        },
        "layers": [{**asdict(p), **e.summary()} for p, e in zip(rows, experts)],
        "timings": timings,
    }


def add_fit(record: dict[str, Any], fit: dict[str, Any]) -> None:
    """A conversion record's fit (``core.fitting``), where there was one; the speed guard's note goes to the summary
    too, shown wherever the summary is (moelab convert, the designer's result card)."""
    if fit:
        record["fit"] = fit
        if "speed_guard" in fit:
            record["summary"]["speed_guard"] = fit["speed_guard"]["note"]


def partition_arrays(experts: list[LayerExperts]) -> dict[str, np.ndarray]:
    """``layer.{i}.shared`` [d_shared] and ``layer.{i}.routed`` [N_re, m] dense neuron ids (int32) of
    every converted layer: what an expert's card lists as its neurons."""
    out: dict[str, np.ndarray] = {}
    for e in experts:
        out[f"layer.{e.layer}.shared"] = np.ascontiguousarray(e.shared, dtype=np.int32)
        routed = np.asarray(e.routed)
        if routed.ndim != 2:  # [N_re, m]; a layer without routed experts may hold a flat empty array
            routed = routed.reshape(len(routed), -1 if routed.size else 0)
        out[f"layer.{e.layer}.routed"] = np.ascontiguousarray(routed, dtype=np.int32)
    return out


def build_partition(inputs: Any, params: MethodParams, plan_for: Callable[[Any, Any], list[LayerPlan]],
                    layer_builder: Callable[[Any, Any], LayerBuilder], progress: Progress = NO_PROGRESS
                    ) -> tuple[Any, Any, dict[str, Any]]:
    """The build step of a partition method (``Method.build``): load the dense model, plan every layer
    from the profile, partition and slice; returns ``(moe_model, tokenizer, record)``."""
    adapter = inputs.load_dense()
    profile = inputs.profile
    moe, record = convert_partition(adapter, profile, params, plan_for(profile, params), layer_builder(profile, params),
                                    progress, inputs.data_dir, map_layers=inputs.map_layers)
    return moe, adapter.tokenizer, record


def abstopk_modules(adapter: ModelAdapter, active_fraction: float) -> dict[int, nn.Module]:
    """EW Eq. 2 baseline: per token keep the ``round(active_fraction · d_ffn)`` largest |act(gate)|."""
    out = {}
    for lay in adapter.layers:
        k = max(1, int(round(active_fraction * lay.d_ffn)))
        out[lay.index] = abstopk_from_dense(*dense_weights(adapter, lay.index), adapter.activation, k)
    return out
