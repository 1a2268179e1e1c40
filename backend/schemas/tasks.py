"""Tasks: the lm-eval tasks an evaluation can score (``GET /tasks``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field


#: An lm-eval task name (its registry's names: letters, digits, ``_ - .``).
TaskName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")]


class TaskOut(BaseModel):
    name: str
    source: Literal["builtin", "task_dir", "lm-eval"] = Field(description="moelab's built-in tasks, the task_dir's, lm-eval's registry")
    offline: bool = Field(description="runs without network: built-in and task_dir tasks; lm-eval's need their data cached")
    domain: str | None = Field(None, description="a built-in task: the built-in set its text comes from (builtin:chat …), "
                               "so a conversion's calibration tells whether the task is in its domain")
    needs: str | None = Field(None, description="what installs its data first (moelab_bigbench_mc: moelab data install bigbench)")


class TaskList(BaseModel):
    items: list[TaskOut]
    total: int = Field(description="tasks listed, before any paging of lm-eval's registry")
