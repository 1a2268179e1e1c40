"""Recovery fine-tuning: queue a fine-tune of a ready conversion, follow its live train log,
and find the fine-tuned model as a new conversion.

Cancel and resume are the job endpoints (``DELETE /jobs/{id}``, ``POST /jobs/{id}/retry``): the
fine-tune's work dir (``<artifacts>/finetunes/<ft-id>/``) is kept across runs, so a re-run
continues from the latest checkpoint instead of starting over.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, get_args

import numpy as np
from fastapi import APIRouter, Query
from sqlalchemy import select

from moelab.engine.data.builtin import bigbench_installed

from moelab.store.artifacts import ArtifactStore
from moelab.store.db import CalibrationSet, Conversion, Finetune
from ..deps import CascadeQ, QueueDep, SessionDep, SettingsDep, StoreDep, TagQ, launch, lookup, require_ready, with_tag
from ..deletion import delete_resource
from ..errors import ApiError
from moelab.engine.limits import conversion_config, eval_tokens_problem, lora_rank_problem, seq_len_problem
from moelab.store.jobs import new_id
from ..schemas import DeleteOut, FinetuneCreate, FinetuneList, FinetuneMode, FinetuneOut, ParamList, ParamOut, TrainLog, TrainStep
from ..views import finetune_out

router = APIRouter(prefix="/finetunes", tags=["finetunes"])

MODES: tuple[str, ...] = get_args(FinetuneMode)
LOG_FILE = "train_log.json"
#: step fields averaged over a bucket when a long log is thinned; the others keep the bucket's last value
_MEAN_FIELDS = ("loss", "ntp_loss", "kd_loss", "aux_loss", "load_cv", "lr")
_LAST_FIELDS = ("step", "tokens", "elapsed_s")


def default_mode(conversion: Conversion) -> str:
    """The fine-tuning mode of a conversion's method (the mode of the same name); 422 when the
    method has none (hierarchical)."""
    from moelab.engine.methods import method_of

    method = method_of(conversion.params or {})
    if method not in MODES:
        raise ApiError(422, f"mode: conversion {conversion.id} was made with method {method!r}, which has no default "
                            f"fine-tuning mode; pass mode explicitly (one of {', '.join(MODES)})")
    return method


def check_mode(mode: str, conversion: Conversion, store: ArtifactStore) -> None:
    """422 when ``mode`` cannot train this conversion's layers (their kinds and combines, read from
    its ``config.json``; ``Recovery.refusal``), before anything is queued."""
    from moelab.engine.methods import REGISTRY

    try:
        config = json.loads((store.path("conversions", conversion.id) / "config.json").read_text())
    except (OSError, ValueError):
        return  # not readable here: the job's own check says it
    problem = REGISTRY[mode].recovery.refusal(mode, config.get("moe_layers") or [])  # type: ignore[union-attr]
    if problem:
        raise ApiError(422, f"mode: {problem}")


def engine_source(source: str, store: ArtifactStore) -> str:
    """The API's ``source`` (builtin:NAME or a calibration-set id) as the engine reads it."""
    return source if source.startswith("builtin:") else str(store.path("calibration-sets", source))


def check_params(params: dict[str, Any], store: ArtifactStore) -> None:
    """The engine's own ``FinetuneParams.validate`` (422 with its message), before anything is queued.

    Imported here, not at module level: the engine module pulls in torch and peft (seconds), so
    the first fine-tune request pays for it, not the API's start.
    """
    from moelab.engine.training.finetune import FinetuneError, FinetuneParams

    try:
        FinetuneParams.from_dict({**params, "source": engine_source(params["source"], store)}).validate()
    except (FinetuneError, TypeError) as exc:
        raise ApiError(422, f"fine-tuning: {exc}") from exc


def check_limits(body: Any, conversion: Conversion, store: ArtifactStore, max_eval_tokens: int) -> None:
    """422 when the fine-tune asks for more than the conversion's model can use: a LoRA rank above its d_model,
    sequences longer than its max_position_embeddings (both from its ``config.json``), or held-out windows
    beyond MOELAB_MAX_EVAL_TOKENS."""
    config = conversion_config(store.path("conversions", conversion.id))
    what = f"the model of conversion {conversion.id}"
    for problem in (lora_rank_problem(body.lora_rank, config, what=what), seq_len_problem(body.seq_len, config, what=what),
                    eval_tokens_problem(body.eval_windows, body.seq_len, max_eval_tokens, windows_name="eval_windows")):
        if problem:
            raise ApiError(422, problem)


@router.post("", response_model=FinetuneOut, status_code=202, responses={404: {}, 409: {}, 422: {}},
             summary="Fine-tune a conversion to recover quality (queued job)")
