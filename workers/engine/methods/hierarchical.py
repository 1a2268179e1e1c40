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
2. **Plan**: CMoE's uniform S·A·E plan (``allocation.plan``) on the expert's width ``f``:
   ``n_experts`` sub-experts of ``m = f // n_experts`` neurons, ``shared`` of them always on,
   ``active`` of the routed ones per token (leftover neurons join the shared part).
3. **Experts + router** (``experts.cmoe_layer``): shared = highest ATopK rates (CM Eq. 5 / AF
   §4.1), routed = balanced clustering of the ATopK features (CM Eqs. 6–10), sub-router = the
   representative neurons (CM Eqs. 17–19 / AF Eqs. 7–8).
4. **Runtime**: one ``MoeFFN`` per expert (``MoeFFN.from_dense``) inside a
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
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..core.params import from_known_fields
from ..core.allocation import AllocationError, AllocationParams, LayerPlan, plan
from ..data.calibration import CalibrationSet, load_calibration
from ..core.dense import ConversionError
from ..core.partition import LayerExperts, cmoe_layer
from ..runtime.export import build_moe_model
from ..runtime.modeling_moelab import HierarchicalExperts, MoeFFN, MoelabForCausalLM, decoder_layers
from ..models import resolve_device, resolve_dtype
from ..runtime.param_count import parameter_counts
from ..profiling.profiler import ProfileSettings, length_sorted_batches
from ..progress import NO_PROGRESS, Progress

__all__ = [
    "ExpertProfile",
    "HierarchicalParams",
    "SparseMoeLayer",
    "convert_hierarchical",
    "load_moe_model",
    "moe_parameter_counts",
    "profile_experts",
    "restructure_expert",
    "sparse_moe_layers",
]

