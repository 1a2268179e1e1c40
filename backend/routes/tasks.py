"""The lm-evaluation-harness tasks an evaluation can run (``evaluation.harness``; no model work, no torch)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ..deps import SettingsDep
from ..errors import ApiError
from ..schemas import TaskList, TaskOut
from .evaluations import checked_task_dir

router = APIRouter(prefix="/tasks", tags=["tasks"])


@router.get("", response_model=TaskList, responses={422: {}},
            summary="Tasks an evaluation can name: moelab's built-in ones (offline), a task_dir's, lm-eval's registry")
def list_tasks(settings: SettingsDep,
               task_dir: Annotated[str | None, Query(max_length=4096, description="also a server directory of task YAMLs "
                                                     "inside MOELAB_DATA_ROOTS")] = None,
               registry: Annotated[bool, Query(description="also lm-eval's registry (thousands of names)")] = False) -> TaskList:
    from moelab.engine.evaluation.harness import TaskError
    from moelab.engine.evaluation.harness import list_tasks as listed

    try:
        items = listed(checked_task_dir(task_dir, settings), registry=registry)
    except TaskError as exc:
        raise ApiError(422, f"task_dir: {exc}") from exc
    shown = items if registry else [t for t in items if t["source"] != "lm-eval"]
    return TaskList(items=[TaskOut(**t) for t in shown], total=len(shown))
