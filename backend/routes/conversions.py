"""Conversions: queue a dense → MoE conversion of a profiled model; read its plan."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy import select

from moelab.engine.core.params import ConversionError
from moelab.engine.methods import get_method, params_from_dict

from moelab.store.db import CalibrationSet, Conversion, Model, Profile
from ..deps import CascadeQ, IndexPath, QueueDep, SessionDep, StoreDep, TagQ, launch, lookup, require_ready, with_tag
from ..deletion import delete_resource
from ..errors import ApiError
from moelab.engine.limits import profile_duplicates_problem
from moelab.store.jobs import new_id
from ..schemas import MAX_INT, DeleteOut, ConversionCreate, ConversionList, ConversionOut, ExpertMatching, ExpertNeurons, ExpertOut
from ..views import conversion_out
from .exports import exports_of, gguf_check

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
        problem = profile_duplicates_problem(body.profile_id, list(body.extra_profile_ids))
        if problem:
            raise ApiError(422, f"{method.name}: {problem}")
        profiles = [lookup(session, Profile, pid, "profile", "profiles") for pid in [body.profile_id, *body.extra_profile_ids]]
        for p in profiles:
            require_ready(p, "profile")
        if len({p.model_id for p in profiles}) > 1:
            raise ApiError(422, f"{method.name}: every profile must be of the same model; these come from "
                                + ", ".join(sorted({p.model_id for p in profiles})))
        _check_engine_params(method.name, params, [_ProfileFacts(p.summary or {}) for p in profiles])
        if body.extra_profile_ids:
            params["extra_profile_ids"] = list(body.extra_profile_ids)
        if body.max_memory is not None:
            _check_budget(session, method, params, profiles[0], body.max_memory)
            params["max_memory"] = body.max_memory
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


def _check_budget(session, method, params: dict, profile: Profile, max_memory: str) -> None:
    """422 when ``max_memory`` cannot hold one layer of the profiled model, or when the conversion would
    have to stream (the model and a fit's work exceed it) but its method or recipe needs the whole model, or
    the budget cannot hold the fit beside the largest layer (``core.params.fit_bytes``)."""
    from moelab.engine.core.params import check_streamable, fit_budget_error, fit_bytes
    from moelab.engine.sizes import format_size, parse_size

    summary = session.get(Model, profile.model_id).summary or {}
    memory = summary.get("memory") or {}
    budget = parse_size(max_memory)
    if memory.get("min_max_memory") is not None and budget < memory["min_max_memory"]:
        raise ApiError(422, f"max_memory: {max_memory} cannot hold one layer of model {profile.model_id}; "
                            f"give at least {format_size(memory['min_max_memory'])} ({memory['min_max_memory']} bytes)")
    if memory.get("total_bytes") is None:
        return
    parsed = params_from_dict(params)
    shape = (summary.get("d_model"), max(summary.get("d_ffn") or [0]), summary.get("n_layers"))
    work = fit_bytes(parsed, *shape) if all(shape) else 0
    if budget < memory["total_bytes"] + work:
        try:
            check_streamable(method, parsed)
        except ConversionError as exc:
            raise ApiError(422, f"max_memory: {exc}") from exc
        if error := fit_budget_error(parsed, budget, memory["min_max_memory"], work):
            raise ApiError(422, f"max_memory: {error}")


def _calibration_spec(session, ref: str) -> str:
    """``builtin:NAME`` as given; a stored calibration set's id must exist and be ready."""
    if ref.startswith("builtin:"):
        from moelab.engine.data.builtin import BUILTIN_SETS

        if ref[len("builtin:"):] not in BUILTIN_SETS:
            raise ApiError(422, f"unknown built-in set {ref!r}; use one of: " + ", ".join(f"builtin:{n}" for n in BUILTIN_SETS))
        return ref
    cset = lookup(session, CalibrationSet, ref, "calibration set", "calibration-sets")
    require_ready(cset, "calibration set")
    return cset.id


@router.get("", response_model=ConversionList, summary="Conversions, newest first, each saying whether it exports to GGUF")
def list_conversions(session: SessionDep, store: StoreDep, profile_id: str | None = None, tag: TagQ = None) -> ConversionList:
    query = select(Conversion).order_by(Conversion.created_at.desc())
    if profile_id:
        query = query.where(Conversion.profile_id == profile_id)
    rows = session.execute(query).scalars().unique().all()
    rows = with_tag(rows, tag)
    exports = exports_of(session, [r.id for r in rows] if profile_id else None)
    return ConversionList(items=[conversion_out(r, gguf=gguf_check(store, r), exports=exports.get(r.id)) for r in rows],
                          total=len(rows))


@router.get("/{conversion_id}", response_model=ConversionOut,
            summary="One conversion with its per-layer plan, whether it exports to GGUF, and its exports")
def get_conversion(conversion_id: str, session: SessionDep, store: StoreDep) -> ConversionOut:
    row = lookup(session, Conversion, conversion_id, "conversion", "conversions")
    layers = None
    record = store.path("conversions", row.id) / "conversion.json"
    if row.job is not None and row.job.state == "succeeded" and record.is_file():
        from moelab.store.jsonsafe import jsonable

        layers = jsonable(json.loads(record.read_text()).get("layers"))
    return conversion_out(row, layers, gguf=gguf_check(store, row), exports=exports_of(session, [row.id]).get(row.id))


@router.get("/{conversion_id}/experts/{layer}", response_model=ExpertNeurons, responses={404: {}, 409: {}, 422: {}},
            summary="Which dense neurons each expert of one layer holds, with their CV")
def get_expert_neurons(conversion_id: str, layer: IndexPath, session: SessionDep, store: StoreDep) -> ExpertNeurons:
    """The neuron partition a partition method (ExpertWeaver, CMoE) built for ``layer``: the shared
    expert's neurons and each routed expert's (ids of the dense FFN's neurons, as in the neuron
    explorer), and each neuron's CV (EW Eq. 3) from the conversion's profile when it still exists."""
    from safetensors import safe_open

    from moelab.engine.profiling.store import ProfileNotFound, StoredProfile
    from moelab.engine.runtime.export import PARTITION_FILE

    row = lookup(session, Conversion, conversion_id, "conversion", "conversions")
    require_ready(row, "conversion")
    path = store.path("conversions", row.id) / PARTITION_FILE
    if not path.is_file():
        raise ApiError(409, f"conversion {row.id} records no neuron partition: only ExpertWeaver and CMoE conversions made by "
                            "this version have one (convert again to get it)")
    with safe_open(str(path), framework="numpy") as f:
        layers = sorted({int(k.split(".")[1]) for k in f.keys()})
        if layer not in layers:
            raise ApiError(422, f"layer {layer} of conversion {row.id} has no experts; converted layers: "
                                + ", ".join(map(str, layers)))
        shared, routed = f.get_tensor(f"layer.{layer}.shared"), f.get_tensor(f"layer.{layer}.routed")
    cv = None
    if row.profile_id is not None:
        try:
            cv = StoredProfile.open(store.path("profiles", row.profile_id)).cv_by_layer()[layer]
        except (ProfileNotFound, IndexError):
            cv = None

    def cvs(ids):
        return [float(cv[i]) for i in ids] if cv is not None else None

    return ExpertNeurons(
        conversion_id=row.id, profile_id=row.profile_id, layer=layer, shared=shared.tolist(), shared_cv=cvs(shared),
        experts=[ExpertOut(expert=e, neurons=ids.tolist(), cv=cvs(ids)) for e, ids in enumerate(routed)],
    )


@router.get("/{conversion_id}/matching/{other_id}", response_model=ExpertMatching, responses={404: {}, 409: {}, 422: {}},
            summary="Experts of two conversions of one model matched by their dense neurons (Jaccard, exact assignment)")
def get_expert_matching(conversion_id: str, other_id: str, session: SessionDep, store: StoreDep,
                        layer: Annotated[int | None, Query(ge=0, le=MAX_INT, description="one layer (with its full Jaccard matrix); "
                                                                               "all layers when unset")] = None) -> ExpertMatching:
    """Expert ids of two conversions are unrelated labels; this pairs A's routed experts with B's per layer by the
    overlap of their neuron sets (``evaluation.expert_matching``: numpy and scipy on the stored partitions, no model),
    so B's experts can be shown under A's matched ids. Layers without neuron sets (dense, AbsTopK/TEAL, MIDAS,
    Dense2MoE, hierarchical) are listed in ``skipped`` with the reason; conversions of different models are refused 422."""
    from moelab.engine.evaluation.expert_matching import CONVERSION_FILE, match_conversion_dirs

    rows = [lookup(session, Conversion, ident, "conversion", "conversions") for ident in (conversion_id, other_id)]
    for row in rows:
        require_ready(row, "conversion")
        if not (store.path("conversions", row.id) / CONVERSION_FILE).is_file():
            raise ApiError(409, f"conversion {row.id} has no stored files; convert again")
    try:
        matching = match_conversion_dirs(store.path("conversions", rows[0].id), store.path("conversions", rows[1].id),
                                         layers=None if layer is None else [layer], names=(rows[0].id, rows[1].id))
    except ValueError as exc:  # DifferentModels too: what to choose instead is in its message
        raise ApiError(422, str(exc)) from exc
    return ExpertMatching(**matching.to_dict(with_matrix=layer is not None))


@router.delete("/{conversion_id}", response_model=DeleteOut, responses={404: {}, 409: {}}, summary="Delete a conversion, its model files and its exports (409 while evaluations or fine-tunes use it)")
def delete_conversion(conversion_id: str, session: SessionDep, queue: QueueDep, store: StoreDep, cascade: CascadeQ = False) -> DeleteOut:
    """Cancels the resource's queued or running job (and its dependants' with cascade) before deleting."""
    return delete_resource(session, queue, store, "conversions", conversion_id, cascade)
