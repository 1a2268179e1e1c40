"""Sending jobs to the workers and revoking them, from the API (tasks are sent by name)."""

from __future__ import annotations

import logging

from celery import Celery

from moelab.store.broker import send_job

from moelab.store.db import Job

log = logging.getLogger("moelab.api")


class BrokerUnavailable(RuntimeError):
    """The job could not be queued; the message names the broker and what to do."""


class JobQueue:
    def __init__(self, celery: Celery) -> None:
        self.celery = celery

    def send(self, job: Job) -> None:
        try:
            send_job(self.celery, job.id, job.kind)
        except Exception as exc:  # kombu raises OperationalError and friends when Redis is down
            raise BrokerUnavailable(
                f"could not queue the job: the broker at {self.celery.conf.broker_url} is unreachable "
                f"({type(exc).__name__}: {exc}); start Redis (or `moelab serve`) and retry the job"
            ) from exc

    def revoke(self, job_id: str) -> None:
        """Best effort: the worker also checks the job row before it starts and while it runs."""
        try:
            self.celery.control.revoke(job_id)
        except Exception as exc:
            log.warning("revoke %s not broadcast (%s); the job row's cancel flag still applies", job_id, exc)
