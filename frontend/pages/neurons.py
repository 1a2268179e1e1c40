"""Neuron explorer (one profile): CV histogram of a layer, CV by layer (EW Fig. 2), neuron × task
map sortable by CV (EW Fig. 1a), task × task similarity (EW Fig. 1b); click a neuron column (or type
a neuron index) for its card: CV, rate, per-task profile, the calibration text it fires on most and
its activation on any text (an activation probe job, ``frontend.neuron_activation``).
State in the URL: ?profile=…&layer=…&neuron=…&order=…&tau=…&normalize=…"""

from __future__ import annotations

import dash
from dash import Input, Output, State, callback, dcc, html

from frontend.figures import neurons as F, common as FC
from frontend import snippets as S
from frontend import neuron_activation
from moelab.api_client import ApiError, api
from frontend.components import error_box, figure_card, num, profile_picker, to_search

dash.register_page(__name__, path="/neurons", name="Neuron explorer", order=2)

N = "nx"

#: Columns the activation map asks for: full resolution (one column = one neuron, so a click picks
#: that neuron) up to this many neurons; wider layers are averaged and a click picks the column's first.
MAP_COLUMNS = 4096

#: The index boxes hold their largest value whole: layers up to 3 digits, neurons up to 6 (d_ffn of
#: today's largest dense models has 5). Dash 4 draws a number box as a container of the text field and
#: its − / + buttons (32 px each, the field's padding 2 × 8 px, a 1 px border): the width is the
#: container's, so the digits get what the buttons leave (the default left "116" of 1160).
LAYER_WIDTH, NEURON_WIDTH = "calc(3ch + 92px)", "calc(6ch + 92px)"


def layout(profile: str | None = None, layer: str = "0", order: str = "cv", tau: str = "0.6", normalize: str = "none",
           neuron: str = "0", **_):
    picker, profile, err = profile_picker(N, profile)
    return html.Div([
        dcc.Location(id=f"{N}-url", refresh=False),
        html.H2("Neuron explorer"),
        error_box(err),
        html.Div(className="controls", children=[
            picker,
            html.Div([html.Label("layer"), dcc.Input(id=f"{N}-layer", type="number", min=0, step=1, value=int(num(layer, 0)), debounce=True,
                                                     className="index-input", style={"width": LAYER_WIDTH})]),
            html.Div([html.Label("neuron order"), dcc.Dropdown(id=f"{N}-order", options=["cv", "task", "index"], value=order, clearable=False, style={"width": 120})]),
            html.Div([html.Label("normalise"), dcc.Dropdown(id=f"{N}-normalize", options=["none", "neuron", "zscore"], value=normalize, clearable=False, style={"width": 120})]),
            html.Div(className="slider", children=[html.Label("τ (EW Eq. 4)"), dcc.Slider(id=f"{N}-tau", min=0.05, max=3, step=0.05, value=num(tau, 0.6),
                                                                                          marks={0.5: "0.5", 1: "1", 2: "2", 3: "3"}, tooltip={"always_visible": True, "placement": "bottom"})]),
        ]),
        html.Div(id=f"{N}-error"), html.Div(id=f"{N}-layer-error"),
        html.Div(className="row", children=[figure_card(f"{N}-cv-hist", "CV distribution of the layer"), figure_card(f"{N}-cv-layers", "CV by layer")]),
        html.Div(className="row", children=[figure_card(f"{N}-act", "Neuron × task/sample activations (click a column to open that neuron)")]),
        html.Div(className="card neuron-card", id=f"{N}-card", children=[
            html.Div(className="card-head", children=[
                html.Span(id=f"{N}-card-title", className="card-title"),
                html.Div(className="controls", children=[html.Div([html.Label("neuron"), dcc.Input(
                    id=f"{N}-neuron-index", type="number", min=0, step=1, value=int(num(neuron, 0)), debounce=True,
                    className="index-input", style={"width": NEURON_WIDTH})])]),
            ]),
            html.Div(id=f"{N}-card-stats", className="note"), html.Div(id=f"{N}-card-error"),
            html.Div(className="row", children=[figure_card(f"{N}-neuron", "Mean activation of the neuron per task (or sample)"),
                                                html.Div(className="card", children=[html.Span("Top-activating tokens", className="card-title"),
                                                                                     dcc.Loading(html.Div(id=f"{N}-snippets"), type="dot")])]),
            neuron_activation.section(),
        ]),
        html.Div(className="row", children=[figure_card(f"{N}-rates", "Activation rate of the layer's neurons"), figure_card(f"{N}-hvals", "h-value histogram of the layer")]),
        html.Div(className="row", children=[figure_card(f"{N}-tasksim", "Similarity of the tasks (or samples) the CV is taken across")]),
        dcc.Store(id=f"{N}-tiles"),
    ])


