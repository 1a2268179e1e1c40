"""Routing explorer: for a conversion and its evaluations (one per held-out set), layer × expert
load heatmaps (EW Fig. 8, MI Fig. 4) of two sets side by side, their difference, per-layer
Jensen–Shannon divergence and load CV by layer (MI Fig. 3). Another conversion of the same model can be
matched to this one (its experts paired with this one's by their dense neurons, since expert ids of two
conversions are unrelated labels): which of its experts matches which, with the Jaccard overlap, and
its routing on set A's text drawn at this conversion's matched expert ids.
State in the URL: ?conversion=…&a=EVAL_ID&b=EVAL_ID&variant=…&match=CONVERSION_ID"""

from __future__ import annotations

import dash
from dash import Input, Output, State, callback, dcc, html, no_update

from frontend.figures import routing as F, common as FC, matching as FM
from moelab.api_client import ApiError, api
from frontend.components import (baselines_choice, cancel_started, builtin_source_options, error_box, figure_card, named_options, not_offered, progress, to_search,
                                 wants_baselines)
from frontend.names import with_id

dash.register_page(__name__, path="/routing", name="Routing explorer", order=7)

N = "rx"
EVAL_WINDOWS, EVAL_TOKENS = 4, 64  # a quick look at routing; the button says how small


def _eval_options(conversion: str | None) -> list[dict]:
    if not conversion:
        return []
    # the text and its size (windows × tokens): two evaluations of one set at different sizes differ
    return [{"label": with_id(FC.heldout_label(e), e["id"]), "value": e["id"]}
            for e in api().evaluations(conversion) if e["status"] == "ready"]


def layout(conversion: str | None = None, a: str | None = None, b: str | None = None, variant: str = "converted",
           match: str | None = None, **_):
    try:
        convs, err = named_options("conversions"), None
        conversion, err = not_offered(conversion, convs)
        if conversion is None and convs:
            conversion = convs[0]["value"]
        evals = _eval_options(conversion)
    except ApiError as exc:
        convs, evals, err = [], [], str(exc)
    if a is None and evals:
        a = evals[0]["value"]
    if b is None and len(evals) > 1:
        b = evals[1]["value"]
    sources = builtin_source_options()  # every built-in set, then the ready calibration sets
    return html.Div([
        dcc.Location(id=f"{N}-url", refresh=False),
        html.H2("Routing explorer"),
        error_box(err),
        html.Div(className="controls", children=[
            html.Div([html.Label("conversion"), dcc.Dropdown(id=f"{N}-conversion", options=convs, value=conversion, clearable=False, style={"width": 520})]),
            html.Div([html.Label("set A (evaluation)"), dcc.Dropdown(id=f"{N}-a", options=evals, value=a, style={"width": 420})]),
            html.Div([html.Label("set B (evaluation)"), dcc.Dropdown(id=f"{N}-b", options=evals, value=b, style={"width": 420})]),
            html.Div([html.Label("variant"), dcc.Dropdown(id=f"{N}-variant", options=["converted", "uniform"], value=variant, clearable=False, style={"width": 130})]),
        ]),
        html.Div(className="controls", children=[
            html.Div([html.Label("match experts with conversion B (same model)"),
                      dcc.Dropdown(id=f"{N}-match", options=convs, value=match, style={"width": 520})]),
        ]),
        html.Div(className="controls", children=[
            html.Div([html.Label("evaluate on another set"), dcc.Dropdown(id=f"{N}-source", options=sources, value="builtin:mixed", style={"width": 420})]),
            baselines_choice(f"{N}-baselines"),
            html.Button(f"Evaluate ({EVAL_WINDOWS} windows × {EVAL_TOKENS} tokens)", id=f"{N}-evaluate"),
            html.Button("Cancel", id=f"{N}-cancel", className="small", title="cancel the evaluation started here"),
            html.Div(id=f"{N}-job", style={"minWidth": "300px"}),
            dcc.Store(id=f"{N}-job-id"), dcc.Interval(id=f"{N}-poll", interval=1000, disabled=True),
        ]),
        html.Div(id=f"{N}-error"),
        html.Div(className="row", children=[figure_card(f"{N}-heat-a", "Set A"), figure_card(f"{N}-heat-b", "Set B")]),
        html.Div(className="row", children=[figure_card(f"{N}-diff", "A − B"), figure_card(f"{N}-js", "Jensen–Shannon by layer")]),
        html.Div(className="row", children=[figure_card(f"{N}-loadcv", "Load CV by layer")]),
        html.Div(className="row", children=[figure_card(f"{N}-match-map", "Experts of B matched to A's"),
                                            figure_card(f"{N}-match-b", "Conversion B at A's expert ids")]),
    ])


@callback(Output(f"{N}-a", "options"), Output(f"{N}-b", "options"), Input(f"{N}-conversion", "value"), Input(f"{N}-job", "children"),
          prevent_initial_call=True)
def _evals(conversion, _job):
    try:
        opts = _eval_options(conversion)
    except ApiError:
        return no_update, no_update
    return opts, opts


NAMES = ("heat-a", "heat-b", "diff", "js", "loadcv")


@callback(*[Output(f"{N}-{n}", "figure") for n in NAMES], *[Output({"type": "csv-data", "name": f"{N}-{n}"}, "data") for n in NAMES],
          Output(f"{N}-error", "children"), Output(f"{N}-url", "search"),
          Input(f"{N}-conversion", "value"), Input(f"{N}-a", "value"), Input(f"{N}-b", "value"), Input(f"{N}-variant", "value"),
          Input(f"{N}-match", "value"))
