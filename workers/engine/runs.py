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
from .core.dense import ConversionError, ConversionParams, abstopk_modules, build_modules, build_experts, convert, uniform_params
from .data.builtin import bigbench_installed
from .evaluation.metrics import bigbench_choice_items, evaluate_models, evaluate_variants, heldout_windows, load_cv_by_source
from .runtime.export import CONVERSION_FILE, build_moe_model, export_model, load_exported
from .methods import PARTITION_METHODS, method_of
from .models import ModelAdapter, load_model
from .runtime.param_count import parameter_counts
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
    """Convert with any method of ``methods.METHODS`` and export the result; returns the record.

    ``profile_dir``: the dense model's profile (EW, CMoE, Dense2MoE; MIDAS's first set);
    ``extra_profiles``: MIDAS's other calibration sets; ``model`` + ``calib``: hierarchical
    conversion of an existing MoE model, which profiles its experts itself.
    The loaded dense model is converted in place: a cached model must not be reused after this.
    """
    t0 = time.perf_counter()
    method = method_of(params)
    if method == "hierarchical":
        if not model or not calib:
            raise ConversionError("hierarchical conversion needs the MoE model and a calibration set (model=, calib=)")
        from .methods.hierarchical import convert_hierarchical

        moe, tokenizer, record = convert_hierarchical(model, calib, params, data_dir=data_dir, device=device, progress=progress)
        record.update(model={"source": model}, calibration={"spec": calib})
    else:
        if profile_dir is None:
            raise ConversionError(f"{method} conversion needs a profile of the dense model")
        profiles = [StoredProfile.open(p) for p in [profile_dir, *extra_profiles]]
        profile = profiles[0]
        if method != "midas" and extra_profiles:
            raise ConversionError(f"{method} reads one profile; only midas takes one profile per calibration set")
        _validate_before_loading(params, method, profiles)
        adapter = loader(
            profile.manifest["model"]["source"], data_dir=data_dir, device=device, dtype="float32",
            trust_remote_code=trust_remote_code, progress=progress,
        )
        tokenizer = adapter.tokenizer
        if method in PARTITION_METHODS:
            conv = convert(adapter, profile, params, progress)
            record = conv.record()
            record["summary"].update(method=method, **_counts_before(adapter))
            moe = build_moe_model(adapter, conv.modules, provenance={"method": method, "router": params.router})
            record["summary"].update(_counts_after(moe))
        elif method == "dense2moe":
            from .dense2moe import fuse_model

            moe, record = fuse_model(adapter, params, profile)
        else:
            from .methods.midas import convert_midas

            moe, record = convert_midas(adapter, profiles, params, progress)
        record.update(
            profile=str(Path(profile_dir).resolve()),
            model=profile.manifest["model"],
            calibration=profile.manifest["calibration"],
        )
        if method == "midas":
            record["profiles"] = [str(p.path.resolve()) for p in profiles]
            record["calibrations"] = [p.manifest["calibration"] for p in profiles]
    progress.update("export", 0, 1)
    record["timings"]["total_s"] = time.perf_counter() - t0
    export_model(moe, out, tokenizer, record)
    progress.update("export", 1, 1)
    return record


def _validate_before_loading(params: Any, method: str, profiles: list[StoredProfile]) -> None:
    """Fail on bad parameters before a model is loaded."""
    if method in PARTITION_METHODS:
        for d_ffn in set(profiles[0].manifest["d_ffn"]):
            params.allocation.validate(d_ffn)
    elif method == "dense2moe":
        params.validate(profiles[0].manifest["n_layers"])
    elif method == "midas":
        params.validate(len(profiles))


def _counts_before(adapter: ModelAdapter) -> dict[str, int]:
    counts = parameter_counts(adapter.model)
    return {"dense_total_params": counts["total"], "dense_active_params": counts["active"], "n_layers": adapter.n_layers}


def _counts_after(moe: Any) -> dict[str, int]:
    counts = parameter_counts(moe)
    return {"total_params": counts["total"], "active_params": counts["active"]}


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
    """Perplexity dense vs converted (vs baselines for EW/CMoE) in one run, plus reconstruction and
    routing; BIG-bench multiple-choice accuracy too when that set is installed (``moelab data
    install bigbench``); for MIDAS, load CV per layer on each calibration set's held-out text."""
    t0 = time.perf_counter()
    record = read_conversion(conversion_dir)
    method = method_of(record["params"])
    converted = load_exported(conversion_dir)
    timings: dict[str, float] = {}
    extra: dict[str, Any] = {}
    if method in PARTITION_METHODS:
        adapter = loader(record["model"]["source"], data_dir=data_dir, device=device, dtype="float32", progress=progress)
        tokenizer = adapter.tokenizer
        converted = converted.to(adapter.device)
        variants: dict[str, Any] = {"dense": None, "converted": converted.moe_modules()}
        if baselines:
            params = ConversionParams.from_dict(record["params"])
            variants["abstopk"] = abstopk_modules(adapter, record["summary"]["active_fraction"])
            uniform = uniform_params(params, [row["alpha"] for row in record["layers"]])
            if uniform != params:
                t1 = time.perf_counter()
                profile = StoredProfile.open(record["profile"])
                _, experts = build_experts(adapter, profile, uniform, progress)
                variants["uniform"] = build_modules(adapter, experts, uniform.combine)
                timings["uniform_build_s"] = time.perf_counter() - t1
        windows = heldout_windows(tokenizer, data_dir, seq_len=seq_len, n_windows=n_windows, source=source)
        items = _choice_items(data_dir, mc_per_task)
        results = evaluate_variants(adapter, variants, windows, progress=progress, choice_items=items)
    else:
        if method == "hierarchical":
            from .methods.hierarchical import load_moe_model

            dense, tokenizer = load_moe_model(record["model"]["source"], device=device)
        else:
            adapter = loader(record["model"]["source"], data_dir=data_dir, device=device, dtype="float32", progress=progress)
            dense, tokenizer = adapter.model, adapter.tokenizer
        converted = converted.to(next(dense.parameters()).device)
        windows = heldout_windows(tokenizer, data_dir, seq_len=seq_len, n_windows=n_windows, source=source)
        items = _choice_items(data_dir, mc_per_task)
        results = evaluate_models({"dense": dense, "converted": converted}, tokenizer, windows, progress=progress, choice_items=items)
        if method == "midas":
            sources = [c.get("source") for c in record.get("calibrations", [])]
            sources = [s for s in sources if isinstance(s, str) and s.startswith("builtin:")]
            extra["load_cv_by_set"] = load_cv_by_source(
                converted, tokenizer, sources, data_dir, n_windows=max(1, n_windows // 4), seq_len=seq_len, progress=progress
            )
    timings["total_s"] = time.perf_counter() - t0
    out = {
        "conversion": str(conversion_dir),
        "method": method,
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
