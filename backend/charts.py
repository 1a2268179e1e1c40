"""Chart-ready JSON from stored artifacts: numpy only, no model, no torch work.

Each function takes arrays already read from a profile or an evaluation and returns a plain
dict the UI plots as is. Sizes are bounded here (bins chosen server-side, big neuron maps
averaged into tiles), and every payload that was reduced says so (``aggregated``, ``note``),
because a heatmap that silently averages 8 neurons per pixel misleads.
No Python loop runs over neurons or tokens: loops are over layers at most.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from moelab.store.jsonsafe import finite_list

Order = Literal["index", "cv", "task"]
Normalize = Literal["none", "neuron", "zscore"]


def _layer_index(sizes: Sequence[int]) -> np.ndarray:
    return np.repeat(np.arange(len(sizes)), sizes)


# --------------------------------------------------------------------------- CV (EW Eq. 3, Fig. 2)


def choose_bins(values: np.ndarray, lo: float, hi: float, lo_bins: int = 10, hi_bins: int = 80) -> int:
    """Freedman–Diaconis bin count on ``[lo, hi]``, kept within ``[lo_bins, hi_bins]``."""
    inside = values[(values >= lo) & (values <= hi)]
    if inside.size < 2 or hi <= lo:
        return lo_bins
    q75, q25 = np.percentile(inside, [75, 25])
    width = 2 * (q75 - q25) / np.cbrt(inside.size)
    if width <= 0:
        return lo_bins
    return int(np.clip(math.ceil((hi - lo) / width), lo_bins, hi_bins))


def cv_histograms(cv_by_layer: Sequence[np.ndarray], bins: int | None = None, clip_quantile: float = 0.99,
                  scale: str = "log") -> dict[str, Any]:
    """Per-layer CV histograms on shared edges, so layers are comparable side by side.

    CV is heavy-tailed (a neuron whose mean is near zero has a huge CV), so the range is cut at
    the ``clip_quantile`` of all neurons and what lies above is counted in ``overflow``.
    ``scale="log"`` (the default) spaces the edges geometrically from the smallest positive CV:
    on the default model CVs run from ~0.1 to ~40, and equal-width bins put most neurons of a
    layer in the first two of 80 bins. CVs of zero or below (a log scale cannot place them) are
    counted in ``underflow``; on a linear scale the range starts at min(0, smallest CV) and
    ``underflow`` is all zeros.
    """
    if scale not in ("linear", "log"):
        raise ValueError(f"scale must be 'linear' or 'log', not {scale!r}")
    sizes = [len(c) for c in cv_by_layer]
    values = np.concatenate([np.asarray(c, dtype=np.float64) for c in cv_by_layer])
    finite = np.isfinite(values)
    fv = values[finite]
    if fv.size == 0:
        raise ValueError("no finite CV value in this profile")
    positive = fv[fv > 0]
    if scale == "log" and positive.size == 0:
        scale = "linear"  # nothing a log axis can show
    hi = float(np.quantile(fv, clip_quantile))
    if scale == "log":
        lo = float(positive.min())
        if hi <= lo:
            hi = float(positive.max()) if positive.max() > lo else lo * 10
        n_bins = bins or choose_bins(np.log10(positive), math.log10(lo), math.log10(hi))
        edges = np.geomspace(lo, hi, n_bins + 1)
        edges[0], edges[-1] = lo, hi  # exact ends: geomspace's float error must not drop the extremes
    else:
        lo = float(min(0.0, fv.min()))
        if hi <= lo:
            hi = float(fv.max()) if fv.max() > lo else lo + 1.0
        n_bins = bins or choose_bins(fv, lo, hi)
        edges = np.linspace(lo, hi, n_bins + 1)
    layer = _layer_index(sizes)
    # bin n_bins = overflow, n_bins + 1 = not finite, n_bins + 2 = below the first edge (log: CV ≤ 0)
    idx = np.clip(np.searchsorted(edges, values, side="right") - 1, 0, n_bins - 1)
    idx = np.where(values > hi, n_bins, idx)
    idx = np.where(values < lo, n_bins + 2, idx)
    idx = np.where(finite, idx, n_bins + 1)
    width = n_bins + 3
    counts = np.bincount(layer * width + idx, minlength=len(sizes) * width).reshape(len(sizes), width)
    spacing = "log-spaced" if scale == "log" else "equal-width"
    return {
        "edges": finite_list(edges, 12),  # log edges start near the smallest CV: 6 decimals would move them
        "layers": list(range(len(sizes))),
        "counts": counts[:, :n_bins].tolist(),
        "overflow": counts[:, n_bins].tolist(),
        "not_finite": counts[:, n_bins + 1].tolist(),
        "underflow": counts[:, n_bins + 2].tolist(),
        "n_neurons": sizes,
        "bins": n_bins,
        "scale": scale,
        "clipped_at": hi,
        "note": (
            f"{n_bins} {spacing} bins shared by all layers ({'requested' if bins else 'Freedman–Diaconis'}"
            f"{' on log CV' if scale == 'log' else ''}); range cut at the {clip_quantile:.0%} quantile of all neurons' "
            f"CV ({hi:.3g}); larger values are counted in 'overflow'"
            + ("; CVs ≤ 0 in 'underflow'" if scale == "log" else "")
        ),
    }


QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


@dataclass(frozen=True)
class CVStats:
    """What the CV summary needs of a profile, independent of τ: computed once per opened profile
    (the τ slider asks again on every move; sorting once makes each r_ℓ a binary search)."""

    sorted_cv: list[np.ndarray]  # per layer: the finite CVs, ascending
    quantiles: np.ndarray  # [layer][QUANTILES]
    means: np.ndarray  # [layer]


def cv_stats(cv_by_layer: Sequence[np.ndarray]) -> CVStats:
    sorted_cv, qs, means = [], [], []
    for cv in cv_by_layer:
        cv = np.asarray(cv, dtype=np.float64)
        cv = np.sort(cv[np.isfinite(cv)])
        sorted_cv.append(cv)
        qs.append(np.quantile(cv, QUANTILES) if cv.size else np.full(len(QUANTILES), np.nan))
        means.append(cv.mean() if cv.size else np.nan)
    return CVStats(sorted_cv, np.array(qs).reshape(len(sorted_cv), len(QUANTILES)), np.array(means))


def cv_summary(cv_by_layer: Sequence[np.ndarray] | CVStats, tau: float | None = None) -> dict[str, Any]:
    """Per-layer CV quantiles and mean (EW Fig. 2), and r_ℓ = share of neurons with CV > τ (EW Eq. 4)."""
    stats = cv_by_layer if isinstance(cv_by_layer, CVStats) else cv_stats(cv_by_layer)
    q = stats.quantiles
    out: dict[str, Any] = {
        "layers": list(range(len(stats.sorted_cv))),
        "quantiles": list(QUANTILES),
        "values": finite_list(q),  # [layer][quantile]
        "mean": finite_list(stats.means),
        "median": finite_list(q[:, QUANTILES.index(0.5)]),
        "tau": tau,
    }
    if tau is not None:
        out["specialisation_ratio"] = [
            float(1.0 - np.searchsorted(cv, tau, side="right") / cv.size) if cv.size else None for cv in stats.sorted_cv
        ]
    return out


# --------------------------------------------------------------------------- neuron × task tiles (EW Fig. 1)


def _bin_mean(a: np.ndarray, axis: int, size: int) -> np.ndarray:
    """Average consecutive groups of ``size`` entries along ``axis`` (the last group may be shorter)."""
    if size <= 1:
        return a
    a = np.moveaxis(a, axis, -1)
    n = a.shape[-1]
    pad = (-n) % size
    if pad:
        a = np.concatenate([a, np.full(a.shape[:-1] + (pad,), np.nan, dtype=a.dtype)], axis=-1)
    with np.errstate(invalid="ignore"):
        out = np.nanmean(a.reshape(a.shape[:-1] + (-1, size)), axis=-1)
    return np.moveaxis(out, -1, axis)


def neuron_order(values: np.ndarray, cv: np.ndarray, order: Order) -> np.ndarray:
    """Column order: natural, by CV (most specialised first) or by the row a neuron peaks on."""
    if order == "index":
        return np.arange(values.shape[1])
    if order == "cv":
        key = np.where(np.isfinite(cv), -cv, np.inf)
        return np.argsort(key, kind="stable")
    peak_row = np.argmax(values, axis=0)
    peak = values[peak_row, np.arange(values.shape[1])]
    return np.lexsort((-peak, peak_row))


def activation_tiles(
    values: np.ndarray, row_labels: Sequence[str], cv: np.ndarray, *, order: Order = "task",
    normalize: Normalize = "none", max_rows: int = 256, max_cols: int = 512,
) -> dict[str, Any]:
    """A rows × neurons activation map (rows = tasks/groups or samples), tiled when large.

    ``values`` are signed mean gate activations ``[rows, d_ffn]``. Columns are ordered first,
    then averaged in runs of ``ceil(d_ffn / max_cols)`` neurons, so a tile stands for
    neighbours in the chosen order (e.g. neurons peaking on the same task).
    """
    values = np.asarray(values, dtype=np.float64)
    n_rows, n_cols = values.shape
    cols = neuron_order(values, np.asarray(cv, dtype=np.float64), order)
    v = values[:, cols]
    if normalize == "neuron":
        scale = np.abs(v).max(axis=0, keepdims=True)
        v = v / np.where(scale > 0, scale, 1.0)
    elif normalize == "zscore":
        sd = v.std(axis=0, keepdims=True)
        v = (v - v.mean(axis=0, keepdims=True)) / np.where(sd > 0, sd, 1.0)
    col_size = max(1, math.ceil(n_cols / max_cols))
    row_size = max(1, math.ceil(n_rows / max_rows))
    tiles = _bin_mean(_bin_mean(v, 1, col_size), 0, row_size)
    labels = list(row_labels)
    if row_size > 1:
        labels = [f"{labels[i]} … ({i}–{min(i + row_size, n_rows) - 1})" for i in range(0, n_rows, row_size)]
    notes = []
    if col_size > 1:
        notes.append(f"each column is the mean of {col_size} consecutive neurons in '{order}' order ({n_cols} neurons)")
    if row_size > 1:
        notes.append(f"each row is the mean of {row_size} consecutive rows ({n_rows} rows)")
    return {
        "values": finite_list(tiles, 5),
        "rows": labels,
        "neuron_order": order,
        "normalize": normalize,
        "n_rows": n_rows,
        "n_neurons": n_cols,
        "neurons_per_column": col_size,
        "rows_per_row": row_size,
        "column_first_neuron": cols[::col_size].tolist(),
        "aggregated": col_size > 1 or row_size > 1,
        "note": "; ".join(notes) or "full resolution",
    }


# --------------------------------------------------------------------------- per-neuron rates and h values (CM Fig. 2)


def neuron_stats(rate: np.ndarray, h_counts: np.ndarray, h_edges: np.ndarray, h_outside: np.ndarray, bins: int = 50) -> dict[str, Any]:
    """Histogram of the layer's neurons' ATopK activation rates (CM Eq. 4 markers, CM Fig. 2)
    on ``bins`` equal bins of [0, max rate], and the stored token-level h-value histogram."""
    rate = np.asarray(rate, dtype=np.float64)
    hi = float(rate.max()) if rate.size and rate.max() > 0 else 1.0
    counts, edges = np.histogram(rate, bins=bins, range=(0.0, hi))
    outside = np.asarray(h_outside).tolist()
    return {
        "rate_edges": finite_list(edges),
        "rate_counts": counts.tolist(),
        "rate_mean": float(rate.mean()) if rate.size else None,
        "n_neurons": int(rate.size),
        "h_edges": finite_list(np.asarray(h_edges)),
        "h_counts": np.asarray(h_counts).astype(np.int64).tolist(),
        "h_below": int(outside[0]) if outside else 0,
        "h_above": int(outside[1]) if len(outside) > 1 else 0,
        "note": f"rates binned server-side into {bins} bins of [0, {hi:.3g}]; h values: the profile's token-level histogram",
    }


#: Tokens shown around a top-activating token: this many before it and after it.
SNIPPET_BEFORE, SNIPPET_AFTER = 12, 4


def top_token_snippets(values: np.ndarray, tokens: np.ndarray, table: Any, samples: Any,
                       before: int = SNIPPET_BEFORE, after: int = SNIPPET_AFTER) -> list[dict[str, Any]]:
    """One neuron's top-activating tokens (CM Eq. 1 h, largest |h| first) with their context.

    ``values``/``tokens``: the neuron's row of the profile's top-token arrays ([K] signed h,
    [K] global token index, -1 for an empty slot); ``table``: tokens.parquet (row i = token i);
    ``samples``: samples.parquet. Each snippet runs from ``before`` tokens before the top token
    to ``after`` tokens after it, inside its sample. Its tokens carry ``value`` = this neuron's h
    only where the profile knows it, i.e. at its top-K tokens (the one in the middle, and any
    other top token that falls in the window); every other token's value is ``None``: the
    profile does not keep all activations. A loop over the K tokens, never over a layer.
    """
    keep = np.asarray(tokens) >= 0
    values, tokens = np.asarray(values, dtype=np.float64)[keep], np.asarray(tokens, dtype=np.int64)[keep]
    known = dict(zip(tokens.tolist(), values.tolist(), strict=True))
    sample_of, position_of = table["sample"].to_numpy(), table["position"].to_numpy()
    pieces = table["piece"].to_numpy()
    n_tokens = samples["n_tokens"].to_numpy()
    meta = samples.set_index("sample")
    out = []
    for rank, (tok, value) in enumerate(zip(tokens.tolist(), values.tolist(), strict=True)):
        sample, position = int(sample_of[tok]), int(position_of[tok])
        lo, hi = tok - min(position, before), tok + min(int(n_tokens[sample]) - 1 - position, after)
        window = range(lo, hi + 1)
        row = meta.loc[sample]
        out.append({
            "rank": rank, "token": tok, "sample": sample, "position": position, "value": value,
            "task": _text(row.get("task")), "domain": _text(row.get("domain")), "group": _text(row.get("group")),
            "snippet": [{"token": t, "position": int(position_of[t]), "piece": str(pieces[t]),
                         "value": known.get(t), "top": t == tok} for t in window],
        })
    return out


def _text(value: Any) -> str | None:
    """A sample's task/domain as text; None for a missing one (None, NaN or pandas' NA)."""
    if value is None:
        return None
    try:
        if value != value:  # NaN
            return None
    except TypeError:  # pandas.NA refuses to be compared
        return None
    return str(value)


# --------------------------------------------------------------------------- similarities


def task_similarity(group_means: Sequence[np.ndarray], labels: Sequence[str], centered: bool = True, max_groups: int = 300) -> dict[str, Any]:
    """Task × task cosine similarity of mean gate-activation vectors (all given layers concatenated).

    ``centered`` subtracts each neuron's mean over tasks first: raw mean activations are
    dominated by what every task shares and give similarities near 1 everywhere.
    """
    x = np.concatenate([np.asarray(g, dtype=np.float64) for g in group_means], axis=1)
    labels = list(labels)
    note = "full resolution"
    if x.shape[0] > max_groups:
        keep = np.unique(np.linspace(0, x.shape[0] - 1, max_groups).round().astype(int))
        x, labels = x[keep], [labels[i] for i in keep]
        note = f"{len(keep)} of {len(group_means[0])} groups shown (evenly spaced)"
    if centered:
        x = x - x.mean(axis=0, keepdims=True)
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    unit = x / np.where(norm > 0, norm, 1.0)
    sim = unit @ unit.T
    return {"labels": labels, "matrix": finite_list(sim, 5), "centered": centered, "metric": "cosine", "note": note}


def layer_similarity(s_outputs: np.ndarray, s_mlp_inputs: np.ndarray, fusion: dict[str, Any] | None = None) -> dict[str, Any]:
    """D2 Eqs. 4–5 matrices (S_L of decoder outputs, S_M of MLP inputs) and adjacent-layer values.

    ``fusion``: what a Dense2MoE conversion would fuse (``methods.dense2moe.preview``'s
    ``fusion``, i.e. the engine's ``choose_fusion``); it is passed through, never recomputed
    here, and ``removed_layers`` lists the blocks it prunes (l*+1 … l*+n*).
    """
    s_l = np.asarray(s_outputs, dtype=np.float64)
    s_m = np.asarray(s_mlp_inputs, dtype=np.float64)
    adjacent_l = np.diagonal(s_l, offset=1)
    adjacent_m = np.diagonal(s_m, offset=1)
    out: dict[str, Any] = {
        "layers": list(range(s_l.shape[0])),
        "S_L": finite_list(s_l, 5),
        "S_M": finite_list(s_m, 5),
        "adjacent_S_L": finite_list(adjacent_l, 5),
        "adjacent_S_M": finite_list(adjacent_m, 5),
        "fusion": fusion,
        "removed_layers": None,
    }
    if fusion is not None:
        out["removed_layers"] = list(range(fusion["layer"] + 1, fusion["layer"] + fusion["n_fused"] + 1))
    return out


# --------------------------------------------------------------------------- routing (EW Fig. 8, MI load heatmaps)


def routing_heatmap(evaluations: Sequence[tuple[str, str, dict[str, Any]]], variant: str = "converted") -> dict[str, Any]:
    """Layer × expert × set token shares from evaluation records ``(evaluation_id, set_label, record)``.

    Each cell is the share of a layer's routed-expert selections that went to that expert on
    that set (rows sum to 1); static layers (no routed expert) are ``None``. ``load_cv`` is
    MI Eq. 7 per set and layer.
    """
    per_set: list[dict[int, np.ndarray]] = []
    cvs: list[dict[int, float]] = []
    for ev_id, _label, record in evaluations:
        entry = record.get("results", {}).get(variant)
        if entry is None:
            raise KeyError(f"evaluation {ev_id} has no variant {variant!r} (has {', '.join(record.get('results', {}))})")
        routing = entry.get("routing") or {}
        per_set.append({int(k): np.asarray(v, dtype=np.float64) for k, v in (routing.get("load") or {}).items()})
        cvs.append({int(k): v for k, v in (routing.get("load_cv") or {}).items()})
    layers = sorted(set().union(*[set(s) for s in per_set])) if per_set else []
    n_exp = max((len(v) for s in per_set for v in s.values()), default=0)
    counts = np.full((len(per_set), len(layers), n_exp), np.nan)
    cv = np.full((len(per_set), len(layers)), np.nan)
    for si, s in enumerate(per_set):  # sets × layers, never experts or tokens
        for li, layer in enumerate(layers):
            if layer in s:
                counts[si, li, : len(s[layer])] = s[layer]
                value = cvs[si].get(layer)
                cv[si, li] = np.nan if value is None else value
    with np.errstate(invalid="ignore", divide="ignore"):
        share = counts / np.nansum(counts, axis=2, keepdims=True)
    return {
        "variant": variant,
        "sets": [label for _, label, _ in evaluations],
        "evaluations": [ev for ev, _, _ in evaluations],
        "layers": layers,
        "n_experts": n_exp,
        "share": finite_list(share, 5),  # [set][layer][expert]
        "counts": finite_list(counts, 0),
        "load_cv": finite_list(cv, 5),  # [set][layer]
        "note": "share of each layer's routed selections per expert; None: layer is static or has fewer experts",
    }


def layer_curves(record: dict[str, Any], variant: str = "converted") -> dict[str, Any]:
    """One evaluation's per-layer curves, for overlaying runs: the relative reconstruction error of
    each layer's FFN on the dense model's inputs (0 where the layer stayed dense), its routing's load
    CV (MI Eq. 7) and its token share per expert (``routing_heatmap``'s, one set), from which two
    runs' Jensen–Shannon divergence per layer is drawn. KeyError names a variant the record lacks."""
    results = record.get("results", {})
    if variant not in results:
        raise KeyError(f"no variant {variant!r} in this evaluation (has {', '.join(results)})")
    errors = [float(v) for v in results[variant].get("reconstruction_error") or []]
    heat = routing_heatmap([("", "", record)], variant)
    layers = sorted(set(range(len(errors))) | set(heat["layers"]))
    routed = {layer: i for i, layer in enumerate(heat["layers"])}
    return {
        "variant": variant,
        "layers": layers,
        "reconstruction_error": [errors[layer] if layer < len(errors) else None for layer in layers],
        "load_cv": [heat["load_cv"][0][routed[layer]] if layer in routed else None for layer in layers],
        "share": [heat["share"][0][routed[layer]] if layer in routed else None for layer in layers],
    }
