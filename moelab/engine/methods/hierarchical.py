"""Hierarchical conversion of an existing MoE model (AF §4.4, Eq. 10), training-free.

Every routed expert ``E_i`` of every sparse-MoE layer (Mixtral, Qwen2-MoE, Qwen3-MoE) is an
ordinary GLU of ``f`` neurons, so the dense CMoE / AF recipe applies to it unchanged:

    E_i(x) -> E_i^s(x) + Σ_j g'_ij · E_ij^r(x)                                  (AF Eq. 10)

The pipeline, per expert, reuses the dense pieces:

1. **Profile** (AF §4.1, CM Eqs. 3–5): one pass of the calibration set; a pre-hook on each
   block's ``experts`` module sees its input and the top-level router's selection. For every
   expert, over the tokens routed to it: ``h = act(x W_gate) ⊙ (x W_up)``, the ``K_a`` neurons
   of largest ``|h_i|`` per token (ATopK marker rows) and the activation rates ``μ_i``.
   Choice: an expert the top-level router sent fewer than ``min_expert_tokens`` tokens has too
   few markers to cluster on (with ``K_a = 10`` a 768-neuron expert needs ~77 tokens for one
   marker per neuron on average), so it is profiled on *all* calibration tokens instead, in a
   second pass that runs only when needed; the record flags it (``fallback``).
2. **Plan**: CMoE's uniform S·A·E plan (``cmoe.plan``) on the expert's width ``f``:
   ``n_experts`` sub-experts of ``m = f // n_experts`` neurons, ``shared`` of them always on,
   ``active`` of the routed ones per token (leftover neurons join the shared part).
3. **Experts + router** (``cmoe.layer_experts``): shared = highest ATopK rates (CM Eq. 5 / AF
   §4.1), routed = balanced clustering of the ATopK features (CM Eqs. 6–10), sub-router = the
   representative neurons (CM Eqs. 17–19 / AF Eqs. 7–8).
4. **Runtime**: one ``MoeFFN`` per expert (``core.slicing.moe_from_dense``) inside a
   ``HierarchicalExperts`` that replaces the block's ``experts`` module with the same call, so
   the top-level router, its top-k weights and Qwen2-MoE's gated shared expert are untouched.

With ``active = n_experts − shared`` every sub-expert runs and the converted model computes the
original one exactly (up to float summation order).

Choices where AF §4.4 is silent: the sub-gates are binary, ``g'_ij ∈ {0, 1}`` (AF Eq. 4, the
training-free form; combine ``sum``), and each sub-MoE's output is scaled by the token's original
top-k weight, as the whole expert was. ATopK rates and features of an expert are counted over the
tokens routed to it, each token once, whatever its top-k weight.

Choice: the top-level router's inputs are not changed, so the original top-k routing decides
which experts run; the sub-router only prunes inside each selected expert (the paper does not
say otherwise). ``seed`` selects the calibration samples; the clustering itself is
deterministic (CMoE's centroids start at the highest-rate neurons).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar


from ..core.allocation import LayerPlan
from ..core.params import ConversionError, MethodParams, param
from ..core.partition import LayerExperts
from ..progress import NO_PROGRESS, Progress
from . import cmoe
from .base import ConversionInputs, Method


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class HierarchicalParams(MethodParams):
    """AF §4.4 parameters; the S·A·E counts apply inside every expert of every MoE layer."""

    method: ClassVar[str] = "hierarchical"

    n_experts: int = param(8, "sub-experts per expert, shared included (E of S·A·E)", paper="AF Eq. 10", ge=1,
                           aliases=("experts",))
    shared: int = param(2, "always-on sub-experts per expert (S)", paper="AF §4.4", ge=0)
    active: int = param(2, "routed sub-experts per token inside each selected expert (A)", paper="AF §4.4", ge=0)
    atopk_k: int = param(10, "K_a: neurons marked per token", paper="CM Eq. 4", ge=1, advanced=True)
    samples: int = param(64, "calibration samples", ge=1, le=100000)
    max_tokens: int = param(256, "tokens per sample (truncation)", ge=2, advanced=True)
    min_expert_tokens: int = param(128, "an expert routed fewer tokens is profiled on all tokens", ge=1, advanced=True)
    max_iter: int = param(50, "balanced clustering iteration cap", paper="CM Eqs. 7-10", ge=1, le=10000, advanced=True)
    seed: int = param(0, "calibration subsample", ge=0, advanced=True)

    def sub_experts(self) -> cmoe.CMoEParams:
        """The dense CMoE S·A·E plan applied to one expert."""
        return cmoe.CMoEParams(n_experts=self.n_experts, shared=self.shared, active=self.active, max_iter=self.max_iter)

    def _check(self) -> None:
        try:  # the S·A·E rules of the dense CMoE plan, with their messages
            self.sub_experts().check()
        except ConversionError as exc:
            raise ConversionError(f"sub-experts: {exc}") from None

    def validate(self, d_expert_ffn: int | None = None) -> None:
        """Raise ``ConversionError`` naming the field to fix; ``d_expert_ffn`` (neurons of one
        expert of the model) enables the size checks."""
        self.check()
        if d_expert_ffn is not None:
            expert_plan(self, d_expert_ffn, 0)
            if self.atopk_k > d_expert_ffn:
                raise ConversionError(
                    f"atopk_k={self.atopk_k} exceeds the {d_expert_ffn} neurons of one expert: use at most {d_expert_ffn}"
                )


# --------------------------------------------------------------------------- restructuring


def expert_plan(params: HierarchicalParams, d_ffn: int, layer: int) -> LayerPlan:
    """CMoE's uniform S·A·E plan for one expert of width ``d_ffn``."""
    return replace(cmoe.plan([d_ffn], params.sub_experts())[0], layer=layer)


