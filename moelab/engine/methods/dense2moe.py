"""Dense2MoE layer-fusion upcycling (D2 §2): prune redundant blocks, keep their MLPs as experts.

The path of data, as in the paper:

1. ``choose_fusion`` (D2 §2.3) reads the profile's S_L (decoder-layer outputs, D2 Eq. 4) and
   S_M (MLP inputs, D2 Eq. 5), ranks the pairs (l, l+n) by S_L descending and takes the first
   whose MLP inputs are close enough: ``1 − S_M[l, l+n] < δ``.
2. ``fuse_model`` applies D2 Eq. 6: blocks l*+1 … l*+n* are removed (attention and norms
   dropped), and block l*'s MLP becomes a ``MoeFFN`` whose experts are N copies of MLP^(l*)
   followed by M copies of each MLP^(l*+k), k = 1 … n*, every one of them applied to the MLP
   input of block l*; a trainable softmax router (D2 §2.1) picks ``top_k`` experts per token.

Defaults: the paper's configuration (D2 §4.2, Qwen2.5-0.5B): "a total of N=6 experts and pruning
the top-5 redundant layers" under "the top-1 gating setting", i.e. ``n_fused`` = n* = 5,
N = M = 1 (1 + 5·1 = 6 experts, Eq. 6), ``top_k`` = 1. What the paper does not give is δ; ours
is 0.3, chosen so that the default model admits the paper's n* (see **δ and n*** below).

Choices where the paper is loose (each one is tested in tests/engine/test_dense2moe.py):

* **Condition.** §2.3 writes ``s(h^l*, h^(l*+n*)) < δ`` but means "approximate MLP inputs"
  (a *similarity* below a threshold would select dissimilar inputs); §2.2 speaks of the
  *distance* d(h^l, h^(l+n)). We use the cosine distance ``1 − S_M[l*, l*+n*] < δ`` (strict),
  on the end pair only as the paper does; the record also lists S_M of every fused layer.
  This is the one meaning of δ everywhere: the parameter, the API (generated from it), the
  preview and the layer-similarity page (which asks the engine's ``choose_fusion``).
* **δ and n*.** §2.3 searches l* and n* together, but S_L falls as the span grows (on SmolLM2-
  135M, 48 × 128 tokens of builtin:mixed: best S_L 0.97 for n = 1, 0.90 for n = 5), so the
  ranking always puts a one-block pair first: with δ = 0.1 it fused one block into two experts.
  §4 treats the number of pruned layers as the setting ("we pruned the top-k redundant layers,
  k = 1, 3, 5, …"; n* = 5 chosen in §4.2): ``n_fused`` fixes n* and the §2.3 search picks l*
  among the n*-block spans, S_L descending, δ screening their MLP inputs. δ must therefore
  exceed the MLP-input distance across n* blocks, which grows with n*: on that profile the
  5-block spans have distances 0.244 … 0.58 (no span of ≥ 2 blocks is below 0.1), so δ = 0.3
  admits the best-S_L 5-block span (l* = 13, distance 0.273). ``n_fused = 0`` restores the
  joint §2.3 search over n ≤ ``max_fused`` (where δ alone decides n*).
* **Sparsity.** The fused layer has 1 + n* distinct MLPs. ``top_k`` ≥ 1 + n* would run every one
  of them on every token: no routing, no sparsity (Eq. 6's full sum; only the removed
  attentions are saved). Such a conversion is refused with a ConversionError saying what to
  change (lower ``top_k``, fuse more blocks); so are ``n_fused`` larger than the model allows
  and a chosen n* that leaves no routing.
* **Indices.** ``S_L[l, l+n]`` compares the outputs of blocks l and l+n, i.e. the residual
  stream before and after blocks l+1 … l+n: exactly the blocks Eq. 6 removes. Pairs run over
  l + n ≤ L − 1 (the paper's lists): the last block may be fused, never anything beyond it.
  Ties in S_L go to the smaller n, then the smaller l.
* **Experts.** §2.3's prose says "the MLPs from layer l* to l*+n*" are replicated M times, but
  Eq. 6 sums k = 1 … n*: we follow Eq. 6 (N copies of MLP^(l*), M of each removed block's MLP).
* **Copies.** With N > 1 or M > 1 the copies are identical tensors (D2 trains them apart; this
  project's recovery trains the router only). Two copies of one MLP selected for one token
  would add that MLP twice, so the layer's spec carries ``expert_groups`` (each expert's source
  block) and the runtime selects at most one expert per group per token: the best-scoring copy
  (router rows are distinct random draws), then the top_k best groups. With top_k = 1 this is
  the plain top-1. Copies thus act as extra router rows for the same MLP (piecewise regions).
* **Norms.** In a pre-norm block the MLP receives ``RMSNorm_l(h^l)``. The fused experts receive
  block l*'s normalised input, not their own norm's: S_M is measured on these post-norm tensors
  (profiling.py), so the δ condition is exactly "MLP^(l*+k)'s input is approximated by what it
  now receives". Families that normalise the MLP *output* (Gemma2/3, OLMo2:
  ``post_feedforward_layernorm``) are refused: one output norm of block l* would then rescale
  the sum of every expert, which Eq. 6 does not describe.
* **Combine.** Default ``"sum"``: the selected experts are added unweighted, i.e. Eq. 6 with
  α = β = 1, the only weighting that keeps the dense function at initialisation (with every
  expert it reproduces the dense model minus the removed attentions exactly), and the
  project's training-free convention (EW Eq. 10). ``"weighted"`` is D2 §2.1 literally,
  ``Σ_{i∈K} g_i(h) MLP^(i)(h)`` with ``g = softmax(h W_g)`` over *all* experts; ``"normalized"``
  renormalises over the top-k (Mixtral; identically 1 at top-1).
* **Router init.** ``W_g ~ N(0, initializer_range²)`` (the model config's, else 0.02), from a
  generator seeded with ``seed``: what a freshly initialised MoE router gets; it is meant to be
  trained (D2 §3 fine-tunes).
* **Fine-tuning** (``prepare_recovery``, mode ``dense2moe`` of training.finetune). Under ``sum``
  the router only ranks: no gradient reaches it from the LM loss. Before training, every ``sum``
  layer (and ``normalized`` at top-1, whose weight is identically 1) switches to the ``scaled``
  combine of CM §3.3, ``g_i = 1 + softmax(h W_g)_i · u_i`` with the gate scale u = 0: the
  selections and outputs are exactly those of the training-free model (logits equal), u gets
  a gradient from the first step and W_g through u from the second (and from EW Eq. 12 when
  λ > 0). W_g and u train at ``router_lr``; the CM balancing bias b stays 0 (D2 has none).
  A run where no trainable parameter receives a gradient is refused before it starts.

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
from .labels import num

Combine = Literal["weighted", "normalized", "sum"]
COMBINES: tuple[str, ...] = ("weighted", "normalized", "sum")

#: How many ranked candidates the record keeps for display.
RECORD_CANDIDATES = 20


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Dense2MoEParams(MethodParams):
    """D2 §2.3 / §4.2 hyper-parameters. ``layer`` (l*): None → chosen from the profile;
    ``n_fused`` (n*): 0 → chosen together with l* (§2.3), at most ``max_fused``;
    ``own_copies`` N, ``fused_copies`` M. Defaults: the paper's 6 experts, top-1, 5 pruned layers."""

    method: ClassVar[str] = "dense2moe"

    delta: float = param(0.3, "δ: a span l → l+n* qualifies when its MLP-input distance 1 − S_M[l, l+n*] < δ "
                              "(cosine distance, 0 … 2; the paper gives no value, 0.3 admits 5-block spans of the default model)",
                         paper="D2 §2.3", gt=0, le=2)
    layer: int | None = param(None, "l*, the block the others fuse into; empty: the best span by S_L that passes δ",
                              paper="D2 §2.3", ge=0, aliases=("fuse-layer",))
    n_fused: int = param(5, "n*, blocks after l* pruned into it (5 in D2 §4.2); 0: chosen with l* from S_L and δ",
                         paper="D2 §4", ge=0, aliases=("fuse-count",))
    max_fused: int = param(8, "cap on n* when it is chosen (n_fused = 0)", paper="D2 §2.3", ge=1, advanced=True)
    own_copies: int = param(1, "N copies of layer l*'s MLP (at most one copy runs per token)", paper="D2 Eq. 6", ge=1, le=64)
    fused_copies: int = param(1, "M copies of each fused MLP (at most one copy runs per token)", paper="D2 Eq. 6", ge=1, le=64)
    top_k: int = param(1, "experts per token (softmax router; top-1 in D2 §4.2); must be below the 1 + n* distinct MLPs",
                       paper="D2 §2.1", ge=1)
    combine: Combine = param("sum", "sum: unweighted (keeps the dense function); weighted: softmax gates (D2 §2.1); "
                                    "normalized: gates renormalised over the top-k", paper="D2 §2.1")
    seed: int = param(0, "router initialisation", ge=0, advanced=True)

    @property
    def fixed_n(self) -> int | None:
        """n* when given, None when it is chosen (``n_fused`` 0; None in records written before 0 meant it)."""
        return int(self.n_fused) if self.n_fused else None

    def n_experts(self, n_fused: int) -> int:
        """``N + n*·M`` (D2 Eq. 6)."""
        return self.own_copies + n_fused * self.fused_copies

    def routing_problem(self, n_fused: int) -> str | None:
        """Why a fusion of ``n_fused`` blocks with these parameters would not route (None: it does).

        The fused layer holds 1 + n* distinct MLPs (copies never run twice for one token): with
        ``top_k`` ≥ 1 + n* every one of them runs on every token."""
        distinct = 1 + n_fused
        if self.top_k < distinct:
            return None
        return (
            f"top_k={self.top_k} with n*={n_fused}: the fused layer holds {distinct} distinct MLPs "
            f"({self.n_experts(n_fused)} experts counting copies, at most one copy of each runs per token), so top-{self.top_k} "
            f"runs all of them on every token: no routing and no sparsity (only the removed attentions would be saved); "
            f"use top_k ≤ {n_fused} (D2 §4.2: top-1 of 6 experts, n* = 5) or fuse more blocks (n_fused > {self.top_k - 1})"
        )

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
        if self.n_fused is not None and self.n_fused < 0:
            raise ConversionError(f"n_fused={self.n_fused}: n* must be at least 1 (or 0 to choose it)")
        n = self.fixed_n
        room = n_layers - 1 - (self.layer or 0)
        if n is not None and n > room:
            where = f"after l* = {self.layer}" if self.layer is not None else "after block 0"
            raise ConversionError(
                f"n_fused={n}: a model of {n_layers} layers has only {room} block(s) {where} to fuse: "
                f"use n_fused ≤ {room}, or 0 to choose n* from S_L and δ"
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
        # The largest n* possible: with it, top_k must still leave a choice between the MLPs.
        n_max = n if n is not None else min(self.max_fused, room)
        problem = self.routing_problem(n_max)
        if problem:
            raise ConversionError(problem)
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

    ``layer`` / ``n_fused`` restrict the search to pairs with that l / n (None: any); when both
    are given the pair is used as is (no δ test) and only its similarities are reported.
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
            + (f"; spans of fewer blocks than n_fused={n_fused} have closer MLP inputs" if n_fused is not None and n_fused > 1 else "")
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
        choice = plan_fusion(profile, params)
    elif params.layer is not None and params.fixed_n is not None:
        choice = FusionChoice(params.layer, params.fixed_n, None, None, params.delta)
    else:
        raise ConversionError("dense2moe needs a profile (S_L, S_M) to choose l*, or both layer and n_fused")
    l, n = choice.layer, choice.n_fused
    E = params.n_experts(n)
    problem = params.routing_problem(n)
    if problem:
        raise ConversionError(f"the fusion l*={l}, n*={n}: {problem}")
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
        "chosen": params.layer is None or params.fixed_n is None,
        "n_experts": E,
        "distinct_experts": 1 + n,
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


def plan_fusion(profile: Any, params: Dense2MoEParams) -> FusionChoice:
    """The (l*, n*) a conversion with ``params`` fuses, from the profile's S_L / S_M (numpy only):
    ``choose_fusion`` with the parameters' δ, n* (0: chosen), l* and cap. The conversion, the
    designer's preview and the layer-similarity page all ask this one function."""
    return choose_fusion(profile.similarity("outputs"), profile.similarity("mlp_inputs"), params.delta,
                         params.max_fused, params.layer, params.fixed_n)


def preview(profile: Any, params: Dense2MoEParams) -> dict[str, Any]:
    """What a conversion would fuse (D2 §2.3), from the stored S_L / S_M: numpy only. Raises the
    ConversionError the conversion would raise (no admitted pair, no routing)."""
    L = profile.manifest["n_layers"]
    params.validate(L)
    choice = plan_fusion(profile, params)
    problem = params.routing_problem(choice.n_fused)
    if problem:
        raise ConversionError(f"the fusion l*={choice.layer}, n*={choice.n_fused}: {problem}")
    return {
        "params": params.to_dict(), "fusion": choice.to_dict(),
        "summary": {"layers_before": L, "layers_after": L - choice.n_fused, "fused_layer": choice.layer,
                    "removed_layers": choice.fused_layers, "n_experts": params.n_experts(choice.n_fused),
                    "distinct_experts": 1 + choice.n_fused, "top_k": params.top_k},
    }


def prepare_recovery(moe: Any, modules: dict[int, Any], batch: Any) -> tuple[dict[int, Any], dict[str, Any], bool]:
    """D2 §3 fine-tunes the router. Layers that combine ``sum`` (or ``normalized`` at top-1, a
    weight identically 1) switch to the ``scaled`` combine with u = b = 0 (CM §3.3): the same
    selections and outputs, but the LM loss now reaches u, and W_g through u (module docstring)."""
    switched, every = [], []
    for i, mod in modules.items():
        if mod.combine == "sum" or (mod.combine == "normalized" and mod.top_k == 1):
            mod.combine = "sum"  # normalized at top-1 computes exactly the sum
            mod.use_scaled_combine()
            switched.append(i)
        if mod.top_k >= mod.n_routed:
            every.append(i)
    notes: dict[str, Any] = {"scaled_combine_layers": switched}
    if every:
        notes["every_expert_layers"] = every  # no routing there: u and W_g learn per-token weights 1 + s'·u
    return modules, notes, False


def _label(p) -> list[str]:
    """δ, the fused layer l* and count n* (D2 §2.3; 'auto' when chosen by the method), top-k."""
    lstar, nstar = p.get("layer"), p.get("n_fused")
    return [f"δ {num(p.get('delta'))}", f"l* {'auto' if lstar is None else lstar}", f"n* {nstar or 'auto'}",
            f"top-{p.get('top_k', 1)}"]


METHOD = Method(
    name="dense2moe",
    label=_label,
    title="Dense2MoE",
    paper="D2 §2.3",
    summary="layer-fusion upcycling: drop the blocks after l* whose MLP inputs S_M are close, keep their MLPs as experts of l* (Eq. 6)",
    params=Dense2MoEParams,
    needs="profile",
    build=build,
    validate=validate,
    preview=preview,
    recovery=Recovery(paper="D2 §3: the router trains (scaled gate 1 + s′·u, u = 0 at start)", lora="off",
                      summary="Dense2MoE: trains only the fused layers' softmax routers (D2 §2.1, §3): the unweighted sum "
                              "becomes the gate 1 + softmax(h W_g)_i·u_i with u = 0 (same model at the start), and W_g and "
                              "u learn; adds λ·L_LB (EW Eq. 12) when λ > 0; no LoRA, γ unused.",
                      balance_bias=False, prepare=prepare_recovery),
)
