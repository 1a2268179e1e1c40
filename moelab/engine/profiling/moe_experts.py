"""Profiling the experts of an existing sparse-MoE model (AF §4.1 applied per expert, for
``methods.hierarchical``): find its MoE layers, load it, and collect each expert's ATopK markers
and activation rates over the tokens the model's own router sends it (CM Eqs. 3–5).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..core.params import ConversionError
from ..data.calibration import CalibrationSet
from ..models import resolve_device, resolve_dtype, service_location
from ..progress import NO_PROGRESS, Progress
from ..runtime.modeling_moelab import decoder_layers
from ..runtime.param_count import parameter_counts
from .profiler import ProfileSettings, length_sorted_batches

SUPPORTED = "Mixtral, Qwen2-MoE and Qwen3-MoE (transformers' fused experts: mlp.experts.gate_up_proj)"
BATCH_TOKENS = ProfileSettings.batch_tokens  # padded tokens per forward, as in profiling


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

    checked = service_location(str(source))  # a service worker: never the working directory, only inside the data roots
    location = checked[0] if checked is not None else Path(source)
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
    params: Any, progress: Progress = NO_PROGRESS,
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
