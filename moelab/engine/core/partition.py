"""Expert construction shared by the partition methods: the always-on shared part, balanced
clustering of the rest into routed experts, and the record of one built layer (``LayerExperts``).
Which score picks the shared neurons, which features are clustered and which router scores the
experts is each method's choice (``methods.expertweaver``, ``methods.cmoe``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .allocation import LayerPlan


@dataclass
class LayerExperts:
    """The neuron partition and router of one layer, ready for ``core.slicing.moe_from_dense``."""

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


def split_shared(score: np.ndarray, row: LayerPlan) -> tuple[np.ndarray, np.ndarray]:
    """Top-``d_shared`` neurons by ``score`` (stable ties: lower index first) and the rest."""
    order = np.argsort(-score, kind="stable")
    return np.sort(order[: row.d_shared]), np.sort(order[row.d_shared :])


def cluster_routed(features: np.ndarray, pool: np.ndarray, row: LayerPlan, **kw: Any):
    """Balanced clustering of the routed pool; returns (routed [N_re, m] ids, result or None)."""
    if row.n_routed == 0:
        return np.zeros((0, row.d_expert), dtype=np.int64), None
    if row.n_routed == 1:
        return pool[None, :], None
    from .clustering import balanced_kmeans  # torch: loaded when a conversion runs

    res = balanced_kmeans(features, row.n_routed, **kw)
    return pool[res.clusters], res


def finish(row: LayerPlan, shared: np.ndarray, routed: np.ndarray, router: str, weights: dict[str, np.ndarray],
           res: Any, t0: float) -> LayerExperts:
    """The ``LayerExperts`` of a built layer; ``res``: the clustering result (None: no clustering ran)."""
    return LayerExperts(
        layer=row.layer, shared=shared, routed=routed, top_k=row.top_k if len(routed) else 0,
        router=router, router_weights=weights,
        objective=None if res is None else float(res.objective),
        objective_history=[] if res is None else [float(v) for v in res.objective_history],
        n_iter=0 if res is None else int(res.n_iter), converged=True if res is None else bool(res.converged),
        seconds=time.perf_counter() - t0,
    )


def save_layer_experts(e: LayerExperts, path: Path) -> None:
    """One layer's experts as a safetensors file (neuron ids, router weights; the rest in its
    metadata), written atomically: another process may build a layer that this one assembles."""
    import json
    import os

    from safetensors.numpy import save_file

    tensors = {"shared": np.ascontiguousarray(e.shared), "routed": np.ascontiguousarray(e.routed)}
    tensors.update({f"router.{k}": np.ascontiguousarray(v) for k, v in e.router_weights.items()})
    meta = {"layer": e.layer, "top_k": e.top_k, "router": e.router, "objective": e.objective,
            "objective_history": list(e.objective_history), "n_iter": e.n_iter, "converged": e.converged, "seconds": e.seconds}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"layer_experts": json.dumps(meta)})
    os.replace(tmp, path)


def load_layer_experts(path: Path) -> LayerExperts:
    """The ``LayerExperts`` ``save_layer_experts`` wrote, equal array for array."""
    import json

    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        meta = json.loads(f.metadata()["layer_experts"])
        arrays = {k: f.get_tensor(k) for k in f.keys()}
    routers = {k.removeprefix("router."): v for k, v in arrays.items() if k.startswith("router.")}
    return LayerExperts(layer=meta["layer"], shared=arrays["shared"], routed=arrays["routed"], top_k=meta["top_k"],
                        router=meta["router"], router_weights=routers, objective=meta["objective"],
                        objective_history=meta["objective_history"], n_iter=meta["n_iter"], converged=meta["converged"],
                        seconds=meta["seconds"])
