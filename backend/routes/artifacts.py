"""Artifacts: list what a finished job stored and download it (a file or the whole directory)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Generator
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, StreamingResponse
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from moelab.store.artifacts import KINDS, ArtifactMissing
from moelab.store.db import ActivationProbe, CalibrationSet, Conversion, Evaluation, Finetune, Job, Probe, Profile
from ..deps import SessionDep, StoreDep
from ..errors import ApiError
from ..schemas import ArtifactFile, ArtifactList, ArtifactOut, ArtifactSummary

router = APIRouter(prefix="/artifacts", tags=["artifacts"])

Kind = Literal["calibration-sets", "profiles", "conversions", "evaluations", "finetunes", "probes", "activation-probes"]
TABLES = {"calibration-sets": CalibrationSet, "profiles": Profile, "conversions": Conversion, "evaluations": Evaluation,
          "finetunes": Finetune, "probes": Probe, "activation-probes": ActivationProbe}
assert tuple(TABLES) == KINDS


def _url(kind: str, ident: str) -> str:
    return f"/api/v1/artifacts/{kind}/{ident}"


def _ready_row(session, kind: str, ident: str):
    row = session.get(TABLES[kind], ident)
    if row is None:
        raise ApiError(404, f"no {kind[:-1]} with id {ident!r}; list artifacts with GET /api/v1/artifacts")
    if row.job is not None and row.job.state != "succeeded":
        raise ApiError(409, f"{kind[:-1]} {ident} has no artifact: its job {row.job.id} is {row.job.state}")
    return row


@router.get("", response_model=ArtifactList, summary="Stored artifacts (of succeeded jobs and uploads)")
def list_artifacts(session: SessionDep, store: StoreDep, kind: Kind | None = None) -> ArtifactList:
    items = []
    for k in ([kind] if kind else KINDS):
        table = TABLES[k]
        rows = session.execute(
            select(table).outerjoin(Job, table.job_id == Job.id).where((table.job_id.is_(None)) | (Job.state == "succeeded"))
            .order_by(table.created_at.desc())
        ).scalars().unique().all()
        items += [ArtifactSummary(kind=k, id=r.id, url=_url(k, r.id)) for r in rows if store.exists(k, r.id)]
    return ArtifactList(items=items, total=len(items))


@router.get("/{kind}/{artifact_id}", response_model=ArtifactOut, responses={404: {}, 409: {}}, summary="Files of one artifact")
def artifact_files(kind: Kind, artifact_id: str, session: SessionDep, store: StoreDep) -> ArtifactOut:
    _ready_row(session, kind, artifact_id)
    try:
        files = store.files(kind, artifact_id)
    except ArtifactMissing as exc:
        raise ApiError(404, str(exc)) from exc
    base = _url(kind, artifact_id)
    return ArtifactOut(
        kind=kind, id=artifact_id, size=sum(f.size for f in files), archive_url=f"{base}/archive",
        files=[ArtifactFile(path=f.path, size=f.size, url=f"{base}/files/{f.path}",
                            modified=datetime.fromtimestamp(f.modified, timezone.utc)) for f in files],
    )


@router.get("/{kind}/{artifact_id}/files/{path:path}", response_class=FileResponse, responses={404: {}, 409: {}},
            summary="Download one file")
def download_file(kind: Kind, artifact_id: str, path: str, session: SessionDep, store: StoreDep) -> FileResponse:
    _ready_row(session, kind, artifact_id)
    try:
        full = store.file(kind, artifact_id, path)
    except ArtifactMissing as exc:
        raise ApiError(404, str(exc)) from exc
    return FileResponse(full, filename=Path(path).name)


class DownloadSlots:
    """At most ``limit`` archives stream at once (each holds a thread and a file handle per entry);
    one more is refused with 429 instead of queueing behind multi-GB downloads."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._sem = threading.BoundedSemaphore(limit)

    def try_acquire(self) -> bool:
        return self._sem.acquire(blocking=False)

    def release(self) -> None:
        self._sem.release()


def zip_response(request: Request, pieces: Generator[bytes, None, None], name: str) -> StreamingResponse:
    """A streamed zip download holding one of the app's download slots (429 when all are taken)."""
    slots: DownloadSlots = request.app.state.download_slots
    if not slots.try_acquire():
        raise ApiError(429, f"{slots.limit} archive downloads are running already (MOELAB_MAX_CONCURRENT_DOWNLOADS); "
                            "retry in a few seconds", headers={"Retry-After": "5"})
    return StreamingResponse(_stream(pieces, slots), media_type="application/zip",
                             headers={"Content-Disposition": f'attachment; filename="{name}.zip"'})


async def _stream(pieces: Generator[bytes, None, None], slots: DownloadSlots) -> AsyncIterator[bytes]:
    """Pull the zip's pieces in a worker thread (file reads block); the slot is given back when the
    download ends, fails or the client goes away (the generator is closed, its files with it)."""
    try:
        while True:
            piece = await run_in_threadpool(next, pieces, None)
            if piece is None:
                break
            if piece:
                yield piece
    finally:
        pieces.close()
        slots.release()


@router.get("/{kind}/{artifact_id}/archive", response_class=StreamingResponse,
            responses={200: {"content": {"application/zip": {}}}, 404: {}, 409: {}, 429: {}},
            summary="Download the whole artifact as a zip (e.g. a converted model directory), streamed")
def download_archive(kind: Kind, artifact_id: str, request: Request, session: SessionDep, store: StoreDep) -> StreamingResponse:
    """Streamed as it is zipped: no temporary copy, so a killed API leaves nothing behind and many
    downloads cost no disk. At most ``MOELAB_MAX_CONCURRENT_DOWNLOADS`` run at once (429 beyond)."""
    _ready_row(session, kind, artifact_id)
    try:
        pieces = store.iter_zip(kind, artifact_id)
    except ArtifactMissing as exc:
        raise ApiError(404, str(exc)) from exc
    return zip_response(request, pieces, artifact_id)
