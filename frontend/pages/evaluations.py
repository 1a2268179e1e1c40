"""Evaluations as a notebook: every evaluation in one list, filtered by tag, method, held-out text,
status and words (``GET /evaluations?…``); notes and tags written on any of them (``PATCH …/notes``);
two or more overlaid as per-layer curves: reconstruction error, expert load CV and the routing's
Jensen–Shannon divergence between the run's text and another text the same conversion was scored on.
State in the URL: ?ids=EV1,EV2&tag=…&method=…&text=…&status=…&q=…&against=TEXT&metric=…"""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, callback, dcc, html, no_update

from frontend.figures import evaluations as F, common as FC
from moelab.api_client import ApiError, api
from frontend.downloads import tasks_table_url
from frontend.components import error_box, figure_card, page_names, to_search
from frontend.names import fmt, heldout_text, ratio_ci, with_id
from frontend.names import chart_label
from frontend.speed import PHASES, kernel_words, phase_text, phase_title, teal_words
from frontend.task_accuracy import accuracy_cell

dash.register_page(__name__, path="/evaluations", name="Evaluations", order=10)

N = "ev"
FILTERS = ("tag", "method", "text", "status", "q")
STATUSES = ["ready", "running", "queued", "failed", "cancelled"]


def _choices() -> tuple[list[str], list[str], list[str], str | None]:
    """(tags, methods, texts) the filters offer, and the API's error text."""
    try:
        tags = [t["tag"] for t in api().tags()]
        methods = [m["name"] for m in api().methods()]
        texts = sorted({heldout_text(e) for e in api().evaluations()})
        return tags, methods, texts, None
    except ApiError as exc:
        return [], [], [], str(exc)


def _dropdown(name: str, label: str, options: list[str], value: str | None, width: int = 180) -> html.Div:
    return html.Div([html.Label(label), dcc.Dropdown(id=f"{N}-{name}", options=options, value=value, style={"width": width})])


def layout(ids: str | None = None, tag: str | None = None, method: str | None = None, text: str | None = None,
           status: str | None = None, q: str | None = None, against: str | None = None, metric: str = "reconstruction_error", **_):
    tags, methods, texts, err = _choices()
    metric = metric if metric in F.LAYER_METRICS else "reconstruction_error"
    chosen = [i for i in (ids or "").split(",") if i]  # offered until the list names them: a value must be an option
    return html.Div([
        dcc.Location(id=f"{N}-url", refresh=False),
        dcc.Store(id=f"{N}-saved", data=0),
        html.H2("Evaluations"),
        error_box(err),
        html.Div(className="controls", children=[
            _dropdown("tag", "tag", tags, tag), _dropdown("method", "method", methods, method),
            _dropdown("text", "held-out text", texts, text, 240), _dropdown("status", "status", STATUSES, status, 130),
            html.Div([html.Label("words (id, text, notes, tags)"),
                      dcc.Input(id=f"{N}-q", type="text", value=q or "", debounce=True, style={"width": 240})]),
        ]),
        html.Div(id=f"{N}-count", className="note"),
        html.Div(id=f"{N}-table", className="table-scroll"),
        html.H3("Notes and tags"),
        html.Div(className="controls", children=[
            html.Div([html.Label("evaluation"), dcc.Dropdown(id=f"{N}-edit", style={"width": 520})]),
            html.Div([html.Label("tags (comma-separated)"), dcc.Input(id=f"{N}-tags", type="text", style={"width": 260})]),
        ]),
        dcc.Textarea(id=f"{N}-notes", style={"width": "100%", "height": 80}, placeholder="what this run shows, what to try next"),
        html.Button("Save notes and tags", id=f"{N}-save", className="primary"),
        html.Span(id=f"{N}-save-msg", className="note"),
        html.H3("Overlay per-layer curves"),
        html.Div(className="controls", children=[
            html.Div([html.Label("evaluations to overlay"),
                      dcc.Dropdown(id=f"{N}-ids", multi=True, value=chosen, options=chosen, style={"width": 760})]),
            html.Div([html.Label("curve"), dcc.Dropdown(id=f"{N}-metric", clearable=False, value=metric, style={"width": 240},
                                                        options=[{"label": v[0], "value": k} for k, v in F.LAYER_METRICS.items()])]),
            _dropdown("against", "divergence against text", texts, against, 240),
        ]),
        html.Div(className="row", children=[figure_card(f"{N}-overlay", "Per-layer curves")]),
    ])


