"""Conversion designer, every method. The per-method parameter panels are built from the engine's
method registry (``GET /api/v1/methods``): each parameter gets one control with its help and paper
reference, so the designer offers exactly what a method reads. Methods with a preview redraw it
(``GET /profiles/{id}/preview/{method}``) on every move: the per-layer shared/routed plan and r_ℓ
(EW Fig. 7) for ExpertWeaver and CMoE, the chosen fusion for Dense2MoE. 'Convert' launches the job
and follows it; the result shows the plan, timings and evaluations.
State in the URL: ?profile=…&method=…&<parameter>=… (one key per parameter of the method)."""

from __future__ import annotations

from typing import Any

import dash
from dash import ALL, MATCH, Input, Output, State, callback, ctx, dcc, html, no_update

from frontend import figures as F
from frontend.api_client import ApiError, api
from frontend.components import builtin_source_options, error_box, figure_card, options, profile_picker, progress, to_search
from frontend.names import fmt

dash.register_page(__name__, path="/designer", name="Conversion designer", order=4)

N = "cd"
EVAL_WINDOWS, EVAL_TOKENS = 4, 64  # a quick first look; the button and the chart say how small
PARAM = "cd-param"  # pattern-matching id type of a parameter control: {"type", "method", "name"}
RECIPE, RECIPE_DIFF = "cd-recipe", "cd-recipe-diff"  # {"type", "method"}: recipe choice and its difference


def _methods() -> tuple[list[dict[str, Any]], str | None]:
    try:
        return api().methods(), None
    except ApiError as exc:
        return [], str(exc)


def _typed(spec: dict[str, Any], raw: Any) -> Any:
    """A URL value as the parameter's type (the default when absent or unreadable)."""
    if raw is None or raw == "":
        return spec["default"]
    try:
        return {"int": int, "float": float}.get(spec["type"], str)(raw)
    except ValueError:
        return spec["default"]


def _label(spec: dict[str, Any]) -> html.Label:
    paper = f" ({spec['paper']})" if spec.get("paper") else ""
    return html.Label(f"{spec['name']}{paper}", title=spec["help"])


def param_control(method: str, spec: dict[str, Any], value: Any) -> html.Div:
    """One control per parameter, chosen from its declaration: a dropdown for choices, a slider with
    its value always shown for a bounded share, a number box otherwise (empty means "choose")."""
    cid = {"type": PARAM, "method": method, "name": spec["name"]}
    lo = spec["ge"] if spec["ge"] is not None else spec["gt"]
    hi = spec["le"] if spec["le"] is not None else spec["lt"]
    if spec["choices"]:
        control = dcc.Dropdown(id=cid, options=spec["choices"], value=value, clearable=False, style={"width": 170})
    elif spec["type"] == "float" and lo is not None and hi is not None and hi - lo <= 2:
        step = 0.05  # one keyboard step moves a share by 5 points, as the designer always did
        lo_v, hi_v = lo + (step if spec["gt"] is not None else 0), hi - (step if spec["lt"] is not None else 0)
        control = dcc.Slider(id=cid, min=round(lo_v, 4), max=round(hi_v, 4), step=step, value=value, updatemode="drag",
                             marks=None, tooltip={"always_visible": True, "placement": "bottom"})
    else:
        control = dcc.Input(id=cid, type="number", value=value, step=1 if spec["type"] == "int" else "any",
                            min=lo, max=hi, placeholder="empty: choose" if spec["optional"] else None,
                            debounce=spec["type"] == "float")
    hint = html.Div(spec["help"], className="hint")
    if isinstance(control, dcc.Slider):  # help above: the value tooltip sits below the slider
        return html.Div(className="slider", style={"paddingBottom": 28}, children=[_label(spec), hint, control])
    return html.Div(className="param", children=[_label(spec), control, hint])


def method_panel(m: dict[str, Any], query: dict[str, Any], shown: bool) -> html.Div:
    """A method's parameters: the main ones, then the advanced ones folded under 'more'."""
    main = [param_control(m["name"], p, _typed(p, query.get(p["name"]))) for p in m["params"] if not p["advanced"]]
    more = [param_control(m["name"], p, _typed(p, query.get(p["name"]))) for p in m["params"] if p["advanced"]]
    children = [html.Div(f"{m['title']} ({m['paper']}): {m['summary']}", className="note")]
    recipes = m.get("recipes") or {}
    if len(recipes) > 1:  # "paper" (the defaults) and the measured "best"
        children.append(html.Div(className="controls", children=[
            html.Div([html.Label("recipe", title="paper: the paper's settings; best: the best training-free conversion "
                                                 "measured (bench_frontier) at the same cost"),
                      dcc.RadioItems(id={"type": RECIPE, "method": m["name"]}, options=list(recipes), value=None, inline=True)]),
            html.Div(id={"type": RECIPE_DIFF, "method": m["name"]}, className="hint"),
        ]))
    children.append(html.Div(main, className="controls"))
    if more:
        children.append(html.Details([html.Summary("more parameters"), html.Div(more, className="controls")]))
    return html.Div(children, id={"type": "cd-panel", "name": m["name"]}, style={} if shown else {"display": "none"})


