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
* MI Eq. 1: the second moment ``XᵀX`` of each layer's MLP input, accumulated in float64, with
  the token count, so a whitening matrix can later be built for any calibration set.

Padding never enters a statistic: every hook selects the attention-mask positions first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from ..data.calibration import CalibrationSet
from ..models import ModelAdapter
from ..progress import NO_PROGRESS, Progress

GroupBy = Literal["auto", "task", "domain", "sample"]


@dataclass
class ProfileSettings:
    """Everything that changes a profile's numbers; stored verbatim in its manifest."""

    max_tokens: int = 256
    batch_tokens: int = 2048
    atopk_k: int = 10  # K_a; CM §4 uses 10 ("counter-intuitive but works best")
    atopk_normalized: bool = False
    feature_tokens: int = 16384  # bound on tokens whose ATopK markers are kept
    hist_bins: int = 201
    group_by: GroupBy = "auto"
    cv_eps: float = 1e-6
    second_moment: bool = True
    seed: int = 0

    def validate(self) -> None:
        checks = [
            (self.max_tokens >= 2, "max_tokens must be at least 2"),
            (self.batch_tokens >= self.max_tokens, "batch_tokens must be ≥ max_tokens"),
            (self.atopk_k >= 1, "atopk_k (K_a) must be ≥ 1"),
            (self.feature_tokens >= 1, "feature_tokens must be ≥ 1"),
            (self.hist_bins >= 2, "hist_bins must be ≥ 2"),
            (self.cv_eps > 0, "cv_eps must be > 0"),
            (self.group_by in ("auto", "task", "domain", "sample"), "group_by: auto|task|domain|sample"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


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


class ProfileError(ValueError):
    pass


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
        self.k = min(s.atopk_k, d_ffn)
        self.bins = s.hist_bins
        self.index_dtype = _index_dtype(d_ffn)

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


def profile_model(
    adapter: ModelAdapter,
    cset: CalibrationSet,
    settings: ProfileSettings | None = None,
    progress: Progress = NO_PROGRESS,
) -> ProfileResult:
    """Run the calibration set through the model once and return every statistic."""
    s = settings or ProfileSettings()
    s.validate()
    if not cset.samples:
        raise ProfileError(f"calibration set {cset.name!r} has no samples")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    basis, group_names, sample_group = _groups(cset, s.group_by)

    tok = adapter.tokenizer
    enc = tok([x.text for x in cset.samples], truncation=True, max_length=s.max_tokens)
    ids = [torch.tensor(e, dtype=torch.long) for e in enc["input_ids"]]
    lengths = np.array([len(e) for e in ids])
    if (lengths == 0).any():
        raise ProfileError(f"sample {int(np.argmin(lengths))} tokenises to nothing")
    n_tokens = int(lengths.sum())
    timings["tokenize_s"] = time.perf_counter() - t0

    # Seeded uniform choice of which tokens keep their ATopK marker rows (the feature sample).
    rng = np.random.default_rng(s.seed)
    n_keep = min(s.feature_tokens, n_tokens)
    chosen = np.sort(rng.choice(n_tokens, size=n_keep, replace=False))
    keep_flags = np.zeros(n_tokens, dtype=bool)
    keep_flags[chosen] = True
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])

    n_layers, d_model = adapter.n_layers, adapter.d_model
    device = adapter.device
    accs = [_LayerAccumulator(len(ids), lay.d_ffn, d_model, s, device) for lay in adapter.layers]
    sim_out = torch.zeros(n_layers, n_layers, dtype=torch.float64)
    sim_mlp = torch.zeros(n_layers, n_layers, dtype=torch.float64)
    feature_rows: list[np.ndarray] = []

    # Per-batch state the hooks read: mask, sample rows, which tokens keep markers, and the
    # unit-norm decoder outputs / MLP inputs of every layer (for S_L and S_M).
    state: dict[str, Any] = {}

    def flat(t: torch.Tensor) -> torch.Tensor:
        # Real tokens only, as [N, width]; a batch without padding needs no gather.
        t = t.reshape(-1, t.shape[-1]) if state["dense"] else t[state["mask"]]
        return t.float()

    def make_hooks(i: int):
        acc, lay = accs[i], adapter.layers[i]

        def on_mlp_input(_m, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            xf = flat(x)
            F.normalize(xf, dim=-1, out=state["mlp_buf"][i])
            if acc.xtx is not None:
                xd = xf.double()
                acc.xtx += xd.T @ xd  # MI Eq. 1
            if s.atopk_normalized:
                acc.add_h(_normalized_h(lay, xf), state["keep"])

        def on_act_output(_m, _args, out):
            # Signed token mean of act(x W_gate) per sample (EW §3.1); the masked sum is a bmm.
            sums = torch.bmm(state["mask_f"][:, None, :], out.float()).squeeze(1)
            acc.sample_means[state["rows"]] = sums / state["lengths"][:, None]

        def on_down_input(_m, args):
            if not s.atopk_normalized:
                acc.add_h(flat(args[0]), state["keep"])

        def on_block_output(_m, _args, out):
            hs = out[0] if isinstance(out, tuple) else out
            F.normalize(flat(hs), dim=-1, out=state["out_buf"][i])

        return [
            lay.mlp.register_forward_pre_hook(on_mlp_input, with_kwargs=True),
            lay.act_fn.register_forward_hook(on_act_output),
            lay.down_proj.register_forward_pre_hook(on_down_input),
            lay.block.register_forward_hook(on_block_output),
        ]

    handles = [h for i in range(n_layers) for h in make_hooks(i)]
    batches = length_sorted_batches(lengths, s.batch_tokens)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    decoder = adapter.decoder()
    t1 = time.perf_counter()
    try:
        progress.update("profile", 0, len(batches))
        with torch.inference_mode():
            for b, rows in enumerate(batches):
                width = int(lengths[rows].max())
                input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
                mask = torch.zeros(len(rows), width, dtype=torch.bool)
                keep = torch.zeros(len(rows), width, dtype=torch.bool)
                for r, sample in enumerate(rows):  # per-sample copy into the batch, not per token
                    n = lengths[sample]
                    input_ids[r, :n] = ids[sample]
                    mask[r, :n] = True
                    keep[r, :n] = torch.from_numpy(keep_flags[offsets[sample] : offsets[sample] + n])
                n_real = int(mask.sum())
                state.update(
                    out_buf=torch.empty(n_layers, n_real, d_model, device=device),
                    mlp_buf=torch.empty(n_layers, n_real, d_model, device=device),
                    dense=n_real == mask.numel(),
                    mask=mask.to(device),
                    mask_f=mask.to(device).float(),
                    rows=torch.from_numpy(rows).to(device),
                    lengths=torch.from_numpy(lengths[rows]).float().to(device),
                    keep=keep[mask].to(device),
                )
                decoder(input_ids=input_ids.to(device), attention_mask=mask.long().to(device), use_cache=False)
                # D2 Eqs. 4-5: Σ_t cos(x_l,t, x_m,t) for every layer pair in one matmul.
                for buf, total in ((state["out_buf"], sim_out), (state["mlp_buf"], sim_mlp)):
                    flat_layers = buf.reshape(n_layers, -1)
                    total += (flat_layers @ flat_layers.T).double().cpu()
                sel = keep.nonzero()
                feature_rows.append(np.stack([rows[sel[:, 0].numpy()], sel[:, 1].numpy()], axis=1))
                progress.update("profile", b + 1, len(batches))
    finally:
        for h in handles:
            h.remove()
    timings["forward_s"] = time.perf_counter() - t1

    layers = [_finish_layer(acc, sample_group, len(group_names), n_tokens, s) for acc in accs]
    timings["finish_s"] = time.perf_counter() - t1 - timings["forward_s"]
    return ProfileResult(
        settings=s,
        model=adapter.describe(),
        calibration={"id": cset.id, "name": cset.name, "source": cset.source, "n_samples": len(cset.samples)},
        group_basis=basis,
        groups=group_names,
        sample_group=sample_group,
        sample_tokens=lengths,
        feature_token_index=np.concatenate(feature_rows).astype(np.int32),
        n_tokens=n_tokens,
        layers=layers,
        similarity_outputs=_finish_similarity(sim_out, n_tokens),
        similarity_mlp_inputs=_finish_similarity(sim_mlp, n_tokens),
        timings=timings,
    )


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
    )
