"""Fine-tune: recover a conversion's quality with a short training run and watch it live.

Pick a ready conversion, the mode (defaulted from the conversion's method) and the budget;
Start queues the job; the loss curve (total and load-balancing loss) is redrawn from the train
log every second until the job ends; Cancel stops it at the next step (it checkpoints first),
Resume re-runs it from the latest checkpoint. The result: perplexity before → after next to the
dense model, and the fine-tuned model as a new conversion to evaluate.
State in the URL: ?conversion=…&finetune=…"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import dash
from dash import Input, Output, State, callback, ctx, dcc, html, no_update

from frontend.figures import finetune as F, common as FC
from moelab.api_client import ApiError, api
from frontend.components import error_box, figure_card, page_names, progress, to_search
from frontend.names import Names, with_id
from frontend.param_controls import param_bounds

dash.register_page(__name__, path="/finetune", name="Fine-tune", order=6)

N = "ft"
TERMINAL = ("succeeded", "failed", "cancelled")

#: (field, label, input step) of the budget the form shows; defaults and bounds are the API's (GET /finetunes/params)
BUDGET: list[tuple[str, str, float | str]] = [
    ("steps", "steps", 1),
    ("batch_size", "batch (sequences)", 1),
    ("seq_len", "seq len (tokens)", 1),
    ("lr", "LR (LoRA)", "any"),
    ("lora_rank", "LoRA rank", 1),
    ("lb_coef", "λ load-balance loss (EW Eq. 12)", "any"),
    ("bias_step", "γ bias step (CM §3.3)", "any"),
    ("distill", "distillation w (dense teacher)", "any"),
]


def modes() -> dict[str, str]:
    """mode -> what it trains, in one line: the methods that offer a recovery fine-tune (GET /methods), so a new
    method's mode appears here without a UI change."""
    return {m["name"]: m.get("recovery_summary") or m["recovery"] for m in api().methods() if m.get("recovery")}


def budget_fields() -> dict[str, dict[str, Any]]:
    """The budget's declared fields (default and bounds) from GET /finetunes/params."""
    names = {name for name, *_ in BUDGET}
    return {p["name"]: p for p in api().finetune_params() if p["name"] in names}


def _label(conversion: dict[str, Any], names: Names | None = None) -> str:
    """model · set · method · key parameters, then the id (a fine-tune says whose)."""
    params = conversion.get("params") or {}
    tuned = f" (fine-tune of {params['finetune_of']})" if params.get("finetune_of") else ""
    return with_id((names or Names()).conversion(conversion) + tuned, conversion["id"])


def _run_options(conversion: str | None, runs: list[dict[str, Any]] | None = None) -> list[dict[str, str]]:
    """The run picker's options: ``runs`` (the conversion's fine-tunes, newest first) or, when not given, asked of the API."""
    if runs is None:
        runs = api().finetunes(conversion) if conversion else []
    return [{"label": _run_label(f), "value": f["id"]} for f in runs]


def _run_label(f: dict[str, Any]) -> str:
    return with_id(f"{f['params'].get('mode')}, {f['params'].get('steps')} steps: {f['status']}", f["id"])


def current_run(runs: list[dict[str, Any]]) -> str | None:
    """Of a conversion's fine-tunes (newest first), the one a page opened on it shows: the newest queued or running one
    (a page reopened while a run trains reconnects to it), else the newest."""
    active = [f for f in runs if f["status"] in ("queued", "running")]
    return (active or runs or [{"id": None}])[0]["id"]


def form_values(params: dict[str, Any] | None, fields: dict[str, dict[str, Any]], known_modes: Iterable[str]) -> dict[str, Any]:
    """The form's values for a run's stored ``params`` (mode, training text, budget); what a run
    does not record keeps the API's default (``fields``: :func:`budget_fields`). Used when the page is reloaded on
    ``?finetune=…`` and when another run is picked, so the form always says how the shown run was made."""
    p = params or {}
    values: dict[str, Any] = {name: p.get(name, fields[name]["default"]) for name, *_ in BUDGET}
    values["source"] = p.get("source") or "builtin:mixed"
    values["mode"] = p.get("mode") if p.get("mode") in known_modes else None
    return values


