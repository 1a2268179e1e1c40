"""Experts matched across two conversions of one dense model.

Expert ids are arbitrary labels: expert 3 of a conversion built on code text and expert 3 of one
built on prose share nothing but the number (balanced k-means numbers its clusters as it finds
them). A partition method's expert is, however, a *set of the dense FFN's neurons*
(``partition.safetensors``: ``layer.{i}.shared`` [d_shared] and ``layer.{i}.routed`` [E, m], the
neuron ids ``core.slicing.partition_arrays`` records), so two conversions of the same model can be
compared expert by expert through their neurons:

* the overlap of every pair is the Jaccard index ``|a ∩ b| / |a ∪ b|``, computed for all pairs at
  once from 0/1 membership matrices ``[E, d_ffn]`` (``|a ∩ b|`` is one sparse matrix product);
* the matching is the assignment maximising the total Jaccard (Hungarian method, exact), one
  expert of B per expert of A at most; with unequal counts the surplus stays unmatched, and so
  does a pair the assignment makes without a common neuron (any such pairing would be arbitrary);
* the shared parts are compared the same way (one Jaccard index per layer).

Only numpy, scipy and safetensors: the API computes this from the stored files in its own process
(no torch). Layers without neuron sets (kept dense, AbsTopK or TEAL layers, MIDAS's low-rank
experts, Dense2MoE's whole-MLP copies, hierarchical sub-experts) are skipped with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

# The file names of an exported conversion (``runtime.export``'s constants; that module imports torch).
CONVERSION_FILE = "conversion.json"
PARTITION_FILE = "partition.safetensors"
CONFIG_FILE = "config.json"

#: why a layer of a given runtime kind has no experts made of dense neurons
KIND_REASONS = {
    "dense": "kept dense (no experts)",
    "abstopk": "an AbsTopK layer: neurons are chosen per token, there are no experts",
    "teal": "a TEAL layer: neurons are chosen per token by a threshold, there are no experts",
    "lowrank_moe": "low-rank experts (MIDAS): each expert is a factorisation, not a set of dense neurons",
    "hierarchical": "sub-experts of an MoE model's experts, not sets of one dense FFN's neurons",
}


class DifferentModels(ValueError):
    """The two conversions were made from different dense models: their neuron ids name different neurons."""


@dataclass(frozen=True)
class ConversionExperts:
    """What matching reads of one conversion: its model, each layer's runtime kind, and the neuron
    sets of every layer that has routed experts in its partition."""

    name: str
    method: str
    source: str | None
    n_layers: int | None
    d_ffn: tuple[int, ...] | None
    kinds: dict[int, str]  # layer -> runtime kind (config.json's moe_layers)
    shared: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [d_shared] neuron ids
    routed: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [E, m] neuron ids
    has_partition: bool = False

    def describe(self) -> str:
        shape = f"{self.n_layers} layers, d_ffn {_ffn_text(self.d_ffn)}" if self.n_layers is not None else "shape unknown"
        return f"{self.name} is a conversion of {self.source or 'an unrecorded model'} ({shape})"


def _ffn_text(d_ffn: tuple[int, ...] | None) -> str:
    if not d_ffn:
        return "?"
    return str(d_ffn[0]) if len(set(d_ffn)) == 1 else "/".join(map(str, d_ffn))


def read_conversion_experts(conversion_dir: Path, layers: Iterable[int] | None = None, name: str | None = None
                            ) -> ConversionExperts:
    """Read a conversion's model, layer kinds and neuron partition (``layers``: only these).
    FileNotFoundError when ``conversion_dir`` holds no conversion."""
    from safetensors import safe_open

    path = Path(conversion_dir)
    if not (path / CONVERSION_FILE).is_file():
        raise FileNotFoundError(f"{path}: not a converted model (no {CONVERSION_FILE})")
    record = json.loads((path / CONVERSION_FILE).read_text())
    model = record.get("model") or {}
    config = json.loads((path / CONFIG_FILE).read_text()) if (path / CONFIG_FILE).is_file() else {}
    kinds = {i: (entry or {}).get("kind", "moe") for i, entry in enumerate(config.get("moe_layers") or [])}
    d_ffn = tuple(int(d) for d in model["d_ffn"]) if model.get("d_ffn") else None
    parts: dict[str, dict[int, np.ndarray]] = {"shared": {}, "routed": {}}
    has_partition = (path / PARTITION_FILE).is_file()
    if has_partition:
        wanted = None if layers is None else set(layers)
        with safe_open(str(path / PARTITION_FILE), framework="numpy") as f:
            for key in f.keys():  # layer.{i}.shared / layer.{i}.routed
                _, i, part = key.split(".")
                if wanted is None or int(i) in wanted:
                    parts[part][int(i)] = f.get_tensor(key).astype(np.int64)
    return ConversionExperts(name=name or path.name, method=str((record.get("params") or {}).get("method") or "expertweaver"),
                             source=model.get("source"), n_layers=model.get("n_layers"), d_ffn=d_ffn, kinds=kinds,
                             shared=parts["shared"], routed=parts["routed"], has_partition=has_partition)


def check_same_model(a: ConversionExperts, b: ConversionExperts) -> None:
    """DifferentModels unless ``a`` and ``b`` were made from one dense model (same source, layer
    count and FFN widths): neuron ``j`` of one model is not neuron ``j`` of another."""
    same_shape = a.n_layers is None or b.n_layers is None or (a.n_layers, a.d_ffn) == (b.n_layers, b.d_ffn)
    if same_shape and a.source == b.source:
        return
    what = "different dense models" if same_shape else "models of different shapes"
    raise DifferentModels(f"{a.describe()}; {b.describe()}: these are {what}, so their neuron ids (and experts) cannot be "
                          "matched; choose two conversions of the same model")


def membership(routed: np.ndarray, d_ffn: int) -> Any:
    """The 0/1 matrix ``[E, d_ffn]`` (scipy CSR): row e marks the neurons of expert e."""
    from scipy import sparse

    routed = np.asarray(routed, dtype=np.int64).reshape(len(routed), -1)
    rows = np.repeat(np.arange(routed.shape[0]), routed.shape[1])
    m = sparse.csr_matrix((np.ones(rows.size, dtype=np.float64), (rows, routed.ravel())), shape=(routed.shape[0], d_ffn))
    m.data[:] = 1.0  # a neuron listed twice in one expert is still one member (duplicates were summed)
    return m


def jaccard_matrix(routed_a: np.ndarray, routed_b: np.ndarray, d_ffn: int) -> np.ndarray:
    """``J[i, j] = |A_i ∩ B_j| / |A_i ∪ B_j|`` for every pair of experts, ``[E_a, E_b]`` (0 when both are empty)."""
    ma, mb = membership(routed_a, d_ffn), membership(routed_b, d_ffn)
    inter = np.asarray((ma @ mb.T).todense(), dtype=np.float64)  # |A_i ∩ B_j|: one product, no loop over neurons
    union = np.asarray(ma.sum(axis=1)).reshape(-1, 1) + np.asarray(mb.sum(axis=1)).reshape(1, -1) - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def set_jaccard(a: np.ndarray, b: np.ndarray) -> float | None:
    """Jaccard index of two neuron-id sets; None when both are empty (nothing to compare)."""
    a, b = np.unique(a), np.unique(b)
    union = np.union1d(a, b).size
    return None if union == 0 else float(np.intersect1d(a, b, assume_unique=True).size / union)


@dataclass(frozen=True)
class LayerMatching:
    """The matching of one layer: ``match_a[i]`` is B's expert assigned to A's expert i (None: unmatched),
    ``match_b[j]`` the reverse; ``jaccard`` the full ``[E_a, E_b]`` overlap."""

    layer: int
    jaccard: np.ndarray
    match_a: list[int | None]
    match_b: list[int | None]
    mean_jaccard: float  # the assignment's total over min(E_a, E_b) pairs (zero-overlap pairs count 0)
    shared_jaccard: float | None
    sizes_a: list[int]
    sizes_b: list[int]
    shared_sizes: tuple[int, int]

    def to_dict(self, with_matrix: bool = False) -> dict[str, Any]:
        """JSON-ready: each side's experts with their assigned and best match in the other conversion."""
        j = self.jaccard

        def side(match: list[int | None], overlap: np.ndarray, sizes: list[int]) -> list[dict[str, Any]]:
            # best: the other side's expert sharing most with this one (None without any common neuron);
            # it may differ from the assigned match, which is optimal for the layer as a whole
            padded = np.concatenate([overlap, np.zeros((len(match), 1))], axis=1)
            best, top = padded.argmax(axis=1), padded.max(axis=1)
            return [{"expert": e, "size": sizes[e], "match": m, "jaccard": None if m is None else round(float(overlap[e, m]), 4),
                     "best": int(best[e]) if top[e] > 0 else None, "best_jaccard": round(float(top[e]), 4)}
                    for e, m in enumerate(match)]

        out = {"layer": self.layer, "n_a": len(self.match_a), "n_b": len(self.match_b),
               "a": side(self.match_a, j, self.sizes_a), "b": side(self.match_b, j.T, self.sizes_b),
               "mean_jaccard": round(self.mean_jaccard, 4),
               "shared_jaccard": None if self.shared_jaccard is None else round(self.shared_jaccard, 4),
               "shared_sizes": list(self.shared_sizes)}
        if with_matrix:
            out["jaccard"] = np.round(j, 4).tolist()
        return out