def _update(conversion, a, b, variant, match=None):
    search = to_search(conversion=conversion, a=a, b=b, variant=variant, match=match)
    ids = [i for i in (a, b) if i]
    if not conversion or not ids:
        msg = "choose a conversion and at least one evaluated set (or press Evaluate)"
        fig = FC.message_figure(msg)
        return (*[fig] * 5, *[None] * 5, error_box(msg if conversion else "no conversion yet: use the Conversion designer"), search)
    try:
        heat = api().conversion_routing(conversion, ids, variant=variant)
        by_id = {e["id"]: e for e in api().evaluations(conversion)}
    except ApiError as exc:
        fig = FC.message_figure(str(exc))
        return (*[fig] * 5, *[None] * 5, error_box(str(exc)), search)
    # each set named with its text and size (the API labels sets by source only)
    heat = {**heat, "sets": [FC.heldout_label(by_id[e]) if e in by_id else name for e, name in zip(heat["evaluations"], heat["sets"], strict=True)]}
    store = {"kind": "routing", "data": heat, "filename": f"routing_{conversion}"}
    two = len(heat["sets"]) > 1
    pair_msg = FC.message_figure("choose a second set to compare")
    figs = [F.routing_heatmap(heat, 0), F.routing_heatmap(heat, 1) if two else pair_msg,
            F.routing_difference(heat, 0, 1) if two else pair_msg, F.routing_js_line(heat, 0, 1) if two else pair_msg, F.load_cv_by_layer(heat)]
    return (*figs, *[store] * 5, error_box(None), search)


def _same_text(evaluations: list[dict], like: dict | None) -> dict | None:
    """The ready evaluation among ``evaluations`` on the text ``like`` read (the same windows × tokens
    first, then the same text at another size): routing shares are comparable on one text only."""
    ready = [e for e in evaluations if e["status"] == "ready"]
    if like is None:
        return ready[0] if ready else None
    return (next((e for e in ready if FC.heldout_key(e) == FC.heldout_key(like)), None)
            or next((e for e in ready if FC.heldout_of(e)["source"] == FC.heldout_of(like)["source"]), None))


@callback(Output(f"{N}-match-map", "figure"), Output(f"{N}-match-b", "figure"),
          Output({"type": "csv-data", "name": f"{N}-match-map"}, "data"), Output({"type": "csv-data", "name": f"{N}-match-b"}, "data"),
          Input(f"{N}-conversion", "value"), Input(f"{N}-match", "value"), Input(f"{N}-a", "value"), Input(f"{N}-variant", "value"))
def _matched(conversion, match, a, variant):
    """B's experts matched to this conversion's, and B's routing on set A's text at A's matched ids."""
    if not conversion or not match:
        fig = FC.message_figure("choose conversion B (another conversion of this model) to match its experts to these")
        return fig, fig, None, None
    try:
        matching = api().expert_matching(conversion, match)
    except ApiError as exc:
        fig = FC.message_figure(str(exc))
        return fig, fig, None, None
    store = {"kind": "matching", "data": matching, "filename": f"matching_{conversion}_{match}"}
    try:
        by_id = {e["id"]: e for e in api().evaluations(conversion)}
        twin = _same_text(api().evaluations(match), by_id.get(a))
        if twin is None:
            text = FC.heldout_label(by_id[a]) if a in by_id else "any text"
            return FM.matching_by_layer(matching), FC.message_figure(f"conversion B has no evaluation on {text}: choose B above "
                                                                   "as the conversion and press Evaluate"), store, None
        heat = api().conversion_routing(match, [twin["id"]], variant=variant)
    except ApiError as exc:
        return FM.matching_by_layer(matching), FC.message_figure(str(exc)), store, None
    heat = {**heat, "sets": [FC.heldout_label(twin)]}
    return (FM.matching_by_layer(matching), FM.routing_at_matched_ids(heat, matching), store,
            {"kind": "routing", "data": heat, "filename": f"routing_{match}"})


@callback(Output(f"{N}-job-id", "data"), Output(f"{N}-poll", "disabled"), Output(f"{N}-job", "children", allow_duplicate=True),
          Input(f"{N}-evaluate", "n_clicks"), State(f"{N}-conversion", "value"), State(f"{N}-source", "value"),
          State(f"{N}-baselines", "value"), prevent_initial_call=True)
def _evaluate(_n, conversion, source, baselines):
    if not conversion or not source:
        return no_update, True, error_box("choose a conversion and a set")
    try:
        created = api().create_evaluation(conversion, source=source, n_windows=EVAL_WINDOWS, seq_len=EVAL_TOKENS,
                                          baselines=wants_baselines(baselines))
    except ApiError as exc:
        return no_update, True, error_box(f"could not start: {exc}")
    return created["job_id"], False, progress(created.get("job"))


@callback(Output(f"{N}-job", "children", allow_duplicate=True), Input(f"{N}-cancel", "n_clicks"), State(f"{N}-job-id", "data"),
          prevent_initial_call=True)
def _cancel(_n, job_id):
    return cancel_started(job_id)


@callback(Output(f"{N}-job", "children"), Output(f"{N}-poll", "disabled", allow_duplicate=True),
          Input(f"{N}-poll", "n_intervals"), State(f"{N}-job-id", "data"), prevent_initial_call=True)
def _poll(_n, job_id):
    try:
        job = api().job(job_id)
    except ApiError as exc:
        return error_box(str(exc)), True
    return progress(job), job["state"] in ("succeeded", "failed", "cancelled")