def restructure_expert(
    gate_w: Any, up_w: Any, down_w: Any, act: str, profile: Any, row: LayerPlan, max_iter: int = 50,
) -> tuple[Any, LayerExperts]:
    """AF Eq. 10 for one expert: shared = top ATopK rates, routed = balanced clustering of the
    ATopK features, representative-neuron sub-router (CM Eqs. 5–10, 17–19; AF Eqs. 7–8)."""
    import torch

    from ..core.slicing import moe_from_dense

    g, u = gate_w.float().cpu().numpy(), up_w.float().cpu().numpy()
    ex = cmoe.layer_experts(row, profile.rate, profile.markers, g, u, router="representative", max_iter=max_iter)
    weights = {k: torch.as_tensor(v).to(device=gate_w.device, dtype=gate_w.dtype) for k, v in ex.router_weights.items()}
    sub = moe_from_dense(gate_w, up_w, down_w, act, ex.shared, ex.routed, ex.top_k, ex.router, "sum", **weights)
    return sub, ex


def wrap_sub_experts(subs: list[Any], experts_per_token: int, **extra: Any) -> Any:
    """A ``HierarchicalExperts`` around already-built sub-MoEs (one ``MoeFFN`` per expert, in expert
    order); no weight copy."""
    import torch
    from torch import nn

    from ..runtime.modeling_moelab import HierarchicalExperts

    if not subs:
        raise ValueError("a hierarchical layer needs one MoeFFN per expert")
    spec = {"kind": "hierarchical", "d_model": subs[0].d_model, "num_experts": len(subs),
            "experts_per_token": int(experts_per_token), **extra, "experts": [m.spec for m in subs]}
    with torch.device("meta"):  # validates the spec; the meta sub-MoEs are replaced right away
        mod = HierarchicalExperts(spec)
    mod.sub_experts = nn.ModuleList(subs)
    return mod

def _expert_record(e: int, row: LayerPlan, ex: LayerExperts, prof: Any) -> dict[str, Any]:
    return {
        "expert": e, "routed_tokens": prof.routed_tokens, "profiled_tokens": prof.profiled_tokens,
        "fallback": prof.fallback, "d_expert": row.d_expert, "n_shared": row.n_shared, "d_shared": row.d_shared,
        "n_routed": row.n_routed, "top_k": ex.top_k, "active_neurons": row.active_neurons,
        "active_fraction": row.active_fraction, "router": ex.router, "objective": ex.objective,
        "n_iter": ex.n_iter, "converged": ex.converged, "seconds": round(ex.seconds, 4),
    }


def convert_hierarchical(
    model_source: str | Path,
    calib: Any,
    params: HierarchicalParams,
    *,
    data_dir: Path,
    device: str = "auto",
    progress: Progress = NO_PROGRESS,
) -> tuple[Any, Any, dict[str, Any]]:
    """Load the MoE model, profile its experts on ``calib`` and restructure every expert of every
    MoE layer (AF §4.4, Eq. 10). Returns ``(moe_model, tokenizer, record)``; ``moe_model`` wraps
    the loaded model (converted in place) and is ready for ``export.export_model``.

    ``calib``: a calibration spec (``builtin:mixed`` …, ``params.samples`` samples drawn with
    ``params.seed``) or a ``CalibrationSet`` (subsampled to ``params.samples``).
    In the record, ``dense_*_params`` are the original MoE model's counts.
    """
    from ..profiling.moe_experts import load_moe_model, moe_parameter_counts, profile_experts, sparse_moe_layers
    from ..runtime.export import build_moe_model
    from ..runtime.modeling_moelab import decoder_layers
    from ..runtime.param_count import ffn_flops_fraction, ffn_macs_per_token, parameter_counts

    params.validate()
    t0 = time.perf_counter()
    progress.update("load model", 0, 1)
    model, tokenizer = load_moe_model(model_source, device=device)
    layers = sparse_moe_layers(model)
    for f in sorted({lay.d_ffn for lay in layers}):
        params.validate(f)
    cset = _calibration_set(calib, params, data_dir)
    original = moe_parameter_counts(model, layers)
    # the original model's per-token FFN cost: every FFN weight, less the experts a token skips
    original_ffn_macs = sum(ffn_macs_per_token(model)) - (original["total"] - original["active"])
    progress.update("load model", 1, 1)
    t1 = time.perf_counter()

    profiles, info = profile_experts(model, tokenizer, cset, layers, params, progress)
    t2 = time.perf_counter()

    modules, layer_records = _restructure_layers(layers, profiles, params, progress)
    t3 = time.perf_counter()

    source = str(Path(model_source).resolve()) if Path(model_source).exists() else str(model_source)
    moe = build_moe_model(model, modules, provenance={"method": "hierarchical", "source": source})
    moe.eval()
    counts = parameter_counts(moe)
    t4 = time.perf_counter()
    first = layers[0]
    row = expert_plan(params, first.d_ffn, first.index)
    summary = {
        "method": "hierarchical",
        "n_layers": len(decoder_layers(model)),
        "moe_layers": [lay.index for lay in layers],
        "num_experts": first.num_experts,
        "experts_per_token": first.experts_per_token,
        "d_expert_ffn": first.d_ffn,
        "sub_experts": params.n_experts,
        "shared_sub_experts": params.shared,
        "active_sub_experts": params.active,
        "sub_expert_size": row.d_expert,
        "active_expert_fraction": row.active_fraction,  # neurons of a selected expert one token uses
        "fallback_experts": info["fallback_experts"],
        "calibration": {"id": cset.id, "name": cset.name, "samples": len(cset.samples), "tokens": info["tokens"]},
        "total_params": counts["total"],
        "active_params": counts["active"],
        "dense_total_params": original["total"],
        "dense_active_params": original["active"],
        "ffn_flops_fraction": ffn_flops_fraction(moe, original_ffn_macs),  # over the original MoE's
        "source": source,
    }
    record = {
        "params": params.to_dict(),
        "summary": summary,
        "layers": layer_records,
        "timings": {"load_s": t1 - t0, "profile_s": info["profile_s"], "fallback_profile_s": info["fallback_profile_s"],
                    "restructure_s": t3 - t2, "build_s": t4 - t3, "total_s": t4 - t0},
    }
    return moe, tokenizer, record


