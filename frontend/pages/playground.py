"""Playground: one prompt, greedily continued by the dense model and by a conversion, side by
side, with each model's tokens/s (a probe job on the worker; both models run there, one after
the other, on the same device). State in the URL: ?conversion=…&probe=…"""

from __future__ import annotations

import dash
from dash import Input, Output, State, callback, dcc, html, no_update

from moelab.api_client import ApiError, api
from frontend.components import error_box, not_offered, options_or_error, progress, to_search
from frontend.token_view import generation_card

dash.register_page(__name__, path="/playground", name="Playground", order=11)

N = "pg"
TERMINAL = ("succeeded", "failed", "cancelled")


def layout(conversion: str | None = None, probe: str | None = None, **_):
    convs, err = options_or_error("conversions")
    if err is None:
        conversion, err = not_offered(conversion, convs)
    if conversion is None and convs:
        conversion = convs[0]["value"]
    return html.Div([
        dcc.Location(id=f"{N}-url", refresh=False),
        html.H2("Playground"),
        html.P("The same prompt, continued greedily by the dense model and by the converted one; tokens/s counts the "
               "generated tokens over the whole call (prefill included).", className="note"),
        error_box(err),
        html.Div(className="controls", children=[
            html.Div([html.Label("conversion"), dcc.Dropdown(id=f"{N}-conversion", options=convs, value=conversion, clearable=False,
                                                             style={"width": 520})]),
            html.Div([html.Label("new tokens"), dcc.Input(id=f"{N}-tokens", type="number", min=1, max=256, step=1, value=32,
                                                          style={"width": 90})]),
            html.Button("Generate", id=f"{N}-run", className="primary"),
        ]),
        dcc.Textarea(id=f"{N}-prompt", value="The three most important ideas in computer science are", style={"width": "100%", "height": 70}),
        html.Div(id=f"{N}-job"),
        dcc.Store(id=f"{N}-probe", data=probe), dcc.Interval(id=f"{N}-poll", interval=1000, disabled=True),
        html.Div(id=f"{N}-result"),
        html.Div(id=f"{N}-error"),
    ])


@callback(Output(f"{N}-probe", "data"), Output(f"{N}-poll", "disabled"), Output(f"{N}-error", "children"),
          Input(f"{N}-run", "n_clicks"), State(f"{N}-conversion", "value"), State(f"{N}-prompt", "value"),
          State(f"{N}-tokens", "value"), prevent_initial_call=True)
def _run(_n, conversion, prompt, tokens):
    if not conversion:
        return no_update, True, error_box("choose a conversion (make one in the Conversion designer)")
    try:
        created = api().create_probe(conversion, "generate", text=prompt or "", max_new_tokens=int(tokens or 32))
    except ApiError as exc:
        return no_update, True, error_box(f"could not start: {exc}")
    return created["id"], False, error_box(None)


@callback(Output(f"{N}-job", "children"), Output(f"{N}-result", "children"), Output(f"{N}-poll", "disabled", allow_duplicate=True),
          Output(f"{N}-url", "search"),
          Input(f"{N}-poll", "n_intervals"), Input(f"{N}-probe", "data"), State(f"{N}-conversion", "value"),
          prevent_initial_call="initial_duplicate")
def _poll(_n, probe_id, conversion):
    search = to_search(conversion=conversion, probe=probe_id)
    if not probe_id:
        return None, html.Div("Write a prompt and press Generate.", className="note"), True, search
    try:
        probe = api().probe(probe_id)
    except ApiError as exc:
        return error_box(str(exc)), None, True, search
    job = probe.get("job")
    if job is not None and job["state"] not in TERMINAL:
        return progress(job, "generation"), no_update, False, search
    s = probe.get("summary") or {}
    if not s.get("dense"):
        return progress(job, "generation"), None, True, search
    speed = s.get("speedup")
    result = html.Div([
        html.Div(f"converted / dense speed: {speed:.2f}×" if speed else "", className="note speedup"),
        html.Div([generation_card("dense", s["dense"]), generation_card(f"converted ({s.get('method')})", s["converted"])], className="row"),
    ])
    return progress(job, "generation"), result, True, search
