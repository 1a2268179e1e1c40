"""Workspace: models, calibration sets, profiles, conversions and jobs with live progress, states,
durations and errors; buttons to create each, delete it (refused in words while something uses it,
then offered with everything that does, after a confirm), retry a failed job and download a
converted model; a getting-started path (model → set → profile → designer) until there is a profile."""

from __future__ import annotations

import dash
from dash import ALL, Input, Output, State, callback, ctx, dcc, html, no_update

from frontend.api_client import ApiError, api
from frontend.components import error_box, options, progress
from frontend.downloads import download_url
from frontend.names import Names, fmt, fmt_pct

dash.register_page(__name__, path="/", name="Workspace", order=0)

N = "ws"


def layout(**_):
    return html.Div([
        html.H2("Workspace"),
        html.Div(id=f"{N}-health", className="note"),
        html.Div(className="card", children=[
            html.Div("Create", className="card-title"),
            html.Div(className="controls", children=[
                html.Div([html.Label("model source ('default', org/name or a server path)"), dcc.Input(id=f"{N}-model-source", value="default", style={"width": 300})]),
                html.Button("Add model", id=f"{N}-add-model"),
                html.Div([html.Label("built-in calibration set"), dcc.Dropdown(id=f"{N}-builtin", options=["mixed"], value="mixed", clearable=False, style={"width": 180})]),
                html.Div([html.Label("samples"), dcc.Input(id=f"{N}-samples", type="number", value=240, min=1, style={"width": 90})]),
                html.Button("Build set", id=f"{N}-add-set"),
            ]),
            html.Div(className="controls", children=[
                html.Div([html.Label("model"), dcc.Dropdown(id=f"{N}-model", style={"width": 300})]),
                html.Div([html.Label("calibration set"), dcc.Dropdown(id=f"{N}-set", style={"width": 300})]),
                html.Div([html.Label("max tokens / sample"), dcc.Input(id=f"{N}-max-tokens", type="number", value=256, min=2, style={"width": 90})]),
                html.Button("Profile", id=f"{N}-add-profile"),
                dcc.Link("Design a conversion →", href="/designer"),
            ]),
            html.Div(id=f"{N}-created"),
            html.Div(id=f"{N}-cancelled"),
            html.Div(id=f"{N}-deleted"),
        ]),
        dcc.Store(id=f"{N}-pending-delete"),
        dcc.ConfirmDialog(id=f"{N}-confirm"),
        html.Div(id=f"{N}-start"),
        html.Div(id=f"{N}-lists"),
        dcc.Interval(id=f"{N}-poll", interval=1500),
    ])


def _table(title: str, items: list[dict], cols: list[tuple[str, callable]], link=None) -> html.Div:
    rows = [html.Tr([html.Th(c) for c, _ in cols])]
    for it in items:
        rows.append(html.Tr([html.Td(f(it)) for _, f in cols]))
    return html.Div(className="card", children=[html.Div(f"{title} ({len(items)})", className="card-title"),
                                                html.Table(rows, className="list") if items else html.Div("none yet", className="note")])


#: the getting-started path: (step, what to do, done when this list is non-empty)
STEPS = [("Add a model", "'default' is SmolLM2-135M, shipped offline; or a local directory / Hugging Face id", "models"),
         ("Build a calibration set", "a built-in set of text (code, prose, math, chat …) or upload JSONL on Calibration sets", "sets"),
         ("Profile the model on the set", "records how each neuron activates on each sample (the neuron explorer's data)", "profiles"),
         ("Design a conversion", "choose a method, see its plan per layer, convert, evaluate", "conversions")]


def getting_started(models: list[dict], sets: list[dict], profiles: list[dict], conversions: list[dict]) -> html.Div | None:
    """The four steps from nothing to a first conversion, each ticked once done (only ready
    resources count); None once a profile is ready (the lists below are the home from then on)."""
    ready = {k: [x for x in v if x.get("status") == "ready"]
             for k, v in {"models": models, "sets": sets, "profiles": profiles, "conversions": conversions}.items()}
    if ready["profiles"]:
        return None
    items = []
    for i, (step, hint, key) in enumerate(STEPS, 1):
        done = bool(ready[key])
        target = dcc.Link(step, href="/designer") if key == "conversions" else step
        items.append(html.Li([html.Span("✓ " if done else f"{i}. ", className="state-succeeded" if done else ""), target,
                              html.Span(f" — {hint}", className="note")]))
    return html.Div(className="card", id=f"{N}-getting-started", children=[
        html.Div("Getting started", className="card-title"), html.Ol(items, className="steps")])


def _clicked() -> dict | None:
    """The pattern id whose button was clicked; None when a callback fired because the lists were
    redrawn (new buttons arrive with n_clicks None)."""
    if not ctx.triggered or not ctx.triggered[0].get("value"):
        return None
    return ctx.triggered_id if isinstance(ctx.triggered_id, dict) else None


