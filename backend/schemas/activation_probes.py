"""Activation probes: chosen neurons of a profile's dense model on any text."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from .common import JobOut, ResourceStatus, _In, _Noted
from .probes import PROBE_HELDOUT_PICK, PROBE_MAX_TEXT, ProbeCreate


#: tokens and neurons an activation probe reads at most (``moelab.engine.evaluation.activations``)
ACTIVATION_MAX_TOKENS = 512
ACTIVATION_MAX_NEURONS = 64


class ActivationProbeCreate(_In):
    """Chosen neurons of one layer of a ready profile's dense model on one text: their FFN activation
    h = act(x W_gate) ⊙ (x W_up) (CM Eq. 1, the quantity of the profile's top tokens) on every token,
    run as a job on a worker. The text is given (``text``, at most 512 tokens: a longer one fails the
    job with its length) or a held-out sample of a built-in set (``sample_source`` + ``sample``)."""

    profile_id: str
    layer: int = Field(ge=0, description="the layer (0-based)")
    neurons: list[int] = Field(min_length=1, max_length=ACTIVATION_MAX_NEURONS,
                               description=f"neurons of the layer (at most {ACTIVATION_MAX_NEURONS})")
    text: str | None = Field(None, min_length=1, max_length=PROBE_MAX_TEXT, description="the text, at most 512 tokens")
    sample_source: str | None = Field(None, description="builtin:NAME: a held-out sample of that set instead of text")
    sample: int = Field(0, ge=0, lt=PROBE_HELDOUT_PICK, description=f"which of the set's first {PROBE_HELDOUT_PICK} held-out samples")

    @model_validator(mode="after")
    def _one_text(self) -> ActivationProbeCreate:
        ProbeCreate._one_text(self)  # type: ignore[arg-type]  (the same text / sample rule)
        if any(n < 0 for n in self.neurons):
            raise ValueError("neurons: indices start at 0")
        if len(set(self.neurons)) != len(self.neurons):
            raise ValueError("neurons: each neuron once")
        return self


class NeuronReference(BaseModel):
    neuron: int
    top_value: float | None = Field(description="signed h at the neuron's calibration token of largest |h| (null: the profile "
                                              "keeps no top tokens)")
    gate_mean: float | None = Field(description="μ_j: the profile's mean gate activation act(x W_gate) (EW §3.1; not a mean of h)")
    rate: float | None = Field(description="ATopK activation rate over the calibration tokens (CM Eq. 4)")


class ActivationResult(BaseModel):
    """``GET /activation-probes/{id}/result``: ``activations[i][t]`` is neuron ``neurons[i]``'s h on token t."""

    kind: Literal["activation"]
    text: str
    tokens: list[str] = Field(description="each token's own text; they concatenate to the text as the model saw it")
    token_ids: list[int]
    layer: int
    neurons: list[int]
    activations: list[list[float | None]] = Field(description="per neuron, h on every token")
    reference: list[NeuronReference] = Field(description="per neuron, the profile's statistics, to scale the values")
    timings: dict[str, Any]


class ActivationProbeOut(_Noted):
    id: str
    profile_id: str
    params: dict[str, Any]
    status: ResourceStatus
    summary: dict[str, Any] | None = Field(None, description="layer, neurons, token count, each neuron's max |h| on the text")
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class ActivationProbeList(BaseModel):
    items: list[ActivationProbeOut]
    total: int
