"""Celery tasks, thin: read the job's resource row → call the engine's ``run_*`` with a
progress callback → publish the artifact → record the outcome (``workers.jobrun``).

Every task takes only the job id (JSON) and is idempotent: a re-run writes the same artifact
path through the engine's atomic directory rename, replacing the previous one whole.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from celery import signals

from moelab.store import jobs
from moelab.store.db import Conversion, Model, Profile
from moelab.store import liveness
from workers import model_cache, parentwatch
from moelab.store.broker import LIGHT_WORKER_PREFIX, TASKS, broker_url
from workers.celery_app import app
from moelab.engine.atomic import atomic_directory, write_json_atomic
from workers.jobrun import SHUTDOWN, JobContext, Outcome, database, run_job, store

log = logging.getLogger("moelab.worker")


def _trust(ctx: JobContext, model: Model) -> bool:
    if model.trust_remote_code and not ctx.settings.allow_trust_remote_code:
        raise ValueError(
            f"model {model.id} needs trust_remote_code but this worker does not allow it; "
            "set MOELAB_ALLOW_TRUST_REMOTE_CODE=1 for the worker too"
        )
    return model.trust_remote_code


# --------------------------------------------------------------------------- bodies


def inspect_model(ctx: JobContext) -> Outcome:
    """Load the model once and describe its layers (the API never loads models itself)."""
    from moelab.engine.models import ModelError
    from moelab.engine.streaming.footprint import footprint

    model = ctx.resource()
    s = ctx.settings
    roots = s.resolved_data_roots()
    ref = _checked_model_source(model.source, roots)
    if s.max_memory:
        described = _describe_on_meta(_load_location(ref), s, _trust(ctx, model))
        if described is not None:
            return Outcome(summary={**described, "source": model.source})
    try:
        with model_cache.job_models(give_back=True):
            adapter = model_cache.cached_load_model(
                ref.value, data_dir=s.data_dir, device=s.device, dtype=s.dtype,
                trust_remote_code=_trust(ctx, model), progress=ctx.progress, allowed_roots=roots,
            )
            info = {"kind": "dense", **adapter.describe(), "memory": footprint(adapter).to_dict()}
    except ModelError as dense_error:  # not a dense GLU model: an MoE one is fine for hierarchical conversion
        info = _describe_moe(_load_location(ref), s.device, _trust(ctx, model), dense_error)
    return Outcome(summary={**info, "source": model.source} if "source" in info else info)


def _checked_model_source(source: str, roots: list[Path]) -> Any:
    """The row's model source, checked again by the data-root rule before anything is read: the
    row may predate the rule or have been edited; a Hub id is never looked up in the working directory."""
    from moelab.store.dataroots import resolve_model_source

    return resolve_model_source(source, roots)


def _load_location(ref: Any) -> str:
    """Where loaders that resolve a name themselves (the meta-device and MoE ones) may read ``ref``:
    a checked real path, ``default``, or a Hub id's snapshot (fetched from the Hub, never the working directory)."""
    if ref.kind != "hub":
        return ref.value
    from moelab.engine.models import hub_snapshot

    return str(hub_snapshot(ref.value))


def _describe_on_meta(source: str, s: Any, trust: bool) -> dict[str, Any] | None:
    """A dense model larger than the worker's MOELAB_MAX_MEMORY, described from its config on
    the meta device (its weights are never loaded whole); None: load it as usual."""
    from moelab.engine.models import ModelError
    from moelab.engine.streaming.footprint import footprint
    from moelab.engine.streaming.plan import meta_model
    from moelab.engine.sizes import parse_size

    try:
        adapter, _, _, dtype = meta_model(source, data_dir=s.data_dir, device=s.device, dtype=s.dtype, trust_remote_code=trust)
    except (ModelError, OSError, ValueError):
        return None  # not a dense safetensors model (GGUF, MoE, …): the ordinary inspection says what it is
    memory = footprint(adapter, dtype)
    if memory.total_bytes <= parse_size(s.max_memory):
        return None
    return {"kind": "dense", **adapter.describe(), "memory": memory.to_dict(), "described_from": "config (larger than MOELAB_MAX_MEMORY)"}


