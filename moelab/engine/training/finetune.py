"""Recovery fine-tuning of a converted MoE: a short CPU-sized run that recovers quality.

Every method's paper follows its conversion with training; each ``mode`` here follows one:

``cmoe`` (CM §3.3, AF §4.3 Eq. 9)
    Every ``MoeFFN`` switches to the ``scaled`` combine: ``s' = softmax(s)``, experts selected by
    ``TopK(s' + b)``, gated ``g_i = 1 + s'_i·u_i``. ``u`` (init 0) is learnt at ``router_lr``;
    ``b`` (init 0) gets no gradient: after every optimizer step ``b_i -= γ`` when expert i is
    over-loaded (``p_i > p* = 1/N_r``, p_i its share of the step's top-k selections) and
    ``b_i += γ`` when under-loaded (``bias_step`` = γ). Plus LoRA (``lr``) on attention q/k/v/o,
    on the shared expert's Linears and on every routed expert (CM §4: "LoRA ... router scale
    parameter (0.001) and other LoRA parameters (5.95e-5)"). The routers' own weights stay
    frozen, as in CM §4. With ``u = b = 0`` the model is exactly the training-free one.
    CMoE balances without an auxiliary loss (AF §4.3), so ``lb_coef`` is not used here.
``expertweaver`` (EW §3.4.2, Eqs. 11-12)
    Routers switch to the softmax router with weighted combine (Eq. 11,
    ``y = E_shared(x) + Σ_{i∈TopK} g_i E_i(x)``, ``g = softmax(x W_router)``), initialised from
    the expert centroids of the gate rows (EW Eq. 9: the conversion's own router weights when it
    used the centroid router). Trained: routers (``router_lr``) + LoRA (``lr``) on attention and
    experts, with ``L = L_NTP + λ·L_LB`` (Eq. 12, λ = ``lb_coef``). EW trains every weight
    (continued pre-training on billions of tokens); on 2 CPU cores LoRA is what fits.
``midas`` (MI App. A.1, Alg. 1 lines 12-15)
    ``LowRankMoeFFN`` layers: the gating network G (``router``) at ``router_lr`` and LoRA on
    attention q/k/v/o and on the experts' factors (``lr``); ``lb_coef`` adds Eq. 12 if > 0.
``dense2moe`` (D2 §2.1, §3)
    The fused ``MoeFFN`` layers' softmax routers (``router_weight``) at ``router_lr``, nothing
    else, with Eq. 12 when ``lb_coef`` > 0. D2 fine-tunes the whole model on 180B tokens; the
    randomly initialised router is the part that cannot work without training. Under the
    training-free ``sum`` combine the router only ranks, so the layers first switch to the
    ``scaled`` combine with u = 0 (``g_i = 1 + s'_i·u_i``, exactly the sum model: same logits);
    the gate scale u trains too (router_lr) and carries the LM loss's gradient to W_g; the
    CM bias b stays 0 (``methods.dense2moe`` docstring).

Every mode: after ``prepare``, one forward/backward on a slice of the first batch checks which
trainable parameters the loss reaches (autograd gives them a gradient, λ·L_LB included); the
others are frozen and left out of ``trainable_params``, and a run that reaches none is refused
(``FinetuneError``) instead of spending its steps training nothing.

Choices where the papers leave room (each tested in tests/engine/test_finetune.py):

* **EW router initialisation.** Taken literally, Eq. 11 on a converted model multiplies every
  routed expert by its probability (about 1/N_e): the model starts far worse than the
  training-free conversion and a CPU-sized run cannot recover that. We initialise the softmax
  router to ``β·W_centroid`` and multiply every routed expert's down projection by ``N_e``: the
  TopK order is unchanged (β > 0), and with β small ``N_e·softmax(β·z) ≈ 1``, so training
  starts from (nearly) the training-free model. β is set per layer from one batch of training
  text so the router logits have a standard deviation of ``EW_INIT_LOGIT_STD`` across
  experts. ``perplexity_start`` reports where training really starts.
* **LoRA on stacked experts.** Routed experts are 3-D ``nn.Parameter`` tensors; peft's
  ``target_parameters`` gives each expert its own rank-r adapter (``[E, r, in]``/``[E, out, r]``)
  and merges them at export. Alpha scaling as peft's (``lora_alpha / r``).
* **Eq. 12.** ``f_i`` = share of the layer's top-k selections that went to expert i (Σ f = 1),
  ``P_i`` = mean router probability over the batch's tokens; ``L_LB`` is averaged over layers.
* **Schedule.** AdamW (β = 0.9, 0.95 as CM §4; no weight decay), linear warm-up over the first
  ``warmup`` share of the steps (10% by default), cosine decay to 10%; gradient norm clipped at 1.
* **Distillation** (``distill`` = w > 0; not in the papers, which train on L_NTP alone). The dense
  model the conversion was made from is the teacher: ``L = (1 − w)·L_NTP + w·L_KD (+ λ·L_LB)``,
  ``L_KD`` the mean over every position of ``KL(p_dense ‖ p_converted)`` at temperature 1 (the
  full next-token distributions; as Minitron-style pruning recovery does). A converted model
  starts as a perturbation of its teacher, so each token's whole distribution says how to move
  back, where L_NTP gives one label; it is also the same signal on any text, which is what a
  conversion scored off its training domains needs. The teacher's forward costs a step about a
  third more on CPU. Measured on the default model out of domain (docs/quality.md, "Recovery
  fine-tuning"), w = 1 ended worse than L_NTP alone at equal wall time, so the default stays 0.
* **Data.** Training windows of ``seq_len`` tokens are cut from the calibration split of
  ``source`` (samples joined by EOS, as ``evaluation.metrics.heldout_windows`` does on the held-out
  split), shuffled per epoch with ``seed``; when the text runs out the next epoch reshuffles.
  Perplexity is measured on a held-out split only: of ``eval_source``, else of ``source`` when
  it is a built-in set, else of builtin:mixed (stored sets have no held-out split).

``run_finetune`` loads the conversion with the engine's own ``MoelabForCausalLM`` (not the
copy bundled in the conversion: training needs the current runtime's combine modes), trains,
checkpoints (``checkpoint.py``: safetensors + JSON, atomic, last two kept, resumable bit for
bit), merges the adapters and exports the result with ``export.export_model``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..atomic import write_json_atomic
from ..data.calibration import load_calibration
from .checkpoint import CHECKPOINT_DIR, CheckpointError, latest_checkpoint, list_checkpoints, restore, save_checkpoint
from ..evaluation.metrics import BATCH_TOKENS, heldout_windows, load_cv, perplexity, window_batch
from ..runtime.export import CONVERSION_FILE, export_model
from ..runtime.modeling_moelab import MoelabForCausalLM, layer_spec, realign_parameters
from ..memory import peak_rss_mib, reset_peak_rss
from ..models import load_model, resolve_device
from ..runtime.param_count import parameter_counts
from ..progress import NO_PROGRESS, Cancelled, Progress
# Declared in a module without torch (the API generates its request body from them).
from .params import FinetuneError, FinetuneParams
from ..core.router_init import is_router_param

TRAIN_LOG = "train_log.json"
SUMMARY_FILE = "finetune.json"
MODEL_DIR = "model"

#: Target std of the initial EW softmax-router logits across experts (see module docstring).
#: At most this many built-in samples (~500 tokens each) are tokenised for training; longer
#: runs cycle through them in reshuffled epochs.
_MAX_BUILTIN_SAMPLES = 4000
_ATTENTION_PARTS = ("self_attn", "attention", "attn")
#: Kinds of layer module that route tokens and can be trained here.
ROUTED_KINDS = ("moe", "lowrank_moe")


# --------------------------------------------------------------------------- data


def training_windows(tokenizer: Any, data_dir: Path | None, source: str, seq_len: int, n_windows: int,
                     seed: int = 0) -> torch.Tensor:
    """``[n, seq_len]`` windows cut without overlap from the CALIBRATION split of ``source``
    (samples joined by EOS). ``n ≤ n_windows``: the trainer cycles when the text runs out."""
    samples = None
    if source.startswith("builtin:"):
        samples = int(min(_MAX_BUILTIN_SAMPLES, max(240, math.ceil(n_windows * seq_len / 400))))
    cset = load_calibration(source, samples=samples, seed=seed, data_dir=data_dir, split="calibration")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids = tokenizer([s.text for s in cset.samples], add_special_tokens=False)["input_ids"]
    stream = np.concatenate([np.append(np.asarray(x, dtype=np.int64), eos) for x in ids])
    n = min(n_windows, len(stream) // seq_len)
    if n == 0:
        raise FinetuneError(f"the training text of {source} ({len(stream)} tokens) is shorter than one {seq_len}-token window: "
                            "lower seq_len or use more text")
    return torch.from_numpy(stream[: n * seq_len].reshape(n, seq_len).copy())


def window_indices(cursor: int, batch_size: int, n_windows: int, seed: int) -> np.ndarray:
    """Indices of the windows at positions ``cursor … cursor+batch_size-1`` of the training order:
    epoch e is a permutation seeded by (seed, e), so any position can be recomputed on resume."""
    pos = np.arange(cursor, cursor + batch_size)
    out = np.empty(batch_size, dtype=np.int64)
    for epoch in np.unique(pos // n_windows):  # one or two epochs per batch
        perm = np.random.default_rng([seed, int(epoch)]).permutation(n_windows)
        sel = pos // n_windows == epoch
        out[sel] = perm[pos[sel] % n_windows]
    return out


def lr_factor(step: int, steps: int, warmup: float = 0.1, start: int = 0) -> float:
    """Linear warm-up over ``warmup`` of the steps after ``start``, then cosine decay to 10% by the
    last step (``step`` 0-based); 0 before ``start`` (a group that waits, see ``router_first``)."""
    if step < start:
        return 0.0
    step, steps = step - start, steps - start
    n_warm = max(1, round(warmup * steps))
    if step < n_warm:
        return (step + 1) / n_warm
    t = (step - n_warm) / max(1, steps - n_warm)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


# --------------------------------------------------------------------------- routing statistics


def load_balancing_loss(probs: torch.Tensor, selected: torch.Tensor, n_experts: int) -> torch.Tensor:
    """EW Eq. 12: ``L_LB = N_e · Σ_i f_i P_i`` for one layer.

    ``probs`` ``[T, E]``: router probabilities (differentiable); ``selected`` ``[T, k]``: the
    top-k expert ids. ``f_i`` = share of all T·k selections that chose expert i; ``P_i`` = mean
    of ``probs[:, i]``. Equals 1 for perfectly balanced routing with uniform probabilities.
    """
    sel = selected.reshape(-1)
    f = torch.bincount(sel, minlength=n_experts).to(probs.dtype) / max(1, sel.numel())
    return n_experts * (f * probs.reshape(-1, n_experts).mean(0)).sum()


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """``L_KD``: mean over positions of ``KL(p_teacher ‖ p_student)`` (temperature 1), logits ``[..., V]``;
    0 when the two distributions are equal (module docstring, "Distillation")."""
    s = F.log_softmax(student_logits.float().reshape(-1, student_logits.shape[-1]), -1)
    t = F.log_softmax(teacher_logits.float().reshape(-1, teacher_logits.shape[-1]), -1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


@torch.no_grad()
def update_router_bias(bias: torch.Tensor, counts: torch.Tensor, gamma: float) -> None:
    """CM §3.3 / AF Eq. 9: ``b_i -= γ`` if expert i is over-loaded (``p_i > p* = 1/N_r``),
    ``b_i += γ`` if under-loaded, unchanged at exactly p*; ``counts``: selections per expert."""
    total = counts.sum()
    if total <= 0:
        return
    p = counts.to(torch.float64) / total
    bias += (gamma * torch.sign(1.0 / counts.numel() - p)).to(bias.dtype)


def router_logits(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The logits whose softmax is the router probability P of EW Eq. 12, or None when the
    module's routing has no such probabilities (centroid/representative/gate-mass scores)."""
    router, w = getattr(module, "router", None), getattr(module, "router_weight", None)
    if isinstance(w, torch.Tensor) and getattr(router, "kind", None) == "softmax":  # MoeFFN's MoeRouter
        return F.linear(x, w)
    if isinstance(router, nn.Linear):  # MIDAS gating network G
        return router(x)
    return None


