"""Recovery fine-tuning: the request (hyper-parameters generated from ``FinetuneParams``), the
stored fine-tune and its training log."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field, model_validator

from moelab.engine.data.builtin import BUILTIN_SETS
from moelab.engine.training.params import FinetuneMode, FinetuneParams

from .common import JobOut, JobState, ResourceStatus, _In, _Noted
from .declared import declared_model


class _FinetuneRequest(_In):
    """Recovery fine-tuning of a ready conversion; the hyper-parameters are generated from
    ``moelab.engine.training.params.FinetuneParams`` (names, defaults, bounds).

    The engine's ``validate`` makes the checks that need several fields or the conversion
    (answered 422 with its message).
    """

    conversion_id: str
    mode: FinetuneMode | None = Field(
        None, description="what is trained and how; default: the conversion's method (expertweaver → expertweaver, cmoe → cmoe, "
        "midas → midas, dense2moe → dense2moe)",
    )
    source: str = Field(
        "builtin:mixed", min_length=1, max_length=200,
        description="training text: builtin:NAME (its calibration split) or the id of a stored calibration set",
    )
    eval_source: str | None = Field(
        None, min_length=1, max_length=200,
        description="held-out text for perplexity before / after / dense: builtin:NAME (its held-out split); default: source "
        "when it is a built-in, else builtin:mixed",
    )

    @model_validator(mode="after")
    def _known_builtin(self) -> _FinetuneRequest:
        for name in ("source", "eval_source"):
            value = getattr(self, name)
            if value is not None and value.startswith("builtin:") and value[len("builtin:"):] not in BUILTIN_SETS:
                raise ValueError(f"{name}: unknown built-in set {value!r}; use one of: " + ", ".join(f"builtin:{n}" for n in BUILTIN_SETS))
        if self.eval_source is not None and not self.eval_source.startswith("builtin:"):
            raise ValueError(f"eval_source {self.eval_source!r}: perplexity needs a held-out split, which only built-in sets have; "
                             "use builtin:NAME")
        return self


FinetuneCreate = declared_model(FinetuneParams, "FinetuneCreate", base=_FinetuneRequest)


class FinetuneOut(_Noted):
    id: str
    conversion_id: str = Field(description="the conversion being fine-tuned")
    params: dict[str, Any] = Field(description="the engine's parameters (mode resolved)")
    status: ResourceStatus
    summary: dict[str, Any] | None = Field(
        None, description="perplexity before / after / dense, steps, tokens, seconds, result_conversion_id"
    )
    result_conversion_id: str | None = Field(None, description="the fine-tuned model as a conversion (evaluate it like any other)")
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class FinetuneList(BaseModel):
    items: list[FinetuneOut]
    total: int


class TrainStep(BaseModel):
    step: int
    loss: float | None = Field(None, description="total loss (1 − w)·L_NTP + w·L_KD + λ·L_LB (EW Eq. 12; w = distill)")
    ntp_loss: float | None = Field(None, description="next-token prediction loss")
    kd_loss: float | None = Field(None, description="distillation loss KL(dense ‖ converted) per token; null when distill is 0")
    aux_loss: float | None = Field(None, description="load-balancing loss L_LB (EW Eq. 12); null when the routers have no probabilities")
    load_cv: float | None = Field(None, description="mean over layers of the step's expert-load CV (MI Eq. 7)")
    lr: float | None = None
    tokens: int | None = Field(None, description="training tokens seen so far")
    elapsed_s: float | None = None


class TrainLog(BaseModel):
    finetune_id: str
    state: JobState | None = Field(None, description="state of the fine-tune's latest job")
    status: str | None = Field(None, description="the trainer's own status in its log; null before it wrote one")
    mode: str | None = None
    total_steps: int = Field(description="steps asked for")
    n_steps: int = Field(description="steps logged so far (across resumed runs)")
    steps: list[TrainStep] = Field(description="logged steps in order; bucket means of consecutive steps when aggregated")
    aggregated: bool = Field(description="True when more than max_points steps were logged and buckets were averaged")
    resumed_at: list[int] = Field(default_factory=list, description="steps a re-run resumed from (its checkpoints)")
    perplexity_before: float | None = Field(None, description="the conversion as it was")
    perplexity_start: float | None = Field(None, description="where training starts (differs when the mode re-parameterises the routers)")
    perplexity_after: float | None = None
    dense_perplexity: float | None = Field(None, description="the dense model on the same held-out windows")
    result_conversion_id: str | None = None
