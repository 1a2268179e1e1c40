"""The FastAPI application: ``create_app()`` wires settings, the SQL store, the artifact
store and the job queue into the routers under ``/api/v1`` (OpenAPI UI at ``/docs``).

Run by hand: ``uvicorn backend.app:create_app --factory --host 127.0.0.1 --port 8000``.
While it runs, a background loop fails running jobs whose worker stopped heartbeating
(``moelab.store.jobs.reap_stale``), so a job of a dead worker ends within
``heartbeat_timeout_s + reaper_interval_s`` even when nobody polls it, and within
``reaper_interval_s`` when the worker's process ended on a host whose sockets the kernel closed
(its named Redis connection is gone: ``moelab.store.liveness.dead_workers``).
"""

from __future__ import annotations

import asyncio

import anyio.to_thread
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from moelab.settings import Settings, get_settings
from moelab.store import liveness
from moelab.store.broker import broker_url, make_celery

from moelab.store import jobs

from . import errors
from moelab.store.artifacts import ArtifactStore, artifacts_label
from moelab.store.db import Database
from .deps import token_refusal
from .limits import BodySizeLimit, StorableUrl, send_error
from .queue import JobQueue
from .routes import api_router
from .routes.artifacts import DownloadSlots
from .deletion import DeleteGuard

log = logging.getLogger("moelab.api")

DESCRIPTION = """\
Turn dense GLU language models into Mixture-of-Experts models, and see why.

Resources: **models** → **calibration sets** → **profiles** → **conversions** → **evaluations**;
**fine-tunes** recover a conversion's quality and publish the result as a new conversion.
Creating a profile, conversion or evaluation returns **202** with a job; follow it at
`GET /api/v1/jobs/{id}` (state, progress `{stage,current,total}`), cancel it with `DELETE`.
Charts are read from stored artifacts (no model work in a request). Errors are
`{"detail": "what was wrong and what to do"}`. When the server sets `MOELAB_API_TOKEN`, every
request except `GET /api/v1/health` and these docs needs `Authorization: Bearer <token>` (reads too).
`DELETE` on a resource removes it (409 naming its dependants; `?cascade=true` removes them too); a `DELETE`
of what another request is deleting answers **202** at once. A full disk is **507** Insufficient Storage
(a job fails with `error_type` `storage`); `GET /api/v1/health` reports free space.
"""


async def _reaper(app: FastAPI) -> None:
    settings: Settings = app.state.settings
    while True:
        try:
            def reap() -> list[str]:
                with app.state.db.session() as session:
                    return jobs.reap_stale(session, settings.heartbeat_timeout_s)

            def reap_dead() -> list[str]:  # the worker's named Redis connection closed: its process ended
                with app.state.db.session() as session:
                    return jobs.fail_jobs_of_dead_workers(
                        session, lambda workers: liveness.dead_workers(app.state.redis, settings.redis_prefix, workers))

            for job_id in await run_in_threadpool(reap):
                log.warning("job %s failed: its worker stopped heartbeating", job_id)
            try:
                for job_id in await run_in_threadpool(reap_dead):
                    log.warning("job %s failed: its worker's process ended", job_id)
            except Exception as exc:  # the broker is down: the heartbeat timeout above still applies
                log.debug("dead-worker check skipped: %s", exc)
        except Exception:  # the loop must survive a database hiccup
            log.exception("reaper pass failed")
        await asyncio.sleep(settings.reaper_interval_s)


#: paths under /api/v1 open without the token (probes, load balancers)
OPEN_PATHS = frozenset({"/api/v1/health"})


class TokenGate:
    """With ``MOELAB_API_TOKEN`` set, a request under ``/api/v1`` (but ``/health``) without the right
    token is answered 401 from its headers alone: its body (an upload of 49 MB) is never read.
    The routes' ``require_token`` dependency checks the same again (defence in depth)."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = self.settings.token()
        path = scope.get("path", "")
        if (token is None or scope["type"] != "http" or not path.startswith("/api/v1/") or path in OPEN_PATHS
                or scope.get("method") == "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1").strip()
        scheme, _, credentials = auth.partition(" ")
        given = credentials.strip() if scheme.lower() == "bearer" and credentials.strip() else headers.get(b"x-api-token", b"").decode("latin-1")
        problem = token_refusal(token, given)
        if problem:
            await send_error(send, 401, problem, [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class UploadSpaceCheck:
    """An upload (a multipart body) whose declared ``Content-Length`` exceeds the free space of the
    artifacts' disk is refused 507 before its body is read: it could not be stored anyway."""

    def __init__(self, app: ASGIApp, store: ArtifactStore) -> None:
        self.app, self.store = app, store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") in ("POST", "PUT"):
            headers = dict(scope.get("headers") or [])
            declared = headers.get(b"content-length", b"")
            if declared.isdigit() and headers.get(b"content-type", b"").startswith(b"multipart/"):
                free = self.store.free_bytes()
                if free is not None and int(declared) > free:
                    detail = self.store.no_space_message(int(declared), "this upload")
                    log.error("%s %s refused: %s", scope.get("method"), scope.get("path"), detail)
                    await send_error(send, 507, detail)
                    return
        await self.app(scope, receive, send)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    anyio.to_thread.current_default_thread_limiter().total_tokens = app.state.settings.api_threads
    await run_in_threadpool(app.state.db.init)
    app.state.store.ensure()
    app.state.store.cleanup()
    task = asyncio.create_task(_reaper(app))
    try:
        yield
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        app.state.db.dispose()


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(
        title="moelab", version="1", description=DESCRIPTION, lifespan=lifespan, docs_url="/docs",
        openapi_url="/openapi.json",
    )
    app.state.settings = settings
    app.state.db = Database(settings.resolved_database_url())
    app.state.store = ArtifactStore(settings.resolved_artifacts_dir(), label=artifacts_label(settings))
    app.state.queue = JobQueue(make_celery(settings))
    app.state.redis = liveness.client_for(broker_url(settings))
    app.state.download_slots = DownloadSlots(settings.max_concurrent_downloads)
    # a DELETE of what another request is deleting answers at once (this process, and others sharing the Redis)
    app.state.queue.delete_guard = DeleteGuard(app.state.redis, settings.redis_prefix)
    # the last added runs first: the token, then free space, then the size limit, all before the body is read
    app.add_middleware(StorableUrl)
    app.add_middleware(BodySizeLimit, limit_bytes=int(settings.max_upload_mb * 1e6))
    app.add_middleware(UploadSpaceCheck, store=app.state.store)
    app.add_middleware(TokenGate, settings=settings)
    errors.install(app)
    app.include_router(api_router())

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = errors.document_errors(FastAPI.openapi(app))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
