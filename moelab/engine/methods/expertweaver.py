"""ExpertWeaver (EW §3): a layer-adaptive split of every FFN into a shared expert and routed experts.

The path of data, as in the paper:

* Eq. 4  ``r_ℓ = mean_j 1[CV_j > τ]``                        (specialisation ratio, from the profile's CV, Eq. 3)
* Eq. 5  ``α_ℓ = α_max − (α_max − α_min) · r_ℓ``            (shared-neuron ratio)
* Eq. 6  ``d_s = round(α_ℓ · d_ffn)``, ``N_se = round(d_s / d_expert)``, ``N_re = n_experts − N_se``;
  per token ``k = round((1 − sparsity) · n_experts)`` experts run: the ``N_se`` shared ones plus
  ``top_k = k − N_se`` routed ones. ``sparsity`` is the fraction of FFN neurons NOT computed per token.
* Eq. 7  shared = the ``d_shared`` neurons with the largest |mean activation| (profile ``abs_mean``);
* Eq. 8  routed = balanced k-means of the remaining neurons' activation profiles ``a_i ∈ R^M``
  (App. G, squared-L2 objective Eq. 13), k-means++ seeding with ``seed``;
* Eq. 9  router ``centroid``: ``W_router[:, i] = mean_{j∈C_i} W_gate[:, j]``; Eq. 10 unweighted sum.

Two readings of α (``alpha_basis``): ``"total"`` (Eq. 6 as written: α is a share of all ``d_ffn``
neurons; on small models at 50% sparsity the paper's defaults can ask for more shared experts than
``k``, and the plan then clamps ``N_se`` to ``k`` and marks the layer ``static``, a fixed prune) and
``"active"`` (α is a share of the active budget, ``d_s = round(α · (1 − sparsity) · d_ffn)``, so
routing always survives unless α = 1). ``router="gate_mass"`` scores each routed expert by the L1
mass of its own gate activations (costs the gate projection of every routed neuron).

Recipes: ``best`` is the best training-free conversion measured (per-layer budget plan, skipped-expert
compensation: neither exports to a stock MoE); ``portable`` the best one whose layout GGUF and
native HF exports hold once recovery (EW Eq. 11) has made its router a softmax with a weighted
combine: ``plan="leading"`` (one shared count from Eqs. 5–6 with the layers' mean α, one top-k, only
leading layers dense; ``plan``), no compensation, and 12 experts a multiple of 64 neurons wide
(``width_multiple``; 128 on the default model): coarser than the paper's 64 because llama.cpp pays per selected
expert, and whole 64s because llama.cpp's f16 dot product on AVX-512 runs 64 values per step and the rest of a row
one at a time (16 experts are 96 wide there). Both measured in tests/benchmarks/bench_frontier.py and
bench_llamacpp.py (--experts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal, Sequence

import numpy as np

from ..core.allocation import (LayerPlan, check_experts_fit, layer_plan, model_width, plan_record, validate_partition,
                               specialisation_ratio, whole_width_counts)
from ..runtime.moelab_routers import PARTITION_ROUTERS
from ..core.params import ConversionError, MethodParams, check_compensation, needs_fitting, param
from ..core.partition import LayerExperts, cluster_routed, finish, split_shared
from ..core.speed_prediction import PREDICTION_ERROR
from .base import ConversionInputs, Method, Recovery
from .labels import num, pct

#: this method's own router and the ones any partition can use (``moelab_routers.PARTITION_ROUTERS``)
Router = Literal[("centroid", *PARTITION_ROUTERS)]

EW_INIT_LOGIT_STD = 0.05  # router logits' std across experts at the start of EW fine-tuning


@dataclass(frozen=True)
class ExpertWeaverParams(MethodParams):
    method: ClassVar[str] = "expertweaver"

    n_experts: int = param(64, "experts per layer (N_e), shared included", paper="EW Eq. 6", ge=1, aliases=("experts",))
    alpha_min: float = param(0.2, "shared share of the most specialised layer", paper="EW Eq. 5", ge=0, le=1)
    alpha_max: float = param(0.7, "shared share of the least specialised layer", paper="EW Eq. 5", ge=0, le=1)
    tau: float = param(0.6, "CV threshold of a specialised neuron", paper="EW Eq. 4", gt=0)
    sparsity: float = param(0.25, "what a token saves: plan paper, the share of FFN neurons not computed (EW §3.2); plans budget "
                            "and leading, the share of FFN multiply-adds saved (ffn_flops_fraction ≤ 1 − sparsity, router included)",
                            paper="EW §3.2", gt=0, lt=1)
    alpha_basis: Literal["total", "active"] = param(
        "total", "α as a share of all neurons (total, EW Eq. 6) or of the active budget (active)", paper="EW Eq. 6")
    router: Router = param(
        "centroid", "centroid: gate-column centroids (EW Eq. 9); gate_mass: L1 mass of each expert's gate activations; "
        "ridge: linear scores fitted in closed form to each expert's output mass on calibration tokens (moelab's)",
        paper="EW Eq. 9")
    plan: Literal["paper", "budget", "leading"] = param(
        "paper", "paper: one top-k for every layer (EW Eq. 6); budget: per-layer top-k chosen by calibration error so "
        "that the FFN cost, router included, is at most 1 - sparsity of the dense FFN's (moelab's); leading: one shared "
        "count (the layers' mean α), one top-k, and the first L layers left dense, L and top-k chosen by calibration "
        "error under the same cost cap: the layout GGUF (llama.cpp deepseek) and native HF (Qwen2-MoE) exports hold "
        "(moelab's)", paper="EW Eq. 6")
    compensation: Literal["none", "skipped_mean"] = param(
        "none", "none: a skipped expert adds nothing (EW Eq. 10); skipped_mean: it adds its mean output over the calibration "
        "tokens that skipped it (moelab's; additions only, no multiply-adds; needs combine 'sum')", paper="EW Eq. 10")
    combine: Literal["sum", "weighted"] = param("sum", "how selected experts add up; sum is EW Eq. 10", paper="EW Eq. 10",
                                                advanced=True)
    seed: int = param(0, "k-means++ seeding of the balanced clustering", paper="EW App. G", ge=0, advanced=True)
    max_iter: int = param(50, "balanced k-means iteration cap", paper="EW App. G", ge=1, le=10000, advanced=True)
    plan_error: Literal["residual", "output", "fisher"] = param(
        "residual", "how the budget and leading plans weigh a layer's calibration error: residual (each token's error "
        "over its residual stream's squared norm), output (over the dense FFN output's: every layer's relative error "
        "alike) or fisher (each output dimension by the squared gradient of the calibration loss: the loss increase "
        "to second order; one backward pass more; moelab's)", advanced=True)
    fit_tokens: int = param(4096, "calibration tokens the ridge router and the budget plan are fitted on",
                            ge=256, le=1_000_000, advanced=True)
    down_keep: float = param(
        1.0, "fraction of each active expert's neurons, shared expert included, whose down projection runs per token: "
        "those of largest |act(gate)·up|, as TEAL sparsifies the down projection's input (1: all, EW Eq. 10; "
        "moelab's). The budget plan spends what it saves on more experts. Its saving needs a kernel that skips the "
        "other rows (moelab's CPU decode kernel does); GGUF and native exports refuse it", gt=0, le=1, advanced=True)
    max_routed_share: float = param(
        1.0, "budget plan: the largest share of a layer's routed experts a token may run; a layer worth more is written "
        "whole (its dense MLP, at the dense multiply-adds), as is one that would run them all. On an AVX-512 CPU the native "
        "kernels beat the dense GEMMs at prefill only while a layer runs about half its experts or fewer (moelab's)",
        gt=0, le=1, advanced=True)
    speed_guard: Literal["none", "machine"] = param(
        "none", "budget plan: machine offers a layer only the top-k this machine's kernel table (measured by the model's "
        "profile) predicts no slower than the dense FFN in every phase (decode at batch 1 and 8, prefill of 512), so "
        "the plan trades no phase's seconds for multiply-adds where the kernels do not turn them into time; without "
        "a table every top-k is offered, and the record says so (moelab's)", advanced=True)
    speed_margin: float = param(
        0.0, "speed_guard machine: offer only the top-k predicted at most 1 - margin of the dense FFN's time in every "
        "phase, so that a plan the guard holds at dense is not slower than dense by the prediction's error (a few "
        "percent; without the guard it does nothing; moelab's)", ge=0, le=0.2, advanced=True)
    width_multiple: int = param(
        1, "experts a whole multiple of this many neurons wide: the plan takes the expert count nearest n_experts (more "
        "experts on a tie) that splits d_ffn so, and says so in each layer's note; where none does, n_experts as given. "
        "64 for llama.cpp: its f16 dot product runs 64 values per step on AVX-512 and the rest of a row one at a time, "
        "and q8_0 quantises rows in blocks of 32 (1: n_experts as given; moelab's)", ge=1, le=4096, advanced=True)
    refit: Literal["none", "converted_inputs"] = param(
        "none", "none: the ridge router and skipped-expert means are fitted on the dense model's MLP inputs; "
        "converted_inputs: fitted again on the inputs the converted model produces (one more calibration forward; moelab's)",
        advanced=True)

    def flops_budget(self) -> float:
        """The budget plan's cap on ``ffn_flops_fraction``."""
        return 1 - self.sparsity

    def _check(self) -> None:
        check_compensation(self)
        if self.refit != "none" and not needs_fitting(self):
            raise ConversionError(f"refit {self.refit!r} fits the ridge router and the skipped-expert means again: use "
                                  "router 'ridge' or compensation 'skipped_mean' (--recipe best), or refit 'none'")
        if self.plan_error != "residual" and self.plan == "paper":
            raise ConversionError(f"plan_error {self.plan_error!r} weighs the errors the budget and leading plans choose "
                                  "top-k by; the paper plan has none: use plan 'budget' (--recipe best) or 'leading', "
                                  "or plan_error 'residual'")
        if self.down_keep < 1 and self.plan == "leading":
            raise ConversionError(f"down_keep {self.down_keep} runs part of each expert, which no export layout holds, and "
                                  "the leading plan exists for those layouts: use plan 'budget' (--recipe best) or down_keep 1")
        if self.speed_guard != "none" and self.plan != "budget":
            raise ConversionError(f"speed_guard {self.speed_guard!r} chooses among the budget plan's top-k per layer: use "
                                  "plan 'budget' (--recipe best) or speed_guard 'none'")
        if self.max_routed_share < 1 and self.plan != "budget":
            raise ConversionError(f"max_routed_share {self.max_routed_share} caps the budget plan's top-k per layer: use "
                                  "plan 'budget' (--recipe best) or max_routed_share 1")
        if self.alpha_min > self.alpha_max:
            raise ConversionError(f"alpha_min ({self.alpha_min}) must not exceed alpha_max ({self.alpha_max}): swap or lower alpha_min")
        if round((1 - self.sparsity) * self.n_experts) < 1:
            raise ConversionError(
                f"sparsity {self.sparsity} with {self.n_experts} experts leaves no expert active: lower sparsity or use more experts"
            )