class RoutingTap:
    """Collects, per training step, each routed layer's selections (via ``recorder``) and,
    where the router has probabilities, its Eq. 12 term (via a forward hook)."""

    def __init__(self, modules: dict[int, nn.Module], with_lb: bool):
        self.modules = {i: m for i, m in modules.items() if 0 < m.top_k < m.n_routed}
        self.with_lb = with_lb
        self.counts: dict[int, torch.Tensor] = {}
        self.terms: list[torch.Tensor] = []
        self._selected: dict[int, torch.Tensor] = {}
        self._hooks = []
        for i, mod in self.modules.items():
            mod.recorder = self._recorder(i)
            self._hooks.append(mod.register_forward_hook(self._hook(i)))

    def _recorder(self, layer: int):
        def record(idx: torch.Tensor) -> None:
            sel = idx.reshape(-1, idx.shape[-1]).detach()
            self._selected[layer] = sel
            E = self.modules[layer].n_routed
            counts = torch.bincount(sel.reshape(-1).cpu(), minlength=E)
            self.counts[layer] = self.counts.get(layer, torch.zeros(E, dtype=torch.long)) + counts

        return record

    def _hook(self, layer: int):
        def hook(mod: nn.Module, args: tuple, _out: Any) -> None:
            if not self.with_lb or not torch.is_grad_enabled():
                return
            sel = self._selected.get(layer)
            logits = router_logits(mod, args[0].reshape(-1, args[0].shape[-1]))
            if sel is not None and logits is not None:
                self.terms.append(load_balancing_loss(torch.softmax(logits.float(), -1), sel, mod.n_routed))

        return hook

    def reset(self) -> None:
        self.counts, self.terms, self._selected = {}, [], {}

    def aux_loss(self) -> torch.Tensor | None:
        """Eq. 12 averaged over the layers that have router probabilities (None if none)."""
        return torch.stack(self.terms).mean() if self.terms else None

    def mean_load_cv(self) -> float | None:
        """MI Eq. 7 per layer, averaged: how unbalanced this step's routing was."""
        cvs = [load_cv(c.numpy()) for c in self.counts.values()]
        cvs = [c for c in cvs if math.isfinite(c)]
        return float(np.mean(cvs)) if cvs else None

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        for mod in self.modules.values():
            mod.recorder = None
        self._hooks = []


