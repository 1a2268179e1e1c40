"""Whole models timed against each other in the three phases a user waits for.

Multiply-adds (``ffn_flops_fraction``) say what a conversion could save; seconds say what it does.
Every model given is timed in the same process, round-robin (round r runs every model once before
round r+1), so each ratio compares the same machine state:

- ``decode_b1``: one new token for one sequence, with a KV cache of ``context`` real tokens (the
  generation loop's step; greedy, so each step feeds the token the model just chose);
- ``decode_b8``: the same step for ``batch`` sequences at once (serving several users);
- ``prefill``: one forward over ``prefill_tokens`` tokens of one sequence (reading a prompt): the KV cache filled
  and the last position's logits computed, as transformers' ``generate()`` and llama.cpp compute them
  (``prefill_logits="last"``; a model whose forward takes no ``logits_to_keep`` computes every position's). Before,
  every position's logits were computed, a scoring pass rather than a prompt's: on the default model the head's
  49,152 × 576 product over 512 tokens is about a fifth of a dense prefill on 2 CPU cores, the same for every model,
  so it pulled every prefill ratio towards 1.

A phase's time is the median over ``repeats`` rounds (decode: seconds per step, the median over its
``decode_steps`` steps in that round, the models taking turns of a few steps; prefill: the mean of
two forwards each, in the order A B … B A), after one untimed warm-up round, so neither model pays
first-call costs (allocator, lazily built kernels) in the numbers. ``speedup[name]`` is the median
over rounds of the reference model's time over ``name``'s in the same round (``rounds`` keeps every
round's seconds): a machine whose speed drifts over seconds (a shared host) moves both times of a
round alike, where a ratio of the two medians would mix rounds. The tokens are real held-out text:
routing, and so the experts a batch touches, depends on the text.

On a CUDA device each model's decode step runs as a CUDA graph (``cuda_graphs``, the default): its KV cache is a
transformers ``StaticCache`` and one step is captured after the prefill and replayed, the token and position updated
in place. An eager step of a small model is hundreds of kernel launches whose host cost hides the kernels (a 135M
model's step took 27 ms eager on an H100), and an MoE layer adds launches where a dense FFN has three: without graphs
the comparison measures Python, not the layout. Every model of a phase runs the same way; if any step cannot be
captured (a host read inside it), the phase runs eagerly for all and ``graphs[phase]`` says why.

The result records ``others_cpu_share``: the share of the machine's CPU time that other processes took while the
models were timed. Every ratio here assumes the models had the cores to themselves; beside another busy process a
converted model's many small parallel calls wait far more than dense's few large ones (``bench_busy_machine.py``:
the default model's ``best`` 0.5 conversion decodes 6× slower beside a 2-thread torch loop, the dense model 3.3×),
so ``describe`` says so (``busy_machine.busy_note``).

Choice (the issue asks for "decode at batch 1 and 8, prefill of 512"): the prefill is capped at
the models' ``max_position_embeddings`` and at the text given (a short text is repeated to fill it),
and the cache a decode starts from is ``context`` tokens, short enough that attention over it does
not hide the FFN's share of a step.
"""

from __future__ import annotations

import contextlib
import inspect
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any

import psutil
import torch
from torch import nn

from .busy_machine import busy_note
from .kernel_gain import LABEL as KERNEL_LABEL, NAME as KERNEL_DENSE, round_ratios, slower_words, sparsity_gain

PHASES = ("decode_b1", "decode_b8", "prefill")
RUNTIME = "PyTorch eager (transformers from_pretrained)"


@dataclass(frozen=True)
class SpeedProtocol:
    repeats: int = 3
    decode_steps: int = 16
    context: int = 32
    batch: int = 8
    prefill_tokens: int = 512
    cuda_graphs: bool = True
    prefill_logits: str = "last"  # the positions a prefill computes logits for (module doc); stored with each timing