def layout(profile: str | None = None, method: str = "expertweaver", **query: str):
    picker, profile, err = profile_picker(N, profile)
    methods, m_err = _methods()
    names = [m["name"] for m in methods]
    method = method if method in names else (names[0] if names else method)
    try:
        profiles, models = options(api().profiles()), options(api().models())
    except ApiError:
        profiles, models = [], []
    return html.Div([
        dcc.Location(id=f"{N}-url", refresh=False),
        html.H2("Conversion designer"),
        error_box(err or m_err),
        html.Div(className="controls", children=[
            picker,
            html.Div([html.Label("method"), dcc.RadioItems(id=f"{N}-method", value=method, inline=True,
                                                           options=[{"label": m["title"], "value": m["name"]} for m in methods])]),
        ]),
        *[method_panel(m, query, m["name"] == method) for m in methods],
        html.Div(className="controls", id=f"{N}-inputs-profiles", style={} if method == "midas" else {"display": "none"}, children=[
            html.Div([html.Label("other calibration sets' profiles (one expert per set)"),
                      dcc.Dropdown(id=f"{N}-extra_profiles", options=profiles, multi=True, style={"width": 420})]),
        ]),
        html.Div(className="controls", id=f"{N}-inputs-moe_model", style={} if method == "hierarchical" else {"display": "none"},
                 children=[
            html.Div([html.Label("MoE model"), dcc.Dropdown(id=f"{N}-moe_model", options=models, style={"width": 320})]),
            html.Div([html.Label("calibration"), dcc.Input(id=f"{N}-calibration", value=query.get("calibration", "builtin:mixed"), debounce=True)]),
        ]),
        dcc.Store(id=f"{N}-methods", data=methods),
        html.Div(id=f"{N}-error"),
        html.Div(id=f"{N}-summary", className="note"),
        html.Div(className="row", children=[figure_card(f"{N}-plan", "Preview", loading=False)]),
        html.Div(className="controls", children=[
            html.Button("Convert", id=f"{N}-convert", className="primary"),
            html.Div([html.Label("evaluate on"), dcc.Dropdown(id=f"{N}-eval-source", options=builtin_source_options(), value="builtin:mixed",
                                                              clearable=False, style={"width": 380})]),
            html.Button(f"Evaluate result ({EVAL_WINDOWS} windows × {EVAL_TOKENS} tokens)", id=f"{N}-evaluate", disabled=True),
        ]),
        html.Div(id=f"{N}-job"),
        html.Div(id=f"{N}-result"),
        dcc.Store(id=f"{N}-job-id"),
        dcc.Store(id=f"{N}-conversion-id"),
        dcc.Interval(id=f"{N}-poll", interval=1000, disabled=True),
    ])


def recipe_values(m: dict[str, Any], recipe: str) -> tuple[dict[str, Any], list[str]]:
    """Every parameter's value under ``recipe`` (the defaults, then its overrides) and the
    differences from the paper's settings in words."""
    over = (m.get("recipes") or {}).get(recipe) or {}
    defaults = {p["name"]: p["default"] for p in m["params"]}
    return {**defaults, **over}, [f"{k}: {defaults[k]} → {v}" for k, v in over.items() if defaults.get(k) != v]


@callback(Output({"type": PARAM, "method": MATCH, "name": ALL}, "value"), Output({"type": RECIPE_DIFF, "method": MATCH}, "children"),
          Input({"type": RECIPE, "method": MATCH}, "value"), State({"type": PARAM, "method": MATCH, "name": ALL}, "id"),
          State({"type": PARAM, "method": MATCH, "name": ALL}, "value"), State(f"{N}-methods", "data"), prevent_initial_call=True)
def _recipe(recipe, ids, current, methods):
    """Choosing a recipe sets every control of its method; ``sparsity`` (the cost asked for) is kept."""
    m = next((m for m in methods or [] if ids and m["name"] == ids[0]["method"]), None)
    if m is None or not recipe:
        return [no_update] * len(ids), no_update
    values, diff = recipe_values(m, recipe)
    keep = {i["name"]: v for i, v in zip(ids, current) if i["name"] == "sparsity"}
    values.update(keep)
    text = f"{recipe}: " + ("; ".join(diff) if diff else "the paper's settings") + (
        ". With plan 'budget', sparsity is of the FFN cost: ffn_flops_fraction ≤ 1 − sparsity." if values.get("plan") == "budget" else "")
    return [values[i["name"]] for i in ids], text


