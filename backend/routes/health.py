"""Liveness of the API and what it depends on (database, broker, workers)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from sqlalchemy import func, select

from moelab.store import liveness

from moelab.store.db import Job
from ..deps import SessionDep
from ..schemas import HealthOut

router = APIRouter(tags=["health"])


def _version() -> str:
    try:
        return version("moelab")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"


@router.get("/health", response_model=HealthOut, summary="Is the service up; are the database, broker and workers?")
def health(request: Request, session: SessionDep) -> HealthOut:
    state = request.app.state
    database = broker = "ok"
    workers: list[str] = []
    counts: dict[str, int] = {"queued": 0, "running": 0}
    try:
        rows = session.execute(
            select(Job.state, func.count()).where(Job.state.in_(("queued", "running"))).group_by(Job.state)
        ).all()
        counts.update({s: int(n) for s, n in rows})
    except Exception as exc:  # a health check reports, it does not fail
        database = f"error: {type(exc).__name__}: {exc}"
    try:
        client = state.redis
        client.ping()
        workers = liveness.alive(client, state.settings.redis_prefix)
    except Exception as exc:
        broker = f"error: {type(exc).__name__}: {exc}"
    status = "ok" if database == "ok" and broker == "ok" else "degraded"
    return HealthOut(status=status, version=_version(), database=database, broker=broker, workers=workers, jobs=counts)
