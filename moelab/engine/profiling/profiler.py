"""Profiling: one streaming pass of a calibration set through the model, hooks on every FFN.

Per layer ℓ it accumulates, without ever keeping all token activations:

* EW §3.1 activation profiles ``A_ℓ ∈ R^{M×d_ffn}``: ``a_ij = mean_tokens(act(x_j W_gate))_i``,
  **signed** (the brief: CV on |·| collapses), read off the activation module's output.
* Group means ``ā_{j,t}`` (mean of the sample profiles of group t; every sample weighs the same,
  as EW's Fig. 1 uses 5 samples per task) and, per neuron, EW Eq. 3:
  ``μ_j = mean_t ā_{j,t}``, ``σ_j = std_t ā_{j,t}`` (population std, ddof=0) and
  ``CV_j = σ_j / (|μ_j| + ε)``. The paper writes ``μ_j + ε``; with signed means μ can be
  negative (SiLU/GELU gates dip below zero), so we divide by ``|μ_j|`` to keep CV a
  non-negative dispersion ratio. Groups are tasks when the set has ≥ 2 tasks, else samples
  (``ProfileSettings.group_by``); the manifest records which.
* CM Eq. 4 ATopK markers: per token the ``K_a`` neurons with the largest ``|h_i|`` where
  ``h = act(x W_gate) ⊙ (x W_up)`` is the down projection's input; activation rates
  ``μ_i = mean_tokens a_i`` over *all* tokens; and, for clustering, the marker rows of a bounded,
  seeded uniform sample of tokens (``feature_tokens``), stored as the K_a sorted neuron indices
  per token (``[T_s, K_a]`` ints: 16,384 × 10 × 2 B = 320 KiB per layer), which is the
  activation feature matrix of CM App. A in sparse form. ``atopk_normalized`` selects CMoE's
  variant that normalises X (per token) and the columns of W_gate/W_up before computing h
  (CM App. A: "we normalize X, W_gate and W_up … to eliminate the influence of their magnitudes").
* A histogram of h values (CM App. A, Fig. 1a) on ``[-R, R]``, R = max |h| in the first batch,
  with the counts below and above kept so nothing is silently dropped.
* D2 Eqs. 4–5: the mean over tokens of the cosine similarity between every pair of layers'
  decoder outputs (S_L) and MLP inputs (S_M, the post-norm tensor the MLP receives), computed
  as ``Σ_t <x̂_l,t, x̂_m,t>`` = one ``[L, N·d] @ [N·d, L]`` product per batch.
* MI Eq. 1: the second moment ``XᵀX`` of each layer's MLP input, each batch's product in
  float32 summed in float64, with the token count, so a whitening matrix can later be built for
  any calibration set.
* Per neuron, its ``top_tokens`` top-activating tokens: the K calibration tokens with the largest
  ``|h_i|`` (h of CM Eq. 1, the down projection's input, never the normalised variant), kept as
  a running ``[d_ffn, K]`` top-K of signed values and global token indices (token index =
  first token of the sample + position), so a neuron page can show the text it fires on. A
  token whose whole prefix repeats a prefix of another sample (the same opening words, a
  shared template) has exactly the activation of that one and is counted once: in the
  sample whose token ids sort first (``repeated_prefix``). Ties and near-ties would otherwise
  fill a neuron's list with copies of one context.

Padding never enters a statistic: every hook selects the attention-mask positions first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..data.calibration import CalibrationSet
from ..limits import atopk_problem
from ..models import ModelAdapter
from ..progress import NO_PROGRESS, Progress
# Declared in a module without torch (the API generates its request body from them), used and re-exported here.
from .settings import GroupBy, ProfileError, ProfileSettings


@dataclass
class LayerStats:
    """Finished statistics of one layer (numpy, CPU)."""

    sample_means: np.ndarray  # [M, d_ffn] float32, EW A_ℓ (rows in calibration-set order)
    group_means: np.ndarray  # [G, d_ffn] float32
    mean: np.ndarray  # [d_ffn] μ_j over groups
    std: np.ndarray  # [d_ffn] σ_j over groups
    cv: np.ndarray  # [d_ffn]
    rate: np.ndarray  # [d_ffn] ATopK activation rate over all tokens
    atopk_indices: np.ndarray  # [T_s, K_a] int16/int32, sorted per row
    h_hist: np.ndarray  # [bins] int64
    h_hist_edges: np.ndarray  # [bins + 1] float32
    h_outside: np.ndarray  # [2] int64: counts below -R and above R
    xtx: np.ndarray | None  # [d_model, d_model] float64
    top_value: np.ndarray | None = None  # [d_ffn, K] float32 signed h of each neuron's top tokens, |h| descending
    top_token: np.ndarray | None = None  # [d_ffn, K] int64 global token index (-1: fewer than K distinct tokens)


@dataclass
class ProfileResult:
    settings: ProfileSettings
    model: dict[str, Any]
    calibration: dict[str, Any]
    group_basis: str
    groups: list[str]
    sample_group: np.ndarray  # [M] int index into groups
    sample_tokens: np.ndarray  # [M] tokens per sample after truncation
    feature_token_index: np.ndarray  # [T_s, 2] (sample, position) of each stored marker row
    n_tokens: int
    layers: list[LayerStats]
    similarity_outputs: np.ndarray  # [L, L] S_L
    similarity_mlp_inputs: np.ndarray  # [L, L] S_M
    timings: dict[str, float] = field(default_factory=dict)
    token_ids: np.ndarray | None = None  # [n_tokens] int32, every sample's token ids back to back
    token_pieces: np.ndarray | None = None  # [n_tokens] str, the text each token decodes to
    token_repeated: np.ndarray | None = None  # [n_tokens] bool, ``repeated_prefix``


# --------------------------------------------------------------------------- helpers


def _groups(cset: CalibrationSet, group_by: GroupBy) -> tuple[str, list[str], np.ndarray]:
    """Which groups the CV is computed across (EW Eq. 3: tasks), and each sample's group."""
    basis = group_by
    if basis == "auto":
        basis = "task" if len(cset.tasks()) >= 2 else "sample"
    if basis == "sample":
        return "sample", [str(i) for i in range(len(cset.samples))], np.arange(len(cset.samples))
    labels = [getattr(s, basis) for s in cset.samples]
    if any(lab is None for lab in labels):
        raise ProfileError(f"group_by={basis!r} but some samples have no {basis}; use group_by=sample")
    names = sorted(set(labels))
    if len(names) < 2:
        raise ProfileError(f"group_by={basis!r} needs at least 2 distinct {basis}s, found {names}")
    index = {n: i for i, n in enumerate(names)}
    return basis, names, np.array([index[lab] for lab in labels])