# --------------------------------------------------------------------------- plan (EW Eqs. 4–6)


def plan(cv_by_layer: Sequence[np.ndarray], params: ExpertWeaverParams) -> list[LayerPlan]:
    """Per-layer plan from the stored CV statistics (numpy only: cheap enough for every slider move).

    ``plan="leading"`` (moelab's) plans for the formats a converted model is served in: llama.cpp's
    ``deepseek`` architecture and HF's Qwen2-MoE hold one routed-expert count, expert size, top-k
    and shared width per model, and llama.cpp leaves only the leading layers dense. It keeps EW
    Eq. 5 (α from each layer's specialisation r_ℓ) averaged over the layers, ``ᾱ = mean_ℓ α_ℓ``,
    and Eq. 6 (``d_s = round(ᾱ · base)``, ``N_se = round(d_s / d_expert)``) for one shared count in
    every layer; a different shared count per candidate would re-cluster every layer. This numpy
    plan is the uniform starting plan (the paper's top-k, no dense layer); the conversion then
    chooses how many leading layers stay dense and the one top-k of the rest by calibration error
    (``core.fitting``: ``leading_choice``)."""
    params.check()
    d_ffns = [len(cv) for cv in cv_by_layer]
    check_experts_fit(params.n_experts, d_ffns)
    r = specialisation_ratio(cv_by_layer, params.tau)
    alpha = params.alpha_max - (params.alpha_max - params.alpha_min) * r  # EW Eq. 5
    if params.plan == "leading":
        if len(set(d_ffns)) > 1:
            raise ConversionError(f"plan 'leading' needs one d_ffn in every layer (one expert size per model); this "
                                  f"model has {sorted(set(d_ffns))}: use plan 'paper' or 'budget'")
        alpha = np.full_like(alpha, alpha.mean())
    return [_plan_layer(i, d, float(r[i]), float(alpha[i]), params) for i, d in enumerate(d_ffns)]


