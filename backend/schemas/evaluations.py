"""Evaluations: perplexity, speed and task scores of a conversion against its dense model."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field, StrictBool, model_validator

from moelab.engine.data.builtin import BUILTIN_SETS

from .common import JobOut, ResourceStatus, _In, _Noted
from .tasks import TaskName


class EvaluationCreate(_In):
    conversion_id: str
    source: str = Field(
        "builtin:mixed", min_length=1, max_length=200,
        description="held-out text: builtin:NAME (its held-out split) or the id of a stored calibration set",
    )
    n_windows: int = Field(32, ge=1, le=4096, description="non-overlapping token windows; n_windows × seq_len is at most "
                           "MOELAB_MAX_EVAL_TOKENS (422 beyond)")
    seq_len: int = Field(256, ge=8, le=32768, description="tokens per window; at most the model's max_position_embeddings")
    baselines: StrictBool = Field(True, description="also evaluate AbsTopK-GLU, the uniform allocation and TEAL "
                            "(activation sparsity) at the conversion's FFN cost")
    speed: StrictBool = Field(True, description="time the whole converted model against its dense model in the same "
                              "process, interleaved (decode at batch 1 and 8, prefill of up to 512 tokens; median of 3): "
                              "the summary's speed, in seconds and × dense, with the device, dtype, threads and runtime")
    multiple_choice_per_task: int = Field(
        50, ge=0, le=10000, description="BIG-bench multiple-choice items per task when that set is installed (0: skip): "
        "lm-eval task moelab_bigbench_mc, reported in the summary's tasks"
    )
    tasks: list[TaskName] = Field(
        default_factory=list, max_length=16,
        description="lm-evaluation-harness tasks scored on every model evaluated (accuracy ± stderr): moelab's built-in "
        "ones (GET /api/v1/tasks), lm-eval's registry (their data must be in the server's HF cache), or task_dir's",
    )
    num_fewshot: int | None = Field(None, ge=0, le=64, description="few-shot examples per item; unset: each task's own")
    limit: int | None = Field(None, ge=1, le=100000, description="items per task; unset: all")
    task_dir: str | None = Field(
        None, min_length=1, max_length=4096,
        description="a server directory of lm-eval task YAMLs inside MOELAB_DATA_ROOTS (not uploads: a task YAML may "
        "run Python through !function, so only directories the server's administrator placed are read)",
    )

    @model_validator(mode="after")
    def _known_builtin(self) -> EvaluationCreate:
        if self.source.startswith("builtin:") and self.source[len("builtin:"):] not in BUILTIN_SETS:
            raise ValueError(f"unknown built-in set {self.source!r}; use one of: " + ", ".join(f"builtin:{n}" for n in BUILTIN_SETS))
        return self


class EvaluationOut(_Noted):
    id: str
    conversion_id: str
    params: dict[str, Any]
    status: ResourceStatus
    summary: dict[str, Any] | None = Field(
        None, description="per variant: perplexity, ratio to dense, tokens/s, mean reconstruction error and load CV, multiple-choice "
        "accuracy; speed: the converted model's time per phase against dense's (when timed)"
    )
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class EvaluationList(BaseModel):
    items: list[EvaluationOut]
    total: int
