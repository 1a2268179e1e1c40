"""Models: register (default, Hugging Face id, local path), list, and read their layer structure.

Registering queues a light ``cpu`` job that loads the model once and stores
``ModelAdapter.describe()``: the API itself never imports torch for a request.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Response
from sqlalchemy import select

from moelab.store.dataroots import DataRootError, http_status, resolve_model_source
from moelab.store.db import Model
from ..deps import CascadeQ, QueueDep, SessionDep, SettingsDep, StoreDep, TagQ, encoded, launch, lookup, with_tag
from ..deletion import delete_resource
from ..errors import ApiError
from moelab.store.jobs import new_id
from moelab.store.hub import hub_refusal
from ..schemas import DeleteOut, LayerOut, ModelCreate, ModelLayers, ModelList, ModelOut
from ..views import model_out

router = APIRouter(prefix="/models", tags=["models"])

def classify_source(source: str, roots: list[Path]) -> tuple[str, str]:
    """``(kind, normalised source)``; raises 422 saying which forms are accepted (403 for a path outside ``roots``).

    The rule is ``moelab.store.dataroots.resolve_model_source``: ``default``, a Hugging Face id (never
    looked up in the API's or worker's working directory), or an absolute / ``~`` path whose real path
    (symlinks resolved), and every file under it, lies inside one of ``roots``
    (``Settings.resolved_data_roots``: DATA_DIR/uploads and MOELAB_DATA_ROOTS). The outside check comes
    before anything about the path is looked at, so the API neither loads nor reveals files elsewhere.
    """
    try:
        ref = resolve_model_source(source, roots)
    except DataRootError as exc:
        raise ApiError(http_status(exc), str(exc)) from exc
    return ("hf" if ref.kind == "hub" else ref.kind), ref.value  # the API's kind for a Hub id is "hf"


@router.post(
    "", response_model=ModelOut, status_code=202,
    responses={200: {"model": ModelOut, "description": "already registered"}, 403: {"description": "remote code refused, or a local path outside MOELAB_DATA_ROOTS"}, 422: {}},
    summary="Register a model and queue its inspection",
)
def register_model(body: ModelCreate, response: Response, session: SessionDep, queue: QueueDep, settings: SettingsDep) -> ModelOut:
    if body.trust_remote_code and not settings.allow_trust_remote_code:
        raise ApiError(
            403, "this server does not run models' own code: register without trust_remote_code, or start the "
            "server with MOELAB_ALLOW_TRUST_REMOTE_CODE=1",
        )
    kind, source = classify_source(body.source, settings.resolved_data_roots())
    refusal = hub_refusal(source, "model") if kind == "hf" else None
    if refusal:
        raise ApiError(422, f"source: {refusal}")
    existing = session.execute(
        select(Model).where(Model.source == source, Model.trust_remote_code == body.trust_remote_code).order_by(Model.created_at)
    ).scalars().first()
    if existing is not None and (existing.job is None or existing.job.state not in ("failed", "cancelled")):
        response.status_code = 200
        return model_out(existing)
    given = body.source.strip()
    name = body.name or ("SmolLM2-135M-Instruct" if kind == "default" else Path(given).name or given)
    # ``source`` is what the worker loads (checked again there); ``params.given`` what the API shows
    row = Model(id=new_id("mod"), name=name, source=source, kind=kind, trust_remote_code=body.trust_remote_code,
                params={"given": given} if given != source else {})
    session.add(row)
    launch(session, queue, row, "models", "inspect_model")
    return model_out(row)


@router.get("", response_model=ModelList, summary="Registered models")
def list_models(session: SessionDep, tag: TagQ = None) -> Response:
    rows = session.execute(select(Model).order_by(Model.created_at.desc())).scalars().unique().all()
    rows = with_tag(rows, tag)
    return encoded(ModelList(items=[model_out(r) for r in rows], total=len(rows)))  # no second thread-pool trip


@router.get("/{model_id}", response_model=ModelOut, summary="One model, with its description once inspected")
def get_model(model_id: str, session: SessionDep) -> Response:
    return encoded(model_out(lookup(session, Model, model_id, "model", "models")))  # no second thread-pool trip


@router.get("/{model_id}/layers", response_model=ModelLayers, responses={409: {}}, summary="Layer structure (GLU FFN per layer)")
def model_layers(model_id: str, session: SessionDep) -> ModelLayers:
    row = lookup(session, Model, model_id, "model", "models")
    info = row.summary
    if not info:
        job = row.job
        state = job.state if job else "unknown"
        reason = f": {job.error}" if job is not None and job.error else ""
        raise ApiError(409, f"model {model_id} is not inspected yet (job {row.job_id} {state}{reason}); poll GET /api/v1/jobs/{row.job_id}")
    if info.get("kind") == "moe":
        raise ApiError(409, f"model {model_id} is a Mixture-of-Experts model ({info.get('family')}, {info.get('num_experts')} experts "
                            "per layer): it has no dense GLU layers; convert it with method 'hierarchical'")
    return ModelLayers(
        model_id=row.id, family=info["family"], tested_family=info["tested_family"], activation=info["activation"],
        n_layers=info["n_layers"], d_model=info["d_model"], fused_gate_up=info["fused_gate_up"],
        n_parameters=info["n_parameters"], n_ffn_parameters=info["n_ffn_parameters"],
        layers=[LayerOut(index=i, d_ffn=d) for i, d in enumerate(info["d_ffn"])],
    )


@router.delete("/{model_id}", response_model=DeleteOut, responses={404: {}, 409: {}}, summary="Delete a model (409 while profiles or conversions use it; cascade=true deletes them too)")
def delete_model(model_id: str, session: SessionDep, queue: QueueDep, store: StoreDep, cascade: CascadeQ = False) -> DeleteOut:
    """Cancels the resource's queued or running job (and its dependants' with cascade) before deleting."""
    return delete_resource(session, queue, store, "models", model_id, cascade)
