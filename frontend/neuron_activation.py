"""The neuron card's "activation on your text": type a text (or pick a held-out sample of a built-in
set), press the button, and an activation probe job on the worker computes the neuron's h on every
token with the profile's dense model; the text is then drawn token by token, coloured by h
(``activation_view``). Part of the Neuron explorer (``pages/neurons.py``), whose ids it shares."""

from __future__ import annotations

from typing import Any

from dash import Input, Output, State, callback, dcc, html, no_update

from frontend.activation_view import activation_text
from moelab.api_client import ApiError, api
from frontend.components import error_box, progress

N = "nx"
TEXT = "your text"
SAMPLE_SETS = ("code", "prose", "literature", "chat", "code_problems", "math", "mixed")
TERMINAL = ("succeeded", "failed", "cancelled")


def section() -> html.Div:
    """The card's part: source, sample index, text box, button, progress and the coloured text."""
    sources = [{"label": TEXT, "value": "text"}] + [{"label": f"held-out sample of builtin:{n}", "value": f"builtin:{n}"}
                                                     for n in SAMPLE_SETS]
    return html.Div(className="card", children=[
        html.Span("Activation on your text", className="card-title"),
        html.Div(className="controls", children=[
            html.Div([html.Label("text"), dcc.Dropdown(id=f"{N}-act-source", options=sources, value="text", clearable=False,
                                                       style={"width": 280})]),
            html.Div([html.Label("sample (0–47)"), dcc.Input(id=f"{N}-act-sample", type="number", min=0, max=47, step=1, value=0,
                                                             style={"width": 90})]),
            html.Button("Show activation", id=f"{N}-act-run", className="primary"),
        ]),
        dcc.Textarea(id=f"{N}-act-text", value="The quick brown fox jumps over the lazy dog.",
                     style={"width": "100%", "height": 60}),
        html.Div(id=f"{N}-act-job"), html.Div(id=f"{N}-act-error"),
        dcc.Store(id=f"{N}-act-probe"), dcc.Interval(id=f"{N}-act-poll", interval=1000, disabled=True),
        dcc.Loading(html.Div(id=f"{N}-act-result"), type="dot"),
    ])


def _int(v: Any, default: int = 0) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


@callback(Output(f"{N}-act-probe", "data"), Output(f"{N}-act-poll", "disabled"), Output(f"{N}-act-error", "children"),
          Input(f"{N}-act-run", "n_clicks"), State(f"{N}-profile", "value"), State(f"{N}-layer", "value"),
          State(f"{N}-neuron-index", "value"), State(f"{N}-act-source", "value"), State(f"{N}-act-sample", "value"),
          State(f"{N}-act-text", "value"), prevent_initial_call=True)
def _run(_n, profile, layer, neuron, source, sample, text):
    """Queue the activation probe of the card's neuron."""
    if not profile:
        return no_update, True, error_box("choose a ready profile first")
    body: dict[str, Any] = {"text": text or ""} if source == "text" else {"sample_source": source, "sample": _int(sample)}
    try:
        created = api().create_activation_probe(profile, _int(layer), [_int(neuron)], **body)
    except ApiError as exc:
        return no_update, True, error_box(f"could not start: {exc}")
    return created["id"], False, error_box(None)


@callback(Output(f"{N}-act-job", "children"), Output(f"{N}-act-result", "children"),
          Output(f"{N}-act-poll", "disabled", allow_duplicate=True),
          Input(f"{N}-act-poll", "n_intervals"), Input(f"{N}-act-probe", "data"), prevent_initial_call=True)
def _poll(_n, probe_id):
    """Follow the job; once it succeeded, draw the text coloured by the neuron's h."""
    if not probe_id:
        return None, None, True
    try:
        probe = api().activation_probe(probe_id)
        job = probe.get("job")
        if job is not None and job["state"] not in TERMINAL:
            return progress(job, "activation"), no_update, False
        if probe.get("status") != "ready":
            return progress(job, "activation"), None, True
        return None, activation_text(api().activation_result(probe_id)), True
    except ApiError as exc:
        return error_box(str(exc)), None, True
