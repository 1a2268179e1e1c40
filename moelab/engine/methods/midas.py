"""MIDAS: one low-rank expert per calibration set behind a new gating network (MI §3.2, Alg. 1).

For every decoder layer and every calibration set D_i (one profile each, all of the same model):

* MI Eq. 1: ``M_i = Σ_{x∈D_i} x xᵀ = S_i S_iᵀ``, the profile's ``XᵀX`` of the FFN input, by
  Cholesky with the smallest jitter that makes it positive definite (``lowrank.whitening``).
* MI Eq. 2: gate and up projections ``W S_i ≈ U_r Σ_r V_rᵀ``, i.e. the rank-r map with the least
  error on D_i's FFN inputs (``lowrank.whitened_lowrank``).
* The down projection reads the hidden state ``h = act(x W_gateᵀ) ⊙ x W_upᵀ``, not x, so S_i does
  not apply to it and the profile holds no ``HᵀH``. MI §3.2 applies SVD-LLM to the FFN layers, and
  SVD-LLM whitens each matrix by its own input's second moment, so ``MidasParams.down="hidden"``
  (default) does that: ``HᵀH`` of the GLU hidden state that the dense model's own forward gives on
  D_i's calibration text as its profile stores it (``hidden_moments``: every set's pass runs layer
  by layer, ``core.fitting.layerwise_inputs``, at most ``max(HIDDEN_TOKENS, 2·d_ffn)`` tokens a
  set), whitened and factorised as Eq. 1–2 do for the gate and up. Choices kept beside it:
  ``surrogate`` draws ``x = S_i z / √n`` with ``z ~ N(0, I)``, whose second moment is exactly
  ``M_i / n``, pushes it through the *dense* gate and up projections and whitens ``W_down`` with
  the resulting ``HᵀH`` (the hidden second moment estimated from D_i's input statistics instead of
  a pass over D_i's text; the default before ``hidden``); ``plain`` is the truncated SVD of
  ``W_down`` (the same for every set). The surrogate is zero-mean Gaussian, which real FFN inputs
  are not; measured on the default model (keep_ratio 0.5, rank 209, experts from 48 × 128 tokens
  of builtin:code / builtin:prose, errors on held-out hidden states of the same set),
  down-projection relative error plain → surrogate (4096 samples) → true ``HᵀH`` of the
  calibration text: layer 3 0.57 → 0.55 → 0.47, layer 15 0.59 → 0.52 → 0.38, layer 27 0.50 →
  0.35 → 0.28; whole-expert FFN output error at layer 15 0.68 → 0.62 → 0.52; held-out perplexity
  (16 × 128 tokens of builtin:mixed, dense 15.9, top-2) plain 1.7·10⁶ → surrogate 934 → hidden
  802 (conversion 31 s surrogate, 53 s hidden), tested: on its own set's ``HᵀH`` each ``hidden``
  expert's down projection has less error than the surrogate's and the plain SVD's (Eckart–Young
  in the whitened space). Surrogate samples: ``HᵀH`` is ``d_ffn × d_ffn`` and has rank ≤ the number of
  samples, so a layer draws ``max(surrogate_samples, 2·d_ffn)`` (``surrogate_samples_for``;
  recorded per layer). With fewer samples than neurons (the old fixed 4096 against d_ffn
  11008–14336 of 7B models) the whitening would be rank-deficient by construction: jitter alone
  would weigh every hidden direction the samples miss. Two per neuron make it full rank (for
  isotropic Gaussian h the sample eigenvalues would spread over (1 ± 1/√2)² of the true ones,
  Marchenko–Pastur). The samples are drawn and accumulated 4096 at a time on the model's device
  (7B: 28672 samples, about 18 TFLOP per layer and set).
* Factors: MI Eq. 2's rank-r map ``U_r Σ_r V_rᵀ S⁻¹`` equals ``U_r U_rᵀ W`` (the dense map
  followed by an orthogonal projection of its output), so no expert matrix can output more
  than the dense one on any input; the two stored factors split each rank-one component
  evenly (``lowrank.balanced_factors``), so their scale no longer grows with √(calibration
  tokens) (on the default model ‖A‖_F was up to 1.3·10⁵ against ‖B‖_F ≈ 0.1–2; now both ≈ 45–65).
* Layers kept dense (``MidasParams.dense_layers``). MI §3.2 copies into the backbone every
  parameter "excluding the FFN layers slated for conversion"; which layers are converted is a
  choice. ``auto`` (default) keeps a layer's dense FFN when its output is at least
  ``DENSE_RATIO`` = 0.5 × the norm of the residual stream entering the layer (median over a
  seeded random-token probe, ``ffn_residual_ratios``). Why: an expert's error is relative to
  the FFN's output, but what the model feels is its size against the residual stream. On the
  default model the layer-0 FFN writes 16.5× the residual it is added to (it *is* the token
  representation; 20× on random tokens), layer 29 0.9× (1.2×), every other layer ≤ 0.4×.
  Converting layer 0 alone (keep 0.5) takes held-out perplexity 15.9 → 1431 and is what made
  the whole conversion useless: all 30 layers 20.5k, all but layer 0 1577, all but 0 and 29
  934 (16 × 128 held-out builtin:mixed tokens, experts from 48 × 128 tokens of code / prose).
  ``none`` converts every layer (the old behaviour); a comma list names the layers.
* Rank: ``keep_ratio`` is the fraction of a matrix's parameters its two factors keep,
  ``r (d_ffn + d_model) ≈ keep_ratio · d_ffn · d_model`` (``lowrank.rank_for_ratio``). This is
  MI §4.1's reading: "25% compression ratio (rank 746)" on Llama-2-7B is
  ``int(0.25 · 11008 · 4096 / (11008 + 4096)) = 746``, and MI Table 8 agrees (4 experts of 25%
  give the dense total, 6.61 B; 2 active give 4.44 B). ``keep_ratio = 1`` means no compression:
  the exact full-rank factorisation (rank ``min(d_ffn, d_model)``), because a factorisation
  with exactly the dense parameter count would still lose information.
* MI Alg. 1 step 4: a new gating network G, ``nn.Linear(d_model, n_sets)`` with a seeded
  N(0, initializer_range²) init; per token ``softmax``, ``top_k``, weights renormalised over the
  selected experts (see ``modeling_moelab.LowRankMoeFFN``), so before any training the layer
  outputs a convex combination of low-rank approximations of the same dense FFN.

The backbone (attention, norms, embeddings and the dense layers) is the base model's own tensors;
LoRA and the two-stage fine-tuning of MI §3.2 are a later step (the factors and G are plain
parameters). Untrained, the model is far from dense, as in the paper (MI Table 9: C4 perplexity
625 before CPT). On the default model, top-2 of {code, prose} (48 × 128 calibration tokens each),
16 × 128 held-out builtin:mixed tokens, dense 15.9: keep_ratio 0.5 gives 802 with ``down="hidden"``
(934 with the surrogate; layers 0 and 29 dense; 20.5k converting all 30 with the surrogate),
keep_ratio 0.25 gives 7.3·10⁴ (7.2·10⁵ with the surrogate, 1.2·10⁶ converting all). At 0.25
(rank 104 of 576) every converted layer's experts miss 0.8–0.9 of its FFN output on held-out text
(0.65–0.75 at 0.5) and the errors compound over 28 layers; each layer alone costs only 3–16%
perplexity. The hidden states do not blow up (median per-token norm within 0.77–1.5× of dense at
every layer); the model is simply far from dense until it is trained.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Literal, Sequence

import numpy as np

from ..core.params import ConversionError, MethodParams, param
from .base import ConversionInputs, Method, Recovery
from .labels import num, pct
from ..progress import NO_PROGRESS, Progress

if TYPE_CHECKING:  # core.lowrank is torch: imported where a conversion runs, never by the API's registry
    import torch

    from ..core.lowrank import LowRank, Whitening

DownChoice = Literal["hidden", "surrogate", "plain"]
#: Manifest fields that must agree between the profiles of one MIDAS conversion.
_MODEL_KEYS = ("source", "family", "activation", "n_layers", "d_model", "d_ffn", "n_parameters")


@dataclass(frozen=True)
class MidasParams(MethodParams):
    """``down``: how ``W_down`` is factorised (module doc); ``surrogate_samples``: the least number
    of Gaussian samples per layer and set for ``down="surrogate"`` (a layer uses
    ``max(surrogate_samples, 2·d_ffn)``); ``dense_layers``: FFN layers that stay dense (module doc)."""

    method: ClassVar[str] = "midas"

    keep_ratio: float = param(0.25, "share of each FFN matrix's parameters an expert keeps", paper="MI §4.1", gt=0, le=1)
    top_k: int = param(2, "experts per token", paper="MI Table 8", ge=1)
    seed: int = param(0, "gating-network init and the surrogate samples", ge=0, advanced=True)
    down: DownChoice = param(
        "hidden", "how W_down is factorised: whitened by the HᵀH of its input (the GLU hidden state) on each set's own "
        "calibration text (SVD-LLM per layer, as MI §3.2 applies it), by a Gaussian surrogate HᵀH, or plain SVD",
        paper="MI Eq. 2", advanced=True)
    surrogate_samples: int = param(
        4096, "least Gaussian samples per layer and set for down=surrogate (a layer uses at least 2 × its d_ffn)",
        ge=16, advanced=True)
    dense_layers: str = param(
        "auto", "FFN layers kept dense: auto (those whose output outweighs half the residual stream), "
        "none, or a comma list such as 0,29", paper="MI §3.2", advanced=True)

    def validate(self, n_sets: int) -> None:
        """``n_sets``: the number of calibration sets (= profiles = experts)."""
        checks = [
            (n_sets >= 2, f"MIDAS needs at least 2 calibration sets (one profile each), got {n_sets}"),
            (isinstance(self.keep_ratio, (int, float)) and 0.0 < self.keep_ratio <= 1.0,
             f"keep_ratio must be in (0, 1] (fraction of each FFN matrix's parameters an expert keeps), got {self.keep_ratio}"),
            (isinstance(self.top_k, int) and 1 <= self.top_k <= n_sets,
             f"top_k must be between 1 and the number of calibration sets ({n_sets}), got {self.top_k}"),
            (self.down in ("hidden", "surrogate", "plain"),
             f"down must be 'hidden', 'surrogate' or 'plain', got {self.down!r}"),
            (isinstance(self.surrogate_samples, int) and self.surrogate_samples >= 16,
             f"surrogate_samples must be an integer ≥ 16, got {self.surrogate_samples}"),
            (_parse_dense_layers(self.dense_layers) is not None,
             f"dense_layers must be 'auto', 'none' or a comma list of layer indices such as '0,29', "
             f"got {self.dense_layers!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConversionError(message)


def expert_rank(out_features: int, in_features: int, keep_ratio: float) -> int:
    """The factor rank of a matrix that keeps ``keep_ratio`` of its parameters (module doc);
    ``keep_ratio = 1`` gives the exact full rank."""
    from ..core.lowrank import rank_for_ratio

    if keep_ratio >= 1.0:
        return min(out_features, in_features)
    return rank_for_ratio(out_features, in_features, keep_ratio)


#: ``dense_layers="auto"`` keeps a layer dense when its FFN output is at least this share of the
#: residual stream entering the layer (module doc).
DENSE_RATIO = 0.5
#: The GLU hidden state's surrogate ``HᵀH`` uses at least this many samples per FFN neuron.
SURROGATE_PER_NEURON = 2
_PROBE_SHAPE = (2, 128)  # random-token probe of the residual ratios: 254 tokens past position 0


def _parse_dense_layers(spec: Any) -> str | list[int] | None:
    """``"auto"``, a sorted list of layer indices (``""``/``"none"``: none), or None if malformed."""
    if not isinstance(spec, str):
        return None
    text = spec.strip().lower()
    if text == "auto":
        return "auto"
    if text in ("", "none"):
        return []
    try:
        layers = sorted({int(part) for part in text.split(",")})
    except ValueError:
        return None
    return layers if all(i >= 0 for i in layers) else None


def ffn_residual_ratios(adapter: Any, seed: int = 0) -> list[float]:
    """Per decoder layer: the median over probe tokens of ``‖FFN output‖ / ‖residual stream
    entering the layer‖`` on seeded random token ids (position 0 left out: it carries the
    attention-sink activations). No text is needed: on the default model the ratios of random
    tokens and of held-out text agree (layer 0: 20 vs 16.5; layer 29: 1.2 vs 0.9; every other
    layer ≤ 0.4 on both)."""
    import torch

    model = adapter.model
    vocab = int(model.get_input_embeddings().weight.shape[0])
    ids = torch.randint(0, vocab, _PROBE_SHAPE, generator=torch.Generator().manual_seed(seed)).to(adapter.device)
    residual: dict[int, Any] = {}
    output: dict[int, Any] = {}
    hooks = []
    for i, lay in enumerate(adapter.layers):
        def pre(_m, args, kwargs, i=i):
            h = args[0] if args else kwargs["hidden_states"]
            residual[i] = h[:, 1:].float().norm(dim=-1)

        def post(_m, _args, out, i=i):
            out = out[0] if isinstance(out, tuple) else out
            output[i] = out[:, 1:].float().norm(dim=-1)

        hooks.append(lay.block.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(lay.mlp.register_forward_hook(post))
    try:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [float((output[i] / residual[i].clamp_min(1e-30)).median()) for i in range(len(adapter.layers))]


def check_profiles(adapter: Any, profiles: Sequence[Any]) -> None:
    """Every profile must come from the loaded model, hold ``XᵀX`` and be a distinct set."""
    from ..core.slicing import check_compatible

    if len(profiles) < 2:
        raise ConversionError(f"MIDAS needs at least 2 profiles (one per calibration set), got {len(profiles)}")
    first = profiles[0]
    ref = first.manifest["model"]
    for p in profiles[1:]:
        other = p.manifest["model"]
        diff = [f"{k}: {ref.get(k)!r} vs {other.get(k)!r}" for k in _MODEL_KEYS if ref.get(k) != other.get(k)]
        if diff:
            raise ConversionError(
                f"profile {p.path} was made on a different model than {first.path} ({'; '.join(diff)}): "
                "profile every calibration set on the same model"
            )
    seen: dict[str, Any] = {}
    for p in profiles:
        check_compatible(adapter, p)
        if "second_moment.safetensors" not in p.manifest["files"]:
            raise ConversionError(f"profile {p.path} has no XᵀX (MI Eq. 1): profile it again with second_moment on")
        cid = p.manifest["calibration"].get("id")
        if cid in seen:
            raise ConversionError(
                f"profiles {seen[cid].path} and {p.path} are of the same calibration set: "
                "MIDAS needs a different set per expert"
            )
        seen[cid] = p


def surrogate_hidden_moment(
    gate_w: Any, up_w: Any, white: Whitening, n_tokens: int, act: str, n_samples: int, seed: int,
    device: Any = None, chunk: int = 4096,
) -> "torch.Tensor":
    """``HᵀH`` (scaled to ``n_tokens``) of the GLU hidden state ``h = act(W_gate x) ⊙ W_up x`` for
    Gaussian inputs ``x = S z / √n_tokens``, ``z ~ N(0, I)``: their second moment is ``M / n_tokens``,
    the calibration set's own (MI Eq. 1). Used to whiten the down projection (module doc).
    ``HᵀH`` has rank ≤ ``n_samples``: fewer samples than FFN neurons leave it singular (the caller
    uses at least 2 per neuron). Samples are drawn (numpy's generator: the same draws on every
    device) and accumulated ``chunk`` at a time on ``device`` (default: the whitening's)."""
    import torch
    from transformers.activations import ACT2FN

    rng = np.random.default_rng(seed)
    dev = torch.device(device) if device is not None else white.S.device
    # float32 for the big products: the estimate's sampling noise dwarfs the rounding
    s = (white.S / np.sqrt(max(n_tokens, 1))).to(device=dev, dtype=torch.float32)
    g = torch.as_tensor(gate_w).to(device=dev, dtype=torch.float32)
    u = torch.as_tensor(up_w).to(device=dev, dtype=torch.float32)
    hth = torch.zeros(g.shape[0], g.shape[0], dtype=torch.float64, device=dev)
    for start in range(0, n_samples, chunk):
        z = rng.standard_normal((min(chunk, n_samples - start), white.S.shape[0]))
        x = torch.from_numpy(z.astype(np.float32)).to(dev) @ s.T
        h = ACT2FN[act](x @ g.T) * (x @ u.T)
        hth += (h.T @ h).double()
    return hth * (n_tokens / n_samples)


#: At most this many of a set's calibration tokens feed its down projection's ``HᵀH`` (``down="hidden"``), but at least
#: ``SURROGATE_PER_NEURON · d_ffn`` where the set has them (a full-rank moment).
HIDDEN_TOKENS = 16384


def hidden_moments(adapter: Any, profiles: Sequence[Any]) -> Iterator[list["torch.Tensor"]]:
    """Per decoder layer, in order: each set's ``HᵀH`` ``[d_ffn, d_ffn]`` (float64) of the GLU hidden state
    ``h = act(W_gate x) ⊙ W_up x`` that ``W_down`` reads, on the set's own calibration text as its profile stores it
    (``down="hidden"``: SVD-LLM's whitening statistic for the down projection, which MI §3.2 applies to every FFN
    matrix). Each set runs the dense model layer by layer (``core.fitting.layerwise_inputs``); the sets' passes advance
    together, so one layer's activations per set are held. A set gives at most ``max(HIDDEN_TOKENS, 2·d_ffn)`` of its
    profile's tokens, in windows of ``core.fitting.FIT_SEQ_LEN`` (one window of all of it where it is shorter)."""
    import torch

    from ..core.fitting import layerwise_inputs, stored_token_windows

    cap = max(HIDDEN_TOKENS, SURROGATE_PER_NEURON * max(lay.d_ffn for lay in adapter.layers))
    passes = [layerwise_inputs(adapter, stored_token_windows(adapter, p, min(int(p.manifest["n_tokens"]), cap),
                                                             shorter=True)) for p in profiles]
    dev = adapter.device  # the products on the model's device, as the surrogate's (7B: 5 TFLOP a layer and set)
    for _ in adapter.layers:
        moments = []
        for inputs in (next(g) for g in passes):
            h, hth = inputs.hidden, torch.zeros(inputs.hidden.shape[1], inputs.hidden.shape[1], dtype=torch.float64,
                                                device=dev)
            for s in range(0, len(h), 4096):  # float32 products, summed in float64 (as the surrogate's)
                chunk = h[s : s + 4096].to(dev)
                hth += (chunk.T @ chunk).double()
            moments.append(hth)
        yield moments


def surrogate_samples_for(params: "MidasParams", d_ffn: int) -> int:
    """Samples for one layer's surrogate ``HᵀH``: ``max(surrogate_samples, 2·d_ffn)``, so that the
    d_ffn × d_ffn moment is full rank (module doc)."""
    return max(int(params.surrogate_samples), SURROGATE_PER_NEURON * int(d_ffn))


@dataclass
class _SetFactors:
    white: Whitening
    gate: LowRank
    up: LowRank
    down: LowRank
    down_jitter: float | None


def _factorise_set(
    w: dict[str, "torch.Tensor"], xtx: Any, n_tokens: int, rank: int, act: str, params: MidasParams, seed: int,
    hth: "torch.Tensor | None" = None,
) -> _SetFactors:
    """One set's factors on the device of ``w`` (float64 tensors there); ``hth``: the set's ``HᵀH`` for
    ``down="hidden"`` (``hidden_moments``)."""
    from ..core.lowrank import truncated_lowrank, whitened_lowrank, whitening

    white = whitening(xtx, device=w["gate"].device)
    gate = whitened_lowrank(w["gate"], white, rank)  # MI Eq. 2
    up = whitened_lowrank(w["up"], white, rank)
    if params.down == "hidden":  # MI Eq. 1–2 on W_down's own input
        white_h = whitening(hth, device=w["down"].device)
        return _SetFactors(white, gate, up, whitened_lowrank(w["down"], white_h, rank), white_h.jitter)
    if params.down == "surrogate":
        n_samples = surrogate_samples_for(params, w["down"].shape[1])
        hth = surrogate_hidden_moment(w["gate"], w["up"], white, n_tokens, act, n_samples, seed)
        white_h = whitening(hth)
        return _SetFactors(white, gate, up, whitened_lowrank(w["down"], white_h, rank), white_h.jitter)
    return _SetFactors(white, gate, up, truncated_lowrank(w["down"], w["down"], rank), None)


def convert_midas(
    adapter: Any, profiles: Sequence[Any], params: MidasParams, progress: Progress = NO_PROGRESS,
) -> tuple[Any, dict[str, Any]]:
    """MI Alg. 1: expert ``i`` of every layer is the dense FFN factorised on profile ``i``'s
    calibration set; returns the MoE model (the adapter's model, converted in place) and the
    conversion record. Per layer the record holds the rank, each set's Cholesky jitter and
    ``gate_error[i][k]`` / ``up_error[i][k]``: expert i's relative data error on set k's ``XᵀX``
    plus its jitter (``lowrank.projection_errors``; sets in ``summary.sets`` order; the diagonal is
    an expert's own set, the off-diagonal shows how specialised the experts are); with
    ``down='hidden'`` (``'surrogate'``) also ``down_error_hidden`` (``down_error_surrogate``), the same for the down
    projection on each set's ``HᵀH`` (surrogate ``HᵀH``, and ``surrogate_samples``), and ``down_jitter``.
    Layers kept dense (``params.dense_layers``, module doc) have no row; ``summary`` names them
    and holds every layer's ``ffn_residual_ratio``."""
    import torch

    from ..runtime.export import build_moe_model
    from ..runtime.param_count import parameter_counts

    t0 = time.perf_counter()
    params.validate(len(profiles))
    check_profiles(adapter, profiles)
    dense = parameter_counts(adapter.model)
    names = [p.manifest["calibration"].get("name") or str(p.path) for p in profiles]
    init_std = float(getattr(adapter.model.config, "initializer_range", 0.02))
    gen = torch.Generator().manual_seed(params.seed)
    E, L = len(profiles), adapter.n_layers
    ratios = ffn_residual_ratios(adapter, params.seed)
    keep_dense = _dense_layers(params.dense_layers, ratios, L)
    modules: dict[int, Any] = {}
    layers: list[dict[str, Any]] = []
    moments = hidden_moments(adapter, profiles) if params.down == "hidden" else None
    progress.update("midas experts", 0, L)
    for i, lay in enumerate(adapter.layers):
        router = torch.randn(E, adapter.d_model, generator=gen, dtype=torch.float64) * init_std
        hth = next(moments) if moments is not None else None  # every layer's pass runs: the next one reads its output
        if i in keep_dense:
            progress.update("midas experts", i + 1, L)
            continue
        modules[i], row = _midas_layer(adapter, i, lay, profiles, router, params, hth)
        layers.append(row)
        progress.update("midas experts", i + 1, L)
    t1 = time.perf_counter()
    moe = build_moe_model(adapter, modules, provenance={"method": "midas", "sets": names})
    counts = parameter_counts(moe)
    t2 = time.perf_counter()
    summary = {
        "method": "midas",
        "n_layers": L,
        "n_experts": E,
        "top_k": params.top_k,
        "keep_ratio": params.keep_ratio,
        "ranks": sorted({row["rank"] for row in layers}),
        "sets": names,
        "down": params.down,
        "dense_layers": list(keep_dense),
        "ffn_residual_ratio": ratios,
        "total_params": counts["total"],
        "active_params": counts["active"],
        "dense_total_params": dense["total"],
        "dense_active_params": dense["active"],
        "max_jitter": max(max(row["jitter"]) for row in layers),
        **{f"mean_{k}_error_own": _mean_diag(layers, f"{k}_error") for k in ("gate", "up")},
        **{f"mean_{k}_error_other": _mean_off_diag(layers, f"{k}_error") for k in ("gate", "up")},
    }
    record = {
        "params": params.to_dict(),
        "summary": summary,
        "layers": layers,
        "timings": {"factorise_s": t1 - t0, "build_s": t2 - t1, "total_s": t2 - t0},
    }
    return moe, record


def _dense_layers(spec: str, ratios: list[float], L: int) -> list[int]:
    """The layers ``params.dense_layers`` keeps dense (``"auto"``: those whose FFN residual ratio is at
    least ``DENSE_RATIO``) of a model with ``L`` layers; refuses a layer beyond it and keeping them all."""
    keep_dense = _parse_dense_layers(spec)
    if keep_dense == "auto":
        keep_dense = [i for i, r in enumerate(ratios) if r >= DENSE_RATIO]
    elif any(i >= L for i in keep_dense):
        raise ConversionError(
            f"dense_layers {spec!r} names a layer beyond the model's {L} layers (0 … {L - 1})")
    if len(keep_dense) == L:
        raise ConversionError(f"dense_layers {spec!r} keeps every layer dense: nothing left to convert")
    return keep_dense


def _midas_layer(adapter: Any, i: int, lay: Any, profiles: Sequence[Any], router: Any, params: MidasParams,
                 hth: list[Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """MI Alg. 1 for layer ``i``: expert ``j`` is the dense FFN factorised on profile ``j``'s ``XᵀX`` (and, for
    ``down="hidden"``, its down projection on set ``j``'s ``HᵀH``: ``hth[j]``); returns the layer's ``LowRankMoeFFN``
    (router ``router``) and its record row (``convert_midas``)."""
    import torch

    from ..core.lowrank import as_float64, lowrank_moe_from_factors, projection_errors

    E = len(profiles)
    n_tokens = [int(p.manifest["n_tokens"]) for p in profiles]
    ref = lay.gate_weight()
    # float64 on the model's device: the factorisations are the job's heavy part at 7B (module doc)
    w = {k: t.detach().to(torch.float64) for k, t in
         (("gate", lay.gate_weight()), ("up", lay.up_weight()), ("down", lay.down_weight()))}
    rank = expert_rank(lay.d_ffn, adapter.d_model, params.keep_ratio)
    xtx = [as_float64(p.xtx(i), ref.device) for p in profiles]
    sets = [_factorise_set(w, xtx[j], n_tokens[j], rank, adapter.activation, params, params.seed * 7919 + i * E + j,
                           None if hth is None else hth[j]) for j in range(E)]

    def cross(kind: str) -> list[list[float]]:
        return projection_errors([getattr(f, kind) for f in sets])

    row: dict[str, Any] = {
        "layer": i, "rank": rank,
        "jitter": [f.white.jitter for f in sets],
        "gate_error": cross("gate"),
        "up_error": cross("up"),
    }
    if params.down == "surrogate":
        row["surrogate_samples"] = surrogate_samples_for(params, lay.d_ffn)
    if params.down != "plain":  # each expert's down projection's error on each set's HᵀH (its own kind)
        row["down_jitter"] = [f.down_jitter for f in sets]
        row[f"down_error_{params.down}"] = cross("down")

    def stack(kind: str, part: str) -> Any:
        mats = [getattr(getattr(f, kind), part) for f in sets]
        return torch.stack(mats).to(dtype=ref.dtype, device=ref.device)

    factors = {f"{k}_a": stack(k, "B") for k in ("gate", "up", "down")}
    factors |= {f"{k}_b": stack(k, "A") for k in ("gate", "up", "down")}
    return lowrank_moe_from_factors(factors, router.to(ref.dtype), adapter.activation, params.top_k), row


def _mean_diag(layers: list[dict[str, Any]], key: str) -> float:
    return float(np.mean([np.diag(np.asarray(row[key])) for row in layers]))


def _mean_off_diag(layers: list[dict[str, Any]], key: str) -> float:
    vals = [np.asarray(row[key])[~np.eye(len(row[key]), dtype=bool)] for row in layers]
    return float(np.mean(np.concatenate(vals)))


def validate(params: MidasParams, profiles: list[Any]) -> None:
    from pathlib import Path

    paths = [Path(p.path).resolve() for p in profiles if getattr(p, "path", None) is not None]
    repeated = sorted({str(p) for p in paths if paths.count(p) > 1})
    if repeated:
        raise ConversionError(f"profile {', '.join(repeated)} given more than once: MIDAS builds one expert per calibration "
                              "set, so every profile must be a different one (one --profile per set)")
    params.validate(len(profiles))


def build(inputs: ConversionInputs, params: MidasParams, progress: Progress) -> tuple[Any, Any, dict[str, Any]]:
    adapter = inputs.load_dense()
    moe, record = convert_midas(adapter, inputs.profiles, params, progress)
    record["profiles"] = [str(p.path.resolve()) for p in inputs.profiles]
    record["calibrations"] = [p.manifest["calibration"] for p in inputs.profiles]
    return moe, adapter.tokenizer, record


def load_cv_by_set(converted: Any, tokenizer: Any, record: dict[str, Any], *, data_dir: Any, n_windows: int,
                   seq_len: int, progress: Progress) -> dict[str, Any]:
    """MI Eq. 7: load CV per layer on the held-out text of each calibration set (built-ins only)."""
    from ..evaluation.metrics import load_cv_by_source

    sources = [c.get("source") for c in record.get("calibrations", [])]
    sources = [s for s in sources if isinstance(s, str) and s.startswith("builtin:")]
    return {"load_cv_by_set": load_cv_by_source(converted, tokenizer, sources, data_dir, n_windows=max(1, n_windows // 4),
                                                seq_len=seq_len, progress=progress)}


def _label(p) -> list[str]:
    """The kept fraction of each FFN and the experts chosen per token."""
    return [f"keep {pct(p.get('keep_ratio'))}", f"top-{num(p.get('top_k'))}"]


METHOD = Method(
    name="midas",
    label=_label,
    title="MIDAS",
    paper="MI §3.2",
    summary="one whitened low-rank expert per calibration set (Eqs. 1-2) behind a new top-k gate; one profile per set",
    params=MidasParams,
    needs="profiles",
    build=build,
    validate=validate,
    recovery=Recovery(paper="MI §3.2: gate + LoRA", layer_kind="lowrank_moe",
                      summary="MIDAS: trains the gating network G and LoRA adapters on attention and the low-rank experts "
                              "(MI App. A.1, Alg. 1); adds λ·L_LB (EW Eq. 12) when λ > 0."),
    extra_evaluation=load_cv_by_set,
)
