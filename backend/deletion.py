"""``DELETE /api/v1/<resource>/{id}``: the one implementation every resource's route calls.

Without ``cascade`` a resource that something depends on is refused with 409 naming the
dependants; with it the whole tree goes. Jobs of what is deleted are cancelled first: a queued job
at once, a running one is asked to stop and awaited (a worker stops within
``MOELAB_CANCEL_POLL_S`` plus one engine step) for up to ``WAIT_S``, so no worker keeps writing
into a resource that no longer exists. Only then are the rows deleted (one transaction) and the
artifacts removed (atomically, each).

A DELETE of a resource that another request is deleting at that moment does not wait on the first
one (eight clients deleting the same evaluation would hold eight API threads for up to ``WAIT_S``):
it answers 202 at once, saying the resource is being deleted (``DeleteGuard``: this process's set,
and a Redis key that API processes sharing the broker see).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from moelab.store import jobs
from moelab.store.artifacts import ArtifactStore
from moelab.store.db import Job
from moelab.store.deletion import RESOURCES, Node, delete_rows, dependants, export_node, remove_artifacts, tree

from .errors import ApiError, not_found
from .queue import JobQueue
from .schemas import DeletedRef, DeleteOut

log = logging.getLogger("moelab.api")

#: how long a DELETE waits for the running jobs it cancelled to stop before answering 409
WAIT_S = 15.0
_LISTING = {"models": "models", "calibration_sets": "calibration-sets", "profiles": "profiles",
            "conversions": "conversions", "evaluations": "evaluations", "finetunes": "finetunes", "probes": "probes",
            "activation_probes": "activation-probes", "exports": "exports"}


class DeleteGuard:
    """Which resources a DELETE is working on now: in this process (a set under a lock) and, when a
    Redis client is given, across API processes (``SET NX`` with an expiry, so a killed process's
    claim lapses). A broker that does not answer only loses the cross-process part."""

    def __init__(self, redis: Any = None, prefix: str = "moelab:", ttl_s: float = WAIT_S + 60) -> None:
        self.redis, self.prefix, self.ttl_ms = redis, prefix, int(ttl_s * 1000)
        self._lock = threading.Lock()
        self._busy: dict[tuple[str, str], float] = {}

    def _key(self, resource_type: str, ident: str) -> str:
        return f"{self.prefix}deleting:{resource_type}:{ident}"

    @contextmanager
    def hold(self, resource_type: str, ident: str, what: str) -> Iterator[None]:
        """Hold ``resource_type``/``ident`` for the block; ``ApiError(202)`` if someone else holds it."""
        item = (resource_type, ident)
        with self._lock:
            started = self._busy.get(item)
            if started is None:
                self._busy[item] = time.monotonic()
        if started is not None:
            raise _being_deleted(what, ident, resource_type, time.monotonic() - started)
        claimed = False
        try:
            if self.redis is not None:
                try:
                    claimed = bool(self.redis.set(self._key(*item), str(time.time()), nx=True, px=self.ttl_ms))
                    if not claimed:
                        raise _being_deleted(what, ident, resource_type, None)
                except ApiError:
                    raise
                except Exception as exc:  # the broker is down: this process's guard still holds
                    log.debug("delete guard without Redis: %s", exc)
            yield
        finally:
            with self._lock:
                self._busy.pop(item, None)
            if claimed:
                try:
                    self.redis.delete(self._key(*item))
                except Exception:  # it expires on its own
                    pass


def _being_deleted(what: str, ident: str, resource_type: str, since_s: float | None) -> ApiError:
    ago = f" (started {since_s:.0f} s ago)" if since_s is not None else ""
    return ApiError(202, f"{what} {ident} is being deleted by another request{ago}; it is gone once "
                         f"GET /api/v1/{_LISTING[resource_type]}/{ident} answers 404 (a few seconds; up to {WAIT_S:.0f} s "
                         "while its running job stops)")


#: used when the app configured none (a queue built outside ``create_app``)
_LOCAL_GUARD = DeleteGuard()


def _names(nodes: list[Node], limit: int = 20) -> str:
    shown = ", ".join(n.describe() for n in nodes[:limit])
    return shown + (f" and {len(nodes) - limit} more" if len(nodes) > limit else "")


def _cancel_jobs(session: Session, queue: JobQueue, nodes: list[Node]) -> tuple[list[str], list[str]]:
    """Cancel the queued/running latest job of every node; returns (cancelled or asked, still running)."""
    asked, running = [], []
    for node in nodes:
        row = session.get(RESOURCES[node.type][0], node.id)
        job = row.job if row is not None else None
        if job is None or job.state not in (jobs.QUEUED, jobs.RUNNING) or job.id in asked:
            continue
        job = jobs.request_cancel(session, job)
        queue.revoke(job.id)
        asked.append(job.id)
        if job.state == jobs.RUNNING:
            running.append(job.id)
    return asked, running


def _wait_ended(session: Session, job_ids: list[str], wait_s: float) -> list[str]:
    """Job ids of ``job_ids`` still running after up to ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    pending = list(job_ids)
    while pending:
        session.commit()  # no snapshot: read what the workers wrote since
        states = dict(session.execute(select(Job.id, Job.state).where(Job.id.in_(pending))).all())
        pending = [j for j in pending if states.get(j) == jobs.RUNNING]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    return pending


