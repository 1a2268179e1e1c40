"""Evaluations: queue perplexity / reconstruction / routing of a conversion on held-out text."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import PlainTextResponse
from sqlalchemy import select

from moelab.engine.data.builtin import bigbench_installed
from moelab.engine.methods import method_of, normalise_params
from moelab.engine.sources import inside_roots

from moelab.store.db import CalibrationSet, Conversion, Evaluation
from ..deps import CascadeQ, QueueDep, SessionDep, SettingsDep, StoreDep, TagQ, launch, lookup, require_ready, with_tag
from ..deletion import delete_resource
from ..errors import ApiError
from moelab.engine.limits import conversion_config, eval_tokens_problem, seq_len_problem
from moelab.store.jobs import new_id
from ..schemas import DeleteOut, EvaluationCreate, EvaluationList, EvaluationOut, ResourceStatus
from ..views import evaluation_out, status_of

router = APIRouter(prefix="/evaluations", tags=["evaluations"])


@router.post("", response_model=EvaluationOut, status_code=202, responses={404: {}, 409: {}, 422: {}},
             summary="Evaluate a conversion against the dense model (queued job)")
def create_evaluation(body: EvaluationCreate, session: SessionDep, queue: QueueDep, settings: SettingsDep,
                      store: StoreDep) -> EvaluationOut:
    # 422 when the held-out tokens (n_windows × seq_len) exceed MOELAB_MAX_EVAL_TOKENS or seq_len exceeds the
    # model's max_position_embeddings (read from the conversion's config.json, no torch)
    problem = eval_tokens_problem(body.n_windows, body.seq_len, settings.max_eval_tokens)
    if problem:
        raise ApiError(422, problem)
    conversion = lookup(session, Conversion, body.conversion_id, "conversion", "conversions")
    require_ready(conversion, "conversion")
    problem = seq_len_problem(body.seq_len, conversion_config(store.path("conversions", conversion.id)),
                              what=f"the model of conversion {conversion.id}")
    if problem:
        raise ApiError(422, problem)
    _check_tasks(body, settings)
    label = body.source
    if body.source == "builtin:bigbench" and not bigbench_installed(settings.data_dir):
        raise ApiError(409, "builtin:bigbench is not installed on this server; run `moelab data install bigbench` there first")
    if not body.source.startswith("builtin:"):
        cset = session.get(CalibrationSet, body.source)
        if cset is None:
            raise ApiError(422, f"source: {body.source!r} is neither builtin:NAME nor the id of a stored calibration set (GET /api/v1/calibration-sets)")
        require_ready(cset, "calibration set")
        label = cset.name
    params = {**body.model_dump(exclude={"conversion_id"}), "label": label}
    row = Evaluation(id=new_id("ev"), conversion_id=conversion.id, params=params)
    session.add(row)
    launch(session, queue, row, "evaluations", "evaluation")
    return evaluation_out(row)


def checked_task_dir(task_dir: str | None, settings: Any) -> Path | None:
    """``task_dir``'s real path, when it is a directory inside MOELAB_DATA_ROOTS (not DATA_DIR/uploads: a task YAML
    may run Python through ``!function``, so only directories the server's administrator placed are read); 422 else."""
    if task_dir is None:
        return None
    roots = [Path(r).expanduser().resolve() for r in settings.data_roots]
    if "\x00" in task_dir or not task_dir.startswith("/"):
        raise ApiError(422, "task_dir: give the absolute path of a server directory of lm-eval task YAMLs")
    if not roots or not inside_roots(task_dir, roots):
        raise ApiError(422, f"task_dir: {task_dir!r} is outside MOELAB_DATA_ROOTS; the server's administrator places task "
                            "directories there (uploads are not read: a task YAML may run Python)")
    real = Path(os.path.realpath(task_dir))
    if not real.is_dir():
        raise ApiError(422, f"task_dir: {task_dir!r} is not a directory on the server")
    return real


