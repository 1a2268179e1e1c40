"""What several resources of the API contract share: the request base class (``_In``), the notes and
tags every stored resource carries (``_Noted``), the job that makes a resource (``JobOut``, embedded in
every resource), what a ``DELETE`` removed, and the bounds and value types more than one module uses."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moelab.engine.text import first_text_problem

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
ResourceStatus = Literal["queued", "running", "ready", "failed", "cancelled"]
JobKind = Literal["inspect_model", "build_calibration", "profile", "conversion", "evaluation", "finetune", "probe", "activation_probe",
                  "export"]


class _In(BaseModel):
    """Request bodies refuse unknown fields: a typo (``alpha-max``) must not silently use a default.
    They refuse non-finite numbers too (``Infinity``, ``NaN``, ``1e999``): a bound like ``gt=0`` lets
    ``inf`` through, and the stored parameters would no longer be standard JSON.
    They refuse text a store would refuse later (a NUL, a lone surrogate: PostgreSQL, UTF-8 files) and
    take booleans as JSON booleans only (``"no"`` is not ``false``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _storable_text(cls, data: Any) -> Any:
        problem = first_text_problem(data)
        if problem:
            raise ValueError(problem)
        return data


#: the largest integer any parameter takes: JSON's exact range (IEEE doubles), so a JavaScript client can say every
#: accepted value, and far below the 64-bit limits of SQL (an ``OFFSET`` of 2**64 overflows SQLite) and torch seeds
MAX_INT = 2**53


class _Noted(BaseModel):
    """What every stored resource carries of its user's own: notes and tags (``PATCH`` sets them)."""

    notes: str | None = Field(None, description="the user's free-text notes on this resource")
    tags: list[str] = Field(default_factory=list, description="the user's labels, to find it again (lists filter by ?tag=)")


# --------------------------------------------------------------------------- jobs


class ProgressOut(BaseModel):
    stage: str | None = Field(None, description="what the engine is doing, e.g. 'profile' or 'cluster experts'")
    current: int = 0
    total: int = 0
    fraction: float | None = Field(None, description="current / total within the stage, when total > 0")
    stage_s: float | None = Field(None, description="seconds the present stage has run (or ran, once the job ended)")
    stage_left_s: float | None = Field(None, description="a running stage's time left at its pace so far (stage_s / current × "
                                       "(total − current)); stages ahead are not counted")


class JobOut(BaseModel):
    id: str = Field(description="job id; also the Celery task id")
    kind: JobKind
    state: JobState
    queue: str
    resource_type: str
    resource_id: str
    progress: ProgressOut
    cancel_requested: bool
    error: str | None = Field(None, description="why it failed or was cancelled, and what to do")
    error_type: str | None = Field(None, description="invalid_input | worker_lost | worker_shutdown | cancelled | out_of_memory | storage (no space left: an operator error) | internal")
    worker: str | None = None
    retry_of: str | None = Field(None, description="the job this one re-runs")
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    heartbeat_at: datetime | None = None
    progress_at: datetime | None = Field(None, description="when the worker last reported progress (at least every few seconds "
                                         "while it runs: MOELAB_PROGRESS_TICK_S)")
    queued_s: float | None = Field(None, description="seconds from creation to start (or until now)")
    queue_position: int | None = Field(None, description="a queued job's place in its queue's line (1: the next to start "
                                       "when a worker of that queue is free)")
    run_s: float | None = Field(None, description="seconds from start to end (or until now)")
    timings: dict[str, Any] | None = Field(None, description="engine timings of a finished job")


# --------------------------------------------------------------------------- deleting


class DeletedRef(BaseModel):
    type: Literal["models", "calibration_sets", "profiles", "conversions", "evaluations", "finetunes", "probes", "activation_probes",
                  "exports"]
    id: str


class DeleteOut(BaseModel):
    """What a ``DELETE`` removed: the resource, and with ``cascade=true`` everything that depended on it."""

    deleted: list[DeletedRef] = Field(description="removed resources, dependants first")
    cancelled_jobs: list[str] = Field(description="queued or running jobs of those resources that were cancelled first")
    artifacts_removed: int = Field(description="artifact directories removed")


# --------------------------------------------------------------------------- charts and profile comparisons

Num = float | None
