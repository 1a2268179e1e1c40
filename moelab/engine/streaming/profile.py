"""Layer-streamed profiling: the same pass as ``profiling.profiler.profile_model`` under a memory budget.

When a model's weights exceed ``--max-memory``, the pass runs layer by layer instead of batch
by batch:

1. The model is built on the ``meta`` device (``accelerate.init_empty_weights``): its modules
   exist, its weights do not.
2. Only the decoder's own weights (embeddings, final norm) are loaded; every calibration batch
   goes through the decoder's real ``forward`` with each decoder layer replaced by a catcher
   that records the exact arguments the model passes to it (causal mask, rotary position
   embeddings, position ids, per-layer attention type). Layer 0's input is the embedded batch.
   This is the model's own code path, so families that scale embeddings (Gemma) or alternate
   sliding/full attention (Gemma 2/3, Qwen2) need nothing special.
3. For each decoder layer: its tensors are read from the safetensors shards (memory-mapped by
   ``safe_open``) into the meta module (``accelerate``'s ``set_module_tensor_to_device``), the
   profiler's own hooks are attached, every batch runs through it with the recorded arguments,
   its outputs become the next layer's inputs, and the weights go back to ``meta``.
4. S_L / S_M (D2 Eqs. 4–5) need every layer's unit-norm vectors of the same token: they are
   kept per layer (in memory or on disk) and reduced at the end in bounded token chunks.

Hidden states, the unit vectors and finished XᵀX matrices stay in memory while the budget left
after the largest layer holds them, and go to memory-mapped files in a scratch directory next
to the output otherwise. The statistics equal the in-memory pass's (tests: to 1e-5).

The budget covers weights and carried tensors, not the Python/torch runtime (a few hundred
MB) nor one batch's transient activations (``batch_tokens`` bounds those).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..atomic import temporary_sibling
from ..data.calibration import CalibrationSet
from ..layer_calls import catch_calls, layer_list_name, run_layer
from ..profiling.profiler import (
    LayerStats,
    ProfileResult,
    ProfileSettings,
    _assemble,
    _batch_state,
    _batch_tensors,
    _feature_rows,
    _finish_layer,
    _LayerAccumulator,
    _layer_hooks,
    _PassInputs,
    start_pass,
)
from ..progress import NO_PROGRESS, Progress
from .checkpoint import Checkpoint, LayerLoader
from .plan import StreamPlan

#: Tokens per chunk when S_L / S_M are reduced from the per-layer unit vectors: 64 MiB of floats.
_SIMILARITY_CHUNK_BYTES = 64 * 1024**2


# --------------------------------------------------------------------------- carried tensors


def _pwrite(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(np.ascontiguousarray(data)).cast("B")
    while len(view):  # a single pwrite may write less than asked (e.g. past 2 GiB)
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _pread(fd: int, nbytes: int, offset: int) -> np.ndarray:
    buf = np.empty(nbytes, dtype=np.uint8)
    view = memoryview(buf)
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise EOFError("scratch file shorter than written")
        view, offset = view[n:], offset + n
    return buf


class _ScratchFile:
    """A file in the scratch directory read and written with pread/pwrite, not mmap: mapped
    pages would count in this process's resident memory until unmapped, which is what the
    budget is meant to bound; the page cache they land in instead is the kernel's to evict."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


class _Carry:
    """Per-batch tensors carried between layers: a list in memory, or one scratch file.

    Stored as raw bytes so bfloat16 (which numpy lacks) round-trips exactly.
    """

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, path: Path | None) -> None:
        self.shapes, self.dtype = shapes, dtype
        sizes = [int(np.prod(s)) * dtype.itemsize for s in shapes]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.items: list[torch.Tensor | None] = [None] * len(shapes)
        self.file = None if path is None else _ScratchFile(path)

    def put(self, b: int, t: torch.Tensor) -> None:
        t = t.detach().to("cpu", self.dtype).contiguous()
        if self.file is None:
            self.items[b] = t
        else:
            _pwrite(self.file.fd, t.view(-1).view(torch.uint8).numpy(), int(self.offsets[b]))

    def get(self, b: int) -> torch.Tensor:
        if self.file is None:
            return self.items[b]
        raw = _pread(self.file.fd, int(self.offsets[b + 1] - self.offsets[b]), int(self.offsets[b]))
        return torch.from_numpy(raw).view(self.dtype).view(self.shapes[b])


