"""Layer similarity: S_L and S_M heatmaps (D2 Fig. 3) with the block a Dense2MoE conversion fuses outlined.

δ, n* and l* are Dense2MoE's own parameters (same names, defaults, bounds and meaning as the
engine, the API and the designer: a span l → l+n* qualifies when its MLP-input distance
1 − S_M[l, l+n*] < δ). The outline is the API's ``fusion``, i.e. the engine's ``choose_fusion``
for these parameters (never recomputed here); 'open in the designer' carries them over.
State in the URL: ?profile=…&delta=…&n_fused=…&layer=…"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, callback, dcc, html

from frontend.figures import layers as F, common as FC
from moelab.api_client import ApiError, api
from frontend.components import error_box, figure_card, num, profile_picker, to_search

dash.register_page(__name__, path="/layers", name="Layer similarity", order=4)

N = "ls"
METHOD = "dense2moe"


def method_specs() -> tuple[dict[str, dict[str, Any]], str | None]:
    """Dense2MoE's parameter declarations (``GET /methods``): name → spec, and an error text."""
    try:
        methods = api().methods()
    except ApiError as exc:
        return {}, str(exc)
    m = next((m for m in methods if m["name"] == METHOD), None)
    if m is None:
        return {}, f"the API offers no {METHOD} method"
    return {p["name"]: p for p in m["params"]}, None


def _int(value: Any) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


def chosen(delta: Any, n_fused: Any, layer: Any) -> dict[str, Any]:
    """The page's parameters as the API reads them (an empty l* box is left out: chosen)."""
    out: dict[str, Any] = {"delta": float(delta)} if delta not in (None, "") else {}
    if _int(n_fused) is not None:
        out["n_fused"] = _int(n_fused)
    if _int(layer) is not None:
        out["layer"] = _int(layer)
    return out


def designer_href(profile: str | None, params: dict[str, Any]) -> str:
    """The designer with Dense2MoE selected and these parameters filled in (its URL state)."""
    return "/designer" + to_search(profile=profile, method=METHOD, **params)


def summary(data: dict[str, Any]) -> str:
    """What a conversion with the page's parameters does, in words (the API's ``fusion``)."""
    f = data.get("fusion")
    if not f:
        return "Nothing outlined: a Dense2MoE conversion with these parameters is refused (the message above says why)."
    lo, n = f["layer"], f["n_fused"]
    why = (f"ranked {f['rank'] + 1} of {f['n_candidates']} spans by S_L, the first whose MLP-input distance "
           f"{1 - f['s_mlp']:.4f} < δ = {f['delta']:g}" if f.get("rank") is not None else "l* and n* given: no δ test")
    p = data.get("params") or {}
    experts = p.get("own_copies", 1) + n * p.get("fused_copies", 1)
    return (f"A Dense2MoE conversion with these parameters fuses {F.blocks(lo + 1, lo + n)} into block {lo} "
            f"(l* = {lo}, n* = {n}; S_L[{lo}, {lo + n}] = {f['s_layer']:.4f}; {why}): "
            f"{len(data['layers'])} → {len(data['layers']) - n} layers, {experts} experts, top-{p.get('top_k', 1)}.")


def layout(profile: str | None = None, delta: str | None = None, n_fused: str | None = None, layer: str | None = None, **_):
    picker, profile, err = profile_picker(N, profile)
    specs, s_err = method_specs()
    d, nf, ly = specs.get("delta", {}), specs.get("n_fused", {}), specs.get("layer", {})
    delta_v = num(delta, d.get("default", 0.3))
    n_v = _int(n_fused) if _int(n_fused) is not None else nf.get("default", 5)
    return html.Div([
        dcc.Location(id=f"{N}-url", refresh=False),
        html.H2("Layer similarity (Dense2MoE)"),
        error_box(err or s_err),
        html.Div(className="controls", children=[
            picker,
            html.Div(className="slider", style={"minWidth": 320}, children=[
                html.Label("δ (D2 §2.3)", title=d.get("help", "")),
                html.Div(d.get("help", "MLP-input distance threshold"), className="hint"),
                dcc.Slider(id=f"{N}-delta", min=0.01, max=max(1.0, delta_v), step=0.01, value=delta_v, updatemode="mouseup",
                           marks={0.1: "0.1", 0.3: "0.3", 0.5: "0.5", 1: "1"},
                           tooltip={"always_visible": True, "placement": "bottom"})]),
            html.Div(className="param", children=[
                html.Label("n* (D2 §4)", title=nf.get("help", "")),
                dcc.Input(id=f"{N}-n_fused", type="number", min=0, step=1, value=n_v, debounce=True),
                html.Div(nf.get("help", ""), className="hint")]),
            html.Div(className="param", children=[
                html.Label("l* (D2 §2.3)", title=ly.get("help", "")),
                dcc.Input(id=f"{N}-layer", type="number", min=0, step=1, value=_int(layer), placeholder="empty: choose", debounce=True),
                html.Div(ly.get("help", ""), className="hint")]),
        ]),
        html.Div(id=f"{N}-error"),
        html.Div(id=f"{N}-summary", className="note"),
        html.Div(dcc.Link("open in the conversion designer →", id=f"{N}-designer", href=designer_href(profile, {})), className="note"),
        html.Div(className="row", children=[figure_card(f"{N}-sl", "S_L: decoder outputs"), figure_card(f"{N}-sm", "S_M: MLP inputs")]),
    ])


@callback(Output(f"{N}-sl", "figure"), Output(f"{N}-sm", "figure"), Output({"type": "csv-data", "name": f"{N}-sl"}, "data"),
          Output({"type": "csv-data", "name": f"{N}-sm"}, "data"), Output(f"{N}-summary", "children"), Output(f"{N}-error", "children"),
          Output(f"{N}-url", "search"), Output(f"{N}-designer", "href"),
          Input(f"{N}-profile", "value"), Input(f"{N}-delta", "value"), Input(f"{N}-n_fused", "value"), Input(f"{N}-layer", "value"))
def _update(profile, delta, n_fused, layer):
    params = chosen(delta, n_fused, layer)
    search = to_search(profile=profile, **params)
    href = designer_href(profile, params)
    if not profile:
        fig = FC.message_figure("choose a ready profile")
        return fig, fig, None, None, "", error_box("no profile chosen: create one on the Workspace page"), search, href
    try:
        data = api().layer_similarity(profile, **params)
    except ApiError as exc:
        fig = FC.message_figure(str(exc))
        return fig, fig, None, None, "", error_box(str(exc)), search, href
    store = {"kind": "layer-similarity", "data": data, "filename": "layer_similarity"}
    return (F.layer_similarity(data, "S_L"), F.layer_similarity(data, "S_M"), store, store, summary(data),
            error_box(data.get("fusion_error")), search, href)
