"""Evaluation of dense vs converted models in one run, on held-out text.

* Perplexity on non-overlapping windows of held-out built-in text: the ``heldout`` split of the
  built-in sets never shares a source file, play, conversation or problem with calibration text.
* Per-layer FFN reconstruction error: relative L2 ``‖F_moe(x) − F(x)‖ / ‖F(x)‖`` of the MLP outputs,
  each layer fed the dense model's own MLP inputs on held-out tokens.
* Routing load per layer × expert, its coefficient of variation (MI Eq. 7:
  ``CV = σ/μ`` of the per-expert token counts, population σ), and per-sample counts.
* Speed: tokens/s of each variant's forward pass, measured in the same run.

Variants are applied by swapping each decoder layer's MLP module in the loaded dense model and
swapping it back afterwards, so dense and every variant see the same weights and tokens.
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ..data.calibration import load_calibration
from ..models import ModelAdapter
from ..progress import NO_PROGRESS, Progress
from ..runtime.modeling_moelab import layer_ffns
from ..runtime.moelab_linear import projections_in_kernels


def heldout_windows(
    tokenizer: Any, data_dir: Path | None, seq_len: int = 256, n_windows: int = 32,
    source: str = "builtin:mixed", seed: int = 0,
) -> torch.Tensor:
    """``[n, seq_len]`` token windows cut without overlap from the held-out split of ``source``.

    Samples are joined with the EOS token into one stream, so windows span sample boundaries
    as in standard perplexity evaluation; fewer windows are returned if the text runs out.
    """
    cset = load_calibration(source, samples=max(n_windows * 2, 12), seed=seed, data_dir=data_dir, split="heldout")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids = tokenizer([s.text for s in cset.samples], add_special_tokens=False)["input_ids"]
    stream = np.concatenate([np.append(np.asarray(x, dtype=np.int64), eos) for x in ids])
    n = min(n_windows, len(stream) // seq_len)
    if n == 0:
        raise ValueError(f"held-out text of {source} is shorter than one {seq_len}-token window")
    return torch.from_numpy(stream[: n * seq_len].reshape(n, seq_len))


@contextmanager
def swapped_mlps(adapter: ModelAdapter, modules: dict[int, nn.Module] | None) -> Iterator[None]:
    """Temporarily replace layer MLPs by ``modules`` (None or none: the dense model as loaded). A variant swapped in
    runs as moelab's runtime runs a conversion: its projections outside the FFNs in the native decode call too
    (``moelab_linear``), so that a baseline timed this way and a converted model differ in their FFNs alone."""
    originals = {}
    try:
        with ExitStack() as stack:
            for i, mod in (modules or {}).items():
                block = adapter.layers[i].block
                originals[i] = block.mlp
                block.mlp = mod
            if originals:
                stack.enter_context(projections_in_kernels(adapter.model, layer_ffns(adapter.model)))
            yield
    finally:
        for i, mod in originals.items():
            adapter.layers[i].block.mlp = mod


#: Most tokens in one forward of an evaluation (perplexity, reconstruction, multiple choice): a batch of long
#: windows holds fewer of them, so one step stays a few seconds and a cancel is seen between steps
#: (``progress.update``) instead of after minutes (8 windows × 32768 tokens sat 220 s in one forward).
BATCH_TOKENS = 2048


def window_batch(batch_size: int, seq_len: int, max_tokens: int = BATCH_TOKENS) -> int:
    """Windows per forward: ``batch_size``, fewer when that many ``seq_len`` windows exceed ``max_tokens`` (≥ 1)."""
    return max(1, min(batch_size, max_tokens // max(1, seq_len)))


def next_token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq - 1]``: ``logsumexp(z_t) − z_t[ids_{t+1}]``, each position's NLL of the token that follows.

    The cross-entropy by its definition, on the logits' own rows. ``F.cross_entropy`` over the class dim of a
    transposed ``[batch, vocab, seq]`` view walked the 49k-wide vocabulary with a stride: 0.65 s per 2048 tokens
    on 2 cores (this takes 0.24 s), and on the default model's held-out text its float32 mean NLL ran 1.2e-4
    below float64's (this: 4e-8), so every perplexity read 0.012% low."""
    z = logits[:, :-1].float()
    return z.logsumexp(-1) - z.gather(-1, ids[:, 1:, None]).squeeze(-1)


