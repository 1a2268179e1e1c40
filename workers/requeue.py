"""The worker side of "the SQL store is the truth for jobs": when it starts and every
``requeue_interval_s`` a worker re-sends the queued jobs the broker lost
(:func:`moelab.store.requeue.requeue_lost`), e.g. after Redis restarted without its data.

It runs in the worker's presence thread with a Celery app of its own (its own broker
connections, none shared with the consumer); ``send_job`` declares the queues first, since a
Redis that lost its data lost kombu's queue bindings too.
"""

from __future__ import annotations

import logging
import time

import redis

from moelab.settings import Settings
from moelab.store.broker import CPU_QUEUE, GPU_QUEUE, make_celery, send_job
from moelab.store.db import Database, Job
from moelab.store.requeue import requeue_lost

log = logging.getLogger("moelab.worker")


class Requeuer:
    """Call :meth:`maybe_run` often; it sweeps at start and then every ``requeue_interval_s``."""

    def __init__(self, settings: Settings, db: Database, client: redis.Redis, owner: str) -> None:
        self.settings, self.db, self.client, self.owner = settings, db, client, owner
        self.app = make_celery(settings)
        self._next = 0.0

    def maybe_run(self) -> list[str]:
        now = time.monotonic()
        if now < self._next:
            return []
        self._next = now + self.settings.requeue_interval_s
        try:
            return self.run()
        except Exception as exc:  # the broker or the database may be down; the next pass retries
            log.warning("re-queue pass failed: %s: %s", type(exc).__name__, exc)
            self._next = now + min(self.settings.requeue_interval_s, 5.0)
            return []

    def run(self) -> list[str]:
        def send(job: Job) -> None:
            send_job(self.app, job.id, job.kind)  # declares the queues first

        with self.db.session() as session:
            return requeue_lost(
                session, self.client, self.settings.redis_prefix, (GPU_QUEUE, CPU_QUEUE), send,
                lock_s=min(self.settings.requeue_interval_s / 2, 10.0), owner=self.owner,
            )
