"""End-to-end jobs: profile, convert, evaluate. The CLI and the job workers call these.

Each job reads its inputs from artifact directories, reports progress through ``Progress``
(which may cancel it), and publishes its result as a new artifact atomically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence


from .atomic import write_json_atomic
from .data.calibration import CalibrationSet, load_calibration
from .data.builtin import bigbench_installed
from .evaluation import reference_scores
from .memory import peak_rss_mib, reset_peak_rss
from .core.speed_prediction import find_table, predicted_summary
from .limits import conversion_config, eval_tokens_problem, seq_len_problem
from .evaluation.harness import TaskRequest, load_tasks, run_tasks
from .evaluation.kernel_dense import kernel_dense_mlps
from .evaluation.kernel_gain import NAME as KERNEL_DENSE
from .evaluation.speed import SpeedProtocol, time_phases
from .evaluation.metrics import MC_TASKS, evaluate_models, evaluate_variants, heldout_windows, swapped_mlps
from .methods import ConversionInputs, Method, check_conversion, get_method, method_of
from .models import ModelAdapter, adapt, load_model
from .runtime.export import CONVERSION_FILE, export_model, load_exported, runtime_is_current
from .runtime.param_count import ffn_flops_fraction
from .profiling.store import ProfileNotFound, StoredProfile, write_profile
from .profiling.profiler import ProfileSettings, profile_model
from .progress import NO_PROGRESS, Cancelled, Progress

EVALUATION_FILE = "evaluation.json"

log = logging.getLogger("moelab.engine")

#: How a job gets its model: ``load_model`` by default; a worker passes its model cache.
ModelLoader = Callable[..., ModelAdapter]


def run_profile(
    model: str, calib: str | CalibrationSet, out: Path, settings: ProfileSettings, *, samples: int | None, data_dir: Path,
    device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False, progress: Progress = NO_PROGRESS,
    loader: ModelLoader = load_model, max_memory: int | str | None = None, time_kernels: bool = True,
) -> StoredProfile:
    """Profile ``model`` over ``calib`` and publish the profile at ``out``. ``calib``: a set spec, read
    here (``samples`` drawn with ``settings.seed``), or a ``CalibrationSet`` already read so.
    ``time_kernels``: then time this machine's kernels for the model, once (``measure_kernel_times``).

    ``max_memory`` (bytes or "2GiB"): when the model's weights exceed it, the pass streams one
    decoder layer at a time (``streaming.profile``); a budget below one layer fails here,
    before the calibration set or any weight is read.
    """
    t0 = time.perf_counter()
    reset_peak_rss()
    settings.validate()
    plan = None
    if max_memory is not None:
        from .sizes import parse_size
        from .streaming.plan import plan_streaming

        plan = plan_streaming(model, parse_size(max_memory), data_dir=data_dir, device=device, dtype=dtype,
                              trust_remote_code=trust_remote_code)
    cset = calib if isinstance(calib, CalibrationSet) else load_calibration(calib, samples=samples, seed=settings.seed,
                                                                             data_dir=data_dir)
    if plan is not None and plan.stream:
        from .streaming.profile import profile_streamed, remove_scratch

        result = profile_streamed(plan, cset, settings, progress, scratch_near=Path(out).parent)
        load_s = 0.0
    else:
        adapter = loader(model, data_dir=data_dir, device=device, dtype=dtype, trust_remote_code=trust_remote_code, progress=progress)
        result = profile_model(adapter, cset, settings, progress)
        load_s = adapter.load_seconds
    try:
        result.timings.update(load_model_s=load_s, total_s=time.perf_counter() - t0, peak_rss_mib=peak_rss_mib())
        if plan is not None:
            result.timings["max_memory_bytes"] = float(plan.max_memory)
        write_profile(result, cset, out)
    finally:
        if plan is not None and plan.stream:
            remove_scratch(result)
    profile = StoredProfile.open(out)
    if time_kernels:
        if plan is not None and plan.stream:  # a streamed model does not fit whole: its FFN layers alone are timed
            measure_ffn_kernel_times(plan, profile.manifest["model"], data_dir, progress)
        else:
            measure_kernel_times(adapter, profile.manifest["model"], data_dir, progress)
    return profile


def measure_kernel_times(adapter: ModelAdapter, model: dict[str, Any], data_dir: Path, progress: Progress) -> None:
    """This machine's kernel times for the profiled model (``evaluation.speed_table``), measured once and cached, so
    the designer and ``moelab convert`` can predict a plan's speed. A failure here is logged, never the profile's."""
    from .evaluation.speed_table import ensure_table, model_info

    info = model_info(adapter, model.get("source"))
    with _kernel_timing(info["source"], progress):
        windows = heldout_windows(adapter.tokenizer, data_dir, seq_len=128, n_windows=4)
        ensure_table(adapter.model.eval(), windows, info, data_dir)


def measure_ffn_kernel_times(plan: Any, model: dict[str, Any], data_dir: Path, progress: Progress) -> None:
    """``measure_kernel_times`` for a model that streams (``plan``: its ``StreamPlan``): its FFN layers only, at its
    shape with random weights, within the plan's memory budget (``speed_table.ensure_ffn_table``), so that the speed
    guard of a streamed conversion has them."""
    from .evaluation.speed_table import ensure_ffn_table, model_info

    info = model_info(plan.adapter, model.get("source"))
    with _kernel_timing(info["source"], progress, "FFN kernels"):
        if ensure_ffn_table(plan.adapter.model, info, (plan.device, plan.dtype), data_dir, plan.max_memory) is None:
            log.warning("the FFN kernel timing of %s needs more than --max-memory; a streamed --recipe best of it runs "
                        "without the speed guard", info["source"])


@contextlib.contextmanager
def _kernel_timing(source: Any, progress: Progress, what: str = "kernels") -> Iterator[None]:
    """A progress step around a kernel timing whose failure is logged, never the job's (a prediction's basis is a
    help; the profile is already published)."""
    try:
        with progress.step(f"time this machine's {what} (once per model)"):
            yield
    except Cancelled:
        raise
    except Exception:  # noqa: BLE001
        log.warning("kernel timing of %s failed; the designer will not predict its speed", source, exc_info=True)


def run_conversion(
    profile_dir: Path | None, params: Any, out: Path, *, data_dir: Path, device: str = "auto",
    trust_remote_code: bool = False, progress: Progress = NO_PROGRESS, loader: ModelLoader = load_model,
    extra_profiles: Sequence[Path] = (), model: str | None = None, calib: str | None = None,
    map_layers: Callable[..., Any] | None = None, max_memory: int | str | None = None, time_kernels: bool = True,
) -> dict[str, Any]:
    """Convert with any registered method (``methods.REGISTRY``) and export the result; returns the record.
    ``map_layers``: where a partition method's per-layer work runs (``core.slicing.LayerMap``).
    ``max_memory`` (bytes or "2GiB"): when the dense model's weights exceed it, a partition method
    converts one decoder layer at a time straight into the export (``streaming.conversion``;
    its layers are not shared with other workers then, as each would load the whole model); a
    budget below one layer, or a method or recipe that needs the whole model, fails before any work.
    ``time_kernels``: where the plan is guarded by this machine's kernel times (``speed_guard="machine"``) and
    none are cached for the model (a profile from before the kernels changed, or one made with the timing off),
    time them first (``measure_kernel_times``), so that the guard does not give way to an unguarded plan.

    ``profile_dir``: the dense model's profile (MIDAS: the first calibration set's);
    ``extra_profiles``: MIDAS's other calibration sets; ``model`` + ``calib``: methods that read an
    existing MoE model (hierarchical), which profile its experts themselves.
    The loaded dense model is converted in place: a cached model must not be reused after this.
    """
    t0 = time.perf_counter()
    method = get_method(method_of(params))
    profile_paths = [p for p in [profile_dir, *extra_profiles] if p is not None]
    profiles = check_conversion(params, profile_paths, model, calib)  # before a model is loaded
    reset_peak_rss()
    budget: dict[str, float] = {}
    guarded = time_kernels and getattr(params, "speed_guard", "none") == "machine"

    def complete(record: dict[str, Any], moe: Any, tokenizer: Any = None) -> None:
        if profiles:
            record["summary"].setdefault(
                "ffn_flops_fraction", ffn_flops_fraction(moe, profiles[0].manifest["model"]["n_ffn_parameters"]))
            layers = getattr(getattr(moe, "config", None), "moe_layers", None)
            if layers:  # seconds beside multiply-adds: from the kernel times the profile job measured on this machine
                import torch

                from .evaluation.speed_table import machine_name

                here = machine_name(next(moe.parameters()).device)
                table = find_table(data_dir, profiles[0].manifest["model"].get("source"), here, torch.get_num_threads())
                if table is not None and tokenizer is not None:
                    layers = _layers_with_touched(moe, tokenizer, layers, data_dir)
                record["summary"]["predicted_speed"] = predicted_summary(table, layers, here)
            record.update(profile=str(Path(profile_paths[0]).resolve()), model=profiles[0].manifest["model"],
                          calibration=profiles[0].manifest["calibration"])
        record["timings"].update(total_s=time.perf_counter() - t0, peak_rss_mib=peak_rss_mib(), **budget)

    if max_memory is not None and profiles:
        from .streaming.conversion import convert_streamed, plan_conversion

        plan = plan_conversion(method, params, profiles[0], max_memory, data_dir=data_dir, device=device,
                               trust_remote_code=trust_remote_code)
        budget["max_memory_bytes"] = float(plan.max_memory)
        if plan.stream:
            if guarded:  # as load_dense does below
                measure_ffn_kernel_times(plan, profiles[0].manifest["model"], data_dir, progress)
            return convert_streamed(plan, profiles[0], params, method, out, data_dir=data_dir, progress=progress,
                                    complete=complete)
    inputs = ConversionInputs(profiles=profiles, data_dir=data_dir, device=device, model=model, calib=calib,
                              map_layers=map_layers)
    if profiles:
        source = profiles[0].manifest["model"]["source"]

        def load_dense() -> ModelAdapter:
            adapter = loader(source, data_dir=data_dir, device=device, dtype="float32",
                             trust_remote_code=trust_remote_code, progress=progress)
            if guarded:
                measure_kernel_times(adapter, profiles[0].manifest["model"], data_dir, progress)
            return adapter

        inputs.load_dense = load_dense
    moe, tokenizer, record = method.build(inputs, params, progress)
    complete(record, moe, tokenizer)
    progress.update("export", 0, 1)
    partition = record.pop("partition", None)
    export_model(moe, out, tokenizer, record, partition=partition)
    progress.update("export", 1, 1)
    return record


def _layers_with_touched(moe: Any, tokenizer: Any, layers: list[dict[str, Any]], data_dir: Path) -> list[dict[str, Any]]:
    """``layers`` with the experts a batch touches on real text (``speed_table.layers_with_touched``), or as they are
    where that cannot be measured: the prediction then takes routing as uniform, and says so."""
    from .evaluation.speed_table import layers_with_touched

    try:
        return layers_with_touched(moe, tokenizer, list(layers), data_dir)
    except Exception:  # noqa: BLE001 - a prediction's refinement; the conversion itself is done
        log.warning("could not measure the experts a batch touches; the speed prediction takes routing as uniform",
                    exc_info=True)
        return list(layers)


def read_conversion(conversion_dir: Path) -> dict[str, Any]:
    path = Path(conversion_dir) / CONVERSION_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{conversion_dir}: not a converted model (no {CONVERSION_FILE}); run `moelab convert` first")
    return json.loads(path.read_text())


def run_evaluation(
    conversion_dir: Path, *, data_dir: Path, n_windows: int = 32, seq_len: int = 256, baselines: bool = True,
    source: str = "builtin:mixed", device: str = "auto", progress: Progress = NO_PROGRESS, write: bool = True,
    mc_per_task: int = 50, loader: ModelLoader = load_model, max_tokens: int | None = None,
    load_converted: Callable[[Path], Any] = load_exported, tasks: TaskRequest | None = None,
    speed: SpeedProtocol | None = SpeedProtocol(),
) -> dict[str, Any]:
    """Perplexity dense vs converted (vs the method's baselines, e.g. AbsTopK for EW/CMoE, and TEAL at the
    conversion's cost wherever the method has baselines) in one run, plus reconstruction and routing; BIG-bench multiple-choice
    accuracy too (lm-eval task ``moelab_bigbench_mc``, ``mc_per_task`` items of each of its tasks) when that set is installed
    (``moelab data install bigbench``); plus the method's own extra numbers (MIDAS: load CV per set).

    ``max_tokens``: the most held-out tokens (``n_windows × seq_len``) this run may read (the caller's
    MOELAB_MAX_EVAL_TOKENS); a ``seq_len`` beyond the model's ``max_position_embeddings`` is refused too.
    ``loader`` / ``load_converted``: where the dense and the converted model come from (a worker passes its
    cache's, which keep them loaded between jobs; the evaluation leaves both as it found them).
    ``tasks``: lm-evaluation-harness tasks scored on every model evaluated (``evaluation.harness``); their data
    is loaded before any model, so an unreachable task fails first.
    ``speed``: the whole converted model timed against the dense one in the same process (``evaluation.speed``: decode
    at batch 1 and 8, prefill), on the held-out text; None skips it."""
    t0 = time.perf_counter()
    record = read_conversion(conversion_dir)
    check_evaluation_limits(conversion_dir, n_windows=n_windows, seq_len=seq_len, max_tokens=max_tokens)
    if tasks is not None and tasks.data_dir is None:
        tasks = dataclasses.replace(tasks, data_dir=Path(data_dir))
    loaded_tasks = []  # (request, its tasks): the user's, and BIG-bench's multiple choice when installed
    for request in (tasks, _bigbench_request(data_dir, mc_per_task)):
        if request is not None:
            with progress.step("load tasks"):
                loaded_tasks.append((request, load_tasks(request)))
    method = get_method(method_of(record["params"]))
    with progress.step("load converted model"):  # stages all the way: a watcher never sees 'starting' for a minute
        converted = load_converted(conversion_dir)
    timings: dict[str, float] = {}
    extra: dict[str, Any] = {}
    notes: dict[str, str] = {}
    if method.baselines is not None:  # layers swap into the dense model: baselines in the same pass
        adapter = loader(record["model"]["source"], data_dir=data_dir, device=device, dtype="float32", progress=progress)
        tokenizer, dense = adapter.tokenizer, adapter.model
        variants: dict[str, Any] = {"dense": None, "converted": converted.to(adapter.device).moe_modules()}
        if baselines:
            t1 = time.perf_counter()
            with progress.step("build baselines"):  # their clustering reports as 'baselines: cluster experts i/L'
                variants.update(method.baselines(adapter, record, progress.within("baselines"), data_dir))
            t2 = time.perf_counter()
            with progress.step("build baselines"):  # TEAL at the conversion's cost: 'baselines: teal: thresholds i/L'
                teal, teal_info = _teal_baseline(adapter, record, converted, progress.within("baselines"), data_dir)
            timings["baselines_build_s"], timings["teal_build_s"] = time.perf_counter() - t1, time.perf_counter() - t2
            notes["teal"] = teal_info["note"]
            if teal:
                variants["teal"] = teal
        with progress.step("read held-out text"):
            windows = heldout_windows(tokenizer, data_dir, seq_len=seq_len, n_windows=n_windows, source=source)
        key, known = _known_dense(record, dense, windows, data_dir)
        results = evaluate_variants(adapter, variants, windows, progress=progress, known=known)
        task_scores = _task_scores({name: (adapter.model, mods) for name, mods in variants.items()}, tokenizer,
                                   loaded_tasks, adapter, progress)
        if "teal" in variants:  # its cost beside its perplexity: TEAL is matched to the conversion's
            results["teal"].update(teal_info["variant"])
    else:
        dense, tokenizer = _reference_model(method, record, data_dir=data_dir, device=device, progress=progress, loader=loader)
        converted = converted.to(next(dense.parameters()).device)
        with progress.step("read held-out text"):
            windows = heldout_windows(tokenizer, data_dir, seq_len=seq_len, n_windows=n_windows, source=source)
        key, known = _known_dense(record, dense, windows, data_dir)
        results = evaluate_models({"dense": dense, "converted": converted}, tokenizer, windows, progress=progress, known=known)
        task_scores = _task_scores({"dense": (dense, None), "converted": (converted, None)}, tokenizer, loaded_tasks,
                                   None, progress)
    reference_scores.save(data_dir, key, results["dense"])
    timed: dict[str, Any] = {}
    if speed is not None:
        with progress.step("time dense and converted"):
            teal = (adapter, variants.get("teal")) if method.baselines is not None else None
            timed = {"speed": {**_time_models(dense, converted, teal, windows, speed), **_runtime_age(conversion_dir)}}
    if method.extra_evaluation is not None:
        extra = method.extra_evaluation(converted, tokenizer, record, data_dir=data_dir, n_windows=n_windows,
                                        seq_len=seq_len, progress=progress)
    timings["total_s"] = time.perf_counter() - t0
    out = {
        "conversion": str(conversion_dir),
        "method": method.name,
        "params": record["params"],
        "summary": record["summary"],
        "heldout": {"source": source, "split": "heldout", "windows": int(len(windows)), "seq_len": seq_len},
        "results": results,
        **timed,
        **extra,
        **({"tasks": task_scores} if task_scores else {}),
        **({"task_settings": tasks.describe()} if tasks is not None else {}),
        **({"notes": notes} if notes else {}),
        "conversion_timings": record["timings"],
        "timings": timings,
    }
    if write:
        write_json_atomic(Path(conversion_dir) / EVALUATION_FILE, out)
        from .runtime.model_card import write_model_card  # the card shows the numbers just measured

        write_model_card(Path(conversion_dir), record, converted, "moelab", out)
    return out


def _time_models(dense: Any, converted: Any, teal: tuple[ModelAdapter, dict[int, Any] | None] | None,
                 windows: Any, protocol: SpeedProtocol) -> dict[str, Any]:
    """Dense and converted timed whole (``evaluation.speed``); the dense model in moelab's kernels
    (``evaluation.kernel_dense``: what the kernels alone give, so the sparsity's own gain reads beside it; where the
    model cannot run in them, ``kernel_dense_note`` says why); and TEAL at the conversion's cost when its MLPs were
    built (``teal``: the dense model's adapter and them). Both baselines are the dense model with their MLPs swapped
    in for the time of their rounds."""
    adapter, mlps = teal if teal is not None else (None, None)
    try:
        adapter = adapter or adapt(dense)
        kernel_mlps, problem = kernel_dense_mlps(adapter), None
    except ValueError as exc:  # a reference that is no dense GLU model (ModelError), or no kernels here
        kernel_mlps, problem = None, str(exc)
    models = {"dense": dense, "converted": converted, **({KERNEL_DENSE: dense} if kernel_mlps else {}),
              **({"teal": dense} if mlps else {})}
    setups = {name: (lambda mods=mods: swapped_mlps(adapter, mods))
              for name, mods in ((KERNEL_DENSE, kernel_mlps), ("teal", mlps)) if mods}
    speed = time_phases(models, windows, protocol=protocol, setups=setups)
    return {**speed, **({"kernel_dense_note": problem} if problem else {})}


def _runtime_age(conversion_dir: Path) -> dict[str, str]:
    """``{"old_runtime": note}`` where the export carries a runtime other than this moelab's (it was timed with its
    own: the note says so beside the times, wherever they are shown, and how to re-export), else ``{}``."""
    return {} if runtime_is_current(conversion_dir) else {"old_runtime": OLD_RUNTIME_NOTE.format(dir=conversion_dir)}


def _task_scores(models: dict[str, tuple[Any, dict[int, Any] | None]], tokenizer: Any,
                 loaded: list[tuple[TaskRequest, dict[str, Any]]], adapter: ModelAdapter | None, progress: Progress,
                 ) -> dict[str, dict[str, Any]]:
    """``{task: {variant: metrics}}``: lm-eval's scores of each ``(model, swapped MLPs)`` on each request's tasks; a
    baseline is the dense model with its MLPs swapped in for the time of its run (``swapped_mlps``)."""
    out: dict[str, dict[str, Any]] = {name: {} for _, tasks in loaded for name in tasks}
    for request, tasks in loaded:
        for variant, (model, modules) in models.items():
            with progress.step(f"tasks {variant}"), swapped_mlps(adapter, modules) if modules else contextlib.nullcontext():
                for task, metrics in run_tasks(model, tokenizer, request, tasks).items():
                    out[task][variant] = metrics
    return out


def _bigbench_request(data_dir: Path, mc_per_task: int) -> TaskRequest | None:
    """BIG-bench's multiple choice as lm-eval task ``moelab_bigbench_mc`` (``mc_per_task`` held-out items of each of
    its three tasks), when ``moelab data install bigbench`` has run; None otherwise."""
    if not mc_per_task or not bigbench_installed(data_dir):
        return None
    return TaskRequest(tasks=("moelab_bigbench_mc",), limit=mc_per_task * len(MC_TASKS), data_dir=Path(data_dir))


OLD_RUNTIME_NOTE = ("an older runtime: {dir} carries the runtime moelab had when it was written, and was timed with it; moelab's runtime "
                    "has changed since (its kernels, and the baselines timed beside it, may be faster): "
                    "`moelab export {dir} --format moelab --out NEW` writes the same weights with the current one")

#: The TEAL baseline's calibration tokens when the record has no ``fit_tokens``: the partition methods' default.
TEAL_FIT_TOKENS = 4096
TEAL_NOTE = ("TEAL's saving needs sparse (column-skipping) kernels: on CPU a decode step of up to 8 tokens (1-2 without "
             "moelab's native kernels) reads only the weight rows some token's nonzero inputs need, each once (timed in "
             "'speed' beside the conversion); prefill runs the dense products, where a batch needs nearly every row")


def _teal_baseline(adapter: ModelAdapter, record: dict[str, Any], converted: Any, progress: Progress,
                   data_dir: Path | None = None) -> tuple[dict[int, Any] | None, dict[str, Any]]:
    """TEAL (``core.teal``, greedy allocation) at the conversion's own ``ffn_flops_fraction``, calibrated on
    the profile's calibration text (as stored in the profile) and as many tokens as the conversion's fit
    reads (``fit_tokens``). Returns its modules (None when the profile or its text is gone: the rest of
    the evaluation goes on) and ``{"note", "variant"}``: the note the evaluation carries, the numbers its
    results entry gains (its cost, calibration tokens and per-layer sparsities). The thresholds are kept
    under ``data_dir`` (``reference_scores.TEAL_DIR``) and reused by the next evaluation at the same cost
    on the same profile: the same modules, without the calibration."""
    from .core.fitting import collect_inputs, stored_token_windows
    from .core.params import ConversionError
    from .core.teal import MAX_TOKENS, STEP, teal_flops_fraction, teal_from_thresholds, teal_layers, teal_modules, teal_thresholds

    dense_macs = sum(3 * adapter.d_model * lay.d_ffn for lay in adapter.layers)
    cost = record["summary"].get("ffn_flops_fraction")
    cost = ffn_flops_fraction(converted, dense_macs) if cost is None else float(cost)
    n_tokens = int(record["params"].get("fit_tokens", TEAL_FIT_TOKENS))
    try:
        profile = StoredProfile.open(record["profile"])
        key = reference_scores.teal_key(record.get("model", {}), adapter.model, {**profile.manifest["calibration"],
                                        "written": profile.manifest.get("created_at")},
                                        {"tokens": n_tokens, "cost": round(cost, 9), "allocation": "greedy", "step": STEP,
                                         "max_tokens": MAX_TOKENS})
        stored = reference_scores.load_teal(data_dir, key)
        if stored is not None:
            with progress.step("teal: stored thresholds"):
                modules, n_read = teal_from_thresholds(adapter, stored["layers"]), stored["calibration_tokens"]
        else:
            windows = stored_token_windows(adapter, profile, n_tokens)
    except (ProfileNotFound, ConversionError, KeyError) as exc:
        return None, {"note": f"TEAL not built: its calibration text could not be read ({exc})"}
    if stored is None:
        inputs = collect_inputs(adapter, windows, progress.within("teal"))  # 'baselines: teal: fit: calibration forward'
        modules, n_read = teal_modules(adapter, inputs, cost, "greedy", progress=progress), inputs.n_tokens
        reference_scores.save_teal(data_dir, key, {"layers": teal_thresholds(modules), "calibration_tokens": n_read})
    variant = {"ffn_flops_fraction": teal_flops_fraction(modules, dense_macs), "allocation": "greedy",
               "calibration_tokens": n_read, **teal_layers(modules), **({"thresholds_reused": True} if stored is not None else {})}
    return modules, {"note": TEAL_NOTE, "variant": variant}


def check_evaluation_limits(conversion_dir: Path, *, n_windows: int, seq_len: int, max_tokens: int | None = None) -> None:
    """ValueError when an evaluation would read more than ``max_tokens`` held-out tokens or windows longer than
    the model's ``max_position_embeddings`` (its ``config.json``), before any model is loaded."""
    problem = ((eval_tokens_problem(n_windows, seq_len, max_tokens, windows_name="windows") if max_tokens is not None else None)
               or seq_len_problem(seq_len, conversion_config(Path(conversion_dir))))
    if problem:
        raise ValueError(problem)


PROBE_KINDS = ("routing", "generate")


def run_probe(
    conversion_dir: Path, *, kind: str, text: str, max_new_tokens: int = 32, data_dir: Path, device: str = "auto",
    progress: Progress = NO_PROGRESS, loader: ModelLoader = load_model, load_converted: Callable[[Path], Any] = load_exported,
) -> dict[str, Any]:
    """A short look at one conversion on one text (``evaluation.probes``).

    ``routing``: the expert every token is routed to, per layer (only the converted model runs).
    ``generate``: ``text`` as a prompt, greedily continued by the dense model the conversion was
    made from (the method's reference model where it has one, e.g. the original MoE of a
    hierarchical conversion) and by the converted model, each timed.
    """
    from transformers import AutoTokenizer

    from .evaluation.probes import timed_generation, token_routing

    if kind not in PROBE_KINDS:
        raise ValueError(f"unknown probe kind {kind!r}; one of {', '.join(PROBE_KINDS)}")
    t0 = time.perf_counter()
    record = read_conversion(conversion_dir)
    with progress.step("load converted model"):
        converted = load_converted(conversion_dir).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(conversion_dir), trust_remote_code=True)  # our own export, as load_exported
    out: dict[str, Any] = {"kind": kind, "method": record["params"].get("method"), "text": text}
    if kind == "routing":
        with progress.step("route tokens"):
            out.update(token_routing(converted, tokenizer, text))
    else:
        method = get_method(method_of(record["params"]))
        dense, dense_tokenizer = _reference_model(method, record, data_dir=data_dir, device=device, progress=progress,
                                                  loader=loader)
        converted = converted.to(next(dense.parameters()).device)
        with progress.step("generate dense"):
            out["dense"] = timed_generation(dense, dense_tokenizer, text, max_new_tokens)
        with progress.step("generate converted"):
            out["converted"] = timed_generation(converted, tokenizer, text, max_new_tokens)
        d, c = out["dense"]["tokens_per_s"], out["converted"]["tokens_per_s"]
        out["speedup"] = c / d if d and c else None
    out["timings"] = {"total_s": time.perf_counter() - t0}
    return out


