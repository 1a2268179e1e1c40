"""Pieces every page uses: a figure card (graph + CSV download + PNG via the mode bar), error
text, job progress, and URL query-string state."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlencode

from dash import MATCH, Input, Output, State, callback, dcc, html, no_update

from frontend.figures import tables as F, common as FC
from .names import Names, with_id

GRAPH_CONFIG = {"displaylogo": False, "toImageButtonOptions": {"format": "png", "scale": 2}}


def figure_card(name: str, title: str = "", loading: bool = True) -> html.Div:
    """A graph with a note line and a 'CSV' button that downloads the figure's data.

    ``loading=False`` for graphs redrawn on every slider move (no spinner flicker)."""
    graph = dcc.Graph(id=name, figure=FC.message_figure("loading…"), config=GRAPH_CONFIG)
    return html.Div(className="card", children=[
        html.Div(className="card-head", children=[
            html.Span(title, className="card-title"),
            html.Button("CSV", id={"type": "csv-btn", "name": name}, className="small", title="download this figure's data"),
            dcc.Download(id={"type": "csv-dl", "name": name}),
        ]),
        dcc.Store(id={"type": "csv-data", "name": name}),
        html.Div(id={"type": "note", "name": name}, className="note subtitle"),
        dcc.Loading(graph, type="dot") if loading else graph,
    ])


@callback(Output({"type": "csv-dl", "name": MATCH}, "data"), Input({"type": "csv-btn", "name": MATCH}, "n_clicks"),
          State({"type": "csv-data", "name": MATCH}, "data"), prevent_initial_call=True)
def _download_csv(_n: int | None, stored: dict[str, Any] | None):
    if not stored:
        return no_update
    rows = stored["rows"] if "rows" in stored else F.table(stored["kind"], stored["data"])
    return dict(content=F.csv_text(rows), filename=f"{stored.get('filename', stored.get('kind', 'data'))}.csv")


def error_box(message: str | None) -> html.Div:
    return html.Div(message or "", className="error" if message else "", role="alert" if message else None)


def cancel_started(job_id: str | None) -> html.Div:
    """Cancel the job a page started (a queued one at once, a running one at its next progress step): its progress
    line after the request, or why not in words."""
    from moelab.api_client import ApiError, api

    if not job_id:
        return error_box("nothing to cancel: no job was started here")
    try:
        return progress(api().cancel_job(job_id))
    except ApiError as exc:
        return error_box(f"not cancelled: {exc}")


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th … 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def duration(seconds: float) -> str:
    """'40 s', '3 min', '1 h 05 min': as a person says a wait."""
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min"


def progress(job: dict[str, Any] | None, name: str | None = None, title: str | None = None) -> html.Div:
    """A job's state, stage and progress bar, with its error in words; ``name``: what it works on
    (shown before the job id), and how long it ran once finished. ``title`` replaces the whole
    'kind name — id' head (a phrase that already says what the job is)."""
    if not job:
        return html.Div()
    p = job.get("progress") or {}
    frac = p.get("fraction")
    if job["state"] == "succeeded":
        frac = 1.0
    head = title or f"{job['kind']} {with_id(name, job['id']) if name else job['id']}"
    label = f"{head}: {job['state']}"
    if job["state"] in ("succeeded", "failed", "cancelled") and isinstance(job.get("run_s"), (int, float)):
        label += f" in {job['run_s']:.1f} s"
    if job["state"] == "queued" and job.get("queue_position"):
        label += f" · {ordinal(job['queue_position'])} in line"
    if p.get("stage") and job["state"] == "running":
        label += f" — {p['stage']} {p.get('current', 0)}/{p.get('total', 0)}"
        if isinstance(p.get("stage_s"), (int, float)) and p["stage_s"] >= 1:  # a long step still moves on screen
            label += f" · {p['stage_s']:.0f} s"
        if isinstance(p.get("stage_left_s"), (int, float)):
            label += f" · about {duration(p['stage_left_s'])} left in this stage"
    if job["state"] == "running" and job.get("cancel_requested"):
        label += " · cancel requested: it stops at its next step"  # the click was heard, the worker has not checked yet
    children = [html.Div(label, className=f"job-label state-{job['state']}"),
                html.Progress(value=str(frac or 0), max="1", className="bar")]
    if job.get("error"):  # a cancelled job's reason is the user's own request, not an error
        children.append(html.Div(job["error"], className="error" if job["state"] == "failed" else "note"))
    return html.Div(children, className="job")


def query(search: str | None) -> dict[str, str]:
    """``?a=1&b=x`` → {'a': '1', 'b': 'x'} (last value wins)."""
    parsed = parse_qs((search or "").lstrip("?"), keep_blank_values=False)
    return {k: v[-1] for k, v in parsed.items()}


def to_search(**state: Any) -> str:
    clean = {k: v for k, v in state.items() if v not in (None, "", [])}
    return "?" + urlencode(clean) if clean else ""


def num(value: Any, default: float) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def options(items: list[dict[str, Any]], ready_only: bool = True, names: Names | None = None) -> list[dict[str, str]]:
    """Dropdown options: a human name first (model · set · method · key parameters for profiles and
    conversions when ``names`` is given), the id second."""
    out = []
    for it in items:
        if ready_only and it.get("status") != "ready":
            continue
        if names is not None and "method" in it:  # a conversion
            name = names.conversion(it)
        elif names is not None and "calibration_set_id" in it:  # a profile
            name = names.profile(it)
        else:
            name = it.get("name") or (it.get("params") or {}).get("label") or ""
        out.append({"label": with_id(name, it["id"]), "value": it["id"]})
    return out


BASELINES = "baselines (AbsTopK, uniform α, TEAL) — slower"


def baselines_choice(ident: str) -> html.Div:
    """The evaluation launchers' 'baselines' box (``ident``), off by default (a quick look: dense and
    converted only); ``wants_baselines`` reads its value for ``create_evaluation(baselines=…)``."""
    return html.Div(dcc.Checklist(id=ident, options=[{"label": BASELINES, "value": "baselines"}], value=[], className="baselines"),
                    title="also evaluate the AbsTopK-GLU, uniform-α and TEAL (activation sparsity at the conversion's cost) baselines: "
                          "up to three more models built and evaluated, several times slower")


def wants_baselines(value: list[str] | None) -> bool:
    return "baselines" in (value or [])


def memory_budget_input(ident: str, what: str) -> html.Div:
    """A job's memory budget (``max_memory`` of a profile or a conversion, ``what`` says which) as the user types it
    ('2GiB', '700MB'); :func:`memory_budget` reads it for the API, which checks it (422 in words)."""
    return html.Div([html.Label("memory budget"),
                     dcc.Input(id=ident, type="text", placeholder="e.g. 2GiB", style={"width": 100})],
                    title=f"the {what} of a model whose weights exceed it runs one decoder layer at a time, with the same "
                          "result (docs/large-models.md); empty: the server's MOELAB_MAX_MEMORY, unset there: the whole "
                          "model in memory")


def memory_budget(value: str | None) -> str | None:
    """The budget :func:`memory_budget_input` holds, for the API (empty: none, the server's default applies)."""
    return (value or "").strip() or None


def install_hint(name: str) -> str:
    return f"not installed: install with `moelab data install {name}`"


def builtin_options(builtins: list[dict[str, Any]], value: str = "name", describe: bool | None = None) -> list[dict[str, Any]]:
    """Dropdown options of the server's built-in sets (``value``: the option's ``name`` or ``spec``;
    ``describe``: what each holds after its name, by default with specs); one the server says is not
    installed (``installed: false``, e.g. bigbench) is shown disabled with how to install it
    (choosing it would only be refused)."""
    describe = value == "spec" if describe is None else describe
    out: list[dict[str, Any]] = []
    for b in builtins:
        shown = b["spec"] if value == "spec" else b["name"]
        if b.get("installed", True):
            label = f"{shown}: {b.get('description', '')}".rstrip(": ") if describe else shown
            out.append({"label": label, "value": b[value]})
        else:
            out.append({"label": f"{shown} — {install_hint(b['name'])}", "value": b[value], "disabled": True})
    return out


def source_options(builtins: list[dict[str, Any]], sets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Texts to evaluate on: every built-in set the server offers (``builtin:code`` … with what it
    holds; one not installed disabled, saying how to install it) and every ready calibration set
    (by name), as dropdown options."""
    return builtin_options(builtins, "spec") + options(sets)


def builtin_source_options() -> list[dict[str, str]]:
    """``source_options`` from the API; ``builtin:mixed`` alone when it does not answer (the page
    shows the API's error elsewhere)."""
    from moelab.api_client import ApiError, api

    try:
        return source_options(api().builtin_sets(), api().calibration_sets())
    except ApiError:
        return [{"label": "builtin:mixed", "value": "builtin:mixed"}]


def page_names(profiles: list[dict[str, Any]] | None = None) -> Names:
    """The names of models, sets and profiles (list calls; pages call it once per update). Names are
    a help, not the data: a list the API does not answer leaves its ids unnamed instead of failing
    the page."""
    from moelab.api_client import ApiError, api

    c = api()

    def _get(fetch):
        try:
            return fetch()
        except ApiError:
            return []

    return Names.from_lists(_get(c.models), _get(c.calibration_sets), profiles if profiles is not None else _get(c.profiles))


def named_options(kind: str, ready_only: bool = True) -> list[dict[str, str]]:
    """Options for ``profiles`` or ``conversions`` named model · set · method · key parameters
    (the list itself must be answered: its ApiError goes to the caller)."""
    from moelab.api_client import api

    if kind == "profiles":
        profiles = api().profiles()
        return options(profiles, ready_only, page_names(profiles))
    return options(api().conversions(), ready_only, page_names())


def not_offered(ident: str | None, offered: list[dict[str, str]]) -> tuple[str | None, str | None]:
    """A conversion named in the URL but not among the ready ones offered: ``(None, why in words)`` instead of
    dropping it silently (cancelled, failed, still running, deleted); ``(ident, None)`` when it is offered."""
    from moelab.api_client import ApiError, api

    if ident is None or any(o["value"] == ident for o in offered):
        return ident, None
    try:
        status = api().conversion(ident).get("status")
    except ApiError:
        return None, f"conversion {ident} (from the link) does not exist any more: choose one of the ready conversions"
    return None, f"conversion {ident} (from the link) is {status}, and only ready conversions can be shown: choose another"


def options_or_error(kind: str) -> tuple[list[dict[str, str]], str | None]:
    """``named_options(kind)`` and None, or no options and the API's error text for ``error_box``."""
    from moelab.api_client import ApiError

    try:
        return named_options(kind), None
    except ApiError as exc:
        return [], str(exc)


def profile_picker(page: str, profile: str | None) -> tuple[html.Div, str | None, str | None]:
    """The profile dropdown shared by the per-profile pages: (control, selected id, error text).

    With no profile in the URL the newest ready one is selected; an unreachable API becomes
    an error text for ``error_box`` rather than an exception.
    """
    profiles, err = options_or_error("profiles")
    if profile is None and profiles:
        profile = profiles[0]["value"]
    control = html.Div([html.Label("profile"), dcc.Dropdown(id=f"{page}-profile", options=profiles, value=profile,
                                                             clearable=False, style={"width": 320})])
    return control, profile, err
