"""Per-layer expert plans: how many shared and routed experts a layer gets, and how many run.

A ``LayerPlan`` is what every partition method (``methods.expertweaver``: EW Eqs. 4–6;
``methods.cmoe``: CMoE's uniform S·A·E) produces per layer and what expert construction reads.
Names (see docs/glossary.md): ``n_experts`` counts every expert of a layer, shared
included; ``n_routed`` the routed ones; ``top_k`` the routed experts active per token (shared
experts always run and are not counted in it).

When ``d_ffn`` is not divisible by ``n_experts``: routed experts all have ``d_expert = d_ffn // n_experts``
neurons (equal sizes keep clustering exact and dispatch batched) and the ``d_ffn mod n_experts``
leftover neurons join the shared expert, so every neuron is kept and always computed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from ..runtime.moelab_routers import ffn_macs, kept, router_kind
from .params import ConversionError, MethodParams


@dataclass
class LayerPlan:
    layer: int
    d_ffn: int
    r: float  # EW Eq. 4 (NaN for CMoE)
    alpha: float  # EW Eq. 5 (shared share of d_ffn actually allocated, for CMoE)
    d_expert: int  # neurons per routed expert (m)
    n_shared: int  # N_se: shared experts (the leftover neurons ride along in the shared part)
    d_shared: int  # neurons in the always-on shared part = n_shared · m + leftover
    n_routed: int  # N_re
    top_k: int  # routed experts activated per token
    active_neurons: int
    active_fraction: float
    static: bool  # no routed expert runs: the layer is a fixed prune
    clamped: bool  # Eq. 6 asked for more shared experts than the active budget allowed
    note: str = ""


def specialisation_ratio(cv_by_layer: Sequence[np.ndarray], tau: float) -> np.ndarray:
    """EW Eq. 4, one value per layer."""
    return np.array([float(np.mean(np.asarray(cv) > tau)) for cv in cv_by_layer])


def layer_plan(layer: int, d_ffn: int, r: float, m: int, n_shared: int, leftover: int, n_routed: int, top_k: int,
               clamped: bool = False, note: str = "") -> LayerPlan:
    """A layer of ``n_shared`` shared experts (plus the leftover neurons) and ``n_routed`` routed ones of ``m`` neurons."""
    d_shared = n_shared * m + leftover
    active = d_shared + top_k * m
    return LayerPlan(
        layer=layer, d_ffn=d_ffn, r=r, alpha=d_shared / d_ffn, d_expert=m, n_shared=n_shared,
        d_shared=d_shared, n_routed=n_routed, top_k=top_k, active_neurons=active,
        active_fraction=active / d_ffn, static=top_k == 0 or n_routed == 0, clamped=clamped, note=note,
    )


def dense_plan(layer: int, d_ffn: int, r: float, m: int) -> LayerPlan:
    """A layer left dense: every neuron in the always-on part, no routed expert, no router (the
    conversion keeps the dense MLP there, ``core.slicing.build_modules``; exports list it as a dense
    layer). ``d_expert`` stays the model's expert size ``m``."""
    return LayerPlan(layer=layer, d_ffn=d_ffn, r=r, alpha=1.0, d_expert=m, n_shared=d_ffn // m, d_shared=d_ffn,
                     n_routed=0, top_k=0, active_neurons=d_ffn, active_fraction=1.0, static=False, clamped=False,
                     note="left dense (all neurons kept)")


def is_dense(row: LayerPlan) -> bool:
    """Whether ``row`` keeps its layer dense (``dense_plan``)."""
    return row.n_routed == 0 and row.d_shared == row.d_ffn


def summarize(rows: list[LayerPlan]) -> dict[str, Any]:
    """Whole-model numbers the UI and the CLI print next to the per-layer plan."""
    d = np.array([r.d_ffn for r in rows])
    active = np.array([r.active_neurons for r in rows])
    return {
        "layers": len(rows),
        "active_fraction": float(active.sum() / d.sum()),
        "sparsity": float(1 - active.sum() / d.sum()),
        "static_layers": [r.layer for r in rows if r.static],
        "dense_layers": [r.layer for r in rows if is_dense(r)],
        "clamped_layers": [r.layer for r in rows if r.clamped],
        "mean_alpha": float(np.mean([r.alpha for r in rows])),
    }


