"""The FastAPI application: ``create_app()`` wires settings, the SQL store, the artifact
store and the job queue into the routers under ``/api/v1`` (OpenAPI UI at ``/docs``).

Run by hand: ``uvicorn backend.app:create_app --factory --host 127.0.0.1 --port 8000``.
While it runs, a background loop fails running jobs whose worker stopped heartbeating
(``backend.jobs.reap_stale``), so a job of a dead worker ends within
``heartbeat_timeout_s + reaper_interval_s`` even when nobody polls it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from moelab.settings import Settings, get_settings
from moelab.store import liveness
from moelab.store.broker import broker_url, make_celery

from moelab.store import jobs

from . import errors
from moelab.store.artifacts import ArtifactStore
from moelab.store.db import Database
from .limits import BodySizeLimit
from .queue import JobQueue
from .routes import api_router

log = logging.getLogger("moelab.api")

DESCRIPTION = """\
Turn dense GLU language models into Mixture-of-Experts models, and see why.

Resources: **models** → **calibration sets** → **profiles** → **conversions** → **evaluations**;
**fine-tunes** recover a conversion's quality and publish the result as a new conversion.
Creating a profile, conversion or evaluation returns **202** with a job; follow it at
`GET /api/v1/jobs/{id}` (state, progress `{stage,current,total}`), cancel it with `DELETE`.
Charts are read from stored artifacts (no model work in a request). Errors are
`{"detail": "what was wrong and what to do"}`. When the server sets `MOELAB_API_TOKEN`,
POST/DELETE need `Authorization: Bearer <token>`.
"""


async def _reaper(app: FastAPI) -> None:
    settings: Settings = app.state.settings
    while True:
        try:
            def reap() -> list[str]:
                with app.state.db.session() as session:
                    return jobs.reap_stale(session, settings.heartbeat_timeout_s)

            for job_id in await run_in_threadpool(reap):
                log.warning("job %s failed: its worker stopped heartbeating", job_id)
        except Exception:  # the loop must survive a database hiccup
            log.exception("reaper pass failed")
        await asyncio.sleep(settings.reaper_interval_s)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
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
    app.state.store = ArtifactStore(settings.resolved_artifacts_dir())
    app.state.queue = JobQueue(make_celery(settings))
    app.state.redis = liveness.client_for(broker_url(settings))
    app.add_middleware(BodySizeLimit, limit_bytes=int(settings.max_upload_mb * 1e6))
    errors.install(app)
    app.include_router(api_router())
    return app