def expert_count(d_ffn: int, n_experts: int, width_multiple: int) -> int:
    """``n_experts``, or with ``width_multiple`` > 1 the count nearest it (two or more; more experts on a tie: finer
    experts scored better training-free, docs/quality.md) that splits ``d_ffn`` into experts a whole
    ``width_multiple`` wide; ``n_experts`` where no count does. Choice (not in the paper): the runtimes people
    serve MoEs in step through a row in fixed widths (ggml's f16 dot product 64 values on AVX-512, q8_0 blocks of
    32), and a remainder costs there."""
    if width_multiple <= 1:
        return n_experts
    return min(whole_width_counts(d_ffn, width_multiple), key=lambda n: (abs(n - n_experts), -n), default=n_experts)


def _plan_layer(layer: int, d_ffn: int, r: float, alpha: float, p: ExpertWeaverParams) -> LayerPlan:
    e = expert_count(d_ffn, p.n_experts, p.width_multiple)
    m = d_ffn // e
    k = int(round((1 - p.sparsity) * e))  # experts per token, shared included
    base = d_ffn if p.alpha_basis == "total" else (1 - p.sparsity) * d_ffn
    d_s = int(round(alpha * base))  # EW Eq. 6
    asked = int(round(d_s / m))
    # the leading plan keeps a routed expert per token: a layer with none is no MoE layer to export
    most = max(0, k - 1) if p.plan == "leading" else k
    n_shared = min(asked, most)
    top_k = k - n_shared
    notes = []
    if p.width_multiple > 1:
        notes.append(f"{e} experts of {m} neurons (n_experts {p.n_experts}, width a multiple of {p.width_multiple})"
                     if m % p.width_multiple == 0 else f"no expert count splits d_ffn {d_ffn} into experts a multiple of "
                     f"{p.width_multiple} wide: {e} experts of {m} neurons")
    if asked > most:
        notes.append(
            f"Eq. 6 asks for {asked} shared experts but only {most} can be: clamped to {most}"
            + (", one routed expert runs" if p.plan == "leading" else ", no routed expert runs (static prune)")
            + "; lower alpha_max, raise tau or use alpha_basis='active'"
        )
    elif top_k == 0:
        notes.append("all active experts are shared: no routed expert runs (static prune)")
    note = "; ".join(notes)
    return layer_plan(layer, d_ffn, r, m, n_shared, d_ffn - m * e, e - n_shared, top_k, asked > most, note)


