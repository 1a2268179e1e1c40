"""Artifacts: the files the jobs wrote, per resource."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel


class ArtifactFile(BaseModel):
    path: str
    size: int
    modified: datetime
    url: str


class ArtifactOut(BaseModel):
    kind: str
    id: str
    size: int
    files: list[ArtifactFile]
    archive_url: str


class ArtifactSummary(BaseModel):
    kind: str
    id: str
    url: str


class ArtifactList(BaseModel):
    items: list[ArtifactSummary]
    total: int