def layout(conversion: str | None = None, finetune: str | None = None, **_):
    run_params: dict[str, Any] | None = None
    try:
        ready = [c for c in api().conversions() if c["status"] == "ready"]
        names = page_names()
        if finetune:
            run = api().finetune(finetune)
            run_params = run.get("params")
            conversion = conversion or run["conversion_id"]
        if conversion is None and ready:
            conversion = ready[0]["id"]
        listed = api().finetunes(conversion) if conversion else []
        finetune = finetune or current_run(listed)
        runs, err = _run_options(conversion, listed), None
        sources = [b["spec"] for b in api().builtin_sets() if b.get("installed", True)]  # bigbench only once installed
        known, fields = modes(), budget_fields()
    except ApiError as exc:
        ready, runs, sources, err, names = [], [], ["builtin:mixed"], str(exc), Names()
        known, fields = {}, {name: dict.fromkeys(("default", "ge", "gt", "le", "lt")) for name, *_ in BUDGET}
    methods = {c["id"]: c["method"] for c in ready}
    mode = methods.get(conversion)
    mode = mode if mode in known else next(iter(known), None)
    form = form_values(run_params, fields, known)  # the shown run's settings (defaults without one)
    mode = form["mode"] or mode
    if form["source"] not in sources:
        sources = [*sources, form["source"]]  # an uploaded set the run trained on
    return html.Div([
        dcc.Location(id=f"{N}-url", refresh=False),
        html.H2("Fine-tune"),
        error_box(err),
        html.Div(className="controls", children=[
            html.Div([html.Label("conversion"), dcc.Dropdown(id=f"{N}-conversion", options=[{"label": _label(c, names), "value": c["id"]} for c in ready],
                                                             value=conversion, clearable=False, style={"width": 560})]),
            html.Div([html.Label("mode"), dcc.RadioItems(id=f"{N}-mode", options=list(known), value=mode, inline=True)]),
        ]),
        html.Div(id=f"{N}-mode-help", className="note"),
        html.Div(className="controls", children=[
            html.Div([html.Label(label), dcc.Input(id=f"{N}-{name}", type="number", value=form[name], step=step,
                                                   min=bounds[0], max=bounds[1], style={"width": 110 if step == 1 else 140})])
            for name, label, step in BUDGET for bounds in [param_bounds(fields[name], step)]
        ] + [html.Div([html.Label("training text (its held-out split measures perplexity)"),
                       dcc.Dropdown(id=f"{N}-source", options=sources, value=form["source"], clearable=False, style={"width": 220})])]),
        html.Div(className="controls", children=[
            html.Button("Start", id=f"{N}-start", className="primary"),
            html.Button("Cancel", id=f"{N}-cancel", disabled=True),
            html.Button("Resume", id=f"{N}-resume", disabled=True, title="re-run from the latest checkpoint"),
            html.Div([html.Label("fine-tune"), dcc.Dropdown(id=f"{N}-run", options=runs, value=finetune, style={"width": 420})]),
        ]),
        html.Div(id=f"{N}-action"),
        html.Div(id=f"{N}-job"),
        html.Div(className="row", children=[figure_card(f"{N}-loss", "Training loss", loading=False)]),
        html.Div(id=f"{N}-result"),
        dcc.Store(id=f"{N}-methods", data=methods),
        dcc.Store(id=f"{N}-modes", data=known), dcc.Store(id=f"{N}-fields", data=fields),  # read once, for the callbacks
        dcc.Interval(id=f"{N}-poll", interval=1000, disabled=True),
    ])


@callback(Output(f"{N}-mode", "value"), Output(f"{N}-run", "options"), Output(f"{N}-run", "value"),
          Input(f"{N}-conversion", "value"), State(f"{N}-methods", "data"), State(f"{N}-modes", "data"), prevent_initial_call=True)
def _conversion_changed(conversion, methods, known):
    """Another conversion: its method's mode, and its newest fine-tune (if any) shown."""
    mode = (methods or {}).get(conversion)
    try:
        runs = _run_options(conversion)
    except ApiError:
        runs = []
    return (mode if mode in (known or {}) else no_update), runs, (runs[0]["value"] if runs else None)


@callback(Output(f"{N}-mode-help", "children"), Input(f"{N}-mode", "value"), Input(f"{N}-conversion", "value"),
          State(f"{N}-methods", "data"), State(f"{N}-modes", "data"))
def _mode_help(mode, conversion, methods, known):
    known = known or {}
    text = known.get(mode, "")
    method = (methods or {}).get(conversion)
    if method and method != mode:
        text += f" (the conversion was made with {method}: its default mode is {method if method in known else 'none'})"
    return text


@callback(Output(f"{N}-mode", "value", allow_duplicate=True), Output(f"{N}-source", "value"),
          *[Output(f"{N}-{name}", "value") for name, *_ in BUDGET], Input(f"{N}-run", "value"), State(f"{N}-fields", "data"),
          State(f"{N}-modes", "data"), prevent_initial_call=True)
def _run_settings(run, fields, known):
    """Another run picked: the form shows how it was made (Start then repeats or varies it)."""
    if not run:
        return [no_update] * (2 + len(BUDGET))
    try:
        values = form_values(api().finetune(run).get("params"), fields, known or {})
    except ApiError:
        return [no_update] * (2 + len(BUDGET))
    return [values["mode"] or no_update, values["source"], *[values[name] for name, *_ in BUDGET]]


@callback(Output(f"{N}-poll", "disabled"), Output(f"{N}-url", "search"), Output(f"{N}-loss", "figure"),
          Input(f"{N}-run", "value"), State(f"{N}-conversion", "value"))
