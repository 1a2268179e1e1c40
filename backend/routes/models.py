"""Models: register (default, Hugging Face id, local path), list, and read their layer structure.

Registering queues a light ``cpu`` job that loads the model once and stores
``ModelAdapter.describe()``: the API itself never imports torch for a request.
"""

from __future__ import annotations

import re
from pathlib import Path

from fastapi import APIRouter, Response
from sqlalchemy import select

from moelab.store.db import Model
from ..deps import CascadeQ, QueueDep, SessionDep, SettingsDep, StoreDep, launch, lookup
from ..deletion import delete_resource
from ..errors import ApiError
from moelab.store.jobs import new_id
from ..schemas import DeleteOut, LayerOut, ModelCreate, ModelLayers, ModelList, ModelOut
from ..views import model_out

router = APIRouter(prefix="/models", tags=["models"])

_HF_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")


def classify_source(source: str, roots: list[Path]) -> tuple[str, str]:
    """``(kind, normalised source)``; raises 422 saying which forms are accepted (403 for a path outside ``roots``).

    A local path must lie, symlinks resolved, inside one of ``roots`` (``Settings.resolved_data_roots``:
    DATA_DIR/uploads and MOELAB_DATA_ROOTS), checked before anything about it is looked at, so the API
    neither loads nor reveals the existence of files elsewhere on the server. Relative paths are
    refused: the API's working directory is not the user's.
    """
    source = source.strip()
    if source == "default":
        return "default", source
    if source.startswith(("/", "./", "../", "~")) or source.endswith(".gguf") or "\\" in source or "\x00" in source:
        if not source.startswith("/"):
            raise ApiError(422, f"source: {source!r} is a relative path; give the absolute path of a model directory "
                                "inside a directory listed in MOELAB_DATA_ROOTS")
        path = Path(source).resolve()
        if not any(path == root or root in path.parents for root in roots):
            listed = ", ".join(str(r) for r in roots) or "none"
            raise ApiError(403, f"source: {source!r} is outside the directories this server loads from ({listed}); "
                                "put the model under one of them or add its directory to MOELAB_DATA_ROOTS on the server")
        if not path.exists():
            raise ApiError(422, f"source: local path {source!r} does not exist on the server; give an existing model directory or .gguf file")
        if path.is_file() and path.suffix != ".gguf":
            raise ApiError(422, f"source: {source!r} is a file but not a .gguf model; give a model directory (with config.json) or a .gguf file")
        if path.is_dir() and not (path / "config.json").is_file():
            raise ApiError(422, f"source: directory {source!r} has no config.json; save the model with save_pretrained first")
        return "local", str(path)
    if not _HF_ID.match(source) or ".." in source:
        raise ApiError(
            422, f"source: {source!r} is neither 'default', an existing local path, nor a Hugging Face id such as 'HuggingFaceTB/SmolLM2-135M'"
        )
    return "hf", source


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
    existing = session.execute(
        select(Model).where(Model.source == source, Model.trust_remote_code == body.trust_remote_code).order_by(Model.created_at)
    ).scalars().first()
    if existing is not None and (existing.job is None or existing.job.state not in ("failed", "cancelled")):
        response.status_code = 200
        return model_out(existing)
    name = body.name or ("SmolLM2-135M-Instruct" if kind == "default" else Path(source).name or source)
    row = Model(id=new_id("mod"), name=name, source=source, kind=kind, trust_remote_code=body.trust_remote_code, params={})
    session.add(row)
    launch(session, queue, row, "models", "inspect_model")
    return model_out(row)


@router.get("", response_model=ModelList, summary="Registered models")
def list_models(session: SessionDep) -> ModelList:
    rows = session.execute(select(Model).order_by(Model.created_at.desc())).scalars().unique().all()
    return ModelList(items=[model_out(r) for r in rows], total=len(rows))


@router.get("/{model_id}", response_model=ModelOut, summary="One model, with its description once inspected")
def get_model(model_id: str, session: SessionDep) -> ModelOut:
    return model_out(lookup(session, Model, model_id, "model", "models"))


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
