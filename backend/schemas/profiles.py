"""Profiles: the profiler's request (its settings generated from ``ProfileSettings``) and result."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field, model_validator

from moelab.engine.profiling.settings import ProfileSettings
from moelab.engine.sizes import parse_size

from .common import JobOut, ResourceStatus, _In, _Noted
from .declared import declared_model


class _ProfileRequest(_In):
    """``POST /profiles``: the model, the calibration set, how much of it and the memory budget; the
    profiler's settings (``moelab.engine.profiling.settings.ProfileSettings``) are generated."""

    model_id: str
    calibration_set_id: str
    samples: int | None = Field(None, ge=1, le=100000, description="task-balanced subsample of the set; all when unset")
    max_memory: str | None = Field(
        None, max_length=32, examples=["2GiB", "512MB"],
        description="memory budget: a model whose weights exceed it is profiled one decoder layer at a time "
        "(same statistics); below one layer's weights: 422 naming the minimum; unset: the worker's MOELAB_MAX_MEMORY",
    )

    @model_validator(mode="after")
    def _batch_holds_a_sample(self) -> _ProfileRequest:
        if self.batch_tokens < self.max_tokens:  # generated fields (ProfileCreate)
            raise ValueError(
                f"batch_tokens ({self.batch_tokens}) must be ≥ max_tokens ({self.max_tokens}): "
                "a batch has to hold at least one whole sample"
            )
        if self.max_memory is not None:
            parse_size(self.max_memory)  # its ValueError says how to write a size
        return self


ProfileCreate = declared_model(ProfileSettings, "ProfileCreate", base=_ProfileRequest)


class ProfileOut(_Noted):
    id: str
    model_id: str
    calibration_set_id: str
    params: dict[str, Any]
    status: ResourceStatus
    summary: dict[str, Any] | None = Field(None, description="layers, d_ffn, tokens, CV basis, groups, timings")
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class ProfileList(BaseModel):
    items: list[ProfileOut]
    total: int
