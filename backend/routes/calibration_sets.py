"""Calibration sets: built-in, uploaded (JSONL / .txt) or from a Hugging Face dataset; their
statistics and sample previews.

An upload is parsed and stored in the request (the file is already here and parsing is
cheap); built-in and Hugging Face sets are built by a light ``cpu`` job (the ``datasets``
library and the built-in builders are not request-path work).
"""

from __future__ import annotations

import shutil
from functools import lru_cache
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, File, Form, Query, Response, UploadFile
from pydantic import Field
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from moelab.engine.text import text_problem
from moelab.engine.data.builtin import BUILTIN_SETS, bigbench_installed, builtin_domains
from moelab.engine.data.calibration import (
    CalibrationError,
    CalibrationSet,
    read_jsonl,
    read_txt,
)

from moelab.store.artifacts import ArtifactStore
from moelab.store.hub import hub_refusal
from moelab.store.dataroots import DataRootError, http_status, resolve_dataset
from moelab.store.db import CalibrationSet as CalibrationRow
from ..deps import (
    CascadeQ,
    OffsetQ,
    QueueDep,
    SessionDep,
    SettingsDep,
    StoreDep,
    TagQ,
    launch,
    lookup,
    require_ready,
    with_tag,
)
from ..deletion import delete_resource
from ..errors import ApiError
from moelab.store.jobs import new_id
from ..schemas import (
    MAX_INT,
    DeleteOut,
    BuiltinCalibrationCreate,
    BuiltinSetOut,
    CalibrationCreate,
    CalibrationSetList,
    CalibrationSetOut,
    SampleOut,
    SamplePage,
)
from ..views import calibration_out

router = APIRouter(prefix="/calibration-sets", tags=["calibration sets"])

KIND = "calibration-sets"
_READERS = {".jsonl": read_jsonl, ".json": read_jsonl, ".txt": read_txt}


class BuiltinSetStatus(BuiltinSetOut):
    installed: bool = Field(True, description="whether this server can build it now (bigbench needs `moelab data install bigbench`)")


@router.get("/builtins", response_model=list[BuiltinSetStatus], summary="Built-in offline sets, and whether each is installed")
def builtins(settings: SettingsDep) -> list[BuiltinSetStatus]:
    return [BuiltinSetStatus(name=n, description=d, spec=f"builtin:{n}", domains=list(builtin_domains(n)),
                             installed=n != "bigbench" or bigbench_installed(settings.data_dir))
            for n, d in BUILTIN_SETS.items()]


@router.post("", response_model=CalibrationSetOut, status_code=202, responses={403: {}, 409: {}, 422: {}},
             summary="Build a built-in or Hugging Face set (queued job)")
def create_set(body: CalibrationCreate, session: SessionDep, queue: QueueDep, settings: SettingsDep) -> CalibrationSetOut:
    if isinstance(body, BuiltinCalibrationCreate):
        if body.name == "bigbench" and not bigbench_installed(settings.data_dir):
            raise ApiError(409, "builtin:bigbench is not installed on this server; run `moelab data install bigbench` there first")
        name = body.name if body.split == "calibration" else f"{body.name}-heldout"
        origin = "builtin"
    else:
        try:
            ref = resolve_dataset(body.dataset, settings.resolved_data_roots())
        except DataRootError as exc:  # by type: OutsideDataRoots is 403, any other refusal 422
            raise ApiError(http_status(exc), str(exc)) from exc
        refusal = hub_refusal(ref.value, "dataset") if ref.kind == "hub" else None
        if refusal:
            raise ApiError(422, f"dataset: {refusal}")
        given = body.dataset.strip()
        name = Path(given).name if ref.kind == "local" else ref.value.split("/")[-1]
        origin = "hf"
    params = body.model_dump()
    if origin == "hf":
        # the user's own string (what the API shows); the worker resolves and checks it again before reading
        params["dataset"] = given
    row = CalibrationRow(id=new_id("cal"), name=name, origin=origin, params=params)
    session.add(row)
    launch(session, queue, row, "calibration_sets", "build_calibration")
    return calibration_out(row)


def _parse_upload(upload: UploadFile, scratch: Path) -> tuple[str, list]:
    filename = Path(upload.filename or "").name
    suffix = Path(filename).suffix.lower()
    reader = _READERS.get(suffix)
    if reader is None:
        shown = suffix or "no extension"
        raise ApiError(422, f"file: unsupported type ({shown}); upload .jsonl (one {{\"text\": …, \"task\": …}} per line) or .txt (samples separated by blank lines)")
    tmp = scratch / f"{new_id('up')}{suffix}"
    try:
        with open(tmp, "wb") as fh:
            shutil.copyfileobj(upload.file, fh, length=1 << 20)
        try:
            samples = reader(tmp)
        except CalibrationError as exc:
            raise ApiError(422, "file: " + str(exc).replace(str(tmp), filename)) from exc
    finally:
        tmp.unlink(missing_ok=True)
    return filename, samples