def _rows(filters: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, tuple[str, dict[str, Any]]]]:
    """The filtered evaluations and, per conversion id, its chart name and record."""
    evals = api().evaluations(**{k: v for k, v in filters.items() if v})
    names = page_names()
    try:
        methods = {m["name"]: m for m in api().methods()}
    except ApiError:
        methods = {}
    convs = {c["id"]: c for c in api().conversions()}
    named = {cid: (chart_label(c, names, methods)[0], c) for cid, c in convs.items()}
    return evals, named


def run_label(e: dict[str, Any], named: dict[str, tuple[str, dict[str, Any]]]) -> str:
    """'code · expertweaver best on builtin:prose': the conversion's chart name and the text scored."""
    conv = named.get(e["conversion_id"], (e["conversion_id"], {}))[0]
    return f"{conv} on {heldout_text(e)}"


def _accuracy_with_downloads(e: dict[str, Any]) -> list[Any] | str:
    """The accuracy cell and, when the evaluation ran tasks, its paper-style table as CSV and Markdown."""
    text = accuracy_cell(e.get("summary"))
    if not text:
        return ""
    return [text, " ", html.A("CSV", href=tasks_table_url(e["id"], "csv"), className="small"), " · ",
            html.A("Markdown", href=tasks_table_url(e["id"], "md"), className="small")]


KERNEL_DENSE_TITLE = ("The dense model's own weights with each MLP run in moelab's decode kernel (the same outputs, "
                      "FFN cost 1.0), timed in the same rounds: the part of the conversion's speed-up that the kernels "
                      "give, and after ';' the conversion's speed over it, what its sparsity gives")


def _table(evals: list[dict[str, Any]], named: dict[str, tuple[str, dict[str, Any]]]) -> html.Table:
    header = html.Tr([html.Th(h) for h in ("evaluation", "id", "status", "method", "text", "FFN cost", "perplexity × dense (95% CI)",
                                           "recon. error (mean)", "load CV (mean)", *(f"{name} speed × dense" for name in PHASES.values()),
                                           "dense in moelab's kernels (speed b1 / b8 / prefill)",
                                           "TEAL at the same cost (speed b1 / b8 / prefill)",
                                           "task accuracy (converted / dense)",
                                           "tags", "notes", "created")])
    body = []
    for e in evals:
        conv = named.get(e["conversion_id"], ("", {}))[1]
        d = ((e.get("summary") or {}).get("variants") or {}).get("converted") or {}
        notes = e.get("notes") or ""
        body.append(html.Tr([
            html.Td(run_label(e, named)), html.Td(e["id"], className="note"), html.Td(e["status"]), html.Td(conv.get("method") or ""),
            html.Td(heldout_text(e)), html.Td(fmt(((conv.get("summary") or {}).get("ffn_flops_fraction")), 3)),
            html.Td(ratio_ci(d.get("perplexity_ratio"), d.get("perplexity_ratio_ci"))), html.Td(fmt(d.get("mean_reconstruction_error"), 3)),
            html.Td(fmt(d.get("mean_load_cv"), 3)),
            *(html.Td(phase_text(e.get("summary"), phase), title=phase_title(e.get("summary"), phase)) for phase in PHASES),
            html.Td(kernel_words(e.get("summary")), className="kernel-dense", title=KERNEL_DENSE_TITLE),
            html.Td(teal_words(e.get("summary")), className="teal", title="TEAL (training-free activation sparsity) at the "
                    "conversion's FFN cost, timed in the same rounds; on CPU its decode step reads only the weight rows of "
                    "nonzero inputs"),
            html.Td(_accuracy_with_downloads(e)), html.Td(", ".join(e.get("tags") or []), className="tags"),
            html.Td(notes if len(notes) <= 80 else notes[:79] + "…", title=notes), html.Td(str(e.get("created_at", ""))[:16]),
        ]))
    return html.Table([header, *body], className="list")


@callback(Output(f"{N}-table", "children"), Output(f"{N}-count", "children"), Output(f"{N}-ids", "options"),
          Output(f"{N}-edit", "options"), Output(f"{N}-edit", "value"),
          *[Input(f"{N}-{f}", "value") for f in FILTERS], Input(f"{N}-saved", "data"), State(f"{N}-edit", "value"),
          State(f"{N}-ids", "value"))
def _list(tag, method, text, status, q, _saved, editing, chosen):
    try:
        evals, named = _rows({"tag": tag, "method": method, "text": text, "status": status, "q": q})
    except ApiError as exc:
        return error_box(str(exc)), "", [], [], None
    options = [{"label": with_id(run_label(e, named), e["id"]), "value": e["id"]} for e in evals if e["status"] == "ready"]
    # runs already chosen stay choosable when a filter hides them
    kept = [o for o in _chosen_options(chosen or [], named) if o["value"] not in {x["value"] for x in options}]
    edit = [{"label": with_id(run_label(e, named), e["id"]), "value": e["id"]} for e in evals]
    ids = {e["id"] for e in evals}
    value = editing if editing in ids else (evals[0]["id"] if evals else None)
    n = len(evals)
    count = f"{n} evaluation{'s' if n != 1 else ''}" + ((" match" if n != 1 else " matches") + " the filters" if any((tag, method, text, status, q)) else "")
    return _table(evals, named), count, options + kept, edit, value