def _describe_moe(source: str, device: str, trust: bool, dense_error: Exception) -> dict[str, Any]:
    from moelab.engine.core.params import ConversionError
    from moelab.engine.profiling.moe_experts import load_moe_model, sparse_moe_layers

    try:
        hf, _ = load_moe_model(source, device=device, trust_remote_code=trust)
        layers = sparse_moe_layers(hf)
    except ConversionError:
        raise dense_error from None  # neither dense GLU nor a supported MoE: the dense message says what is supported
    cfg = hf.config
    return {
        "kind": "moe", "family": cfg.model_type, "n_layers": int(cfg.num_hidden_layers), "d_model": int(cfg.hidden_size),
        "moe_layers": [lay.index for lay in layers], "num_experts": layers[0].num_experts,
        "experts_per_token": layers[0].experts_per_token, "d_expert_ffn": layers[0].d_ffn,
        "n_params": int(sum(p.numel() for p in hf.parameters())),
        "note": "an MoE model: convert it with the hierarchical method (AF §4.4)",
    }


def build_calibration(ctx: JobContext) -> Outcome:
    from moelab.engine.data.calibration import load_calibration, load_hf_dataset

    row = ctx.resource()
    p = row.params
    ctx.progress.update("build calibration set", 0, 1)
    if p["source"] == "builtin":
        cset = load_calibration(f"builtin:{p['name']}", samples=p["samples"], seed=p["seed"], data_dir=ctx.settings.data_dir,
                                split=p["split"])
    else:
        from moelab.store.dataroots import check_hub_name_is_not_local, resolve_dataset

        # checked again here: the row may predate the rule, and the worker is what reads the disk;
        # the loader checks every data file it will open too (allowed_roots), symlinks resolved
        roots = ctx.settings.resolved_data_roots()
        ref = resolve_dataset(p["dataset"], roots)
        if ref.kind == "hub":
            check_hub_name_is_not_local(ref.value)
        cset = load_hf_dataset(ref.value, split=p["split"], text_field=p["text_field"], task_field=p["task_field"],
                               domain_field=p["domain_field"], config=p.get("config"), allowed_roots=roots)
        cset.source = f"hf:{p['dataset'].strip()}@{p['split']}"  # the user's string, not the resolved server path
        if p.get("samples"):
            cset = cset.subsample(p["samples"], p["seed"])
    ctx.progress.update("save", 0, 1)
    cset.save(ctx.store.path("calibration-sets", row.id))
    ctx.progress.update("save", 1, 1)
    return Outcome(summary=cset.stats(), fields={"content_id": cset.id})


def profile(ctx: JobContext) -> Outcome:
    from moelab.engine.profiling.profiler import ProfileSettings
    from moelab.engine.runs import run_profile

    row = ctx.resource()
    model = ctx.row(Model, row.model_id)
    p = dict(row.params)
    samples = p.pop("samples", None)
    s = ctx.settings
    max_memory = p.pop("max_memory", None) or s.max_memory  # the job's own budget, else the worker's
    settings = ProfileSettings(**p)
    with model_cache.job_models(give_back=True):
        stored = run_profile(
            model.source, str(ctx.store.path("calibration-sets", row.calibration_set_id)),
            ctx.store.path("profiles", row.id), settings, samples=samples, data_dir=s.data_dir, device=s.device,
            dtype=s.dtype, trust_remote_code=_trust(ctx, model), progress=ctx.progress,
            loader=model_cache.cached_load_model, max_memory=max_memory, time_kernels=s.time_kernels,
        )
    m = stored.manifest
    groups = list(m.get("groups", []))
    summary = {
        "n_layers": m["n_layers"], "d_ffn": m["d_ffn"], "n_tokens": m["n_tokens"], "cv_basis": m["cv_basis"],
        "n_groups": len(groups), "groups": groups[:64], "model": m["model"], "calibration": m["calibration"],
        "n_feature_tokens": m.get("n_feature_tokens"), "files": m.get("files"),
    }
    return Outcome(summary=summary, timings=m.get("timings"))


