"""Activation probes: chosen neurons of one layer of a profile's dense model on any text, h on every
token (queued jobs; the worker runs the model, the API checks the request against the profile's
manifest, records it and serves the result)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter
from sqlalchemy import select

from moelab.store.db import ActivationProbe, Profile
from moelab.store.jobs import new_id
from ..deletion import delete_resource
from ..deps import CascadeQ, QueueDep, SessionDep, StoreDep, TagQ, launch, lookup, require_ready, with_tag
from ..errors import ApiError
from ..schemas import ActivationProbeCreate, ActivationProbeList, ActivationProbeOut, ActivationResult, DeleteOut
from ..views import activation_probe_out
from .charts import stored_profile

router = APIRouter(prefix="/activation-probes", tags=["activation probes"])


def _check_neurons(manifest: dict[str, Any], layer: int, neurons: list[int]) -> None:
    """422 for a layer or neuron the profiled model does not have, before a job is queued."""
    widths = [int(d) for d in manifest["d_ffn"]]
    if layer >= len(widths):
        raise ApiError(422, f"layer: this profile has layers 0 … {len(widths) - 1} (got {layer})")
    bad = [n for n in neurons if n >= widths[layer]]
    if bad:
        raise ApiError(422, f"neurons: layer {layer} has {widths[layer]} neurons, use 0 … {widths[layer] - 1} (got {bad[:5]})")


@router.post("", response_model=ActivationProbeOut, status_code=202, responses={404: {}, 409: {}, 422: {}},
             summary="Neurons' activation on every token of a text, by a profile's dense model (queued job)")
def create_activation_probe(body: ActivationProbeCreate, session: SessionDep, queue: QueueDep, store: StoreDep) -> ActivationProbeOut:
    """A text longer than 512 tokens is only known to be so once tokenised: its job fails saying so."""
    profile = lookup(session, Profile, body.profile_id, "profile", "profiles")
    require_ready(profile, "profile")
    _check_neurons(stored_profile(session, store, profile.id).manifest, body.layer, body.neurons)
    row = ActivationProbe(id=new_id("act"), profile_id=profile.id, params=body.model_dump(exclude={"profile_id"}))
    session.add(row)
    launch(session, queue, row, "activation_probes", "activation_probe")
    return activation_probe_out(row)


@router.get("/{probe_id}", response_model=ActivationProbeOut, summary="One activation probe and its summary")
def get_activation_probe(probe_id: str, session: SessionDep) -> ActivationProbeOut:
    return activation_probe_out(lookup(session, ActivationProbe, probe_id, "activation probe", "activation-probes"))


@router.get("", response_model=ActivationProbeList, summary="Activation probes of a profile (or all), newest first")
def list_activation_probes(session: SessionDep, profile_id: str | None = None, tag: TagQ = None) -> ActivationProbeList:
    query = select(ActivationProbe).order_by(ActivationProbe.created_at.desc())
    if profile_id:
        query = query.where(ActivationProbe.profile_id == profile_id)
    rows = session.execute(query).scalars().unique().all()
    rows = with_tag(rows, tag)
    return ActivationProbeList(items=[activation_probe_out(r) for r in rows], total=len(rows))


@router.get("/{probe_id}/result", response_model=ActivationResult, responses={404: {}, 409: {}},
            summary="A ready activation probe's tokens and every neuron's activation on each")
def get_activation_result(probe_id: str, session: SessionDep, store: StoreDep) -> dict[str, Any]:
    row = lookup(session, ActivationProbe, probe_id, "activation probe", "activation-probes")
    require_ready(row, "activation probe")
    path = store.path("activation-probes", row.id) / "activations.json"
    if not path.is_file():
        raise ApiError(409, f"activation probe {row.id} is ready but its result file is missing; re-run it with "
                            f"POST /api/v1/jobs/{row.job_id}/retry")
    return json.loads(path.read_text())


@router.delete("/{probe_id}", response_model=DeleteOut, responses={404: {}, 409: {}}, summary="Delete an activation probe")
def delete_activation_probe(probe_id: str, session: SessionDep, queue: QueueDep, store: StoreDep,
                            cascade: CascadeQ = False) -> DeleteOut:
    return delete_resource(session, queue, store, "activation_probes", probe_id, cascade)
