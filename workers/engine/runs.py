"""End-to-end jobs: profile, convert, evaluate. The CLI and the job workers call these.

Each job reads its inputs from artifact directories, reports progress through ``Progress``
(which may cancel it), and publishes its result as a new artifact atomically.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any, Callable, Sequence


from .atomic import write_json_atomic
from .data.calibration import load_calibration
from .core.params import ConversionError
from .data.builtin import bigbench_installed
from .evaluation.metrics import bigbench_choice_items, evaluate_models, evaluate_variants, heldout_windows
from .methods import REGISTRY, ConversionInputs, Method, get_method, method_of
from .models import ModelAdapter, load_model
from .runtime.export import CONVERSION_FILE, export_model, load_exported
from .runtime.param_count import ffn_flops_fraction
from .profiling.store import StoredProfile, write_profile
from .profiling.profiler import ProfileSettings, profile_model
from .progress import NO_PROGRESS, Progress

EVALUATION_FILE = "evaluation.json"

#: How a job gets its model: ``load_model`` by default; a worker passes its model cache.
ModelLoader = Callable[..., ModelAdapter]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_profile(
    model: str, calib: str, out: Path, settings: ProfileSettings, *, samples: int | None, data_dir: Path,
    device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False, progress: Progress = NO_PROGRESS,
    loader: ModelLoader = load_model,
) -> StoredProfile:
    t0 = time.perf_counter()
    settings.validate()
    cset = load_calibration(calib, samples=samples, seed=settings.seed, data_dir=data_dir)
    adapter = loader(model, data_dir=data_dir, device=device, dtype=dtype, trust_remote_code=trust_remote_code, progress=progress)
    result = profile_model(adapter, cset, settings, progress)
    result.timings.update(load_model_s=adapter.load_seconds, total_s=time.perf_counter() - t0, peak_rss_mib=_peak_rss_mib())
    write_profile(result, cset, out)
    return StoredProfile.open(out)


def run_conversion(
    profile_dir: Path | None, params: Any, out: Path, *, data_dir: Path, device: str = "auto",
    trust_remote_code: bool = False, progress: Progress = NO_PROGRESS, loader: ModelLoader = load_model,
    extra_profiles: Sequence[Path] = (), model: str | None = None, calib: str | None = None,
) -> dict[str, Any]:
    """Convert with any registered method (``methods.REGISTRY``) and export the result; returns the record.

    ``profile_dir``: the dense model's profile (MIDAS: the first calibration set's);
    ``extra_profiles``: MIDAS's other calibration sets; ``model`` + ``calib``: methods that read an
    existing MoE model (hierarchical), which profile its experts themselves.
    The loaded dense model is converted in place: a cached model must not be reused after this.
    """
    t0 = time.perf_counter()
    method = get_method(method_of(params))
    params.check()
    profile_paths = [p for p in [profile_dir, *extra_profiles] if p is not None]
    _check_inputs(method, profile_paths, model, calib)
    profiles = [StoredProfile.open(p) for p in profile_paths]
    if method.validate is not None:
        method.validate(params, profiles)  # before a model is loaded
    inputs = ConversionInputs(profiles=profiles, data_dir=data_dir, device=device, model=model, calib=calib)
    if profiles:
        source = profiles[0].manifest["model"]["source"]
        inputs.load_dense = lambda: loader(source, data_dir=data_dir, device=device, dtype="float32",
                                           trust_remote_code=trust_remote_code, progress=progress)
    moe, tokenizer, record = method.build(inputs, params, progress)
    if profiles:
        record["summary"].setdefault(
            "ffn_flops_fraction", ffn_flops_fraction(moe, profiles[0].manifest["model"]["n_ffn_parameters"]))
        record.update(profile=str(Path(profile_paths[0]).resolve()), model=profiles[0].manifest["model"],
                      calibration=profiles[0].manifest["calibration"])
    progress.update("export", 0, 1)
    record["timings"]["total_s"] = time.perf_counter() - t0
    export_model(moe, out, tokenizer, record)
    progress.update("export", 1, 1)
    return record


def _check_inputs(method: Method, profiles: list[Path], model: str | None, calib: str | None) -> None:
    """Each method reads what its ``needs`` says, and nothing else."""
    if method.needs == "moe_model":
        if profiles:
            raise ConversionError(f"{method.name} conversion profiles the MoE model itself: give the model and a calibration set, not a profile")
        if not model or not calib:
            raise ConversionError(f"{method.name} conversion needs the MoE model and a calibration set (model=, calib=)")
        return
    if not profiles:
        raise ConversionError(f"{method.name} conversion needs a profile of the dense model (run `moelab profile` first)")
    if method.needs == "profile" and len(profiles) > 1:
        several = ", ".join(n for n, m in REGISTRY.items() if m.needs == "profiles")
        raise ConversionError(f"{method.name} reads one profile; only {several} take(s) one profile per calibration set")


def read_conversion(conversion_dir: Path) -> dict[str, Any]:
    path = Path(conversion_dir) / CONVERSION_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{conversion_dir}: not a converted model (no {CONVERSION_FILE}); run `moelab convert` first")
    return json.loads(path.read_text())


def run_evaluation(
    conversion_dir: Path, *, data_dir: Path, n_windows: int = 32, seq_len: int = 256, baselines: bool = True,
    source: str = "builtin:mixed", device: str = "auto", progress: Progress = NO_PROGRESS, write: bool = True,
    mc_per_task: int = 50, loader: ModelLoader = load_model,
) -> dict[str, Any]:
    """Perplexity dense vs converted (vs the method's baselines, e.g. AbsTopK for EW/CMoE) in one run,
    plus reconstruction and routing; BIG-bench multiple-choice accuracy too when that set is installed
    (``moelab data install bigbench``); plus the method's own extra numbers (MIDAS: load CV per set)."""
    t0 = time.perf_counter()
    record = read_conversion(conversion_dir)
    method = get_method(method_of(record["params"]))
    converted = load_exported(conversion_dir)
    timings: dict[str, float] = {}
    extra: dict[str, Any] = {}
    items = _choice_items(data_dir, mc_per_task)
    if method.baselines is not None:  # layers swap into the dense model: baselines in the same pass
        adapter = loader(record["model"]["source"], data_dir=data_dir, device=device, dtype="float32", progress=progress)
        tokenizer = adapter.tokenizer
        variants: dict[str, Any] = {"dense": None, "converted": converted.to(adapter.device).moe_modules()}
        if baselines:
            t1 = time.perf_counter()
            variants.update(method.baselines(adapter, record, progress))
            timings["baselines_build_s"] = time.perf_counter() - t1
        windows = heldout_windows(tokenizer, data_dir, seq_len=seq_len, n_windows=n_windows, source=source)
        results = evaluate_variants(adapter, variants, windows, progress=progress, choice_items=items)
    else:
        if method.reference is not None:
            dense, tokenizer = method.reference(record, device=device, data_dir=data_dir)
        else:
            adapter = loader(record["model"]["source"], data_dir=data_dir, device=device, dtype="float32", progress=progress)
            dense, tokenizer = adapter.model, adapter.tokenizer
        converted = converted.to(next(dense.parameters()).device)
        windows = heldout_windows(tokenizer, data_dir, seq_len=seq_len, n_windows=n_windows, source=source)
        results = evaluate_models({"dense": dense, "converted": converted}, tokenizer, windows, progress=progress, choice_items=items)
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
        **extra,
        "conversion_timings": record["timings"],
        "timings": timings,
    }
    if write:
        write_json_atomic(Path(conversion_dir) / EVALUATION_FILE, out)
    return out


def _choice_items(data_dir: Path, mc_per_task: int) -> Any:
    return bigbench_choice_items(data_dir, per_task=mc_per_task) if mc_per_task and bigbench_installed(data_dir) else None