class _Units:
    """Unit-norm vectors of every layer and token, [L, N, d] float32, in memory or a scratch file."""

    def __init__(self, n_layers: int, n_tokens: int, d_model: int, path: Path | None) -> None:
        self.shape = (n_layers, n_tokens, d_model)
        self.file = None if path is None else _ScratchFile(path)
        self.data = torch.empty(self.shape) if path is None else None

    def put(self, layer: int, t0: int, t: torch.Tensor) -> None:
        if self.file is None:
            self.data[layer, t0 : t0 + len(t)] = t
        else:
            _, n, d = self.shape
            _pwrite(self.file.fd, t.float().contiguous().numpy(), ((layer * n) + t0) * d * 4)

    def chunk(self, t0: int, t1: int) -> torch.Tensor:
        """[L, t1 - t0, d] for tokens t0 … t1 - 1."""
        if self.file is None:
            return self.data[:, t0:t1]
        n_layers, n, d = self.shape
        rows = [_pread(self.file.fd, (t1 - t0) * d * 4, ((i * n) + t0) * d * 4).view(np.float32) for i in range(n_layers)]
        return torch.from_numpy(np.stack(rows).reshape(n_layers, t1 - t0, d))


# --------------------------------------------------------------------------- the streamed pass


@dataclass
class _Budget:
    """What goes to disk: decided once from the bytes left after the largest step."""

    left: int
    on_disk: dict[str, bool] = field(default_factory=dict)

    def place(self, name: str, nbytes: int) -> bool:
        fits = nbytes <= self.left
        if fits:
            self.left -= nbytes
        self.on_disk[name] = not fits
        return not fits


def profile_streamed(
    plan: StreamPlan,
    cset: CalibrationSet,
    settings: ProfileSettings | None = None,
    progress: Progress = NO_PROGRESS,
    scratch_near: Path | None = None,
) -> ProfileResult:
    """``profile_model``'s statistics, one decoder layer in memory at a time."""
    adapter = plan.adapter
    s, p, timings = start_pass(adapter.tokenizer, cset, settings)

    n_layers, d_model = adapter.n_layers, adapter.d_model
    decoder = adapter.decoder()
    layers_name = layer_list_name(adapter)

    # Where the carried tensors live: budget after the largest step, hidden states first
    # (they are read every layer), then the unit vectors, then the finished XᵀX matrices.
    batch_shapes = [(len(rows), int(p.lengths[rows].max()), d_model) for rows in p.batches]
    hidden_bytes = sum(int(np.prod(sh)) for sh in batch_shapes) * plan.dtype.itemsize
    unit_bytes = n_layers * p.n_tokens * d_model * 4
    budget = _Budget(plan.max_memory - plan.footprint.floor_bytes)
    hidden_disk = budget.place("hidden_states", 2 * hidden_bytes)
    units_disk = budget.place("unit_vectors", 2 * unit_bytes)
    xtx_disk = s.second_moment and budget.place("second_moment", n_layers * d_model * d_model * 8)
    scratch = None
    if hidden_disk or units_disk or xtx_disk:
        scratch = temporary_sibling(Path(scratch_near or Path.cwd()) / "profile", "stream")
        scratch.mkdir(parents=True)

    loader = LayerLoader(adapter, Checkpoint(plan.location), plan.device, plan.dtype)
    try:
        def carry(name: str) -> _Carry:
            return _Carry(batch_shapes, plan.dtype, scratch / f"{name}.bin" if hidden_disk else None)

        h_in, h_out = carry("hidden_a"), carry("hidden_b")
        units_out = _Units(n_layers, p.n_tokens, d_model, scratch / "units_out.f32" if units_disk else None)
        units_mlp = _Units(n_layers, p.n_tokens, d_model, scratch / "units_mlp.f32" if units_disk else None)
        token_start = np.concatenate([[0], np.cumsum([int(p.lengths[rows].sum()) for rows in p.batches])])

        # Step 2: embeddings and each layer's call arguments, through the model's own forward.
        t1 = time.perf_counter()
        calls_per_batch, feature_rows = _embed(plan, p, loader, decoder, layers_name, h_in, progress)
        timings["embed_s"] = time.perf_counter() - t1

        # Step 3: one layer at a time over every batch.
        layers: list[LayerStats] = []
        t2 = time.perf_counter()
        progress.update("profile layers", 0, n_layers)
        for i, lay in enumerate(adapter.layers):
            acc = _run_layer(i, lay, plan, p, s, loader, calls_per_batch, (h_in, h_out),
                             (units_out, units_mlp), token_start)
            stats = _finish_layer(acc, p.sample_group, len(p.group_names), p.n_tokens, s)
            if xtx_disk and stats.xtx is not None:  # finished XᵀX wait on disk for the profile writer
                np.save(scratch / f"xtx_{i}.npy", stats.xtx)
                stats.xtx = np.load(scratch / f"xtx_{i}.npy", mmap_mode="r")
            layers.append(stats)
            del acc
            h_in, h_out = h_out, h_in
            progress.update("profile layers", i + 1, n_layers)
        timings["forward_s"] = time.perf_counter() - t2
        timings["seconds_per_layer"] = timings["forward_s"] / n_layers

        # Step 4: D2 Eqs. 4-5 from the stored unit vectors, a bounded token chunk at a time.
        t3 = time.perf_counter()
        sim_out = _similarity(units_out)
        sim_mlp = _similarity(units_mlp)
        del units_out, units_mlp
        timings["finish_s"] = time.perf_counter() - t3
        timings.update(max_memory_bytes=float(plan.max_memory), streamed=1.0,
                       hidden_states_on_disk=float(hidden_disk), unit_vectors_on_disk=float(units_disk),
                       second_moment_on_disk=float(bool(xtx_disk)))
        info = adapter.describe() | {"streamed": True}
        result = _assemble(info, cset, s, p, layers, sim_out, sim_mlp, feature_rows, timings, adapter.tokenizer)
        result.scratch = scratch  # the XᵀX memmaps live there until the profile is written
        return result
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise


