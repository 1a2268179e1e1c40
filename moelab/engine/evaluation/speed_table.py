"""This machine's kernel times for a model, measured once and cached (``core.speed_prediction`` predicts from them).

``measure_table`` times the whole dense model per phase (``evaluation.speed``) and, in the same rounds, the same
model with its FFNs returning zeros (so the FFNs' share of the model's time is a ratio measured in one process,
where the difference of two separately timed numbers drifted by a fifth), one dense FFN layer, and random-weight MoE
FFN layers of moelab's runtime over a grid of layouts around the model's FFN width (expert sizes D/128 … D/8, shared
shares 0.1–0.5, active shares 0.25–0.75, whole and half down rows), then fits each phase's coefficients. Each
layout's weights are cycled through enough copies (``working_set_bytes``: at least twice the largest CPU cache) that
a call reads them from memory as a whole model's layer does, not from a cache the previous calls warmed (a 300 MiB
L3 held 18 copies of the default model's dense FFN, and the table's FFNs ran 15% faster than the model's), but
no more copies than the model has layers (a model whose layers fit the cache runs them from it), and each
layout is timed in the same rounds as the dense FFN, as a ratio to it (a busy or drifting machine moves both alike).

A model that never is whole in memory (profiled under ``--max-memory``, streamed) gets ``measure_ffn_table``: the same
FFN layers at its shape, random weights, without the whole-model phases. That predicts no model's speed, but it is
what the speed guard of ``--recipe best`` reads, so a streamed conversion is guarded too.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import json
import statistics
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Union

import torch
from torch import nn

from ..atomic import write_json_atomic
from ..core.speed_prediction import FFN_LAYERS, TABLE_DIR, TABLE_VERSION, cpu_machine_name, fit, layer_features, table_key
from ..runtime.modeling_moelab import convert_in_place, decoder_layers, ffn_name, layer_ffns
from ..runtime.moelab_linear import projections_in_kernels
from ..runtime import moelab_native
from ..runtime.moelab_moe import MoeFFN
from .speed import CpuWatch, SpeedProtocol, prefill_length, time_phases

WORKING_SET_BYTES = 192 << 20
MAX_COPIES = 128
PHASE_TOKENS = {"decode_b1": 1, "decode_b8": 8}  # prefill: the protocol's prefill tokens
#: rounds a decode phase takes at least: a decode call of an 8B-shaped layer swings ±20% from one call to the next
#: (a grid layout's ratio to dense at batch 8 read 0.82 in one table and 1.24 in the next with 3 rounds), and its
#: calls are short (tens of ms) where a prefill's take a second
DECODE_MIN_ROUNDS = 9


def largest_cache_bytes() -> int:
    """The largest CPU cache this machine reports (Linux sysfs; 0 where it says nothing)."""
    sizes = [0]
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        with contextlib.suppress(ValueError):
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes)


def working_set_bytes(device: torch.device) -> int:
    """Bytes of weights a decode timing cycles through: enough that none of them is still cached from the last call."""
    return WORKING_SET_BYTES if device.type != "cpu" else max(WORKING_SET_BYTES, 2 * largest_cache_bytes())


def grid(d_ffn: int) -> list[dict[str, Any]]:
    """The MoE layouts timed: sizes a plan of this width produces (``d_shared``, ``n_routed``, ``expert_size``, ``top_k``)."""
    out = []
    for m in sorted({max(4, d_ffn // n) for n in (128, 64, 32, 16, 8)}):
        for shared, active in ((0.1, 0.25), (0.25, 0.5), (0.5, 0.75)):
            d_shared = int(round(shared * d_ffn))
            n_routed = (d_ffn - d_shared) // m
            top_k = min(n_routed, max(1, round((active * d_ffn - d_shared) / m)))
            out.append({"kind": "moe", "d_shared": d_shared, "n_routed": n_routed, "expert_size": m, "top_k": top_k, "down_keep": 1.0})
    for m in (d_ffn // 32, d_ffn // 16):
        n_routed = (d_ffn - d_ffn // 4) // m
        out.append({"kind": "moe", "d_shared": d_ffn // 4, "n_routed": n_routed, "expert_size": m,
                    "top_k": max(1, n_routed // 3), "down_keep": 0.5})
    # small experts (``--recipe best``'s layers): most of them selected (the products ranked for down_keep, and a
    # prefill past the machine's ``dense_share`` in two GEMMs), and 42% at the guard's boundary, where a prefill of
    # such a layer costs about the dense FFN's (without those the fit read a Xeon's layers of 35-45 such experts of
    # 80-100 at 0.94-0.95 of the dense FFN where they took 0.94-1.11, median 1.02, in the model)
    m = max(4, d_ffn // 128)
    for d_shared, share, keep in ((d_ffn // 4, 2 / 3, 0.5), (d_ffn // 4, 2 / 3, 1.0), (d_ffn // 4, 0.8, 0.5),
                                  (d_ffn // 4, 0.42, 0.5), (d_ffn // 3, 0.42, 0.5)):
        n_routed = (d_ffn - d_shared) // m
        out.append({"kind": "moe", "d_shared": d_shared, "n_routed": n_routed, "expert_size": m,
                    "top_k": max(1, round(share * n_routed)), "down_keep": keep})
    out.append({"kind": "moe", "d_shared": d_ffn, "n_routed": 0, "expert_size": 0, "top_k": 0, "down_keep": 1.0})  # dense-like
    return out


def copies(size: int, n_layers: int, device: torch.device) -> int:
    """How many copies of a layer of ``size`` bytes a decode timing cycles through: enough that each call reads its
    weights from memory (``working_set_bytes``), as a model's layer does when its layers' weights exceed the cache;
    but no more than the model's ``n_layers``, whose decode step reads each of its layers once: a model that fits the
    cache runs its layers from it, and so do the table's (a tiny model's layers timed through 128 copies took 4.8 s)."""
    return min(MAX_COPIES, max(1, n_layers), max(1, -(-working_set_bytes(device) // max(1, size))))


def _round_times(makes: list[Any], d_model: int, tokens: dict[str, int], device: torch.device, dtype: torch.dtype,
                 repeats: int, n_layers: int) -> dict[str, list[list[float]]]:
    """Per phase, per round, the seconds per call of each layer ``makes`` build, timed one after the other within each
    round, so that a machine's drift (this one's GEMMs swing 11-16 ms within a minute) hits them alike. A decode step
    reads every weight for a few tokens, so its calls cycle through copies (``copies``) and read them from where the
    model's layers would; a prefill computes long enough on each weight that one warm copy times it."""
    families = []
    for make in makes:
        first = make().to(device=device, dtype=dtype).eval()
        n = copies(sum(p.numel() * p.element_size() for p in first.parameters()), n_layers, device)
        families.append([first] + [copy.deepcopy(first) for _ in range(n - 1)])
    out: dict[str, list[list[float]]] = {}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for phase, t in tokens.items():
            x = torch.randn(t, d_model, generator=gen).to(device=device, dtype=dtype)
            cycled = [f if t <= max(PHASE_TOKENS.values()) else f[:1] for f in families]
            for layers in cycled:  # warm-up: first calls build kernels and buffers
                for layer in layers:
                    layer(x)
            rounds = []
            for _ in range(repeats if t > max(PHASE_TOKENS.values()) else max(repeats, DECODE_MIN_ROUNDS)):
                row = []
                for layers in cycled:
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    for layer in layers:
                        layer(x)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    row.append((time.perf_counter() - t0) / len(layers))
                rounds.append(row)
            out[phase] = rounds
    return out