def chosen_params(method: str, values: list[Any], ids: list[dict[str, Any]]) -> dict[str, Any]:
    """The chosen method's parameter values (empty boxes are left out: the method's default applies)."""
    return {i["name"]: v for v, i in zip(values, ids) if i["method"] == method and v is not None and v != ""}


@callback(Output(f"{N}-inputs-profiles", "style"), Output(f"{N}-inputs-moe_model", "style"),
          Output({"type": "cd-panel", "name": ALL}, "style"), Input(f"{N}-method", "value"), State(f"{N}-methods", "data"))
def _panels(method, methods):
    """Only the chosen method's parameters and inputs are shown."""
    needs = next((m["needs"] for m in methods or [] if m["name"] == method), "profile")
    hide = {"display": "none"}
    return ({} if needs == "profiles" else hide, {} if needs == "moe_model" else hide,
            [{} if m["name"] == method else hide for m in methods or []])


@callback(Output(f"{N}-plan", "figure"), Output({"type": "csv-data", "name": f"{N}-plan"}, "data"), Output(f"{N}-summary", "children"),
          Output(f"{N}-error", "children"), Output(f"{N}-url", "search"),
          Input(f"{N}-profile", "value"), Input(f"{N}-method", "value"), Input({"type": PARAM, "method": ALL, "name": ALL}, "value"),
          State({"type": PARAM, "method": ALL, "name": ALL}, "id"), State(f"{N}-methods", "data"))
def _preview(profile, method, values, ids, methods):
    params = chosen_params(method, values, ids)
    search = to_search(profile=profile, method=method, **params)
    m = next((m for m in methods or [] if m["name"] == method), None)
    if m is None or not m["preview"]:
        note = f"{m['title']}: {m['summary']}. No preview: it reads {m['needs'].replace('_', ' ')}." if m else ""
        return F.message_figure("no preview for this method"), None, note, error_box(None), search
    if not profile:
        return F.message_figure("choose a ready profile"), None, "", error_box("no profile chosen: create one on the Workspace page"), search
    try:
        preview = api().method_preview(profile, method, **params)
    except ApiError as exc:
        return F.message_figure(str(exc)), None, "", error_box(str(exc)), search
    s = preview["summary"]
    if preview.get("fusion"):
        f = preview["fusion"]
        test = f"< δ {f['delta']:g}" if f.get("rank") is not None else "(l*, n* given: no δ test)"
        text = (f"fuse layers {s['removed_layers']} into layer {s['fused_layer']} (S_L {f['s_layer']:.3f}, MLP-input distance "
                f"{1 - f['s_mlp']:.3f} {test}): {s['layers_before']} → {s['layers_after']} layers, "
                f"{s['n_experts']} experts, top-{s['top_k']}.")
        return F.message_figure(text), {"kind": "fusion", "data": preview, "filename": "fusion"}, text, error_box(None), search
    text = [f"active {s['active_fraction']:.1%} of FFN neurons (neuron sparsity {s['sparsity']:.1%}), mean α {s['mean_alpha']:.2f}."]
    if s.get("ffn_flops_fraction") is not None:
        text.append(f" FFN cost {s['ffn_flops_fraction']:.3f} of dense (ffn_flops_fraction: multiply-adds per token, router included).")
    if s.get("plan_note"):
        text.append(html.Span(" " + s["plan_note"] + ".", className="aggregated"))
    if s.get("clamped_layers"):
        text.append(html.Span(f" Clamped layers {s['clamped_layers']}: Eq. 6 asked for more shared experts than the active budget; "
                              "lower α_max, raise τ or use α basis 'active'.", className="aggregated"))
    if s.get("static_layers"):
        text.append(html.Span(f" Static layers {s['static_layers']}: no routed expert runs there (a fixed prune).", className="aggregated"))
    return F.allocation_plan(preview), {"kind": "allocation", "data": preview, "filename": "allocation_plan"}, text, error_box(None), search


