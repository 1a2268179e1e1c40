"""Calibration sets: built-in, Hugging Face or uploaded text, and its samples."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from moelab.engine.data.builtin import BUILTIN_SETS

from .common import JobOut, ResourceStatus, _In, _Noted


BuiltinName = Literal[tuple(BUILTIN_SETS)]  # type: ignore[valid-type]


class BuiltinSetOut(BaseModel):
    name: str
    description: str
    spec: str
    domains: list[str] = Field(default_factory=list, description="the built-in sources it draws from (mixed: all six); a held-out "
                               "text of none of a conversion's calibration domains is out of domain")


class BuiltinCalibrationCreate(_In):
    source: Literal["builtin"]
    name: BuiltinName = Field(description="built-in set (GET /calibration-sets/builtins)")  # type: ignore[valid-type]
    samples: int = Field(240, ge=1, le=20000, description="number of samples drawn")
    seed: int = Field(0, ge=0)
    split: Literal["calibration", "heldout"] = "calibration"


class HFCalibrationCreate(_In):
    source: Literal["hf"]
    dataset: str = Field(min_length=1, max_length=1000, description="Hugging Face dataset name ('name' or 'org/name'), or the absolute path of a data file / directory "
                         "inside DATA_DIR/uploads or a directory the server lists in MOELAB_DATA_ROOTS (others: 403)")
    split: str = Field("train", min_length=1, max_length=100, pattern=r"^[\w.\-\[\]:%]+$")
    config: str | None = Field(None, max_length=200)
    text_field: str = Field("text", min_length=1, max_length=200)
    task_field: str = Field("task", min_length=1, max_length=200)
    domain_field: str = Field("domain", min_length=1, max_length=200)
    samples: int | None = Field(None, ge=1, le=20000, description="task-balanced subsample; all rows when unset")
    seed: int = Field(0, ge=0)


CalibrationCreate = Annotated[BuiltinCalibrationCreate | HFCalibrationCreate, Field(discriminator="source")]


class CalibrationSetOut(_Noted):
    id: str
    name: str
    origin: Literal["builtin", "upload", "hf"]
    params: dict[str, Any]
    content_id: str | None = Field(None, description="engine content id (same text → same id)")
    status: ResourceStatus
    stats: dict[str, Any] | None = Field(None, description="samples and characters overall, per task and per domain")
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class CalibrationSetList(BaseModel):
    items: list[CalibrationSetOut]
    total: int


class SampleOut(BaseModel):
    index: int
    text: str
    chars: int
    truncated: bool
    task: str | None
    domain: str | None


class SamplePage(BaseModel):
    calibration_set_id: str
    offset: int
    limit: int
    total: int = Field(description="samples matching the filter")
    items: list[SampleOut]
