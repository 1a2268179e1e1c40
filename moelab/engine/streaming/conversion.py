"""A partition conversion (ExpertWeaver, CMoE) under a memory budget: one decoder layer in memory
at a time, written straight into the export (``moelab convert --max-memory``).

The dense model is built on the ``meta`` device (``streaming.plan.meta_model``). For each
layer, only its MLP's weights are read from the safetensors shards (memory-mapped, one tensor at a
time), its experts are built exactly as in memory (``core.slicing``: same plan, same clustering,
same router) and sliced into a ``MoeFFN``, whose tensors go to that layer's shard of the export;
then the layer's weights go back to ``meta``. Every other tensor (attention, norms, embeddings) is
copied from the source shards one at a time. The export has the same files, names and float32
values as the in-memory conversion's (``runtime.export.export_model``), so it loads the same way
and computes the same logits.

A fitted conversion (ridge router, budget or leading plan, skipped-expert compensation: ``--recipe best``
and ``portable``) runs two passes. The first is ``core.fitting.layerwise_inputs`` over the calibration
windows with each decoder layer loaded in turn (``checkpoint.LayerLoader``): while a layer is in memory its
experts are clustered and fitted (``core.fitting.LayerFits.add``); then the plan is made over every layer,
as in memory. The second loads each MLP again, fits its skipped-expert means at the planned top-k and
writes it. The fit holds the calibration windows' hidden states and one layer's activations
(``fit_bytes``), which the budget must hold beside the largest layer.

What cannot stream is refused before any weight is read: the Fisher-weighted plan and the refit on the
converted model's inputs run the whole model at once, and the other methods read the whole model by
design. ``plan_conversion`` decides whether a conversion streams and checks that it can
(``core.params.check_streamable``), once; ``convert_streamed`` takes that plan as the decision.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..atomic import atomic_directory, write_json_atomic
from ..core.fitting import FIT_STAGE, LayerFits, guard_table, layerwise_inputs, profile_token_windows
from ..core.params import MethodParams, check_streamable, fit_budget_error, fit_bytes, needs_fitting
from ..core.slicing import (add_fit, build_modules, build_one_layer, check_compatible, partition_arrays,
                            partition_record)
from ..progress import NO_PROGRESS, Progress
from ..runtime.export import AUTO_MAP, CONVERSION_FILE, PARTITION_FILE, build_moe_model, copy_runtime
from ..runtime.modeling_moelab import MoelabForCausalLM
from ..runtime.param_count import parameter_counts
from ..sizes import parse_size
from .checkpoint import Checkpoint, LayerLoader, load_module, unload_module
from .footprint import MemoryBudgetError
from .plan import StreamPlan, plan_streaming

INDEX_FILE = "model.safetensors.index.json"
SHARD_BYTES = 256 << 20  # tensors other than the MLPs are grouped into shards of about this size (held until written)


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules()}


class _ShardWriter:
    """Safetensors shards written as they fill, and the index that maps each tensor to its shard."""

    def __init__(self, out: Path) -> None:
        self.out, self.weight_map, self.total = out, {}, 0
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes, self.n = 0, 0

    def add(self, name: str, t: torch.Tensor, flush_at: int = SHARD_BYTES) -> None:
        self.pending[name] = t.detach().to(torch.float32).contiguous()
        self.pending_bytes += self.pending[name].numel() * 4
        if self.pending_bytes >= flush_at:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        self.n += 1
        shard = f"model-{self.n:05d}.safetensors"
        save_file(self.pending, str(self.out / shard), metadata={"format": "pt"})
        self.weight_map.update({k: shard for k in self.pending})
        self.total += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Rename the shards ``-of-N`` as transformers writes them, and write the index."""
        self.flush()
        names = {f"model-{i:05d}.safetensors": f"model-{i:05d}-of-{self.n:05d}.safetensors" for i in range(1, self.n + 1)}
        for old, new in names.items():
            (self.out / old).rename(self.out / new)
        index = {"metadata": {"total_size": self.total}, "weight_map": {k: names[v] for k, v in sorted(self.weight_map.items())}}
        write_json_atomic(self.out / INDEX_FILE, index)


def plan_conversion(method: Any, params: MethodParams, profile: Any, max_memory: int | str, *, data_dir: Path,
                    device: str = "auto", trust_remote_code: bool = False) -> StreamPlan:
    """The profiled model (``profile``'s source) built on ``meta`` in float32, as a conversion reads it,
    against ``max_memory`` (bytes or "2GiB"): MemoryBudgetError when the budget cannot hold one layer (and,
    for a fitted conversion, what its fit holds: ``fit_bytes``); when the model and its fit exceed it
    (``plan.stream``), ConversionError when ``method`` or ``params`` cannot stream. The plan is the decision
    ``convert_streamed`` acts on; nothing checks it again."""
    plan = plan_streaming(profile.manifest["model"]["source"], parse_size(max_memory), data_dir=data_dir,
                          device=device, dtype="float32", trust_remote_code=trust_remote_code)
    adapter = plan.adapter
    plan.work_bytes = fit_bytes(params, adapter.d_model, max(lay.d_ffn for lay in adapter.layers), adapter.n_layers)
    if plan.stream:
        check_streamable(method, params)
        if error := fit_budget_error(params, plan.max_memory, plan.footprint.floor_bytes, plan.work_bytes):
            raise MemoryBudgetError(error)
    return plan


