"""Compare profiles: two profiles of one model (say, on code and on literature) neuron by neuron. Each
neuron's mean gate activation on A against B coloured by its set-specificity d (GET /profiles/compare;
``moelab/engine/profiling/compare.py`` defines d), the share of specific neurons per layer, the
most specific neurons of each side with their top tokens in both texts, and a neuron search; every
neuron links to its card in the Neuron explorer. State in the URL: ?a=…&b=…&layer=…&threshold=…"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, callback, dcc, html

from frontend.figures import profile_compare as F, common as FC
from frontend import snippets as S
from moelab.api_client import ApiError, api
from frontend.components import error_box, figure_card, num, options_or_error, page_names, to_search
from frontend.names import Names, fmt, fmt_pct

dash.register_page(__name__, path="/profiles/compare", name="Compare profiles", order=3)

N = "pc"
TOP = 10
PAGE = 50
SNIPPET_CELL = {"minWidth": "300px"}
SORTS = ["specificity", "cv", "rate", "mean", "abs_mean", "layer"]


def neuron_href(profile: str, layer: int, neuron: int) -> str:
    """The Neuron explorer's address of one neuron's card."""
    return "/neurons" + to_search(profile=profile, layer=layer, neuron=neuron)


def _number(ident: str, value: Any, width: str = "90px", **kw: Any) -> dcc.Input:
    return dcc.Input(id=ident, type="number", value=value, debounce=True, style={"width": width}, **kw)


def _field(label: str, control: Any) -> html.Div:
    return html.Div([html.Label(label), control])


def layout(a: str | None = None, b: str | None = None, layer: str | None = None, threshold: str = "1", fdr: str = "0.05", **_):
    profiles, err = options_or_error("profiles")
    if a is None and profiles:
        a = profiles[0]["value"]
    if b is None:  # the newest other profile of A's model
        names = page_names()
        model = (names.profiles.get(a or "") or {}).get("model_id")
        b = next((p["value"] for p in profiles if p["value"] != a and (names.profiles.get(p["value"]) or {}).get("model_id") == model), None)
    return html.Div([
        dcc.Location(id=f"{N}-url", refresh=False),
        html.H2("Compare profiles"),
        html.Div("Two profiles of the same model on different text: which neurons are specific to one of them. "
                 "d = (μ_A − μ_B) / √((σ_A² + σ_B²)/2) over the per-sample mean activations; a neuron is specific when |d| is large "
                 "and Welch's test of the gap survives a false-discovery-rate control (Benjamini–Hochberg) over every neuron; "
                 "red: specific to A, blue: to B.",
                 className="note"),
        error_box(err),
        html.Div(className="controls", children=[
            _field("profile A", dcc.Dropdown(id=f"{N}-a", options=profiles, value=a, clearable=False, style={"width": 360})),
            _field("profile B (same model)", dcc.Dropdown(id=f"{N}-b", options=profiles, value=b, clearable=False, style={"width": 360})),
            _field("layer (empty: most specific)", _number(f"{N}-layer", int(num(layer, 0)) if layer not in (None, "") else None, min=0, step=1)),
            _field("specific at |d| ≥", _number(f"{N}-threshold", num(threshold, 1.0), min=0.1, step=0.1)),
            _field("and false-discovery rate q ≤", _number(f"{N}-fdr", num(fdr, 0.05), min=0.001, max=1, step=0.01)),
        ]),
        html.Div(id=f"{N}-error"),
        html.Div(className="row", children=[figure_card(f"{N}-scatter", "Mean activation on A vs B"),
                                            figure_card(f"{N}-shares", "Share of set-specific neurons by layer")]),
        *[html.Div(className="card", children=[html.Span(f"Most specific to {side.upper()}", id=f"{N}-top-{side}-title", className="card-title"),
                                               dcc.Loading(html.Div(id=f"{N}-top-{side}", className="table-scroll"), type="dot")])
          for side in ("a", "b")],  # full width each: the snippets need the room
        _search_card(),
    ])


def _search_card() -> html.Div:
    return html.Div(className="card", id=f"{N}-search", children=[
        html.Span("Search neurons", className="card-title"),
        html.Div(className="controls", children=[
            _field("in", dcc.RadioItems(id=f"{N}-s-side", options=[{"label": "A", "value": "a"}, {"label": "B", "value": "b"}], value="a",
                                        inline=True)),
            _field("a top token is", dcc.Input(id=f"{N}-s-token", type="text", placeholder="def", debounce=True, style={"width": 120})),
            _field("", dcc.Checklist(id=f"{N}-s-part", options=[{"label": "or contains it (def → default)", "value": "substring"}],
                                     value=[], inline=True)),
            _field("d ≥ (vs the other)", _number(f"{N}-s-min-d", None, step=0.1)),
            _field("CV from", _number(f"{N}-s-cv-min", None, min=0, step=0.1)), _field("CV to", _number(f"{N}-s-cv-max", None, min=0, step=0.1)),
            _field("rate from", _number(f"{N}-s-rate-min", None, min=0, max=1, step=0.01)),
            _field("rate to", _number(f"{N}-s-rate-max", None, min=0, max=1, step=0.01)),
            _field("layer", _number(f"{N}-s-layer", None, min=0, step=1, width="70px")),
            _field("sort", dcc.Dropdown(id=f"{N}-s-sort", options=SORTS, value="specificity", clearable=False, style={"width": 130})),
            _field("page", _number(f"{N}-s-page", 1, min=1, step=1, width="70px")),
            html.Button("Search", id=f"{N}-s-go"),
        ]),
        html.Div(id=f"{N}-s-error"),
        dcc.Loading(html.Div(id=f"{N}-s-results", className="table-scroll"), type="dot"),
    ])


# --------------------------------------------------------------------------- pure helpers (tested without a browser)


def model_problem(a: str | None, b: str | None, names: Names) -> str | None:
    """Why A and B cannot be compared before asking the API: the same profile, or profiles of different models."""
    if not a or not b:
        return "choose two ready profiles of the same model (Workspace → Profile on two calibration sets)"
    if a == b:
        return "A and B are the same profile: choose a profile of the same model on other text as B"
    pa, pb = names.profiles.get(a), names.profiles.get(b)
    if pa and pb and pa.get("model_id") != pb.get("model_id"):
        return (f"A is a profile of {names.model(pa.get('model_id'))}, B of {names.model(pb.get('model_id'))}: these are different "
                "models, whose neurons cannot be compared; choose two profiles of the same model")
    return None


def b_options(options: list[dict[str, Any]], a: str | None, names: Names) -> list[dict[str, Any]]:
    """B's choices: profiles of A's model first; the others disabled, saying they are of another model."""
    model = (names.profiles.get(a or "") or {}).get("model_id")
    same, other = [], []
    for o in options:
        p = names.profiles.get(o["value"]) or {}
        if model is None or p.get("model_id") == model:
            same.append(o)
        else:
            other.append({**o, "label": f"{o['label']} (another model)", "disabled": True})
    return same + other


def set_names(a: str, b: str, names: Names) -> tuple[str, str]:
    """What A and B are on figures: their calibration sets' names (the profile ids when the sets are the same)."""
    sa, sb = (names.set((names.profiles.get(p) or {}).get("calibration_set_id")) for p in (a, b))
    return (sa, sb) if sa != sb else (f"{sa} ({a})", f"{sb} ({b})")


