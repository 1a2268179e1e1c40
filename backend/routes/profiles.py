"""Profiles: queue a profiling run of a model over a calibration set; read its summary."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import select

from moelab.store.db import CalibrationSet, Model, Profile
from ..deps import CascadeQ, QueueDep, SessionDep, StoreDep, TagQ, launch, lookup, require_ready, with_tag
from ..deletion import delete_resource
from ..errors import ApiError
from moelab.engine.limits import atopk_problem
from moelab.store.jobs import new_id
from moelab.engine.sizes import format_size, parse_size
from ..schemas import DeleteOut, ProfileCreate, ProfileList, ProfileOut
from ..views import profile_out

router = APIRouter(prefix="/profiles", tags=["profiles"])


@router.post("", response_model=ProfileOut, status_code=202, responses={404: {}, 409: {}, 422: {}},
             summary="Profile a model over a calibration set (queued job)")
def create_profile(body: ProfileCreate, session: SessionDep, queue: QueueDep) -> ProfileOut:
    model = lookup(session, Model, body.model_id, "model", "models")
    cset = lookup(session, CalibrationSet, body.calibration_set_id, "calibration set", "calibration-sets")
    if model.job is not None and model.job.state in ("failed", "cancelled"):
        raise ApiError(409, f"model {model.id} could not be loaded (job {model.job.id} {model.job.state}: {model.job.error}); fix the source and register it again")
    require_ready(cset, "calibration set")
    if (model.summary or {}).get("kind") == "moe":
        raise ApiError(422, f"model {model.id} is a Mixture-of-Experts model: profiling reads dense GLU layers; "
                            "convert it with method 'hierarchical' (it profiles its experts itself)")
    problem = atopk_problem(body.atopk_k, (model.summary or {}).get("d_ffn"), what=f"model {model.id}")
    if problem:
        raise ApiError(422, problem)
    n = (cset.summary or {}).get("n_samples")
    if body.samples is not None and n is not None and body.samples > n:
        raise ApiError(422, f"samples: the set {cset.id} has {n} samples, cannot draw {body.samples}; ask for at most {n}")
    if body.group_by in ("task", "domain"):
        labels = sorted((cset.summary or {}).get(f"{body.group_by}s") or {})
        if len(labels) < 2:
            raise ApiError(
                422, f"group_by: the CV across {body.group_by}s needs at least 2 distinct {body.group_by} labels, "
                f"set {cset.id} has {labels or 'none'}; use group_by='sample' or 'auto'",
            )
    floor = ((model.summary or {}).get("memory") or {}).get("min_max_memory")
    if body.max_memory is not None and floor is not None and parse_size(body.max_memory) < floor:
        raise ApiError(422, f"max_memory: {body.max_memory} cannot hold one step of model {model.id} "
                            f"(largest decoder layer {format_size(model.summary['memory']['max_layer_bytes'])}, "
                            f"embeddings {format_size(model.summary['memory']['resident_bytes'])}); "
                            f"give at least {format_size(floor)} ({floor} bytes)")
    row = Profile(id=new_id("pr"), model_id=model.id, calibration_set_id=cset.id,
                  params=body.model_dump(exclude={"model_id", "calibration_set_id"}))
    session.add(row)
    launch(session, queue, row, "profiles", "profile")
    return profile_out(row)


@router.get("", response_model=ProfileList, summary="Profiles, newest first")
def list_profiles(session: SessionDep, model_id: str | None = None, tag: TagQ = None) -> ProfileList:
    query = select(Profile).order_by(Profile.created_at.desc())
    if model_id:
        query = query.where(Profile.model_id == model_id)
    rows = session.execute(query).scalars().unique().all()
    rows = with_tag(rows, tag)
    return ProfileList(items=[profile_out(r) for r in rows], total=len(rows))


@router.get("/{profile_id}", response_model=ProfileOut, summary="One profile and its summary")
def get_profile(profile_id: str, session: SessionDep) -> ProfileOut:
    return profile_out(lookup(session, Profile, profile_id, "profile", "profiles"))


@router.delete("/{profile_id}", response_model=DeleteOut, responses={404: {}, 409: {}}, summary="Delete a profile and its artifact (409 while conversions use it)")
def delete_profile(profile_id: str, session: SessionDep, queue: QueueDep, store: StoreDep, cascade: CascadeQ = False) -> DeleteOut:
    """Cancels the resource's queued or running job (and its dependants' with cascade) before deleting."""
    return delete_resource(session, queue, store, "profiles", profile_id, cascade)