# --------------------------------------------------------------------------- modes


@dataclass
class TrainSetup:
    """What a mode made of the model: ``model`` is called in training (a peft wrapper when
    LoRA is used), ``moe`` is the MoelabForCausalLM inside it, ``modules`` the routed layers."""

    model: nn.Module
    moe: MoelabForCausalLM
    modules: dict[int, nn.Module]
    groups: dict[str, list[tuple[str, nn.Parameter]]]
    buffers: dict[str, torch.Tensor]
    changes_function: bool = False
    notes: dict[str, Any] = field(default_factory=dict)

    def trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for group in self.groups.values() for n, p in group}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Everything training changes: trainable parameters and the CMoE biases."""
        return {**{n: p.data for n, p in self.trainable().items()}, **self.buffers}


def _kind(module: nn.Module) -> str:
    spec = getattr(module, "spec", None)
    return str(spec.get("kind", "")) if isinstance(spec, dict) else ""


def routed_modules(moe: MoelabForCausalLM) -> dict[int, nn.Module]:
    """Layer -> routed MoE module (``MoeFFN`` / ``LowRankMoeFFN`` kinds) of a converted model."""
    return {i: m for i, m in moe.moe_modules().items() if _kind(m) in ROUTED_KINDS}


def _lora_targets(moe: MoelabForCausalLM, modules: dict[int, nn.Module]) -> tuple[list[str], list[str]]:
    """(Linear module names, stacked 3-D expert parameter names) that get LoRA adapters:
    attention projections, shared-expert Linears and the routed experts (never the routers)."""
    prefix = {id(m): n for n, m in moe.named_modules()}
    moe_prefixes = [prefix[id(m)] + "." for m in modules.values()]
    linears, params = [], []
    for name, mod in moe.named_modules():
        if isinstance(mod, nn.Linear) and not any(name.startswith(p) for p in moe_prefixes):
            if any(part in _ATTENTION_PARTS for part in name.split(".")):
                linears.append(name)
    for mod in modules.values():
        base = prefix[id(mod)]
        for child, sub in mod.named_children():
            if isinstance(sub, nn.Linear) and not is_router_param(child):
                linears.append(f"{base}.{child}")
        # stacked experts: the MoeFFN's ``experts`` module (gate_up_proj, down_proj), or the
        # module's own 3-D factors (LowRankMoeFFN)
        for pname, p in mod.named_parameters():
            if p.dim() == 3 and not is_router_param(pname):
                params.append(f"{base}.{pname}")
    return linears, params


def _router_params(setup_model: nn.Module, modules: dict[int, nn.Module], only: tuple[str, ...] | None = None
                   ) -> list[tuple[str, nn.Parameter]]:
    ids = {}
    for mod in modules.values():
        for pname, p in mod.named_parameters():
            if is_router_param(pname) and (only is None or pname in only):
                ids[id(p)] = p
    return [(n, p) for n, p in setup_model.named_parameters() if id(p) in ids]


def apply_mode(moe: MoelabForCausalLM, params: FinetuneParams, batch: torch.Tensor) -> TrainSetup:
    """Make ``moe`` trainable as ``params.mode`` says; freezes everything else.

    ``batch``: training windows, used by ``expertweaver`` to scale its router initialisation.
    """
    recovery = params.recovery
    problem = recovery.refusal(params.mode, [getattr(m, "spec", None) for m in moe.moe_modules().values()])
    if problem:
        raise FinetuneError(problem)
    modules = {i: m for i, m in routed_modules(moe).items() if _kind(m) == recovery.layer_kind}
    changes = False
    notes: dict[str, Any] = {}
    if recovery.prepare is not None:
        modules, notes, changes = recovery.prepare(moe, modules, batch)
    model: nn.Module = moe
    for p in moe.parameters():
        p.requires_grad_(False)
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
    if params.uses_lora:
        from peft import LoraConfig, get_peft_model

        linears, stacked = _lora_targets(moe, modules)
        config = LoraConfig(r=params.lora_rank, lora_alpha=params.lora_alpha, lora_dropout=0.0, bias="none",
                            target_modules=linears, target_parameters=stacked or None)
        model = get_peft_model(moe, config)
        groups["adapters"] = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        notes["lora_targets"] = {"modules": len(linears), "stacked_parameters": len(stacked)}
    groups["routers"] = _router_params(model, modules, recovery.router_params)
    if not groups["routers"]:
        raise FinetuneError(f"mode {params.mode!r}: the routed layers have no trainable router parameters")
    for _, p in groups["routers"]:
        p.requires_grad_(True)
    groups = _keep_reached(model, modules, groups, batch, params, notes)
    buffers = {}
    if recovery.balance_bias:
        names = {id(b): n for n, b in model.named_buffers()}
        buffers = {names[id(m.router_bias)]: m.router_bias for m in modules.values()
                   if getattr(m, "router_bias", None) is not None}
    return TrainSetup(model, moe, modules, groups, buffers, changes, notes)


#: Tokens of the first batch that the gradient check runs on (one sequence).
_PROBE_TOKENS = 32


def reached_parameters(model: nn.Module, modules: dict[int, nn.Module], params: list[nn.Parameter], batch: torch.Tensor,
                       lb: float) -> set[int]:
    """ids of the ``params`` that the training loss (NTP + ``lb``·L_LB) reaches, i.e. that autograd
    gives a gradient, on the first ``_PROBE_TOKENS`` tokens of ``batch``'s first sequence.

    Reaching is structural: a LoRA A matrix (B = 0) or a router behind a zero gate scale u gets
    an all-zero gradient at the start and is still reached; a router that only ranks experts
    (``sum`` combine) or a layer that runs every expert is not."""
    x = batch[:1, :_PROBE_TOKENS]
    was_training = model.training
    model.eval()
    tap = RoutingTap(modules, with_lb=lb > 0)
    try:
        with torch.enable_grad():
            loss = model(input_ids=x, labels=x, use_cache=False).loss
            aux = tap.aux_loss()
            if aux is not None and lb > 0:
                loss = loss + lb * aux
            if not loss.requires_grad:  # no trainable parameter is on the loss's path at all
                return set()
            grads = torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        tap.close()
        model.train(was_training)
    return {id(p) for p, g in zip(params, grads) if g is not None}


def _keep_reached(model: nn.Module, modules: dict[int, nn.Module], groups: dict[str, list[tuple[str, nn.Parameter]]],
                  batch: torch.Tensor, params: FinetuneParams, notes: dict[str, Any]
                  ) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """The groups without the parameters no gradient reaches (frozen again and named in
    ``notes["no_gradient"]``); FinetuneError when none is reached: nothing would train."""
    every = [p for ps in groups.values() for _, p in ps]
    reached = reached_parameters(model, modules, every, batch, params.lb_used)
    dropped = [n for ps in groups.values() for n, p in ps if id(p) not in reached]
    for p in every:
        if id(p) not in reached:
            p.requires_grad_(False)
    kept = {g: [(n, p) for n, p in ps if id(p) in reached] for g, ps in groups.items()}
    kept = {g: ps for g, ps in kept.items() if ps}
    if not kept:
        layers = "; ".join(
            f"layer {i}: combine {getattr(m, 'combine', '?')!r}, top-{m.top_k} of {m.n_routed} experts" for i, m in modules.items()
        )
        raise FinetuneError(
            f"mode {params.mode!r}: no trainable parameter receives a gradient from the training loss, so nothing would "
            f"train ({len(dropped)} parameter tensors checked; {layers}; λ·L_LB = {params.lb_used:g}). A router that only "
            "ranks experts (combine 'sum') or a layer that runs every expert gets no gradient from the LM loss: raise "
            "lb_coef above 0 (EW Eq. 12 reaches a router that chooses among experts), reconvert with top_k below the "
            "expert count, or use the mode of the method that made this conversion"
        )
    if dropped:
        notes["no_gradient"] = dropped
    return kept


@torch.no_grad()
def _merge_lora(model: nn.Module) -> None:
    """Fold every LoRA adapter into its base weight and put the base module back, innermost
    wrappers included. (peft's ``merge_and_unload`` skips modules nested inside a tuner layer,
    e.g. the shared-expert Linears inside the ``target_parameters`` wrapper of a MoeFFN.)"""
    from peft.tuners.tuners_utils import BaseTunerLayer

    while True:
        name = next((n for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)), None)
        if name is None:
            break
        layer = model.get_submodule(name)
        if hasattr(layer, "unload_and_optionally_merge_module"):  # nested ParamWrappers: all at once
            base = layer.unload_and_optionally_merge_module(merge=True, safe_merge=False, adapter_names=None)
        else:
            layer.merge()
            base = layer.get_base_layer()
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, base)
    if hasattr(model, "peft_config"):
        del model.peft_config


def merge_adapters(setup: TrainSetup) -> MoelabForCausalLM:
    """Fold LoRA into the weights and record each changed layer's new structure in the config,
    so the export rebuilds it."""
    moe = setup.moe
    if setup.model is not moe:
        _merge_lora(moe)
    specs = list(moe.config.moe_layers)
    for i, mod in setup.modules.items():
        specs[i] = layer_spec(mod)  # whole: a key the module dropped (EW Eq. 11 drops skip_mean) must go too
    moe.config.moe_layers = specs
    for p in moe.parameters():
        p.requires_grad_(False)
    realign_parameters(moe)
    return moe


# --------------------------------------------------------------------------- the run


def read_train_log(out: Path) -> dict[str, Any] | None:
    """The run's ``train_log.json`` (None before it was written)."""
    path = Path(out) / TRAIN_LOG
    return json.loads(path.read_text()) if path.is_file() else None