def convert(ctx: JobContext) -> Outcome:
    from moelab.engine.methods import params_from_dict
    from moelab.engine.runs import run_conversion

    row = ctx.resource()
    inputs = dict(row.params)
    extra_ids = inputs.pop("extra_profile_ids", [])
    calib = inputs.pop("calibration", None)
    max_memory = inputs.pop("max_memory", None) or ctx.settings.max_memory  # the job's own budget, else the worker's
    params = params_from_dict(inputs)
    if row.profile_id is None:  # hierarchical: an MoE model and a calibration set
        model = ctx.row(Model, row.model_id)
        profile_dir, source = None, model.source
        if calib and not calib.startswith("builtin:"):
            calib = str(ctx.store.path("calibration-sets", calib))
    else:
        prof = ctx.row(Profile, row.profile_id)
        model = ctx.row(Model, prof.model_id)
        profile_dir, source = ctx.store.path("profiles", prof.id), None
    # a conversion under a memory budget is not shared: each helper would load the whole model
    map_layers = _fan_out(ctx, row, params, profile_dir, model) if profile_dir is not None and not max_memory else None
    if map_layers is not None:
        from moelab.engine.profiling.store import StoredProfile

        map_layers.start(list(range(StoredProfile.open(profile_dir).n_layers)))  # helpers start before this model loads
    with (map_layers or contextlib.nullcontext()), model_cache.job_models(give_back=False):  # rewrites the model in place
        record = run_conversion(
            profile_dir, params, ctx.store.path("conversions", row.id),
            data_dir=ctx.settings.data_dir, device=ctx.settings.device, trust_remote_code=_trust(ctx, model),
            progress=ctx.progress, loader=model_cache.cached_load_model,
            extra_profiles=[ctx.store.path("profiles", pid) for pid in extra_ids], model=source, calib=calib,
            map_layers=map_layers, max_memory=max_memory,
            # a guard's missing kernel table is timed first, but not beside helpers that load and convert layers
            time_kernels=ctx.settings.time_kernels and map_layers is None,
        )
    notes = [{"layer": r["layer"], "note": r["note"]} for r in record.get("layers", []) if r.get("note")]
    from moelab.store.jsonsafe import jsonable

    return Outcome(summary=jsonable({**record["summary"], "notes": notes}), timings=record.get("timings"))


def _fan_out(ctx: JobContext, row: Any, params: Any, profile_dir: Path, model: Model) -> Any:
    """A ``LayerFanOut`` sharing a partition conversion's layers with the other live workers
    (``workers.fanout``); None for other methods or with ``MOELAB_CONVERSION_FANOUT=0``."""
    from moelab.engine.methods import get_method
    from workers.fanout import LayerFanOut, scratch_dir

    s = ctx.settings
    if not s.conversion_fanout or get_method(params.method).partition is None:
        return None
    client = liveness.client_for(broker_url(s))
    # the light worker consumes no gpu message: a helper sent for it would wait for a busy worker instead
    others = [w for w in liveness.alive(client, s.redis_prefix) if w != ctx.worker and not w.startswith(LIGHT_WORKER_PREFIX)]
    spec = {"profile": str(profile_dir), "params": params.to_dict(), "source": model.source,
            "trust_remote_code": _trust(ctx, model)}

    def send_helper() -> None:
        app.send_task(CONVERT_LAYERS, args=[ctx.job_id], queue=TASKS["conversion"][1])

    return LayerFanOut(client, s.redis_prefix, ctx.job_id, ctx.worker, scratch_dir(ctx.store.root / "conversions", row.id),
                       spec, helpers=len(others), send_helper=send_helper)


def _mean(values: Any) -> float | None:
    vals = [float(v) for v in (values or []) if v is not None and v == v]
    return sum(vals) / len(vals) if vals else None