def create_finetune(body: FinetuneCreate, session: SessionDep, queue: QueueDep, store: StoreDep, settings: SettingsDep) -> FinetuneOut:
    conversion = lookup(session, Conversion, body.conversion_id, "conversion", "conversions")
    require_ready(conversion, "conversion")
    if "builtin:bigbench" in (body.source, body.eval_source) and not bigbench_installed(settings.data_dir):
        raise ApiError(409, "builtin:bigbench is not installed on this server; run `moelab data install bigbench` there first")
    if not body.source.startswith("builtin:"):
        cset = session.get(CalibrationSet, body.source)
        if cset is None:
            raise ApiError(422, f"source: {body.source!r} is neither builtin:NAME nor the id of a stored calibration set "
                                "(GET /api/v1/calibration-sets)")
        require_ready(cset, "calibration set")
    params = body.model_dump(exclude={"conversion_id"})
    params["mode"] = body.mode or default_mode(conversion)
    check_mode(params["mode"], conversion, store)
    check_params(params, store)
    check_limits(body, conversion, store, settings.max_eval_tokens)
    row = Finetune(id=new_id("ft"), conversion_id=conversion.id, params=params)
    session.add(row)
    launch(session, queue, row, "finetunes", "finetune")
    return finetune_out(row)


@router.get("", response_model=FinetuneList, summary="Fine-tunes, newest first")
def list_finetunes(session: SessionDep, conversion_id: str | None = None, tag: TagQ = None) -> FinetuneList:
    query = select(Finetune).order_by(Finetune.created_at.desc())
    if conversion_id:
        query = query.where(Finetune.conversion_id == conversion_id)
    rows = session.execute(query).scalars().unique().all()
    rows = with_tag(rows, tag)
    return FinetuneList(items=[finetune_out(r) for r in rows], total=len(rows))


@router.get("/params", response_model=ParamList,
            summary="The fine-tune hyper-parameters (name, type, default, help, paper, bounds), from the engine's declarations")
def finetune_params() -> ParamList:
    """What the Fine-tune page and ``moelab finetune`` offer, so no client repeats a default or a bound; the modes
    are the methods with a recovery (``GET /methods``: ``recovery``, ``recovery_summary``)."""
    from moelab.engine.training.params import FinetuneParams

    return ParamList(items=[ParamOut(**s.to_dict()) for s in FinetuneParams.specs()])


@router.get("/{finetune_id}", response_model=FinetuneOut, summary="One fine-tune: perplexity before / after, result conversion")
def get_finetune(finetune_id: str, session: SessionDep) -> FinetuneOut:
    return finetune_out(lookup(session, Finetune, finetune_id, "fine-tune", "finetunes"))


def thin_steps(steps: list[dict[str, Any]], max_points: int) -> tuple[list[dict[str, Any]], bool]:
    """At most ``max_points`` points: buckets of consecutive steps, losses and LR averaged
    (so a thinned curve is a smoothed one, not a subsample), step / tokens / time of the bucket's end."""
    if len(steps) <= max_points:
        return steps, False
    k = -(-len(steps) // max_points)
    n_buckets = -(-len(steps) // k)
    pad = n_buckets * k - len(steps)
    out: list[dict[str, Any]] = [{} for _ in range(n_buckets)]
    last = [min((b + 1) * k, len(steps)) - 1 for b in range(n_buckets)]
    for name in _MEAN_FIELDS:
        col = np.array([s.get(name) for s in steps] + [None] * pad, dtype=float).reshape(n_buckets, k)
        seen = np.isfinite(col).sum(1)
        means = np.where(seen > 0, np.nansum(col, 1) / np.maximum(seen, 1), np.nan)
        for row, value in zip(out, means.tolist()):
            row[name] = value if value == value else None
    for name in _LAST_FIELDS:
        for row, i in zip(out, last):
            row[name] = steps[i].get(name)
    return out, True


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value == value else None


@router.get("/{finetune_id}/log", response_model=TrainLog,
            summary="The live train log: loss and aux loss per step, status, perplexities (readable while it runs)")
def get_log(
    finetune_id: str, session: SessionDep, store: StoreDep,
    max_points: Annotated[int, Query(ge=2, le=100_000, description="at most this many points (bucket means beyond)")] = 2000,
) -> TrainLog:
    row = lookup(session, Finetune, finetune_id, "fine-tune", "finetunes")
    path = store.path("finetunes", row.id) / LOG_FILE
    # the trainer replaces the file atomically after every step: a read sees one whole version
    log: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    raw = [s for s in log.get("steps") or [] if isinstance(s, dict) and "step" in s]
    steps, aggregated = thin_steps(raw, max_points)
    return TrainLog(
        finetune_id=row.id, state=row.job.state if row.job is not None else None, status=log.get("status"),
        mode=log.get("mode") or (row.params or {}).get("mode"), total_steps=int((row.params or {}).get("steps", 0)),
        n_steps=len(raw), steps=[TrainStep(**{k: s.get(k) for k in TrainStep.model_fields}) for s in steps],
        aggregated=aggregated, resumed_at=[int(s) for s in log.get("resumed_at") or []],
        perplexity_before=_num(log.get("perplexity_before")), perplexity_start=_num(log.get("perplexity_start")),
        perplexity_after=_num(log.get("perplexity_after")), dense_perplexity=_num(log.get("dense_perplexity")),
        result_conversion_id=row.result_conversion_id,
    )


@router.delete("/{finetune_id}", response_model=DeleteOut, responses={404: {}, 409: {}}, summary="Delete a fine-tune and its work dir (its result conversion stays)")
def delete_finetune(finetune_id: str, session: SessionDep, queue: QueueDep, store: StoreDep, cascade: CascadeQ = False) -> DeleteOut:
    """Cancels the resource's queued or running job (and its dependants' with cascade) before deleting."""
    return delete_resource(session, queue, store, "finetunes", finetune_id, cascade)
