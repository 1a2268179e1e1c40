"""Health: the database, the broker, the workers and the free disk space."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class HealthDiskOut(BaseModel):
    free_bytes: int | None = Field(description="free bytes on its file system (None: could not be read)")
    total_bytes: int | None = None
    state: Literal["ok", "low", "unknown"] = Field(
        description="low: under 1 GB or 5 % of the disk free (the smaller), jobs and uploads may fail with 507/storage")


class HealthOut(BaseModel):
    status: Literal["ok", "degraded"]
    version: str
    database: str
    broker: str
    workers: list[str] = Field(description="workers that sent a heartbeat recently")
    jobs: dict[str, int] = Field(description="queued and running job counts")
    disk: dict[str, HealthDiskOut] = Field(
        default_factory=dict, description="free space of the artifacts dir ('artifacts') and of MOELAB_DATA_DIR ('data')")
    disk_state: Literal["ok", "low", "unknown"] = Field("ok", description="the worst state in disk")
    warnings: list[str] = Field(default_factory=list, description="what an operator should look at (low disk space)")
