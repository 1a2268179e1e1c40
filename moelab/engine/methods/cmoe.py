"""CMoE (CM §3): a uniform S·A·E split of every FFN, from ATopK activation statistics.

* S·A·E: ``shared`` always-on experts, ``active`` routed experts per token (the runtime's
  ``top_k``), ``n_experts`` experts in all, of ``d_ffn // n_experts`` neurons each (CM §3.1);
* shared = the neurons with the highest ATopK activation rates μ (Eq. 5; markers of Eq. 4, K_a);
* routed = balanced clustering of the ATopK features ``c_i`` (each neuron's 0/1 marker over the
  profile's token sample) with L2 distances (Eq. 6), centroids initialised at the highest-rate
  remaining neurons, iterated to convergence (Eqs. 7–10), not the single iteration of the
  reference code;
* router ``representative``: the neuron of each cluster closest to its centroid (Eq. 17),
  ``G(x) = act(x W_gate^R) ⊙ (x W_up^R)`` (Eqs. 18–19); or ``gate_mass`` (see ``expertweaver``).

Recovery (CM §3.3): a differentiable gate scale u and a load-balancing bias b on the training-free
selection, plus LoRA on the experts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Sequence

import numpy as np

from ..core.allocation import LayerPlan, check_experts_fit, layer_plan, model_width, plan_record, validate_partition
from ..runtime.moelab_routers import PARTITION_ROUTERS
from ..core.params import ConversionError, MethodParams, check_compensation, param
from ..core.partition import LayerExperts, cluster_routed, finish, split_shared
from .base import ConversionInputs, Method, Recovery
from .labels import num

#: this method's own router and the ones any partition can use (``moelab_routers.PARTITION_ROUTERS``)
Router = Literal[("representative", *PARTITION_ROUTERS)]


@dataclass(frozen=True)
class CMoEParams(MethodParams):
    method: ClassVar[str] = "cmoe"

    # Defaults: the paper's S3A3E8 (CM §4.1, Table 3: 6 of 8 experts run, 75% activation), the
    # configuration that sits beside ExpertWeaver's default 25% sparsity; S1A1E8 is its 25% one.
    n_experts: int = param(8, "experts per layer (E of S·A·E), shared included", paper="CM §3.1", ge=1, aliases=("experts",))
    shared: int = param(3, "shared experts, always active (S of S·A·E)", paper="CM Eq. 5", ge=0)
    active: int = param(3, "routed experts active per token (A of S·A·E)", paper="CM §3.1", ge=0)
    router: Router = param(
        "representative", "representative: one neuron per expert (CM Eqs. 17-19); gate_mass: L1 mass of each expert's "
        "gate activations; ridge: linear scores fitted in closed form to each expert's output mass (moelab's)",
        paper="CM Eq. 18")
    plan: Literal["paper", "budget"] = param(
        "paper", "paper: A routed experts in every layer (CM §3.1); budget: the same total FFN cost, the routed experts "
        "per layer chosen by calibration error (moelab's)", paper="CM §3.1")
    compensation: Literal["none", "skipped_mean"] = param(
        "none", "none: a skipped expert adds nothing (CM Eq. 11); skipped_mean: it adds its mean output over the calibration "
        "tokens that skipped it (moelab's; additions only, no multiply-adds; needs combine 'sum')", paper="CM Eq. 11")
    combine: Literal["sum", "weighted"] = param("sum", "how selected experts add up; sum is CM Eq. 11", paper="CM Eq. 11",
                                                advanced=True)
    max_iter: int = param(50, "balanced clustering iteration cap", paper="CM Eqs. 7-10", ge=1, le=10000, advanced=True)
    fit_tokens: int = param(4096, "calibration tokens the ridge router and the budget plan are fitted on",
                            ge=256, le=1_000_000, advanced=True)

    def _check(self) -> None:
        s, a, e = self.shared, self.active, self.n_experts
        check_compensation(self)
        if s + a > e:
            raise ConversionError(f"S·A·E = {s}·{a}·{e}: shared + active ({s + a}) exceeds the {e} experts; lower S or A or raise n_experts")
        if s + a == 0:
            raise ConversionError("S·A·E with S = A = 0 computes nothing: activate at least one expert")
        if a > 0 and s == e:
            raise ConversionError("every expert is shared, none is left to route: lower S")


def plan(d_ffns: Sequence[int], params: CMoEParams) -> list[LayerPlan]:
    """The same S·A·E plan for every layer (it reads only the widths)."""
    params.check()
    check_experts_fit(params.n_experts, d_ffns)
    e = params.n_experts
    return [layer_plan(i, d, float("nan"), d // e, params.shared, d - (d // e) * e, e - params.shared, params.active)
            for i, d in enumerate(d_ffns)]


def plan_for(profile: Any, params: CMoEParams) -> list[LayerPlan]:
    return plan(profile.manifest["d_ffn"], params)


def preview(profile: Any, params: CMoEParams) -> dict[str, Any]:
    return plan_record(plan_for(profile, params), params, model_width(profile))


def layer_experts(row: LayerPlan, rate: np.ndarray, atopk_rows: np.ndarray, gate_w: np.ndarray, up_w: np.ndarray,
                  router: str = "representative", max_iter: int = 50) -> LayerExperts:
    """CM Eqs. 4–10 and 17–19 for one layer. ``atopk_rows``: stored marker rows ``[T_s, K_a]``."""
    from ..core.clustering import atopk_features, representative_neurons

    t0 = time.perf_counter()
    d_ffn = len(rate)
    shared, pool = split_shared(rate, row)
    features = atopk_features(atopk_rows, d_ffn)[pool]  # [n_pool, T_s] 0/1 markers
    # Initial centroids: the highest-rate neurons of the routed pool (CM §3.1).
    seeds = np.argsort(-rate[pool], kind="stable")[: row.n_routed]
    routed, res = cluster_routed(features, pool, row, init=features[seeds], metric="euclidean", max_iter=max_iter)
    weights = {}
    if router == "representative" and routed.size:
        if res is not None:
            local = np.searchsorted(pool, routed)  # positions of the routed ids inside the pool
            reps = pool[representative_neurons(features, local, res.centroids)]  # Eq. 17
        else:  # one routed expert: the router cannot change the choice, any member will do
            reps = routed[:, 0]
        weights = {"router_gate": gate_w[reps], "router_up": up_w[reps]}  # Eq. 18
    return finish(row, shared, routed, router, weights, res, t0)


def layer_builder(profile: Any, params: CMoEParams) -> Any:
    """Per-layer expert construction reading ``profile`` (a ``core.slicing.LayerBuilder``)."""
    rate = profile.column_by_layer("rate")

    def build_layer(row: LayerPlan, gate_w: np.ndarray, up_w: np.ndarray) -> LayerExperts:
        return layer_experts(row, rate[row.layer], profile.atopk(row.layer), gate_w, up_w, params.router, params.max_iter)

    return build_layer


def build(inputs: ConversionInputs, params: CMoEParams, progress: Any) -> tuple[Any, Any, dict[str, Any]]:
    from ..core.slicing import build_partition

    return build_partition(inputs, params, plan_for, layer_builder, progress)


def baselines(adapter: Any, record: dict[str, Any], progress: Any, data_dir: Any = None) -> dict[str, Any]:
    """AbsTopK-GLU at the same active fraction (EW Eq. 2); S·A·E is already uniform."""
    from ..core.slicing import abstopk_modules

    return {"abstopk": abstopk_modules(adapter, record["summary"]["active_fraction"])}


def prepare_recovery(moe: Any, modules: dict[int, Any], batch: Any) -> tuple[dict[int, Any], dict[str, Any], bool]:
    """CM §3.3: the training-free sum combine gains a gate scale u and a balancing bias b (u = b = 0)."""
    for mod in modules.values():
        if mod.n_routed > 0:
            mod.use_scaled_combine()
    return modules, {}, False


def accepts_recovery(spec: dict[str, Any]) -> str | None:
    """CM §3.3 extends the training-free sum combine (or a layer it already made ``scaled``)."""
    if spec.get("combine") in ("sum", "scaled"):
        return None
    return (f"cmoe fine-tuning extends the training-free 'sum' combine (CM §3.3), these combine {spec.get('combine')!r}: "
            "use mode expertweaver or dense2moe for those")


def split_label(p) -> list[str]:
    """CM's own name for a split: S shared, A active, E experts in all ('S1·A1·E64')."""
    return [f"S{num(p.get('shared'))}·A{num(p.get('active'))}·E{num(p.get('n_experts'))}"]


METHOD = Method(
    name="cmoe",
    label=split_label,
    title="CMoE",
    paper="CM §3",
    summary="uniform S·A·E split: shared experts by ATopK rate (Eq. 5), balanced clustering of ATopK markers (Eqs. 6-10), representative-neuron router (Eqs. 17-19)",
    params=CMoEParams,
    needs="profile",
    build=build,
    partition=(plan_for, layer_builder),
    validate=validate_partition,
    preview=preview,
    # CM §4: u trains, not the router weights; b balances the load instead of EW's λ (AF §4.3).
    recovery=Recovery(paper="CM §3.3: gate scale u + balancing bias b, LoRA", load_balance=False,
                      summary="CMoE: top-k of s′ + b, gate g_i = 1 + s′_i·u_i (CM §3.3); learns the scale u and LoRA "
                              "adapters, moves the bias b by γ per step toward equal load (AF Eq. 9); no auxiliary loss, "
                              "λ unused.",
                      router_params=("router_scale",), prepare=prepare_recovery,
                      accepts=accepts_recovery),
    baselines=baselines,
)