def evaluate(ctx: JobContext) -> Outcome:
    from moelab.engine.evaluation.harness import TaskRequest
    from moelab.engine.evaluation.speed import SpeedProtocol
    from moelab.engine.runs import run_evaluation

    row = ctx.resource()
    p = row.params
    tasks = None
    if p.get("tasks"):
        tasks = TaskRequest(tasks=tuple(p["tasks"]), num_fewshot=p.get("num_fewshot"), limit=p.get("limit"),
                            task_dir=Path(p["task_dir"]) if p.get("task_dir") else None)
    source = p["source"] if p["source"].startswith("builtin:") else str(ctx.store.path("calibration-sets", p["source"]))
    with model_cache.job_models(give_back=True):
        report = run_evaluation(
            ctx.store.path("conversions", row.conversion_id), data_dir=ctx.settings.data_dir, n_windows=p["n_windows"],
            seq_len=p["seq_len"], baselines=p["baselines"], source=source, device=ctx.settings.device,
            progress=ctx.progress, write=False, mc_per_task=p.get("multiple_choice_per_task", 50),
            loader=model_cache.cached_load_model, max_tokens=ctx.settings.max_eval_tokens,
            load_converted=model_cache.cached_load_converted, tasks=tasks, speed=SpeedProtocol(**ctx.settings.speed_protocol()) if p.get("speed", True) else None,
        )
    report["heldout"]["source"] = p["source"]  # the id or builtin name, not a server path
    with atomic_directory(ctx.store.path("evaluations", row.id)) as tmp:
        write_json_atomic(tmp / "evaluation.json", report)
    variants = {
        name: {
            "perplexity": r.get("perplexity"), "perplexity_ratio": r.get("perplexity_ratio"),
            "perplexity_ci": r.get("perplexity_ci"), "perplexity_ratio_ci": r.get("perplexity_ratio_ci"),
            "tokens_per_s": r.get("tokens_per_s"),
            "mean_reconstruction_error": _mean(r.get("reconstruction_error")),
            "mean_load_cv": _mean((r.get("routing") or {}).get("load_cv", {}).values()),
            "multiple_choice_accuracy": ((report.get("tasks") or {}).get("moelab_bigbench_mc", {}).get(name) or {}).get("acc_norm"),
            "ffn_flops_fraction": r.get("ffn_flops_fraction"),  # a baseline built at the conversion's cost (TEAL) says it
            "reused": "reused" in r,  # the dense model's stored score on the same windows (evaluation.reference_scores)
        }
        for name, r in report["results"].items()
    }
    from moelab.store.jsonsafe import jsonable

    tasks_out = {"tasks": report["tasks"], "task_settings": report["task_settings"]} if "tasks" in report else {}
    speed = {"speed": report["speed"]} if "speed" in report else {}
    return Outcome(summary=jsonable({"variants": variants, "heldout": report["heldout"], **tasks_out, **speed}),
                   timings=report.get("timings"))


def finetune(ctx: JobContext) -> Outcome:
    """Fine-tune a conversion in a work dir that outlives the job (a re-run resumes from its latest
    checkpoint), then publish the fine-tuned model as a new conversion of the same profile."""
    from moelab.engine.training.finetune import MODEL_DIR, FinetuneParams, run_finetune

    row = ctx.resource()
    parent = ctx.row(Conversion, row.conversion_id)
    p = dict(row.params)
    if not p["source"].startswith("builtin:"):
        p["source"] = str(ctx.store.path("calibration-sets", p["source"]))
    work = ctx.store.path("finetunes", row.id)
    work.mkdir(parents=True, exist_ok=True)  # never atomic_directory: that would replace the checkpoints
    with model_cache.job_models(give_back=False):  # what a training run loads may be changed in place: never reuse it
        summary = run_finetune(
            ctx.store.path("conversions", parent.id), FinetuneParams.from_dict(p), work, data_dir=ctx.settings.data_dir,
            device=ctx.settings.device, progress=ctx.progress, loader=model_cache.cached_load_model,
        )
    result_id = _publish_finetuned(ctx, row, parent, work / MODEL_DIR, summary)
    from moelab.store.jsonsafe import jsonable

    # server paths (the model dir, which moved; a calibration set's dir) stay out of the API's summary
    public = {k: v for k, v in summary.items() if k not in ("model", "conversion", "params")}
    return Outcome(summary=jsonable({**public, "conversion_id": parent.id, "result_conversion_id": result_id}),
                   fields={"result_conversion_id": result_id})