def _chosen_options(ids: list[str], named: dict[str, tuple[str, dict[str, Any]]]) -> list[dict[str, str]]:
    out = []
    for ident in ids:
        try:
            e = api().get(f"/evaluations/{ident}")
        except ApiError:
            continue
        out.append({"label": with_id(run_label(e, named), ident), "value": ident})
    return out


@callback(Output(f"{N}-tag", "options"), Input(f"{N}-saved", "data"), prevent_initial_call=True)
def _tag_options(_saved):
    """A tag just written is offered by the tag filter at once, not after a reload."""
    try:
        return [t["tag"] for t in api().tags()]
    except ApiError:
        return no_update


@callback(Output(f"{N}-notes", "value"), Output(f"{N}-tags", "value"), Input(f"{N}-edit", "value"), Input(f"{N}-saved", "data"))
def _load_notes(ident, _saved):
    if not ident:
        return "", ""
    try:
        e = api().get(f"/evaluations/{ident}")
    except ApiError:
        return "", ""
    return e.get("notes") or "", ", ".join(e.get("tags") or [])


@callback(Output(f"{N}-save-msg", "children"), Output(f"{N}-saved", "data"), Input(f"{N}-save", "n_clicks"),
          State(f"{N}-edit", "value"), State(f"{N}-notes", "value"), State(f"{N}-tags", "value"), State(f"{N}-saved", "data"),
          prevent_initial_call=True)
def _save(_n, ident, notes, tags, saved):
    if not ident:
        return "choose an evaluation first", no_update
    tag_list = [t.strip() for t in (tags or "").split(",") if t.strip()]
    try:
        out = api().set_notes("evaluations", ident, notes=notes or "", tags=tag_list)
    except ApiError as exc:
        return f"not saved: {exc}", no_update
    return f"saved: {len(out['tags'])} tag(s) on {ident}", (saved or 0) + 1


@callback(Output(f"{N}-overlay", "figure"), Output({"type": "csv-data", "name": f"{N}-overlay"}, "data"), Output(f"{N}-url", "search"),
          Input(f"{N}-ids", "value"), Input(f"{N}-metric", "value"), Input(f"{N}-against", "value"),
          *[Input(f"{N}-{f}", "value") for f in FILTERS])
def _overlay(ids, metric, against, *filters):
    ids = ids or []
    search = to_search(ids=",".join(ids), against=against, metric=metric, **dict(zip(FILTERS, filters, strict=True)))
    if len(ids) < 1:
        return FC.message_figure("choose evaluations to overlay"), None, search
    if metric == "js" and not against:
        return FC.message_figure("choose the text to measure the routing's divergence against"), None, search
    try:
        runs, missing = overlay_runs(ids, metric, against)
    except ApiError as exc:
        return FC.message_figure(str(exc)), None, search
    note = f"no evaluation on {against} of: {'; '.join(missing)}" if missing else None
    rows = [{"run": r["label"], "evaluation_id": r["evaluation_id"], "layer": layer, metric: v}
            for r in runs for layer, v in zip(r["layers"], r["values"], strict=True)]
    return F.layer_overlay(runs, metric, note), ({"rows": rows, "filename": f"layers_{metric}"} if rows else None), search


def overlay_runs(ids: list[str], metric: str, against: str | None) -> tuple[list[dict[str, Any]], list[str]]:
    """The lines to overlay (``F.layer_overlay``'s runs) and the runs with no line: for ``js``, those
    whose conversion has no ready evaluation on ``against`` (other than the run itself)."""
    names = page_names()
    methods = {m["name"]: m for m in api().methods()}
    runs, missing = [], []
    for ident in ids:
        e = api().get(f"/evaluations/{ident}")
        conv = api().conversion(e["conversion_id"])
        label = f"{chart_label(conv, names, methods)[0]} on {heldout_text(e)}"
        curves = api().layer_curves(ident)
        if metric == "js":
            other = next((o for o in api().evaluations(e["conversion_id"], text=against, status="ready") if o["id"] != ident), None)
            if other is None:
                missing.append(label)
                continue
            values = F.js_between(curves, api().layer_curves(other["id"]))
            label = f"{label} vs {against}"
        else:
            values = curves[metric]
        runs.append({"label": label, "evaluation_id": ident, "layers": curves["layers"], "values": values})
    return runs, missing