def _layer_seconds(make: Any, reference: Any, reference_s: dict[str, float], d_model: int, tokens: dict[str, int],
                   device: torch.device, dtype: torch.dtype, repeats: int, n_layers: int) -> dict[str, float]:
    """Seconds per call of the layer ``make()`` builds, per phase: its median ratio to the ``reference`` layer (the dense
    FFN) timed in the same rounds, times the reference's own seconds ``reference_s``."""
    rounds = _round_times([make, reference], d_model, tokens, device, dtype, repeats, n_layers)
    return {phase: statistics.median(a / b for a, b in r) * reference_s[phase] for phase, r in rounds.items()}


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return cpu_machine_name()


class _ZeroFFN(nn.Module):
    """An FFN that adds nothing: the model around it is the part a conversion does not change."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros_like(x)


@contextlib.contextmanager
def without_ffns(model: nn.Module) -> Iterator[None]:
    """``model`` with every decoder layer's FFN returning zeros, for the time of the block."""
    originals = dict(enumerate(layer_ffns(model)))
    convert_in_place(model, {i: _ZeroFFN() for i in originals})
    try:
        yield
    finally:
        convert_in_place(model, originals)


@contextlib.contextmanager
def _rest_in_kernels(model: nn.Module) -> Iterator[None]:
    """``model`` without its FFNs (``without_ffns``) and with its other projections in the native decode call: the
    part of a step a conversion does not change, as moelab's runtime runs it (``moelab_linear``)."""
    with without_ffns(model), projections_in_kernels(model, layer_ffns(model)):
        yield


