"""Whitened low-rank factorisation of FFN weights (MIDAS, MI §3.2, after SVD-LLM).

For a linear map in ``nn.Linear`` layout, ``y = W x`` with ``W ∈ R^{out×in}``, and calibration
inputs whose second moment is ``M = Σ_t x_t x_tᵀ`` (the profile's ``XᵀX``):

* MI Eq. 1: ``M = S Sᵀ`` by Cholesky, in float64.

Everything runs in torch float64 on the device of the inputs (or ``device``): at d_ffn 14,336 the
SVDs and Cholesky factorisations of a 7B model take hours in numpy on a CPU and seconds on a GPU.
Inputs may be numpy arrays or tensors; results are tensors on that device.
* MI Eq. 2: ``W S = U Σ Vᵀ``, truncated to rank r.

Because ``Σ_t ‖(W − W') x_t‖² = ‖(W − W') S‖_F²``, the truncated SVD of ``W S`` is the best
rank-r map *on the calibration data*: ``W' = U_r Σ_r V_rᵀ S⁻¹``. Plain SVD of ``W`` is optimal only
for isotropic inputs.

Since ``Σ_r V_rᵀ = U_rᵀ W S``, that map is exactly ``W' = U_r U_rᵀ W``: the dense map followed by
the orthogonal projection onto the r output directions that carry most of the calibration
outputs. So ``‖W' x‖ ≤ ‖W x‖`` for *every* input, seen in calibration or not: a whitened factor
cannot amplify anything. The factors are computed from that form (``balanced_factors``), not
as ``V_rᵀ S⁻¹``: no triangular solve whose rounding grows with the condition number of ``S``
(large when ``M`` needed jitter), and the split between the two factors is a free choice that
MI Eq. 2 leaves open. It is balanced per component: ``A = U_r C``, ``B = C⁻¹ U_rᵀ W`` with
``C = diag(‖Wᵀ u_i‖^½)``, so column i of A and row i of B have the same norm, and neither
depends on the number of calibration tokens. (``A = U_r Σ_r``, ``B = V_rᵀ S⁻¹`` puts the whole
scale of ``S`` — √tokens × the input RMS — into A: on SmolLM2-135M with 6144 calibration tokens
‖A‖_F reached 1.3·10⁵ against ‖B‖_F ≈ 0.1–2; the product is the same but the factors are
trained parameters, and such a split is out of fp16 range for larger calibration sets and makes
one learning rate wrong for both.)

``M`` is only positive semi-definite when the calibration set has fewer tokens than input
features or dead features; the smallest jitter ``λ·I`` that makes the Cholesky succeed is added
(``λ = mean(diag M) · 10^k``, k = −12, −11, …) and reported, so it can be shown to the user.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..runtime.moelab_lowrank import LowRankMoeFFN
from .empty_module import empty_module


def as_float64(a: Any, device: Any = None) -> torch.Tensor:
    """``a`` (array or tensor) as a float64 tensor on ``device`` (default: where it is; arrays: CPU)."""
    t = torch.as_tensor(a)
    return t.to(device=device if device is not None else t.device, dtype=torch.float64)


@dataclass(frozen=True)
class Whitening:
    S: torch.Tensor  # [in, in] lower-triangular, S Sᵀ = M + jitter·I
    jitter: float  # λ added to the diagonal (0.0 when M was positive definite)


@dataclass(frozen=True)
class LowRank:
    A: torch.Tensor  # [out, r] = U_r C
    B: torch.Tensor  # [r, in]  = C⁻¹ U_rᵀ W   (A B = U_r Σ_r V_rᵀ S⁻¹ = U_r U_rᵀ W)
    singular_values: torch.Tensor  # all singular values of W S, descending

    @property
    def rank(self) -> int:
        return self.A.shape[1]


def whitening(xtx: Any, max_exponent: int = 0, device: Any = None) -> Whitening:
    """MI Eq. 1 with the smallest diagonal jitter that makes ``M`` positive definite."""
    m = as_float64(xtx, device)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"the second moment must be a square matrix, got shape {tuple(m.shape)}")
    m = (m + m.T) / 2  # exact symmetry; accumulation leaves rounding-level asymmetry
    scale = float(torch.diagonal(m).mean()) or 1.0
    eye = torch.eye(len(m), dtype=m.dtype, device=m.device)
    for exponent in [None, *range(-12, max_exponent + 1)]:
        jitter = 0.0 if exponent is None else scale * 10.0**exponent
        factor, info = torch.linalg.cholesky_ex(m + jitter * eye)
        if int(info) == 0:
            return Whitening(factor, jitter)
    raise ValueError("the second moment is not positive semi-definite even with jitter: is it a real XᵀX?")


def rank_for_ratio(out_features: int, in_features: int, keep: float) -> int:
    """The rank whose two factors hold ``keep`` of the dense parameters: r(out + in) ≈ keep·out·in."""
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"the kept parameter ratio must be in (0, 1], got {keep}")
    return max(1, min(min(out_features, in_features), int(keep * out_features * in_features / (out_features + in_features))))


def whitened_lowrank(weight: Any, white: Whitening, rank: int) -> LowRank:
    """MI Eq. 2: truncated SVD of ``W S``, mapped back through ``S⁻¹`` (= ``U_r U_rᵀ W``, module doc)."""
    w = as_float64(weight, white.S.device)
    if w.shape[1] != white.S.shape[0]:
        raise ValueError(f"weight has {w.shape[1]} inputs but the whitening matrix is {white.S.shape[0]} wide")
    if not 1 <= rank <= min(w.shape):
        raise ValueError(f"rank must be within 1 … {min(w.shape)}, got {rank}")
    u, s, _ = torch.linalg.svd(w @ white.S, full_matrices=False)
    a, b = balanced_factors(w, u[:, :rank])  # U_r Σ_r V_rᵀ S⁻¹ = U_r U_rᵀ W (module doc)
    return LowRank(a, b, s)


def balanced_factors(weight: Any, basis: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` with ``A B = U Uᵀ W`` for an orthonormal ``basis`` U ``[out, r]``, split so that
    column i of A and row i of B have the same norm ``‖Wᵀ u_i‖^½`` (module doc). A component
    with ``Wᵀ u_i = 0`` contributes nothing and gets zero factors."""
    u = as_float64(basis)
    w = as_float64(weight, u.device)
    p = u.T @ w  # [r, in], row i = u_iᵀ W
    c = torch.linalg.vector_norm(p, dim=1).sqrt()
    return u * c, p / torch.where(c > 0, c, torch.ones_like(c))[:, None]


