"""Table rows → response models (the one place that knows both shapes)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import object_session

from moelab.store.db import ActivationProbe, CalibrationSet, Conversion, Evaluation, Export, Finetune, Job, Model, Probe, Profile, utcnow
from .schemas import (
    ArtifactFile,
    CalibrationSetOut,
    ConversionOut,
    EvaluationOut,
    ExportOut,
    GgufCheck,
    FinetuneOut,
    JobOut,
    ModelOut,
    ProbeOut,
    ActivationProbeOut,
    ProfileOut,
    ProgressOut,
)

_STATUS = {"queued": "queued", "running": "running", "succeeded": "ready", "failed": "failed", "cancelled": "cancelled"}


def status_of(job: Job | None) -> str:
    """A resource is as ready as its latest job; one made without a job (an upload) is ready."""
    return "ready" if job is None else _STATUS[job.state]


def _queue_position(job: Job) -> int | None:
    """1 + the queued jobs of the same queue created before ``job`` (workers take a queue's jobs in order)."""
    session = object_session(job)
    if job.state != "queued" or session is None:
        return None
    ahead = session.execute(select(func.count()).select_from(Job).where(
        Job.queue == job.queue, Job.state == "queued", Job.created_at < job.created_at)).scalar_one()
    return int(ahead) + 1


def _stage_left(job: Job, stage_s: float | None) -> float | None:
    if job.state != "running" or stage_s is None or not job.current or not job.total or job.current >= job.total:
        return None
    return stage_s / job.current * (job.total - job.current)


def job_out(job: Job) -> JobOut:
    now = utcnow()
    end = job.finished_at or now
    stage_s = (end - job.stage_at).total_seconds() if job.stage_at else None
    return JobOut(
        id=job.id, kind=job.kind, state=job.state, queue=job.queue, resource_type=job.resource_type,
        resource_id=job.resource_id,
        progress=ProgressOut(
            stage=job.stage, current=job.current, total=job.total,
            fraction=(job.current / job.total) if job.total else None,
            stage_s=stage_s, stage_left_s=_stage_left(job, stage_s),
        ),
        cancel_requested=job.cancel_requested, error=job.error, error_type=job.error_type, worker=job.worker,
        retry_of=job.retry_of, created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
        heartbeat_at=job.heartbeat_at, progress_at=job.progress_at,
        queued_s=((job.started_at or end) - job.created_at).total_seconds(), queue_position=_queue_position(job),
        run_s=(end - job.started_at).total_seconds() if job.started_at else None,
        timings=job.timings,
    )


def _common(row: Any) -> dict[str, Any]:
    return {
        "id": row.id, "params": row.params or {}, "status": status_of(row.job), "job_id": row.job_id,
        "job": job_out(row.job) if row.job is not None else None, "created_at": row.created_at,
        "notes": row.notes, "tags": list(row.tags or []),
    }


def shown_source(row: Model) -> str:
    """The model's source as the user gave it (``params.given``), not the server path the worker loads."""
    return str((row.params or {}).get("given") or row.source)


def model_out(row: Model) -> ModelOut:
    c = _common(row)
    c.pop("params")
    source = shown_source(row)
    info = row.summary
    if isinstance(info, dict) and "source" in info:  # the worker's description names what it loaded
        info = {**info, "source": source}
    return ModelOut(**c, name=row.name, source=source, kind=row.kind, trust_remote_code=row.trust_remote_code, info=info)


def calibration_out(row: CalibrationSet) -> CalibrationSetOut:
    return CalibrationSetOut(**_common(row), name=row.name, origin=row.origin, content_id=row.content_id, stats=row.summary)


def profile_out(row: Profile) -> ProfileOut:
    return ProfileOut(**_common(row), model_id=row.model_id, calibration_set_id=row.calibration_set_id, summary=row.summary)


def conversion_out(row: Conversion, layers: list[dict[str, Any]] | None = None, gguf: GgufCheck | None = None,
                   exports: list[ExportOut] | None = None) -> ConversionOut:
    from moelab.engine.methods import conversion_label, method_of, normalise_params

    common = {**_common(row), "params": normalise_params(row.params or {})}  # records from before the registry too
    return ConversionOut(
        **common, method=method_of(common["params"]), label=conversion_label(common["params"]), profile_id=row.profile_id,
        model_id=row.model_id, summary=row.summary, layers=layers, gguf=gguf, exports=exports or [],
    )


def export_out(row: Export, files: list[ArtifactFile] | None = None) -> ExportOut:
    """An export; its file's name, size and download URLs once its job has written it."""
    common = _common(row)
    summary = row.summary or {}
    ready = common["status"] == "ready"
    name = summary.get("file") if ready else None
    base = f"/api/v1/exports/{row.id}"
    return ExportOut(
        **common, conversion_id=row.conversion_id, format=row.format, type=row.type, summary=row.summary, file=name,
        bytes=summary.get("bytes") if ready else None, download_url=f"{base}/files/{name}" if name else None,
        archive_url=f"{base}/archive" if ready else None, files=files,
    )


def evaluation_out(row: Evaluation) -> EvaluationOut:
    return EvaluationOut(**_common(row), conversion_id=row.conversion_id, summary=row.summary)


def finetune_out(row: Finetune) -> FinetuneOut:
    return FinetuneOut(**_common(row), conversion_id=row.conversion_id, summary=row.summary,
                       result_conversion_id=row.result_conversion_id)


def probe_out(row: Probe) -> ProbeOut:
    return ProbeOut(**_common(row), conversion_id=row.conversion_id, summary=row.summary)


def activation_probe_out(row: ActivationProbe) -> ActivationProbeOut:
    return ActivationProbeOut(**_common(row), profile_id=row.profile_id, summary=row.summary)
