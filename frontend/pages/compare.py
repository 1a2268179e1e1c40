"""Compare conversions: two or more side by side (parameters, FFN cost, perplexity, quality vs cost,
per-layer active share, load CV). State in the URL: ?ids=c1,c2

"sparsity" is the method's own parameter (EW: the share of neurons not computed per token); what
conversions are compared at is their recorded ``ffn_flops_fraction``, FFN multiply-adds per token,
router and scoring included, over the dense FFN's."""

from __future__ import annotations

import dash
from dash import Input, Output, callback, dcc, html

from frontend import figures as F
from frontend.api_client import ApiError, api
from frontend.components import error_box, figure_card, options, to_search

dash.register_page(__name__, path="/compare", name="Compare conversions", order=6)

N = "cc"
HEADERS = {"sparsity": "sparsity (parameter)"}  # the cost compared at is ffn_flops_fraction, its own column


def layout(ids: str | None = None, **_):
    try:
        convs, err = options(api().conversions()), None
    except ApiError as exc:
        convs, err = [], str(exc)
    chosen = [i for i in (ids or "").split(",") if i] or [c["value"] for c in convs[:2]]
    return html.Div([
        dcc.Location(id=f"{N}-url", refresh=False),
        html.H2("Compare conversions"),
        error_box(err),
        html.Div(className="controls", children=[
            html.Div([html.Label("conversions"), dcc.Dropdown(id=f"{N}-ids", options=convs, value=chosen, multi=True, style={"width": 640})]),
        ]),
        html.Div(id=f"{N}-error"),
        html.Div(id=f"{N}-table"),
        html.Div(className="row", children=[figure_card(f"{N}-ppl", "Perplexity"), figure_card(f"{N}-cost", "Quality vs cost")]),
        html.Div(className="row", children=[figure_card(f"{N}-active", "Active share per layer")]),
    ])


@callback(Output(f"{N}-table", "children"), Output(f"{N}-ppl", "figure"), Output(f"{N}-active", "figure"), Output(f"{N}-cost", "figure"),
          Output({"type": "csv-data", "name": f"{N}-ppl"}, "data"), Output({"type": "csv-data", "name": f"{N}-active"}, "data"),
          Output(f"{N}-error", "children"), Output(f"{N}-url", "search"), Input(f"{N}-ids", "value"))
def _update(ids):
    ids = ids or []
    search = to_search(ids=",".join(ids))
    if not ids:
        fig = F.message_figure("choose conversions to compare")
        return None, fig, fig, fig, None, None, error_box("no conversion chosen"), search
    try:
        convs = [api().conversion(i) for i in ids]
        evals = {i: api().evaluations(i) for i in ids}
    except ApiError as exc:
        fig = F.message_figure(str(exc))
        return None, fig, fig, fig, None, None, error_box(str(exc)), search
    keys = ["method", "n_experts", "alpha_min", "alpha_max", "tau", "sparsity", "plan", "shared", "active"]
    header = html.Tr([html.Th("conversion"), html.Th("status"), html.Th("router")] + [html.Th(HEADERS.get(k, k)) for k in keys]
                     + [html.Th("active neuron fraction"), html.Th("FFN cost (ffn_flops_fraction)"), html.Th("load CV (mean)")])
    body, ppl_rows, plans, cost_points = [], [], {}, []
    for c in convs:
        alloc = {**(c["params"] or {}), "method": c.get("method")}  # every method (flat parameters)
        s = c.get("summary") or {}
        ev = [e for e in evals[c["id"]] if e["status"] == "ready"]
        load_cv = None
        for e in ev:
            heldout = (e.get("summary") or {}).get("heldout") or {}
            text = f"{heldout.get('source', '?')} ({heldout.get('windows', '?')}×{heldout.get('seq_len', '?')} tokens)"
            for variant, d in ((e.get("summary") or {}).get("variants") or {}).items():
                ppl_rows.append({"conversion": c["id"], "variant": f"{variant}", "perplexity": d.get("perplexity")})
                if variant == "converted":
                    load_cv = d.get("load_cv") if d.get("load_cv") is not None else d.get("mean_load_cv")
                    cost_points.append({"label": c["id"], "text": text, "ffn_flops_fraction": s.get("ffn_flops_fraction"),
                                        "perplexity_ratio": d.get("perplexity_ratio")})
        body.append(html.Tr([html.Td(c["id"]), html.Td(c["status"]), html.Td((c["params"] or {}).get("router"))]
                            + [html.Td(str(alloc.get(k, ""))) for k in keys]
                            + [html.Td(f"{s['active_fraction']:.3f}" if isinstance(s.get("active_fraction"), float) else ""),
                               html.Td(f"{s['ffn_flops_fraction']:.3f}" if isinstance(s.get("ffn_flops_fraction"), float) else "not recorded"),
                               html.Td(f"{load_cv:.3f}" if isinstance(load_cv, (int, float)) else "")]))
        plans[c["id"]] = [{"layer": r.get("layer"), "active_fraction": r.get("active_fraction")} for r in (c.get("layers") or [])]
    ppl = F.compare_perplexity(ppl_rows) if ppl_rows else F.message_figure("no evaluation yet: evaluate from the designer or routing explorer")
    active_rows = [{"conversion": k, **r} for k, rows in plans.items() for r in rows]
    return (html.Table([header, *body], className="list"), ppl, F.compare_active(plans), F.quality_vs_cost(cost_points),
            {"rows": ppl_rows, "filename": "perplexity"} if ppl_rows else None, {"rows": active_rows, "filename": "active_share"},
            error_box(None), search)