def data_error(weight: Any, approx: Any, xtx: Any) -> float:
    """Relative error on the calibration inputs: ``sqrt(tr(Δ M Δᵀ) / tr(W M Wᵀ))``, Δ = W − W'."""
    return data_errors(weight, [approx], [xtx])[0][0]


def data_errors(weight: Any, approxes: Sequence[Any], moments: Sequence[Any]) -> list[list[float]]:
    """``data_error`` of every approximation on every moment (``[approx][moment]``): each moment's
    ``tr(W M Wᵀ)`` and each approximation's ``Δ`` are computed once, not once per pair."""
    w = as_float64(weight)
    deltas = [w - as_float64(a, w.device) for a in approxes]
    out: list[list[float]] = [[] for _ in deltas]
    for xtx in moments:
        m = as_float64(xtx, w.device)
        # tr(D M Dᵀ) as a sum of an elementwise product: one matmul, not a triple loop
        total = torch.sum((w @ m) * w)
        for row, d in zip(out, deltas):
            row.append(float(torch.sqrt(torch.sum((d @ m) * d) / total)))
    return out


#: the stacked factors of a ``LowRankMoeFFN``, by parameter name
FACTORS = ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b")


@torch.no_grad()
def lowrank_moe_from_factors(factors: dict[str, torch.Tensor], router_weight: torch.Tensor, act: str, top_k: int,
                             **extra: Any) -> LowRankMoeFFN:
    """MIDAS's layer (``runtime.moelab_lowrank.LowRankMoeFFN``) from stacked factors (keys ``FACTORS``,
    shapes as in its docstring) and the gating network's weight ``[E, d_model]``; dtype/device of
    ``gate_a``."""
    missing = [k for k in FACTORS if k not in factors]
    if missing:
        raise ValueError(f"missing factors: {', '.join(missing)}")
    E, r, d = factors["gate_a"].shape
    f = factors["gate_b"].shape[1]
    spec = {"kind": "lowrank_moe", "d_model": int(d), "d_ffn": int(f), "act": str(act), "n_experts": int(E),
            "rank": int(r), "top_k": int(top_k), **extra}
    mod = empty_module(LowRankMoeFFN, spec, factors["gate_a"])
    for name in FACTORS:
        p = getattr(mod, name)
        if tuple(factors[name].shape) != tuple(p.shape):
            raise ValueError(f"{name} must be {tuple(p.shape)}, got {tuple(factors[name].shape)}")
        p.copy_(factors[name])
    if tuple(router_weight.shape) != (E, d):
        raise ValueError(f"router_weight must be [n_experts={E}, d_model={d}], got {tuple(router_weight.shape)}")
    mod.router.weight.copy_(router_weight)
    return mod