def _publish_finetuned(ctx: JobContext, row: Any, parent: Any, model_dir: Path, summary: dict[str, Any]) -> str:
    """Move the exported model into the conversions store and record it as a conversion.

    The new row shares the fine-tune's job, so it turns ready exactly when that job succeeds
    (and shows the job's failure if the job is lost before it records its success).
    """
    from moelab.store.jsonsafe import jsonable
    from moelab.engine.runtime.export import CONVERSION_FILE

    record = json.loads((model_dir / CONVERSION_FILE).read_text())
    result_id = jobs.new_id("conv")
    os.replace(model_dir, ctx.store.path("conversions", result_id))  # same file system: one rename
    lineage = {"finetune_of": parent.id, "finetune_id": row.id}
    ppl = {k: summary.get(k) for k in ("perplexity_before", "perplexity_after", "dense_perplexity") if k in summary}
    with ctx.db.session() as session:
        session.add(Conversion(
            id=result_id, profile_id=parent.profile_id, model_id=parent.model_id, params={**(parent.params or {}), **lineage},
            summary=jsonable({**(record.get("summary") or {}), **lineage, **ppl}), job_id=ctx.job_id,
        ))
    return result_id


def probe(ctx: JobContext) -> Outcome:
    """Token routing or side-by-side generation on one text; the whole result is the artifact
    ``probes/<id>/probe.json``, the job's summary a digest of it (generation: all of it)."""
    from moelab.store.jsonsafe import jsonable
    from moelab.engine.runs import heldout_sample, run_probe

    row = ctx.resource()
    p = row.params
    s = ctx.settings
    text = p["text"] if p.get("text") is not None else heldout_sample(p["sample_source"], p["sample"], data_dir=s.data_dir)
    with model_cache.job_models(give_back=True):
        result = run_probe(
            ctx.store.path("conversions", row.conversion_id), kind=p["kind"], text=text, max_new_tokens=p["max_new_tokens"],
            data_dir=s.data_dir, device=s.device, progress=ctx.progress, loader=model_cache.cached_load_model,
            load_converted=model_cache.cached_load_converted,
        )
    result = jsonable(result)
    with atomic_directory(ctx.store.path("probes", row.id)) as tmp:
        write_json_atomic(tmp / "probe.json", result)
    if p["kind"] == "routing":
        summary = {"kind": "routing", "method": result["method"], "n_tokens": len(result["tokens"]),
                   "layers": [lay["layer"] for lay in result["layers"]], "text": text[:200]}
    else:
        summary = {k: v for k, v in result.items() if k != "timings"}
    return Outcome(summary=summary, timings=result.get("timings"))


def activation_probe(ctx: JobContext) -> Outcome:
    """Neurons of one layer of a profile's dense model on one text (``runs.run_activation_probe``); the
    whole result is the artifact ``activation-probes/<id>/activations.json``, the summary a digest."""
    from moelab.store.jsonsafe import jsonable
    from moelab.engine.runs import heldout_sample, run_activation_probe

    row = ctx.resource()
    p = row.params
    s = ctx.settings
    prof = ctx.row(Profile, row.profile_id)
    model = ctx.row(Model, prof.model_id)
    text = p["text"] if p.get("text") is not None else heldout_sample(p["sample_source"], p["sample"], data_dir=s.data_dir)
    with model_cache.job_models(give_back=True):
        result = run_activation_probe(
            ctx.store.path("profiles", prof.id), text=text, layer=p["layer"], neurons=p["neurons"], data_dir=s.data_dir,
            device=s.device, trust_remote_code=_trust(ctx, model), progress=ctx.progress, loader=model_cache.cached_load_model,
        )
    result = jsonable(result)
    with atomic_directory(ctx.store.path("activation-probes", row.id)) as tmp:
        write_json_atomic(tmp / "activations.json", result)
    peaks = [max((abs(v) for v in acts if v is not None), default=None) for acts in result["activations"]]
    summary = {"kind": "activation", "layer": result["layer"], "neurons": result["neurons"], "n_tokens": len(result["tokens"]),
               "max_abs": peaks, "text": text[:200]}
    return Outcome(summary=summary, timings=result.get("timings"))