def _store(kind, data, name):
    return {"kind": kind, "data": data, "filename": name}


def _csv(name: str) -> Output:
    return Output({"type": "csv-data", "name": f"{N}-{name}"}, "data")


def _note(name: str) -> Output:
    """The card's subtitle line: a figure's note shown as HTML, which wraps (a plotly title is cut)."""
    return Output({"type": "note", "name": f"{N}-{name}"}, "children")


def _split(fig) -> tuple:
    """(the figure titled by its title alone, its note for the card's subtitle line)."""
    return FC.without_note(fig)


NO_PROFILE = "choose a ready profile (Workspace → Profile)"


def _basis(profile: str) -> tuple[str | None, int | None]:
    """The profile's CV basis (tasks, domains or samples) and its layer count."""
    summary = api().profile(profile).get("summary") or {}
    return summary.get("cv_basis"), summary.get("n_layers")


def _check_layer(layer: int, n_layers: int | None) -> None:
    if n_layers is not None and not 0 <= layer < n_layers:
        raise ApiError(f"layer {layer} does not exist: this profile has layers 0 … {n_layers - 1}")


# Three callbacks, each on the inputs its charts depend on: a layer change does not refetch the
# profile-wide charts, order/normalise refetch the map only, and a bad layer blanks only the
# charts of that layer (the profile-wide ones stay).


@callback(Output(f"{N}-url", "search"), Input(f"{N}-profile", "value"), Input(f"{N}-layer", "value"), Input(f"{N}-order", "value"),
          Input(f"{N}-normalize", "value"), Input(f"{N}-tau", "value"), Input(f"{N}-neuron-index", "value"))
def _url(profile, layer, order, normalize, tau, neuron):
    return to_search(profile=profile, layer=layer, neuron=neuron, order=order, normalize=normalize, tau=tau)


@callback(Output(f"{N}-cv-layers", "figure"), Output(f"{N}-tasksim", "figure"), _csv("cv-layers"), _csv("tasksim"), Output(f"{N}-error", "children"),
          _note("cv-layers"), _note("tasksim"), Input(f"{N}-profile", "value"), Input(f"{N}-tau", "value"))
def _profile_charts(profile, tau):
    """CV by layer (EW Fig. 2, with τ) and the similarity of the CV's groups: the whole profile."""
    if not profile:
        blank = FC.message_figure(NO_PROFILE)
        return blank, blank, None, None, error_box("no profile chosen: create one on the Workspace page"), "", ""
    try:
        summary = api().cv_summary(profile, tau=tau)
        sim = api().task_similarity(profile)
        basis, _ = _basis(profile)
    except ApiError as exc:
        fig = FC.message_figure(str(exc))
        return fig, fig, None, None, error_box(str(exc)), "", ""
    (cv_fig, cv_note), (sim_fig, sim_note) = _split(F.cv_by_layer(summary)), _split(F.task_similarity(sim, basis))
    return (cv_fig, sim_fig, _store("cv-summary", summary, "cv_by_layer"),
            _store("task-similarity", sim, "task_similarity"), error_box(None), cv_note, sim_note)


@callback(Output(f"{N}-cv-hist", "figure"), Output(f"{N}-rates", "figure"), Output(f"{N}-hvals", "figure"),
          _csv("cv-hist"), _csv("rates"), _csv("hvals"), Output(f"{N}-layer-error", "children"),
          _note("cv-hist"), _note("rates"), _note("hvals"),
          Input(f"{N}-profile", "value"), Input(f"{N}-layer", "value"), Input(f"{N}-tau", "value"))
