"""Probes: token-level routing and side-by-side generation of one conversion on one text (queued
jobs; the worker runs the models, the API only records and lists them)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter
from sqlalchemy import select

from moelab.store.db import Conversion, Probe
from moelab.store.jobs import new_id
from ..deletion import delete_resource
from ..deps import CascadeQ, QueueDep, SessionDep, StoreDep, TagQ, launch, lookup, require_ready, with_tag
from ..errors import ApiError
from ..schemas import DeleteOut, ProbeCreate, ProbeList, ProbeOut
from ..views import probe_out

router = APIRouter(prefix="/probes", tags=["probes"])


@router.post("", response_model=ProbeOut, status_code=202, responses={404: {}, 409: {}, 422: {}},
             summary="Route a text's tokens through a conversion, or generate from a prompt with dense and converted (queued job)")
def create_probe(body: ProbeCreate, session: SessionDep, queue: QueueDep) -> ProbeOut:
    conversion = lookup(session, Conversion, body.conversion_id, "conversion", "conversions")
    require_ready(conversion, "conversion")
    row = Probe(id=new_id("pb"), conversion_id=conversion.id, params=body.model_dump(exclude={"conversion_id"}))
    session.add(row)
    launch(session, queue, row, "probes", "probe")
    return probe_out(row)


@router.get("", response_model=ProbeList, summary="Probes, newest first")
def list_probes(session: SessionDep, conversion_id: str | None = None, kind: str | None = None, tag: TagQ = None) -> ProbeList:
    query = select(Probe).order_by(Probe.created_at.desc())
    if conversion_id:
        query = query.where(Probe.conversion_id == conversion_id)
    rows = [r for r in session.execute(query).scalars().unique().all() if kind is None or (r.params or {}).get("kind") == kind]
    rows = with_tag(rows, tag)
    return ProbeList(items=[probe_out(r) for r in rows], total=len(rows))


@router.get("/{probe_id}", response_model=ProbeOut, summary="One probe and its result")
def get_probe(probe_id: str, session: SessionDep) -> ProbeOut:
    return probe_out(lookup(session, Probe, probe_id, "probe", "probes"))


@router.get("/{probe_id}/result", responses={404: {}, 409: {}}, summary="A ready probe's whole result")
def get_probe_result(probe_id: str, session: SessionDep, store: StoreDep) -> dict[str, Any]:
    """Routing: ``tokens`` (each token's text), ``token_ids`` and ``layers`` ``[{layer, n_routed, top_k,
    experts: [[expert ids] per token], load}]``; generate: ``dense`` and ``converted`` (text, tokens,
    new_tokens, seconds, tokens_per_s, prefill_s) and ``speedup``."""
    row = lookup(session, Probe, probe_id, "probe", "probes")
    require_ready(row, "probe")
    path = store.path("probes", row.id) / "probe.json"
    if not path.is_file():
        raise ApiError(409, f"probe {row.id} is ready but its result file is missing; re-run it with POST /api/v1/jobs/{row.job_id}/retry")
    return json.loads(path.read_text())


@router.delete("/{probe_id}", response_model=DeleteOut, responses={404: {}, 409: {}}, summary="Delete a probe and its result")
def delete_probe(probe_id: str, session: SessionDep, queue: QueueDep, store: StoreDep, cascade: CascadeQ = False) -> DeleteOut:
    """Cancels the probe's queued or running job before deleting."""
    return delete_resource(session, queue, store, "probes", probe_id, cascade)