def export(ctx: JobContext) -> Outcome:
    """A ready conversion as a GGUF file (``gguf_export.export_gguf``): the .gguf, an Ollama Modelfile
    and a model card, published atomically into ``conversions/<conv-id>/exports/<exp-id>/``. Refused
    before the model is loaded when its layout does not export or it would exceed MOELAB_MAX_MEMORY."""
    from moelab.engine.limits import gguf_export_footprint, memory_problem
    from moelab.engine.runtime.gguf_export import export_gguf, gguf_layout

    row = ctx.resource()
    conv = ctx.row(Conversion, row.conversion_id)
    src = ctx.store.path("conversions", conv.id)
    if row.format != "gguf":
        raise ValueError(f"export format {row.format!r} is not one this worker writes (gguf)")
    gguf_layout(json.loads((src / "config.json").read_text()))  # GgufExportError (a ValueError) says what blocks it
    footprint = gguf_export_footprint(src, row.type)
    problem = memory_problem(footprint["memory_bytes"], ctx.settings.max_memory,
                             f"the GGUF {row.type} export of conversion {conv.id}") if footprint else None
    if problem:
        raise ValueError(problem)
    ctx.progress.update(f"export gguf {row.type}", 0, 1)
    info = export_gguf(src, ctx.store.export_path(conv.id, row.id), row.type, ctx.settings.data_dir)
    ctx.progress.update(f"export gguf {row.type}", 1, 1)
    from moelab.store.jsonsafe import jsonable

    # the file by its name only: server paths (``out``, ``source``) stay out of the API's summary
    summary = {"file": Path(info["file"]).name, "bytes": info["bytes"], "architecture": info["architecture"],
               "type": info["type"], "format": "gguf", "layout": info.get("layout"), "conversion_id": conv.id,
               "note": info.get("note")}
    return Outcome(summary=jsonable(summary))


# --------------------------------------------------------------------------- tasks


def _task(kind: str, body: Any) -> Any:
    name, _queue = TASKS[kind]

    @app.task(name=name, bind=True, ignore_result=True, acks_late=True)
    def task(self: Any, job_id: str) -> None:
        run_job(job_id, self.request.hostname or "worker", body)

    task.__doc__ = body.__doc__
    return task


inspect_model_task = _task("inspect_model", inspect_model)
build_calibration_task = _task("build_calibration", build_calibration)
profile_task = _task("profile", profile)
convert_task = _task("conversion", convert)
evaluate_task = _task("evaluation", evaluate)
finetune_task = _task("finetune", finetune)
probe_task = _task("probe", probe)
activation_probe_task = _task("activation_probe", activation_probe)
export_task = _task("export", export)

CONVERT_LAYERS = "moelab.convert_layers"


@app.task(name=CONVERT_LAYERS, bind=True, ignore_result=True, acks_late=True)
def convert_layers_task(self: Any, job_id: str) -> None:
    """Build layers of another worker's conversion job (``workers.fanout``); not a job of its own."""
    from moelab.settings import get_settings
    from workers.fanout import help_build_layers

    s = get_settings()

    def load_dense(spec: dict[str, Any]) -> Any:
        return model_cache.cached_load_model(spec["source"], data_dir=s.data_dir, device=s.device, dtype="float32",
                                             trust_remote_code=spec["trust_remote_code"])

    client = liveness.client_for(broker_url(s))
    with model_cache.job_models(give_back=True):  # read only: the cached model stays usable
        built = help_build_layers(client, s.redis_prefix, job_id, self.request.hostname or "worker", load_dense)
    if built:
        log.info("built %d layer(s) of conversion job %s", built, job_id)