@torch.inference_mode()
def window_nll(
    model: nn.Module, windows: torch.Tensor, batch_size: int = 8, progress: Progress = NO_PROGRESS,
    stage: str = "perplexity", before_batch: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, float]:
    """(mean next-token NLL of each window [n_windows], tokens/s). Every window has the same length, so the
    perplexity is ``exp(mean of these)`` and the windows are the units a bootstrap resamples (``bootstrap_ci``).

    ``before_batch(first_window_index)`` runs before each batch (routing recorders use it).
    """
    device = next(model.parameters()).device
    out = np.zeros(len(windows), dtype=np.float64)
    t0 = time.perf_counter()
    batch_size = window_batch(batch_size, windows.shape[-1])
    n_batches = math.ceil(len(windows) / batch_size)
    for b in range(n_batches):
        if before_batch is not None:
            before_batch(b * batch_size)
        x = windows[b * batch_size : (b + 1) * batch_size].to(device)
        loss = next_token_nll(model(input_ids=x, use_cache=False).logits, x)
        out[b * batch_size : b * batch_size + len(x)] = loss.double().mean(dim=1).cpu().numpy()
        progress.update(stage, b + 1, n_batches)
    elapsed = time.perf_counter() - t0
    return out, windows.numel() / elapsed


def perplexity(
    model: nn.Module, windows: torch.Tensor, batch_size: int = 8, progress: Progress = NO_PROGRESS,
    stage: str = "perplexity", before_batch: Callable[[int], None] | None = None,
) -> tuple[float, float]:
    """(perplexity, tokens/s): exp of the mean next-token NLL over every predicted position of every window."""
    nll, tps = window_nll(model, windows, batch_size, progress, stage, before_batch)
    return math.exp(float(nll.mean())), tps


#: resamples and coverage of the perplexity intervals
BOOTSTRAP_RESAMPLES, CI_LEVEL = 2000, 0.95


def bootstrap_ci(nll: Sequence[float], baseline: Sequence[float] | None = None, resamples: int = BOOTSTRAP_RESAMPLES,
                 level: float = CI_LEVEL, seed: int = 0) -> list[float] | None:
    """Percentile bootstrap over windows of ``exp(mean NLL)`` (a perplexity), or with ``baseline`` (the dense model's
    NLL on the same windows) of ``exp(mean NLL − mean NLL_baseline)``, the perplexity ratio, resampling the windows
    in pairs so the text's own difficulty cancels. ``[low, high]``; None with fewer than 2 windows.

    Why windows: tokens inside a window are not independent draws (one text's difficulty moves them together), the
    windows are the units the held-out text was cut into; a seeded resample makes the interval reproducible."""
    x = np.asarray(nll, dtype=np.float64)
    if x.size < 2 or (baseline is not None and len(baseline) != x.size):
        return None
    diff = x - np.asarray(baseline, dtype=np.float64) if baseline is not None else x
    idx = np.random.default_rng(seed).integers(0, x.size, size=(resamples, x.size))
    means = diff[idx].mean(axis=1)
    tail = (1 - level) / 2 * 100
    return [float(np.exp(v)) for v in np.percentile(means, [tail, 100 - tail])]


@torch.inference_mode()
def reconstruction_errors(
    adapter: ModelAdapter, variants: dict[str, dict[int, nn.Module]], windows: torch.Tensor, batch_size: int = 8,
    progress: Progress = NO_PROGRESS,
) -> dict[str, list[float]]:
    """Per variant, per layer: relative L2 error of its replacement MLPs on the dense model's MLP
    inputs. One dense pass serves every variant, since they all see the same inputs."""
    L = adapter.n_layers
    err = {name: torch.zeros(L, dtype=torch.float64) for name in variants}
    ref = torch.zeros(L, dtype=torch.float64)
    hooks = []
    for i, lay in enumerate(adapter.layers):

        def hook(_m, args, out, i=i):
            dense = out.float()
            ref[i] += float(dense.pow(2).sum())
            for name, modules in variants.items():
                if i in modules:
                    err[name][i] += float((modules[i](args[0]).float() - dense).pow(2).sum())

        hooks.append(lay.mlp.register_forward_hook(hook))
    batch_size = window_batch(batch_size, windows.shape[-1])
    n_batches = math.ceil(len(windows) / batch_size)
    try:
        for b in range(n_batches):
            adapter.decoder()(input_ids=windows[b * batch_size : (b + 1) * batch_size].to(adapter.device), use_cache=False)
            progress.update("reconstruction error", b + 1, n_batches)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for name, modules in variants.items():
        rel = (err[name] / ref.clamp_min(1e-30)).sqrt().tolist()
        out[name] = [rel[i] if i in modules else 0.0 for i in range(L)]
    return out


