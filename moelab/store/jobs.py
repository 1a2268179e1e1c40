"""The job state machine, shared by the API and the workers.

    queued ──claim──▶ running ──finish──▶ succeeded | failed | cancelled
       └──cancel (before it started)──▶ cancelled

Every transition is one conditional ``UPDATE … WHERE state = …``, so the API cancelling a
queued job and a worker claiming it cannot both win, and a message Redis redelivers for a job
that already ended is recognised and skipped. A running job's worker writes ``heartbeat_at``
every few seconds; :func:`reap_stale` fails running jobs whose heartbeat stopped (the worker
died), so no job stays "running" forever.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from .db import Job, utcnow

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
TERMINAL = (SUCCEEDED, FAILED, CANCELLED)


def new_id(prefix: str) -> str:
    """Opaque ids (``job-…``, ``pr-…``): never derived from user input, safe as artifact keys."""
    return f"{prefix}-{secrets.token_hex(8)}"


def new_job(session: Session, kind: str, queue: str, resource_type: str, resource_id: str, retry_of: str | None = None) -> Job:
    job = Job(
        id=new_id("job"), kind=kind, queue=queue, resource_type=resource_type, resource_id=resource_id,
        state=QUEUED, retry_of=retry_of, created_at=utcnow(),
    )
    session.add(job)
    return job


def claim(session: Session, job_id: str, worker: str) -> bool:
    """queued → running for this worker; False when the job is not queued (cancelled, ended, redelivered)."""
    now = utcnow()
    res = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == QUEUED)
        .values(state=RUNNING, started_at=now, heartbeat_at=now, worker=worker, stage="starting")
    )
    session.commit()
    return res.rowcount == 1


def beat(session: Session, job_id: str) -> None:
    session.execute(update(Job).where(Job.id == job_id, Job.state == RUNNING).values(heartbeat_at=utcnow()))
    session.commit()


def record_progress(session: Session, job_id: str, stage: str, current: int, total: int, new_stage: bool = False) -> None:
    """Write the engine's ``(stage, current, total)``; ``new_stage`` starts the stage's clock (``stage_at``)."""
    now = utcnow()
    values: dict[str, Any] = {"stage": stage[:200], "current": int(current), "total": int(total), "progress_at": now, "heartbeat_at": now}
    if new_stage:
        values["stage_at"] = now
    session.execute(update(Job).where(Job.id == job_id, Job.state == RUNNING).values(**values))
    session.commit()


def touch_progress(session: Session, job_id: str) -> None:
    """The stage still runs: ``progress_at`` moves (the job answers how long its stage has taken) while
    one engine step has no natural point to report from (a model loading, one large layer clustering)."""
    now = utcnow()
    session.execute(update(Job).where(Job.id == job_id, Job.state == RUNNING).values(progress_at=now, heartbeat_at=now))
    session.commit()


def cancel_requested(session: Session, job_id: str) -> bool:
    return bool(session.execute(select(Job.cancel_requested).where(Job.id == job_id)).scalar())


def running_with_cancel(session: Session, job_id: str) -> tuple[bool, bool]:
    """``(running, cancel_requested)`` of job ``job_id`` in one read (``(False, False)`` for no such job)."""
    row = session.execute(select(Job.state, Job.cancel_requested).where(Job.id == job_id)).one_or_none()
    return (False, False) if row is None else (row[0] == RUNNING, bool(row[1]))


def finish(
    session: Session, job_id: str, state: str, *, error: str | None = None, error_type: str | None = None,
    timings: dict[str, Any] | None = None,
) -> bool:
    """running → a terminal state. False if the job was no longer running (e.g. already reaped)."""
    assert state in TERMINAL
    res = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == RUNNING)
        .values(state=state, finished_at=utcnow(), error=error, error_type=error_type, timings=timings)
    )
    return res.rowcount == 1


def request_cancel(session: Session, job: Job) -> Job:
    """Cancel a queued job at once; ask a running one to stop at its next progress check."""
    now = utcnow()
    if job.state == QUEUED:
        res = session.execute(
            update(Job)
            .where(Job.id == job.id, Job.state == QUEUED)
            .values(state=CANCELLED, cancel_requested=True, finished_at=now, error="cancelled before it started",
                    error_type="cancelled")
        )
        if res.rowcount == 1:
            session.commit()
            session.refresh(job)
            return job
        session.refresh(job)  # a worker claimed it meanwhile: fall through to the running case
    if job.state == RUNNING:
        session.execute(update(Job).where(Job.id == job.id).values(cancel_requested=True))
        session.commit()
        session.refresh(job)
    return job


def stale_reason(job: Job, timeout_s: float, now: datetime) -> str:
    last = job.heartbeat_at or job.started_at
    age = (now - last).total_seconds() if last else float("inf")
    return (
        f"worker {job.worker or '?'} stopped sending heartbeats {age:.0f} s ago (limit {timeout_s:.0f} s) while the job "
        f"was at stage {job.stage!r} {job.current}/{job.total}: the worker process died or lost its database "
        "connection. Check the worker's log (out of memory?), make sure a worker is running, then re-run the job "
        "with POST /api/v1/jobs/{id}/retry".replace("{id}", job.id)
    )


def reap_stale(session: Session, timeout_s: float, job_id: str | None = None) -> list[str]:
    """Fail running jobs whose heartbeat is older than ``timeout_s``; returns their ids."""
    now = utcnow()
    cutoff = now - timedelta(seconds=timeout_s)
    query = select(Job).where(Job.state == RUNNING, Job.heartbeat_at < cutoff)
    if job_id is not None:
        query = query.where(Job.id == job_id)
    reaped = []
    for job in session.execute(query).scalars().all():
        res = session.execute(
            update(Job)
            .where(Job.id == job.id, Job.state == RUNNING, Job.heartbeat_at < cutoff)
            .values(state=FAILED, finished_at=now, error=stale_reason(job, timeout_s, now), error_type="worker_lost")
        )
        if res.rowcount == 1:
            reaped.append(job.id)
    session.commit()
    return reaped


def fail_jobs_of(session: Session, worker: str, reason: Callable[[Job], str]) -> list[str]:
    """Fail the jobs marked running under ``worker`` (a worker known to be dead), each with
    ``reason(job)``; returns their ids. Conditional per row, like every transition."""
    now = utcnow()
    failed = []
    for job in session.execute(select(Job).where(Job.state == RUNNING, Job.worker == worker)).scalars().all():
        res = session.execute(
            update(Job)
            .where(Job.id == job.id, Job.state == RUNNING)
            .values(state=FAILED, finished_at=now, error_type="worker_lost", error=reason(job))
        )
        if res.rowcount == 1:
            failed.append(job.id)
    session.commit()
    return failed


def fail_jobs_of_dead_workers(session: Session, dead_workers: Callable[[set[str]], set[str]]) -> list[str]:
    """Fail the running jobs of the workers that ``dead_workers`` (given the workers that run jobs)
    says are gone, e.g. :func:`moelab.store.liveness.dead_workers`; returns the jobs' ids."""
    running = set(session.execute(select(Job.worker).where(Job.state == RUNNING).distinct()).scalars()) - {None}
    failed: list[str] = []
    for worker in sorted(dead_workers(running)) if running else []:
        failed += fail_jobs_of(session, worker, lambda job, worker=worker: (
            f"the process of worker {worker} ended while this job was running at stage {job.stage!r} "
            f"{job.current}/{job.total} (its connection to the broker closed): it was killed, often by the kernel's "
            "out-of-memory killer (see `dmesg`), or crashed (see its log). Make sure a worker is running, then re-run "
            f"the job with POST /api/v1/jobs/{job.id}/retry"
        ))
    return failed


def fail_orphans_of(session: Session, worker: str) -> list[str]:
    """A worker (re)starting under a name fails the jobs still marked running under that name."""
    return fail_jobs_of(session, worker, lambda job: (
        f"worker {worker} restarted while this job was running (it crashed or was killed) at stage {job.stage!r} "
        f"{job.current}/{job.total}; re-run the job with POST /api/v1/jobs/{job.id}/retry"
    ))