SUPPORTED = "Mixtral, Qwen2-MoE and Qwen3-MoE (transformers' fused experts: mlp.experts.gate_up_proj)"
BATCH_TOKENS = ProfileSettings.batch_tokens  # padded tokens per forward, as in profiling


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class HierarchicalParams:
    """AF §4.4 parameters; the S·A·E counts apply inside every expert of every MoE layer."""

    method: Literal["hierarchical"] = "hierarchical"
    n_experts: int = 8  # sub-experts per expert, shared included (E of S·A·E)
    shared: int = 2  # always-on sub-experts per expert (S)
    active: int = 2  # routed sub-experts per token inside each selected expert (A)
    atopk_k: int = ProfileSettings.atopk_k  # K_a of CM Eq. 4 / AF §4.1
    samples: int = 64  # calibration samples
    max_tokens: int = 256  # tokens per sample (truncation)
    min_expert_tokens: int = 128  # fewer routed tokens: profile the expert on all tokens
    max_iter: int = 50  # balanced-clustering iterations (CM Eqs. 7–10)
    seed: int = 0  # calibration subsample

    def validate(self, d_expert_ffn: int | None = None) -> None:
        """Raise ``ConversionError`` naming the field to fix; ``d_expert_ffn`` (neurons of one
        expert of the model) enables the size checks."""
        if self.method != "hierarchical":
            raise ConversionError(f"method must be 'hierarchical', got {self.method!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "method" and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConversionError(f"{f.name} must be an integer, got {value!r}")
        checks = [
            (self.n_experts >= 1, f"n_experts (sub-experts per expert) must be ≥ 1, got {self.n_experts}"),
            (self.atopk_k >= 1, f"atopk_k (K_a) must be ≥ 1, got {self.atopk_k}"),
            (self.samples >= 1, f"samples must be ≥ 1, got {self.samples}"),
            (self.max_tokens >= 2, f"max_tokens must be ≥ 2, got {self.max_tokens}"),
            (self.min_expert_tokens >= 1, f"min_expert_tokens must be ≥ 1, got {self.min_expert_tokens}"),
            (self.max_iter >= 1, f"max_iter must be ≥ 1, got {self.max_iter}"),
            (self.seed >= 0, f"seed must be ≥ 0, got {self.seed}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConversionError(message)
        alloc = self.allocation()
        try:  # the S·A·E rules of the dense CMoE plan, with their messages
            alloc.validate(d_expert_ffn if d_expert_ffn is not None else self.n_experts)
        except AllocationError as exc:
            raise ConversionError(f"sub-experts: {exc}") from None
        if d_expert_ffn is not None and self.atopk_k > d_expert_ffn:
            raise ConversionError(
                f"atopk_k={self.atopk_k} exceeds the {d_expert_ffn} neurons of one expert: use at most {d_expert_ffn}"
            )

    def allocation(self) -> AllocationParams:
        """The dense CMoE S·A·E plan applied to one expert."""
        return AllocationParams(method="cmoe", n_experts=self.n_experts, shared=self.shared, active=self.active)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HierarchicalParams":
        return from_known_fields(cls, d, "hierarchical", ConversionError)


# --------------------------------------------------------------------------- the MoE model


@dataclass
class SparseMoeLayer:
    """One sparse-MoE block: ``experts`` holds ``gate_up_proj [E, 2f, d]`` (gate rows first,
    as the transformers forward's ``chunk(2)`` reads them) and ``down_proj [E, d, f]``."""

    index: int
    block: nn.Module  # the sparse-MoE block (layers[index].mlp)
    experts: nn.Module
    num_experts: int  # E
    d_ffn: int  # f: neurons per expert
    experts_per_token: int  # the top-level router's k
    act: str

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(gate [f, d], up [f, d], down [d, f])`` of expert ``e`` (views, no copy)."""
        gate_up = self.experts.gate_up_proj[e].detach()
        return gate_up[: self.d_ffn], gate_up[self.d_ffn :], self.experts.down_proj[e].detach()


def sparse_moe_layers(model: nn.Module) -> list[SparseMoeLayer]:
    """Every decoder layer whose MLP is a sparse-MoE block with fused experts (dense layers,
    e.g. Qwen's ``mlp_only_layers``, are skipped). Raises ConversionError when there is none."""
    cfg = model.config
    family = getattr(cfg, "model_type", type(model).__name__)
    try:
        blocks = decoder_layers(model)
    except ValueError:
        raise ConversionError(
            f"model type {family!r}: cannot find its decoder layers; supported: {SUPPORTED}"
        ) from None
    act = str(getattr(cfg, "hidden_act", "silu"))
    out = []
    for i, block in enumerate(blocks):
        moe = getattr(block, "mlp", None)
        experts, gate = getattr(moe, "experts", None), getattr(moe, "gate", None)
        if experts is None or gate is None:
            continue
        gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3:
            raise ConversionError(
                f"model type {family!r}, layer {i}: the experts module {type(experts).__name__} has no fused "
                f"3-D gate_up_proj/down_proj; supported: {SUPPORTED}"
            )
        E, two_f, d = gate_up.shape
        f = two_f // 2
        if two_f % 2 or tuple(down.shape) != (E, d, f):
            raise ConversionError(
                f"layer {i}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
                "[E, 2f, d] and [E, d, f]"
            )
        if any(getattr(experts, n, None) is not None for n in ("gate_up_proj_bias", "down_proj_bias")):
            raise ConversionError(f"layer {i}: experts with biases are not supported by the MoE runtime")
        k = int(getattr(gate, "top_k", getattr(cfg, "num_experts_per_tok", 0)))
        out.append(SparseMoeLayer(i, moe, experts, int(E), int(f), k, act))
    if not out:
        raise ConversionError(
            f"model type {family!r} ({type(model).__name__}) has no sparse-MoE layer; hierarchical conversion "
            f"restructures an existing MoE model: {SUPPORTED}. Convert a dense model with cmoe or expertweaver"
        )
    return out


def load_moe_model(
    source: str | Path, *, device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False
) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)`` of a MoE causal LM: a local ``save_pretrained`` directory or a Hub
    id. (``models.load_model`` only adapts dense GLU models.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    location = Path(source)
    if location.exists() and not (location / "config.json").is_file():
        raise ConversionError(f"{source}: a local model directory needs a config.json (a Hugging Face save)")
    where = str(location) if location.exists() else str(source)
    dev = resolve_device(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            where, dtype=resolve_dtype(dtype, dev), trust_remote_code=trust_remote_code
        )
        tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConversionError(
            f"could not load the MoE model {str(source)!r} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            "pass a local directory saved with save_pretrained"
        ) from exc
    if tokenizer.pad_token_id is None:  # padding is masked out of every statistic
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return model.to(dev).eval(), tokenizer


def moe_parameter_counts(model: nn.Module, layers: list[SparseMoeLayer]) -> dict[str, int]:
    """Total and per-token active parameters of the original MoE model: per MoE layer only
    ``experts_per_token`` of its ``num_experts`` experts run (the router always does)."""
    total = parameter_counts(model)["total"]
    idle = sum((lay.num_experts - lay.experts_per_token) * 3 * lay.d_ffn * lay.experts.gate_up_proj.shape[2]
               for lay in layers)
    return {"total": int(total), "active": int(total - idle)}


# --------------------------------------------------------------------------- profiling


@dataclass
class ExpertProfile:
    """ATopK statistics of one expert (CM Eqs. 4–5 over the tokens it was profiled on)."""

    rate: np.ndarray  # [f] activation rate μ_i
    markers: np.ndarray  # [n, K_a] ATopK marker rows (neuron ids), one per profiled token
    routed_tokens: int  # calibration tokens the top-level router sent to this expert
    fallback: bool  # profiled on all calibration tokens (routed_tokens < min_expert_tokens)

    @property
    def profiled_tokens(self) -> int:
        return int(self.markers.shape[0])


def _atopk_markers(x: torch.Tensor, gate_up: torch.Tensor, act_fn: Any, k_a: int) -> torch.Tensor:
    """CM Eqs. 3–4: the ``K_a`` neurons of largest ``|h|``, ``h = act(x W_gate) ⊙ (x W_up)``, per token."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return (act_fn(gate) * up).abs().topk(k_a, dim=1).indices


def _batches(tokenizer: Any, cset: CalibrationSet, max_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Length-sorted, right-padded ``(input_ids, attention_mask)`` batches, tokenised as profiling does."""
    enc = tokenizer([s.text for s in cset.samples], truncation=True, max_length=max_tokens)
    ids = [torch.tensor(e, dtype=torch.long) for e in enc["input_ids"]]
    lengths = np.array([len(e) for e in ids])
    if (lengths == 0).any():
        raise ConversionError(f"calibration sample {int(np.argmin(lengths))} tokenises to nothing; remove it")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = []
    for rows in length_sorted_batches(lengths, max(BATCH_TOKENS, max_tokens)):
        width = int(lengths[rows].max())
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, sample in enumerate(rows):  # per sample, not per token
            input_ids[r, : lengths[sample]] = ids[sample]
            mask[r, : lengths[sample]] = 1
        out.append((input_ids, mask))
    return out


def _pass(model: nn.Module, batches: list, layers: list[SparseMoeLayer], on_tokens: Any,
          progress: Progress, stage: str) -> None:
    """Run every batch through the decoder; ``on_tokens(layer, x [N, d], top_k_index [N, k])``
    receives each MoE layer's experts input restricted to real (unpadded) tokens."""
    state: dict[str, torch.Tensor] = {}

    def make_hook(lay: SparseMoeLayer):
        def hook(_module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            keep = state["mask"]
            on_tokens(lay, x[keep], idx[keep])

        return hook

    handles = [lay.experts.register_forward_pre_hook(make_hook(lay), with_kwargs=True) for lay in layers]
    device = next(model.parameters()).device
    decoder = model.get_decoder()  # the LM head is not needed
    try:
        progress.update(stage, 0, len(batches))
        with torch.inference_mode():
            for b, (input_ids, mask) in enumerate(batches):
                state["mask"] = mask.reshape(-1).bool().to(device)  # the block flattens [B, S] row-major
                decoder(input_ids=input_ids.to(device), attention_mask=mask.to(device), use_cache=False)
                progress.update(stage, b + 1, len(batches))
    finally:
        for h in handles:
            h.remove()


def profile_experts(
    model: nn.Module, tokenizer: Any, cset: CalibrationSet, layers: list[SparseMoeLayer],
    params: HierarchicalParams, progress: Progress = NO_PROGRESS,
) -> tuple[dict[int, list[ExpertProfile]], dict[str, Any]]:
    """ATopK profile of every expert of every MoE layer, over the tokens routed to it (AF §4.1
    applied per expert). Returns ``({layer: [profile per expert]}, info)``; info holds token
    counts and per-pass seconds."""
    batches = _batches(tokenizer, cset, params.max_tokens)
    n_tokens = int(sum(int(m.sum()) for _, m in batches))
    routed: dict[tuple[int, int], list[torch.Tensor]] = {}
    counts: dict[tuple[int, int], int] = {}

    def on_routed(lay: SparseMoeLayer, x: torch.Tensor, idx: torch.Tensor) -> None:
        for e in range(lay.num_experts):  # a loop over experts; tokens are batched
            tok = (idx == e).any(dim=1).nonzero().squeeze(1)
            counts[lay.index, e] = counts.get((lay.index, e), 0) + int(tok.numel())
            if tok.numel():
                xe = x.index_select(0, tok)
                top = _atopk_markers(xe, lay.experts.gate_up_proj[e], lay.experts.act_fn, params.atopk_k)
                routed.setdefault((lay.index, e), []).append(top.to("cpu", torch.int32))

    t0 = time.perf_counter()
    _pass(model, batches, layers, on_routed, progress, "profile experts")
    t1 = time.perf_counter()
    short = {(lay.index, e) for lay in layers for e in range(lay.num_experts)
             if counts.get((lay.index, e), 0) < params.min_expert_tokens}
    everything: dict[tuple[int, int], list[torch.Tensor]] = {}
    if short:
        def on_all(lay: SparseMoeLayer, x: torch.Tensor, idx: torch.Tensor) -> None:
            for e in range(lay.num_experts):
                if (lay.index, e) in short:
                    top = _atopk_markers(x, lay.experts.gate_up_proj[e], lay.experts.act_fn, params.atopk_k)
                    everything.setdefault((lay.index, e), []).append(top.to("cpu", torch.int32))

        _pass(model, batches, [lay for lay in layers if any((lay.index, e) in short for e in range(lay.num_experts))],
              on_all, progress, "profile fallback experts")
    t2 = time.perf_counter()

    out: dict[int, list[ExpertProfile]] = {}
    for lay in layers:
        profiles = []
        for e in range(lay.num_experts):
            key = (lay.index, e)
            fallback = key in short
            rows = torch.cat((everything if fallback else routed)[key]).numpy()
            rate = np.bincount(rows.ravel(), minlength=lay.d_ffn) / rows.shape[0]  # CM Eq. 5
            profiles.append(ExpertProfile(rate, rows, counts.get(key, 0), fallback))
        out[lay.index] = profiles
    info = {"tokens": n_tokens, "batches": len(batches), "fallback_experts": len(short),
            "profile_s": t1 - t0, "fallback_profile_s": t2 - t1}
    return out, info


# --------------------------------------------------------------------------- restructuring


def expert_plan(params: HierarchicalParams, d_ffn: int, layer: int) -> LayerPlan:
    """CMoE's uniform S·A·E plan for one expert of width ``d_ffn`` (it reads only the width)."""
    return replace(plan([np.zeros(d_ffn)], params.allocation())[0], layer=layer)


def restructure_expert(
    gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor, act: str, profile: ExpertProfile,
    row: LayerPlan, max_iter: int = 50,
) -> tuple[MoeFFN, LayerExperts]:
    """AF Eq. 10 for one expert: shared = top ATopK rates, routed = balanced clustering of the
    ATopK features, representative-neuron sub-router (CM Eqs. 5–10, 17–19; AF Eqs. 7–8)."""
    g, u = gate_w.float().cpu().numpy(), up_w.float().cpu().numpy()
    ex = cmoe_layer(row, profile.rate, profile.markers, g, u, router="paper", max_iter=max_iter)
    weights = {k: torch.as_tensor(v).to(device=gate_w.device, dtype=gate_w.dtype) for k, v in ex.router_weights.items()}
    sub = MoeFFN.from_dense(gate_w, up_w, down_w, act, ex.shared, ex.routed, ex.top_k, ex.router, "sum", **weights)
    return sub, ex


def _expert_record(e: int, row: LayerPlan, ex: LayerExperts, prof: ExpertProfile) -> dict[str, Any]:
    return {
        "expert": e, "routed_tokens": prof.routed_tokens, "profiled_tokens": prof.profiled_tokens,
        "fallback": prof.fallback, "d_expert": row.d_expert, "n_shared": row.n_shared, "d_shared": row.d_shared,
        "n_routed": row.n_routed, "top_k": ex.top_k, "active_neurons": row.active_neurons,
        "active_fraction": row.active_fraction, "router": ex.router, "objective": ex.objective,
        "n_iter": ex.n_iter, "converged": ex.converged, "seconds": round(ex.seconds, 4),
    }


def convert_hierarchical(
    model_source: str | Path,
    calib: str | CalibrationSet,
    params: HierarchicalParams,
    *,
    data_dir: Path,
    device: str = "auto",
    progress: Progress = NO_PROGRESS,
) -> tuple[MoelabForCausalLM, Any, dict[str, Any]]:
    """Load the MoE model, profile its experts on ``calib`` and restructure every expert of every
    MoE layer (AF §4.4, Eq. 10). Returns ``(moe_model, tokenizer, record)``; ``moe_model`` wraps
    the loaded model (converted in place) and is ready for ``export.export_model``.

    ``calib``: a calibration spec (``builtin:mixed`` …, ``params.samples`` samples drawn with
    ``params.seed``) or a ``CalibrationSet`` (subsampled to ``params.samples``).
    In the record, ``dense_*_params`` are the original MoE model's counts.
    """
    params.validate()
    t0 = time.perf_counter()
    progress.update("load model", 0, 1)
    model, tokenizer = load_moe_model(model_source, device=device)
    layers = sparse_moe_layers(model)
    for f in sorted({lay.d_ffn for lay in layers}):
        params.validate(f)
    if isinstance(calib, CalibrationSet):
        cset = calib.subsample(params.samples, params.seed)
    else:
        cset = load_calibration(calib, samples=params.samples, seed=params.seed, data_dir=data_dir)
    if not cset.samples:
        raise ConversionError(f"calibration set {cset.name!r} has no samples")
    original = moe_parameter_counts(model, layers)
    progress.update("load model", 1, 1)
    t1 = time.perf_counter()

    profiles, info = profile_experts(model, tokenizer, cset, layers, params, progress)
    t2 = time.perf_counter()

    modules: dict[int, nn.Module] = {}
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
            modules[lay.index] = HierarchicalExperts.from_sub_experts(subs, lay.experts_per_token)
            layer_records.append({
                "layer": lay.index, "num_experts": lay.num_experts, "experts_per_token": lay.experts_per_token,
                "d_expert_ffn": lay.d_ffn, "fallback_experts": sum(r["fallback"] for r in records),
                "experts": records,
            })
            progress.update("restructure experts", n + 1, len(layers))
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
