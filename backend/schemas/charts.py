"""Charts: chart-ready JSON of profiles, conversions and evaluations (``backend.charts``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from .common import Num


class CVHistogram(BaseModel):
    profile_id: str
    layers: list[int]
    edges: list[Num] = Field(description="bins + 1 edges shared by all layers")
    counts: list[list[int]] = Field(description="[layer][bin] neuron counts")
    overflow: list[int] = Field(description="per layer: neurons with CV above the last edge")
    not_finite: list[int]
    underflow: list[int] = Field(description="per layer: neurons below the first edge (log scale: CV ≤ 0)")
    n_neurons: list[int]
    bins: int
    scale: Literal["linear", "log"] = Field(description="edge spacing: geometric (log) or equal width (linear)")
    clipped_at: float
    note: str


class CVSummary(BaseModel):
    profile_id: str
    layers: list[int]
    quantiles: list[float]
    values: list[list[Num]] = Field(description="[layer][quantile]")
    mean: list[Num]
    median: list[Num]
    tau: float | None
    specialisation_ratio: list[float | None] | None = Field(None, description="EW Eq. 4 r_ℓ for the given tau")


class ActivationTiles(BaseModel):
    profile_id: str
    layer: int
    row_kind: Literal["groups", "samples"]
    values: list[list[Num]] = Field(description="[row][column] mean signed gate activation (normalised as asked)")
    rows: list[str]
    neuron_order: str
    normalize: str
    n_rows: int
    n_neurons: int
    neurons_per_column: int
    rows_per_row: int
    column_first_neuron: list[int] = Field(description="first neuron (in the chosen order) of each column")
    aggregated: bool = Field(description="True when tiles average several neurons or rows")
    note: str


class NeuronStats(BaseModel):
    profile_id: str
    layer: int
    rate_edges: list[Num] = Field(description="bins + 1 edges of the activation-rate histogram")
    rate_counts: list[int] = Field(description="neurons per rate bin (ATopK activation rate, CM Eq. 4 / Fig. 2)")
    rate_mean: Num
    n_neurons: int
    h_edges: list[Num] = Field(description="edges of the h-value (gate activation) histogram")
    h_counts: list[int] = Field(description="token × neuron h values per bin")
    h_below: int = Field(description="h values below the first edge")
    h_above: int = Field(description="h values above the last edge")
    note: str


class SnippetToken(BaseModel):
    token: int = Field(description="global token index (tokens.parquet row)")
    position: int = Field(description="position in its sample")
    piece: str = Field(description="the text the token decodes to")
    value: Num = Field(description="this neuron's h at the token where the profile knows it (its top-K tokens), else null")
    top: bool = Field(description="the top-activating token this snippet is centred on")


class TopToken(BaseModel):
    rank: int = Field(description="0 = largest |h|")
    token: int
    sample: int
    position: int
    value: float = Field(description="signed h (CM Eq. 1) of the neuron at this token")
    task: str | None
    domain: str | None
    group: str | None = Field(description="the sample's group in the CV (its task, domain or sample number)")
    snippet: list[SnippetToken] = Field(description="the sample's tokens from position − 12 to position + 4")


class NeuronCard(BaseModel):
    profile_id: str
    layer: int
    neuron: int
    d_ffn: int = Field(description="neurons in this layer")
    cv: Num = Field(description="EW Eq. 3 CV of the neuron's signed group means")
    cv_basis: str = Field(description="what the CV is taken across: task, domain or sample")
    mean: Num = Field(description="μ_j, mean over groups of the signed mean gate activation")
    abs_mean: Num
    std: Num
    rate: Num = Field(description="ATopK activation rate over all tokens (CM Eq. 4)")
    groups: list[str]
    group_means: list[Num] = Field(description="per group (task …): the neuron's mean gate activation ā_{j,t} (EW §3.1)")
    top_tokens: int = Field(description="K top tokens the profile keeps per neuron; 0 when it keeps none")
    top: list[TopToken] = Field(description="the neuron's top-activating tokens by |h|, largest first, with snippets")
    note: str


class TaskSimilarity(BaseModel):
    profile_id: str
    layer: int | None = Field(description="None: all layers concatenated")
    labels: list[str]
    matrix: list[list[Num]]
    centered: bool
    metric: str
    note: str


class LayerSimilarity(BaseModel):
    profile_id: str
    layers: list[int]
    S_L: list[list[Num]] = Field(description="D2 Eq. 4: cosine similarity of decoder-layer outputs")
    S_M: list[list[Num]] = Field(description="D2 Eq. 5: cosine similarity of MLP inputs")
    adjacent_S_L: list[Num]
    adjacent_S_M: list[Num]
    delta: float = Field(description="D2 §2.3 δ used: a span l → l+n qualifies when its MLP-input distance 1 − S_M[l, l+n] < δ "
                                     "(the dense2moe parameter, same meaning everywhere)")
    params: dict[str, Any] = Field(description="the dense2moe parameters the fusion was planned with (defaults filled in)")
    fusion: dict[str, Any] | None = Field(None, description="what a dense2moe conversion with these parameters fuses: the engine's "
                                                            "choose_fusion (l*, n*, S_L, S_M, distance, rank, ranked candidates)")
    removed_layers: list[int] | None = Field(None, description="the blocks that fusion prunes, l*+1 … l*+n*")
    fusion_error: str | None = Field(None, description="why a conversion with these parameters would be refused (then no fusion)")


class MethodPreview(BaseModel):
    profile_id: str
    method: str
    params: dict[str, Any]
    layers: list[dict[str, Any]] | None = Field(None, description="partition methods: per-layer plan (EW Eqs. 4–6 / S·A·E): r, alpha, shared/routed experts, top_k, static, clamped, note")
    fusion: dict[str, Any] | None = Field(None, description="dense2moe: the chosen (l*, n*) and the ranked candidates (D2 §2.3)")
    summary: dict[str, Any] = Field(description="active fraction, sparsity, static and clamped layers, mean alpha; or the fusion's layer counts; "
                                    "predicted_speed: per phase (decode_b1, decode_b8, prefill) the plan's predicted speed over dense "
                                    "from this machine's measured kernel times, or a note saying why there is none")


class RoutingHeatmap(BaseModel):
    conversion_id: str
    variant: str
    sets: list[str] = Field(description="held-out set of each evaluation")
    evaluations: list[str]
    layers: list[int]
    n_experts: int
    share: list[list[list[Num]]] = Field(description="[set][layer][expert] share of the layer's routed selections")
    counts: list[list[list[Num]]]
    load_cv: list[list[Num]] = Field(description="[set][layer] MI Eq. 7 load CV")
    note: str


class LayerCurves(BaseModel):
    """One evaluation's per-layer curves (``charts.layer_curves``); None where a layer has no value
    (no routed expert, or the variant left it dense)."""

    evaluation_id: str
    conversion_id: str
    text: str = Field(description="the held-out text it was scored on")
    variant: str
    layers: list[int]
    reconstruction_error: list[Num | None] = Field(description="relative L2 error of each layer's FFN on the dense model's inputs")
    load_cv: list[Num | None] = Field(description="MI Eq. 7 load CV of each layer's routing")
    share: list[list[Num] | None] = Field(description="[layer][expert] share of the layer's routed selections")
