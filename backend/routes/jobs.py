"""Jobs: follow (state, progress, timings, error), cancel, and re-run."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from sqlalchemy import func, select

from moelab.store import jobs
from moelab.store.db import RESOURCE_TABLES, Job
from ..deps import OffsetQ, QueueDep, SessionDep, encoded, launch, lookup
from ..errors import ApiError
from ..schemas import JobKind, JobList, JobOut, JobState
from ..views import job_out

router = APIRouter(prefix="/jobs", tags=["jobs"])


def _reap(request: Request, session, job_id: str | None = None) -> None:
    jobs.reap_stale(session, request.app.state.settings.heartbeat_timeout_s, job_id)


@router.get("", response_model=JobList, summary="Jobs, newest first")
def list_jobs(
    request: Request, session: SessionDep,
    state: JobState | None = None, kind: JobKind | None = None,
    resource_id: Annotated[str | None, Query(max_length=40)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100, offset: OffsetQ = 0,
) -> Response:
    _reap(request, session)
    query = select(Job)
    if state:
        query = query.where(Job.state == state)
    if kind:
        query = query.where(Job.kind == kind)
    if resource_id:
        query = query.where(Job.resource_id == resource_id)
    total = session.execute(select(func.count()).select_from(query.subquery())).scalar_one()
    rows = session.execute(query.order_by(Job.created_at.desc()).limit(limit).offset(offset)).scalars().all()
    return encoded(JobList(items=[job_out(j) for j in rows], total=total))  # encoded here: no second thread-pool trip


@router.get("/{job_id}", response_model=JobOut, summary="State, progress {stage,current,total}, timings, error")
def get_job(job_id: str, request: Request, session: SessionDep) -> Response:
    lookup(session, Job, job_id, "job", "jobs")
    _reap(request, session, job_id)
    job = session.get(Job, job_id)
    session.refresh(job)
    return encoded(job_out(job))  # polled by the UI: encoded here, no second thread-pool trip


@router.delete(
    "/{job_id}", response_model=JobOut, status_code=202,
    responses={200: {"model": JobOut, "description": "already cancelled"}, 409: {}},
    summary="Cancel: a queued job at once, a running one at its next progress step",
)
def cancel_job(job_id: str, response: Response, session: SessionDep, queue: QueueDep) -> JobOut:
    job = lookup(session, Job, job_id, "job", "jobs")
    if job.state == jobs.CANCELLED:
        response.status_code = 200
        return job_out(job)
    if job.state in (jobs.SUCCEEDED, jobs.FAILED):
        raise ApiError(409, f"job {job_id} already {job.state}; only queued or running jobs can be cancelled")
    job = jobs.request_cancel(session, job)
    queue.revoke(job_id)
    if job.state == jobs.CANCELLED:
        response.status_code = 200
    return job_out(job)


@router.post("/{job_id}/retry", response_model=JobOut, status_code=202, responses={409: {}},
             summary="Re-run a failed or cancelled job (a new job for the same resource)")
def retry_job(job_id: str, session: SessionDep, queue: QueueDep) -> JobOut:
    job = lookup(session, Job, job_id, "job", "jobs")
    if job.state not in (jobs.FAILED, jobs.CANCELLED):
        raise ApiError(409, f"job {job_id} is {job.state}; only failed or cancelled jobs can be re-run")
    row = session.get(RESOURCE_TABLES[job.resource_type], job.resource_id)
    if row is None:
        raise ApiError(409, f"the {job.resource_type} {job.resource_id} of job {job_id} no longer exists")
    if row.job_id != job.id:
        raise ApiError(409, f"job {job_id} is not the latest job of {job.resource_id} (that is {row.job_id}); retry that one")
    new = launch(session, queue, row, job.resource_type, job.kind, retry_of=job.id)
    return job_out(new)
