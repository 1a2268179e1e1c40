"""Conversion: profile + model + parameters -> one MoE module per decoder layer.

The pipeline reads like the papers: allocation (``allocation.plan``, EW Eqs. 4–6 or CMoE
S·A·E) -> expert construction per layer (``experts``) -> runtime modules
(``modeling_moelab.MoeFFN.from_dense``). Baselines built here too, so every conversion can
be compared with them in one evaluation: AbsTopK-GLU at the same sparsity (EW Eq. 2) and a
uniform allocation with the same mean shared ratio (EW without layer adaptivity).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Sequence

import numpy as np
import torch
from torch import nn

from .allocation import AllocationParams, LayerPlan, plan, summarize
from .partition import LayerExperts, RouterChoice, cmoe_layer, expertweaver_layer
from ..runtime.modeling_moelab import AbsTopKGLU, MoeFFN
from ..models import ModelAdapter
from ..progress import NO_PROGRESS, Progress


class ConversionError(ValueError):
    """The conversion cannot run as asked; the message says what to change."""


@dataclass(frozen=True)
class ConversionParams:
    allocation: AllocationParams = AllocationParams()
    router: RouterChoice = "paper"
    combine: Literal["sum", "weighted"] = "sum"  # EW Eq. 10 / CM Eq. 11: unweighted sum
    seed: int = 0
    max_iter: int = 50

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "allocation": self.allocation.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ConversionParams":
        return cls(**{**d, "allocation": AllocationParams(**d["allocation"])})


@dataclass
class Conversion:
    params: ConversionParams
    plan: list[LayerPlan]
    experts: list[LayerExperts]
    modules: dict[int, nn.Module]
    timings: dict[str, float] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """What ``conversion.json`` holds: parameters, per-layer allocation, clustering, timings."""
        return {
            "params": self.params.to_dict(),
            "summary": summarize(self.plan),
            "layers": [{**asdict(p), **e.summary()} for p, e in zip(self.plan, self.experts)],
            "timings": self.timings,
        }


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


def _weights(adapter: ModelAdapter, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lay = adapter.layers[i]
    return lay.gate_weight().detach(), lay.up_weight().detach(), lay.down_weight().detach()


def build_experts(adapter: ModelAdapter, profile: Any, params: ConversionParams, progress: Progress = NO_PROGRESS) -> tuple[list[LayerPlan], list[LayerExperts]]:
    """Plan every layer and partition its neurons (clustering is the slow part: per-layer progress)."""
    check_compatible(adapter, profile)
    rows = plan(profile.cv_by_layer(), params.allocation)
    method = params.allocation.method
    score_col = "abs_mean" if method == "expertweaver" else "rate"
    scores = profile.column_by_layer(score_col)
    experts = []
    progress.update("cluster experts", 0, len(rows))
    for i, row in enumerate(rows):
        gate_w, up_w, _ = (w.float().cpu().numpy() for w in _weights(adapter, i))
        if method == "expertweaver":
            e = expertweaver_layer(row, scores[i], profile.sample_means(i), gate_w, params.router, params.seed, params.max_iter)
        else:
            e = cmoe_layer(row, scores[i], profile.atopk(i), gate_w, up_w, params.router, params.max_iter)
        experts.append(e)
        progress.update("cluster experts", i + 1, len(rows))
    return rows, experts


def build_modules(adapter: ModelAdapter, experts: list[LayerExperts], combine: str = "sum") -> dict[int, nn.Module]:
    """One ``MoeFFN`` per layer, sliced from the dense weights (EW Eqs. 7–8, CM Eq. 5)."""
    modules: dict[int, nn.Module] = {}
    for e in experts:
        gate_w, up_w, down_w = _weights(adapter, e.layer)
        router_weights = {k: torch.as_tensor(v, dtype=gate_w.dtype, device=gate_w.device) for k, v in e.router_weights.items()}
        modules[e.layer] = MoeFFN.from_dense(
            gate_w, up_w, down_w, adapter.activation, e.shared, e.routed, e.top_k, e.router, combine, **router_weights
        )
    return modules


def convert(adapter: ModelAdapter, profile: Any, params: ConversionParams, progress: Progress = NO_PROGRESS) -> Conversion:
    t0 = time.perf_counter()
    rows, experts = build_experts(adapter, profile, params, progress)
    t1 = time.perf_counter()
    modules = build_modules(adapter, experts, params.combine)
    t2 = time.perf_counter()
    timings = {"cluster_s": t1 - t0, "build_s": t2 - t1, "total_s": t2 - t0}
    return Conversion(params, rows, experts, modules, timings)


# --------------------------------------------------------------------------- baselines


def abstopk_modules(adapter: ModelAdapter, active_fraction: float) -> dict[int, nn.Module]:
    """EW Eq. 2 baseline: per token keep the ``round(active_fraction · d_ffn)`` largest |act(gate)|."""
    out = {}
    for lay in adapter.layers:
        k = max(1, int(round(active_fraction * lay.d_ffn)))
        out[lay.index] = AbsTopKGLU.from_dense(*_weights(adapter, lay.index), adapter.activation, k)
    return out


def uniform_params(params: ConversionParams, alphas: Sequence[float]) -> ConversionParams:
    """The same conversion with one shared ratio for every layer: the mean of the plan's
    per-layer shared shares ``alphas`` (``LayerPlan.alpha``), so the shared budget is equal."""
    alloc = params.allocation
    if alloc.method != "expertweaver":
        return params  # CMoE's S·A·E is already uniform
    mean_alpha = float(np.mean(alphas))
    if alloc.alpha_basis == "active":
        mean_alpha = mean_alpha / (1 - alloc.sparsity)
    mean_alpha = min(1.0, mean_alpha)
    return replace(params, allocation=replace(alloc, alpha_min=mean_alpha, alpha_max=mean_alpha))
