"""Conversions: queue a dense → MoE conversion of a profiled model; read its plan."""

from __future__ import annotations

import json

from fastapi import APIRouter
from sqlalchemy import select

from workers.engine.core.params import ConversionError
from workers.engine.methods import get_method, params_from_dict

from moelab.store.db import CalibrationSet, Conversion, Model, Profile
from ..deps import QueueDep, SessionDep, StoreDep, launch, lookup, require_ready
from ..errors import ApiError
from moelab.store.jobs import new_id
from ..schemas import ConversionCreate, ConversionList, ConversionOut
from ..views import conversion_out

router = APIRouter(prefix="/conversions", tags=["conversions"])


@router.post("", response_model=ConversionOut, status_code=202, responses={404: {}, 409: {}, 422: {}},
             summary="Convert a model into an MoE model with any method (queued job)")
def create_conversion(body: ConversionCreate, session: SessionDep, queue: QueueDep) -> ConversionOut:
    method = get_method(body.method)
    params = body.engine_params()
    profile_id = model_id = None
    if method.needs == "moe_model":
        model = lookup(session, Model, body.model_id, "model", "models")
        require_ready(model, "model")
        if (model.summary or {}).get("kind") != "moe":
            raise ApiError(422, f"model {model.id} is not a Mixture-of-Experts model; {method.name} conversion restructures "
                                "the experts of an MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE): register one")
        _check_engine_params(method.name, params, [])
        params["calibration"] = _calibration_spec(session, body.calibration)
        model_id = model.id
    else:
        profiles = [lookup(session, Profile, pid, "profile", "profiles") for pid in [body.profile_id, *body.extra_profile_ids]]
        for p in profiles:
            require_ready(p, "profile")
        if len({p.model_id for p in profiles}) > 1:
            raise ApiError(422, f"{method.name}: every profile must be of the same model; these come from "
                                + ", ".join(sorted({p.model_id for p in profiles})))
        _check_engine_params(method.name, params, [_ProfileFacts(p.summary or {}) for p in profiles])
        if body.extra_profile_ids:
            params["extra_profile_ids"] = list(body.extra_profile_ids)
        profile_id = profiles[0].id
    row = Conversion(id=new_id("conv"), profile_id=profile_id, model_id=model_id, params=params)
    session.add(row)
    launch(session, queue, row, "conversions", "conversion")
    return conversion_out(row)


class _ProfileFacts:
    """What a method's ``validate`` reads of a profile (its manifest's sizes), from the profile row's
    summary: the API checks the parameters against the profiles without opening their artifacts."""

    def __init__(self, summary: dict) -> None:
        self.manifest = {"d_ffn": summary.get("d_ffn", []), "n_layers": summary.get("n_layers")}


def _check_engine_params(method: str, params: dict, profiles: list[_ProfileFacts]) -> None:
    """The method's own validation against the profiles' sizes (422 with its message)."""
    try:
        validate = get_method(method).validate
        parsed = params_from_dict(params)
        if validate is not None and all(p.manifest["n_layers"] for p in profiles):
            validate(parsed, profiles)
    except (ConversionError, ValueError) as exc:
        raise ApiError(422, f"{method}: {exc}") from exc


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
        from moelab.store.jsonsafe import jsonable

        layers = jsonable(json.loads(record.read_text()).get("layers"))
    return conversion_out(row, layers)