@router.post(
    "/upload", response_model=CalibrationSetOut, status_code=201,
    responses={200: {"model": CalibrationSetOut, "description": "the same content is already stored"}, 413: {}, 422: {}},
    summary="Upload a JSONL or .txt calibration set",
)
def upload_set(
    response: Response, session: SessionDep, store: StoreDep,
    file: Annotated[UploadFile, File(description=".jsonl with 'text' (+ optional 'task', 'domain') per line, or .txt")],
    name: Annotated[str | None, Form(max_length=200)] = None,
    samples: Annotated[int | None, Form(ge=1, le=20000, description="task-balanced subsample")] = None,
    seed: Annotated[int, Form(ge=0, le=MAX_INT)] = 0,
) -> CalibrationSetOut:
    for field, value in (("name", name), ("file", file.filename)):
        problem = text_problem(value or "")
        if problem:
            raise ApiError(422, f"{field}: {problem}")
    filename, parsed = _parse_upload(file, store.upload_dir())
    cset = CalibrationSet(name or Path(filename).stem or "upload", parsed, source=f"upload:{filename}")
    if samples is not None:
        cset = cset.subsample(samples, seed)
    existing = _stored_upload(session, store, cset)
    if existing is not None:
        response.status_code = 200
        return calibration_out(existing)
    row = CalibrationRow(
        id=new_id("cal"), name=cset.name, origin="upload", content_id=cset.id, upload_key=cset.id,
        params={"filename": filename, "samples": samples, "seed": seed}, summary=cset.stats(),
    )
    cset.save(store.path(KIND, row.id))  # artifact first: a row never points at nothing
    session.add(row)
    try:
        session.commit()  # the unique upload_key decides between identical concurrent uploads
    except IntegrityError:
        session.rollback()
        store.remove(KIND, row.id)
        existing = _stored_upload(session, store, cset)
        if existing is None:  # the winner was deleted in between: nothing sensible to return but a retry
            raise ApiError(409, "the same content was being uploaded and deleted at once; upload it again") from None
        response.status_code = 200
        return calibration_out(existing)
    return calibration_out(row)


def _stored_upload(session: Session, store: ArtifactStore, cset: CalibrationSet) -> CalibrationRow | None:
    """The stored upload of the same content, if any (its samples re-written if its artifact went missing)."""
    existing = session.execute(select(CalibrationRow).where(CalibrationRow.upload_key == cset.id)).scalars().first()
    if existing is not None and not store.exists(KIND, existing.id):
        cset.save(store.path(KIND, existing.id))
    return existing


@router.get("", response_model=CalibrationSetList, summary="Stored calibration sets")
def list_sets(session: SessionDep, tag: TagQ = None) -> CalibrationSetList:
    rows = session.execute(select(CalibrationRow).order_by(CalibrationRow.created_at.desc())).scalars().unique().all()
    rows = with_tag(rows, tag)
    return CalibrationSetList(items=[calibration_out(r) for r in rows], total=len(rows))


@router.get("/{set_id}", response_model=CalibrationSetOut, summary="One set with its statistics")
def get_set(set_id: str, session: SessionDep) -> CalibrationSetOut:
    return calibration_out(lookup(session, CalibrationRow, set_id, "calibration set", "calibration-sets"))


@lru_cache(maxsize=16)
def _load_set(path: str, stamp: float) -> CalibrationSet:
    return CalibrationSet.load(Path(path))


@router.get("/{set_id}/samples", response_model=SamplePage, responses={409: {}}, summary="Sample previews, filterable")
def set_samples(
    set_id: str, session: SessionDep, store: StoreDep,
    offset: OffsetQ = 0,
    limit: Annotated[int, Query(ge=1, le=200)] = 20,
    max_chars: Annotated[int, Query(ge=10, le=100000, description="cut texts longer than this")] = 300,
    task: Annotated[str | None, Query(max_length=200)] = None,
    domain: Annotated[str | None, Query(max_length=200)] = None,
) -> SamplePage:
    row = lookup(session, CalibrationRow, set_id, "calibration set", "calibration-sets")
    require_ready(row, "calibration set")
    path = store.path(KIND, row.id)
    meta = path / "calibration.json"
    if not meta.is_file():
        raise ApiError(409, f"calibration set {set_id} has no stored samples; re-run its job")
    cset = _load_set(str(path), meta.stat().st_mtime)
    chosen = [(i, s) for i, s in enumerate(cset.samples) if (task is None or s.task == task) and (domain is None or s.domain == domain)]
    items = [
        SampleOut(index=i, text=s.text if len(s.text) <= max_chars else s.text[:max_chars].rstrip() + "…",
                  chars=len(s.text), truncated=len(s.text) > max_chars, task=s.task, domain=s.domain)
        for i, s in chosen[offset: offset + limit]
    ]
    return SamplePage(calibration_set_id=set_id, offset=offset, limit=limit, total=len(chosen), items=items)


@router.delete("/{set_id}", response_model=DeleteOut, responses={404: {}, 409: {}}, summary="Delete a calibration set and its samples (409 while profiles, conversions, evaluations or fine-tunes use it)")
def delete_calibration_set(set_id: str, session: SessionDep, queue: QueueDep, store: StoreDep, cascade: CascadeQ = False) -> DeleteOut:
    """Cancels the resource's queued or running job (and its dependants' with cascade) before deleting."""
    return delete_resource(session, queue, store, "calibration_sets", set_id, cascade)
