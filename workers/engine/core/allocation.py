"""Expert allocation: how many shared and routed experts each layer gets, and how many run.

ExpertWeaver (EW §3.2), per layer ℓ:

* Eq. 4  ``r_ℓ = mean_j 1[CV_j > τ]``                        (specialisation ratio)
* Eq. 5  ``α_ℓ = α_max − (α_max − α_min) · r_ℓ``            (shared-neuron ratio)
* Eq. 6  ``d_s = round(α_ℓ · d_ffn)``, ``N_se = round(d_s / d_expert)``, ``N_re = N_e − N_se``

and per token ``k = round((1 − sparsity) · N_e)`` experts run: all ``N_se`` shared ones plus the
top ``k − N_se`` routed ones. ``sparsity`` is the fraction of FFN neurons NOT computed per token.

Two readings of α, both offered (``alpha_basis``):

* ``"total"`` (the paper's Eq. 6): α is a share of all ``d_ffn`` neurons. On small models at
  50% sparsity the paper's defaults can ask for more shared experts than the active budget
  ``k``; the plan then clamps ``N_se`` to ``k`` and marks the layer ``static``: no routed
  expert runs, the layer is a fixed prune. Layers with ``N_se == k`` are static too.
* ``"active"``: α is a share of the *active* budget, ``d_s = round(α · (1 − sparsity) · d_ffn)``,
  so ``N_se ≤ k`` always and every layer keeps some routing unless α = 1.

CMoE (CM §3.1) uses a uniform ``S·A·E`` plan: S shared, A active routed, E experts in total.
A uniform-α ExpertWeaver plan is simply ``alpha_min == alpha_max``.

When ``d_ffn`` is not divisible by ``N_e``: routed experts all have ``d_expert = d_ffn // N_e``
neurons (equal sizes keep clustering exact and dispatch batched) and the ``d_ffn mod N_e``
leftover neurons join the shared expert, so every neuron is kept and always computed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, Sequence

import numpy as np

Method = Literal["expertweaver", "cmoe"]


class AllocationError(ValueError):
    """Parameters that cannot make a plan; the message says which and how to fix them."""


@dataclass(frozen=True)
class AllocationParams:
    method: Method = "expertweaver"
    n_experts: int = 64  # N_e (EW) or E (CMoE): experts per layer, shared ones included
    # ExpertWeaver
    alpha_min: float = 0.2
    alpha_max: float = 0.7
    tau: float = 0.6
    sparsity: float = 0.25
    alpha_basis: Literal["total", "active"] = "total"
    # CMoE S·A·E
    shared: int = 1
    active: int = 1

    def validate(self, d_ffn: int) -> None:
        e = self.n_experts
        if e < 1:
            raise AllocationError(f"experts must be ≥ 1 (got {e})")
        if e > d_ffn:
            raise AllocationError(f"{e} experts do not fit d_ffn={d_ffn}: use at most {d_ffn} (one neuron each)")
        if self.method == "expertweaver":
            if not 0.0 <= self.alpha_min <= 1.0 or not 0.0 <= self.alpha_max <= 1.0:
                raise AllocationError("alpha_min and alpha_max are neuron shares: keep them within [0, 1]")
            if self.alpha_min > self.alpha_max:
                raise AllocationError(
                    f"alpha_min ({self.alpha_min}) must not exceed alpha_max ({self.alpha_max})"
                )
            if not self.tau > 0:
                raise AllocationError(f"tau is a CV threshold and must be > 0 (got {self.tau})")
            if not 0.0 < self.sparsity < 1.0:
                raise AllocationError(
                    f"sparsity is the fraction of FFN neurons skipped per token: use a value in (0, 1), got {self.sparsity}"
                )
            if self.alpha_basis not in ("total", "active"):
                raise AllocationError("alpha_basis must be 'total' or 'active'")
            if round((1 - self.sparsity) * e) < 1:
                raise AllocationError(f"sparsity {self.sparsity} with {e} experts leaves no expert active")
        elif self.method == "cmoe":
            if self.shared < 0 or self.active < 0:
                raise AllocationError("shared and active expert counts must be ≥ 0")
            if self.shared + self.active > e:
                raise AllocationError(
                    f"S·A·E = {self.shared}·{self.active}·{e}: shared + active ({self.shared + self.active}) "
                    f"exceeds the {e} experts; lower S or A or raise E"
                )
            if self.shared + self.active == 0:
                raise AllocationError("S·A·E with S = A = 0 computes nothing: activate at least one expert")
            if self.active > 0 and self.shared == e:
                raise AllocationError("every expert is shared, none is left to route: lower S")
        else:
            raise AllocationError(f"unknown method {self.method!r}: use expertweaver or cmoe")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LayerPlan:
    layer: int
    d_ffn: int
    r: float  # EW Eq. 4 (NaN for CMoE)
    alpha: float  # EW Eq. 5 (shared share of d_ffn actually allocated, for CMoE)
    d_expert: int  # neurons per routed expert (m)
    n_shared: int  # N_se: shared experts (the leftover neurons ride along in the shared part)
    d_shared: int  # neurons in the always-on shared part = n_shared · m + leftover
    n_routed: int  # N_re
    top_k: int  # routed experts activated per token
    active_neurons: int
    active_fraction: float
    static: bool  # no routed expert runs: the layer is a fixed prune
    clamped: bool  # Eq. 6 asked for more shared experts than the active budget allowed
    note: str = ""


def specialisation_ratio(cv_by_layer: Sequence[np.ndarray], tau: float) -> np.ndarray:
    """EW Eq. 4, one value per layer."""
    return np.array([float(np.mean(np.asarray(cv) > tau)) for cv in cv_by_layer])


def plan(cv_by_layer: Sequence[np.ndarray], params: AllocationParams) -> list[LayerPlan]:
    """Per-layer plan from the stored CV statistics (numpy only: cheap enough for every slider move)."""
    d_ffns = [len(cv) for cv in cv_by_layer]
    for d in set(d_ffns):
        params.validate(d)
    if params.method == "cmoe":
        return [_plan_cmoe(i, d, params) for i, d in enumerate(d_ffns)]
    r = specialisation_ratio(cv_by_layer, params.tau)
    alpha = params.alpha_max - (params.alpha_max - params.alpha_min) * r  # EW Eq. 5
    return [_plan_expertweaver(i, d, float(r[i]), float(alpha[i]), params) for i, d in enumerate(d_ffns)]


def _plan_expertweaver(layer: int, d_ffn: int, r: float, alpha: float, p: AllocationParams) -> LayerPlan:
    e = p.n_experts
    m = d_ffn // e
    leftover = d_ffn - m * e
    k = int(round((1 - p.sparsity) * e))  # experts per token, shared included
    base = d_ffn if p.alpha_basis == "total" else (1 - p.sparsity) * d_ffn
    d_s = int(round(alpha * base))  # EW Eq. 6
    n_shared = int(round(d_s / m))
    clamped = n_shared > k
    n_shared = min(n_shared, k)
    top_k = k - n_shared
    note = ""
    if clamped:
        note = (
            f"Eq. 6 asks for {int(round(d_s / m))} shared experts but only {k} can be active: clamped to {k}, "
            "no routed expert runs (static prune); lower alpha_max, raise tau or use alpha_basis='active'"
        )
    elif top_k == 0:
        note = "all active experts are shared: no routed expert runs (static prune)"
    return _layer(layer, d_ffn, r, m, n_shared, leftover, e - n_shared, top_k, clamped, note)


def _plan_cmoe(layer: int, d_ffn: int, p: AllocationParams) -> LayerPlan:
    m = d_ffn // p.n_experts
    leftover = d_ffn - m * p.n_experts
    return _layer(layer, d_ffn, float("nan"), m, p.shared, leftover, p.n_experts - p.shared, p.active, False, "")


def _layer(layer, d_ffn, r, m, n_shared, leftover, n_routed, top_k, clamped, note) -> LayerPlan:
    d_shared = n_shared * m + leftover
    active = d_shared + top_k * m
    return LayerPlan(
        layer=layer, d_ffn=d_ffn, r=r, alpha=d_shared / d_ffn, d_expert=m, n_shared=n_shared,
        d_shared=d_shared, n_routed=n_routed, top_k=top_k, active_neurons=active,
        active_fraction=active / d_ffn, static=top_k == 0 or n_routed == 0, clamped=clamped, note=note,
    )


def summarize(rows: list[LayerPlan]) -> dict[str, Any]:
    """Whole-model numbers the UI and the CLI print next to the per-layer plan."""
    d = np.array([r.d_ffn for r in rows])
    active = np.array([r.active_neurons for r in rows])
    return {
        "layers": len(rows),
        "active_fraction": float(active.sum() / d.sum()),
        "sparsity": float(1 - active.sum() / d.sum()),
        "static_layers": [r.layer for r in rows if r.static],
        "clamped_layers": [r.layer for r in rows if r.clamped],
        "mean_alpha": float(np.mean([r.alpha for r in rows])),
    }


def preview(profile: Any, params: AllocationParams) -> dict[str, Any]:
    """The whole per-layer plan for a stored profile (``profile_store.StoredProfile``)."""
    rows = plan(profile.cv_by_layer(), params)
    return {"params": params.to_dict(), "layers": [asdict(r) for r in rows], "summary": summarize(rows)}
