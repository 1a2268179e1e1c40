"""The Neuron explorer's figures: coefficient-of-variation distributions, activation maps, neuron cards."""

from __future__ import annotations

import math

from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go

from .common import LOG_COUNTS, _arr, _count_bars, _layout, _log_ticks, basis_names, binned_histogram


def cv_histogram(data: dict[str, Any], layer: int, tau: float | None = None, basis: str | None = None) -> go.Figure:
    """Histogram of one layer's neuron CV on the server's shared bins (log counts), τ (EW Eq. 4) drawn
    when given; overflow (and, on log bins, CVs ≤ 0) said in the title.

    Log-spaced bins (``scale == "log"``) are drawn as equal-width bars on a log10 axis labelled in
    CV units: plotly's own log axis would draw each bar's width in linear units, misplacing wide
    bins."""
    edges = _arr(data["edges"])
    counts = np.asarray(data["counts"][layer])
    log = data.get("scale") == "log"
    pos = np.log10(edges) if log else edges
    centers = (pos[:-1] + pos[1:]) / 2
    bar = _count_bars(centers, counts, np.diff(pos), "CV", f"layer {layer}")
    bar.customdata = np.stack([edges[:-1], edges[1:]], axis=-1)  # hover in CV units on either axis
    fig = go.Figure(bar)
    extra = data["overflow"][layer]
    note = f"{data['n_neurons'][layer]} neurons; {extra} above {data['clipped_at']:.3g} not shown"
    below = (data.get("underflow") or [0] * (layer + 1))[layer]
    if below:
        note += f"; {below} with CV ≤ 0 not shown"
    note += "; counts on a log axis" + ("; CV on a log axis" if log else "")
    if tau is not None:
        fig.add_vline(x=math.log10(tau) if log and tau > 0 else tau, line_dash="dash", line_color="firebrick",
                      annotation_text=f"τ = {tau:g}")
        note += "; right of τ: specialised neurons (r_ℓ, EW Eq. 4)"
    axis: dict[str, Any] = {}
    if log:
        ticks, labels = _log_ticks(float(edges[0]), float(edges[-1]))
        axis = {"xaxis_tickvals": ticks, "xaxis_ticktext": labels}
    return _layout(fig, f"Neuron CV, layer {layer}", note, xaxis_title=f"CV across {basis_names(basis)[1]}" + (" (log)" if log else ""),
                   yaxis_title="neurons (log)", bargap=0, **LOG_COUNTS, **axis)


def cv_by_layer(summary: dict[str, Any]) -> go.Figure:
    """EW Fig. 2: CV by layer as boxes from the server's quantiles (5/25/50/75/95 %) and the mean."""
    q = _arr(summary["values"])
    layers = summary["layers"]
    quantiles = list(summary["quantiles"])
    col = {v: i for i, v in enumerate(quantiles)}
    fig = go.Figure(go.Box(
        x=layers, q1=q[:, col[0.25]], median=q[:, col[0.5]], q3=q[:, col[0.75]],
        lowerfence=q[:, col[0.05]], upperfence=q[:, col[0.95]], mean=_arr(summary["mean"]), name="CV",
        boxpoints=False,
    ))
    if summary.get("tau") is not None:
        fig.add_hline(y=summary["tau"], line_dash="dash", line_color="firebrick", annotation_text=f"τ = {summary['tau']:g}")
    return _layout(fig, "Neuron CV by layer (EW Fig. 2)", "whiskers: 5 % and 95 % quantiles", xaxis_title="layer", yaxis_title="CV")


def specialisation_ratio(summary: dict[str, Any]) -> go.Figure:
    """r_ℓ (EW Eq. 4) per layer for the summary's τ."""
    r = summary.get("specialisation_ratio") or []
    fig = go.Figure(go.Scatter(x=summary["layers"], y=r, mode="lines+markers", name="r_ℓ"))
    return _layout(fig, f"Specialisation ratio r_ℓ (τ = {summary.get('tau')})", None, xaxis_title="layer", yaxis_title="share CV > τ", yaxis_range=[0, 1])