def _rows(tokens: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``rows × width`` ids cut from the flat ``tokens`` (repeated when they are fewer than needed)."""
    flat = tokens.reshape(-1)
    need = rows * width
    if flat.numel() < need:
        flat = flat.repeat(-(-need // max(1, flat.numel())))
    return flat[:need].reshape(rows, width)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache(out: Any) -> Any:
    """The KV cache a forward returned (transformers ≥ 5.2x name it ``cache``; earlier ``past_key_values``)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def _cache_kwarg(model: nn.Module) -> str:
    """The forward's name for the KV cache it is handed: ``cache`` (transformers ≥ 5.2x) or ``past_key_values``. An
    unknown keyword would land in ``**kwargs`` unread, and each step would run without its cache; a forward that
    takes both (``MoelabForCausalLM``) gets the name the installed transformers uses."""
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        return "cache"
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "past_key_values" in params and not passes_on:
        return "past_key_values"
    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


#: consecutive decode steps a model takes before the next model's turn (``_decode_steps_s``)
STEPS_PER_TURN = 4


class _EagerDecode:
    """A model's cached greedy decode after an (untimed) prefill of ``context``: ``step()`` runs one step."""

    def __init__(self, model: nn.Module, context: torch.Tensor, steps: int) -> None:
        self.model, self.kwarg = model, _cache_kwarg(model)
        out = model(input_ids=context, use_cache=True)
        self.cache, self.token = _cache(out), out.logits[:, -1:].argmax(-1)

    def step(self) -> None:
        out = self.model(input_ids=self.token, **{self.kwarg: self.cache}, use_cache=True)
        self.cache, self.token = _cache(out), out.logits[:, -1:].argmax(-1)


class _StaticCacheDecode:
    """The same decode as ``_EagerDecode`` on a transformers ``StaticCache`` (``context + steps`` positions and the
    warm-up's), whose filled length is a device tensor the model reads its positions from and advances in place: after
    the eager prefill, one step (reading the token from a fixed tensor and writing the next one there) is captured as
    a CUDA graph, after ``WARMUP`` steps on a side stream, which capture needs; ``step()`` replays it. Greedy tokens, so
    each step computes what the eager loop computes. ``graph=False`` runs the same steps without a graph (how the
    static-cache steps are checked on a CPU)."""

    WARMUP = 2

    def __init__(self, model: nn.Module, context: torch.Tensor, steps: int, graph: bool = True) -> None:
        from transformers import StaticCache

        kwarg = _cache_kwarg(model)
        cache = StaticCache(config=model.config, max_cache_len=context.shape[1] + steps + self.WARMUP)
        self.token = model(input_ids=context, **{kwarg: cache}, use_cache=True).logits[:, -1:].argmax(-1)
        self.cache, self.graph = cache, None  # the steps write into the cache

        def one_step() -> None:
            logits = model(input_ids=self.token, **{kwarg: cache}, use_cache=True).logits
            self.token.copy_(logits[:, -1:].argmax(-1))

        self._one_step = one_step
        if not graph:
            return
        side = torch.cuda.Stream(context.device)
        side.wait_stream(torch.cuda.current_stream(context.device))
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP):
                one_step()
        torch.cuda.current_stream(context.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            one_step()

    def step(self) -> None:
        if self.graph is None:
            self._one_step()
        else:
            self.graph.replay()


def _decode_steps_s(models: Mapping[str, nn.Module], setups: Mapping[str, Callable[[], AbstractContextManager[Any]]],
                    context: torch.Tensor, steps: int, graphs: bool = False) -> dict[str, float]:
    """Each model's median seconds of one cached greedy step after a prefill of ``context`` (untimed), the models
    taking turns of ``STEPS_PER_TURN`` steps: a neighbour's burst on a shared host slows a few steps of each model,
    where one model's steps timed after the other's put it on one side; and a model runs consecutive steps, as in
    generation, so that what a large cache keeps of its weights from one step to the next counts (steps alternating
    one by one ran the dense model 14% slower on a 300 MiB L3). The median passes over a turn's first step.
    ``graphs``: each step a CUDA graph replay (``_StaticCacheDecode``)."""
    decode = _StaticCacheDecode if graphs else _EagerDecode
    state = {}
    for name, model in models.items():
        with setups.get(name, contextlib.nullcontext)():
            state[name] = decode(model, context, steps)
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for first in range(0, steps, STEPS_PER_TURN):
        for name in models:
            with setups.get(name, contextlib.nullcontext)():
                for _ in range(min(STEPS_PER_TURN, steps - first)):  # each step needs the previous one's token
                    _sync(context.device)
                    t0 = time.perf_counter()
                    state[name].step()
                    _sync(context.device)
                    seconds[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in seconds.items()}


def _last_logits_only(model: nn.Module) -> dict[str, int]:
    """``logits_to_keep=1`` where the model's forward takes it (module doc: a prefill as generation runs it)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def _prefill_s(model: nn.Module, ids: torch.Tensor, kwargs: Mapping[str, Any]) -> float:
    _sync(ids.device)
    t0 = time.perf_counter()
    model(input_ids=ids, use_cache=True, **kwargs)
    _sync(ids.device)
    return time.perf_counter() - t0


def max_positions(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def prefill_length(protocol: SpeedProtocol, models: Iterable[nn.Module]) -> int:
    """The tokens ``protocol``'s prefill times: its ``prefill_tokens``, within every model's positions."""
    return min([protocol.prefill_tokens, *filter(None, map(max_positions, models))])


@torch.inference_mode()
def time_phases(models: Mapping[str, nn.Module], tokens: torch.Tensor, *, reference: str = "dense",
                protocol: SpeedProtocol = SpeedProtocol(),
                setups: Mapping[str, Callable[[], AbstractContextManager[Any]]] | None = None) -> dict[str, Any]:
    """Each model's seconds per phase and its speed-up over ``reference`` (a key of ``models``), all on the device of
    the reference model. ``tokens``: real token ids (any shape) the inputs are cut from. ``setups[name]``: a context
    each of ``name``'s rounds runs in (a baseline is the dense model with its MLPs swapped in for the time of its
    rounds: ``evaluation.metrics.swapped_mlps``)."""
    if reference not in models:
        raise ValueError(f"the reference model {reference!r} is not among {sorted(models)}")
    first = models[reference]
    param = next(first.parameters())
    device, dtype = param.device, param.dtype
    limits = [n for n in (max_positions(m) for m in models.values()) if n]
    prefill = prefill_length(protocol, models.values())
    context = min([protocol.context, *(n - protocol.decode_steps for n in limits)])
    if context < 1:
        raise ValueError(f"the models hold {min(limits)} positions: too few to time {protocol.decode_steps} decode steps")
    inputs = {
        "decode_b1": _rows(tokens, 1, context).to(device),
        "decode_b8": _rows(tokens, protocol.batch, context).to(device),
        "prefill": _rows(tokens, 1, prefill).to(device),
    }

    setups = setups or {}
    prefill_kwargs = {name: _last_logits_only(model) if protocol.prefill_logits == "last" else {}
                      for name, model in models.items()}
    cpu = CpuWatch()
    graphs = {phase: _graphs_usable(models, setups, inputs[phase], protocol) for phase in ("decode_b1", "decode_b8")}
    times: dict[str, dict[str, list[float]]] = {phase: {name: [] for name in models} for phase in PHASES}
    for round_ in range(protocol.repeats + 1):  # round 0 warms up
        for phase in PHASES:  # what is compared is timed close together: decode steps in turns, prefills A B … B A
            if phase == "prefill":  # a drift over the round moves every model's mean alike
                seconds = {name: 0.0 for name in models}
                for name in [*models, *reversed(models)]:
                    with setups.get(name, contextlib.nullcontext)():
                        seconds[name] += _prefill_s(models[name], inputs[phase], prefill_kwargs[name]) / 2
            else:
                seconds = _decode_steps_s(models, setups, inputs[phase], protocol.decode_steps, graphs[phase] is True)
            if round_:
                for name, s in seconds.items():
                    times[phase][name].append(s)
    phases: dict[str, Any] = {}
    for phase in PHASES:
        median = {name: statistics.median(ts) for name, ts in times[phase].items()}
        rows = inputs[phase].shape[0] * (1 if phase != "prefill" else inputs[phase].shape[1])
        ref = times[phase][reference]
        phases[phase] = {
            "seconds": median,
            "rounds": times[phase],
            "tokens_per_s": {name: rows / s for name, s in median.items()},
            "speedup": {name: statistics.median(r / t for r, t in zip(ref, ts)) for name, ts in times[phase].items()},
            "tokens": int(inputs[phase].shape[1]) if phase == "prefill" else None,
            **({"logits": protocol.prefill_logits} if phase == "prefill" else {}),
            "batch": int(inputs[phase].shape[0]),
            **({"cuda_graphs": graphs[phase]} if graphs.get(phase) is not None else {}),
        }
    return {
        "reference": reference, "phases": phases, "protocol": {**asdict(protocol), "prefill_tokens": prefill, "context": context},
        "device": _device_name(device), "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
        "others_cpu_share": cpu.others_share(),
        "runtime": runtime_name(models.values(), device, dtype)
        + (" + CUDA graphs (decode)" if any(g is True for g in graphs.values()) else ""),
    }


class CpuWatch:
    """The CPU time every other process took since it was made, as a share of the machine's (wall time × CPUs)."""

    def __init__(self) -> None:
        self._own = psutil.Process()
        self._start = (time.perf_counter(), self._busy(), self._own_s())

    def _busy(self) -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    def _own_s(self) -> float:  # this process's threads; a child running meanwhile competes like any other process
        t = self._own.cpu_times()
        return t.user + t.system

    def others_share(self) -> float:
        wall0, busy0, own0 = self._start
        wall = time.perf_counter() - wall0
        others = (self._busy() - busy0) - (self._own_s() - own0)
        return round(min(1.0, max(0.0, others / max(1e-9, wall * (psutil.cpu_count() or 1)))), 3)