def length_sorted_batches(lengths: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Length-sorted batches under a padded-token budget (less padding, deterministic)."""
    order = np.argsort(-lengths, kind="stable")
    batches, start = [], 0
    while start < len(order):
        size = max(1, batch_tokens // int(lengths[order[start]]))
        batches.append(order[start : start + size])
        start += size
    return batches


def _index_dtype(d_ffn: int) -> torch.dtype:
    return torch.int16 if d_ffn <= torch.iinfo(torch.int16).max else torch.int32


def check_atopk(s: ProfileSettings, d_ffn: list[int]) -> None:
    """ATopK's K_a marks K neurons per token: more than the narrowest layer has is refused
    (``ProfileError``), not clamped, so the manifest's ``atopk_k`` is what every layer used."""
    problem = atopk_problem(s.atopk_k, d_ffn)
    if problem:
        raise ProfileError(problem)


class _LayerAccumulator:
    """Running sums for one layer; the hooks feed it masked, flattened tensors."""

    def __init__(self, n_samples: int, d_ffn: int, d_model: int, s: ProfileSettings, device: torch.device) -> None:
        self.sample_means = torch.zeros(n_samples, d_ffn, device=device)
        self.rate_counts = torch.zeros(d_ffn, dtype=torch.int64, device=device)
        self.markers: list[torch.Tensor] = []
        self.hist = torch.zeros(s.hist_bins, dtype=torch.int64, device=device)
        self.outside = torch.zeros(2, dtype=torch.int64, device=device)
        self.hist_range: float | None = None
        self.xtx = (
            torch.zeros(d_model, d_model, dtype=torch.float64, device=device) if s.second_moment else None
        )
        check_atopk(s, [d_ffn])
        self.k = s.atopk_k
        self.bins = s.hist_bins
        self.index_dtype = _index_dtype(d_ffn)
        # Running top-K of |h| per neuron: score (|h|, -inf for a repeated prefix), signed h, token index.
        self.top_k = s.top_tokens
        self.top_score = torch.empty(d_ffn, 0, device=device)
        self.top_value = torch.empty(d_ffn, 0, device=device)
        self.top_token = torch.empty(d_ffn, 0, dtype=torch.int64, device=device)

    def add_top(self, h: torch.Tensor, token: torch.Tensor, repeated: torch.Tensor) -> None:
        """Merge the batch into every neuron's top-K tokens by |h| (h: CM Eq. 1) in two ``topk`` calls.

        h: [N, d_ffn] float32; token: [N] int64 global token index; repeated: [N] bool (never kept).
        """
        if self.top_k == 0:
            return
        score = h.abs()
        if repeated.any():
            score = score.masked_fill(repeated[:, None], float("-inf"))
        best = score.topk(min(self.top_k, h.shape[0]), dim=0)  # [k, d_ffn] over the batch's tokens
        score = torch.cat([self.top_score, best.values.T], dim=1)
        value = torch.cat([self.top_value, h.gather(0, best.indices).T], dim=1)
        tok = torch.cat([self.top_token, token[best.indices].T], dim=1)
        keep = score.topk(min(self.top_k, score.shape[1]), dim=1).indices  # [d_ffn, K] with the running list
        self.top_score, self.top_value, self.top_token = score.gather(1, keep), value.gather(1, keep), tok.gather(1, keep)

    def add_h(self, h: torch.Tensor, keep: torch.Tensor) -> None:
        """h: [N, d_ffn] float32 for the batch's real tokens; keep: [N] bool feature rows."""
        top = h.abs().topk(self.k, dim=1).indices  # CM Eq. 4
        self.rate_counts += torch.bincount(top.flatten(), minlength=h.shape[1])
        if keep.any():
            self.markers.append(top[keep].sort(dim=1).values.to(self.index_dtype))
        if self.hist_range is None:
            self.hist_range = float(h.abs().max().clamp_min(1e-12))
        r = self.hist_range
        self.hist += torch.histc(h, bins=self.bins, min=-r, max=r).to(torch.int64)
        self.outside[0] += torch.count_nonzero(h < -r)
        self.outside[1] += torch.count_nonzero(h > r)


# --------------------------------------------------------------------------- the pass


@dataclass
class _PassInputs:
    """Everything a pass needs before a layer runs: tokens, groups, the feature sample, batches.

    Shared by the in-memory pass below and the layer-streamed one (``streaming.profile``), so both
    see the same batches in the same order and keep the same marker rows.
    """

    ids: list[torch.Tensor]
    lengths: np.ndarray  # [M] tokens per sample
    n_tokens: int
    basis: str
    group_names: list[str]
    sample_group: np.ndarray
    keep_flags: np.ndarray  # [n_tokens] bool: the token keeps its ATopK marker row
    offsets: np.ndarray  # [M] first token of each sample in keep_flags
    batches: list[np.ndarray]
    pad_id: int
    repeated: np.ndarray  # [n_tokens] bool, ``repeated_prefix``: left out of the top tokens


def repeated_prefix(ids: list[np.ndarray], offsets: np.ndarray, n_tokens: int) -> np.ndarray:
    """[n_tokens] bool: the token's whole prefix (its sample's tokens up to and including it) is
    also a prefix of a sample whose token ids sort before this one's (ties: the lower index).

    In a causal model such a token has exactly the activations of that one, so each repeated
    context is counted once among a neuron's top tokens. Samples sharing a prefix are adjacent
    in sorted order, so each sample is compared with its sorted predecessor only (a loop over
    samples; the comparison itself is vectorised).
    """
    order = sorted(range(len(ids)), key=lambda i: (ids[i].tolist(), i))
    repeated = np.zeros(n_tokens, dtype=bool)
    for prev, cur in zip(order, order[1:]):
        a, b = ids[prev], ids[cur]
        n = min(len(a), len(b))
        differ = np.flatnonzero(a[:n] != b[:n])
        common = int(differ[0]) if differ.size else n
        repeated[offsets[cur] : offsets[cur] + common] = True
    return repeated


def token_pieces(tokenizer: Any, token_ids: np.ndarray) -> np.ndarray:
    """The text each token decodes to, for showing snippets without a tokenizer: one decode per
    distinct id. SentencePiece tokens that start a word (``▁the``) decode alone without their
    space, so it is put back."""
    uniq, inverse = np.unique(np.asarray(token_ids), return_inverse=True)
    texts = tokenizer.batch_decode(uniq[:, None].tolist())
    raw = tokenizer.convert_ids_to_tokens(uniq.tolist())
    texts = [" " + t if str(r).startswith("▁") and not t.startswith(" ") else t for t, r in zip(texts, raw, strict=True)]
    return np.asarray(texts, dtype=object)[inverse.reshape(-1)]


def start_pass(tokenizer: Any, cset: CalibrationSet, settings: ProfileSettings | None,
               ) -> tuple[ProfileSettings, _PassInputs, dict[str, float]]:
    """What both passes (in memory, streamed) do first: check the settings and the set, tokenise."""
    s = settings or ProfileSettings()
    s.validate()
    if not cset.samples:
        raise ProfileError(f"calibration set {cset.name!r} has no samples")
    t0 = time.perf_counter()
    p = _prepare_pass(tokenizer, cset, s)
    return s, p, {"tokenize_s": time.perf_counter() - t0}


def _prepare_pass(tokenizer: Any, cset: CalibrationSet, s: ProfileSettings) -> _PassInputs:
    basis, group_names, sample_group = _groups(cset, s.group_by)
    enc = tokenizer([x.text for x in cset.samples], truncation=True, max_length=s.max_tokens)
    ids = [torch.tensor(e, dtype=torch.long) for e in enc["input_ids"]]
    lengths = np.array([len(e) for e in ids])
    if (lengths == 0).any():
        raise ProfileError(f"sample {int(np.argmin(lengths))} tokenises to nothing")
    n_tokens = int(lengths.sum())
    # Seeded uniform choice of which tokens keep their ATopK marker rows (the feature sample).
    rng = np.random.default_rng(s.seed)
    n_keep = min(s.feature_tokens, n_tokens)
    chosen = np.sort(rng.choice(n_tokens, size=n_keep, replace=False))
    keep_flags = np.zeros(n_tokens, dtype=bool)
    keep_flags[chosen] = True
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    repeated = repeated_prefix([e.numpy() for e in ids], offsets, n_tokens) if s.top_tokens else np.zeros(n_tokens, dtype=bool)
    return _PassInputs(ids, lengths, n_tokens, basis, group_names, sample_group, keep_flags, offsets,
                       length_sorted_batches(lengths, s.batch_tokens), pad_id, repeated)


def _batch_tensors(p: _PassInputs, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, mask, keep) of one batch, each [B, width], on the CPU."""
    width = int(p.lengths[rows].max())
    input_ids = torch.full((len(rows), width), p.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    keep = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, sample in enumerate(rows):  # per-sample copy into the batch, not per token
        n = p.lengths[sample]
        input_ids[r, :n] = p.ids[sample]
        mask[r, :n] = True
        keep[r, :n] = torch.from_numpy(p.keep_flags[p.offsets[sample] : p.offsets[sample] + n])
    return input_ids, mask, keep


def _batch_state(p: _PassInputs, rows: np.ndarray, mask: torch.Tensor, keep: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """What the hooks read about the batch in flight (``out_buf``/``mlp_buf`` are set by the caller).

    ``token``: the global token index (sample's first token + position) of each real token, in
    the order ``_flat`` puts them; ``repeated``: whether that token is left out of the top tokens.
    """
    token = torch.from_numpy(p.offsets[rows])[:, None] + torch.arange(mask.shape[1])[None, :]
    token = token[mask]
    return dict(
        dense=bool(mask.all()),
        mask=mask.to(device),
        mask_f=mask.to(device).float(),
        rows=torch.from_numpy(rows).to(device),
        lengths=torch.from_numpy(p.lengths[rows]).float().to(device),
        keep=keep[mask].to(device),
        token=token.to(device),
        repeated=torch.from_numpy(p.repeated[token.numpy()]).to(device),
    )


def _feature_rows(rows: np.ndarray, keep: torch.Tensor) -> np.ndarray:
    """(sample, position) of the batch's tokens that keep marker rows, in the hooks' order."""
    sel = keep.nonzero()
    return np.stack([rows[sel[:, 0].numpy()], sel[:, 1].numpy()], axis=1)


def _flat(state: dict[str, Any], t: torch.Tensor) -> torch.Tensor:
    # Real tokens only, as [N, width]; a batch without padding needs no gather.
    t = t.reshape(-1, t.shape[-1]) if state["dense"] else t[state["mask"]]
    return t.float()


def _layer_hooks(i: int, lay: Any, acc: _LayerAccumulator, state: dict[str, Any], s: ProfileSettings) -> list[Any]:
    """Register layer ``i``'s statistic hooks; they read the batch from ``state`` and write
    the unit-norm MLP inputs / decoder outputs into ``state["mlp_buf"][i]`` / ``state["out_buf"][i]``."""

    def on_mlp_input(_m, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        xf = _flat(state, x)
        F.normalize(xf, dim=-1, out=state["mlp_buf"][i])
        if acc.xtx is not None:
            # MI Eq. 1: each batch's product in float32 (a batch sums ≤ batch_tokens terms; float64
            # matmuls are several times slower, and on GPUs much more), the running sum in float64.
            acc.xtx += (xf.T @ xf).double()
        if s.atopk_normalized:
            acc.add_h(_normalized_h(lay, xf), state["keep"])

    def on_act_output(_m, _args, out):
        # Signed token mean of act(x W_gate) per sample (EW §3.1); the masked sum is a bmm.
        sums = torch.bmm(state["mask_f"][:, None, :], out.float()).squeeze(1)
        acc.sample_means[state["rows"]] = sums / state["lengths"][:, None]

    def on_down_input(_m, args):
        h = _flat(state, args[0])  # CM Eq. 1 h, the neurons' activations
        if not s.atopk_normalized:
            acc.add_h(h, state["keep"])
        acc.add_top(h, state["token"], state["repeated"])

    def on_block_output(_m, _args, out):
        hs = out[0] if isinstance(out, tuple) else out
        F.normalize(_flat(state, hs), dim=-1, out=state["out_buf"][i])

    return [
        lay.mlp.register_forward_pre_hook(on_mlp_input, with_kwargs=True),
        lay.act_fn.register_forward_hook(on_act_output),
        lay.down_proj.register_forward_pre_hook(on_down_input),
        lay.block.register_forward_hook(on_block_output),
    ]


def _assemble(
    model: dict[str, Any], cset: CalibrationSet, s: ProfileSettings, p: _PassInputs, layers: list[LayerStats],
    sim_out: torch.Tensor, sim_mlp: torch.Tensor, feature_rows: list[np.ndarray], timings: dict[str, float],
    tokenizer: Any,
) -> ProfileResult:
    return ProfileResult(
        settings=s,
        model=model,
        calibration={"id": cset.id, "name": cset.name, "source": cset.source, "n_samples": len(cset.samples)},
        group_basis=p.basis,
        groups=p.group_names,
        sample_group=p.sample_group,
        sample_tokens=p.lengths,
        feature_token_index=np.concatenate(feature_rows).astype(np.int32),
        n_tokens=p.n_tokens,
        layers=layers,
        similarity_outputs=_finish_similarity(sim_out, p.n_tokens),
        similarity_mlp_inputs=_finish_similarity(sim_mlp, p.n_tokens),
        timings=timings,
        token_ids=torch.cat(p.ids).numpy().astype(np.int32),
        token_pieces=token_pieces(tokenizer, torch.cat(p.ids).numpy()) if s.top_tokens else None,
        token_repeated=p.repeated,
    )


def profile_model(
    adapter: ModelAdapter,
    cset: CalibrationSet,
    settings: ProfileSettings | None = None,
    progress: Progress = NO_PROGRESS,
) -> ProfileResult:
    """Run the calibration set through the model once and return every statistic."""
    check_atopk(settings or ProfileSettings(), [lay.d_ffn for lay in adapter.layers])  # before anything is tokenised
    s, p, timings = start_pass(adapter.tokenizer, cset, settings)

    n_layers, d_model = adapter.n_layers, adapter.d_model
    device = adapter.device
    accs = [_LayerAccumulator(len(p.ids), lay.d_ffn, d_model, s, device) for lay in adapter.layers]
    sim_out = torch.zeros(n_layers, n_layers, dtype=torch.float64)
    sim_mlp = torch.zeros(n_layers, n_layers, dtype=torch.float64)
    feature_rows: list[np.ndarray] = []

    # Per-batch state the hooks read: mask, sample rows, which tokens keep markers, and the
    # unit-norm decoder outputs / MLP inputs of every layer (for S_L and S_M).
    state: dict[str, Any] = {}
    handles = [h for i, lay in enumerate(adapter.layers) for h in _layer_hooks(i, lay, accs[i], state, s)]
    decoder = adapter.decoder()
    t1 = time.perf_counter()
    try:
        progress.update("profile", 0, len(p.batches))
        with torch.inference_mode():
            for b, rows in enumerate(p.batches):
                input_ids, mask, keep = _batch_tensors(p, rows)
                n_real = int(mask.sum())
                state.update(
                    _batch_state(p, rows, mask, keep, device),
                    out_buf=torch.empty(n_layers, n_real, d_model, device=device),
                    mlp_buf=torch.empty(n_layers, n_real, d_model, device=device),
                )
                decoder(input_ids=input_ids.to(device), attention_mask=mask.long().to(device), use_cache=False)
                # D2 Eqs. 4-5: Σ_t cos(x_l,t, x_m,t) for every layer pair in one matmul.
                for buf, total in ((state["out_buf"], sim_out), (state["mlp_buf"], sim_mlp)):
                    flat_layers = buf.reshape(n_layers, -1)
                    total += (flat_layers @ flat_layers.T).double().cpu()
                feature_rows.append(_feature_rows(rows, keep))
                progress.update("profile", b + 1, len(p.batches))
    finally:
        for h in handles:
            h.remove()
    timings["forward_s"] = time.perf_counter() - t1

    layers = [_finish_layer(acc, p.sample_group, len(p.group_names), p.n_tokens, s) for acc in accs]
    timings["finish_s"] = time.perf_counter() - t1 - timings["forward_s"]
    return _assemble(adapter.describe(), cset, s, p, layers, sim_out, sim_mlp, feature_rows, timings, adapter.tokenizer)


def _normalized_h(lay, x: torch.Tensor) -> torch.Tensor:
    """CMoE's normalised hidden state: unit-norm tokens and unit-norm W_gate/W_up columns."""
    xn = F.normalize(x, dim=-1)
    wg = F.normalize(lay.gate_weight().float(), dim=1)
    wu = F.normalize(lay.up_weight().float(), dim=1)
    # .forward bypasses our own hook on the activation module (this is not the model's call).
    return lay.act_fn.forward(xn @ wg.T) * (xn @ wu.T)


def _finish_similarity(total: torch.Tensor, n_tokens: int) -> np.ndarray:
    sim = (total / n_tokens).numpy()
    sim = (sim + sim.T) / 2  # exact symmetry; the two triangles differ only by rounding
    np.fill_diagonal(sim, 1.0)  # cos(x, x) = 1 by definition
    return sim.astype(np.float32)


def _finish_layer(acc: _LayerAccumulator, group: np.ndarray, n_groups: int, n_tokens: int, s: ProfileSettings) -> LayerStats:
    a = acc.sample_means.cpu().numpy()
    onehot = np.zeros((n_groups, len(group)), dtype=np.float64)
    onehot[group, np.arange(len(group))] = 1.0
    gmeans = (onehot @ a.astype(np.float64)) / onehot.sum(1, keepdims=True)  # ā_{j,t}
    mu = gmeans.mean(0)
    sigma = gmeans.std(0)
    cv = sigma / (np.abs(mu) + s.cv_eps)  # EW Eq. 3 on signed group means
    markers = torch.cat(acc.markers).cpu() if acc.markers else torch.zeros(0, acc.k, dtype=acc.index_dtype)
    r = acc.hist_range or 1.0
    top_value = top_token = None
    if acc.top_k:
        # Pad to K when the set has fewer tokens; a slot without a distinct token says so with index -1.
        missing = acc.top_k - acc.top_score.shape[1]
        score = F.pad(acc.top_score, (0, missing), value=float("-inf")).cpu()
        empty = torch.isneginf(score)
        top_value = F.pad(acc.top_value, (0, missing)).cpu().masked_fill(empty, 0.0).numpy().astype(np.float32)
        top_token = F.pad(acc.top_token, (0, missing)).cpu().masked_fill(empty, -1).numpy().astype(np.int64)
    return LayerStats(
        sample_means=a.astype(np.float32),
        group_means=gmeans.astype(np.float32),
        mean=mu.astype(np.float32),
        std=sigma.astype(np.float32),
        cv=cv.astype(np.float32),
        rate=(acc.rate_counts.double() / n_tokens).cpu().numpy().astype(np.float32),
        atopk_indices=markers.numpy(),
        h_hist=acc.hist.cpu().numpy(),
        h_hist_edges=np.linspace(-r, r, acc.bins + 1, dtype=np.float32),
        h_outside=acc.outside.cpu().numpy(),
        xtx=None if acc.xtx is None else acc.xtx.cpu().numpy(),
        top_value=top_value,
        top_token=top_token,
    )
