"""The settings of a profiling pass (``profiling.profiler``), declared once with ``param``.

Kept apart from the profiler, which needs torch: the API generates the ``POST /profiles`` body from
these declarations (``backend.schemas``) and must not import torch to do so; ``moelab profile``
generates its options from them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from ..core.params import DeclaredParams, param

GroupBy = Literal["auto", "task", "domain", "sample"]


class ProfileError(ValueError):
    """The profile cannot be made as asked; the message says what to change."""


@dataclass
class ProfileSettings(DeclaredParams):
    """Everything that changes a profile's numbers; stored verbatim in its manifest. The CLI options
    of ``moelab profile`` and the fields of ``POST /profiles`` are generated from these declarations."""

    error: ClassVar[type[Exception]] = ProfileError

    max_tokens: int = param(256, "tokens per sample (truncation)", ge=2, le=32768)
    batch_tokens: int = param(2048, "padded tokens per forward batch (≥ max_tokens)", ge=2, le=1_000_000)
    atopk_k: int = param(10, "K_a: neurons marked per token, the ones with the largest |h_i|; CM §4 uses 10",
                         paper="CM Eq. 4", ge=1, le=4096)
    atopk_normalized: bool = param(False, "CMoE's normalised h: unit X rows and unit W_gate / W_up columns",
                                   paper="CM App. A")
    feature_tokens: int = param(16384, "tokens whose ATopK markers are kept for clustering (a seeded uniform sample)",
                                paper="CM App. A", ge=1, le=1_000_000)
    hist_bins: int = param(201, "bins of the histogram of h on [-R, R]", paper="CM App. A, Fig. 1a", ge=2, internal=True)
    group_by: GroupBy = param("auto", "what the CV is computed across (auto: tasks when the set has ≥ 2, else samples)",
                              paper="EW Eq. 3")
    cv_eps: float = param(1e-6, "ε of CV_j = σ_j / (|μ_j| + ε)", paper="EW Eq. 3", gt=0, internal=True)
    second_moment: bool = param(True, "store XᵀX of every layer's MLP input (MIDAS needs it)", paper="MI Eq. 1")
    seed: int = param(0, "seed of the calibration subsample and of the feature-token sample", ge=0)
    top_tokens: int = param(8, "top-activating tokens kept per neuron (largest |h|) for its card; 0: none",
                            paper="CM Eq. 1", ge=0, le=256)

    def _check(self) -> None:
        if self.batch_tokens < self.max_tokens:
            raise ProfileError("batch_tokens must be ≥ max_tokens")

    #: The name the runs and the CLI call: every field against its declaration, then ``_check``.
    validate = DeclaredParams.check
