"""Artifacts: list what a finished job stored and download it (a file or the whole directory)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, BackgroundTasks
from fastapi.responses import FileResponse
from sqlalchemy import select

from moelab.store.artifacts import KINDS, ArtifactMissing
from moelab.store.db import CalibrationSet, Conversion, Evaluation, Finetune, Job, Profile
from ..deps import SessionDep, StoreDep
from ..errors import ApiError
from moelab.store.jobs import new_id
from ..schemas import ArtifactFile, ArtifactList, ArtifactOut, ArtifactSummary

router = APIRouter(prefix="/artifacts", tags=["artifacts"])

Kind = Literal["calibration-sets", "profiles", "conversions", "evaluations", "finetunes"]
TABLES = {"calibration-sets": CalibrationSet, "profiles": Profile, "conversions": Conversion, "evaluations": Evaluation,
          "finetunes": Finetune}
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


@router.get("/{kind}/{artifact_id}/archive", response_class=FileResponse, responses={404: {}, 409: {}},
            summary="Download the whole artifact as a zip (e.g. a converted model directory)")
def download_archive(kind: Kind, artifact_id: str, session: SessionDep, store: StoreDep, background: BackgroundTasks) -> FileResponse:
    _ready_row(session, kind, artifact_id)
    if not store.exists(kind, artifact_id):
        raise ApiError(404, f"{kind}/{artifact_id}: no stored artifact")
    target = store.upload_dir() / f"{new_id('zip')}.zip"
    store.zip_to(kind, artifact_id, target)
    background.add_task(target.unlink, missing_ok=True)
    return FileResponse(target, filename=f"{artifact_id}.zip", media_type="application/zip")
