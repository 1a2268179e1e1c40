"""The Conversion designer's figures: the per-layer allocation and budget plan, reconstruction error."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from .common import _layout, message_figure


def allocation_plan(preview: dict[str, Any]) -> go.Figure:
    """EW Fig. 7: neurons per layer split into shared / routed-active / routed-idle, with r_ℓ on a 2nd axis."""
    rows = preview["layers"]
    layers = [r["layer"] for r in rows]
    shared = np.array([r["d_shared"] for r in rows])
    routed_active = np.array([r["top_k"] * r["d_expert"] for r in rows])
    d_ffn = np.array([r["d_ffn"] for r in rows])
    idle = d_ffn - shared - routed_active
    fig = go.Figure()
    fig.add_bar(x=layers, y=shared / d_ffn, name="shared (always on)", marker_color="#1f77b4")
    fig.add_bar(x=layers, y=routed_active / d_ffn, name="routed, active per token", marker_color="#ff7f0e")
    fig.add_bar(x=layers, y=idle / d_ffn, name="routed, idle per token", marker_color="#d3d3d3")
    r = [row.get("r") for row in rows]
    if any(v is not None and np.isfinite(v) for v in r):
        fig.add_scatter(x=layers, y=r, name="r_ℓ (EW Eq. 4)", mode="lines+markers", yaxis="y2", line={"color": "black"})
    clamped = [row["layer"] for row in rows if row.get("clamped")]
    static = [row["layer"] for row in rows if row.get("static")]
    s = preview.get("summary", {})
    note = f"active {s.get('active_fraction', float('nan')):.1%} of FFN neurons"
    if clamped:
        note += f"; CLAMPED layers {clamped} (Eq. 6 asked for more shared experts than the active budget)"
    if static:
        note += f"; STATIC layers {static} (no routed expert runs: a fixed prune)"
    title = "Per-layer shared / routed plan (EW Fig. 7)"
    if budget_plan(preview):
        title = "Starting plan of the budget plan: per-layer top-k is fitted at conversion"
        note += f"; the conversion keeps {budget_cap(preview)}"
    elif (preview.get("params") or {}).get("plan") == "leading":
        title = "Starting plan of the leading plan: leading dense layers and one top-k are fitted at conversion"
        note += f"; the conversion keeps {budget_cap(preview)}"
    fig.update_layout(barmode="stack", yaxis={"title": "share of d_ffn", "range": [0, 1]},
                      yaxis2={"title": "r_ℓ", "overlaying": "y", "side": "right", "range": [0, 1]},
                      legend={"orientation": "h", "y": -0.2})
    return _layout(fig, title, note, xaxis_title="layer")


def budget_plan(preview: dict[str, Any]) -> bool:
    """Whether a preview is of a ``plan="budget"`` conversion: its per-layer top-k is chosen at
    conversion time from calibration error (``core.fitting``), which a numpy preview cannot show."""
    return (preview.get("params") or {}).get("plan") == "budget"


def budget_cap(preview: dict[str, Any]) -> str:
    """The budget plan's cap on the FFN cost in words (``core.fitting``): ExpertWeaver's
    ``flops_budget`` 1 − sparsity, else (CMoE) the paper plan's own cost."""
    params, summary = preview.get("params") or {}, preview.get("summary") or {}
    if isinstance(params.get("sparsity"), (int, float)):
        return f"ffn_flops_fraction ≤ {1 - params['sparsity']:.3g} (1 − sparsity)"
    cost = summary.get("ffn_flops_fraction")
    return f"ffn_flops_fraction ≤ {cost:.3f} (the paper plan's cost)" if isinstance(cost, (int, float)) else "the paper plan's cost"


def reconstruction_error(report: dict[str, Any]) -> go.Figure:
    """Per-layer FFN reconstruction error of each variant, from an evaluation report (``evaluation.json``)."""
    traces = []
    for name, result in (report.get("results") or {}).items():
        err = result.get("reconstruction_error")
        if isinstance(err, dict):
            err = [err[k] for k in sorted(err, key=int)]
        if err:
            traces.append(go.Scatter(x=list(range(len(err))), y=err, mode="lines+markers", name=name))
    if not traces:
        return message_figure("this evaluation has no per-layer reconstruction error")
    return _layout(go.Figure(traces), "Per-layer FFN reconstruction error", "relative error of the MoE FFN output vs the dense FFN",
                   xaxis_title="layer", yaxis_title="error")
