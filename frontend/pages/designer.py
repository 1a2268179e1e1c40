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

from frontend.figures import designer as F, common as FC, compare as FX
from moelab.api_client import ApiError, api
from frontend.exportability import ui_words
from frontend.param_controls import param_bounds, param_step
from frontend.components import (baselines_choice, builtin_source_options, cancel_started, error_box, figure_card, memory_budget,
                                 memory_budget_input, options, profile_picker, progress, to_search, wants_baselines)
from frontend.names import fmt
from frontend.speed import predicted_speed_words, slower_phases
from moelab.engine.methods.labels import collapse_notes, layer_span

dash.register_page(__name__, path="/designer", name="Conversion designer", order=5)

N = "cd"
EVAL_WINDOWS, EVAL_TOKENS = 4, 64  # a quick first look; the button and the chart say how small
PARAM = "cd-param"  # pattern-matching id type of a parameter control: {"type", "method", "name"}
RECIPE, RECIPE_DIFF = "cd-recipe", "cd-recipe-diff"  # {"type", "method"}: recipe choice and its difference
#: how the recipe choice names a recipe (the API lists them by name, ``Method.describe``)
RECIPE_LABELS = {"portable": "portable (exportable to GGUF / native HF)"}


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


def bound_text(spec: dict[str, Any]) -> str:
    """The engine's bounds of a parameter in words: '> 0', '≥ 0 and ≤ 1'."""
    parts = [f"{op} {fmt(spec[k])}" for k, op in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")) if spec.get(k) is not None]
    return " and ".join(parts)


def param_problem(spec: dict[str, Any], value: Any) -> str | None:
    """Why a control's value cannot be previewed or converted, in words (None: it can): a number
    outside the engine's bounds (``ge``/``gt``/``le``/``lt``), or a required number left empty or
    not accepted by the box (the browser hands over no value for one off its steps)."""
    if spec["type"] not in ("int", "float") or spec["choices"]:
        return None
    bounds = bound_text(spec)
    need = f"a{'n integer' if spec['type'] == 'int' else ' number'}" + (f" {bounds}" if bounds else "")
    if value is None or value == "":
        if spec["optional"]:
            return None
        step = param_step(spec)
        return f"{spec['name']}: enter {need}" + (f", in steps of {fmt(step)}" if spec["type"] == "float" else "")
    v = float(value)
    if ((spec["ge"] is not None and v < spec["ge"]) or (spec["gt"] is not None and v <= spec["gt"])
            or (spec["le"] is not None and v > spec["le"]) or (spec["lt"] is not None and v >= spec["lt"])):
        return f"{spec['name']} = {fmt(value)} is out of bounds: it must be {bounds}"
    return None


def param_control(method: str, spec: dict[str, Any], value: Any) -> html.Div:
    """One control per parameter, chosen from its declaration: a dropdown for choices, a slider with
    its value always shown for a bounded share, a number box otherwise (empty means "choose"). The
    step and bounds come from the declaration (:func:`param_step`, :func:`param_bounds`)."""
    cid = {"type": PARAM, "method": method, "name": spec["name"]}
    lo, hi = param_bounds(spec)
    step = param_step(spec)
    if spec["choices"]:
        control = dcc.Dropdown(id=cid, options=spec["choices"], value=value, clearable=False, style={"width": 170})
    elif spec["type"] == "float" and lo is not None and hi is not None and hi - lo <= 2:
        control = dcc.Slider(id=cid, min=lo, max=hi, step=step, value=value, updatemode="drag",
                             marks=None, tooltip={"always_visible": True, "placement": "bottom"})
    else:
        control = dcc.Input(id=cid, type="number", value=value, step=step, min=lo, max=hi,
                            placeholder="empty: choose" if spec["optional"] else None, debounce=spec["type"] == "float")
    bounds = bound_text(spec)
    hint = html.Div(spec["help"] + (f" ({bounds})" if bounds and not isinstance(control, dcc.Slider) else ""), className="hint")
    if isinstance(control, dcc.Slider):  # help above: the value tooltip sits below the slider
        return html.Div(className="slider", style={"paddingBottom": 28}, children=[_label(spec), hint, control])
    return html.Div(className="param", children=[_label(spec), control, hint])


def initial_recipe(m: dict[str, Any], query: dict[str, Any]) -> str | None:
    """The recipe a method's panel starts at: the URL's ``recipe`` when the method has it, else
    'paper' (its defaults); None for a method without recipes to choose from."""
    recipes = m.get("recipes") or {}
    if len(recipes) < 2:
        return None
    wanted = query.get("recipe")
    return wanted if wanted in recipes else ("paper" if "paper" in recipes else next(iter(recipes)))


def initial_values(m: dict[str, Any], query: dict[str, Any]) -> dict[str, Any]:
    """Every control's starting value: the recipe's (:func:`initial_recipe`), then the URL's own
    value of each parameter on top (a link keeps exactly what it says)."""
    recipe = initial_recipe(m, query)
    values = recipe_values(m, recipe)[0] if recipe else {p["name"]: p["default"] for p in m["params"]}
    return {p["name"]: _typed({**p, "default": values[p["name"]]}, query.get(p["name"])) for p in m["params"]}


def recipe_text(recipe: str, diff: list[str], plan: Any) -> str:
    """What a recipe changes from the paper's settings, in words."""
    return f"{recipe}: " + ("; ".join(diff) if diff else "the paper's settings") + (
        ". With plan 'budget', sparsity is of the FFN cost: ffn_flops_fraction ≤ 1 − sparsity." if plan == "budget" else
        ". With plan 'leading', sparsity is of the FFN cost (ffn_flops_fraction ≤ 1 − sparsity), and the model exports to "
        "GGUF / native HF after recovery fine-tuning in mode expertweaver." if plan == "leading" else "")


def method_panel(m: dict[str, Any], query: dict[str, Any], shown: bool) -> html.Div:
    """A method's parameters: the main ones, then the advanced ones folded under 'more'; the recipe
    choice starts at the URL's ``recipe`` or 'paper', its controls at that recipe's values."""
    values = initial_values(m, query)
    main = [param_control(m["name"], p, values[p["name"]]) for p in m["params"] if not p["advanced"]]
    more = [param_control(m["name"], p, values[p["name"]]) for p in m["params"] if p["advanced"]]
    children = [html.Div(f"{m['title']} ({m['paper']}): {m['summary']}", className="note")]
    recipes = m.get("recipes") or {}
    recipe = initial_recipe(m, query)
    if recipe:  # "paper" (the defaults), the measured "best" and, where it differs, the exportable "portable"
        options = [{"label": RECIPE_LABELS.get(r, r), "value": r} for r in recipes]
        children.append(html.Div(className="controls", children=[
            html.Div([html.Label("recipe", title="paper: the paper's settings; best: the best training-free conversion "
                                                 "measured (bench_frontier) at the same cost; portable: the best one "
                                                 "that exports to GGUF / native HF once recovered (mode expertweaver)"),
                      dcc.RadioItems(id={"type": RECIPE, "method": m["name"]}, options=options, value=recipe, inline=True)]),
            html.Div(recipe_text(recipe, recipe_values(m, recipe)[1], values.get("plan")),
                     id={"type": RECIPE_DIFF, "method": m["name"]}, className="hint recipe-diff"),
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
    needs = next((m["needs"] for m in methods if m["name"] == method), "profile")  # which inputs besides a profile
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
        html.Div(className="controls", id=f"{N}-inputs-profiles", style={} if needs == "profiles" else {"display": "none"}, children=[
            html.Div([html.Label("other calibration sets' profiles (one expert per set)"),
                      dcc.Dropdown(id=f"{N}-extra_profiles", options=profiles, multi=True, style={"width": 420})]),
        ]),
        html.Div(className="controls", id=f"{N}-inputs-moe_model", style={} if needs == "moe_model" else {"display": "none"},
                 children=[
            html.Div([html.Label("MoE model"), dcc.Dropdown(id=f"{N}-moe_model", options=models, style={"width": 320})]),
            html.Div([html.Label("calibration"), dcc.Input(id=f"{N}-calibration", value=query.get("calibration", "builtin:mixed"), debounce=True)]),
        ]),
        dcc.Store(id=f"{N}-methods", data=methods),
        html.Div(id=f"{N}-error"),
        html.Div(id=f"{N}-summary", className="note"),
        html.Div(id=f"{N}-banner", className="banner"),  # what the preview cannot show (a budget plan's fitted top-k)
        html.Div(id=f"{N}-export-note", className="note export-note"),  # whether the result will export (GGUF / native)
        dcc.Store(id=f"{N}-family"),  # the profiled model's family (what the exports can express)
        html.Div(className="row", children=[figure_card(f"{N}-plan", "Preview", loading=False)]),
        html.Div(className="controls", children=[
            html.Button("Convert", id=f"{N}-convert", className="primary"),
            html.Button("Cancel", id=f"{N}-cancel", className="small", title="cancel the running conversion or evaluation"),
            dcc.Checklist(id=f"{N}-allow-pruned", options=[{"label": "convert even with pruned layers", "value": "allow"}], value=[],
                          inline=True),
            memory_budget_input(f"{N}-max-memory", "conversion (expertweaver, cmoe)"),
            html.Div([html.Label("evaluate on"), dcc.Dropdown(id=f"{N}-eval-source", options=builtin_source_options(), value="builtin:mixed",
                                                              clearable=False, style={"width": 380})]),
            baselines_choice(f"{N}-eval-baselines"),
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
    return [values[i["name"]] for i in ids], recipe_text(recipe, diff, values.get("plan"))


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


def budget_banner(preview: dict[str, Any]) -> str | None:
    """What a preview of a ``plan="budget"`` or ``"leading"`` conversion can and cannot show, in words (None for
    other plans): the per-layer top-k is fitted on calibration tokens at conversion
    (``core.fitting``), so the chart is the starting plan; the other parameters it was drawn with."""
    p = preview.get("params") or {}
    used = ", ".join(f"{k} {p[k]}" for k in ("router", "alpha_basis", "compensation") if p.get(k) is not None)
    if p.get("plan") == "leading":
        return ("Leading plan: how many leading layers stay dense and the one top-k of the others are fitted on calibration "
                f"tokens at conversion, so this preview shows the uniform starting plan (drawn with {used}) and the cost "
                f"cap {F.budget_cap(preview)}; after recovery in mode expertweaver the model exports to GGUF / native HF.")
    if not F.budget_plan(preview):
        return None
    return ("Budget plan: the per-layer top-k is fitted on calibration tokens at conversion, so this preview shows the "
            f"starting plan (drawn with {used}) and the cost cap {F.budget_cap(preview)}; the converted model "
            "records the per-layer top-k it chose.")


def recipe_of_panel(method: str, recipes: list[Any], recipe_ids: list[dict[str, Any]]) -> str | None:
    """The chosen method's recipe radio value (None: the method has none)."""
    return next((v for v, i in zip(recipes or [], recipe_ids or []) if i["method"] == method), None)


@callback(Output(f"{N}-plan", "figure"), Output({"type": "csv-data", "name": f"{N}-plan"}, "data"), Output(f"{N}-summary", "children"),
          Output(f"{N}-banner", "children"), Output(f"{N}-error", "children"), Output(f"{N}-url", "search"),
          Input(f"{N}-profile", "value"), Input(f"{N}-method", "value"), Input({"type": PARAM, "method": ALL, "name": ALL}, "value"),
          State({"type": PARAM, "method": ALL, "name": ALL}, "id"), State(f"{N}-methods", "data"),
          State({"type": RECIPE, "method": ALL}, "value"), State({"type": RECIPE, "method": ALL}, "id"))
def _preview(profile, method, values, ids, methods, recipes, recipe_ids):
    params = chosen_params(method, values, ids)
    search = to_search(profile=profile, method=method, recipe=recipe_of_panel(method, recipes, recipe_ids), **params)
    m = next((m for m in methods or [] if m["name"] == method), None)
    if m is None or not m["preview"]:
        note = f"{m['title']}: {m['summary']}. No preview: it reads {m['needs'].replace('_', ' ')}." if m else ""
        return FC.message_figure("no preview for this method"), None, note, None, error_box(None), search
    if not profile:
        return (FC.message_figure("choose a ready profile"), None, "", None, error_box("no profile chosen: create one on the Workspace page"),
                search)
    problems = params_problems(m, method, values, ids)
    if problems:  # said before the API is asked: the bound, not a blank chart
        text = "; ".join(problems)
        return FC.message_figure(text), None, "", None, error_box(text), search
    try:
        preview = api().method_preview(profile, method, **params)
    except ApiError as exc:
        return FC.message_figure(str(exc)), None, "", None, error_box(str(exc)), search
    s = preview["summary"]
    if preview.get("fusion"):
        f = preview["fusion"]
        test = f"< δ {f['delta']:g}" if f.get("rank") is not None else "(l*, n* given: no δ test)"
        text = (f"fuse layers {s['removed_layers']} into layer {s['fused_layer']} (S_L {f['s_layer']:.3f}, MLP-input distance "
                f"{1 - f['s_mlp']:.3f} {test}): {s['layers_before']} → {s['layers_after']} layers, "
                f"{s['n_experts']} experts, top-{s['top_k']}.")
        return FC.message_figure(text), {"kind": "fusion", "data": preview, "filename": "fusion"}, text, None, error_box(None), search
    budget = budget_banner(preview)
    start = "starting plan: " if budget else ""
    text = [f"{start}active {s['active_fraction']:.1%} of FFN neurons (neuron sparsity {s['sparsity']:.1%}), mean α {s['mean_alpha']:.2f}."]
    if s.get("ffn_flops_fraction") is not None:
        text.append(f" FFN cost {s['ffn_flops_fraction']:.3f} of dense (ffn_flops_fraction: multiply-adds per token, router included).")
    if s.get("predicted_speed"):
        text.append(html.Span(" " + predicted_speed_words(s["predicted_speed"]), id=f"{N}-speed",
                              className="slower" if slower_phases(s["predicted_speed"]) else "note"))
    if s.get("plan_note") and not budget:
        text.append(html.Span(" " + s["plan_note"] + ".", className="aggregated"))
    if s.get("clamped_layers"):
        text.append(html.Span(f" Clamped layers {s['clamped_layers']}: Eq. 6 asked for more shared experts than the active budget; "
                              "lower α_max, raise τ or use α basis 'active'.", className="aggregated"))
    if s.get("static_layers"):
        text.append(html.Span(" " + pruned_warning(s["static_layers"]), className="error", id=f"{N}-pruned"))
    return (F.allocation_plan(preview), {"kind": "allocation", "data": preview, "filename": "allocation_plan"}, text, budget,
            error_box(None), search)


def pruned_warning(static: list[int]) -> str:
    """What a plan with layers of no routed expert costs, in words, and what to do."""
    return (f"This plan runs no routed expert in {layer_span(static)} ({len(static)} of the model's FFNs reduced to their shared "
            "part: a fixed prune, not an MoE layer). Expect a large loss: on the default model the paper recipe at sparsity 0.5 "
            "pruned 8 layers this way and measured 20× dense perplexity on code and 23× on literature. Lower the sparsity, "
            "raise τ or use the 'best' recipe; Convert asks you to tick 'convert even with pruned layers' first.")


@callback(Output(f"{N}-family", "data"), Input(f"{N}-profile", "value"))
def _family(profile):
    """The family (llama, qwen3 …) of the chosen profile's model, for the export note."""
    if not profile:
        return None
    try:
        model_id = api().profile(profile).get("model_id")
        model = next((m for m in api().models() if m["id"] == model_id), None)
    except ApiError:
        return None
    return ((model or {}).get("info") or {}).get("family")


@callback(Output(f"{N}-export-note", "children"), Input(f"{N}-method", "value"),
          Input({"type": PARAM, "method": ALL, "name": ALL}, "value"), Input(f"{N}-family", "data"),
          State({"type": PARAM, "method": ALL, "name": ALL}, "id"))
def _export_note(method, values, family, ids):
    """Whether the planned conversion will export to GGUF / native, from its parameters (the API's export plan)."""
    if not method:
        return None
    try:
        plan = api().export_plan(method, chosen_params(method, values, ids), family)
    except ApiError as exc:
        return html.Span(f"GGUF / native export: not known ({exc})", className="export-no")
    return html.Span(ui_words(plan["text"]), className=f"export-{plan['verdict']}")


def params_problems(m: dict[str, Any], method: str, values: list[Any], ids: list[dict[str, Any]]) -> list[str]:
    """Every control of ``method`` whose value the engine would refuse (:func:`param_problem`)."""
    specs = {p["name"]: p for p in m["params"]}
    return [msg for v, i in zip(values, ids) if i["method"] == method and i["name"] in specs
            if (msg := param_problem(specs[i["name"]], v))]


@callback(Output(f"{N}-job-id", "data"), Output(f"{N}-conversion-id", "data"), Output(f"{N}-poll", "disabled"),
          Output(f"{N}-job", "children", allow_duplicate=True),
          Input(f"{N}-convert", "n_clicks"), Input(f"{N}-evaluate", "n_clicks"),
          State(f"{N}-conversion-id", "data"), State(f"{N}-profile", "value"), State(f"{N}-method", "value"),
          State({"type": PARAM, "method": ALL, "name": ALL}, "value"), State({"type": PARAM, "method": ALL, "name": ALL}, "id"),
          State(f"{N}-extra_profiles", "value"), State(f"{N}-moe_model", "value"), State(f"{N}-calibration", "value"),
          State(f"{N}-methods", "data"), State(f"{N}-eval-source", "value"), State(f"{N}-eval-baselines", "value"),
          State(f"{N}-allow-pruned", "value"), State(f"{N}-max-memory", "value"), prevent_initial_call=True)
def _launch(_c, _e, conversion_id, profile, method, values, ids, extra_profiles, moe_model, calibration, methods, eval_source,
            eval_baselines, allow_pruned, max_memory):
    try:
        if ctx.triggered_id == f"{N}-evaluate":
            if not conversion_id:
                return no_update, no_update, True, error_box("convert first")
            created = api().create_evaluation(conversion_id, source=eval_source or "builtin:mixed", n_windows=EVAL_WINDOWS,
                                              seq_len=EVAL_TOKENS, baselines=wants_baselines(eval_baselines))
            return created["job_id"], conversion_id, False, progress(created.get("job"))
        m = next((m for m in methods or [] if m["name"] == method), None)
        needs = m["needs"] if m else "profile"
        if m and (problems := params_problems(m, method, values, ids)):
            return no_update, no_update, True, error_box("; ".join(problems))
        body: dict[str, Any] = {"method": method, method: chosen_params(method, values, ids)}
        if needs == "moe_model":
            body.update(model_id=moe_model, calibration=calibration)
        else:
            if not profile:
                return no_update, no_update, True, error_box("choose a profile first")
            body["profile_id"] = profile
            if needs == "profiles":
                body["extra_profile_ids"] = list(extra_profiles or [])
            if m and m["preview"] and not allow_pruned:  # the plan the engine will build, asked before it is built
                static = api().method_preview(profile, method, **body[method])["summary"].get("static_layers")
                if static:
                    return no_update, no_update, True, error_box("not converted: " + pruned_warning(static))
        created = api().create_conversion(**body, max_memory=memory_budget(max_memory))
    except ApiError as exc:
        return no_update, no_update, True, error_box(f"could not start: {exc}")
    return created["job_id"], created["id"], False, progress(created.get("job"))


@callback(Output(f"{N}-job", "children", allow_duplicate=True), Input(f"{N}-cancel", "n_clicks"), State(f"{N}-job-id", "data"),
          prevent_initial_call=True)
def _cancel(_n, job_id):
    return cancel_started(job_id)


@callback(Output(f"{N}-job", "children"), Output(f"{N}-poll", "disabled", allow_duplicate=True), Output(f"{N}-result", "children"),
          Output(f"{N}-evaluate", "disabled"),
          Input(f"{N}-poll", "n_intervals"), State(f"{N}-job-id", "data"), State(f"{N}-conversion-id", "data"), prevent_initial_call=True)
def _poll(_n, job_id, conversion_id):
    """The followed job's progress; once it ends, the result card. 'Evaluate result' is enabled
    whenever the conversion is ready and no job runs, a failed evaluation included (to retry)."""
    if not job_id:
        return no_update, True, no_update, True
    try:
        job = api().job(job_id)
    except ApiError as exc:
        return error_box(str(exc)), True, no_update, True
    done = job["state"] in ("succeeded", "failed", "cancelled")
    if not (done and conversion_id):
        return progress(job), done, no_update, True
    card, ready = _result(conversion_id, job)
    return progress(job), True, card, not ready


#: A timing's or a measure's unit by the end of its key (the engine's naming: ``total_s``, ``peak_rss_mib``, ``max_memory_bytes``).
UNITS = {"_s": "s", "_seconds": "s", "_mib": "MiB", "_gib": "GiB", "_mb": "MB", "_bytes": "bytes"}


def fmt_measure(key: str, value: Any) -> str:
    """One timing or memory figure with its own unit: 'total 6.24 s', 'peak rss 1,667.7 MiB',
    'max memory 2.00 GiB', 'seconds per layer 0.10 s' (never a memory figure in seconds)."""
    suffix = next((s for s in sorted(UNITS, key=len, reverse=True) if key.endswith(s)), None)
    name = (key[: -len(suffix)] if suffix else key).replace("_", " ")
    if key.startswith("seconds"):
        suffix, name = "_s", key.replace("_", " ")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return f"{name} {fmt(value)}"
    unit = UNITS.get(suffix or "")
    if unit == "s":
        return f"{name} {value:.2f} s"
    if unit == "bytes":
        for size, u in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(value) >= size:
                return f"{name} {value / size:,.2f} {u}"
        return f"{name} {value:,.0f} bytes"
    if unit:
        return f"{name} {value:,.1f} {unit}"
    return f"{name} {fmt(value)}"


def planned_top_k(layers: list[dict[str, Any]]) -> str:
    """'dense, 54/84, 0/84 …': each layer's selected experts over its routed ones, 'dense' where the plan kept the
    dense FFN (no routed expert: its top-k of 0 selects nothing because there is nothing to select)."""
    return ", ".join("dense" if not r.get("n_routed") else f"{r.get('top_k')}/{r['n_routed']}" for r in layers)


def _result(conversion_id: str, job: dict[str, Any] | None = None) -> tuple[html.Div, bool]:
    """The result card and whether the conversion is ready (can be evaluated): plan summary, timings,
    what the last job's failure was in words, and — once evaluated — perplexity vs baselines and
    per-layer reconstruction error."""
    try:
        conv = api().conversion(conversion_id)
        evals = [e for e in api().evaluations(conversion_id) if e["status"] == "ready"]
        report = api().evaluation_report(evals[0]["id"]) if evals else None
    except ApiError as exc:
        return error_box(str(exc)), False
    ready = conv["status"] == "ready"
    s = conv.get("summary") or {}
    children = [html.H3(f"Conversion {conversion_id}: {conv['status']}"),
                html.Div(", ".join(f"{k}: {fmt(v)}" for k, v in s.items() if not isinstance(v, (dict, list))), className="note")]
    if ready:
        children += [dcc.Link("open in routing explorer", href=f"/routing?conversion={conversion_id}"), html.Span(" · "),
                     dcc.Link("compare", href=f"/compare?ids={conversion_id}"), html.Span(" · "),
                     dcc.Link("token routing", href=f"/tokens?a={conversion_id}"), html.Span(" · "),
                     dcc.Link("playground", href=f"/playground?conversion={conversion_id}")]
    for line in collapse_notes(s.get("notes") or []):
        children.append(html.Div(line, className="aggregated note-line"))
    if (conv.get("params") or {}).get("plan") == "budget" and conv.get("layers"):
        children.append(html.Div(f"budget plan's top-k per layer (layers 0–{len(conv['layers']) - 1}): "
                                 f"{planned_top_k(conv['layers'])}", className="note", id=f"{N}-top-k"))
    timings = (conv.get("job") or {}).get("timings") or s.get("timings")
    if isinstance(timings, dict):
        children.append(html.Div("timings: " + ", ".join(fmt_measure(k, v) for k, v in timings.items()), className="note timings"))
    conv_job = conv.get("job") or {}
    if not ready:
        why = conv_job.get("error") or (job or {}).get("error") or "no reason recorded"
        children.append(html.Div(f"The conversion {conv['status']}: {why}. Change the parameters and press Convert again; "
                                 "there is nothing to evaluate.", className="error"))
        return html.Div(children, className="card", id=f"{N}-result-card"), False
    failed = job if job and job.get("kind") == "evaluation" and job["state"] in ("failed", "cancelled") else None
    if failed:
        children.append(html.Div(f"Evaluation job {failed['id']} {failed['state']}: {failed.get('error') or 'no reason recorded'}. "
                                 "Press 'Evaluate result' to try again, or choose another text to evaluate on.",
                                 className="error", id=f"{N}-eval-failed"))
    if not evals:
        if not failed:
            children.append(html.Div("Not evaluated yet: press 'Evaluate result' for perplexity vs dense (and the baselines when ticked).", className="note"))
        return html.Div(children, className="card", id=f"{N}-result-card"), True
    rows = FX.perplexity_rows([conv], {conversion_id: evals[:1]})  # the newest evaluation, labelled with its text and size
    children.append(html.Div(className="row", children=[
        dcc.Graph(id=f"{N}-ppl", figure=FX.compare_perplexity(rows)),
        dcc.Graph(id=f"{N}-recon", figure=F.reconstruction_error(report or {})),
    ]))
    return html.Div(children, className="card", id=f"{N}-result-card"), True
