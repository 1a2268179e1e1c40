"""Token routing: paste a text or pick a held-out sample, and see every token coloured by the
expert it is routed to, layer by layer, for one conversion or two side by side (two calibration
sets' conversions, or the paper recipe against the best one). Each conversion's routing is a
short probe job on the worker (the API runs no model). Choosing an expert shows that expert's
view: only the tokens routed to it are coloured.
Expert ids of two conversions are unrelated labels, so B's experts are named and coloured after the
A experts they are matched to by their dense neurons (``GET /conversions/{a}/matching/{b}``: "B e7 ≙ A
e3 (J=0.62)"), the expert field picks A's expert and B's matched one, and the layer's overlap matrix
is drawn below; layers or methods without neuron sets say why they are not matched.
State in the URL: ?a=…&b=…&pa=…&pb=…&source=…&sample=…&layer=…&expert=… (conversions, their probes, the
held-out sample they read, the view); a shared URL opens with its controls set from these (and the
probe's own text when it routed a typed text)."""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, callback, dcc, html, no_update

from frontend.figures import matching as F
from moelab.api_client import ApiError, api
from frontend.components import GRAPH_CONFIG, error_box, options_or_error, progress, to_search
from frontend.token_view import expert_card, routed_layers, routed_tokens

dash.register_page(__name__, path="/tokens", name="Token routing", order=8)

N = "tk"
TERMINAL = ("succeeded", "failed", "cancelled")
TEXT = "type a text (routing reads its first 512 tokens)"
SAMPLE_SETS = ("code", "prose", "literature", "chat", "code_problems", "math", "mixed")
DEFAULT_TEXT = "def mean(values):\n    return sum(values) / len(values)  # the average"


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _probe(probe_id: str | None) -> dict[str, Any] | None:
    if not probe_id:
        return None
    try:
        return api().probe(probe_id)
    except ApiError:
        return None


def initial_controls(query: dict[str, Any], probe_a: dict[str, Any] | None, probe_b: dict[str, Any] | None,
                     default_a: str | None = None) -> dict[str, Any]:
    """The controls' values for a URL (a shared link opens with the controls it was made with):
    the URL's own values first, then what its probes were run on (their conversions, text or
    held-out sample), then the defaults."""
    params = (probe_a or {}).get("params") or {}
    sources = {f"builtin:{n}" for n in SAMPLE_SETS}
    source = query.get("source") or params.get("sample_source") or "text"
    sample = _int(query.get("sample"))
    if sample is None:
        sample = _int(params.get("sample")) or 0
    return {
        "a": query.get("a") or (probe_a or {}).get("conversion_id") or default_a,
        "b": query.get("b") or (probe_b or {}).get("conversion_id"),
        "source": source if source in sources else "text",
        "sample": sample,
        "text": query.get("text") or params.get("text") or DEFAULT_TEXT,
        "layer": _int(query.get("layer")),
        "expert": _int(query.get("expert")),
    }