def _fit_pass(plan: StreamPlan, profile: Any, params: MethodParams, rows: list[Any], build_one: Callable[[int], Any],
              ckpt: Checkpoint, data_dir: Path, progress: Progress) -> tuple[list[Any], list[Any], LayerFits, dict]:
    """The first pass of a fitted conversion (module docstring): every layer clustered and fitted while the
    calibration windows pass through it, then the plan; returns ``(rows, experts, fits, fit record)``."""
    adapter = plan.adapter
    windows = profile_token_windows(adapter, profile, params.fit_tokens, data_dir)  # type: ignore[attr-defined]
    fits = LayerFits(adapter, params, int(windows.numel()), windows)
    experts = []
    progress.update(FIT_STAGE, 0, len(rows))
    loader = LayerLoader(adapter, ckpt, plan.device, plan.dtype)
    for i, inputs in enumerate(layerwise_inputs(adapter, windows, weights=loader)):
        experts.append(build_one(i))
        fits.add(rows[i], experts[i], inputs)
        del inputs  # not held through the next layer's pass
        progress.update(FIT_STAGE, i + 1, len(rows))
    rows, record = fits.plan(rows, experts, profile, guard_table(params, data_dir, (plan.device, plan.dtype),
                                                                adapter, profile))
    return rows, experts, fits, record


def convert_streamed(plan: StreamPlan, profile: Any, params: MethodParams, method: Any, out: Path, *, data_dir: Path,
                     progress: Progress = NO_PROGRESS, complete: Callable[[dict[str, Any], Any], None] | None = None,
                     ) -> dict[str, Any]:
    """Convert ``plan.adapter`` (a meta-device model; ``plan`` from ``plan_conversion``, which checked that
    ``method`` and ``params`` stream) layer by layer into the export directory ``out`` (atomic); returns
    the conversion record. ``complete(record, moe)``: adds the caller's fields (cost, provenance) before
    it is written. ``data_dir``: where a fitted conversion finds the profile's calibration text again."""
    from safetensors.numpy import save_file

    from ..runtime.model_card import write_model_card

    t0 = time.perf_counter()
    adapter = plan.adapter
    hf = adapter.model
    hf.tie_weights()  # a model built on meta leaves tied embeddings untied: they would count twice
    check_compatible(adapter, profile)
    ckpt = Checkpoint(plan.location)
    plan_for, layer_builder = method.partition
    rows = plan_for(profile, params)
    build_one = build_one_layer(adapter, rows, layer_builder(profile, params))
    before = parameter_counts(hf)
    names = _module_names(hf)
    mlp_prefixes = tuple(f"{names[id(lay.mlp)]}." for lay in adapter.layers)
    experts, meta_modules, fits, fit = [], {}, None, {}
    if needs_fitting(params):
        rows, experts, fits, fit = _fit_pass(plan, profile, params, rows, build_one, ckpt, data_dir, progress)
    with atomic_directory(out) as tmp:
        shards = _ShardWriter(tmp)
        progress.update("build experts", 0, len(rows))
        for i in range(len(rows)):
            mlp = adapter.layers[i].mlp
            load_module(hf, mlp_prefixes[i], mlp, ckpt, torch.device("cpu"), torch.float32)
            if fits is None:
                experts.append(build_one(i))
            elif fits.compensates:
                fits.compensate(experts[i])
            module = build_modules(adapter, [experts[i]], params).get(i)
            # this layer's experts (or, where the plan writes it whole, its dense MLP) go to the export now
            for name, t in (module or mlp).state_dict().items():
                shards.add(f"model.{mlp_prefixes[i]}{name}", t)
            shards.flush()
            unload_module(mlp)
            if module is not None:
                meta_modules[i] = module.to("meta")
            progress.update("build experts", i + 1, len(rows))
        t1 = time.perf_counter()
        progress.update("copy the other weights", 0, 1)
        moe = build_moe_model(adapter, meta_modules, provenance={"method": params.method, "router": params.router})  # type: ignore[attr-defined]
        tied = set(moe.all_tied_weights_keys or {})
        for name in moe.state_dict():  # every other tensor, named as save_pretrained names it: ``model.`` + HF name
            hf_name = name.removeprefix("model.")
            if hf_name.startswith(mlp_prefixes) or name in tied:  # tied (lm_head ↔ embed_tokens): written once, as there
                continue
            shards.add(name, ckpt.get(hf_name))
        shards.finish()
        progress.update("copy the other weights", 1, 1)
        moe.config.auto_map = dict(AUTO_MAP)
        moe.config.architectures = [MoelabForCausalLM.__name__]
        moe.config.dtype = torch.float32
        moe.config.save_pretrained(tmp)
        if getattr(moe, "generation_config", None) is not None:
            moe.generation_config.save_pretrained(tmp)
        copy_runtime(tmp)
        adapter.tokenizer.save_pretrained(tmp)
        save_file(partition_arrays(experts), str(tmp / PARTITION_FILE))
        record = partition_record(params, rows, experts, adapter.n_layers, before, parameter_counts(moe),
                                  {"build_s": t1 - t0, "copy_s": time.perf_counter() - t1, "streamed": True})
        add_fit(record, fit)
        if complete is not None:
            complete(record, moe)
        write_json_atomic(tmp / CONVERSION_FILE, record)
        write_model_card(tmp, record, moe, fmt="moelab")
    return record