def run_activation_probe(
    profile_dir: Path, *, text: str, layer: int, neurons: Sequence[int], data_dir: Path, device: str = "auto",
    trust_remote_code: bool = False, progress: Progress = NO_PROGRESS, loader: ModelLoader = load_model,
) -> dict[str, Any]:
    """h (CM Eq. 1, as the profiler's top tokens) of ``neurons`` of ``layer`` on every token of ``text``,
    computed by the profile's dense model (``evaluation.activations``), with each neuron's profile
    statistics for scale. A neuron's activation is a property of the dense model, not of a
    conversion, so this takes a profile (which names the model and its layer widths): the layer and
    neurons are checked against the profile's manifest before any model is loaded."""
    from .evaluation.activations import check_activation_request, neuron_activations, profile_reference

    t0 = time.perf_counter()
    profile = StoredProfile.open(profile_dir)
    neurons = [int(n) for n in neurons]
    check_activation_request([int(d) for d in profile.manifest["d_ffn"]], layer, neurons)
    model = profile.manifest["model"]
    adapter = loader(model["source"], data_dir=data_dir, device=device, dtype="float32",
                     trust_remote_code=trust_remote_code, progress=progress)
    with progress.step("neuron activations"):
        out = neuron_activations(adapter, text, layer, neurons)
    out.update(kind="activation", text=text, reference=profile_reference(profile, layer, neurons),
               timings={"total_s": time.perf_counter() - t0})
    return out