def preview(profile: Any, params: ExpertWeaverParams) -> dict[str, Any]:
    """The whole per-layer plan for a stored profile (``profiling.store.StoredProfile``)."""
    return plan_record(plan_for(profile, params), params, model_width(profile))


# --------------------------------------------------------------------------- experts (EW Eqs. 7–9)


def layer_experts(row: LayerPlan, abs_mean: np.ndarray, sample_means: np.ndarray, gate_w: np.ndarray,
                  router: str = "centroid", seed: int = 0, max_iter: int = 50) -> LayerExperts:
    """EW Eqs. 7–9 for one layer. ``sample_means``: ``[M, d_ffn]``; ``gate_w``: ``[d_ffn, d_model]``."""
    t0 = time.perf_counter()
    shared, pool = split_shared(abs_mean, row)
    routed, res = cluster_routed(sample_means[:, pool].T, pool, row, seed=seed, max_iter=max_iter)
    weights = {}
    if router == "centroid":
        weights["router_weight"] = gate_w[routed].mean(axis=1) if routed.size else np.zeros((0, gate_w.shape[1]))
    return finish(row, shared, routed, router, weights, res, t0)


def plan_for(profile: Any, params: ExpertWeaverParams) -> list[LayerPlan]:
    return plan(profile.cv_by_layer(), params)


