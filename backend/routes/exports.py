"""Exports: a ready conversion written in another format by a worker, stored inside the conversion's
artifact (``conversions/<conv-id>/exports/<exp-id>/``) and deleted with it.

``format`` ``gguf`` (issue 25): one ``.gguf`` file that stock llama.cpp and Ollama run, beside an
Ollama ``Modelfile`` and a model card. Only layouts llama.cpp's deepseek architecture expresses
exactly export (``gguf_export.gguf_refusal``, read from the conversion's ``config.json``: pure
JSON, the API never imports torch); anything else is refused with 409 saying what blocks it and
which conversion would export. Whether a conversion exports is part of its JSON (``ConversionOut.gguf``),
so a list of conversions answers it for every row without one more request per row.

One export per conversion, format and type: asking again for one that is queued, running or ready
returns it (200); one whose job failed or was cancelled, or whose file is gone, is re-run (202).
The file is served by ``FileResponse`` (streamed from disk in chunks, byte ranges honoured: a
multi-GB download can resume), the whole export as a streamed zip like an artifact's archive.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, StreamingResponse
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from moelab.store import jobs
from moelab.store.artifacts import ArtifactMissing, ArtifactStore
from moelab.store.db import Conversion, Export
from moelab.store.jobs import new_id
from moelab.engine.limits import gguf_export_footprint, memory_problem
from moelab.engine.runtime.gguf_layout import GGUF_TYPES, gguf_refusal

from ..deletion import delete_resource
from ..deps import QueueDep, SessionDep, SettingsDep, StoreDep, TagQ, launch, lookup, require_ready, with_tag
from ..errors import ApiError
from ..schemas import ArtifactFile, DeleteOut, ExportCreate, ExportList, ExportOut, GgufCheck
from ..views import export_out
from .artifacts import zip_response

router = APIRouter(tags=["exports"])


@lru_cache(maxsize=4096)
def _refusal(path: str, _mtime_ns: int, _size: int) -> tuple[bool, str | None]:
    """(readable, why it does not export) of one config.json version (a published conversion never
    changes: the cache key's mtime and size only guard against a replaced directory)."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False, None
    if not isinstance(config, dict):
        return False, None
    try:
        return True, gguf_refusal(config)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a config.json of an older or foreign layout
        return True, f"its config.json does not describe a converted model's layout ({type(exc).__name__}: {exc})"


def gguf_check(store: ArtifactStore, row: Conversion) -> GgufCheck | None:
    """Whether a ready conversion exports to GGUF (None: not ready, or its config.json is not readable here)."""
    if row.job is not None and row.job.state != jobs.SUCCEEDED:
        return None
    path = store.path("conversions", row.id) / "config.json"
    try:
        st = path.stat()
    except OSError:
        return None
    readable, reason = _refusal(str(path), st.st_mtime_ns, st.st_size)
    if not readable:
        return None
    return GgufCheck(exportable=reason is None, reason=reason, types=list(GGUF_TYPES))


def exports_of(session: Session, conversion_ids: list[str] | None = None) -> dict[str, list[ExportOut]]:
    """Exports by conversion id, newest first (one query: a listing of every conversion makes one)."""
    query = select(Export).order_by(Export.created_at.desc())
    if conversion_ids is not None:
        query = query.where(Export.conversion_id.in_(conversion_ids))
    out: dict[str, list[ExportOut]] = {}
    for row in session.execute(query).scalars().unique():
        out.setdefault(row.conversion_id, []).append(export_out(row))
    return out


def _usable(row: Export, store: ArtifactStore) -> bool:
    """Queued, running, or ready with its file still there: asking again returns it as it is."""
    job = row.job
    if job is not None and job.state in (jobs.QUEUED, jobs.RUNNING):
        return True
    if job is not None and job.state != jobs.SUCCEEDED:
        return False
    name = (row.summary or {}).get("file")
    return bool(name) and (store.export_path(row.conversion_id, row.id) / name).is_file()


def _same(session: Session, conversion_id: str, fmt: str, gguf_type: str) -> Export | None:
    query = select(Export).where(Export.conversion_id == conversion_id, Export.format == fmt, Export.type == gguf_type)
    return session.execute(query).scalars().first()


@router.post(
    "/conversions/{conversion_id}/exports", response_model=ExportOut, status_code=202,
    responses={200: {"model": ExportOut, "description": "an export of this format and type is queued, running or ready: "
                                                        "returned as it is"},
               404: {}, 409: {"description": "the conversion is not ready, or its layout does not export (the reason)"},
               422: {}, 503: {}, 507: {}},
    summary="Export a conversion as a GGUF file for llama.cpp / Ollama (queued job; asked again: the same export)",
)
def create_export(conversion_id: str, body: ExportCreate, response: Response, session: SessionDep, queue: QueueDep,
                  store: StoreDep, settings: SettingsDep) -> ExportOut:
    """409 with the reason when the conversion's layout has no exact GGUF equivalent, or when the export
    would need more memory than the server's MOELAB_MAX_MEMORY; 507 when the artifacts' disk cannot hold
    its staging checkpoint and file. The estimate is kept in the export's ``params``."""
    conversion = lookup(session, Conversion, conversion_id, "conversion", "conversions")
    require_ready(conversion, "conversion")
    check = gguf_check(store, conversion)
    if check is None:
        raise ApiError(409, f"conversion {conversion.id} has no readable config.json in the artifacts dir (its files are "
                            "missing or damaged); convert again")
    if not check.exportable:
        raise ApiError(409, f"conversion {conversion.id} does not export to GGUF: {check.reason}")
    existing = _same(session, conversion.id, body.format, body.type)
    if existing is not None and _usable(existing, store):
        response.status_code = 200
        return export_out(existing)
    what = f"the GGUF {body.type} export of conversion {conversion.id}"
    footprint = gguf_export_footprint(store.path("conversions", conversion.id), body.type)
    if footprint is not None:
        problem = memory_problem(footprint["memory_bytes"], settings.max_memory, what)
        if problem:
            raise ApiError(409, problem)
        store.require_free(footprint["disk_bytes"], f"{what} (its fp32 staging checkpoint and the file)")
    params = {"format": body.format, "type": body.type, **({"estimate": footprint} if footprint else {})}
    retry_of = None
    if existing is None:
        row = Export(id=new_id("exp"), conversion_id=conversion.id, format=body.format, type=body.type, params=params)
        session.add(row)
        try:
            session.flush()
        except IntegrityError:  # the same export was asked for concurrently: that one is it
            session.rollback()
            row = _same(session, conversion.id, body.format, body.type)
            if row is None:
                raise
            response.status_code = 200
            return export_out(row)
    else:  # failed, cancelled, or its file is gone: the same export again
        row = existing
        row.params = params
        if existing.job is not None and existing.job.state in (jobs.FAILED, jobs.CANCELLED):
            retry_of = existing.job_id
    launch(session, queue, row, "exports", "export", retry_of=retry_of)
    return export_out(row)


@router.get("/conversions/{conversion_id}/exports", response_model=ExportList, responses={404: {}},
            summary="A conversion's exports, and whether it exports to GGUF (why not)")
def list_conversion_exports(conversion_id: str, session: SessionDep, store: StoreDep) -> ExportList:
    conversion = lookup(session, Conversion, conversion_id, "conversion", "conversions")
    items = exports_of(session, [conversion.id]).get(conversion.id, [])
    return ExportList(items=items, total=len(items), gguf=gguf_check(store, conversion))


@router.get("/exports", response_model=ExportList, summary="Exports of every conversion, newest first")
def list_exports(session: SessionDep, conversion_id: str | None = None, tag: TagQ = None) -> ExportList:
    items = [e for group in exports_of(session, [conversion_id] if conversion_id else None).values() for e in group]
    items = with_tag(items, tag)
    items.sort(key=lambda e: e.created_at, reverse=True)
    return ExportList(items=items, total=len(items))


@router.get("/exports/{export_id}", response_model=ExportOut, responses={404: {}}, summary="One export, with its files once ready")
def get_export(export_id: str, session: SessionDep, store: StoreDep) -> ExportOut:
    row = lookup(session, Export, export_id, "export", "exports")
    files = None
    if row.job is None or row.job.state == jobs.SUCCEEDED:
        base = f"/api/v1/exports/{row.id}/files"
        try:
            files = [ArtifactFile(path=f.path, size=f.size, url=f"{base}/{f.path}",
                                  modified=datetime.fromtimestamp(f.modified, timezone.utc))
                     for f in store.export_files(row.conversion_id, row.id)]
        except ArtifactMissing:
            files = []
    return export_out(row, files)


def _ready(session: Session, export_id: str) -> Export:
    row = lookup(session, Export, export_id, "export", "exports")
    require_ready(row, "export")
    return row


def _missing(row: Export, exc: ArtifactMissing) -> ApiError:
    return ApiError(404, f"{exc}; export it again with POST /api/v1/conversions/{row.conversion_id}/exports "
                         f"{{\"format\": \"{row.format}\", \"type\": \"{row.type}\"}}")


@router.get("/exports/{export_id}/files/{path:path}", response_class=FileResponse, responses={404: {}, 409: {}},
            summary="Download one file of a ready export (the .gguf: its download_url), streamed")
def download_export_file(export_id: str, path: str, session: SessionDep, store: StoreDep) -> FileResponse:
    row = _ready(session, export_id)
    try:
        full = store.export_file(row.conversion_id, row.id, path)
    except ArtifactMissing as exc:
        raise _missing(row, exc) from exc
    return FileResponse(full, filename=Path(path).name, media_type="application/octet-stream")


@router.get("/exports/{export_id}/archive", response_class=StreamingResponse,
            responses={200: {"content": {"application/zip": {}}}, 404: {}, 409: {}, 429: {}},
            summary="Download a ready export as a zip (the .gguf, its Ollama Modelfile and model card), streamed")
def download_export_archive(export_id: str, request: Request, session: SessionDep, store: StoreDep) -> StreamingResponse:
    row = _ready(session, export_id)
    try:
        pieces = store.iter_export_zip(row.conversion_id, row.id)
    except ArtifactMissing as exc:
        raise _missing(row, exc) from exc
    return zip_response(request, pieces, row.id)


@router.delete("/exports/{export_id}", response_model=DeleteOut, responses={404: {}, 409: {}},
               summary="Delete an export and its files (its conversion stays)")
def delete_export(export_id: str, session: SessionDep, queue: QueueDep, store: StoreDep) -> DeleteOut:
    """Cancels the export's queued or running job first."""
    return delete_resource(session, queue, store, "exports", export_id, cascade=False)
