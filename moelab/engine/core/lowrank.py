"""Whitened low-rank factorisation of FFN weights (MIDAS, MI §3.2, after SVD-LLM).

For a linear map in ``nn.Linear`` layout, ``y = W x`` with ``W ∈ R^{out×in}``, and calibration
inputs whose second moment is ``M = Σ_t x_t x_tᵀ`` (the profile's ``XᵀX``):

* MI Eq. 1: ``M = S Sᵀ`` by Cholesky, in float64.
* MI Eq. 2: ``W S = U Σ Vᵀ``, truncated to rank r.

Everything runs in torch float64 on the device of the inputs (or ``device``): at d_ffn 14,336 the
SVDs and Cholesky factorisations of a 7B model take hours in numpy on a CPU and seconds on a GPU.
Inputs may be numpy arrays or tensors; results are tensors on that device.

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

Only ``U_r`` and the singular values are needed, never ``V``, so they come from the symmetric
eigendecomposition of the smaller Gram matrix of ``A = W S`` (``top_left_singular``): ``A Aᵀ`` when
``A`` is wide (its eigenvectors are ``U``), ``Aᵀ A`` when it is tall (its eigenvectors are ``V``;
``U_r`` is the orthonormalised ``A V_r``). ``torch.linalg.svd`` computes all of ``U``, ``Σ`` and
``V``; on the default model's gate projection (``A`` is 1536 × 576, rank 288; a Zen 2 core) the Gram
route took 49 ms against the SVD's 142 ms, with projectors ``U_r U_rᵀ`` equal to 8·10⁻¹⁶ at
condition number 4.6·10³. With ``projection_errors`` too, ``moelab convert --method midas`` of the
default model (keep_ratio 0.5, code and prose profiles of 48 × 128 tokens) went from 75 s to 44–48 s
on a 2-core Zen 4, its recorded errors equal to 2·10⁻¹³ (relative) and its held-out perplexity to
10⁻⁴. The price is accuracy at the small end: the Gram squares the condition number, so the error
of the rank-r subspace grows by ``σ_1 / 2σ_r`` over the SVD's. Below ``σ_r / σ_1 = GRAM_MIN_RATIO``
(10⁻⁵, so at most 5·10⁴ × the SVD's ~10⁻¹⁶ relative error) the SVD is used instead.

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
    basis: torch.Tensor  # [out, r] U_r, orthonormal
    whitened: torch.Tensor  # [out, in] W S, the matrix factorised (``projection_errors`` reads it)

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
    return truncated_lowrank(w, w @ white.S, rank)


def truncated_lowrank(weight: torch.Tensor, whitened: torch.Tensor, rank: int) -> LowRank:
    """The factors of ``U_r U_rᵀ W`` for the top-``rank`` left singular vectors of ``whitened``: ``W S``
    (MI Eq. 2, ``whitened_lowrank``), or ``W`` itself for a plain truncated SVD."""
    u, s = top_left_singular(whitened, rank)
    a, b = balanced_factors(weight, u)  # U_r Σ_r V_rᵀ S⁻¹ = U_r U_rᵀ W (module doc)
    return LowRank(a, b, s, u, whitened)


#: Below this ``σ_r / σ_1`` the Gram matrix's squared condition number costs the rank-r subspace more
#: accuracy than float64 can spare, and ``top_left_singular`` falls back to the SVD (module doc).
GRAM_MIN_RATIO = 1e-5


def top_left_singular(a: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U_r, σ)``: the top-``rank`` left singular vectors of ``a`` (orthonormal columns) and all its
    ``min(a.shape)`` singular values, descending, from the eigendecomposition of the smaller of
    ``a aᵀ`` and ``aᵀ a``; by the SVD when ``σ_r < GRAM_MIN_RATIO · σ_1`` (module doc)."""
    rows, cols = a.shape
    wide = rows <= cols
    eigenvalues, vectors = torch.linalg.eigh(a @ a.T if wide else a.T @ a)  # ascending
    s = eigenvalues.flip(0).clamp_min(0).sqrt()
    if not s[rank - 1] >= GRAM_MIN_RATIO * s[0] or not bool(torch.isfinite(s[0])):
        u, s, _ = torch.linalg.svd(a, full_matrices=False)
        return u[:, :rank], s
    top = vectors[:, -rank:].flip(1)
    if wide:
        return top, s
    # U_r = A V_r Σ_r⁻¹ in exact arithmetic; a QR makes its columns orthonormal to rounding (the
    # factors must be an exact projection, module doc). A column's sign is free: balanced_factors
    # gives the same A B for u_i and −u_i.
    return torch.linalg.qr(a @ top).Q, s


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
    w = as_float64(weight)
    m = as_float64(xtx, w.device)
    d = w - as_float64(approx, w.device)
    # tr(D M Dᵀ) as a sum of an elementwise product: one matmul, not a triple loop
    return float(torch.sqrt(torch.sum((d @ m) * d) / torch.sum((w @ m) * w)))


def projection_errors(factors: Sequence[LowRank]) -> list[list[float]]:
    """``[j][k]``: ``data_error`` of expert j's map ``U_j U_jᵀ W`` on set k's inputs, from set k's
    ``A_k = W S_k`` (``LowRank.whitened``): ``Σ_t ‖(W − U_j U_jᵀ W) x_t‖² = ‖(I − U_j U_jᵀ) A_k‖_F² =
    ‖A_k‖_F² − ‖U_jᵀ A_k‖_F²`` since ``U_j`` is orthonormal. One ``r × out × in`` product a pair, where
    forming ``tr(Δ M Δᵀ)`` takes ``out × in × in`` a pair and a moment (a fifth of the multiply-adds on
    the default model). The moment is ``S_k S_kᵀ = M_k + λ_k I``, the one the factors were fitted to
    (λ_k, the whitening's jitter, is 0 where ``M_k`` is positive definite). The difference loses about
    10⁻¹⁶ of ``‖A_k‖²``, so an error below ~10⁻⁷ is rounding (floored at 0)."""
    norms = [float(f.whitened.pow(2).sum()) for f in factors]
    return [[max(0.0, 1.0 - float((e.basis.T @ f.whitened).pow(2).sum()) / n) ** 0.5 for f, n in zip(factors, norms)]
            for e in factors]


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