def layer_builder(profile: Any, params: ExpertWeaverParams) -> Any:
    """Per-layer expert construction reading ``profile`` (a ``core.slicing.LayerBuilder``)."""
    abs_mean = profile.column_by_layer("abs_mean")

    def build_layer(row: LayerPlan, gate_w: np.ndarray, _up_w: np.ndarray) -> LayerExperts:
        return layer_experts(row, abs_mean[row.layer], profile.sample_means(row.layer), gate_w,
                             params.router, params.seed, params.max_iter)

    return build_layer


def build(inputs: ConversionInputs, params: ExpertWeaverParams, progress: Any) -> tuple[Any, Any, dict[str, Any]]:
    from ..core.slicing import build_partition

    return build_partition(inputs, params, plan_for, layer_builder, progress)


# --------------------------------------------------------------------------- evaluation baselines


def uniform_params(params: ExpertWeaverParams, alphas: Sequence[float]) -> ExpertWeaverParams:
    """The same conversion with one shared ratio for every layer: the mean of the plan's per-layer
    shared shares ``alphas`` (``LayerPlan.alpha``), so the shared budget is equal (EW without Eq. 5)."""
    mean_alpha = float(np.mean(alphas))
    if params.alpha_basis == "active":
        mean_alpha = mean_alpha / (1 - params.sparsity)
    mean_alpha = min(1.0, mean_alpha)
    return replace(params, alpha_min=mean_alpha, alpha_max=mean_alpha)


def baselines(adapter: Any, record: dict[str, Any], progress: Any, data_dir: Any = None) -> dict[str, Any]:
    """AbsTopK-GLU at the same active fraction (EW Eq. 2) and the same conversion with a uniform α.

    The uniform variant is built exactly as the conversion was (``partition_modules``): a ridge
    router, a budget plan or the skipped-expert compensation is fitted on the profile's calibration
    tokens again, so every recipe, ``best`` included, has its baseline. A conversion whose experts run
    only part of their down projections (``down_keep``) computes the gate and up rows of more neurons
    than it pays for in full: its AbsTopK runs at its ``ffn_flops_fraction`` instead, equal multiply-adds."""
    from ..core.slicing import abstopk_modules, partition_modules
    from ..profiling.store import StoredProfile

    params = ExpertWeaverParams.from_dict(record["params"])
    fraction = record["summary"]["active_fraction"]
    if params.down_keep < 1:
        fraction = record["summary"].get("ffn_flops_fraction", fraction)
    out = {"abstopk": abstopk_modules(adapter, fraction)}
    uniform = uniform_params(params, [row["alpha"] for row in record["layers"]])
    if uniform != params and params.plan != "leading":  # the leading plan's MoE layers share one α already
        profile = StoredProfile.open(record["profile"])
        *_, modules, _ = partition_modules(adapter, profile, uniform, plan_for(profile, uniform),
                                           layer_builder(profile, uniform), progress, data_dir)
        out["uniform"] = modules
    return out