def _snips(tops: list[dict[str, Any]], label: str) -> html.Div:
    if not tops:
        return html.Div("–", className="note")
    scale = max(abs(t["value"]) for t in tops)
    return html.Div([S.snippet(t, scale, label) for t in tops])


#: the most-specific tables' columns and what each number is (a header's hover text)
COLUMNS = [("#", "rank"), ("neuron", "its card in each profile"), ("d", "set-specificity (Cohen's d over per-sample means)"),
           ("mean gate act. A", "mean over A's samples of act(x·W_gate), the quantity d compares"), ("mean gate act. B", "the same on B"),
           ("top-K rate A", "share of A's tokens where the neuron is among the top-K |h| (ATopK, CM Eq. 4)"),
           ("top-K rate B", "the same on B"), ("top tokens in A (h)", "its strongest tokens in A's text, coloured by h = act(x·W_gate)·(x·W_up)"),
           ("top tokens in B (h)", "the same in B's text")]


def specific_table(data: dict[str, Any], side: str) -> html.Table | html.Div:
    """The most specific neurons of ``side``: each links to its card in that side's profile (and the other's)."""
    rows = F.specific_rows(data, side)
    if not rows:
        return html.Div("no neuron", className="note")
    own, other = data[side], data["b" if side == "a" else "a"]
    head = html.Tr([html.Th(h, title=t) for h, t in COLUMNS])
    body = []
    for row, neuron in zip(rows, data[f"top_{side}"], strict=True):
        label = f"layer {row['layer']} · neuron {row['neuron']}"
        links = [dcc.Link(label, href=neuron_href(own, row["layer"], row["neuron"]), className="neuron-link"), html.Br(),
                 dcc.Link("card in the other profile", href=neuron_href(other, row["layer"], row["neuron"]), className="note")]
        body.append(html.Tr([html.Td(row["rank"]), html.Td(links), html.Td(fmt(row["d"], 3)), html.Td(fmt(row["mean_a"])),
                             html.Td(fmt(row["mean_b"])), html.Td(fmt_pct(row["rate_a"])), html.Td(fmt_pct(row["rate_b"])),
                             html.Td(_snips(neuron["top_a"], f"A: {label}"), style=SNIPPET_CELL),
                             html.Td(_snips(neuron["top_b"], f"B: {label}"), style=SNIPPET_CELL)],
                            className=f"specific-{side}"))
    return html.Table([head, *body], className="list")


