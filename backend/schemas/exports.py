"""Exports: GGUF files for llama.cpp / Ollama, and whether a conversion exports at all."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from moelab.engine.runtime.gguf_layout import GGUF_TYPES

from .artifacts import ArtifactFile
from .common import JobOut, ResourceStatus, _In, _Noted


GgufType = Literal[GGUF_TYPES]  # type: ignore[valid-type]


class GgufCheck(BaseModel):
    """Whether a conversion's layout exports to GGUF exactly, read from its stored config.json (no model loaded)."""

    exportable: bool = Field(description="its layout maps exactly onto llama.cpp's deepseek MoE architecture")
    reason: str | None = Field(None, description="why not: what blocks it, and which conversion would export")
    types: list[GgufType] = Field(description="the GGUF types an export can be written in")  # type: ignore[valid-type]


class ExportCreate(_In):
    format: Literal["gguf"] = Field("gguf", description="gguf: one .gguf file that stock llama.cpp and Ollama run")
    type: GgufType = Field("f16", description="weight type of the file: f32 (exact), f16 or q8_0 (8-bit, about a quarter of f32)")  # type: ignore[valid-type]


class ExportOut(_Noted):
    id: str
    conversion_id: str
    format: Literal["gguf"]
    type: str
    status: ResourceStatus = Field(description="'ready' once its job has written the file")
    params: dict[str, Any] = Field(description="format and type, and the estimate the job was checked against "
                                   "(weights, file_bytes, disk_bytes, memory_bytes)")
    summary: dict[str, Any] | None = Field(None, description="file (its name), bytes, architecture (deepseek), layout")
    file: str | None = Field(None, description="the .gguf file's name, once ready")
    bytes: int | None = Field(None, description="its size, once ready")
    download_url: str | None = Field(None, description="GET it to download the .gguf (streamed), once ready")
    archive_url: str | None = Field(None, description="the .gguf with its Ollama Modelfile and model card as a zip, once ready")
    files: list[ArtifactFile] | None = Field(None, description="every file of the export (detail view only, once ready)")
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class ExportList(BaseModel):
    items: list[ExportOut]
    total: int
    gguf: GgufCheck | None = Field(None, description="the conversion's GGUF check (listing one conversion's exports only)")