# --------------------------------------------------------------------------- worker lifecycle


class _NoBackendNoise(logging.Filter):
    """Celery tries to store REVOKED in a result backend on every revoke; there is none by design."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "as revoked in backend" not in record.getMessage()


logging.getLogger("celery.worker.control").addFilter(_NoBackendNoise())

_presence_stop = threading.Event()


def _presence(name: str) -> None:
    """Announce this worker in Redis every second over a connection named after it (its closing tells
    the API at once that this process died: ``moelab.store.liveness``) and, like the API, fail jobs
    whose worker died or stopped beating (so those bounds hold even while no API process runs); at
    start and every ``requeue_interval_s``, re-send queued jobs the broker lost (``workers.requeue``)."""
    import time

    from moelab.settings import get_settings
    from workers.requeue import Requeuer

    s = get_settings()
    client = liveness.client_for(broker_url(s), name=liveness.connection_name(s.redis_prefix, name))
    requeuer = Requeuer(s, database(), client, owner=name)
    next_check, announced = 0.0, True
    while True:
        try:
            liveness.announce(client, s.redis_prefix, name, ttl_s=max(5.0, 3 * s.heartbeat_s))
            announced = True
        except Exception as exc:  # the broker may come back; say so once, not every second
            if announced:
                log.warning("worker presence not written: %s", exc)
            announced = False
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + s.heartbeat_s
            try:
                with database().session() as session:
                    for job_id in jobs.reap_stale(session, s.heartbeat_timeout_s):
                        log.warning("job %s failed: its worker stopped heartbeating", job_id)
            except Exception as exc:
                log.warning("stale-job check failed: %s", exc)
            try:
                with database().session() as session:
                    dead = jobs.fail_jobs_of_dead_workers(
                        session, lambda workers: liveness.dead_workers(client, s.redis_prefix, workers))
                for job_id in dead:
                    log.warning("job %s failed: its worker's process ended", job_id)
            except Exception as exc:  # the broker is down (said above): the heartbeat timeout still applies
                log.debug("dead-worker check skipped: %s", exc)
        requeuer.maybe_run()
        if _presence_stop.wait(liveness.ANNOUNCE_S):
            break
    try:
        liveness.withdraw(client, s.redis_prefix, name)
    except Exception:
        pass


@signals.worker_ready.connect
def _on_ready(sender: Any = None, **_: Any) -> None:
    from moelab.settings import get_settings

    name = getattr(sender, "hostname", None) or "worker"
    parentwatch.watch(name)  # first: a serve that dies while the engine imports still takes this worker with it
    s = get_settings()
    model_cache.install(s.model_cache_size, s.model_cache_bytes())
    # The engine's imports (torch, transformers: seconds) now, not in the first job: a worker
    # that helps another's conversion (``workers.fanout``) must be ready when the layers are.
    import moelab.engine.core.slicing  # noqa: F401
    import moelab.engine.models  # noqa: F401
    database().init()
    store().cleanup()
    with database().session() as session:
        orphans = jobs.fail_orphans_of(session, name)
    if orphans:
        log.warning("failed %d job(s) left running by a previous run of %s: %s", len(orphans), name, ", ".join(orphans))
    threading.Thread(target=_presence, args=(name,), name="presence", daemon=True).start()


@signals.worker_init.connect
def _restrict_model_sources(**_: Any) -> None:
    """Every model this worker loads (any job, any loader path through ``load_model``) is checked
    against the data roots: a Hub id never resolves against the working directory, a path must lie
    inside MOELAB_DATA_ROOTS, whatever a row or a stored record says."""
    from moelab.settings import get_settings
    from moelab.engine.models import restrict_sources

    restrict_sources(get_settings().resolved_data_roots())


@signals.worker_shutting_down.connect
def _on_shutting_down(**_: Any) -> None:
    parentwatch.exit_if_serve_gone()  # serve died (its parent-death SIGTERM): the cause recorded, and out at once
    SHUTDOWN.set()  # running jobs stop at their next progress step and are recorded as failed
    _presence_stop.set()