def match_layer(layer: int, routed_a: np.ndarray, routed_b: np.ndarray, shared_a: np.ndarray, shared_b: np.ndarray,
                d_ffn: int) -> LayerMatching:
    """Jaccard of every pair of routed experts and the exact assignment maximising their total."""
    from scipy.optimize import linear_sum_assignment

    j = jaccard_matrix(routed_a, routed_b, d_ffn)
    rows, cols = linear_sum_assignment(j, maximize=True)  # rectangular: min(E_a, E_b) pairs
    match_a: list[int | None] = [None] * j.shape[0]
    match_b: list[int | None] = [None] * j.shape[1]
    for r, c in zip(rows.tolist(), cols.tolist()):
        if j[r, c] > 0:  # a pair without a common neuron is no match, only the assignment's leftover
            match_a[r], match_b[c] = c, r
    pairs = min(j.shape)
    return LayerMatching(
        layer=layer, jaccard=j, match_a=match_a, match_b=match_b,
        mean_jaccard=float(j[rows, cols].sum() / pairs) if pairs else 0.0,
        shared_jaccard=set_jaccard(shared_a, shared_b),
        sizes_a=[int(np.unique(r).size) for r in np.asarray(routed_a).reshape(len(routed_a), -1)],
        sizes_b=[int(np.unique(r).size) for r in np.asarray(routed_b).reshape(len(routed_b), -1)],
        shared_sizes=(int(np.unique(shared_a).size), int(np.unique(shared_b).size)),
    )


