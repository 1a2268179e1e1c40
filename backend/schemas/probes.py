"""Probes: token routing and generation on one text (the playground)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from moelab.engine.data.builtin import BUILTIN_SETS

from .common import JobOut, ResourceStatus, _In, _Noted


#: held-out samples a probe can pick per built-in set (``moelab.engine.runs.HELDOUT_PICK``)
PROBE_HELDOUT_PICK = 48
PROBE_MAX_TEXT = 20_000  # characters; routing reads at most 512 tokens of it


class ProbeCreate(_In):
    """A short look at a ready conversion on one text, run as a job on a worker (the API runs no model).

    ``kind: routing``: the expert every token is routed to, per layer. ``kind: generate``: ``text``
    as a prompt, greedily continued by the dense and the converted model, each timed. The text is
    either given (``text``) or a held-out sample of a built-in set (``sample_source`` + ``sample``).
    """

    conversion_id: str
    kind: Literal["routing", "generate"] = "routing"
    text: str | None = Field(None, min_length=1, max_length=PROBE_MAX_TEXT, description="the text (routing) or prompt (generate)")
    sample_source: str | None = Field(None, description="builtin:NAME: probe a held-out sample of that set instead of text")
    sample: int = Field(0, ge=0, lt=PROBE_HELDOUT_PICK, description=f"which of the set's first {PROBE_HELDOUT_PICK} held-out samples")
    max_new_tokens: int = Field(32, ge=1, le=256, description="tokens each model generates (generate only)")

    @model_validator(mode="after")
    def _one_text(self) -> ProbeCreate:
        if (self.text is None) == (self.sample_source is None):
            raise ValueError("give exactly one of text or sample_source (builtin:NAME, with sample)")
        if self.sample_source is not None:
            name = self.sample_source.removeprefix("builtin:")
            if not self.sample_source.startswith("builtin:") or name not in BUILTIN_SETS or name == "bigbench":
                raise ValueError(f"sample_source {self.sample_source!r}: use one of "
                                 + ", ".join(f"builtin:{n}" for n in BUILTIN_SETS if n != "bigbench"))
        if self.text is not None and not self.text.strip():
            raise ValueError("text is blank: give at least one word")
        return self


class ProbeOut(_Noted):
    id: str
    conversion_id: str
    params: dict[str, Any]
    status: ResourceStatus
    summary: dict[str, Any] | None = Field(
        None, description="routing: tokens and per layer the experts of every token; generate: dense and converted text, "
        "tokens/s and the speed-up (the whole result is also the artifact probes/<id>/probe.json)",
    )
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class ProbeList(BaseModel):
    items: list[ProbeOut]
    total: int
