"""Compare conversions: two or more side by side (parameters, FFN cost, perplexity, quality vs cost and vs
measured speed per phase, per-layer active share, load CV). State in the URL: ?ids=c1,c2[&phase=decode_b8]

"sparsity" is the method's own parameter (EW: the share of neurons not computed per token); what
conversions are compared at is their recorded ``ffn_flops_fraction``, FFN multiply-adds per token,
router and scoring included, over the dense FFN's."""

from __future__ import annotations


import dash
from dash import Input, Output, callback, dcc, html

from frontend.figures import compare as F, common as FC
from moelab.api_client import ApiError, api
from frontend.components import error_box, figure_card, named_options, page_names, to_search
from frontend.speed import KERNEL_DENSE, PHASES, phase_speedup
from frontend.task_accuracy import accuracy_figure, accuracy_points
from frontend.names import calibration_of, calibration_spec, chart_label, domain_relation, fmt, fmt_pct, heldout_spec, with_id

dash.register_page(__name__, path="/compare", name="Compare conversions", order=9)

N = "cc"
HEADERS = {"sparsity": "sparsity (parameter)"}  # the cost compared at is ffn_flops_fraction, its own column


def per_layer(conversion: dict, key: str, param: str) -> str:
    """A conversion's per-layer count (``n_shared``, ``top_k`` of its plan's layers: '39', or '37–39' when layers
    differ), else its parameter of that meaning (CMoE's S, A), else '' (a method without experts of that kind)."""
    values = sorted({int(r[key]) for r in conversion.get("layers") or [] if isinstance(r.get(key), (int, float))})
    if values:
        return str(values[0]) if len(values) == 1 else f"{values[0]}–{values[-1]}"
    given = (conversion.get("params") or {}).get(param)
    return fmt(given) if given is not None else ""


def layout(ids: str | None = None, phase: str | None = None, **_):
    try:
        convs, err = named_options("conversions"), None
    except ApiError as exc:
        convs, err = [], str(exc)
    chosen = [i for i in (ids or "").split(",") if i] or [c["value"] for c in convs[:2]]
    return html.Div([
        dcc.Location(id=f"{N}-url", refresh=False),
        html.H2("Compare conversions"),
        error_box(err),
        html.Div(className="controls", children=[
            html.Div([html.Label("conversions"), dcc.Dropdown(id=f"{N}-ids", options=convs, value=chosen, multi=True, style={"width": 640})]),
            html.Div([html.Label("speed measured in"),
                      dcc.RadioItems(id=f"{N}-phase", options=[{"label": name, "value": k} for k, name in PHASES.items()],
                                     value=phase if phase in PHASES else "decode_b1", inline=True)]),
        ]),
        html.Div(id=f"{N}-error"),
        html.Div(id=f"{N}-table", className="table-scroll"),  # a wide table scrolls in its own box, not the page
        html.Div(className="row", children=[figure_card(f"{N}-ppl", "Perplexity")]),  # full width: one panel per text
        html.Div(className="row", children=[figure_card(f"{N}-cost", "Quality vs cost"), figure_card(f"{N}-speed", "Quality vs measured speed")]),
        html.Div(className="row", children=[figure_card(f"{N}-active", "Active share per layer")]),
        html.Div(className="row", children=[figure_card(f"{N}-acc-cost", "Accuracy vs cost (lm-eval tasks)"),
                                            figure_card(f"{N}-acc-speed", "Accuracy vs measured speed")]),
    ])


@callback(Output(f"{N}-acc-cost", "figure"), Output(f"{N}-acc-speed", "figure"),
          Output({"type": "csv-data", "name": f"{N}-acc-cost"}, "data"), Input(f"{N}-ids", "value"), Input(f"{N}-phase", "value"))
def _accuracy(ids, phase):
    """Each conversion's newest evaluation with tasks: accuracy against FFN cost and against the speed measured
    in that evaluation, the marker saying whether the task's text is in the conversion's calibration domain."""
    if not ids:
        fig = FC.message_figure("choose conversions to compare")
        return fig, fig, None
    try:
        convs = [api().conversion(i) for i in ids]
        evals = {i: api().evaluations(i) for i in ids}
        names = page_names()
        task_sets = {t["name"]: t.get("domain") for t in api().tasks()}
        builtins = {b["name"]: b.get("domains") or [b["name"]] for b in api().builtin_sets()}
        methods = {m["name"]: m for m in api().methods()}
    except ApiError as exc:
        fig = FC.message_figure(str(exc))
        return fig, fig, None
    labels = {c["id"]: chart_label(c, names, methods)[0] for c in convs}

    def task_domain(c, task):
        return domain_relation(calibration_spec(c, names), task_sets.get(task), builtins)

    points = accuracy_points(convs, evals, labels, task_domain)
    return (accuracy_figure(points, "ffn_flops_fraction"), accuracy_figure(points, f"speed_{phase}"),
            {"rows": points, "filename": "accuracy"} if points else None)


@callback(Output(f"{N}-table", "children"), Output(f"{N}-ppl", "figure"), Output(f"{N}-active", "figure"), Output(f"{N}-cost", "figure"),
          Output(f"{N}-speed", "figure"),
          Output({"type": "csv-data", "name": f"{N}-ppl"}, "data"), Output({"type": "csv-data", "name": f"{N}-active"}, "data"),
          Output({"type": "csv-data", "name": f"{N}-cost"}, "data"), Output({"type": "csv-data", "name": f"{N}-speed"}, "data"),
          Output(f"{N}-error", "children"), Output(f"{N}-url", "search"), Input(f"{N}-ids", "value"), Input(f"{N}-phase", "value"))
