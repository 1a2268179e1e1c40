"""Allocation and conversions: the request (one parameter block per registered method, generated),
the stored conversion, and its experts' neurons and their matching across two conversions."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, create_model, model_validator

from moelab.engine.methods import REGISTRY, Method
from moelab.engine.sizes import parse_size

from .common import JobOut, ResourceStatus, _In, _Noted
from .declared import declared_model
from .exports import ExportOut, GgufCheck


def method_params_model(method: Method) -> type[BaseModel]:
    """The request body block of one method, generated from its parameter dataclass: the same
    names, types, defaults, bounds and help as the engine, the CLI and ``GET /methods``. Rules that
    relate several fields are the engine's own ``check()`` (a 422 with its message)."""

    def engine_check(self: BaseModel) -> BaseModel:
        method.params(**self.model_dump()).check()  # ConversionError is a ValueError: 422
        return self

    title = "".join(part.capitalize() for part in method.name.split("_"))
    return declared_model(method.params, f"{title}Params", doc=f"{method.title} ({method.paper}): {method.summary}",
                          validators={"engine_check": model_validator(mode="after")(engine_check)})


#: One generated parameters model per registered method.
METHOD_PARAMS: dict[str, type[BaseModel]] = {name: method_params_model(m) for name, m in REGISTRY.items()}
ConversionMethod = Literal[tuple(REGISTRY)]  # type: ignore[valid-type]


class _ConversionBase(_In):
    method: ConversionMethod = Field("expertweaver", description="the conversion method (GET /api/v1/methods lists them)")  # type: ignore[valid-type]
    profile_id: str | None = Field(None, description="the dense model's profile (methods that read a profile)")
    extra_profile_ids: list[str] = Field(
        default_factory=list, max_length=63, description="midas: profiles of the other calibration sets (same model)"
    )
    model_id: str | None = Field(None, description="hierarchical: the registered MoE model")
    calibration: str | None = Field(
        None, max_length=200, description="hierarchical: builtin:NAME or the id of a stored calibration set"
    )
    max_memory: str | None = Field(
        None, max_length=32, examples=["2GiB"],
        description="memory budget: when the dense model's weights (and a fitted recipe's fit) exceed it, an "
        "expertweaver/cmoe conversion runs one decoder layer at a time into the export (same result; a fitted recipe "
        "in two passes); below one layer's weights, or below that and the fit: 422 naming the minimum; unset: the "
        "worker's MOELAB_MAX_MEMORY",
    )

    @model_validator(mode="after")
    def _inputs_of_method(self) -> "_ConversionBase":
        if self.max_memory is not None:
            try:
                parse_size(self.max_memory)
            except ValueError as exc:  # it says how to write a size
                raise ValueError(f"max_memory: {exc}") from None
        m = self.method
        others = [name for name in REGISTRY if name != m and getattr(self, name) is not None]
        if others:
            raise ValueError(f"parameter block(s) {', '.join(others)} given, but method is {m!r}: put the parameters in {m!r}")
        needs = REGISTRY[m].needs
        if needs == "moe_model":
            if not self.model_id or not self.calibration:
                raise ValueError(f"{m} conversion needs model_id (an MoE model) and calibration (e.g. builtin:mixed)")
            if self.profile_id or self.extra_profile_ids:
                raise ValueError(f"{m} conversion profiles the MoE model itself: drop profile_id")
            return self
        if not self.profile_id:
            raise ValueError(f"{m} conversion needs profile_id (profile the dense model first)")
        if needs == "profiles" and not self.extra_profile_ids:
            raise ValueError(f"{m} builds one expert per calibration set: give extra_profile_ids (≥ 1 more profile of the same model)")
        if needs == "profile" and self.extra_profile_ids:
            several = ", ".join(n for n, x in REGISTRY.items() if x.needs == "profiles")
            raise ValueError(f"{m} reads one profile; only {several} take(s) extra_profile_ids")
        return self

    def engine_params(self) -> dict[str, Any]:
        """The engine's parameters dict for this request (``moelab.engine.methods.params_from_dict``)."""
        block = getattr(self, self.method) or METHOD_PARAMS[self.method]()
        return {"method": self.method, **block.model_dump()}