HELDOUT_PICK = 48  # held-out samples a probe can pick from, per built-in set (a fixed, seeded draw)


def heldout_sample(source: str, index: int, *, data_dir: Path) -> str:
    """The text of sample ``index`` of a built-in set's held-out split (``builtin:NAME``), from a
    fixed draw of ``HELDOUT_PICK`` samples (seed 0), so an index always names the same text."""
    cset = load_calibration(source, samples=HELDOUT_PICK, split="heldout", data_dir=data_dir)
    if not 0 <= index < len(cset.samples):
        raise ValueError(f"{source} offers {len(cset.samples)} held-out samples to probe: choose sample 0 to {len(cset.samples) - 1}")
    return cset.samples[index].text


def _reference_model(method: Method, record: dict[str, Any], *, data_dir: Path, device: str, progress: Progress,
                     loader: ModelLoader) -> tuple[Any, Any]:
    """``(model, tokenizer)`` a conversion is compared with: the method's reference (e.g. the original
    MoE of a hierarchical conversion) or the profiled dense model, float32."""
    if method.reference is not None:
        with progress.step("load reference model"):
            return method.reference(record, device=device, data_dir=data_dir)
    adapter = loader(record["model"]["source"], data_dir=data_dir, device=device, dtype="float32", progress=progress)
    return adapter.model, adapter.tokenizer


def _known_dense(record: dict[str, Any], dense: Any, windows: Any, data_dir: Path,
                 ) -> tuple[str, dict[str, dict[str, Any]]]:
    """The key of the dense model's scores on ``windows`` and, when an earlier evaluation stored
    them, ``{"dense": entry}`` (``evaluation.reference_scores``)."""
    protocol = {"batch_size": 8}
    key = reference_scores.fingerprint(record.get("model", {}), dense, windows, protocol)
    entry = reference_scores.load(data_dir, key)
    return key, ({"dense": entry} if entry else {})
