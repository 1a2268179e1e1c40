"""The Compare profiles page's figures: neuron specificity and the share of specific neurons per layer."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from .common import _arr, _layout


#: d < 0 (specific to B) blue, d > 0 (specific to A) red: the neuron card's colours for negative / positive h
SPECIFICITY_SCALE = [[0.0, "rgb(37, 99, 235)"], [0.5, "rgb(229, 231, 235)"], [1.0, "rgb(220, 38, 38)"]]


def specificity_scatter(data: dict[str, Any], names: tuple[str, str]) -> go.Figure:
    """Each neuron of the payload's layer at (mean on A, mean on B), coloured by its set-specificity d
    (red: specific to A, blue: to B, symmetric around 0); the diagonal is 'as active on both'.
    ``data``: GET /profiles/compare; ``names``: what A and B are (their calibration sets)."""
    sc = data["scatter"]
    d = _arr(sc["specificity"])
    finite = np.abs(d[np.isfinite(d)])
    top = max(2.0 * data["threshold"], float(np.quantile(finite, 0.99)) if finite.size else 0.0)
    x, y = _arr(sc["mean_a"]), _arr(sc["mean_b"])
    fig = go.Figure(go.Scatter(  # SVG, not WebGL: ≤ max_points points, and headless browsers lack WebGL
        x=x, y=y, mode="markers", customdata=np.stack([np.asarray(sc["neurons"]), d], axis=-1) if len(d) else None,
        marker={"color": d, "colorscale": SPECIFICITY_SCALE, "cmin": -top, "cmax": top, "size": 6,
                "colorbar": {"title": "d"}, "line": {"width": 0}},
        hovertemplate="neuron %{customdata[0]}<br>mean on A %{x:.4g}, on B %{y:.4g}<br>d = %{customdata[1]:.3g}<extra></extra>",
    ))
    finite_xy = np.concatenate([x[np.isfinite(x)], y[np.isfinite(y)]])
    if finite_xy.size:
        lo, hi = float(finite_xy.min()), float(finite_xy.max())
        fig.add_shape(type="line", x0=lo, y0=lo, x1=hi, y1=hi, line={"dash": "dot", "color": "#9ca3af", "width": 1})
    note = (f"{sc['note']}; colour: d (red: more active on A, blue: on B; specific: |d| ≥ {data['threshold']:g} and "
            f"Benjamini–Hochberg q ≤ {data['fdr']:g})")
    return _layout(fig, f"Layer {sc['layer']}: each neuron's mean gate activation on A and on B", note,
                   xaxis_title=f"mean gate activation on A: {names[0]}", yaxis_title=f"mean gate activation on B: {names[1]}")


def specific_share_bars(data: dict[str, Any], names: tuple[str, str]) -> go.Figure:
    """Per layer the share of neurons specific to A (d ≥ threshold) and to B (d ≤ −threshold), each kept by the
    false-discovery control (q ≤ fdr), stacked; the scatter's layer outlined."""
    rows = data["layers"]
    layers = [r["layer"] for r in rows]
    outline = [2 if layer == data["layer"] else 0 for layer in layers]
    fig = go.Figure([
        go.Bar(x=layers, y=[100 * r["share_a"] for r in rows], name=f"specific to A: {names[0]}", marker_color=SPECIFICITY_SCALE[2][1],
               marker_line={"width": outline, "color": "#111"}, customdata=[r["n_specific_a"] for r in rows],
               hovertemplate="layer %{x}: %{y:.1f}% (%{customdata} neurons) specific to A<extra></extra>"),
        go.Bar(x=layers, y=[100 * r["share_b"] for r in rows], name=f"specific to B: {names[1]}", marker_color=SPECIFICITY_SCALE[0][1],
               marker_line={"width": outline, "color": "#111"}, customdata=[r["n_specific_b"] for r in rows],
               hovertemplate="layer %{x}: %{y:.1f}% (%{customdata} neurons) specific to B<extra></extra>"),
    ])
    large = sum(r["n_large_a"] + r["n_large_b"] for r in rows)
    kept = sum(r["n_specific_a"] + r["n_specific_b"] for r in rows)
    note = (f"|d| ≥ {data['threshold']:g} and Welch's test kept at a false-discovery rate q ≤ {data['fdr']:g} (Benjamini–Hochberg "
            f"over every neuron): {kept} of the {large} neurons with that gap; outlined: layer {data['layer']} (the scatter's); "
            "click a bar to show its layer")
    return _layout(fig, "Share of set-specific neurons by layer", note, xaxis_title="layer", yaxis_title="% of the layer's neurons",
                   barmode="stack", legend={"orientation": "h", "x": 0, "y": -0.2, "yanchor": "top", "traceorder": "normal"})


def specific_rows(data: dict[str, Any], side: str) -> list[dict[str, Any]]:
    """The rows of a 'most specific to A/B' table: rank, layer, neuron, d and both sets' numbers, most specific first."""
    return [{"rank": i + 1, "layer": n["layer"], "neuron": n["neuron"], "d": n["specificity"], "mean_a": n["mean_a"],
             "mean_b": n["mean_b"], "rate_a": n["rate_a"], "rate_b": n["rate_b"]}
            for i, n in enumerate(data[f"top_{side}"])]