def layout(a: str | None = None, b: str | None = None, pa: str | None = None, pb: str | None = None,
           layer: str | None = None, expert: str | None = None, source: str | None = None, sample: str | None = None,
           text: str | None = None, **_):
    convs, err = options_or_error("conversions")
    probe_a, probe_b = _probe(pa), _probe(pb)
    init = initial_controls({"a": a, "b": b, "layer": layer, "expert": expert, "source": source, "sample": sample, "text": text},
                            probe_a, probe_b, convs[0]["value"] if convs else None)
    sources = [{"label": TEXT, "value": "text"}] + [{"label": f"held-out sample of builtin:{n}", "value": f"builtin:{n}"}
                                                     for n in SAMPLE_SETS]
    probes = {"a": pa, "b": pb} if pa else None
    return html.Div([
        dcc.Location(id=f"{N}-url", refresh=False),
        html.H2("Token routing"),
        html.P("Each token coloured by the expert it is routed to in one layer (hover for all its experts); "
               "two conversions side by side on the same text.", className="note"),
        error_box(err),
        html.Div(className="controls", children=[
            html.Div([html.Label("conversion A"), dcc.Dropdown(id=f"{N}-a", options=convs, value=init["a"], clearable=False, style={"width": 480})]),
            html.Div([html.Label("conversion B (optional)"), dcc.Dropdown(id=f"{N}-b", options=convs, value=init["b"], style={"width": 480})]),
        ]),
        html.Div(className="controls", children=[
            html.Div([html.Label("text"), dcc.Dropdown(id=f"{N}-source", options=sources, value=init["source"], clearable=False, style={"width": 330})]),
            html.Div([html.Label("sample (0–47)"), dcc.Input(id=f"{N}-sample", type="number", min=0, max=47, step=1, value=init["sample"],
                                                         style={"width": 90})]),
            html.Button("Route tokens", id=f"{N}-run", className="primary"),
        ]),
        dcc.Textarea(id=f"{N}-text", value=init["text"], style={"width": "100%", "height": 90}),
        html.Div(id=f"{N}-jobs"),
        dcc.Store(id=f"{N}-probes", data=probes), dcc.Store(id=f"{N}-ready", data=probes),
        dcc.Interval(id=f"{N}-poll", interval=1000, disabled=True),
        html.Div(className="controls", children=[
            html.Div([html.Label("layer"), dcc.Dropdown(id=f"{N}-layer", options=[init["layer"]] if init["layer"] is not None else [],
                                                        value=init["layer"], clearable=False, style={"width": 120})]),
            html.Div([html.Label("expert (blank: all)"), dcc.Input(id=f"{N}-expert", type="number", min=0, step=1, value=init["expert"],
                                                               debounce=True, style={"width": 90})]),
        ]),
        html.Div(id=f"{N}-view", className="row"),
        html.Div(id=f"{N}-match"),
        html.Div(id=f"{N}-error"),
    ])


@callback(Output(f"{N}-probes", "data"), Output(f"{N}-poll", "disabled"), Output(f"{N}-error", "children"),
          Input(f"{N}-run", "n_clicks"), State(f"{N}-a", "value"), State(f"{N}-b", "value"), State(f"{N}-source", "value"),
          State(f"{N}-sample", "value"), State(f"{N}-text", "value"), prevent_initial_call=True)
def _run(_n, a, b, source, sample, text):
    if not a:
        return no_update, True, error_box("choose a conversion (make one in the Conversion designer)")
    body: dict[str, Any] = {"text": text} if source == "text" else {"sample_source": source, "sample": _int(sample) or 0}
    made: dict[str, str | None] = {"a": None, "b": None}
    try:
        for side, conversion in (("a", a), ("b", b)):
            if conversion:
                made[side] = api().create_probe(conversion, "routing", **body)["id"]
    except ApiError as exc:
        return no_update, True, error_box(f"could not start: {exc}")
    return made, False, error_box(None)


@callback(Output(f"{N}-jobs", "children"), Output(f"{N}-ready", "data"), Output(f"{N}-poll", "disabled", allow_duplicate=True),
          Input(f"{N}-poll", "n_intervals"), State(f"{N}-probes", "data"), prevent_initial_call=True)
def _poll(_n, probes):
    if not probes:
        return None, no_update, True
    try:
        rows = {side: api().probe(pid) for side, pid in probes.items() if pid}
    except ApiError as exc:
        return error_box(str(exc)), no_update, True
    done = all(r["job"] is None or r["job"]["state"] in TERMINAL for r in rows.values())
    bars = [progress(r.get("job"), f"routing of conversion {side.upper()}") for side, r in rows.items()]
    return html.Div(bars), (probes if done else no_update), done


