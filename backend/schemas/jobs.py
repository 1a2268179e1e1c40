"""Jobs: the list of jobs (one job's model, ``JobOut``, is in ``common``: every resource embeds it)."""

from __future__ import annotations

from pydantic import BaseModel

from .common import JobOut


class JobList(BaseModel):
    items: list[JobOut]
    total: int