def load_conversion_for_training(conversion_dir: Path, device: torch.device) -> MoelabForCausalLM:
    """The exported conversion as the engine's ``MoelabForCausalLM`` in float32."""
    if not (Path(conversion_dir) / CONVERSION_FILE).is_file():
        raise FinetuneError(f"{conversion_dir}: not a converted model (no {CONVERSION_FILE}); convert first")
    moe = MoelabForCausalLM.from_pretrained(str(conversion_dir), dtype=torch.float32)
    return moe.to(device)


def load_tokenizer(conversion_dir: Path) -> Any:
    """The tokenizer exported with the conversion (its tokenizer.json; AutoTokenizer would
    first read config.json, whose model type only the bundled remote code knows)."""
    from transformers import PreTrainedTokenizerFast

    if not (Path(conversion_dir) / "tokenizer.json").is_file():
        raise FinetuneError(f"{conversion_dir}: no tokenizer.json; re-export the conversion with its tokenizer")
    return PreTrainedTokenizerFast.from_pretrained(str(conversion_dir))


def _optimizer(setup: TrainSetup, params: FinetuneParams) -> torch.optim.Optimizer:
    groups = [{"params": [p for _, p in setup.groups[g]], "lr": lr, "base_lr": lr, "name": g}
              for g, lr in (("adapters", params.lr), ("routers", params.router_lr)) if setup.groups.get(g)]
    return torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.0)


