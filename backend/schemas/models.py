"""Models: registering a dense model, its inspection and its layers."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool

from .common import JobOut, ResourceStatus, _In, _Noted


class ModelCreate(_In):
    source: str = Field(
        "default", min_length=1, max_length=1000,
        description="'default' (SmolLM2-135M-Instruct, offline), a Hugging Face id (org/name) or a local "
        "directory / .gguf file on the server",
    )
    name: str | None = Field(None, max_length=200, description="display name; defaults to the source's last part")
    trust_remote_code: StrictBool = Field(False, description="run the model repository's own code (the server must allow it)")


class ModelOut(_Noted):
    id: str
    name: str
    source: str
    kind: Literal["default", "local", "hf"]
    trust_remote_code: bool
    status: ResourceStatus = Field(description="'ready' once the inspection job has described the model")
    info: dict[str, Any] | None = Field(None, description="layer structure (engine ModelAdapter.describe()); memory: weight "
                                        "bytes in total, of the largest layer, and min_max_memory, the least max_memory a profile streams in")
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class ModelList(BaseModel):
    items: list[ModelOut]
    total: int


class LayerOut(BaseModel):
    index: int
    d_ffn: int


class ModelLayers(BaseModel):
    model_id: str
    family: str
    tested_family: bool
    activation: str
    n_layers: int
    d_model: int
    fused_gate_up: bool
    n_parameters: int
    n_ffn_parameters: int
    layers: list[LayerOut]