@callback(Output(f"{N}-layer", "options"), Output(f"{N}-layer", "value"), Input(f"{N}-ready", "data"), State(f"{N}-layer", "value"))
def _layers(probes, layer):
    if not probes or not probes.get("a"):
        return [], None
    try:
        layers = routed_layers(api().probe_result(probes["a"]))
    except ApiError:
        return [], None
    return [{"label": str(i), "value": i} for i in layers], (layer if layer in layers else (layers[len(layers) // 2] if layers else None))


def _matching(conversions: dict[str, str], layer: int) -> tuple[dict[str, Any] | None, str | None]:
    """B's experts matched to A's in ``layer`` (the matching's entry), or why they are not."""
    if not conversions.get("a") or not conversions.get("b"):
        return None, None
    unrelated = "the expert ids of A and B are unrelated labels: equal numbers are not the same expert"
    try:
        matching = api().expert_matching(conversions["a"], conversions["b"], layer)
    except ApiError as exc:
        return None, f"B's experts are not matched to A's ({exc}); {unrelated}"
    entry = F.matched_layer(matching, layer)
    if entry is None:
        return None, f"B's experts are not matched to A's in layer {layer}: {F.skipped_reason(matching, layer)}; {unrelated}"
    return entry, None


def _side(side: str, probe: dict[str, Any], result: dict[str, Any], layer: int, expert: int | None,
          entry: dict[str, Any] | None) -> html.Div:
    """One conversion's tokens (B's experts under A's matched ids and colours) and, for a chosen expert
    (A's numbering), its card with its best match in the other conversion."""
    title = f"{side.upper()}: {probe['conversion_id']} ({result.get('method')}, {len(result['tokens'])} tokens)"
    own, note = expert, None
    colour_ids = labels = None
    if entry is not None:
        labels = {e["expert"]: F.matched_label(entry, side, e["expert"]) for e in entry[side]}
        colour_ids = F.matched_colour_ids(entry) if side == "b" else None
        if side == "b" and expert is not None:  # the expert field names A's expert: B shows the one matched to it
            own = entry["a"][expert]["match"] if 0 <= expert < entry["n_a"] else None
            if own is None:
                note = f"A's expert {expert} has no match in B: B's tokens are shown unfiltered"
    children = [html.Div(note, className="note") if note else None,
                routed_tokens(result, layer, own, title=title, colour_ids=colour_ids, labels=labels)]
    if own is not None:  # the expert's card: its neurons, linked to the neuron explorer
        try:
            children.append(expert_card(api().expert_neurons(probe["conversion_id"], layer), own))
        except ApiError as exc:
            children.append(html.Div(str(exc), className="note"))
        if entry is not None and 0 <= own < len(entry[side]):
            children.append(html.Div(F.best_match_text(entry, side, own), className="note best-match"))
    return html.Div(children, className="col")


@callback(Output(f"{N}-view", "children"), Output(f"{N}-match", "children"), Output(f"{N}-url", "search"),
          Input(f"{N}-ready", "data"), Input(f"{N}-layer", "value"), Input(f"{N}-expert", "value"),
          State(f"{N}-a", "value"), State(f"{N}-b", "value"))
def _view(probes, layer, expert, a, b):
    search = to_search(a=a, b=b, pa=(probes or {}).get("a"), pb=(probes or {}).get("b"), layer=layer, expert=expert)
    if not probes or layer is None:
        return html.Div("Route a text to see its tokens.", className="note"), None, search
    cards, shown = [], {}
    for side, pid in probes.items():
        if not pid:
            continue
        try:
            shown[side] = api().probe(pid), api().probe_result(pid)
        except ApiError as exc:
            cards.append(error_box(f"conversion {side.upper()}: {exc}"))
    if "a" in shown and (params := shown["a"][0].get("params") or {}).get("sample_source"):
        # the URL says which held-out sample (a typed text is in the probe)
        search = to_search(a=a, b=b, pa=probes.get("a"), pb=probes.get("b"), source=params["sample_source"],
                           sample=params.get("sample", 0), layer=layer, expert=expert)
    entry, why = _matching({side: probe["conversion_id"] for side, (probe, _) in shown.items()}, layer)
    cards += [_side(side, probe, result, layer, _int(expert), entry) for side, (probe, result) in shown.items()]
    match = None
    if entry is not None:
        match = html.Div([dcc.Graph(id=f"{N}-overlap", figure=F.expert_overlap(entry), config=GRAPH_CONFIG)], className="card")
    elif why:
        match = html.Div(why, className="note")
    return cards, match, search