# --------------------------------------------------------------------------- recovery (EW Eqs. 11–12)


def prepare_recovery(moe: Any, modules: dict[int, Any], batch: Any) -> tuple[dict[int, Any], dict[str, Any], bool]:
    """EW Eq. 11: every training-free layer becomes a softmax router (initialised from its centroids,
    scaled so the logits start with std ``EW_INIT_LOGIT_STD``) with a weighted combine."""
    from ..runtime.modeling_moelab import convert_in_place
    from ..core.router_init import centroid_logit_std, to_softmax_router

    switch = {i: m for i, m in modules.items() if not (m.router.kind == "softmax" and m.combine == "weighted") and m.n_routed > 0}
    if not switch:
        return modules, {}, False
    std = centroid_logit_std(moe, switch, batch)
    betas = {i: EW_INIT_LOGIT_STD / s if s > 0 else 1.0 for i, s in std.items()}
    new = {i: to_softmax_router(m, betas[i]) for i, m in switch.items()}
    convert_in_place(moe.model, new)
    return {**modules, **new}, {"router_init_beta": {str(i): b for i, b in betas.items()}}, True


def accepts_recovery(spec: dict[str, Any]) -> str | None:
    """EW Eq. 11 starts from the training-free sum combine (Eq. 10), or an Eq. 11 layer already."""
    if spec.get("combine") == "sum" or (spec.get("router") == "softmax" and spec.get("combine") == "weighted"):
        return None
    return (f"expertweaver fine-tuning starts from the training-free 'sum' combine (EW Eq. 10), these combine "
            f"{spec.get('combine')!r}: use mode cmoe or dense2moe, or convert with combine 'sum'")


def _label(p) -> list[str]:
    """Experts, the α range and τ (EW Eqs. 4-5), sparsity; an option the record lacks is left out, not '?'."""
    wide = p.get("width_multiple") or 1  # the plan may take another count: each layer's note says which
    parts = [f"{num(p.get('n_experts'))} experts" + (f" (widths ×{wide})" if wide > 1 else "")]
    if p.get("alpha_min") is not None and p.get("alpha_max") is not None:
        parts.append(f"α {num(p['alpha_min'])}–{num(p['alpha_max'])}")
    parts += [f"τ {num(p['tau'])}"] if p.get("tau") is not None else []
    parts += [f"sparsity {pct(p['sparsity'])}"] if p.get("sparsity") is not None else []
    return parts