def _calibration_set(calib: Any, params: HierarchicalParams, data_dir: Path) -> Any:
    """``calib`` (a spec or a ``CalibrationSet``) as ``params.samples`` samples drawn with ``params.seed``."""
    from ..data.calibration import CalibrationSet, load_calibration

    if isinstance(calib, CalibrationSet):
        cset = calib.subsample(params.samples, params.seed)
    else:
        cset = load_calibration(calib, samples=params.samples, seed=params.seed, data_dir=data_dir)
    if not cset.samples:
        raise ConversionError(f"calibration set {cset.name!r} has no samples")
    return cset


def _restructure_layers(layers: list[Any], profiles: Any, params: HierarchicalParams, progress: Progress,
                        ) -> tuple[dict[int, Any], list[dict[str, Any]]]:
    """AF Eq. 10 for every expert of every MoE layer: ``({layer: HierarchicalExperts}, layer records)``."""
    import torch

    modules: dict[int, Any] = {}
    layer_records = []
    progress.update("restructure experts", 0, len(layers))
    with torch.no_grad():
        for n, lay in enumerate(layers):
            row = expert_plan(params, lay.d_ffn, lay.index)
            subs, records = [], []
            for e, prof in enumerate(profiles[lay.index]):
                sub, ex = restructure_expert(*lay.expert_weights(e), lay.act, prof, row, params.max_iter)
                subs.append(sub)
                records.append(_expert_record(e, row, ex, prof))
            modules[lay.index] = wrap_sub_experts(subs, lay.experts_per_token)
            layer_records.append({
                "layer": lay.index, "num_experts": lay.num_experts, "experts_per_token": lay.experts_per_token,
                "d_expert_ffn": lay.d_ffn, "fallback_experts": sum(r["fallback"] for r in records),
                "experts": records,
            })
            progress.update("restructure experts", n + 1, len(layers))
    return modules, layer_records


def build(inputs: ConversionInputs, params: HierarchicalParams, progress: Progress) -> tuple[Any, Any, dict[str, Any]]:
    if not inputs.model or not inputs.calib:
        raise ConversionError("hierarchical conversion needs the MoE model and a calibration set (model=, calib=)")
    moe, tokenizer, record = convert_hierarchical(inputs.model, inputs.calib, params, data_dir=inputs.data_dir,
                                                  device=inputs.device, progress=progress)
    record.update(model={"source": inputs.model}, calibration={"spec": inputs.calib})
    return moe, tokenizer, record


def reference(record: dict[str, Any], *, device: str, **_: Any) -> tuple[Any, Any]:
    """The MoE model before restructuring is what the conversion is compared with."""
    from ..profiling.moe_experts import load_moe_model

    return load_moe_model(record["model"]["source"], device=device)


def validate(params: HierarchicalParams, profiles: list[Any]) -> None:
    params.validate()


METHOD = Method(
    name="hierarchical",
    label=cmoe.split_label,  # named as CMoE names its split (S shared, A active, E experts)
    title="Hierarchical (AF)",
    paper="AF §4.4",
    summary="shared + routed sub-experts inside every expert of an existing MoE model (Mixtral, Qwen2/3-MoE), CMoE recipe per expert",
    params=HierarchicalParams,
    needs="moe_model",
    build=build,
    validate=validate,
    reference=reference,
)