#: ``POST /conversions`` body: the method, its inputs and one parameter block named after the method.
ConversionCreate = create_model(
    "ConversionCreate", __base__=_ConversionBase,
    **{name: (model | None, Field(None, description=f"{REGISTRY[name].title} parameters (used when method is {name!r})"))
       for name, model in METHOD_PARAMS.items()},
)


class ConversionOut(_Noted):
    id: str
    method: str = Field(description="expertweaver, cmoe, dense2moe, midas or hierarchical")
    profile_id: str | None = Field(None, description="the profile it was made from (null for hierarchical)")
    model_id: str | None = Field(None, description="hierarchical: the MoE model it restructures")
    params: dict[str, Any]
    label: str = Field("", description="its method's key parameters in words ('64 experts, α 0.2–0.7, τ 0.6, sparsity 25%'), "
                                       "from the method's declaration")
    status: ResourceStatus
    summary: dict[str, Any] | None = Field(None, description="active fraction, static and clamped layers, timings")
    layers: list[dict[str, Any]] | None = Field(None, description="per-layer plan and clustering (detail view only)")
    gguf: GgufCheck | None = Field(None, description="whether it exports to GGUF and why not (null until it is ready)")
    exports: list[ExportOut] = Field(default_factory=list, description="its exports (POST /conversions/{id}/exports), newest first")
    job_id: str | None
    job: JobOut | None = None
    created_at: datetime


class ConversionList(BaseModel):
    items: list[ConversionOut]
    total: int


class ExpertOut(BaseModel):
    expert: int = Field(description="routed expert id in its layer (as in routing heatmaps and probes)")
    neurons: list[int] = Field(description="the dense FFN's neuron ids this expert holds")
    cv: list[float] | None = Field(None, description="each neuron's CV (EW Eq. 3) in the conversion's profile; null without it")


class ExpertNeurons(BaseModel):
    conversion_id: str
    profile_id: str | None
    layer: int
    shared: list[int] = Field(description="neurons of the shared expert (run for every token)")
    shared_cv: list[float] | None = None
    experts: list[ExpertOut]


class MatchedExpert(BaseModel):
    expert: int = Field(description="routed expert id in its own conversion's layer")
    size: int = Field(description="its number of dense neurons")
    match: int | None = Field(description="the other conversion's expert assigned to it (maximum total Jaccard); "
                                          "null: unmatched (surplus expert, or no common neuron)")
    jaccard: float | None = Field(description="Jaccard index of the expert and its match (their neuron sets)")
    best: int | None = Field(description="the other conversion's expert sharing most neurons with it (may differ from the "
                                         "assigned match); null without any common neuron")
    best_jaccard: float


class LayerMatchingOut(BaseModel):
    layer: int
    n_a: int
    n_b: int
    a: list[MatchedExpert] = Field(description="A's routed experts, each with its match in B")
    b: list[MatchedExpert] = Field(description="B's routed experts, each with its match in A")
    mean_jaccard: float = Field(description="the assignment's total Jaccard over min(n_a, n_b) pairs")
    shared_jaccard: float | None = Field(description="Jaccard index of the two shared experts' neurons (null: neither has one)")
    shared_sizes: list[int] = Field(description="neurons of A's and B's shared expert")
    jaccard: list[list[float]] | None = Field(None, description="[n_a][n_b] Jaccard of every pair; only when one layer is asked")


class SkippedLayer(BaseModel):
    layer: int
    reason: str = Field(description="why this layer has no experts made of dense neurons in A or B")


class ExpertMatching(BaseModel):
    a: str = Field(description="conversion A's id")
    b: str = Field(description="conversion B's id")
    method_a: str
    method_b: str
    layers: list[LayerMatchingOut]
    skipped: list[SkippedLayer]