@callback(Output(f"{N}-job-id", "data"), Output(f"{N}-conversion-id", "data"), Output(f"{N}-poll", "disabled"),
          Output(f"{N}-job", "children", allow_duplicate=True),
          Input(f"{N}-convert", "n_clicks"), Input(f"{N}-evaluate", "n_clicks"),
          State(f"{N}-conversion-id", "data"), State(f"{N}-profile", "value"), State(f"{N}-method", "value"),
          State({"type": PARAM, "method": ALL, "name": ALL}, "value"), State({"type": PARAM, "method": ALL, "name": ALL}, "id"),
          State(f"{N}-extra_profiles", "value"), State(f"{N}-moe_model", "value"), State(f"{N}-calibration", "value"),
          State(f"{N}-methods", "data"), State(f"{N}-eval-source", "value"), prevent_initial_call=True)
def _launch(_c, _e, conversion_id, profile, method, values, ids, extra_profiles, moe_model, calibration, methods, eval_source):
    try:
        if ctx.triggered_id == f"{N}-evaluate":
            if not conversion_id:
                return no_update, no_update, True, error_box("convert first")
            created = api().create_evaluation(conversion_id, source=eval_source or "builtin:mixed", n_windows=EVAL_WINDOWS, seq_len=EVAL_TOKENS)
            return created["job_id"], conversion_id, False, progress(created.get("job"))
        needs = next((m["needs"] for m in methods or [] if m["name"] == method), "profile")
        body: dict[str, Any] = {"method": method, method: chosen_params(method, values, ids)}
        if needs == "moe_model":
            body.update(model_id=moe_model, calibration=calibration)
        else:
            if not profile:
                return no_update, no_update, True, error_box("choose a profile first")
            body["profile_id"] = profile
            if needs == "profiles":
                body["extra_profile_ids"] = list(extra_profiles or [])
        created = api().create_conversion(**body)
    except ApiError as exc:
        return no_update, no_update, True, error_box(f"could not start: {exc}")
    return created["job_id"], created["id"], False, progress(created.get("job"))


@callback(Output(f"{N}-job", "children"), Output(f"{N}-poll", "disabled", allow_duplicate=True), Output(f"{N}-result", "children"),
          Output(f"{N}-evaluate", "disabled"),
          Input(f"{N}-poll", "n_intervals"), State(f"{N}-job-id", "data"), State(f"{N}-conversion-id", "data"), prevent_initial_call=True)
def _poll(_n, job_id, conversion_id):
    if not job_id:
        return no_update, True, no_update, True
    try:
        job = api().job(job_id)
    except ApiError as exc:
        return error_box(str(exc)), True, no_update, True
    done = job["state"] in ("succeeded", "failed", "cancelled")
    result = no_update
    if done and conversion_id:
        result = _result(conversion_id)
    return progress(job), done, result, not (done and job["state"] == "succeeded" and conversion_id)


def _result(conversion_id: str) -> html.Div:
    """Plan summary, timings, and — once evaluated — perplexity vs baselines and per-layer reconstruction error."""
    try:
        conv = api().conversion(conversion_id)
        evals = [e for e in api().evaluations(conversion_id) if e["status"] == "ready"]
        report = api().evaluation_report(evals[0]["id"]) if evals else None
    except ApiError as exc:
        return error_box(str(exc))
    s = conv.get("summary") or {}
    children = [html.H3(f"Conversion {conversion_id}: {conv['status']}"),
                html.Div(", ".join(f"{k}: {fmt(v)}" for k, v in s.items() if not isinstance(v, (dict, list))), className="note"),
                dcc.Link("open in routing explorer", href=f"/routing?conversion={conversion_id}"), html.Span(" · "),
                dcc.Link("compare", href=f"/compare?ids={conversion_id}"), html.Span(" · "),
                dcc.Link("token routing", href=f"/tokens?a={conversion_id}"), html.Span(" · "),
                dcc.Link("playground", href=f"/playground?conversion={conversion_id}")]
    for note in s.get("notes") or []:
        children.append(html.Div(f"layer {note['layer']}: {note['note']}", className="aggregated"))
    timings = (conv.get("job") or {}).get("timings") or s.get("timings")
    if isinstance(timings, dict):
        children.append(html.Div("timings: " + ", ".join(f"{k} {v:.2f} s" if isinstance(v, (int, float)) else f"{k} {v}"
                                                          for k, v in timings.items()), className="note"))
    if not evals:
        children.append(html.Div("Not evaluated yet: press 'Evaluate result' for perplexity vs dense and baselines.", className="note"))
        return html.Div(children, className="card", id=f"{N}-result-card")
    rows = F.perplexity_rows([conv], {conversion_id: evals[:1]})  # the newest evaluation, labelled with its text and size
    children.append(html.Div(className="row", children=[
        dcc.Graph(id=f"{N}-ppl", figure=F.compare_perplexity(rows)),
        dcc.Graph(id=f"{N}-recon", figure=F.reconstruction_error(report or {})),
    ]))
    return html.Div(children, className="card", id=f"{N}-result-card")