def load_cv(counts: np.ndarray) -> float:
    """MI Eq. 7: σ/μ of per-expert token counts (population σ); NaN with no routed expert."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.size == 0 or counts.sum() == 0:
        return float("nan")
    return float(counts.std() / counts.mean())


def _is_moe(module: nn.Module) -> bool:
    """Any routed module of ``modeling_moelab`` (MoeFFN, the MIDAS and hierarchical layers), from
    the engine *or* from an exported model's own copy of the file (loaded with
    trust_remote_code as a different class object), so duck-typed, not an isinstance check."""
    return all(hasattr(module, a) for a in ("recorder", "top_k")) and routed_count(module) is not None \
        and not isinstance(module, torch.Tensor)


def routed_count(module: nn.Module) -> int | None:
    """Routed experts of a layer module; exports written before the method registry bundle a
    runtime that called this ``n_experts``."""
    return getattr(module, "n_routed", getattr(module, "n_experts", None))


@dataclass
class RoutingRecorder:
    """Per layer × expert × window counts of routed-expert selections (via MoeFFN.recorder)."""

    n_windows: int
    counts: dict[int, np.ndarray] = field(default_factory=dict)
    _offset: int = 0

    def attach(self, modules: dict[int, nn.Module]) -> None:
        for i, mod in modules.items():
            if _is_moe(mod) and mod.top_k > 0:
                self.counts[i] = np.zeros((self.n_windows, routed_count(mod)), dtype=np.int64)
                mod.recorder = self._recorder(i, routed_count(mod))

    def _recorder(self, layer: int, n_experts: int):
        def record(idx: torch.Tensor) -> None:
            # idx: [batch, seq, top_k] expert ids -> per-window histograms, no loop over tokens
            b = idx.shape[0]
            flat = idx.reshape(b, -1).cpu()
            rows = torch.arange(b).repeat_interleave(flat.shape[1])
            hist = torch.zeros(b * n_experts, dtype=torch.int64).index_add_(
                0, rows * n_experts + flat.reshape(-1), torch.ones(flat.numel(), dtype=torch.int64)
            )
            self.counts[layer][self._offset : self._offset + b] += hist.view(b, n_experts).numpy()

        return record

    def set_offset(self, first_window: int) -> None:
        self._offset = first_window

    def detach(self, modules: dict[int, nn.Module]) -> None:
        for mod in modules.values():
            if _is_moe(mod):
                mod.recorder = None

    def summary(self) -> dict[str, Any]:
        per_layer = {i: c.sum(0) for i, c in self.counts.items()}
        return {
            "load": {str(i): c.tolist() for i, c in per_layer.items()},
            "load_cv": {str(i): load_cv(c) for i, c in per_layer.items()},
        }


@torch.inference_mode()
def experts_touched(model: nn.Module, windows: torch.Tensor, batch: int = 8) -> dict[int, float]:
    """Per routed layer of ``model``, the mean number of distinct routed experts ``batch`` sequences select at one
    position: what a decode step at batch ``batch`` reads of the layer's routed weights. ``windows``: ``[n, L]``
    token ids, real text; its first ``batch`` rows run. Real routing repeats itself across sequences (on the default
    model, half as many experts as uniform routing would touch at 8 sequences), which ``core.speed_prediction`` counts
    when it is given this."""
    routed = routed_modules(model)
    picks: dict[int, torch.Tensor] = {}

    def keep(layer: int) -> Callable[[torch.Tensor], None]:
        def record(idx: torch.Tensor) -> None:
            picks[layer] = idx.detach().cpu()  # [batch, seq, top_k]
        return record

    for i, mod in routed.items():
        if mod.top_k > 0:
            mod.recorder = keep(i)
    try:
        model(input_ids=windows[:batch].to(next(model.parameters()).device))
    finally:
        for mod in routed.values():
            mod.recorder = None
    out = {}
    for i, idx in picks.items():
        hit = torch.zeros(*idx.shape[:2], routed_count(routed[i]), dtype=torch.bool).scatter_(2, idx.long(), True)
        out[i] = float(hit.any(0).sum(-1).float().mean())  # distinct experts per position, over the batch's rows
    return out


def routed_modules(model: nn.Module) -> dict[int, nn.Module]:
    """Layer index -> routed module of a whole converted model (empty for a dense model)."""
    get = getattr(model, "moe_modules", None)
    return {i: m for i, m in get().items() if _is_moe(m)} if callable(get) else {}


def _score(
    model: nn.Module, tokenizer: Any, routed: dict[int, nn.Module], windows: torch.Tensor, batch_size: int,
    progress: Progress, stage: str,
) -> dict[str, Any]:
    """Perplexity, tokens/s and routing load (of ``routed``) of one model."""
    recorder = RoutingRecorder(len(windows))
    recorder.attach(routed)
    try:
        nll, tps = window_nll(model, windows, batch_size, progress, stage, before_batch=recorder.set_offset)
    finally:
        recorder.detach(routed)
    entry: dict[str, Any] = {"perplexity": math.exp(float(nll.mean())), "perplexity_ci": bootstrap_ci(nll),
                             "window_nll": nll.tolist(), "tokens_per_s": tps}
    if recorder.counts:
        entry["routing"] = recorder.summary()
    return entry


def _add_ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each variant's perplexity over the dense model's, with its paired bootstrap interval (``bootstrap_ci``) when
    both have per-window NLLs (a dense entry reused from before they were kept has none: no interval)."""
    dense = results.get("dense", {})
    if dense.get("perplexity"):
        for entry in results.values():
            entry["perplexity_ratio"] = entry["perplexity"] / dense["perplexity"]
            if entry is not dense and entry.get("window_nll") and dense.get("window_nll"):
                entry["perplexity_ratio_ci"] = bootstrap_ci(entry["window_nll"], dense["window_nll"])
    return results