def delete_resource(session: Session, queue: JobQueue, store: ArtifactStore, resource_type: str, ident: str,
                    cascade: bool, wait_s: float = WAIT_S) -> DeleteOut:
    table, what, _kind = RESOURCES[resource_type]
    if session.get(table, ident) is None:
        raise not_found(what, ident, _LISTING[resource_type])
    guard: DeleteGuard = getattr(queue, "delete_guard", None) or _LOCAL_GUARD
    with guard.hold(resource_type, ident, what):
        return _delete(session, queue, store, resource_type, ident, cascade, wait_s)


def _delete(session: Session, queue: JobQueue, store: ArtifactStore, resource_type: str, ident: str,
            cascade: bool, wait_s: float) -> DeleteOut:
    table, what, _kind = RESOURCES[resource_type]
    session.commit()  # end the read so far: a DELETE that just finished under the guard is seen
    if session.get(table, ident, populate_existing=True) is None:
        raise not_found(what, ident, _LISTING[resource_type])
    root = export_node(session, ident) if resource_type == "exports" else Node(resource_type, ident)
    if not cascade:
        direct = dependants(session, root)
        if direct:
            whole = tree(session, root)[:-1]
            more = f" ({len(whole)} resources in all, counting what depends on those)" if len(whole) > len(direct) else ""
            raise ApiError(
                409, f"{what} {ident} is used by {_names(direct)}{more}; delete those first, or repeat with "
                f"?cascade=true to delete {what} {ident} together with everything that depends on it",
            )
    nodes = tree(session, root)
    asked, running = _cancel_jobs(session, queue, nodes)
    still = _wait_ended(session, running, wait_s)
    if still:
        raise ApiError(
            409, f"{what} {ident} was not deleted: job(s) {', '.join(still)} are still running after {wait_s:.0f} s; "
            "they were asked to cancel and will end as cancelled — repeat the DELETE in a few seconds",
        )
    try:
        delete_rows(session, nodes)
        session.commit()  # rows first: an artifact without a row is never served; the reverse would read as broken
    except IntegrityError as exc:  # a dependant was created meanwhile (its foreign key holds the row)
        session.rollback()
        raise ApiError(409, f"{what} {ident} was not deleted: something started using it while it was being deleted; "
                            "repeat the DELETE (with ?cascade=true to remove the new dependant too)") from exc
    removed = remove_artifacts(store, nodes)
    return DeleteOut(deleted=[DeletedRef(type=n.type, id=n.id) for n in nodes], cancelled_jobs=asked,
                     artifacts_removed=removed)