METHOD = Method(
    name="expertweaver",
    label=_label,
    title="ExpertWeaver",
    paper="EW §3",
    summary="layer-adaptive shared expert from neuron CV (Eqs. 4-7), balanced k-means routed experts (Eq. 8), centroid router (Eq. 9)",
    params=ExpertWeaverParams,
    needs="profile",
    build=build,
    partition=(plan_for, layer_builder),
    validate=validate_partition,
    preview=preview,
    recovery=Recovery(paper="EW Eqs. 11-12: softmax router + load balancing, LoRA", lora="optional",
                      summary="ExpertWeaver: a softmax router (started from the centroid router) weights the top-k "
                              "experts (EW Eq. 11); routers and LoRA adapters learn L_NTP + λ·L_LB (EW Eq. 12); γ unused.",
                      prepare=prepare_recovery, accepts=accepts_recovery),
    baselines=baselines,
    # tests/benchmarks/bench_frontier.py: the best training-free conversion measured at every cost
    # "portable": the best one whose recovered model (EW Eq. 11) exports to GGUF and native HF; 12 experts
    # (128 neurons on the default model): llama.cpp runs 64 experts of 24 neurons slower than dense (a matmul
    # and a sum per selected expert, and q8_0 cannot quantise rows of 24), 16 of 96 faster at decode but 0.75-0.81x
    # dense at f16 prefill on AVX-512 CPUs (ggml's f16 dot product does the last 32 values of every 96-value row one
    # at a time: 11% of its time in a decode step, perf), 12 of 128 1.02-1.09x there and faster at f16 decode; 24
    # of 64 slower than both (bench_llamacpp --experts 0 12 24). Quality: equal at 0.75 (1.75x against 1.76x dense),
    # 3% worse at 0.5 after two recovery steps (3.69x against 3.58x in llama.cpp). width_multiple 64 keeps that
    # rule on other models: the count nearest 12 whose experts are whole 64s (16 on Gemma 3 270M, 14 on Llama-3 8B)
    # "best" fits on 16,384 calibration tokens: better in and out of domain than 4,096 (leave-domain-out frontier);
    # 128 finer experts (12 neurons on the default model; the router costs 2x, under 3% of the FFN): out of domain
    # 1.50x / 2.77x dense at 0.75 / 0.5 against 64 experts' 1.57x / 2.96x, in domain better too (docs/quality.md);
    # down_keep 0.5 (TEAL inside the experts: the budget plan spends the halved down projections on more experts):
    # out of domain at 0.75 code 1.38x -> 1.20x, prose 1.39x -> 1.18x; 0.3 and 0.7 were worse (bench_frontier)
    # max_routed_share 0.65 (a layer worth more of its experts is written whole; issue 38): code left out, on code
    # 1.21x -> 1.20x at 0.75 and 2.35x -> 2.24x at 0.5 (0.5: 1.30x / 2.26x; 1.0: 1.22x / 2.26x); at 0.75 faster than
    # the uncapped plan at decode b1 and prefill in three runs out of three, at decode b8 in two (bench_recipe_speed)
    # speed_guard "machine": no top-k this machine's kernel table predicts slower than dense in a phase (issue 38: "no
    # phase slower than dense" where the recipe runs); on the 2-vCPU EPYC it offers up to 69-70% of each layer's
    # experts, so the 0.65 cap binds first and the plan is unchanged (bench_recipe_speed guard-0.25 / guard-0.5)
    # On a 300 MiB-L3 Xeon it offers 20-35% (prefill binds): prefill 0.81-0.91x -> 0.94-1.12x dense, but at 0.25 held-out
    # perplexity 1.25x -> 1.41x, 16 of 30 layers whole (bench_recipe_speed_xeon_guard*.json; docs/quality.md)
    # speed_margin PREDICTION_ERROR (0.05): the guard held a Xeon's plan at dense and its prefill measured
    # 0.955-0.97x; with each layer at most 0.95 of its dense FFN, 0.25 measured 1.00-1.09x and decoded 1.5-4% faster
    # for 1.280x -> 1.289x out of domain, 0.5 as good (2.015x -> 2.013x) and 1-4% faster (three runs in one process
    # each; docs/quality.md); 0.1 cost 0.25 its budget and quality (1.33x at 0.735) for no prefill. With the table's
    # layouts at the guard's boundary (TABLE_VERSION 13) the margin changes less: 1.31x -> 1.32x, prefill 1.01x -> 1.02x
    recipes={"best": {"router": "ridge", "alpha_basis": "active", "plan": "budget", "compensation": "skipped_mean",
                      "fit_tokens": 16384, "n_experts": 128, "down_keep": 0.5, "max_routed_share": 0.65,
                      "speed_guard": "machine", "speed_margin": PREDICTION_ERROR},
             "portable": {"router": "ridge", "alpha_basis": "active", "plan": "leading", "compensation": "none",
                          "n_experts": 12, "width_multiple": 64}},
)