def _embed(plan: StreamPlan, p: _PassInputs, loader: LayerLoader, decoder: nn.Module, layers_name: str,
           h_in: _Carry, progress: Progress) -> tuple[list[dict[int, Any]], list[np.ndarray]]:
    """Step 2 of ``profile_streamed``: the decoder (its own weights loaded by ``loader``) without its layers runs
    every batch, a ``LayerCatcher`` in each layer's place; the first layer's input goes to ``h_in``.
    Returns every batch's per-layer call arguments and its feature rows."""
    device = plan.device
    n_layers = plan.adapter.n_layers
    progress.update("embed", 0, len(p.batches))
    calls_per_batch: list[dict[int, Any]] = []
    feature_rows: list[np.ndarray] = []
    with loader.decoder():
        with torch.inference_mode():
            for b, rows in enumerate(p.batches):
                input_ids, mask, keep = _batch_tensors(p, rows)
                calls = catch_calls(decoder, layers_name, n_layers, input_ids=input_ids.to(device),
                                    attention_mask=mask.long().to(device))
                h_in.put(b, calls.pop("input"))
                calls_per_batch.append(calls)
                feature_rows.append(_feature_rows(rows, keep))
                progress.update("embed", b + 1, len(p.batches))
    return calls_per_batch, feature_rows


def _run_layer(i: int, lay: Any, plan: StreamPlan, p: _PassInputs, s: ProfileSettings, loader: LayerLoader,
               calls_per_batch: list[dict[int, Any]], hidden: tuple[_Carry, _Carry], units: tuple[_Units, _Units],
               token_start: np.ndarray) -> _LayerAccumulator:
    """Step 3 of ``profile_streamed`` for layer ``i``: its weights loaded (``loader``), every batch run through
    it with the profiling hooks, hidden states ``h_in`` → ``h_out`` (``hidden``), its unit vectors (output, MLP)
    into ``units``; unloaded again. Returns the layer's accumulator."""
    device, d_model = plan.device, plan.adapter.d_model
    (h_in, h_out), (units_out, units_mlp) = hidden, units
    acc = _LayerAccumulator(len(p.ids), lay.d_ffn, d_model, s, device)
    state: dict[str, Any] = {}
    with loader.layer(lay):
        handles = _layer_hooks(i, lay, acc, state, s)
        try:
            with torch.inference_mode():
                for b, rows in enumerate(p.batches):
                    _, mask, keep = _batch_tensors(p, rows)
                    n_real = int(mask.sum())
                    out_buf = {i: torch.empty(n_real, d_model, device=device)}
                    mlp_buf = {i: torch.empty(n_real, d_model, device=device)}
                    state.update(_batch_state(p, rows, mask, keep, device), out_buf=out_buf, mlp_buf=mlp_buf)
                    h_out.put(b, run_layer(lay.block, h_in.get(b).to(device), calls_per_batch[b][i]))
                    units_out.put(i, int(token_start[b]), out_buf[i].cpu())
                    units_mlp.put(i, int(token_start[b]), mlp_buf[i].cpu())
        finally:
            for h in handles:
                h.remove()
    return acc


def _similarity(units: _Units) -> torch.Tensor:
    """Σ_t <x̂_l,t, x̂_m,t> for every layer pair, over token chunks of bounded size."""
    n_layers, n_tokens, d_model = units.shape
    chunk = max(1, _SIMILARITY_CHUNK_BYTES // (n_layers * d_model * 4))
    total = torch.zeros(n_layers, n_layers, dtype=torch.float64)
    for t0 in range(0, n_tokens, chunk):
        flat = units.chunk(t0, min(n_tokens, t0 + chunk)).reshape(n_layers, -1)
        total += (flat @ flat.T).double()
    return total


def remove_scratch(result: ProfileResult) -> None:
    """Delete a streamed result's scratch files (after the profile is written)."""
    scratch = getattr(result, "scratch", None)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