#: the dense model's own phases, timed quicker than an evaluation's (the table is a prediction's basis, not a result)
TABLE_PROTOCOL = SpeedProtocol(repeats=2, decode_steps=8)


def measure_table(model: nn.Module, tokens: torch.Tensor, info: dict[str, Any], protocol: SpeedProtocol = TABLE_PROTOCOL,
                  repeats: int = 5) -> dict[str, Any]:
    """The kernel table of ``model`` (a dense causal LM; ``info``: its source, d_model, d_ffn, n_layers) on its device."""
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    whole = time_phases({"dense": model, "no_ffn": model, "no_ffn_kernels": model}, tokens, protocol=protocol,
                        setups={"no_ffn": lambda: without_ffns(model), "no_ffn_kernels": lambda: _rest_in_kernels(model)})
    tokens_by_phase = {**PHASE_TOKENS, "prefill": int(whole["phases"]["prefill"]["tokens"])}
    mlp = _first_ffn(model)
    table = _ffn_table(copy.deepcopy(mlp), info, tokens_by_phase, device, dtype, repeats)
    for phase, entry in table["phases"].items():
        timed = whole["phases"][phase]
        entry.update(dense_model_s=timed["seconds"]["dense"], ffn_share=max(0.0, 1 - 1 / timed["speedup"]["no_ffn"]),
                     rest_share=1 / timed["speedup"]["no_ffn_kernels"])
    return table


def measure_ffn_table(model: nn.Module, info: dict[str, Any], where: tuple[torch.device, torch.dtype],
                      prefill_tokens: int, repeats: int = 3) -> dict[str, Any]:
    """The kernel table of a model that is never whole in memory (a streamed profile): the dense FFN layer and the
    grid of MoE layers only, ``model``'s FFN module (its weights on any device, meta included) rebuilt with random
    weights on ``where`` as the reference. Without the whole model's phases it predicts no model's speed
    (``scope`` ``ffn_layers``, ``speed_prediction.predict`` says so), but it holds what the speed guard reads: each
    layout's time over the dense FFN's (``top_k_no_slower``). Choice: ``repeats`` 3, where the whole-model table takes 5:
    a layer of an 8B model takes about a second to prefill 512 tokens on 2 cores, and the grid is 23 layouts (the decode
    phases' short calls take ``DECODE_MIN_ROUNDS`` all the same)."""
    device, dtype = where
    tokens_by_phase = {**PHASE_TOKENS, "prefill": int(prefill_tokens)}
    table = _ffn_table(_random_weights(_first_ffn(model), device, dtype), info, tokens_by_phase, device, dtype, repeats)
    return {**table, "scope": FFN_LAYERS}


def ffn_table_bytes(info: dict[str, Any], where: tuple[torch.device, torch.dtype], prefill_tokens: int) -> int:
    """What ``measure_ffn_table`` holds at once: a grid layout and the dense FFN (about one GLU's weights each), each
    in as many copies as a decode timing cycles through (``copies``), and a prefill's activations twice over (its
    input, gate and up products, and their GLU; an 8B-shaped table peaked 1.52 GiB over the process before it,
    against the weights' 1.31 GiB and this 0.18 GiB)."""
    device, dtype = where
    d_model, d_ffn, item = int(info["d_model"]), int(info["d_ffn"]), torch.empty((), dtype=dtype).element_size()
    size = 3 * d_model * d_ffn * item
    return 2 * copies(size, int(info["n_layers"]), device) * size + 2 * prefill_tokens * (d_model + 3 * d_ffn) * item