def activation_heatmap(tiles: dict[str, Any], basis: str | None = None) -> go.Figure:
    """EW Fig. 1a: rows (tasks, domains or samples: the profile's ``basis``) × neurons (in the server's
    order), tiles when aggregated."""
    z = _arr(tiles["values"])
    x = tiles["column_first_neuron"]
    one, many = basis_names(basis)
    fig = go.Figure(go.Heatmap(
        z=z, y=tiles["rows"], x=list(range(len(x))), customdata=np.tile(np.asarray(x), (z.shape[0], 1)) if z.size else None,
        colorscale="RdBu", zmid=0, colorbar={"title": "mean act."},
        hovertemplate=one + " %{y}<br>column %{x} (first neuron %{customdata})<br>value %{z:.4f}<extra></extra>",
    ))
    note = ("aggregated server-side: " + tiles["note"]) if tiles.get("aggregated") else tiles.get("note")
    return _layout(fig, f"Neuron × {one} activations, layer {tiles['layer']} ({len(tiles['rows'])} {many}; order: {tiles['neuron_order']})",
                   note, xaxis_title="neuron column", yaxis_title=one)


def neuron_profile(tiles: dict[str, Any], column: int, basis: str | None = None) -> go.Figure:
    """One neuron column's value on every row (clicked on the heatmap)."""
    z = _arr(tiles["values"])
    first = tiles["column_first_neuron"][column]
    label = f"neuron {first}" if tiles.get("neurons_per_column", 1) == 1 else f"neurons from {first} ({tiles['neurons_per_column']} averaged)"
    return _group_bars(tiles["rows"], z[:, column], label, basis)


def _group_bars(rows: Sequence[str], values: np.ndarray, label: str, basis: str | None) -> go.Figure:
    one = basis_names(basis)[0]
    fig = go.Figure(go.Bar(x=list(rows), y=values))
    return _layout(fig, f"Per-{one} profile: {label}", None, xaxis_title=one, yaxis_title="mean activation")


def neuron_card_profile(card: dict[str, Any]) -> go.Figure:
    """A neuron card's mean gate activation per group (EW §3.1 ā_{j,t}: the neuron × task map's column)."""
    return _group_bars(card["groups"], _arr(card["group_means"]), f"layer {card['layer']} · neuron {card['neuron']}", card.get("cv_basis"))


def task_similarity(data: dict[str, Any], basis: str | None = None) -> go.Figure:
    """EW Fig. 1b: cosine similarity of the activation patterns of the profile's groups, titled by
    what they are (a single-topic set is profiled per sample: a sample × sample matrix, not tasks)."""
    one, many = basis_names(basis)
    fig = go.Figure(go.Heatmap(z=_arr(data["matrix"]), x=data["labels"], y=data["labels"], colorscale="Viridis",
                               colorbar={"title": "cosine"},
                               hovertemplate=f"{one} %{{y}} vs {one} %{{x}}<br>cosine %{{z:.3f}}<extra></extra>"))
    centered = "centred per neuron" if data.get("centered") else "raw"
    note = f"{len(data['labels'])} {many}; {centered}"
    if data.get("note") and data.get("note") != "full resolution":
        note += f"; {data['note']}"
    if basis == "sample":
        note += "; the set has fewer than 2 tasks, so the CV is taken across samples"
    return _layout(fig, f"{one.capitalize()} × {one} activation similarity (EW Fig. 1b)", note)


def activation_rate_histogram(stats: dict[str, Any]) -> go.Figure:
    """CM Fig. 2: how often each neuron is among a token's ATopK markers (CM Eq. 4)."""
    return binned_histogram(stats["rate_edges"], stats["rate_counts"], f"Activation rate, layer {stats['layer']} (CM Fig. 2)",
                            "share of tokens with the neuron in the ATopK set", "neurons",
                            f"{stats['n_neurons']} neurons, mean rate {stats['rate_mean']:.3g}")


def h_value_histogram(stats: dict[str, Any]) -> go.Figure:
    """Token-level gate activations h of the layer, with what fell outside the stored range."""
    return binned_histogram(stats["h_edges"], stats["h_counts"], f"h values, layer {stats['layer']}", "h = act(x·W_gate) ⊙ x·W_up",
                            "token × neuron values", f"{stats['h_below']} below and {stats['h_above']} above the range not shown")
