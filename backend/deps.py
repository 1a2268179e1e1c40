"""Dependencies injected into routes: the DB session, the store, the queue, the token check,
and lookups that turn an unknown id into a 404 that says where to find valid ones."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Path, Query, Request, Response, Security
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from moelab.settings import Settings

from moelab.store import jobs
from moelab.store.artifacts import ArtifactStore
from moelab.store.db import Job
from .errors import ApiError, not_found
from .queue import BrokerUnavailable, JobQueue
from .schemas import MAX_INT

_bearer = HTTPBearer(auto_error=False, description="needed on every request but /health when the server sets MOELAB_API_TOKEN")


# The dependencies below are ``async def`` although they await nothing: FastAPI runs a plain ``def``
# dependency in its thread pool, and under 50 concurrent clients those hops (two per generator
# dependency, one per function) cost more than the work itself. None of them blocks: the session
# is created without a connection and closing it returns a pooled one.


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_store(request: Request) -> ArtifactStore:
    return request.app.state.store


async def get_queue(request: Request) -> JobQueue:
    return request.app.state.queue


async def get_session(request: Request) -> AsyncIterator[Session]:
    with request.app.state.db.session() as session:
        yield session
        if session.new or session.dirty or session.deleted:  # unflushed writes: the commit may wait on disk
            await run_in_threadpool(session.commit)


async def require_token(request: Request, credentials: HTTPAuthorizationCredentials | None = Security(_bearer)) -> None:
    """With ``MOELAB_API_TOKEN`` set, every request must carry it (Bearer or X-API-Token), reads included:
    artifacts are converted weights, samples are the user's text and job errors name server paths.
    Only ``/api/v1/health`` (probes) and the OpenAPI docs are open; they are not behind this dependency."""
    token = request.app.state.settings.token()
    if token is None:
        return
    given = credentials.credentials if credentials is not None else request.headers.get("x-api-token")
    problem = token_refusal(token, given)
    if problem:
        raise ApiError(401, problem, headers={"WWW-Authenticate": "Bearer"})


def token_refusal(token: str, given: str | None) -> str | None:
    """Why a request carrying ``given`` may not pass a server whose token is ``token`` (None: it may);
    compared in constant time. Shared by ``require_token`` and ``app.TokenGate``."""
    if not given:
        return ("this server requires an API token: send 'Authorization: Bearer <MOELAB_API_TOKEN>' "
                "(or 'X-API-Token: <token>') with every request")
    if not secrets.compare_digest(given.encode(), token.encode()):
        return "wrong API token: send the server's MOELAB_API_TOKEN as 'Authorization: Bearer <token>'"
    return None


def encoded(model: BaseModel) -> Response:
    """``model`` as the JSON body FastAPI would send for it as the route's ``response_model``, encoded
    here, in the thread that built it. Returned from a plain ``def`` route, this saves FastAPI's second
    trip through the thread pool: it validates a returned model there again (after dumping it) before
    encoding it, and under 50 concurrent clients that second wait behind the busy threads doubled the
    latency of every such GET. The route keeps ``response_model`` for the OpenAPI schema."""
    return Response(model.__pydantic_serializer__.to_json(model, by_alias=True), media_type="application/json")


CascadeQ = Annotated[bool, Query(description="also delete everything that depends on it (otherwise such a resource is "
                                              "refused with 409 naming its dependants)")]
#: how many items of a list to skip (``?offset=``), bounded so that SQL's 64-bit OFFSET cannot overflow
OffsetQ = Annotated[int, Query(ge=0, le=MAX_INT, description="items to skip")]
#: a position (decoder layer, neuron) in the URL, bounded above so it cannot overflow; the route checks it against the
#: resource itself and says the valid range ("use 0 … 95"), negatives included
IndexPath = Annotated[int, Path(le=MAX_INT)]
TagQ = Annotated[str | None, Query(max_length=40, description="only resources carrying this tag (PATCH …/notes sets tags)")]
SessionDep = Annotated[Session, Depends(get_session)]
StoreDep = Annotated[ArtifactStore, Depends(get_store)]
QueueDep = Annotated[JobQueue, Depends(get_queue)]
SettingsDep = Annotated[Settings, Depends(get_settings)]

T = TypeVar("T")


def lookup(session: Session, table: type[T], ident: str, what: str, listing: str) -> T:
    row = session.get(table, ident)
    if row is None:
        raise not_found(what, ident, listing)
    return row


def launch(session: Session, queue: JobQueue, row: Any, resource_type: str, kind: str, retry_of: str | None = None) -> Job:
    """Create the job for ``row``, commit, then queue it (a worker must find the committed row).

    If the broker is down the job is recorded as failed (so nothing is left "queued" forever)
    and the client gets 503 with what to do.
    """
    from moelab.store.broker import TASKS

    job = jobs.new_job(session, kind, TASKS[kind][1], resource_type, row.id, retry_of=retry_of)
    row.job = job
    session.commit()
    try:
        queue.send(job)
    except BrokerUnavailable as exc:
        job.state, job.error, job.error_type, job.finished_at = jobs.FAILED, str(exc), "broker", jobs.utcnow()
        session.commit()
        raise ApiError(503, str(exc)) from exc
    return job


def require_ready(row: Any, what: str) -> None:
    """409 unless ``row``'s latest job succeeded, saying what happened to it."""
    job = row.job
    if job is None or job.state == jobs.SUCCEEDED:
        return
    if job.state in (jobs.QUEUED, jobs.RUNNING):
        raise ApiError(409, f"{what} {row.id} is still {job.state} (job {job.id}); wait until GET /api/v1/jobs/{job.id} says succeeded")
    reason = f": {job.error}" if job.error else ""
    raise ApiError(
        409, f"{what} {row.id} has no usable result: its job {job.id} {job.state}{reason}. "
        f"Re-run it with POST /api/v1/jobs/{job.id}/retry or create a new one",
    )


def with_tag(rows: Sequence[T], tag: str | None) -> list[T]:
    """The rows (table rows or response models) carrying ``tag``; all of them when None. Filtered
    here, not in SQL: JSON containment is spelled differently on SQLite and Postgres, and a
    collection is small enough to read whole."""
    if not tag:
        return list(rows)
    return [r for r in rows if tag in (getattr(r, "tags", None) or [])]