def _job_row(job: dict, names: dict[str, str] | None = None) -> html.Div:
    name = (names or {}).get(job.get("resource_id") or "")
    if job["state"] in ("failed", "cancelled"):
        return html.Div([progress(job, name), html.Button("Retry", id={"type": "ws-retry", "job": job["id"], "at": "jobs"}, className="small",
                                                          title="re-run this job (a new job for the same resource)")])
    if job["state"] not in ("queued", "running"):
        return progress(job, name)
    return html.Div([progress(job, name), html.Button("Cancel", id={"type": "ws-cancel", "job": job["id"]}, className="small")])


@callback(Output(f"{N}-cancelled", "children"), Input({"type": "ws-cancel", "job": ALL}, "n_clicks"),
          Input({"type": "ws-retry", "job": ALL, "at": ALL}, "n_clicks"), prevent_initial_call=True)
def _job_action(_cancels, _retries):
    clicked = _clicked()
    if clicked is None:
        return no_update
    job_id = clicked["job"]
    try:
        if clicked["type"] == "ws-retry":
            new = api().retry_job(job_id)
            return html.Div(f"{job_id} re-runs as job {new['id']}", className="note")
        api().cancel_job(job_id)
    except ApiError as exc:
        return error_box(f"could not {'retry' if clicked['type'] == 'ws-retry' else 'cancel'} {job_id}: {exc}")
    return html.Div(f"cancel requested for {job_id}", className="note")


def _delete_button(kind: str, it: dict) -> html.Button:
    return html.Button("Delete", id={"type": "ws-del", "kind": kind, "id": it["id"]}, className="small",
                       title="delete (refused while something uses it; then offered with everything that does)")


@callback(Output(f"{N}-pending-delete", "data"), Output(f"{N}-confirm", "message"), Output(f"{N}-confirm", "displayed"),
          Input({"type": "ws-del", "kind": ALL, "id": ALL}, "n_clicks"), Input({"type": "ws-cascade", "kind": ALL, "id": ALL}, "n_clicks"),
          prevent_initial_call=True)
def _ask_delete(_dels, _cascades):
    """Every delete is confirmed first; the cascade's confirm says it takes the dependants too."""
    clicked = _clicked()
    if clicked is None:
        return no_update, no_update, no_update
    cascade = clicked["type"] == "ws-cascade"
    what = f"{clicked['kind'][:-1].replace('-', ' ')} {clicked['id']}"
    message = (f"Delete {what} together with everything that depends on it? This cannot be undone." if cascade
               else f"Delete {what}? This cannot be undone.")
    return {"kind": clicked["kind"], "id": clicked["id"], "cascade": cascade}, message, True


@callback(Output(f"{N}-deleted", "children"), Input(f"{N}-confirm", "submit_n_clicks"), State(f"{N}-pending-delete", "data"),
          prevent_initial_call=True)
def _delete(_ok, pending):
    if not pending:
        return no_update
    kind, ident, cascade = pending["kind"], pending["id"], pending["cascade"]
    try:
        out = api().delete(kind, ident, cascade=cascade)
    except ApiError as exc:
        if exc.status == 409 and not cascade and "cascade" in str(exc):  # used by others: say by whom, offer the cascade
            used_by = str(exc).split("; delete those first", 1)[0]  # the API's next words are about ?cascade=true: the button says it here
            return html.Div([error_box(f"not deleted: {used_by}. Delete those first, or delete it together with everything that depends on it:"),
                             html.Button("Delete it with everything that depends on it",
                                         id={"type": "ws-cascade", "kind": kind, "id": ident}, className="small")])
        return error_box(f"could not delete {ident}: {exc}")
    gone = out.get("deleted") or []
    others = [d["id"] for d in gone if d["id"] != ident]
    text = f"deleted {ident}" + (f" and {len(others)} that depended on it ({', '.join(others)})" if others else "")
    if out.get("cancelled_jobs"):
        text += f"; cancelled job(s) {', '.join(out['cancelled_jobs'])}"
    return html.Div(text, className="note")


def _status(it: dict):
    job = it.get("job")
    if it["status"] in ("queued", "running") and job:
        return progress(job)
    if it["status"] in ("failed", "cancelled") and job:
        return html.Span([html.Span([it["status"], ": ", job.get("error") or ""], className="state-failed"), " ",
                          html.Button("Retry", id={"type": "ws-retry", "job": job["id"], "at": "row"}, className="small")])
    if it["status"] == "ready" and job and isinstance(job.get("run_s"), (int, float)):
        return f"ready ({job['run_s']:.1f} s)"  # how long its job ran
    return it["status"]


def _conversion_actions(v: dict) -> html.Span:
    if v["status"] != "ready":
        return html.Span(_delete_button("conversions", v))
    return html.Span([dcc.Link("routing", href=f"/routing?conversion={v['id']}"), " · ",
                      dcc.Link("compare", href=f"/compare?ids={v['id']}"), " · ",
                      dcc.Link("fine-tune", href=f"/finetune?conversion={v['id']}"), " · ",
                      html.A("download (zip)", href=download_url("conversions", v["id"]), download=f"{v['id']}.zip",
                             title="the converted model directory (Hugging Face format, safetensors) as a zip"), " ",
                      _delete_button("conversions", v)])