def _layer_charts(profile, layer, tau):
    """The layer's CV histogram (τ drawn), activation rates and h values."""
    if not profile:
        blank = FC.message_figure(NO_PROFILE)
        return blank, blank, blank, None, None, None, None, "", "", ""
    layer = int(layer or 0)
    try:
        basis, n_layers = _basis(profile)
        _check_layer(layer, n_layers)
        hist = api().cv_histogram(profile)
        stats = api().neuron_stats(profile, layer=layer)
    except ApiError as exc:
        fig = FC.message_figure(str(exc))
        return fig, fig, fig, None, None, None, error_box(str(exc)), "", "", ""
    figs = [_split(f) for f in (F.cv_histogram(hist, layer, tau=float(tau) if tau is not None else None, basis=basis),
                                F.activation_rate_histogram(stats), F.h_value_histogram(stats))]
    return (*[f for f, _ in figs], _store("cv-histogram", hist, "cv_histogram"), _store("rates", stats, f"activation_rate_layer{layer}"),
            _store("h-values", stats, f"h_values_layer{layer}"), error_box(None), *[n for _, n in figs])


@callback(Output(f"{N}-act", "figure"), _csv("act"), Output({"type": "note", "name": f"{N}-act"}, "children"), Output(f"{N}-tiles", "data"),
          Input(f"{N}-profile", "value"), Input(f"{N}-layer", "value"), Input(f"{N}-order", "value"), Input(f"{N}-normalize", "value"))
def _activation_map(profile, layer, order, normalize):
    """EW Fig. 1a for the layer; the clicked column's profile is drawn from the stored tiles."""
    if not profile:
        return FC.message_figure(NO_PROFILE), None, "", None
    layer = int(layer or 0)
    try:
        basis, n_layers = _basis(profile)
        _check_layer(layer, n_layers)  # said once, in the layer's error line
        tiles = api().activations(profile, layer=layer, order=order, normalize=normalize, max_cols=MAP_COLUMNS)
    except ApiError as exc:
        return FC.message_figure(str(exc)), None, "", None
    fig, _said = _split(F.activation_heatmap(tiles, basis))  # the note once, as the card's subtitle
    note = html.Span(f"Aggregated server-side: {tiles['note']}", className="aggregated") if tiles["aggregated"] else tiles["note"]
    return fig, _store("activations", tiles, f"activations_layer{layer}"), note, {**tiles, "basis": basis}


@callback(Output(f"{N}-neuron-index", "value"), Input(f"{N}-act", "clickData"), State(f"{N}-tiles", "data"), prevent_initial_call=True)
def _pick(click, tiles):
    """A click on the map selects one neuron: the clicked column's (its first when columns average several)."""
    if not click or not tiles:
        return dash.no_update
    return int(tiles["column_first_neuron"][int(click["points"][0]["x"])])


@callback(Output(f"{N}-card-title", "children"), Output(f"{N}-card-stats", "children"), Output(f"{N}-card-error", "children"),
          Output(f"{N}-neuron", "figure"), Output({"type": "csv-data", "name": f"{N}-neuron"}, "data"), Output(f"{N}-snippets", "children"),
          Input(f"{N}-profile", "value"), Input(f"{N}-layer", "value"), Input(f"{N}-neuron-index", "value"))
def _card(profile, layer, neuron):
    """The chosen neuron's card; only it is fetched when the neuron changes."""
    if not profile:
        return "neuron", "", None, FC.message_figure(NO_PROFILE), None, None
    layer, neuron = int(layer or 0), int(neuron or 0)
    try:
        card = api().neuron_card(profile, layer, neuron)
    except ApiError as exc:  # a bad layer is said once, in the layer's error line
        said = None if str(exc).startswith("layer:") else error_box(str(exc))
        return f"layer {layer} · neuron {neuron}", "", said, FC.message_figure(str(exc)), None, None
    one = FC.basis_names(card.get("cv_basis"))[0]
    rows = [{one: g, "mean_activation": v} for g, v in zip(card["groups"], card["group_means"], strict=True)]
    return (S.card_title(card), S.card_stats(card), None, F.neuron_card_profile(card),
            {"rows": rows, "filename": f"neuron_layer{layer}_{neuron}"}, S.snippets(card))