def _run_changed(run, conversion):
    """A run chosen (or started): poll it; none: say what to do."""
    fig = FC.message_figure("reading the train log…" if run else "start a fine-tune or pick an earlier one")
    return not run, to_search(conversion=conversion, finetune=run), fig


@callback(Output(f"{N}-run", "options", allow_duplicate=True), Output(f"{N}-run", "value", allow_duplicate=True),
          Output(f"{N}-poll", "disabled", allow_duplicate=True), Output(f"{N}-action", "children"),
          Input(f"{N}-start", "n_clicks"), Input(f"{N}-cancel", "n_clicks"), Input(f"{N}-resume", "n_clicks"),
          State(f"{N}-conversion", "value"), State(f"{N}-mode", "value"), State(f"{N}-run", "value"), State(f"{N}-source", "value"),
          *[State(f"{N}-{name}", "value") for name, *_ in BUDGET], prevent_initial_call=True)
def _act(_s, _c, _r, conversion, mode, run, source, *budget):
    try:
        if ctx.triggered_id == f"{N}-start":
            if not conversion:
                return no_update, no_update, no_update, error_box("choose a ready conversion first (make one in the Conversion designer)")
            params = dict(zip([name for name, *_ in BUDGET], budget))
            created = api().create_finetune(conversion, mode=mode, source=source, **params)
            return _run_options(conversion), created["id"], False, error_box(None)
        if not run:
            return no_update, no_update, no_update, error_box("choose a fine-tune first")
        job_id = api().finetune(run)["job_id"]
        if ctx.triggered_id == f"{N}-cancel":
            api().cancel_job(job_id)
        else:
            api().retry_job(job_id)
    except ApiError as exc:
        return no_update, no_update, no_update, error_box(f"could not {str(ctx.triggered_id).removeprefix(f'{N}-')}: {exc}")
    return no_update, no_update, False, error_box(None)


@callback(Output(f"{N}-loss", "figure", allow_duplicate=True), Output({"type": "csv-data", "name": f"{N}-loss"}, "data"),
          Output(f"{N}-job", "children"),
          Output(f"{N}-poll", "disabled", allow_duplicate=True), Output(f"{N}-cancel", "disabled"), Output(f"{N}-resume", "disabled"),
          Output(f"{N}-result", "children"), Output(f"{N}-run", "options", allow_duplicate=True),
          Input(f"{N}-poll", "n_intervals"), State(f"{N}-run", "value"), State(f"{N}-run", "options"), prevent_initial_call=True)
def _poll(_n, run, options):
    """One poll: the run's job and train log; polling stops when the job has ended. The picker's label of the run
    follows its status (queued → running → ready)."""
    if not run:
        return FC.message_figure("start a fine-tune or pick an earlier one"), None, html.Div(), True, True, True, html.Div(), no_update
    try:
        ft = api().finetune(run)
        log = api().finetune_log(run, max_points=1000)
    except ApiError as exc:
        return FC.message_figure(str(exc)), None, error_box(str(exc)), True, True, True, html.Div(), no_update
    job = ft.get("job") or {}
    state = job.get("state")
    done = state in TERMINAL
    store = {"kind": "finetune-log", "data": log, "filename": f"train_log_{run}"}
    label = _run_label(ft)
    relabelled = ([{**o, "label": label} if o["value"] == run else o for o in options or []]
                  if any(o["value"] == run and o["label"] != label for o in options or []) else no_update)
    return (F.finetune_loss(log), store, progress(job), done, state not in ("queued", "running"), state not in ("failed", "cancelled"),
            _result(ft, log) if done else html.Div(), relabelled)


def _result(ft: dict[str, Any], log: dict[str, Any]) -> html.Div:
    """Perplexity before → after (and dense), and where the fine-tuned model went."""
    result = ft.get("result_conversion_id")
    if ft["status"] != "ready" or not result:
        return html.Div(f"Fine-tune {ft['id']} {ft['status']}: press Resume to continue from its latest checkpoint.", className="note",
                        id=f"{N}-result-card")
    summary = F.finetune_summary_text(log)
    summary = f"{summary} {F.finetune_eval_text(ft.get('params') or {})}" if summary else "perplexity not measured"  # and on how much text
    return html.Div(className="card", id=f"{N}-result-card", children=[
        html.H3(f"Fine-tune {ft['id']}: ready"),
        html.Div(summary, id=f"{N}-result-ppl"),
        html.Div([f"The fine-tuned model is conversion {result}: ",
                  dcc.Link("evaluate it in the routing explorer", href=f"/routing?conversion={result}"), html.Span(" · "),
                  dcc.Link("compare with the original", href=f"/compare?ids={ft['conversion_id']},{result}"), html.Span(" · "),
                  dcc.Link("fine-tune it further", href=f"/finetune?conversion={result}")], className="note"),
    ])