#: Most tokens in one forward/backward of a training step (larger steps are split into micro-batches).
STEP_TOKENS = BATCH_TOKENS


def run_finetune(
    conversion_dir: Path,
    params: FinetuneParams,
    out: Path,
    *,
    data_dir: Path | None,
    device: str = "auto",
    progress: Progress = NO_PROGRESS,
    loader: Any = load_model,
) -> dict[str, Any]:
    """Fine-tune the conversion in ``conversion_dir`` into ``out`` and export ``out/model``.

    Resumes from the latest checkpoint in ``out/checkpoints`` when there is one (same params
    required). ``progress.update("train", step, steps)`` after every step may raise
    ``Cancelled``: the last completed step is checkpointed first, so a re-run continues there.
    Returns the summary also written to ``out/finetune.json``.
    """
    t0 = time.perf_counter()
    reset_peak_rss()  # the summary's peak is this run's, not the worst job this worker process ever ran
    conversion_dir, out = Path(conversion_dir), Path(out)
    _validate(params, conversion_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_root = out / CHECKPOINT_DIR
    ckpt, log = _resumable(out, params)
    dev = resolve_device(device)
    record = _conversion_record(conversion_dir, params)
    moe, tokenizer, train_win, eval_win = _load_inputs(conversion_dir, params, dev, data_dir, progress)
    fresh = log is None or log.get("perplexity_before") is None
    before = perplexity(moe, eval_win, progress=progress, stage="perplexity before")[0] if fresh else None
    dense = _dense_model(record, data_dir, device, progress, loader) if fresh or params.distill > 0 else None
    teacher = dense if params.distill > 0 else None
    if fresh:
        log = _fresh_log(conversion_dir, params, before, dense, train_win, eval_win, progress)
        write_json_atomic(out / TRAIN_LOG, log)
    del dense  # kept only as the teacher: the float32 dense model is as large as the conversion

    setup = _set_up(moe, params, train_win, eval_win, dev, log, progress)
    optimizer = _optimizer(setup, params)
    names = {id(p): n for n, p in setup.trainable().items()}
    step, elapsed = 0, 0.0
    if ckpt is not None:
        try:
            restore(ckpt, setup.state_tensors(), optimizer, names)
        except CheckpointError as exc:
            raise FinetuneError(str(exc)) from exc
        step, elapsed = ckpt.step, float(ckpt.state.get("elapsed_s", 0.0))
        log["steps"] = [s for s in log.get("steps", []) if s["step"] <= step]
        log.setdefault("resumed_at", []).append(step)
    tap = RoutingTap(setup.modules, with_lb=True)

    def checkpoint(at: int) -> None:
        if list_checkpoints(ckpt_root) and list_checkpoints(ckpt_root)[-1][0] == at:
            return
        meta = {"params": params.to_dict(), "cursor": at * params.batch_size, "elapsed_s": elapsed}
        save_checkpoint(ckpt_root, at, setup.state_tensors(), optimizer, names, meta)

    trainable = list(setup.trainable().values())
    setup.model.train()
    log["status"] = "training"
    try:
        progress.update("train", step, params.steps)
        while step < params.steps:
            t_step = time.perf_counter()
            idx = window_indices(step * params.batch_size, params.batch_size, len(train_win), params.seed)
            x = train_win[idx].to(dev)
            factor = _schedule(optimizer, setup, params, step)
            tap.reset()
            sums = _accumulate_step(setup, params, tap, x, lambda: progress.update("train", step, params.steps),
                                    teacher)
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if setup.buffers and params.bias_step > 0:  # CM §3.3: b follows the loads
                for i, counts in tap.counts.items():
                    update_router_bias(setup.modules[i].router_bias, counts, params.bias_step)
            step += 1
            elapsed += time.perf_counter() - t_step
            log["steps"].append({
                "step": step, **sums, "load_cv": tap.mean_load_cv(),
                "lr": params.lr * factor if setup.groups.get("adapters") else params.router_lr * factor,
                "tokens": step * params.batch_size * params.seq_len, "elapsed_s": elapsed,
            })
            write_json_atomic(out / TRAIN_LOG, log)
            if step % params.checkpoint_every == 0 or step == params.steps:
                checkpoint(step)
            progress.update("train", step, params.steps)
    except Cancelled:
        if step > 0:
            checkpoint(step)
        log["status"] = "cancelled"
        write_json_atomic(out / TRAIN_LOG, log)
        tap.close()
        raise
    tap.close()

    return _export_finetuned(setup, conversion_dir, out, params, record, log, tokenizer, eval_win, step, elapsed, t0,
                             progress)


def _conversion_record(conversion_dir: Path, params: FinetuneParams) -> dict | None:
    """The conversion's record (None without one); distillation needs the dense model it names."""
    path = conversion_dir / CONVERSION_FILE
    record = json.loads(path.read_text()) if path.is_file() else None
    if params.distill > 0 and not _dense_source(record):
        raise FinetuneError(f"distill={params.distill:g} needs the dense model the conversion was made from, and "
                            f"{conversion_dir}'s record names none: use distill 0")
    return record


def _fresh_log(conversion_dir: Path, params: FinetuneParams, before: float, dense: nn.Module | None,
               train_win: torch.Tensor, eval_win: torch.Tensor, progress: Progress) -> dict[str, Any]:
    """A new run's log: what it trains on, the held-out perplexity ``before`` training and the dense model's."""
    return {"params": params.to_dict(), "mode": params.mode, "status": "evaluating", "steps": [],
            "conversion": str(conversion_dir.resolve()), "train_windows": int(len(train_win)),
            "eval_windows": int(len(eval_win)), "eval_source": params.heldout_source(),
            "lb_coef_used": params.lb_used, "resumed_at": [],
            "perplexity_before": before, "dense_perplexity": None if dense is None else
            perplexity(dense, eval_win, progress=progress, stage="perplexity dense")[0]}


def _validate(params: FinetuneParams, conversion_dir: Path) -> None:
    """The parameters' own rules, then those against the conversion's config (its layer kinds)."""
    params.validate()
    try:
        model_config = json.loads((conversion_dir / "config.json").read_text())
    except (OSError, ValueError):
        model_config = None  # loading the conversion says what is missing
    params.validate_for(model_config)


def _load_inputs(conversion_dir: Path, params: FinetuneParams, dev: Any, data_dir: Path | None,
                 progress: Progress) -> tuple[MoelabForCausalLM, Any, torch.Tensor, torch.Tensor]:
    """The conversion (in eval mode), its tokenizer, the training windows and the held-out windows."""
    with progress.step("load converted model"):  # real stages before 'train': loading and tokenising take a while
        moe = load_conversion_for_training(conversion_dir, dev)
        tokenizer = load_tokenizer(conversion_dir)
    with progress.step("read training and held-out text"):
        eval_win = heldout_windows(tokenizer, data_dir, seq_len=params.seq_len, n_windows=params.eval_windows,
                                   source=params.heldout_source())
        train_win = training_windows(tokenizer, data_dir, params.source, params.seq_len, params.steps * params.batch_size,
                                     params.seed)
    moe.eval()
    return moe, tokenizer, train_win, eval_win


def _set_up(moe: MoelabForCausalLM, params: FinetuneParams, train_win: torch.Tensor, eval_win: torch.Tensor, dev: Any,
            log: dict, progress: Progress) -> TrainSetup:
    """``apply_mode`` on the first batch; a fresh run's log gets the perplexity at the start of training
    (after a set-up that changes the function) and the trainable parameter counts."""
    torch.manual_seed(params.seed)
    first = torch.as_tensor(train_win[window_indices(0, params.batch_size, len(train_win), params.seed)]).to(dev)
    first = first[: window_batch(len(first), params.seq_len)]  # the set-up's forward: at most BATCH_TOKENS tokens
    with progress.step(f"set up {params.mode} training"):
        setup = apply_mode(moe, params, first)
    if "perplexity_start" not in log:
        log["perplexity_start"] = log["perplexity_before"]
        if setup.changes_function:
            setup.model.eval()
            log["perplexity_start"], _ = perplexity(setup.model, eval_win, progress=progress, stage="perplexity start")
        log["trainable_params"] = {g: int(sum(p.numel() for _, p in ps)) for g, ps in setup.groups.items()}
        log["mode_notes"] = setup.notes
    return setup


def _schedule(optimizer: torch.optim.Optimizer, setup: TrainSetup, params: FinetuneParams, step: int) -> float:
    """Set each group's learning rate for ``step`` (adapters wait ``router_first`` of the steps when
    routers train); returns the schedule's factor."""
    wait = round(params.router_first * params.steps) if setup.groups.get("routers") else 0
    for group in optimizer.param_groups:
        start = wait if group["name"] == "adapters" else 0
        group["lr"] = group["base_lr"] * lr_factor(step, params.steps, params.warmup, start)
    return lr_factor(step, params.steps, params.warmup)


def _resumable(out: Path, params: FinetuneParams) -> tuple[Any, dict | None]:
    """The latest checkpoint in ``out`` and its training log (``(None, None)`` for a fresh run); a
    checkpoint of a run with other parameters is refused. A parameter added since the checkpoint was
    written counts with its default, which is what that run trained with."""
    ckpt = latest_checkpoint(out / CHECKPOINT_DIR)
    if ckpt is not None and {**FinetuneParams().to_dict(), **(ckpt.state.get("params") or {})} != params.to_dict():
        raise FinetuneError(
            f"{out} holds checkpoints of a run with other parameters ({ckpt.state.get('params')}); "
            "resume with those parameters or use a new output directory"
        )
    return ckpt, (read_train_log(out) if ckpt is not None else None)


def _accumulate_step(setup: TrainSetup, params: FinetuneParams, tap: RoutingTap, x: torch.Tensor,
                     between: Any, teacher: nn.Module | None = None) -> dict[str, float | None]:
    """Forward and backward of one step's windows ``x``; returns the step's mean ``loss``, ``ntp_loss``,
    ``aux_loss`` (None without router probabilities) and ``kd_loss`` (None without a ``teacher``).

    A step of batch_size × seq_len tokens runs as micro-batches of at most STEP_TOKENS tokens (gradients
    accumulated, each weighted by its share of the windows): one forward/backward is bounded, and a cancel
    is seen between them (``between()``, a progress update), not only after a step of unbounded size.
    With a ``teacher`` the loss is ``(1 − w)·L_NTP + w·L_KD`` (w = ``distill``, module docstring)."""
    per = window_batch(len(x), params.seq_len, STEP_TOKENS)
    sums: dict[str, float | None] = {"loss": 0.0, "ntp_loss": 0.0, "aux_loss": None, "kd_loss": None}
    w = float(params.distill) if teacher is not None else 0.0
    for start in range(0, len(x), per):
        if start:
            between()
        xb = x[start:start + per]
        weight = len(xb) / len(x)
        out = setup.model(input_ids=xb, labels=xb, use_cache=False)
        terms = {"ntp_loss": out.loss}
        loss_b = out.loss
        if teacher is not None:
            with torch.no_grad():
                target = teacher(input_ids=xb, use_cache=False).logits
            terms["kd_loss"] = distillation_loss(out.logits, target)
            loss_b = terms["kd_loss"] if w >= 1 else (1 - w) * out.loss + w * terms["kd_loss"]
        aux_b = tap.aux_loss()
        tap.terms.clear()
        if aux_b is not None:
            terms["aux_loss"] = aux_b
            if params.lb_used > 0:
                loss_b = loss_b + params.lb_used * aux_b
        (loss_b * weight if weight != 1 else loss_b).backward()
        for key, value in {**terms, "loss": loss_b}.items():
            sums[key] = (sums[key] or 0.0) + weight * float(value.detach())
    return sums


def _export_finetuned(setup: TrainSetup, conversion_dir: Path, out: Path, params: FinetuneParams, record: dict | None,
                      log: dict, tokenizer: Any, eval_win: torch.Tensor, step: int, elapsed: float, t0: float,
                      progress: Progress) -> dict[str, Any]:
    """Merge the adapters, score the result, export ``out/model`` and write the summary."""
    log["status"] = "exporting"
    write_json_atomic(out / TRAIN_LOG, log)
    moe = merge_adapters(setup)
    moe.eval()
    log["perplexity_after"], _ = perplexity(moe, eval_win, progress=progress, stage="perplexity after")
    counts = parameter_counts(moe)
    block = {
        "params": params.to_dict(), "parent": str(conversion_dir.resolve()), "steps": step,
        "tokens": step * params.batch_size * params.seq_len,
        **{k: log.get(k) for k in ("perplexity_before", "perplexity_start", "perplexity_after", "dense_perplexity",
                                   "trainable_params", "mode_notes", "lb_coef_used")},
    }
    new_record = dict(record or {})
    new_record["summary"] = {**(new_record.get("summary") or {}), "total_params": counts["total"],
                             "active_params": counts["active"], "finetuned": True}
    new_record["finetune"] = block
    progress.update("export", 0, 1)
    export_model(moe, out / MODEL_DIR, tokenizer, new_record)
    progress.update("export", 1, 1)
    last = log["steps"][-1] if log["steps"] else {}
    summary = {
        "mode": params.mode, "steps": step, "tokens": block["tokens"],
        **{k: log.get(k) for k in ("perplexity_before", "perplexity_start", "perplexity_after", "dense_perplexity")},
        "final_loss": last.get("ntp_loss"), "train_s": elapsed, "total_s": time.perf_counter() - t0,
        "peak_rss_mib": peak_rss_mib(), "total_params": counts["total"], "active_params": counts["active"],
        "trainable_params": log.get("trainable_params"), "model": str((out / MODEL_DIR).resolve()),
        "conversion": str(conversion_dir.resolve()), "params": params.to_dict(),
    }
    write_json_atomic(out / SUMMARY_FILE, summary)
    log["status"] = "done"
    write_json_atomic(out / TRAIN_LOG, log)
    return summary


def _dense_source(record: dict | None) -> str | None:
    """The dense model a conversion's record says it was made from (None when it names none)."""
    return ((record or {}).get("model") or {}).get("source") or None


def _dense_model(record: dict | None, data_dir: Path | None, device: str, progress: Progress, loader: Any
                 ) -> nn.Module | None:
    """The dense model the conversion was made from (float32, eval mode; the perplexity reference and the
    distillation teacher), None when the record names none."""
    source = _dense_source(record)
    if not source:
        return None
    model = loader(source, data_dir=data_dir, device=device, dtype="float32", progress=progress).model
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