def layer_cost(row: LayerPlan, router: str, d_model: int, down_keep: float = 1.0) -> tuple[int, int]:
    """Per-token multiply-adds of a planned layer below all of its experts: ``(always-run part, one
    selected routed expert)``; the shared expert plus the router kind's scoring, and its per-expert
    cost (``moelab_routers.Router.macs``: gate_mass computes every routed neuron's gate to score,
    after which a selected expert adds only its up and down rows; under ``down_keep`` only the kept
    neurons' down rows). What the budget plan buys with; ``ffn_macs`` of the same layer."""
    E, m, d = row.n_routed, row.d_expert, d_model
    fixed = ffn_macs(d, row.d_shared, 0, m, 0, router, down_keep=down_keep)
    skipped_down = d * (m - kept(m, down_keep))
    if E == 0:
        return fixed, 3 * d * m - skipped_down
    scoring, per_expert = router_kind(router).macs(d, E, m)
    return fixed + scoring, per_expert - skipped_down


def plan_macs(row: LayerPlan, router: str, d_model: int, combine: str = "sum", down_keep: float = 1.0) -> int:
    """Multiply-adds per token of a planned layer: ``moelab_routers.ffn_macs``, the function the
    converted layer counts its own cost with (``MoeFFN.active_param_count``); a layer left dense keeps
    its dense MLP, so it costs ``3·d·d_ffn`` whatever ``down_keep``."""
    if is_dense(row):
        return 3 * d_model * row.d_ffn
    return ffn_macs(d_model, row.d_shared, row.n_routed, row.d_expert, row.top_k, router, combine, down_keep)


def plan_flops_fraction(rows: Sequence[LayerPlan], router: str, d_model: int, combine: str = "sum",
                        down_keep: float = 1.0) -> float:
    """``ffn_flops_fraction`` of a plan: FFN multiply-adds per token, router and scoring included,
    over the dense FFN's ``3·d·d_ffn`` per layer."""
    cost = sum(plan_macs(row, router, d_model, combine, down_keep) for row in rows)
    return cost / sum(3 * d_model * row.d_ffn for row in rows)


def whole_width_counts(d_ffn: int, multiple: int) -> list[int]:
    """The expert counts (two or more) that split ``d_ffn`` into experts a whole ``multiple`` neurons wide."""
    return [n for n in range(2, d_ffn // multiple + 1) if d_ffn % n == 0 and (d_ffn // n) % multiple == 0]


def check_experts_fit(n_experts: int, d_ffns: Iterable[int]) -> None:
    """Every layer must have at least one neuron per expert."""
    for d in sorted(set(d_ffns)):
        if n_experts > d:
            raise ConversionError(f"{n_experts} experts do not fit d_ffn={d}: use at most {d} (one neuron each)")


def validate_partition(params: Any, profiles: list[Any]) -> None:
    """``Method.validate`` of a partition method: its own rules, and every layer fits ``n_experts``."""
    params.check()
    check_experts_fit(params.n_experts, profiles[0].manifest["d_ffn"])


def model_width(profile: Any) -> int | None:
    """``d_model`` of a profiled model (None when the profile does not record it: no cost then)."""
    return (getattr(profile, "manifest", None) or {}).get("model", {}).get("d_model")


def plan_record(rows: list[LayerPlan], params: MethodParams, d_model: int | None = None) -> dict[str, Any]:
    """The whole per-layer plan as the designer and the API show it; with ``d_model``, its
    ``ffn_flops_fraction`` (the cost the converted model will record) too."""
    summary = summarize(rows)
    if d_model:
        summary["ffn_flops_fraction"] = plan_flops_fraction(rows, getattr(params, "router", "centroid"), d_model,
                                                            getattr(params, "combine", "sum"),
                                                            getattr(params, "down_keep", 1.0))
        plan = getattr(params, "plan", "paper")
        if plan == "budget":
            summary["plan_note"] = ("budget plan: this is the paper plan; the conversion redistributes top-k across "
                                    "layers by calibration error at the same or a lower cost, and leaves dense a "
                                    "layer that would run every expert")
        elif plan == "leading":
            summary["plan_note"] = ("leading plan: this is the uniform starting plan; the conversion chooses how many "
                                    "leading layers stay dense and one top-k for the rest by calibration error, at "
                                    "ffn_flops_fraction ≤ 1 − sparsity")
    return {"params": params.to_dict(), "layers": [asdict(r) for r in rows], "summary": summary}
