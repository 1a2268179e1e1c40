"""The Routing explorer's figures: routed share per expert, set differences, Jensen-Shannon per layer, load CV."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from .common import _arr, _layout, _missing_note, js_divergence, layer_gaps


def routing_share(heat: dict[str, Any]) -> np.ndarray:
    return _arr(heat["share"]).reshape(len(heat["sets"]), len(heat["layers"]), heat["n_experts"])


def routed_experts(heat: dict[str, Any], set_index: int = 0) -> np.ndarray:
    """Routed experts of each layer: the payload pads every layer to the widest one's expert count
    with ``None`` (EW's layer-adaptive α gives layers different counts); a static layer has none."""
    counts = _arr(heat["counts"]).reshape(len(heat["sets"]), len(heat["layers"]), heat["n_experts"])[set_index]
    return np.isfinite(counts).sum(axis=-1)


#: Why a heatmap cell is blank, said in its hover text and under the title.
BLANK_NOTE = "blank cells: padding beyond a layer's own routed experts (layers have different counts) or a static layer"


def _blank_note(heat: dict[str, Any]) -> str | None:
    """BLANK_NOTE when the payload has blank cells (a narrower or static layer), else nothing to explain."""
    return BLANK_NOTE if (routed_experts(heat) < heat["n_experts"]).any() else None


def _pair(heat: dict[str, Any], a: int, b: int) -> str:
    """'A = code · 4 windows × 64 tokens …<br>B = …': set names are long, one line each."""
    return f"A = {heat['sets'][a]}<br>B = {heat['sets'][b]}"


def _cell_text(heat: dict[str, Any], z: np.ndarray, set_index: int, what: str) -> list[list[str]]:
    """Hover text of every cell, the blank ones saying why they are blank."""
    n = routed_experts(heat, set_index)
    out = []
    for li, layer in enumerate(heat["layers"]):
        row = []
        for e in range(heat["n_experts"]):
            if n[li] == 0:
                row.append(f"layer {layer}: static, no routed expert")
            elif e >= n[li]:
                row.append(f"layer {layer} has {n[li]} routed experts: no expert {e} (padding)")
            elif not np.isfinite(z[li, e]):
                row.append(f"layer {layer}, expert {e}: no routed token")
            else:
                row.append(f"layer {layer}, expert {e}: {what} {z[li, e]:.4f}")
        out.append(row)
    return out


def routing_heatmap(heat: dict[str, Any], set_index: int, zmax: float | None = None) -> go.Figure:
    """Layer × expert token share on one set; blank (padding / static) cells explained on hover."""
    share = routing_share(heat)[set_index]
    fig = go.Figure(go.Heatmap(z=share, x=list(range(heat["n_experts"])), y=heat["layers"], colorscale="Viridis", zmin=0,
                               zmax=zmax, colorbar={"title": "share"}, text=_cell_text(heat, share, set_index, "share"),
                               hovertemplate="%{text}<extra></extra>", hoverongaps=True))
    note = "share of each layer's routed selections per expert" + (f"<br>{blank}" if (blank := _blank_note(heat)) else "")
    return _layout(fig, f"Routing on {heat['sets'][set_index]}", note, xaxis_title="expert", yaxis_title="layer")


def routing_difference(heat: dict[str, Any], a: int, b: int) -> go.Figure:
    share = routing_share(heat)
    diff = share[a] - share[b]
    m = float(np.nanmax(np.abs(diff))) if np.isfinite(diff).any() else 1.0
    fig = go.Figure(go.Heatmap(z=diff, x=list(range(heat["n_experts"])), y=heat["layers"], colorscale="RdBu", zmid=0,
                               zmin=-m, zmax=m, colorbar={"title": "Δ share"}, text=_cell_text(heat, diff, a, "Δ share"),
                               hovertemplate="%{text}<extra></extra>", hoverongaps=True))
    note = _pair(heat, a, b) + (f"<br>{blank}" if (blank := _blank_note(heat)) else "")
    return _layout(fig, "Difference of token shares: A − B", note, xaxis_title="expert", yaxis_title="layer")


def routing_js_line(heat: dict[str, Any], a: int, b: int) -> go.Figure:
    share = routing_share(heat)
    js = js_divergence(share[a], share[b])
    n = routed_experts(heat, a)
    xs, y = layer_gaps(heat["layers"], js)  # lists: null gaps in the browser, not an encoded array
    experts = dict(zip(heat["layers"], n.tolist(), strict=True))
    fig = go.Figure(go.Scatter(x=xs, y=y, mode="lines+markers", name="JS divergence", customdata=[experts.get(x, 0) for x in xs],
                               hovertemplate="layer %{x}: JS %{y:.4f} bits over its %{customdata} routed experts<extra></extra>"))
    note = _pair(heat, a, b) + "<br>bits over each layer's own routed experts; 0 = same routing, 1 = disjoint"
    if (static := [layer for layer, k in zip(heat["layers"], n, strict=True) if k == 0]):
        note += f"; static layers {static} have no routed expert (no value)"
    note += _missing_note(heat["layers"])
    return _layout(fig, "Jensen–Shannon divergence per layer, A vs B", note, xaxis_title="layer", yaxis_title="JS (bits)", yaxis_range=[0, 1])


def load_cv_by_layer(heat: dict[str, Any]) -> go.Figure:
    """MI Fig. 3: load CV (MI Eq. 7) per layer, one line per set, broken at layers without routed experts."""
    cv = _arr(heat["load_cv"]).reshape(len(heat["sets"]), len(heat["layers"]))
    lines = [(name, *layer_gaps(heat["layers"], cv[i])) for i, name in enumerate(heat["sets"])]
    fig = go.Figure([go.Scatter(x=xs, y=y, mode="lines+markers", name=name) for name, xs, y in lines])
    return _layout(fig, "Expert load CV by layer (MI Fig. 3)", "0 = perfectly balanced" + _missing_note(heat["layers"]),
                   xaxis_title="layer", yaxis_title="load CV")