def _update(ids, phase):
    ids = ids or []
    search = to_search(ids=",".join(ids), phase=phase if phase != "decode_b1" else None)
    if not ids:
        fig = FC.message_figure("choose conversions to compare")
        return None, fig, fig, fig, fig, None, None, None, None, error_box("no conversion chosen"), search
    try:
        convs = [api().conversion(i) for i in ids]
        evals = {i: api().evaluations(i) for i in ids}
        names = page_names()
    except ApiError as exc:
        fig = FC.message_figure(str(exc))
        return None, fig, fig, fig, fig, None, None, None, None, error_box(str(exc)), search
    try:
        methods = {m["name"]: m for m in api().methods()}
        builtins = {b["name"]: b.get("domains") or [b["name"]] for b in api().builtin_sets()}
    except ApiError:  # recipes and domains are a help for the labels, not the data
        methods, builtins = {}, {}
    keys = ["n_experts", "alpha_min", "alpha_max", "tau", "plan"]
    header = html.Tr([html.Th(h) for h in ("conversion", "id", "status", "method", "router", HEADERS["sparsity"])]
                     + [html.Th(HEADERS.get(k, k)) for k in keys] + [html.Th("shared experts / layer"), html.Th("routed top-k / layer")]
                     + [html.Th("active neuron fraction"), html.Th("FFN cost (ffn_flops_fraction)"), html.Th("load CV (mean)")])
    label = {c["id"]: names.conversion(c) for c in convs}
    short = {c["id"]: chart_label(c, names, methods) for c in convs}
    ppl_rows = F.perplexity_rows(convs, evals, {i: s[0] for i, s in short.items()})
    body, plans, cost_points = [], {}, []
    for c in convs:
        params = c["params"] or {}
        s = c.get("summary") or {}
        load_cv = None
        for r in ppl_rows:  # newest evaluation per text (perplexity_rows keeps one per text)
            if r["conversion_id"] != c["id"] or r["variant"] != "converted":
                continue
            ev = next(e for e in evals[c["id"]] if e["id"] == r["evaluation_id"])
            d = ev["summary"]["variants"]["converted"]
            cv = d.get("load_cv") if d.get("load_cv") is not None else d.get("mean_load_cv")
            if load_cv is None and isinstance(cv, (int, float)):
                load_cv = f"{cv:.3f} on {r['text']}"
            cost_points.append({"conversion_id": c["id"], "conversion": label[c["id"]], "label": short[c["id"]][0],
                                "domain": domain_relation(calibration_spec(c, names), heldout_spec(ev, names), builtins),
                                "calibration_set": calibration_of(c, names), "method": c.get("method"), "recipe": short[c["id"]][1],
                                "text": r["text"], "evaluation_id": r["evaluation_id"],
                                "ffn_flops_fraction": s.get("ffn_flops_fraction"), "perplexity_ratio": r["ratio_to_dense"],
                                **{f"speed_{p}": phase_speedup(ev["summary"], p) for p in PHASES},
                                **{f"kernels_{p}": phase_speedup(ev["summary"], p, KERNEL_DENSE) for p in PHASES}})
        body.append(html.Tr([html.Td(label[c["id"]]), html.Td(c["id"], className="note"), html.Td(c["status"]), html.Td(c.get("method")),
                             html.Td(params.get("router") or ""), html.Td(fmt_pct(params.get("sparsity")))]
                            + [html.Td(fmt(params.get(k))) for k in keys]
                            + [html.Td(per_layer(c, "n_shared", "shared")), html.Td(per_layer(c, "top_k", "active"))]
                            + [html.Td(fmt(s.get("active_fraction"), 3)),
                               html.Td(fmt(s.get("ffn_flops_fraction"), 3) if s.get("ffn_flops_fraction") is not None else "not recorded"),
                               html.Td(load_cv or "")]))
        plans[with_id(short[c["id"]][0], c["id"])] = [{"layer": r.get("layer"), "active_fraction": r.get("active_fraction")}
                                                      for r in (c.get("layers") or [])]
    ppl = F.compare_perplexity(ppl_rows)
    active_rows = [{"conversion": k, **r} for k, rows in plans.items() for r in rows]
    csv_rows = [{k: v for k, v in r.items() if k != "text_key"} for r in ppl_rows]
    cost_rows = F.quality_cost_points(cost_points)  # exactly the points the chart draws
    speed_rows = F.quality_cost_points(cost_points, f"speed_{phase}")
    return (html.Table([header, *body], className="list"), ppl, F.compare_active(plans), F.quality_vs_cost(cost_points),
            F.quality_vs_cost(cost_points, f"speed_{phase}"),
            {"rows": csv_rows, "filename": "perplexity"} if csv_rows else None, {"rows": active_rows, "filename": "active_share"},
            {"rows": cost_rows, "filename": "quality_vs_cost"} if cost_rows else None,
            {"rows": speed_rows, "filename": f"quality_vs_speed_{phase}"} if speed_rows else None,
            error_box(None), search)
