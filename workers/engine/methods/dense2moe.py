"""Dense2MoE layer-fusion upcycling (D2 §2): prune redundant blocks, keep their MLPs as experts.

The path of data, as in the paper:

1. ``choose_fusion`` (D2 §2.3) reads the profile's S_L (decoder-layer outputs, D2 Eq. 4) and
   S_M (MLP inputs, D2 Eq. 5), ranks every pair (l, l+n) by S_L descending and takes the first
   whose MLP inputs are close enough: ``1 − S_M[l, l+n] < δ``.
2. ``fuse_model`` applies D2 Eq. 6: blocks l*+1 … l*+n* are removed (attention and norms
   dropped), and block l*'s MLP becomes a ``MoeFFN`` whose experts are N copies of MLP^(l*)
   followed by M copies of each MLP^(l*+k), k = 1 … n*, every one of them applied to the MLP
   input of block l*; a trainable softmax router (D2 §2.1) picks ``top_k`` experts per token.

Choices where the paper is loose (each one is tested in tests/engine/test_dense2moe.py):

* **Condition.** §2.3 writes ``s(h^l*, h^(l*+n*)) < δ`` but means "approximate MLP inputs"
  (a *similarity* below a threshold would select dissimilar inputs); §2.2 speaks of the
  *distance* d(h^l, h^(l+n)). We use the cosine distance ``1 − S_M[l*, l*+n*] < δ`` (strict),
  on the end pair only as the paper does; the record also lists S_M of every fused layer.
* **Indices.** ``S_L[l, l+n]`` compares the outputs of blocks l and l+n, i.e. the residual
  stream before and after blocks l+1 … l+n: exactly the blocks Eq. 6 removes. Pairs run over
  l + n ≤ L − 1 (the paper's lists): the last block may be fused, never anything beyond it;
  ``n ≤ max_fused``. Ties in S_L go to the smaller n, then the smaller l.
* **Experts.** §2.3's prose says "the MLPs from layer l* to l*+n*" are replicated M times, but
  Eq. 6 sums k = 1 … n*: we follow Eq. 6 (N copies of MLP^(l*), M of each removed block's MLP).
* **Norms.** In a pre-norm block the MLP receives ``RMSNorm_l(h^l)``. The fused experts receive
  block l*'s normalised input, not their own norm's: S_M is measured on these post-norm tensors
  (profiling.py), so the δ condition is exactly "MLP^(l*+k)'s input is approximated by what it
  now receives". Families that normalise the MLP *output* (Gemma2/3, OLMo2:
  ``post_feedforward_layernorm``) are refused: one output norm of block l* would then rescale
  the sum of every expert, which Eq. 6 does not describe.
* **Combine.** Default ``"sum"``: the selected experts are added unweighted, i.e. Eq. 6 with
  α = β = 1, the only weighting that keeps the dense function at initialisation (with ``top_k``
  = all experts it reproduces the dense model minus the removed attentions exactly), and the
  project's training-free convention (EW Eq. 10). On SmolLM2-135M (l*=24, held-out mixed text)
  it gave perplexity 9.29 vs 9.77 for "weighted" (n*=1, k=2) and 21.9 vs 40.5 (n*=3, k=2).
  ``"weighted"`` is D2 §2.1 literally, ``Σ_{i∈K} g_i(h) MLP^(i)(h)`` with ``g = softmax(h W_g)``
  over *all* experts; ``"normalized"`` renormalises over the top-k (Mixtral). Choose one of
  these two to fine-tune (D2 §3): with ``"sum"`` the router only ranks and gets no gradient.
* **Router init.** ``W_g ~ N(0, initializer_range²)`` (the model config's, else 0.02), from a
  generator seeded with ``seed``: what a freshly initialised MoE router gets; it is meant to be
  trained (D2 §3 fine-tunes). Random rows also separate the N identical copies of MLP^(l*).

The dense model is modified in place (its blocks are removed, its config says the new layer
count); the returned ``MoelabForCausalLM`` shares every tensor with it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from ..core.params import ConversionError, MethodParams, param
from ..progress import NO_PROGRESS, Progress
from .base import ConversionInputs, Method, Recovery

Combine = Literal["weighted", "normalized", "sum"]
COMBINES: tuple[str, ...] = ("weighted", "normalized", "sum")

#: How many ranked candidates the record keeps for display.
RECORD_CANDIDATES = 20


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Dense2MoEParams(MethodParams):
    """D2 §2.3 hyper-parameters. ``layer``/``n_fused`` (l*, n*): None → chosen from the profile;
    ``own_copies`` N, ``fused_copies`` M; ``max_fused`` caps n* only when it is chosen."""

    method: ClassVar[str] = "dense2moe"

    delta: float = param(0.1, "threshold on the MLP-input distance 1 - S_M[l, l+n]", paper="D2 §2.3", gt=0, le=2)
    layer: int | None = param(None, "l*, the block the others fuse into; empty: chosen from S_L and S_M", paper="D2 §2.3",
                              ge=0, aliases=("fuse-layer",))
    n_fused: int | None = param(None, "n*, blocks after l* fused into it; empty: chosen", paper="D2 §2.3", ge=1,
                                aliases=("fuse-count",))
    max_fused: int = param(8, "cap on n* when it is chosen", paper="D2 §2.3", ge=1, advanced=True)
    own_copies: int = param(1, "N copies of layer l*'s MLP", paper="D2 Eq. 6", ge=1, le=64)
    fused_copies: int = param(1, "M copies of each fused MLP", paper="D2 Eq. 6", ge=1, le=64)
    top_k: int = param(2, "experts per token (softmax router)", paper="D2 §2.1", ge=1)
    combine: Combine = param("sum", "sum: unweighted (keeps the dense function); weighted: softmax gates (D2 §2.1); "
                                    "normalized: gates renormalised over the top-k", paper="D2 §2.1")
    seed: int = param(0, "router initialisation", ge=0, advanced=True)

    def n_experts(self, n_fused: int) -> int:
        """``N + n*·M`` (D2 Eq. 6)."""
        return self.own_copies + n_fused * self.fused_copies

    def validate(self, n_layers: int) -> None:
        """Raise ConversionError saying what to change, for a dense model of ``n_layers`` blocks."""
        if n_layers < 2:
            raise ConversionError(f"the model has {n_layers} decoder layer(s); layer fusion needs at least 2")
        if not (isinstance(self.delta, (int, float)) and math.isfinite(self.delta) and 0 < self.delta <= 2):
            raise ConversionError(f"delta={self.delta!r}: the cosine-distance threshold δ must be in (0, 2]")
        if self.layer is not None and not 0 <= self.layer <= n_layers - 2:
            raise ConversionError(
                f"layer={self.layer}: l* must be in [0, {n_layers - 2}] (some block after it must exist to fuse)"
            )
        if self.n_fused is not None and self.n_fused < 1:
            raise ConversionError(f"n_fused={self.n_fused}: n* must be at least 1 (or omitted to choose it)")
        if self.layer is not None and self.n_fused is not None and self.layer + self.n_fused >= n_layers:
            raise ConversionError(
                f"layer + n_fused = {self.layer} + {self.n_fused} must be < n_layers = {n_layers}: "
                f"use n_fused ≤ {n_layers - 1 - self.layer}"
            )
        if self.max_fused < 1:
            raise ConversionError(f"max_fused={self.max_fused}: the cap on n* must be at least 1")
        if self.own_copies < 1:
            raise ConversionError(f"own_copies={self.own_copies}: N (copies of layer l*'s MLP) must be at least 1")
        if self.fused_copies < 1:
            raise ConversionError(
                f"fused_copies={self.fused_copies}: M must be at least 1 (M = 0 would be plain layer pruning)"
            )
        if self.top_k < 1:
            raise ConversionError(f"top_k={self.top_k}: at least one expert must run per token")
        # The largest n* possible: top_k must fit the biggest MoE the choice could build.
        n_max = self.n_fused
        if n_max is None:
            n_max = min(self.max_fused, n_layers - 1 - (self.layer or 0))
        if self.top_k > self.n_experts(n_max):
            raise ConversionError(
                f"top_k={self.top_k} exceeds the {self.n_experts(n_max)} experts "
                f"(N + n*·M = {self.own_copies} + {n_max}·{self.fused_copies}): lower top_k or add copies"
            )
        if self.combine not in COMBINES:
            raise ConversionError(f"combine={self.combine!r}: use one of {', '.join(COMBINES)}")
        if self.seed < 0:
            raise ConversionError(f"seed={self.seed}: use a non-negative integer")


# --------------------------------------------------------------------------- choosing l*, n*


@dataclass(frozen=True)
class FusionChoice:
    """The pair (l*, n*) and its similarities; ``candidates``: every (l, n) ranked by S_L
    descending, as dicts ``{layer, n_fused, s_layer, s_mlp, distance, admitted}``."""

    layer: int
    n_fused: int
    s_layer: float | None
    s_mlp: float | None
    delta: float
    rank: int | None = None  # position of the chosen pair in ``candidates`` (None: given by the user)
    candidates: list[dict[str, Any]] = field(default_factory=list)

    @property
    def fused_layers(self) -> list[int]:
        return list(range(self.layer + 1, self.layer + self.n_fused + 1))

    def to_dict(self, max_candidates: int | None = RECORD_CANDIDATES) -> dict[str, Any]:
        d = asdict(self)
        d["candidates"] = self.candidates[:max_candidates] if max_candidates is not None else self.candidates
        d["n_candidates"] = len(self.candidates)
        return d


def _check_similarity(s_layer: np.ndarray, s_mlp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s_layer, s_mlp = np.asarray(s_layer, dtype=np.float64), np.asarray(s_mlp, dtype=np.float64)
    if s_layer.ndim != 2 or s_layer.shape[0] != s_layer.shape[1] or s_layer.shape != s_mlp.shape:
        raise ConversionError(
            f"S_L {s_layer.shape} and S_M {s_mlp.shape} must be square matrices of the same size (layers × layers)"
        )
    if s_layer.shape[0] < 2:
        raise ConversionError("S_L has fewer than 2 layers: nothing can be fused")
    if not (np.isfinite(s_layer).all() and np.isfinite(s_mlp).all()):
        raise ConversionError("S_L or S_M contains NaN/inf: re-run the profile")
    return s_layer, s_mlp


def choose_fusion(
    s_layer: np.ndarray,
    s_mlp: np.ndarray,
    delta: float,
    max_fused: int,
    layer: int | None = None,
    n_fused: int | None = None,
) -> FusionChoice:
    """D2 §2.3: sort the pairs (l, l+n) of S_L by similarity, descending, and take the first
    with MLP-input distance ``1 − S_M[l, l+n] < δ`` (0 ≤ l, 1 ≤ n ≤ max_fused, l + n ≤ L − 1).

    ``layer`` / ``n_fused`` restrict the search to pairs with that l / n; when both are given
    the pair is used as is (no δ test) and only its similarities are reported.
    Raises ConversionError naming the δ that would admit the best-ranked pair.
    """
    s_layer, s_mlp = _check_similarity(s_layer, s_mlp)
    L = s_layer.shape[0]
    if layer is not None and n_fused is not None:
        if not (0 <= layer and n_fused >= 1 and layer + n_fused <= L - 1):
            raise ConversionError(f"layer={layer}, n_fused={n_fused} do not fit a model of {L} layers")
        return FusionChoice(layer, n_fused, float(s_layer[layer, layer + n_fused]),
                            float(s_mlp[layer, layer + n_fused]), float(delta))
    ls, ms = np.triu_indices(L, k=1)  # every pair l < m = l + n
    ns = ms - ls
    keep = ns <= max_fused
    if layer is not None:
        keep &= ls == layer
    if n_fused is not None:
        keep &= ns == n_fused
    ls, ms, ns = ls[keep], ms[keep], ns[keep]
    if ls.size == 0:
        raise ConversionError(
            f"no pair (l, n) with n ≤ max_fused={max_fused}"
            + (f", l={layer}" if layer is not None else "") + (f", n={n_fused}" if n_fused is not None else "")
            + f" exists in a model of {L} layers"
        )
    sl, sm = s_layer[ls, ms], s_mlp[ls, ms]
    dist = 1.0 - sm
    order = np.lexsort((ls, ns, -sl))  # S_L descending; ties: smaller n, then smaller l
    admitted = dist < delta
    candidates = [
        {"layer": int(ls[i]), "n_fused": int(ns[i]), "s_layer": float(sl[i]), "s_mlp": float(sm[i]),
         "distance": float(dist[i]), "admitted": bool(admitted[i])}
        for i in order
    ]
    ok = np.flatnonzero(admitted[order])
    if ok.size == 0:
        best = candidates[0]
        raise ConversionError(
            f"no layer pair satisfies the MLP-input condition 1 − S_M < δ = {delta:g}: the best pair by S_L "
            f"(l={best['layer']}, n={best['n_fused']}, S_L={best['s_layer']:.4f}) has MLP-input distance "
            f"{best['distance']:.4f}, so δ > {best['distance']:.4f} would admit it "
            f"(the smallest distance of any pair is {float(dist.min()):.4f})"
        )
    r = int(ok[0])
    c = candidates[r]
    return FusionChoice(c["layer"], c["n_fused"], c["s_layer"], c["s_mlp"], float(delta), r, candidates)


# --------------------------------------------------------------------------- conversion


def fuse_model(
    adapter: Any,
    params: Dense2MoEParams,
    profile: Any = None,
    progress: Progress = NO_PROGRESS,
) -> tuple[Any, dict[str, Any]]:
    """Dense2MoE (D2 §2.3, Eq. 6) on a loaded dense model; returns ``(moe_model, record)``.

    ``profile`` (a ``StoredProfile`` of this model) supplies S_L / S_M; it may be None only when
    both ``params.layer`` and ``params.n_fused`` are given (the record then has no similarities).
    The adapter's model is modified in place and must not be reused as a dense model.
    """
    from ..core.fusion import check_fusable, fused_ffn, remove_decoder_layers
    from ..core.slicing import check_compatible
    from ..runtime.export import build_moe_model
    from ..runtime.param_count import parameter_counts

    t0 = time.perf_counter()
    L = adapter.n_layers
    params.validate(L)
    progress.update("choose fusion", 0, 1)
    if profile is not None:
        check_compatible(adapter, profile)
        choice = choose_fusion(
            profile.similarity("outputs"), profile.similarity("mlp_inputs"),
            params.delta, params.max_fused, params.layer, params.n_fused,
        )
    elif params.layer is not None and params.n_fused is not None:
        choice = FusionChoice(params.layer, params.n_fused, None, None, params.delta)
    else:
        raise ConversionError("dense2moe needs a profile (S_L, S_M) to choose l* and n*, or both layer and n_fused")
    l, n = choice.layer, choice.n_fused
    E = params.n_experts(n)
    if params.top_k > E:
        raise ConversionError(
            f"top_k={params.top_k} exceeds the {E} experts of the chosen fusion (l*={l}, n*={n}): "
            f"lower top_k or raise own_copies/fused_copies"
        )
    check_fusable(adapter, [l, *choice.fused_layers])
    s_mlp_fused = None
    if profile is not None:
        s_m = profile.similarity("mlp_inputs")
        s_mlp_fused = [float(s_m[l, j]) for j in choice.fused_layers]
    progress.update("choose fusion", 1, 1)
    t1 = time.perf_counter()

    progress.update("fuse layers", 0, 1)
    dense = parameter_counts(adapter.model)
    module = fused_ffn(adapter, l, n, params)
    kept = remove_decoder_layers(adapter.model, choice.fused_layers)
    new_l = kept.index(l)
    moe = build_moe_model(
        adapter, {new_l: module},
        provenance={"method": "dense2moe", "fused_layer": l, "removed_layers": choice.fused_layers},
    )
    counts = parameter_counts(moe)
    progress.update("fuse layers", 1, 1)
    t2 = time.perf_counter()

    layers = []
    for new_i, old_i in enumerate(kept):
        row: dict[str, Any] = {"layer": new_i, "source_layer": old_i, "kind": "fused" if old_i == l else "dense"}
        if old_i == l:
            row.update(
                fused_layers=choice.fused_layers, n_experts=E, top_k=params.top_k,
                expert_source_layers=module.spec["expert_source_layers"], s_mlp_fused=s_mlp_fused,
            )
        layers.append(row)
    summary = {
        "method": "dense2moe",
        "n_layers": len(kept),
        "layers_before": L,
        "layers_after": len(kept),
        "fused_layer": l,
        "n_fused": n,
        "removed_layers": choice.fused_layers,
        "s_layer": choice.s_layer,
        "s_mlp": choice.s_mlp,
        "distance": None if choice.s_mlp is None else 1.0 - choice.s_mlp,
        "chosen": params.layer is None or params.n_fused is None,
        "n_experts": E,
        "top_k": params.top_k,
        "combine": params.combine,
        "total_params": counts["total"],
        "active_params": counts["active"],
        "dense_total_params": dense["total"],
        "dense_active_params": dense["active"],
    }
    record = {
        "params": params.to_dict(),
        "summary": summary,
        "fusion": choice.to_dict(),
        "layers": layers,
        "timings": {"choose_s": t1 - t0, "fuse_s": t2 - t1, "total_s": t2 - t0},
    }
    return moe, record


def validate(params: Dense2MoEParams, profiles: list[Any]) -> None:
    params.validate(profiles[0].manifest["n_layers"])


def build(inputs: ConversionInputs, params: Dense2MoEParams, progress: Progress) -> tuple[Any, Any, dict[str, Any]]:
    adapter = inputs.load_dense()
    moe, record = fuse_model(adapter, params, inputs.profile, progress)
    return moe, adapter.tokenizer, record


def preview(profile: Any, params: Dense2MoEParams) -> dict[str, Any]:
    """What a conversion would fuse (D2 §2.3), from the stored S_L / S_M: numpy only."""
    params.validate(profile.manifest["n_layers"])
    choice = choose_fusion(profile.similarity("outputs"), profile.similarity("mlp_inputs"), params.delta,
                           params.max_fused, params.layer, params.n_fused)
    L = profile.manifest["n_layers"]
    return {
        "params": params.to_dict(), "fusion": choice.to_dict(),
        "summary": {"layers_before": L, "layers_after": L - choice.n_fused, "fused_layer": choice.layer,
                    "removed_layers": choice.fused_layers, "n_experts": params.n_experts(choice.n_fused),
                    "top_k": params.top_k},
    }


METHOD = Method(
    name="dense2moe",
    title="Dense2MoE",
    paper="D2 §2.3",
    summary="layer-fusion upcycling: drop the blocks after l* whose MLP inputs S_M are close, keep their MLPs as experts of l* (Eq. 6)",
    params=Dense2MoEParams,
    needs="profile",
    build=build,
    validate=validate,
    preview=preview,
    recovery=Recovery(paper="D2 §3: the router trains", lora="off"),
)
