"""Expert construction: which neurons form the shared part, how the rest cluster into routed
experts, and the training-free router of each method.

ExpertWeaver (EW §3.3):
  * shared = the ``d_shared`` neurons with the largest |mean activation| (Eq. 7), taken from the
    profile's ``abs_mean`` = |μ_j| (mean over the CV groups of the signed activation profile);
  * routed = balanced k-means of the remaining neurons' activation profiles ``a_i ∈ R^M``
    (Eq. 8, App. G, squared-L2 objective Eq. 13), k-means++ seeding with ``seed``;
  * router = per-expert centroid of the gate columns, ``W_router[:, i] = mean_{j∈C_i} W_gate[:, j]`` (Eq. 9).

CMoE (CM §3.1–3.2):
  * shared = the neurons with the highest ATopK activation rates μ (Eq. 5);
  * routed = balanced clustering of the ATopK features ``c_i`` (each neuron's 0/1 marker over the
    profile's token sample) with L2 distances (Eq. 6), centroids initialised at the highest-rate
    remaining neurons, iterated to convergence (Eqs. 7–10) — not the single iteration of the
    reference code;
  * router = the representative neuron of each cluster (closest to the centroid, Eq. 17):
    ``G(x) = act(x W_gate^R) ⊙ (x W_up^R)`` (Eqs. 18–19).

Either method can use the ``gate_mass`` router instead: each routed expert is scored by the L1
mass of its own gate activations, ``Σ_{j∈C_i} |act(x W_gate[:, j])|``; it costs the gate
projection of every routed neuron but nothing else (the runtime reuses those activations).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .allocation import LayerPlan
from .clustering import atopk_features, balanced_kmeans, representative_neurons

RouterChoice = Literal["paper", "gate_mass"]


@dataclass
class LayerExperts:
    """The neuron partition and router of one layer, ready for ``MoeFFN.from_dense``."""

    layer: int
    shared: np.ndarray  # [d_shared] neuron ids
    routed: np.ndarray  # [N_re, m] neuron ids
    top_k: int
    router: str  # runtime router kind: centroid | representative | gate_mass
    router_weights: dict[str, np.ndarray] = field(default_factory=dict)
    objective: float | None = None  # clustering objective (EW Eq. 13 / CM Eq. 7 cost)
    objective_history: list[float] = field(default_factory=list)
    n_iter: int = 0
    converged: bool = True
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "layer": self.layer, "d_shared": int(len(self.shared)), "n_routed": int(len(self.routed)),
            "expert_size": int(self.routed.shape[1]) if self.routed.size else 0, "top_k": self.top_k,
            "router": self.router, "objective": self.objective, "n_iter": self.n_iter,
            "converged": self.converged, "seconds": round(self.seconds, 4),
        }


def _split_shared(score: np.ndarray, row: LayerPlan) -> tuple[np.ndarray, np.ndarray]:
    """Top-``d_shared`` neurons by ``score`` (stable ties: lower index first) and the rest."""
    order = np.argsort(-score, kind="stable")
    return np.sort(order[: row.d_shared]), np.sort(order[row.d_shared :])


def _cluster(features: np.ndarray, pool: np.ndarray, row: LayerPlan, **kw: Any):
    """Balanced clustering of the routed pool; returns (routed [N_re, m] ids, result or None)."""
    if row.n_routed == 0:
        return np.zeros((0, row.d_expert), dtype=np.int64), None
    if row.n_routed == 1:
        return pool[None, :], None
    res = balanced_kmeans(features, row.n_routed, **kw)
    return pool[res.clusters], res


def expertweaver_layer(
    row: LayerPlan, abs_mean: np.ndarray, sample_means: np.ndarray, gate_w: np.ndarray,
    router: RouterChoice = "paper", seed: int = 0, max_iter: int = 50,
) -> LayerExperts:
    """EW Eqs. 7–9 for one layer. ``sample_means``: ``[M, d_ffn]``; ``gate_w``: ``[d_ffn, d_model]``."""
    t0 = time.perf_counter()
    shared, pool = _split_shared(abs_mean, row)
    routed, res = _cluster(sample_means[:, pool].T, pool, row, seed=seed, max_iter=max_iter)
    weights = {}
    if router == "paper":
        weights["router_weight"] = gate_w[routed].mean(axis=1) if routed.size else np.zeros((0, gate_w.shape[1]))
    return _finish(row, shared, routed, "centroid" if router == "paper" else "gate_mass", weights, res, t0)


def cmoe_layer(
    row: LayerPlan, rate: np.ndarray, atopk_rows: np.ndarray, gate_w: np.ndarray, up_w: np.ndarray,
    router: RouterChoice = "paper", max_iter: int = 50,
) -> LayerExperts:
    """CM Eqs. 4–10 and 17–19 for one layer. ``atopk_rows``: stored marker rows ``[T_s, K_a]``."""
    t0 = time.perf_counter()
    d_ffn = len(rate)
    shared, pool = _split_shared(rate, row)
    features = atopk_features(atopk_rows, d_ffn)[pool]  # [n_pool, T_s] 0/1 markers
    # Initial centroids: the highest-rate neurons of the routed pool (CM §3.1).
    seeds = np.argsort(-rate[pool], kind="stable")[: row.n_routed]
    routed, res = _cluster(features, pool, row, init=features[seeds], metric="euclidean", max_iter=max_iter)
    weights = {}
    if router == "paper" and routed.size:
        if res is not None:
            local = np.searchsorted(pool, routed)  # positions of the routed ids inside the pool
            reps = pool[representative_neurons(features, local, res.centroids)]  # Eq. 17
        else:  # one routed expert: the router cannot change the choice, any member will do
            reps = routed[:, 0]
        weights = {"router_gate": gate_w[reps], "router_up": up_w[reps]}  # Eq. 18
    return _finish(row, shared, routed, "representative" if router == "paper" else "gate_mass", weights, res, t0)


def _finish(row, shared, routed, router, weights, res, t0) -> LayerExperts:
    return LayerExperts(
        layer=row.layer, shared=shared, routed=routed, top_k=row.top_k if len(routed) else 0,
        router=router, router_weights=weights,
        objective=None if res is None else float(res.objective),
        objective_history=[] if res is None else [float(v) for v in res.objective_history],
        n_iter=0 if res is None else int(res.n_iter), converged=True if res is None else bool(res.converged),
        seconds=time.perf_counter() - t0,
    )