def _first_ffn(model: nn.Module) -> nn.Module:
    """The dense FFN a conversion replaces (the first decoder layer's), as the model runs it."""
    own = decoder_layers(model)[0]
    return getattr(own, ffn_name(own))


def _random_weights(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A copy of ``module`` (its weights anywhere, on ``meta`` too) on ``device`` in ``dtype``, with random weights:
    what its calls take does not depend on the values."""
    out = copy.deepcopy(module).to_empty(device=device).to(dtype)
    with torch.no_grad():
        for p in out.parameters():
            nn.init.normal_(p, std=0.02)
    return out


def _ffn_table(dense: nn.Module, info: dict[str, Any], tokens_by_phase: dict[str, int], device: torch.device,
               dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    """The table's FFN part: the dense FFN layer ``dense`` and the grid's MoE layers timed against it (every layout
    against this one layer: an 8B shape's random FFN takes a second to draw), each phase's coefficients fitted."""
    d_model, d_ffn, n_layers = int(info["d_model"]), int(info["d_ffn"]), int(info["n_layers"])
    reference = lambda: dense  # noqa: E731
    dense_ffn = {phase: statistics.median(r[0] for r in rounds)
                 for phase, rounds in _round_times([reference], d_model, tokens_by_phase, device, dtype, repeats,
                                                   n_layers).items()}
    native = device.type == "cpu" and dtype == torch.float32 and moelab_native.library() is not None
    shares = list(moelab_native.dense_shares()) if native else None  # measured first: not inside the grid's rounds
    cpu = CpuWatch()

    def seconds(layout: dict[str, Any]) -> dict[str, float]:
        spec = {**layout, "d_model": d_model, "router": "centroid", "combine": "sum"}
        return _layer_seconds(lambda: MoeFFN(spec), reference, dense_ffn, d_model, tokens_by_phase, device, dtype,
                              repeats, n_layers)

    rows = [{"layer": layout, "seconds": seconds(layout)} for layout in grid(d_ffn)]
    coefs = {phase: fit(rows, t, phase, native, d_model, shares) for phase, t in tokens_by_phase.items()}
    retimed = []
    for i in _off_the_fit(rows, coefs, tokens_by_phase, native, d_model, shares):
        retimed.append({"layer": rows[i]["layer"], "first_seconds": rows[i]["seconds"]})
        rows[i] = {"layer": rows[i]["layer"], "seconds": seconds(rows[i]["layer"])}
    if retimed:
        coefs = {phase: fit(rows, t, phase, native, d_model, shares) for phase, t in tokens_by_phase.items()}
    phases = {phase: {"tokens": t, "dense_ffn_s": dense_ffn[phase], "coef": coefs[phase].tolist()}
              for phase, t in tokens_by_phase.items()}
    return {"version": TABLE_VERSION, "native": native, **({"native_dense_shares": shares} if shares else {}),
            "model": {k: info[k] for k in ("source", "d_model", "d_ffn", "n_layers")},
            "d_ffn": d_ffn, "n_layers": n_layers, "machine": machine_name(device),
            "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "phases": phases, "grid": rows,
            "retimed": retimed, "others_cpu_share": cpu.others_share()}


#: a grid layout whose measured time is off its fitted time by more than this factor, in any phase, is timed again:
#: the fit holds every layout of a quiet machine within 15%, and a neighbour's burst during one layout's rounds made a
#: default-model layout read 15x its fit (its calls wait at each OpenMP barrier for the other process, the dense
#: reference's few large ones hardly), which moved the batch-8 and prefill coefficients by 10-30%
OFF_THE_FIT = 2.0


def _off_the_fit(rows: list[dict[str, Any]], coefs: dict[str, Any], tokens_by_phase: dict[str, int], native: bool,
                 d_model: int, shares: list[float] | None) -> list[int]:
    """The grid rows whose seconds are more than ``OFF_THE_FIT`` times off their fitted seconds in any phase."""
    out = []
    for i, row in enumerate(rows):
        for phase, t in tokens_by_phase.items():
            fitted = float(layer_features(row["layer"], t, native, d_model, shares) @ coefs[phase])
            if not 1 / OFF_THE_FIT <= fitted / max(row["seconds"][phase], 1e-12) <= OFF_THE_FIT:
                out.append(i)
                break
    return out


#: the batch whose touched experts a converted model's prediction counts: ``PHASE_TOKENS["decode_b8"]`` sequences
TOUCHED_BATCH = PHASE_TOKENS["decode_b8"]


def layers_with_touched(model: nn.Module, tokenizer: Any, layers: list[dict[str, Any]], data_dir: Path) -> list[dict[str, Any]]:
    """``layers`` (the converted ``model``'s ``moe_layers``) with the experts a decode step at batch 8 touches in each,
    measured on held-out text (``metrics.experts_touched``): ``touched`` as ``core.speed_prediction`` reads it."""
    from .metrics import experts_touched, heldout_windows

    windows = heldout_windows(tokenizer, data_dir, seq_len=64, n_windows=TOUCHED_BATCH)
    seen = experts_touched(model, windows, TOUCHED_BATCH)
    return [{**layer, "touched": {str(TOUCHED_BATCH): round(seen[i], 3)}} if i in seen else dict(layer)
            for i, layer in enumerate(layers)]


def model_info(adapter: Any, source: str | None) -> dict[str, Any]:
    """What a table is keyed by and predicts for: the model's source, d_model, d_ffn and layer count."""
    return {"source": source, "d_model": adapter.d_model, "d_ffn": adapter.layers[0].d_ffn, "n_layers": len(adapter.layers)}


#: where a model's weights are: the model itself, or ``(device, dtype)`` for one that is not in memory (a streamed job)
Placement = Union[nn.Module, tuple[torch.device, torch.dtype]]


def table_path(where: Placement, info: dict[str, Any], data_dir: Path) -> Path:
    """Where the table of a model on ``where`` (``info``: its source and shape) on this machine, its dtype, this thread
    count and this build of the native kernels is cached."""
    if isinstance(where, nn.Module):
        param = next(where.parameters())
        where = (param.device, param.dtype)
    device, dtype = where
    kernels = moelab_native.build_key() if device.type == "cpu" and moelab_native.library() is not None else ""
    key = table_key(info, machine_name(device), str(dtype).removeprefix("torch."), torch.get_num_threads(), kernels)
    return Path(data_dir) / TABLE_DIR / f"{key}.json"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # never measured, or damaged: measured again by the next profile


def cached_table(where: Placement, info: dict[str, Any], data_dir: Path) -> dict[str, Any] | None:
    """The table ``ensure_table`` measured here for the model on ``where``, or None."""
    return _read(table_path(where, info, data_dir))


def ensure_table(model: nn.Module, tokens: torch.Tensor, info: dict[str, Any], data_dir: Path) -> dict[str, Any]:
    """The cached table of ``model`` on this machine, measured and written (atomically) when there is none (or it is
    damaged, or it timed the FFN layers only: the model is whole in memory now)."""
    path = table_path(model, info, data_dir)
    table = _read(path)
    if table is None or table.get("scope") == FFN_LAYERS:
        table = measure_table(model, tokens, info)
        _write(path, table)
    return table


def ensure_ffn_table(model: nn.Module, info: dict[str, Any], where: tuple[torch.device, torch.dtype], data_dir: Path,
                     max_memory: int) -> dict[str, Any] | None:
    """The cached table of a model that streams (``model``: on ``meta``), or its FFN layers timed (the prefill as the
    whole-model table's, ``TABLE_PROTOCOL``, within the model's positions) and written when there is none; None where
    that timing would not fit ``max_memory`` (``ffn_table_bytes``)."""
    path = table_path(where, info, data_dir)
    table = _read(path)
    if table is None:
        prefill = prefill_length(TABLE_PROTOCOL, [model])
        if ffn_table_bytes(info, where, prefill) > max_memory:
            return None
        table = measure_ffn_table(model, info, where, prefill)
        _write(path, table)
    return table


def _write(path: Path, table: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, table)