def evaluate_variants(
    adapter: ModelAdapter, variants: dict[str, dict[int, nn.Module] | None], windows: torch.Tensor,
    batch_size: int = 8, reconstruction: bool = True, progress: Progress = NO_PROGRESS,
    known: dict[str, dict[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Perplexity, tokens/s, reconstruction error and routing load of every variant, in one run (downstream
    accuracy: ``evaluation.harness``). A variant is a set of MLP
    replacements swapped into the loaded dense model (None: the dense model itself). ``known``:
    entries already scored on these windows (``reference_scores``), not run again."""
    results: dict[str, dict[str, Any]] = dict(known or {})
    for name, modules in variants.items():
        if name in results:
            continue
        with swapped_mlps(adapter, modules):
            results[name] = _score(
                adapter.model, adapter.tokenizer, dict(modules or {}), windows, batch_size, progress,
                f"evaluate {name}",
            )
    replaced = {name: modules for name, modules in variants.items() if modules}
    if reconstruction and replaced:
        for name, errors in reconstruction_errors(adapter, replaced, windows, batch_size, progress).items():
            results[name]["reconstruction_error"] = errors
    return _add_ratios(results)


def evaluate_models(
    models: dict[str, nn.Module], tokenizer: Any, windows: torch.Tensor, batch_size: int = 8,
    progress: Progress = NO_PROGRESS, known: dict[str, dict[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Like ``evaluate_variants`` for whole models that cannot be swapped into one dense model
    (Dense2MoE drops layers, MIDAS replaces every FFN by low-rank experts, hierarchical starts
    from an MoE): the same windows, perplexity, speed and routing for each."""
    results: dict[str, dict[str, Any]] = dict(known or {})
    for name, model in models.items():
        if name not in results:
            results[name] = _score(model, tokenizer, routed_modules(model), windows, batch_size, progress,
                                   f"evaluate {name}")
    return _add_ratios(results)


@torch.inference_mode()
def load_cv_by_source(
    model: nn.Module, tokenizer: Any, sources: list[str], data_dir: Path | None, *, n_windows: int = 8,
    seq_len: int = 256, batch_size: int = 8, progress: Progress = NO_PROGRESS,
) -> dict[str, dict[str, Any]]:
    """MI Eq. 7 per layer and per evaluation set: routing load CV on each source's held-out text."""
    routed = routed_modules(model)
    out: dict[str, dict[str, Any]] = {}
    for source in sources:
        windows = heldout_windows(tokenizer, data_dir, seq_len=seq_len, n_windows=n_windows, source=source)
        entry = _score(model, tokenizer, routed, windows, batch_size, progress, f"routing on {source}")
        out[source] = {"windows": int(len(windows)), **entry.get("routing", {})}
    return out


# --------------------------------------------------------------------------- multiple choice

#: BIG-bench tasks on which a 135M model scores clearly above chance (the brief).
MC_TASKS = ("goal_step_wikihow/goal_inference", "general_knowledge", "code_line_description")


@dataclass
class ChoiceItem:
    task: str
    prompt: str
    choices: list[str]
    answer: int  # index of the highest-scoring choice


def bigbench_choice_items(data_dir: Path, tasks: tuple[str, ...] = MC_TASKS, per_task: int = 50) -> list[ChoiceItem]:
    """Held-out multiple-choice examples (``target_scores``) of installed BIG-bench tasks."""
    from ..data.builtin import bigbench_examples, bigbench_task, bigbench_task_names, render_bigbench_example

    installed = set(bigbench_task_names(data_dir))
    items: list[ChoiceItem] = []
    for name in tasks:
        if name not in installed:
            continue
        task = bigbench_task(name, data_dir)
        for ex in bigbench_examples(name, "heldout", data_dir)[:per_task]:
            scores = ex.get("target_scores")
            if not isinstance(scores, dict) or len(scores) < 2:
                continue
            choices = [str(c) for c in scores]
            values = [float(v) for v in scores.values()]
            items.append(ChoiceItem(name, render_bigbench_example(task, ex, with_target=False), choices, int(np.argmax(values))))
    return items


@torch.inference_mode()
def choice_loglikelihoods(model: nn.Module, tokenizer: Any, items: list[ChoiceItem], batch_size: int = 16,
                          progress: Progress = NO_PROGRESS, stage: str = "multiple choice") -> tuple[np.ndarray, np.ndarray]:
    """``(sums, counts)``, each ``[items, most choices]``: the summed log-prob of each choice's tokens
    (``" " + choice``) after the prompt, and how many tokens that is (-inf / 0 where an item has fewer choices)."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    pairs = []  # (item index, choice index, token ids, number of prompt tokens)
    for i, item in enumerate(items):
        prompt = tokenizer(item.prompt, add_special_tokens=False)["input_ids"]
        for j, choice in enumerate(item.choices):
            cont = tokenizer(" " + choice, add_special_tokens=False)["input_ids"]
            pairs.append((i, j, (prompt + cont)[-1024:], min(len(prompt), 1024 - len(cont))))
    sums = np.full((len(items), max((len(it.choices) for it in items), default=0)), -np.inf)
    counts = np.zeros(sums.shape, dtype=np.int64)
    # batches of at most batch_size pairs and BATCH_TOKENS padded tokens (one long pair alone), in order
    chunks: list[list[Any]] = []
    for pair in pairs:
        last = chunks[-1] if chunks else None
        if last is not None and len(last) < batch_size and \
                (len(last) + 1) * max(len(pair[2]), *(len(p[2]) for p in last)) <= BATCH_TOKENS:
            last.append(pair)
        else:
            chunks.append([pair])
    done = 0
    for chunk in chunks:
        width = max(len(p[2]) for p in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        target = torch.zeros(len(chunk), width, dtype=torch.bool)  # positions that score a choice token
        for r, (_, _, seq, n_prompt) in enumerate(chunk):
            ids[r, : len(seq)] = torch.tensor(seq)
            mask[r, : len(seq)] = 1
            target[r, n_prompt : len(seq)] = True
        ids = ids.to(device)
        tok_lp = -next_token_nll(model(input_ids=ids, attention_mask=mask.to(device), use_cache=False).logits, ids).cpu()
        sel = target[:, 1:]
        sum_lp, n_tok = (tok_lp.double() * sel).sum(1), sel.sum(1)
        for r, (i, j, _, _) in enumerate(chunk):
            sums[i, j], counts[i, j] = float(sum_lp[r]), int(n_tok[r])
        done += len(chunk)
        progress.update(stage, done, len(pairs))  # choices scored
    return sums, counts