def skip_reason(c: ConversionExperts, layer: int) -> str | None:
    """Why ``layer`` of ``c`` has no routed experts made of dense neurons (None: it has)."""
    if layer in c.routed and len(c.routed[layer]):
        return None
    kind = c.kinds.get(layer)
    if kind in KIND_REASONS:
        return f"layer {layer} of {c.name} is {KIND_REASONS[kind]}"
    if not c.has_partition:
        return (f"{c.name} ({c.method}) records no neuron partition: its experts are not sets of the dense FFN's neurons "
                "(only ExpertWeaver and CMoE conversions have one)")
    return f"layer {layer} of {c.name} has no routed experts"


@dataclass(frozen=True)
class Matching:
    """Every layer present in both conversions: matched, or skipped with the reason."""

    a: ConversionExperts
    b: ConversionExperts
    layers: list[LayerMatching]
    skipped: list[tuple[int, str]]

    def to_dict(self, with_matrix: bool = False) -> dict[str, Any]:
        return {"a": self.a.name, "b": self.b.name, "method_a": self.a.method, "method_b": self.b.method,
                "layers": [m.to_dict(with_matrix) for m in self.layers],
                "skipped": [{"layer": i, "reason": r} for i, r in self.skipped]}


def match_conversions(a: ConversionExperts, b: ConversionExperts, layers: Iterable[int] | None = None) -> Matching:
    """Match the routed experts of every layer both conversions have (``layers``: only these).
    DifferentModels when they come from different models."""
    check_same_model(a, b)
    n_layers = a.n_layers or b.n_layers or max([*a.kinds, *b.kinds, *a.routed, *b.routed, -1]) + 1
    wanted = sorted(set(range(n_layers)) if layers is None else set(layers))
    if wanted and not 0 <= wanted[0] <= wanted[-1] < n_layers:
        raise ValueError(f"layer {wanted[-1] if wanted[-1] >= n_layers else wanted[0]} does not exist: the model has "
                         f"{n_layers} layers, use 0 … {n_layers - 1}")
    done, skipped = [], []
    for i in wanted:  # layers only: the neurons are handled by matrix products
        reason = skip_reason(a, i) or skip_reason(b, i)
        if reason:
            skipped.append((i, reason))
            continue
        d_ffn = a.d_ffn[i] if a.d_ffn else int(max(a.routed[i].max(), b.routed[i].max(), -1)) + 1
        done.append(match_layer(i, a.routed[i], b.routed[i], a.shared.get(i, np.zeros(0, np.int64)),
                                b.shared.get(i, np.zeros(0, np.int64)), d_ffn))
    return Matching(a=a, b=b, layers=done, skipped=skipped)


def match_conversion_dirs(dir_a: Path, dir_b: Path, layers: Iterable[int] | None = None,
                          names: tuple[str, str] | None = None) -> Matching:
    """``match_conversions`` of two exported conversion directories (``names``: how messages call them)."""
    layers = None if layers is None else list(layers)
    a = read_conversion_experts(dir_a, layers, names[0] if names else None)
    b = read_conversion_experts(dir_b, layers, names[1] if names else None)
    return match_conversions(a, b, layers)