def _graphs_usable(models: Mapping[str, nn.Module], setups: Mapping[str, Callable[[], AbstractContextManager[Any]]],
                   context: torch.Tensor, protocol: SpeedProtocol) -> bool | str | None:
    """Whether a phase's decode runs as CUDA graphs: None off CUDA or when the protocol says no; True when every
    model's step can be captured (``capture_blocker``); else why not, and the phase runs eagerly for every model."""
    if not protocol.cuda_graphs or context.device.type != "cuda":
        return None
    for name, model in models.items():
        with setups.get(name, contextlib.nullcontext)():
            blocker = capture_blocker(model, context, protocol.decode_steps)
        if blocker:
            return f"{name}: {blocker}"
    return True


def capture_blocker(model: nn.Module, context: torch.Tensor, steps: int) -> str | None:
    """Why ``model``'s decode step cannot be captured as a CUDA graph (None: it can): one static-cache step run
    eagerly with torch's sync debugging set to raise, so a host read (``.tolist()``, ``.item()``, a boolean mask's
    ``nonzero``) is named here rather than met inside a capture, whose failure leaves the stream capturing."""
    previous = torch.cuda.get_sync_debug_mode()
    try:
        decode = _StaticCacheDecode(model, context, steps, graph=False)  # a forward that takes no StaticCache fails here
        torch.cuda.set_sync_debug_mode("error")
        decode.step()
    except Exception as exc:  # noqa: BLE001 - whatever stops the static-cache step is the reason to run eagerly
        return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return None


