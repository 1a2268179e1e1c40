"""The SQL store is the truth for jobs: re-send every job that is ``queued`` in SQL but whose
message the broker no longer holds.

Why: a Redis that restarts without persistence (or loses its last second of AOF, or is
replaced) forgets queued messages, and the job rows would stay ``queued`` forever while new
jobs run. Workers call :func:`requeue_lost` when they start and every ``requeue_interval_s``.

Re-sending is safe because a job runs only after :func:`moelab.store.jobs.claim` moved its row
``queued → running`` in one conditional update: a second message for the same job (the broker
kept the first after all, or two sweeps raced) finds the row no longer queued and is skipped.

What counts as "held by the broker" (kombu's Redis layout, every key under ``redis_prefix``):

* a message waiting in a queue list (``gpu``, ``cpu`` and their priority lists), or
* a message delivered to a worker and not yet acknowledged (``unacked``) less than
  ``grace_s`` ago: a worker claims its job right after delivery, so a job still ``queued`` whose
  message was delivered longer ago than that was lost with the worker that took it.

Jobs younger than ``grace_s`` are left alone: the API commits the row before it sends the
message, and a sweep in between must not count that as lost (a duplicate would be harmless,
only noisy).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from .db import Job, utcnow
from .jobs import QUEUED

log = logging.getLogger("moelab.requeue")

#: kombu's Redis transport: priority lists are ``queue + SEP + priority`` (priority 0 is the bare name)
_SEP = "\x06\x16"
_PRIORITIES = (0, 3, 6, 9)
GRACE_S = 5.0
_LOCK = "requeue-lock"


def _task_id(raw: bytes | str) -> str | None:
    """The Celery task id (= job id) of a stored kombu message, or None when it is not one of ours."""
    try:
        payload = json.loads(raw)
        if isinstance(payload, list):  # an ``unacked`` entry: [message, exchange, routing_key]
            payload = payload[0]
        return str(payload["headers"]["id"])
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def broker_job_ids(client: redis.Redis, prefix: str, queues: Iterable[str], grace_s: float = GRACE_S) -> set[str]:
    """Ids of the jobs whose message Redis holds: waiting in a queue, or delivered within ``grace_s``."""
    held: set[str] = set()
    for queue in queues:
        for pri in _PRIORITIES:
            key = f"{prefix}{queue}" if pri == 0 else f"{prefix}{queue}{_SEP}{pri}"
            held.update(filter(None, map(_task_id, client.lrange(key, 0, -1))))
    recent = client.zrangebyscore(f"{prefix}unacked_index", time.time() - grace_s, "+inf")
    if recent:
        held.update(filter(None, map(_task_id, filter(None, client.hmget(f"{prefix}unacked", recent)))))
    return held


def lost_jobs(session: Session, held: set[str], grace_s: float = GRACE_S) -> list[Job]:
    """Queued jobs (older than ``grace_s``) whose message is not in ``held``, oldest first."""
    cutoff = utcnow() - timedelta(seconds=grace_s)
    rows = session.execute(
        select(Job).where(Job.state == QUEUED, Job.created_at < cutoff).order_by(Job.created_at)
    ).scalars().all()
    return [job for job in rows if job.id not in held]


def requeue_lost(
    session: Session, client: redis.Redis, prefix: str, queues: Iterable[str], send: Callable[[Job], None],
    *, grace_s: float = GRACE_S, lock_s: float = 5.0, owner: str = "?",
) -> list[str]:
    """Re-send every lost queued job with ``send``; returns their ids.

    One sweeper at a time across all workers (a Redis lock held for ``lock_s``), so N workers do
    not send N copies; a copy that slips through is skipped by ``claim`` anyway.
    """
    if not session.execute(select(Job.id).where(Job.state == QUEUED).limit(1)).first():
        return []  # the common case: nothing queued, nothing to read from Redis
    if not client.set(f"{prefix}{_LOCK}", owner, nx=True, px=max(100, int(lock_s * 1000))):
        return []
    held = broker_job_ids(client, prefix, queues, grace_s)
    sent = []
    for job in lost_jobs(session, held, grace_s):
        send(job)
        sent.append(job.id)
        log.warning("job %s was queued in the SQL store but not in the broker: sent again", job.id)
    return sent
