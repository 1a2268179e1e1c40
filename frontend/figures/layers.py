"""The Layer similarity page's figure: S_L / S_M between layers, with Dense2MoE's fusion outline."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from .common import _arr, _layout


def blocks(first: int, last: int) -> str:
    """'block 4' or 'blocks 4–8'."""
    return f"block {first}" if first == last else f"blocks {first}–{last}"


def fusion_outline(data: dict[str, Any]) -> tuple[int, int] | None:
    """The (l*, l*+n*) block a Dense2MoE conversion fuses, as the API's ``fusion`` says (the engine's
    ``choose_fusion``; never recomputed here), or None when the conversion would be refused."""
    f = data.get("fusion")
    return (int(f["layer"]), int(f["layer"]) + int(f["n_fused"])) if f else None


def layer_similarity(data: dict[str, Any], which: str = "S_L") -> go.Figure:
    """D2 Fig. 3: S_L or S_M heatmap, with the block l* … l*+n* a Dense2MoE conversion fuses outlined
    (the compared cell [l*, l*+n*] marked): exactly the API's ``fusion``."""
    z = _arr(data[which])
    layers = data["layers"]
    fig = go.Figure(go.Heatmap(z=z, x=layers, y=layers, colorscale="Blues", zmin=min(0.0, np.nanmin(z)) if z.size else 0, zmax=1,
                               colorbar={"title": "cosine"}))
    block = fusion_outline(data)
    note = None
    if block is not None:
        lo, hi = block
        fig.add_shape(type="rect", x0=lo - 0.5, x1=hi + 0.5, y0=lo - 0.5, y1=hi + 0.5, name="fusion",
                      line={"color": "firebrick", "width": 2})
        fig.add_shape(type="rect", x0=hi - 0.5, x1=hi + 0.5, y0=lo - 0.5, y1=lo + 0.5, name="fusion-pair",
                      line={"color": "firebrick", "width": 3, "dash": "dot"})
        f = data["fusion"]
        value = f["s_layer"] if which == "S_L" else f["s_mlp"]
        test = f"< δ = {f['delta']:g}" if f.get("rank") is not None else "(l*, n* given: no δ test)"
        note = (f"fused: l* = {lo}, n* = {hi - lo} ({blocks(lo + 1, hi)} pruned); {which}[{lo}, {hi}] = {value:.4f}, "
                f"MLP-input distance {1 - f['s_mlp']:.4f} {test}")
    elif data.get("fusion_error"):
        note = "no fusion outlined: a conversion with these parameters is refused"
    name = "decoder outputs S_L (D2 Eq. 4)" if which == "S_L" else "MLP inputs S_M (D2 Eq. 5)"
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, f"Layer similarity of {name}", note, xaxis_title="layer", yaxis_title="layer")
