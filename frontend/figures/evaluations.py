"""The Evaluations page's per-layer overlays of several runs."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from .common import _layout, js_divergence, message_figure


#: per-layer curves of an evaluation (``GET /evaluations/{id}/charts/layers``) a user can overlay
LAYER_METRICS = {
    "reconstruction_error": ("Reconstruction error per layer", "relative L2 error of each layer's FFN on the dense model's inputs "
                             "(0: the layer stayed dense)", "relative error"),
    "load_cv": ("Expert load CV per layer (MI Eq. 7)", "0 = perfectly balanced routing", "load CV"),
    "js": ("Routing divergence per layer", "Jensen–Shannon divergence (bits) between a run's routing on its text and the same "
           "conversion's on the chosen text; 0 = same routing, 1 = disjoint", "JS (bits)"),
}


def js_between(curves: dict[str, Any], other: dict[str, Any]) -> list[float | None]:
    """Per layer of ``curves``: the JS divergence (``js_divergence``) of its expert shares and ``other``'s
    (an evaluation of the same conversion on another text, so expert ids are the same experts); None
    where either has no routed expert in that layer."""
    theirs = dict(zip(other["layers"], other["share"], strict=True))
    out: list[float | None] = []
    for layer, mine in zip(curves["layers"], curves["share"], strict=True):
        other_share = theirs.get(layer)
        if not mine or not other_share:
            out.append(None)
            continue
        p = np.array([np.nan if v is None else v for v in mine], dtype=float)
        q = np.array([np.nan if v is None else v for v in other_share], dtype=float)
        value = float(js_divergence(p[None], q[None])[0])
        out.append(value if np.isfinite(value) else None)
    return out


def layer_overlay(runs: list[dict[str, Any]], metric: str, note: str | None = None) -> go.Figure:
    """One line per run over the layers: ``runs`` are ``{"label", "layers", "values"}`` (None: no value
    at that layer, a gap in the line). ``metric`` is a key of ``LAYER_METRICS``."""
    title, what, axis = LAYER_METRICS[metric]
    if not runs:
        return message_figure("choose evaluations to overlay")
    fig = go.Figure([go.Scatter(x=r["layers"], y=list(r["values"]), mode="lines+markers", name=r["label"],
                                hovertemplate=f"{r['label']}<br>layer %{{x}}: %{{y:.4f}}<extra></extra>") for r in runs])
    extra = {"yaxis_range": [0, 1]} if metric == "js" else {}
    return _layout(fig, title, what + (f"<br>{note}" if note else ""), xaxis_title="layer", yaxis_title=axis,
                   legend={"orientation": "h", "y": -0.25}, showlegend=True, **extra)
