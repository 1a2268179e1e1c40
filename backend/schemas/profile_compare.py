"""Two profiles compared (moelab/engine/profiling/compare.py) and neuron search (profiling/search.py)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from .charts import TopToken
from .common import Num


class SpecificNeuron(BaseModel):
    layer: int
    neuron: int
    specificity: Num = Field(description="d = (μ_A − μ_B) / sqrt((σ_A² + σ_B²)/2 + ε²) over per-sample mean gate activations; "
                                         "> 0: specific to A")
    p: Num = Field(description="Welch's two-sided p-value for equal means over the two sets' samples")
    q: Num = Field(description="Benjamini–Hochberg q over every neuron of the comparison")
    mean_a: Num = Field(description="mean over A's samples of the neuron's per-sample mean gate activation")
    mean_b: Num
    std_a: Num = Field(description="standard deviation (ddof 1) of the per-sample means over A's samples")
    std_b: Num
    rate_a: Num = Field(description="ATopK activation rate over A's tokens (CM Eq. 4)")
    rate_b: Num
    cv_a: Num = Field(description="EW Eq. 3 CV in A (across A's CV basis)")
    cv_b: Num
    top_a: list[TopToken] = Field(description="the neuron's strongest top tokens in A's text, with snippets (empty when A keeps none)")
    top_b: list[TopToken] = Field(description="the same in B's text")


class LayerSpecificity(BaseModel):
    layer: int
    d_ffn: int
    n_specific_a: int = Field(description="neurons with d ≥ threshold and Benjamini–Hochberg q ≤ fdr")
    n_specific_b: int = Field(description="neurons with d ≤ −threshold and q ≤ fdr")
    share: float = Field(description="(n_specific_a + n_specific_b) / d_ffn")
    share_a: float
    share_b: float
    n_large_a: int = Field(description="neurons with d ≥ threshold, before the test")
    n_large_b: int = Field(description="neurons with d ≤ −threshold, before the test")


class CompareScatter(BaseModel):
    layer: int
    neurons: list[int] = Field(description="neuron index of each point")
    mean_a: list[Num]
    mean_b: list[Num]
    specificity: list[Num]
    sampled: bool = Field(description="True when the layer has more neurons than max_points: every specific neuron (largest |d| "
                                      "first) and a seeded sample of the rest")
    note: str


class ProfileComparison(BaseModel):
    a: str = Field(description="profile A's id")
    b: str = Field(description="profile B's id")
    model: str | None = Field(description="the model both are profiles of")
    n_layers: int
    d_ffn: list[int]
    n_samples_a: int
    n_samples_b: int
    threshold: float = Field(description="|d| at and above which a neuron counts as specific (with q ≤ fdr)")
    fdr: float = Field(description="the false-discovery rate: a specific neuron's Welch test survives Benjamini–Hochberg at q ≤ fdr")
    score: str = Field(description="the set-specificity score's definition")
    layer: int = Field(description="the layer of the scatter (the asked one, else the one with the largest share of specific neurons)")
    scatter: CompareScatter
    layers: list[LayerSpecificity]
    top_a: list[SpecificNeuron] = Field(description="the most A-specific neurons over all layers, largest d first")
    top_b: list[SpecificNeuron] = Field(description="the most B-specific neurons over all layers, smallest d first")
    note: str


class NeuronHit(BaseModel):
    layer: int
    neuron: int
    cv: Num
    rate: Num
    mean: Num
    abs_mean: Num
    std: Num
    specificity: Num = Field(None, description="d against the vs profile (> 0: specific to this one); null without vs")
    tokens: list[str] | None = Field(None, description="the neuron's top tokens that contain the searched text; null without token")


class NeuronSearch(BaseModel):
    profile_id: str
    vs: str | None
    total: int = Field(description="neurons passing every filter")
    offset: int
    limit: int
    sort: str
    descending: bool
    items: list[NeuronHit]
    note: str
