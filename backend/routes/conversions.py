"""Conversions: queue a dense → MoE conversion of a profiled model; read its plan."""

from __future__ import annotations

import json

from fastapi import APIRouter
from sqlalchemy import select

from workers.engine.core.allocation import AllocationError, AllocationParams

from ..db import CalibrationSet, Conversion, Model, Profile
from ..deps import QueueDep, SessionDep, StoreDep, launch, lookup, require_ready
from ..errors import ApiError
from ..jobs import new_id
from ..schemas import AllocationIn, ConversionCreate, ConversionList, ConversionOut
from ..views import conversion_out

router = APIRouter(prefix="/conversions", tags=["conversions"])


def check_allocation(allocation: AllocationIn, d_ffns: list[int]) -> AllocationParams:
    """The engine's own checks against every layer width of the profile (422 with its message)."""
    params = AllocationParams(**allocation.model_dump())
    try:
        for d in sorted(set(d_ffns)):
            params.validate(d)
    except AllocationError as exc:
        raise ApiError(422, f"allocation: {exc}") from exc
    return params


@router.post("", response_model=ConversionOut, status_code=202, responses={404: {}, 409: {}, 422: {}},
             summary="Convert a model into an MoE model with any method (queued job)")
def create_conversion(body: ConversionCreate, session: SessionDep, queue: QueueDep) -> ConversionOut:
    method = body.resolved_method
    params = body.engine_params()
    profile_id = model_id = None
    if method == "hierarchical":
        model = lookup(session, Model, body.model_id, "model", "models")
        require_ready(model, "model")
        if (model.summary or {}).get("kind") != "moe":
            raise ApiError(422, f"model {model.id} is not a Mixture-of-Experts model; hierarchical conversion restructures "
                                "the experts of an MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE): register one")
        params["calibration"] = _calibration_spec(session, body.calibration)
        model_id = model.id
    else:
        profiles = [lookup(session, Profile, pid, "profile", "profiles") for pid in [body.profile_id, *body.extra_profile_ids]]
        for p in profiles:
            require_ready(p, "profile")
        profile = profiles[0]
        if len({p.model_id for p in profiles}) > 1:
            raise ApiError(422, "midas: every profile must be of the same model; these come from "
                                + ", ".join(sorted({p.model_id for p in profiles})))
        summary = profile.summary or {}
        if method in ("expertweaver", "cmoe"):
            check_allocation(body.allocation, summary.get("d_ffn", []))
        _check_engine_params(method, params, summary, len(profiles))
        if body.extra_profile_ids:
            params["extra_profile_ids"] = list(body.extra_profile_ids)
        profile_id = profile.id
    row = Conversion(id=new_id("conv"), profile_id=profile_id, model_id=model_id, params=params)
    session.add(row)
    launch(session, queue, row, "conversions", "conversion")
    return conversion_out(row)


def _calibration_spec(session, ref: str) -> str:
    """``builtin:NAME`` as given; a stored calibration set's id must exist and be ready."""
    if ref.startswith("builtin:"):
        from workers.engine.data.builtin import BUILTIN_SETS

        if ref[len("builtin:"):] not in BUILTIN_SETS:
            raise ApiError(422, f"unknown built-in set {ref!r}; use one of: " + ", ".join(f"builtin:{n}" for n in BUILTIN_SETS))
        return ref
    cset = lookup(session, CalibrationSet, ref, "calibration set", "calibration-sets")
    require_ready(cset, "calibration set")
    return cset.id


def _check_engine_params(method: str, params: dict, profile_summary: dict, n_profiles: int) -> None:
    """The engine's own validation of Dense2MoE / MIDAS parameters (422 with its message)."""
    if method not in ("dense2moe", "midas"):
        return
    from workers.engine.core.dense import ConversionError
    from workers.engine.methods import params_from_dict

    try:
        p = params_from_dict(params)
        if method == "dense2moe" and profile_summary.get("n_layers"):
            p.validate(int(profile_summary["n_layers"]))
        elif method == "midas":
            p.validate(n_profiles)
    except (ConversionError, ValueError) as exc:
        raise ApiError(422, f"{method}: {exc}") from exc


@router.get("", response_model=ConversionList, summary="Conversions, newest first")
def list_conversions(session: SessionDep, profile_id: str | None = None) -> ConversionList:
    query = select(Conversion).order_by(Conversion.created_at.desc())
    if profile_id:
        query = query.where(Conversion.profile_id == profile_id)
    rows = session.execute(query).scalars().unique().all()
    return ConversionList(items=[conversion_out(r) for r in rows], total=len(rows))


@router.get("/{conversion_id}", response_model=ConversionOut, summary="One conversion with its per-layer plan")
def get_conversion(conversion_id: str, session: SessionDep, store: StoreDep) -> ConversionOut:
    row = lookup(session, Conversion, conversion_id, "conversion", "conversions")
    layers = None
    record = store.path("conversions", row.id) / "conversion.json"
    if row.job is not None and row.job.state == "succeeded" and record.is_file():
        from ..charts import jsonable

        layers = jsonable(json.loads(record.read_text()).get("layers"))
    return conversion_out(row, layers)
