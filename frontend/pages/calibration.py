"""Calibration sets: build from built-ins, upload a .jsonl/.txt file, preview samples, sizes by
task and domain (characters: a set is stored without a tokenizer; tokens where its statistics have them). A set being built is followed until its job ends, then it joins the
list and is shown (no reload). State in the URL: ?set=…&task=…"""

from __future__ import annotations

import base64

import dash
from dash import Input, Output, State, callback, dcc, html, no_update

from frontend.figures import calibration as F, common as FC
from moelab.api_client import ApiError, api
from frontend.components import builtin_options, error_box, figure_card, options, progress, to_search
from frontend.defaults import CALIBRATION_NOTE, CALIBRATION_SAMPLES, default_builtin

dash.register_page(__name__, path="/calibration", name="Calibration sets", order=1)

N = "cs"


def layout(set: str | None = None, **_):  # noqa: A002  (the URL parameter's name)
    try:
        sets, builtins, err = api().calibration_sets(), api().builtin_sets(), None
    except ApiError as exc:
        sets, builtins, err = [], [], str(exc)
    opts = options(sets)
    if set is None and opts:
        set = opts[0]["value"]
    return html.Div([
        dcc.Location(id=f"{N}-url", refresh=False),
        html.H2("Calibration sets"),
        error_box(err),
        html.Div(className="card", children=[
            html.Div(className="controls", children=[
                html.Div([html.Label("built-in"), dcc.Dropdown(id=f"{N}-builtin", options=builtin_options(builtins, describe=True),
                                                              value=default_builtin([b["name"] for b in builtins]), style={"width": 420})]),
                html.Div([html.Label("samples"), dcc.Input(id=f"{N}-samples", type="number", min=1, value=CALIBRATION_SAMPLES, style={"width": 90})]),
                html.Button("Build", id=f"{N}-build"),
                dcc.Upload(id=f"{N}-upload", children=html.Button("Upload .jsonl / .txt"), multiple=False),
            ]),
            html.Div(CALIBRATION_NOTE, id=f"{N}-proposed", className="note"),
            html.Div(id=f"{N}-created"),
            dcc.Store(id=f"{N}-pending"), dcc.Interval(id=f"{N}-poll", interval=1000, disabled=True),
        ]),
        html.Div(className="controls", children=[
            html.Div([html.Label("set"), dcc.Dropdown(id=f"{N}-set", options=opts, value=set, style={"width": 360})]),
        ]),
        html.Div(id=f"{N}-error"),
        html.Div(id=f"{N}-stats", className="note"),
        html.Div(className="row", children=[figure_card(f"{N}-tokens", "Size by task / domain")]),
        html.Div(className="card", children=[html.Div("Samples (first 20)", className="card-title"), html.Div(id=f"{N}-samples-list")]),
    ])


@callback(Output(f"{N}-tokens", "figure"), Output({"type": "csv-data", "name": f"{N}-tokens"}, "data"), Output(f"{N}-stats", "children"),
          Output(f"{N}-samples-list", "children"), Output(f"{N}-error", "children"), Output(f"{N}-url", "search"), Input(f"{N}-set", "value"))
def _show(set_id):
    search = to_search(set=set_id)
    if not set_id:
        return FC.message_figure("no ready set yet: build or upload one"), None, "", None, None, search
    try:
        cs = api().calibration_set(set_id)
        page = api().samples(set_id, limit=20)
    except ApiError as exc:
        return FC.message_figure(str(exc)), None, "", None, error_box(str(exc)), search
    stats = cs.get("stats") or {}
    rows = [{"group": g, "label": k, **v} for g in ("tasks", "domains") for k, v in (stats.get(g) or {}).items()]
    text = f"{stats.get('n_samples')} samples, {stats.get('n_chars')} characters" + (f", {stats['n_tokens']} tokens" if "n_tokens" in stats else "")
    samples = [html.Div(f"[{s['index']}] " + "".join(f"{k} {s[k]} · " for k in ("task", "domain") if s.get(k)) + s["text"], className="sample")
               for s in page["items"]]  # no 'task=None' for a set without tasks
    return F.calibration_sizes(stats), {"rows": rows, "filename": f"calibration_{set_id}"}, text, samples, None, search


@callback(Output(f"{N}-created", "children"), Output(f"{N}-set", "options"), Output(f"{N}-pending", "data"), Output(f"{N}-poll", "disabled"),
          Input(f"{N}-build", "n_clicks"), Input(f"{N}-upload", "contents"),
          State(f"{N}-upload", "filename"), State(f"{N}-builtin", "value"), State(f"{N}-samples", "value"), prevent_initial_call=True)
def _create(_n, contents, filename, builtin, samples):
    try:
        if dash.ctx.triggered_id == f"{N}-upload" and contents:
            raw = base64.b64decode(contents.split(",", 1)[1])
            created = api().upload_set(filename or "upload.txt", raw)
            msg = f"uploaded {created['id']} ({filename})"
        else:
            created = api().create_builtin_set(builtin, int(samples or CALIBRATION_SAMPLES))
            msg = f"building {created['id']} (job {created['job_id']}); it appears in the list when ready"
        opts = options(api().calibration_sets())
    except ApiError as exc:
        return error_box(f"could not create: {exc}"), no_update, no_update, no_update
    pending = {"set": created["id"], "job": created.get("job_id")}
    return html.Div(msg, className="note"), opts, pending, False  # followed until its job ends (an upload's may be done already)


@callback(Output(f"{N}-created", "children", allow_duplicate=True), Output(f"{N}-set", "options", allow_duplicate=True),
          Output(f"{N}-set", "value"), Output(f"{N}-poll", "disabled", allow_duplicate=True),
          Input(f"{N}-poll", "n_intervals"), State(f"{N}-pending", "data"), prevent_initial_call=True)
def _follow(_n, pending):
    """The set being built: its job's progress; once ready it joins the list and is shown."""
    if not pending:
        return no_update, no_update, no_update, True
    try:
        cs = api().calibration_set(pending["set"])
        if cs["status"] in ("queued", "running"):
            return progress(cs.get("job")), no_update, no_update, False
        opts = options(api().calibration_sets())
    except ApiError as exc:
        return error_box(str(exc)), no_update, no_update, True
    if cs["status"] != "ready":
        job = cs.get("job") or {}
        return error_box(f"calibration set {cs['id']} {cs['status']}: {job.get('error') or 'no reason recorded'}"), opts, no_update, True
    return html.Div(f"{cs['name']} — {cs['id']} is ready", className="note"), opts, cs["id"], True