def search_table(found: dict[str, Any]) -> html.Div:
    """A search page: each neuron links to its card in the searched profile."""
    profile = found["profile_id"]
    head = html.Tr([html.Th(h) for h in ("neuron", "d", "CV", "rate", "mean", "matching top tokens")])
    body = [html.Tr([html.Td(dcc.Link(f"layer {i['layer']} · neuron {i['neuron']}", href=neuron_href(profile, i["layer"], i["neuron"]),
                                      className="neuron-link")),
                     html.Td(fmt(i["specificity"], 3)), html.Td(fmt(i["cv"])), html.Td(fmt_pct(i["rate"])), html.Td(fmt(i["mean"])),
                     html.Td(", ".join(repr(t) for t in i["tokens"] or []))]) for i in found["items"]]
    return html.Div([html.Div(found["note"], className="note"), html.Table([head, *body], className="list") if body else html.Div()])


# --------------------------------------------------------------------------- callbacks


@callback(Output(f"{N}-url", "search"), Input(f"{N}-a", "value"), Input(f"{N}-b", "value"), Input(f"{N}-layer", "value"),
          Input(f"{N}-threshold", "value"), Input(f"{N}-fdr", "value"))
def _url(a, b, layer, threshold, fdr):
    return to_search(a=a, b=b, layer=layer, threshold=threshold, fdr=fdr)


@callback(Output(f"{N}-b", "options"), Input(f"{N}-a", "value"))
def _b_options(a):
    profiles, _err = options_or_error("profiles")
    return b_options(profiles, a, page_names())


@callback(Output(f"{N}-layer", "value"), Input(f"{N}-shares", "clickData"), prevent_initial_call=True)
def _pick_layer(click):
    """A click on a layer's bar shows that layer's scatter."""
    return int(click["points"][0]["x"]) if click else dash.no_update


def _blank(message: str) -> tuple:
    fig = FC.message_figure(message)
    return fig, fig, None, None, "", "", error_box(message), None, None, "Most specific to A", "Most specific to B"


@callback(Output(f"{N}-scatter", "figure"), Output(f"{N}-shares", "figure"),
          Output({"type": "csv-data", "name": f"{N}-scatter"}, "data"), Output({"type": "csv-data", "name": f"{N}-shares"}, "data"),
          Output({"type": "note", "name": f"{N}-scatter"}, "children"), Output({"type": "note", "name": f"{N}-shares"}, "children"),
          Output(f"{N}-error", "children"), Output(f"{N}-top-a", "children"), Output(f"{N}-top-b", "children"),
          Output(f"{N}-top-a-title", "children"), Output(f"{N}-top-b-title", "children"),
          Input(f"{N}-a", "value"), Input(f"{N}-b", "value"), Input(f"{N}-layer", "value"), Input(f"{N}-threshold", "value"),
          Input(f"{N}-fdr", "value"))
def _compare(a, b, layer, threshold, fdr):
    names = page_names()
    problem = model_problem(a, b, names)
    if problem:
        return _blank(problem)
    try:
        data = api().compare_profiles(a, b, layer=layer, threshold=threshold or None, fdr=fdr or None, top=TOP, snippets=2)
    except ApiError as exc:
        return _blank(str(exc))
    sets = set_names(a, b, names)
    (scatter, s_note), (shares, b_note) = FC.without_note(F.specificity_scatter(data, sets)), FC.without_note(F.specific_share_bars(data, sets))
    return (scatter, shares, {"kind": "profile-compare", "data": data, "filename": f"specificity_layer{data['layer']}"},
            {"kind": "specific-shares", "data": data, "filename": "specific_share_by_layer"}, f"{s_note}; {data['note']}", b_note,
            error_box(None), specific_table(data, "a"), specific_table(data, "b"),
            f"Most specific to A: {sets[0]}", f"Most specific to B: {sets[1]}")


@callback(Output(f"{N}-s-results", "children"), Output(f"{N}-s-error", "children"),
          Input(f"{N}-s-go", "n_clicks"), Input(f"{N}-s-token", "value"), Input(f"{N}-s-page", "value"),
          State(f"{N}-a", "value"), State(f"{N}-b", "value"), State(f"{N}-s-side", "value"), State(f"{N}-s-min-d", "value"),
          State(f"{N}-s-cv-min", "value"), State(f"{N}-s-cv-max", "value"), State(f"{N}-s-rate-min", "value"),
          State(f"{N}-s-rate-max", "value"), State(f"{N}-s-layer", "value"), State(f"{N}-s-sort", "value"),
          State(f"{N}-s-part", "value"), prevent_initial_call=True)
def _search(_go, token, page, a, b, side, min_d, cv_min, cv_max, rate_min, rate_max, layer, sort, part):
    """The search runs on its button (or Enter in the token box, or a page change)."""
    searched, other = (a, b) if side == "a" else (b, a)
    if not searched:
        return None, error_box("choose profile A (and B to search by specificity)")
    vs = other if other and other != searched else None
    filters = {"token": token or None, "match": "substring" if part else None, "cv_min": cv_min, "cv_max": cv_max, "rate_min": rate_min, "rate_max": rate_max, "layer": layer,
               "vs": vs, "min_specificity": min_d, "sort": sort if vs or sort != "specificity" else None,
               "limit": PAGE, "offset": PAGE * (max(1, int(page or 1)) - 1)}
    try:
        found = api().search_neurons(searched, **filters)
    except ApiError as exc:
        return None, error_box(str(exc))
    return search_table(found), error_box(None)