def runtime_name(models: Any, device: torch.device, dtype: torch.dtype) -> str:
    """``RUNTIME``, naming moelab's native CPU kernels where a model's MoE layers run them here (float32 on the CPU,
    the kernels built: ``runtime.moelab_native``), since the same model runs at another speed without them. A model
    exported before the prefill kernel carries the decode kernel only (its layers have ``_native_decode``)."""
    from ..runtime.moelab_native import library

    if device.type != "cpu" or dtype != torch.float32 or library() is None:
        return RUNTIME
    layers = [m for model in models for m in model.modules()]
    if any(hasattr(m, "_native_routed") for m in layers):
        return RUNTIME + " + moelab native CPU kernels"
    if any(hasattr(m, "_native_decode") for m in layers):
        return RUNTIME + " + moelab native CPU decode kernel"
    return RUNTIME


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {platform.processor() or platform.machine()}"


PHASE_NAMES = {"decode_b1": "decode, batch 1", "decode_b8": "decode, batch 8", "prefill": "prefill"}


def phase_label(phase: str, entry: Mapping[str, Any]) -> str:
    """'decode, batch 8' / 'prefill of 512 tokens': a phase as its numbers were measured. A prefill that computed
    every position's logits (``logits`` not ``"last"``, or absent: timed before the field) says so."""
    if phase == "prefill" and entry.get("tokens"):
        every = "" if entry.get("logits") == "last" else ", every position's logits"
        return f"prefill of {entry['tokens']} tokens{every}"
    return PHASE_NAMES.get(phase, phase)


def describe(speed: Mapping[str, Any], name: str | None = None) -> list[str]:
    """Text lines of a ``time_phases`` result: each timed model's (or only ``name``'s) time per phase beside the
    reference's, its speed-up with the spread of the rounds' ratios, and which phases it is slower in (with the
    number)."""
    ref = speed["reference"]
    p = speed["protocol"]
    first = next(iter(speed["phases"].values()))
    names = [name] if name else [n for n in first["seconds"] if n != ref]
    lines = [f"speed, whole model against {ref} ({speed['runtime']}; {speed['device']}, {speed['dtype']}, "
             f"{speed['threads']} threads; median of {p['repeats']} interleaved rounds)"]
    if (busy := busy_note(speed)) is not None:
        lines.append(f"  {busy}")
    if speed.get("old_runtime"):
        lines.append(f"  {speed['old_runtime']}")
    for model in names:
        for phase, entry in speed["phases"].items():
            unit = "per step" if phase != "prefill" else ""
            ratio = entry["speedup"][model]
            ratios = round_ratios(entry, model, ref)
            spread = f" (rounds {min(ratios):.2f}–{max(ratios):.2f})" if len(ratios) > 1 else ""
            lines.append(f"  {phase_label(phase, entry):<24} {ref} {entry['seconds'][ref] * 1e3:8.1f} ms {unit:<8} "
                         f"{KERNEL_LABEL if model == KERNEL_DENSE else model:<9} {entry['seconds'][model] * 1e3:8.1f} ms  {ratio:5.2f}× {ref}"
                         + spread + (f"  ({words})" if (words := slower_words(ratio, ratios)) else ""))
    if (gain := sparsity_gain(speed)) and (name is None or name == "converted"):
        lines.append("  converted over the dense model in moelab's kernels (the sparsity's own gain): "
                     + ", ".join(f"{PHASE_NAMES.get(p, p)} {g:.2f}×" for p, g in gain.items()))
    elif speed.get("kernel_dense_note"):
        lines.append(f"  the dense model in moelab's kernels: not timed ({speed['kernel_dense_note']})")
    return lines
