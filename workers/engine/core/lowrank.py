"""Whitened low-rank factorisation of FFN weights (MIDAS, MI §3.2, after SVD-LLM).

For a linear map in ``nn.Linear`` layout, ``y = W x`` with ``W ∈ R^{out×in}``, and calibration
inputs whose second moment is ``M = Σ_t x_t x_tᵀ`` (the profile's ``XᵀX``):

* MI Eq. 1: ``M = S Sᵀ`` by Cholesky, in float64.
* MI Eq. 2: ``W S = U Σ Vᵀ``, truncated to rank r.

Because ``Σ_t ‖(W − W') x_t‖² = ‖(W − W') S‖_F²``, the truncated SVD of ``W S`` is the best
rank-r map *on the calibration data*: ``W' = U_r Σ_r V_rᵀ S⁻¹``, stored as two factors
``A = U_r Σ_r`` (out×r) and ``B = V_rᵀ S⁻¹`` (r×in, by a triangular solve, never an explicit
inverse). Plain SVD of ``W`` is optimal only for isotropic inputs.

``M`` is only positive semi-definite when the calibration set has fewer tokens than input
features or dead features; the smallest jitter ``λ·I`` that makes the Cholesky succeed is added
(``λ = mean(diag M) · 10^k``, k = −12, −11, …) and reported, so it can be shown to the user.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.linalg import solve_triangular


@dataclass(frozen=True)
class Whitening:
    S: np.ndarray  # [in, in] lower-triangular, S Sᵀ = M + jitter·I
    jitter: float  # λ added to the diagonal (0.0 when M was positive definite)


@dataclass(frozen=True)
class LowRank:
    A: np.ndarray  # [out, r] = U_r Σ_r
    B: np.ndarray  # [r, in]  = V_rᵀ S⁻¹
    singular_values: np.ndarray  # all singular values of W S, descending

    @property
    def rank(self) -> int:
        return self.A.shape[1]


def whitening(xtx: np.ndarray, max_exponent: int = 0) -> Whitening:
    """MI Eq. 1 with the smallest diagonal jitter that makes ``M`` positive definite."""
    m = np.asarray(xtx, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"the second moment must be a square matrix, got shape {m.shape}")
    m = (m + m.T) / 2  # exact symmetry; accumulation leaves rounding-level asymmetry
    scale = float(np.mean(np.diag(m))) or 1.0
    for exponent in [None, *range(-12, max_exponent + 1)]:
        jitter = 0.0 if exponent is None else scale * 10.0**exponent
        try:
            return Whitening(np.linalg.cholesky(m + jitter * np.eye(len(m))), jitter)
        except np.linalg.LinAlgError:
            continue
    raise ValueError("the second moment is not positive semi-definite even with jitter: is it a real XᵀX?")


def rank_for_ratio(out_features: int, in_features: int, keep: float) -> int:
    """The rank whose two factors hold ``keep`` of the dense parameters: r(out + in) ≈ keep·out·in."""
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"the kept parameter ratio must be in (0, 1], got {keep}")
    return max(1, min(min(out_features, in_features), int(keep * out_features * in_features / (out_features + in_features))))


def whitened_lowrank(weight: np.ndarray, white: Whitening, rank: int) -> LowRank:
    """MI Eq. 2: truncated SVD of ``W S``, mapped back through ``S⁻¹``."""
    w = np.asarray(weight, dtype=np.float64)
    if w.shape[1] != white.S.shape[0]:
        raise ValueError(f"weight has {w.shape[1]} inputs but the whitening matrix is {white.S.shape[0]} wide")
    if not 1 <= rank <= min(w.shape):
        raise ValueError(f"rank must be within 1 … {min(w.shape)}, got {rank}")
    u, s, vt = np.linalg.svd(w @ white.S, full_matrices=False)
    a = u[:, :rank] * s[:rank]
    # B = V_rᵀ S⁻¹  <=>  Sᵀ Bᵀ = V_r, a triangular solve with the upper-triangular Sᵀ
    b = solve_triangular(white.S.T, vt[:rank].T, lower=False).T
    return LowRank(a, b, s)


def data_error(weight: np.ndarray, approx: np.ndarray, xtx: np.ndarray) -> float:
    """Relative error on the calibration inputs: ``sqrt(tr(Δ M Δᵀ) / tr(W M Wᵀ))``, Δ = W − W'."""
    w = np.asarray(weight, dtype=np.float64)
    m = np.asarray(xtx, dtype=np.float64)
    d = w - np.asarray(approx, dtype=np.float64)
    # tr(D M Dᵀ) as a sum of an elementwise product: one BLAS matmul, not einsum's triple loop
    return float(np.sqrt(np.sum((d @ m) * d) / np.sum((w @ m) * w)))