@callback(Output(f"{N}-lists", "children"), Output(f"{N}-health", "children"), Output(f"{N}-model", "options"),
          Output(f"{N}-set", "options"), Output(f"{N}-builtin", "options"), Output(f"{N}-start", "children"),
          Input(f"{N}-poll", "n_intervals"), Input(f"{N}-created", "children"), Input(f"{N}-deleted", "children"),
          Input(f"{N}-cancelled", "children"))
def _refresh(_n, _created, _deleted, _job_action):
    c = api()
    try:
        health = c.health()
        models, sets, profiles, convs, jobs = c.models(), c.calibration_sets(), c.profiles(), c.conversions(), c.jobs(limit=20)
        builtins = [b["name"] for b in c.builtin_sets()]
    except ApiError as exc:
        return error_box(str(exc)), "", [], [], ["mixed"], None
    names = Names.from_lists(models, sets, profiles)
    named = {**{m["id"]: m["name"] for m in models}, **{s["id"]: s["name"] for s in sets},
             **{p["id"]: names.profile(p) for p in profiles}, **{v["id"]: names.conversion(v) for v in convs}}  # what each job works on
    lists = [
        _table("Models", models, [("id", lambda m: m["id"]), ("name", lambda m: m["name"]), ("status", _status),
                                  ("layers", lambda m: str((m.get("info") or {}).get("n_layers", ""))),
                                  ("", lambda m: _delete_button("models", m))]),
        _table("Calibration sets", sets, [("id", lambda s: dcc.Link(s["id"], href=f"/calibration?set={s['id']}")), ("name", lambda s: s["name"]),
                                          ("status", _status), ("samples", lambda s: str((s.get("stats") or {}).get("n_samples", ""))),
                                          ("", lambda s: _delete_button("calibration-sets", s))]),
        _table("Profiles", profiles, [("profile", names.profile), ("id", lambda p: html.Span(p["id"], className="note")),
                                      ("CV across", lambda p: str((p.get("summary") or {}).get("cv_basis") or "")),
                                      ("status", _status),
                                      ("open", lambda p: html.Span([dcc.Link("neurons", href=f"/neurons?profile={p['id']}"), " · ",
                                                                    dcc.Link("layers", href=f"/layers?profile={p['id']}"), " · ",
                                                                    dcc.Link("design", href=f"/designer?profile={p['id']}")]) if p["status"] == "ready" else ""),
                                      ("", lambda p: _delete_button("profiles", p))]),
        _table("Conversions", convs, [("conversion", names.conversion), ("id", lambda v: html.Span(v["id"], className="note")),
                                      ("method", lambda v: v.get("method") or ""), ("router", lambda v: (v.get("params") or {}).get("router") or ""),
                                      ("sparsity (parameter)", lambda v: fmt_pct((v.get("params") or {}).get("sparsity"))),
                                      ("ffn_flops_fraction", lambda v: fmt((v.get("summary") or {}).get("ffn_flops_fraction"), 3)),
                                      ("status", _status), ("open", _conversion_actions)]),
        html.Div(className="card", children=[html.Div("Recent jobs", className="card-title")] + [_job_row(j, named) for j in jobs]),
    ]
    text = (f"API {c.base_url}: {health['status']}; workers: {', '.join(health['workers']) or 'none (jobs will wait)'}; "
            f"jobs: {fmt(health['jobs'])}")
    return lists, text, options(models), options(sets), builtins, getting_started(models, sets, profiles, convs)


@callback(Output(f"{N}-created", "children"), Input(f"{N}-add-model", "n_clicks"), Input(f"{N}-add-set", "n_clicks"),
          Input(f"{N}-add-profile", "n_clicks"), State(f"{N}-model-source", "value"), State(f"{N}-builtin", "value"),
          State(f"{N}-samples", "value"), State(f"{N}-model", "value"), State(f"{N}-set", "value"), State(f"{N}-max-tokens", "value"),
          prevent_initial_call=True)
def _create(_m, _s, _p, source, builtin, samples, model, cset, max_tokens):
    c = api()
    try:
        if ctx.triggered_id == f"{N}-add-model":
            created = c.create_model(source or "default")
        elif ctx.triggered_id == f"{N}-add-set":
            created = c.create_builtin_set(builtin, int(samples or 240))
        else:
            if not model or not cset:
                return error_box("choose a ready model and calibration set first")
            mt = int(max_tokens or 256)
            created = c.create_profile(model, cset, max_tokens=mt, batch_tokens=max(2048, mt))
    except ApiError as exc:
        return error_box(f"could not create: {exc}")
    return html.Div(f"created {created['id']} (job {created.get('job_id')})", className="note")