def _check_tasks(body: EvaluationCreate, settings: Any) -> None:
    """422 before queueing: unknown task names, a task directory outside the roots, an lm-eval task whose data this
    server cannot read (offline: it must be in the HF cache). Torch-free (``evaluation.harness``)."""
    from moelab.engine.evaluation.harness import TaskError, TaskRequest, list_tasks, load_tasks, unknown_tasks

    task_dir = checked_task_dir(body.task_dir, settings)
    if not body.tasks:
        if task_dir is not None:
            raise ApiError(422, "tasks: name the tasks of task_dir to run (GET /api/v1/tasks?task_dir=… lists them)")
        return
    try:
        unknown = unknown_tasks(body.tasks, task_dir)
    except TaskError as exc:
        raise ApiError(422, f"task_dir: {exc}") from exc
    if unknown:
        raise ApiError(422, f"tasks: unknown task(s) {', '.join(unknown)}; GET /api/v1/tasks lists them")
    offline = {t["name"] for t in list_tasks(task_dir, registry=False) if t["offline"]}  # built-in and task_dir tasks
    registry = [t for t in body.tasks if t not in offline]
    if registry:
        try:
            load_tasks(TaskRequest(tasks=tuple(registry)))
        except TaskError as exc:
            raise ApiError(422, f"tasks: {exc}") from exc


@router.get("/{evaluation_id}/tasks-table", summary="The evaluation's task accuracies as a paper-style table (CSV or Markdown)",
            response_class=PlainTextResponse, responses={404: {}, 409: {}})
def evaluation_task_table(evaluation_id: str, session: SessionDep,
                          format: Annotated[Literal["csv", "markdown"], Query(description="csv or markdown")] = "markdown",
                          ) -> PlainTextResponse:
    """One row per model (dense, converted, the baselines), one column per task: accuracy in percent ± stderr."""
    from moelab.engine.evaluation.harness import task_table

    row = lookup(session, Evaluation, evaluation_id, "evaluation", "evaluations")
    require_ready(row, "evaluation")
    tasks = (row.summary or {}).get("tasks")
    if not tasks:
        raise ApiError(409, f"evaluation {evaluation_id} ran no tasks; evaluate with tasks (e.g. [\"moelab_chat_qa\"])")
    media = "text/csv" if format == "csv" else "text/markdown"
    return PlainTextResponse(task_table(tasks, fmt=format), media_type=media,
                             headers={"Content-Disposition": f'attachment; filename="{evaluation_id}-tasks.{"csv" if format == "csv" else "md"}"'})


@router.get("", response_model=EvaluationList, summary="Evaluations, newest first, filterable")
def list_evaluations(
    session: SessionDep, conversion_id: str | None = None, tag: TagQ = None,
    method: Annotated[str | None, Query(max_length=40, description="only evaluations of conversions by this method")] = None,
    text: Annotated[str | None, Query(max_length=200, description="only those scored on this held-out text (builtin:NAME, a set id or its name)")] = None,
    status: ResourceStatus | None = None,
    q: Annotated[str | None, Query(max_length=200, description="words found in the id, the text, the notes or the tags (case-insensitive)")] = None,
) -> EvaluationList:
    query = select(Evaluation).order_by(Evaluation.created_at.desc())
    if conversion_id:
        query = query.where(Evaluation.conversion_id == conversion_id)
    rows = with_tag(session.execute(query).scalars().unique().all(), tag)
    if method:
        methods = {c.id: method_of(normalise_params(c.params or {}))
                   for c in session.execute(select(Conversion).where(Conversion.id.in_({r.conversion_id for r in rows}))).scalars()}
        rows = [r for r in rows if methods.get(r.conversion_id) == method]
    if text:
        rows = [r for r in rows if text in ((r.params or {}).get("source"), (r.params or {}).get("label"))]
    if status:
        rows = [r for r in rows if status_of(r.job) == status]
    if q:
        words = q.lower().split()
        rows = [r for r in rows if all(w in _searchable(r) for w in words)]
    return EvaluationList(items=[evaluation_out(r) for r in rows], total=len(rows))


def _searchable(row: Evaluation) -> str:
    p = row.params or {}
    return " ".join([row.id, row.conversion_id, str(p.get("source", "")), str(p.get("label", "")), row.notes or "",
                     *(row.tags or [])]).lower()


@router.get("/{evaluation_id}", response_model=EvaluationOut, summary="One evaluation and its summary")
def get_evaluation(evaluation_id: str, session: SessionDep) -> EvaluationOut:
    return evaluation_out(lookup(session, Evaluation, evaluation_id, "evaluation", "evaluations"))


@router.delete("/{evaluation_id}", response_model=DeleteOut, responses={404: {}, 409: {}}, summary="Delete an evaluation and its report")
def delete_evaluation(evaluation_id: str, session: SessionDep, queue: QueueDep, store: StoreDep, cascade: CascadeQ = False) -> DeleteOut:
    """Cancels the resource's queued or running job (and its dependants' with cascade) before deleting."""
    return delete_resource(session, queue, store, "evaluations", evaluation_id, cascade)
