"""Workspace: models, calibration sets, profiles, conversions, evaluations and jobs with live
progress, states, durations and errors, each job named by what it works on; buttons to create each
(a profile with the groups its CV is taken across, an evaluation with or without baselines), delete
it (the confirm says what goes; refused in words next to its row while something uses it, then
offered with everything that does, the confirm naming each), retry a failed job and download a
converted model, as a zip or as a GGUF file for llama.cpp / Ollama (f16, q8_0 or f32: an export job,
then the file through this server's relay; a conversion whose layout does not export says why in its
row); a getting-started path (model → set → profile → designer) until there is a profile."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import dash
from dash import ALL, Input, Output, State, callback, ctx, dcc, html, no_update

from moelab.api_client import ApiError, api
from moelab.engine.sizes import format_size
from frontend.figures import common as FC
from frontend.components import (baselines_choice, builtin_options, error_box, memory_budget, memory_budget_input, options, progress,
                                 source_options, wants_baselines)
from frontend.defaults import CALIBRATION_NOTE, CALIBRATION_SAMPLES, CALIBRATION_SET, CALIBRATION_TOKENS
from frontend.downloads import download_url, export_download_url
from frontend.exportability import ui_words
from frontend.speed import how_timed, perplexity_ratio, predicted_cell, slower_phases, speed_cell
from frontend.task_accuracy import accuracy_cell
from frontend.names import (Names, evaluation_name, finetune_name, fmt, fmt_pct, heldout_text, job_subject, probe_name, ratio_ci,
                            with_id)

dash.register_page(__name__, path="/", name="Workspace", order=0)

N = "ws"
TASK_ITEMS = 200  # items per task: accuracy ± stderr of about 3 points at 50%


#: what the CV (EW Eq. 3) of a profile is taken across (``ProfileCreate.group_by``)
GROUP_BY = [{"label": "auto", "value": "auto"}, {"label": "tasks", "value": "task"}, {"label": "domains", "value": "domain"},
            {"label": "samples", "value": "sample"}]
AUTO_NOTE = "auto: the set's tasks when it has at least 2 distinct tasks, else each sample"


def layout(**_):
    return html.Div([
        html.H2("Workspace"),
        html.Div(id=f"{N}-health", className="note"),
        html.Div(className="card", children=[
            html.Div("Create", className="card-title"),
            html.Div(className="controls", children=[
                html.Div([html.Label("model source ('default', org/name or a server path)"), dcc.Input(id=f"{N}-model-source", value="default", style={"width": 300})]),
                html.Button("Add model", id=f"{N}-add-model"),
                html.Div([html.Label("built-in calibration set"), dcc.Dropdown(id=f"{N}-builtin", options=[CALIBRATION_SET], value=CALIBRATION_SET, clearable=False, style={"width": 420})]),
                html.Div([html.Label("samples"), dcc.Input(id=f"{N}-samples", type="number", value=CALIBRATION_SAMPLES, min=1, style={"width": 90})]),
                html.Button("Build set", id=f"{N}-add-set"),
            ]),
            html.Div(CALIBRATION_NOTE, id=f"{N}-proposed", className="note"),
            html.Div(className="controls", children=[
                html.Div([html.Label("model"), dcc.Dropdown(id=f"{N}-model", style={"width": 300})]),
                html.Div([html.Label("calibration set"), dcc.Dropdown(id=f"{N}-set", style={"width": 300})]),
                html.Div([html.Label("max tokens / sample"), dcc.Input(id=f"{N}-max-tokens", type="number", value=CALIBRATION_TOKENS, min=2, style={"width": 90})]),
                html.Div([html.Label("CV across"), dcc.Dropdown(id=f"{N}-group-by", options=GROUP_BY, value="auto", clearable=False, style={"width": 130})]),
                memory_budget_input(f"{N}-max-memory", "profile"),
                html.Button("Profile", id=f"{N}-add-profile"),
                dcc.Link("Design a conversion →", href="/designer"),
            ]),
            html.Div(AUTO_NOTE, id=f"{N}-group-note", className="note"),
            html.Div(className="controls", children=[
                html.Div([html.Label("conversion to evaluate"), dcc.Dropdown(id=f"{N}-eval-conversion", style={"width": 420})]),
                html.Div([html.Label("held-out text"), dcc.Dropdown(id=f"{N}-eval-source", options=["builtin:mixed"], value="builtin:mixed", clearable=False, style={"width": 300})]),
                html.Div([html.Label("windows"), dcc.Input(id=f"{N}-eval-windows", type="number", value=8, min=1, style={"width": 80})]),
                html.Div([html.Label("tokens / window"), dcc.Input(id=f"{N}-eval-seq-len", type="number", value=128, min=8, style={"width": 90})]),
                baselines_choice(f"{N}-eval-baselines"),
                html.Div([html.Label("downstream tasks (lm-evaluation-harness)"),
                          dcc.Dropdown(id=f"{N}-eval-tasks", multi=True, options=[], placeholder="none: perplexity only",
                                       style={"width": 360})]),
                html.Div([html.Label("items / task"), dcc.Input(id=f"{N}-eval-task-limit", type="number", value=TASK_ITEMS, min=1,
                                                                style={"width": 90})]),
                html.Div([html.Label("your task YAMLs (server directory in MOELAB_DATA_ROOTS)"),
                          dcc.Input(id=f"{N}-eval-task-dir", type="text", placeholder="optional", debounce=True,
                                    style={"width": 300})]),
                html.Button("Evaluate", id=f"{N}-add-eval"),
            ]),
            html.Div(id=f"{N}-eval-task-note"),
            html.Div(id=f"{N}-created"),
            html.Div(id=f"{N}-cancelled"),
            html.Div(id=f"{N}-deleted"),
            html.Div(id=f"{N}-exported"),
        ]),
        dcc.Store(id=f"{N}-pending-delete"),
        dcc.Store(id=f"{N}-refusal"),  # a refused delete: said next to its row in the lists
        dcc.Store(id=f"{N}-shown"),  # a digest of what the lists show: a poll that finds nothing new redraws nothing
        dcc.ConfirmDialog(id=f"{N}-confirm"),
        html.Div(id=f"{N}-start"),
        html.Div(id=f"{N}-lists"),
        dcc.Interval(id=f"{N}-poll", interval=1500),
    ])


def _table(title: str, items: list[dict], cols: list[tuple[str, callable]], kind: str | None = None,
           refusal: dict | None = None) -> html.Div:
    """A card with one row per item; a refused delete of one of them (``refusal`` of this ``kind``)
    is said in a row right under it, with the offer to delete it together with its dependants."""
    rows = [html.Tr([html.Th(c) for c, _ in cols])]
    for it in items:
        rows.append(html.Tr([html.Td(f(it)) for _, f in cols]))
        if refusal and kind and refusal.get("kind") == kind and refusal.get("id") == it["id"]:
            rows.append(html.Tr(html.Td(_refusal_box(refusal), colSpan=len(cols)), className="row-msg"))
    return html.Div(className="card", children=[html.Div(f"{title} ({len(items)})", className="card-title"),
                                                html.Table(rows, className="list") if items else html.Div("none yet", className="note")])


def _refusal_box(refusal: dict) -> html.Div:
    children = [error_box(refusal["text"])]
    if refusal.get("cascade"):
        children.append(html.Button("Delete it with everything that depends on it",
                                    id={"type": "ws-cascade", "kind": refusal["kind"], "id": refusal["id"]}, className="small"))
    return html.Div(children, className="refusal")


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
    redrawn (new buttons arrive with n_clicks None). A click and a redraw can reach one call together:
    the clicked button is the triggering input with a count, wherever it is in the list."""
    for trig in ctx.triggered or ():
        ident = trig.get("prop_id", "").rsplit(".", 1)[0]
        if trig.get("value") and ident.startswith("{"):
            return json.loads(ident)
    return None


def job_title(job: dict, subjects: dict[str, str]) -> str:
    """'evaluation of <conversion> on builtin:mixed — ev-1 (job job-2)': what the job works on first."""
    rid = job.get("resource_id")
    return f"{with_id(job_subject(job, subjects), rid) if rid else job_subject(job, subjects)} (job {job['id']})"


def _job_row(job: dict, subjects: dict[str, str] | None = None) -> html.Div:
    title = job_title(job, subjects or {})
    if job["state"] in ("failed", "cancelled"):
        return html.Div([progress(job, title=title), html.Button("Retry", id={"type": "ws-retry", "job": job["id"], "at": "jobs"}, className="small",
                                                                 title="re-run this job (a new job for the same resource)")])
    if job["state"] not in ("queued", "running"):
        return progress(job, title=title)
    return html.Div([progress(job, title=title), html.Button("Cancel", id={"type": "ws-cancel", "job": job["id"]}, className="small")])


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


#: a resource kind (API path) → (its name in words, what deleting it removes besides its record)
KINDS = {"models": ("model", "the record only: the model's own files stay where they are"),
         "calibration-sets": ("calibration set", "its stored samples"),
         "profiles": ("profile", "its activation statistics"),
         "conversions": ("conversion", "its converted model files and GGUF exports"),
         "evaluations": ("evaluation", "its report"),
         "finetunes": ("fine-tune", "its checkpoints and training log"),
         "probes": ("probe", "its result")}


def direct_dependants(kind: str, ident: str, lists: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """The resources that read ``kind``/``ident`` directly, as the API's delete sees them
    (``moelab.store.deletion.dependants``): a model ← its profiles and conversions; a calibration
    set ← profiles over it and conversions, evaluations and fine-tunes that name it as their text;
    a profile ← conversions made from it (also as an extra profile); a conversion ← its
    evaluations, fine-tunes and probes; the rest ← nothing."""
    def where(k: str, test) -> list[tuple[str, str]]:
        return [(k, r["id"]) for r in lists.get(k) or [] if test(r)]

    def params(r: dict) -> dict:
        return r.get("params") or {}

    out: list[tuple[str, str]] = []
    if kind == "models":
        out += where("profiles", lambda r: r.get("model_id") == ident) + where("conversions", lambda r: r.get("model_id") == ident)
    elif kind == "calibration-sets":
        out += where("profiles", lambda r: r.get("calibration_set_id") == ident)
        out += where("conversions", lambda r: params(r).get("calibration") == ident)
        out += where("evaluations", lambda r: params(r).get("source") == ident)
        out += where("finetunes", lambda r: params(r).get("source") == ident)
    elif kind == "profiles":
        out += where("conversions", lambda r: r.get("profile_id") == ident or ident in (params(r).get("extra_profile_ids") or []))
    elif kind == "conversions":
        for k in ("evaluations", "finetunes", "probes"):
            out += where(k, lambda r: r.get("conversion_id") == ident)
    return [d for d in dict.fromkeys(out) if d != (kind, ident)]


def dependants(kind: str, ident: str, lists: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """Everything that depends on ``kind``/``ident``, transitively (what a cascade delete takes too),
    nearest first."""
    seen: list[tuple[str, str]] = []
    todo = [(kind, ident)]
    while todo:
        for dep in direct_dependants(*todo.pop(0), lists):
            if dep not in seen and dep != (kind, ident):
                seen.append(dep)
                todo.append(dep)
    return seen


def subjects(lists: dict[str, list[dict]]) -> dict[str, str]:
    """Every stored resource's id → what it is, in words: 'model SmolLM2-135M', 'profile SmolLM2 ·
    mixed · 256 tokens/sample', 'evaluation of <conversion> on builtin:mixed', 'routing probe of …'."""
    names = Names.from_lists(lists.get("models") or [], lists.get("calibration-sets") or [], lists.get("profiles") or [])
    convs = {v["id"]: names.conversion(v) for v in lists.get("conversions") or []}
    out = {m["id"]: f"model {m.get('name') or m['id']}" for m in lists.get("models") or []}
    out |= {s["id"]: f"calibration set {s.get('name') or s['id']}" for s in lists.get("calibration-sets") or []}
    out |= {p["id"]: f"profile {names.profile(p)}" for p in lists.get("profiles") or []}
    out |= {i: f"conversion {n}" for i, n in convs.items()}
    out |= {e["id"]: evaluation_name(e, convs.get(e.get("conversion_id"))) for e in lists.get("evaluations") or []}
    out |= {p["id"]: probe_name(p, convs.get(p.get("conversion_id"))) for p in lists.get("probes") or []}
    out |= {f["id"]: finetune_name(f, convs.get(f.get("conversion_id"))) for f in lists.get("finetunes") or []}
    out |= {e["id"]: f"GGUF {e.get('type')} export of {convs.get(v['id'], v['id'])}"
            for v in lists.get("conversions") or [] for e in v.get("exports") or []}
    return out


def delete_message(kind: str, ident: str, cascade: bool, lists: dict[str, list[dict]]) -> str:
    """The confirm's words: what is deleted (the resource by name and what goes with it) and, for a
    cascade, every dependant by name; a plain delete of something in use says the server refuses it."""
    said = subjects(lists)
    word, removes = KINDS.get(kind, (kind, ""))

    def name(k: str, i: str) -> str:
        return with_id(said.get(i) or f"{KINDS.get(k, (k,))[0]} {i}", i)

    what = name(kind, ident)
    deps = dependants(kind, ident, lists)
    listed = "\n".join(f"  • {name(k, i)}" for k, i in deps[:20]) + (f"\n  … and {len(deps) - 20} more" if len(deps) > 20 else "")
    if cascade:
        head = (f"Delete {what} together with the {len(deps)} resource{'s' if len(deps) != 1 else ''} that depend on it?\n{listed}"
                if deps else f"Delete {what}? Nothing depends on it any more.")
        tail = "Their queued or running jobs are cancelled first; their stored files go with them"
    else:
        head = f"Delete {what} ({removes})?"
        if deps:
            direct = len(direct_dependants(kind, ident, lists))
            count = (f"{direct} resource{'s' if direct != 1 else ''}" if direct == len(deps)
                     else f"{direct} resource{'s' if direct != 1 else ''} ({len(deps)} counting what depends on those)")
            head += (f"\nIt is used by {count}:\n{listed}\n"
                     "The server refuses to delete it alone; you will then be offered to delete them too.")
        else:
            head += " Nothing depends on it."
        tail = f"A queued or running job of this {word} is cancelled first"
    return f"{head}\n{tail}. This cannot be undone."


def _lists(c) -> dict[str, list[dict]]:
    """Every resource list the workspace shows or names (one API call each)."""
    return {"models": c.models(), "calibration-sets": c.calibration_sets(), "profiles": c.profiles(), "conversions": c.conversions(),
            "evaluations": c.evaluations(), "probes": c.probes(), "finetunes": c.finetunes()}


@callback(Output(f"{N}-pending-delete", "data"), Output(f"{N}-confirm", "message"), Output(f"{N}-confirm", "displayed"),
          Input({"type": "ws-del", "kind": ALL, "id": ALL}, "n_clicks"), Input({"type": "ws-cascade", "kind": ALL, "id": ALL}, "n_clicks"),
          prevent_initial_call=True)
def _ask_delete(_dels, _cascades):
    """Every delete is confirmed first, the confirm saying what goes (the cascade's: every dependant)."""
    clicked = _clicked()
    if clicked is None:
        return no_update, no_update, no_update
    cascade = clicked["type"] == "ws-cascade"
    try:
        lists = _lists(api())
    except ApiError:
        lists = {}
    message = delete_message(clicked["kind"], clicked["id"], cascade, lists)
    return {"kind": clicked["kind"], "id": clicked["id"], "cascade": cascade}, message, True


@callback(Output(f"{N}-deleted", "children"), Output(f"{N}-refusal", "data"), Input(f"{N}-confirm", "submit_n_clicks"),
          State(f"{N}-pending-delete", "data"), prevent_initial_call=True)
def _delete(_ok, pending):
    """Deleted: said at the top (the row is gone). Refused: said next to the row (``ws-refusal``),
    with the offer of the cascade when something depends on it."""
    if not pending:
        return no_update, no_update
    kind, ident, cascade = pending["kind"], pending["id"], pending["cascade"]
    try:
        out = api().delete(kind, ident, cascade=cascade)
    except ApiError as exc:
        if exc.status == 409 and not cascade and "cascade" in str(exc):  # used by others: say by whom, offer the cascade
            used_by = str(exc).split("; delete those first", 1)[0]  # the API's next words are about ?cascade=true: the button says it here
            text = f"not deleted: {used_by}. Delete those first, or delete it together with everything that depends on it:"
            return None, {"kind": kind, "id": ident, "text": text, "cascade": True}
        return None, {"kind": kind, "id": ident, "text": f"could not delete {ident}: {exc}", "cascade": False}
    gone = out.get("deleted") or []
    others = [d["id"] for d in gone if d["id"] != ident]
    text = f"deleted {ident}" + (f" and {len(others)} that depended on it ({', '.join(others)})" if others else "")
    if out.get("cancelled_jobs"):
        text += f"; cancelled job(s) {', '.join(out['cancelled_jobs'])}"
    return html.Div(text, className="note"), None


def model_weights(m: dict[str, Any]) -> str:
    """'513.14 MiB (a memory budget ≥ 108.00 MiB streams it)': the model's weights in the dtype its jobs run and the
    least budget a profile or conversion streams it in (its inspection's ``memory``); '' before it is inspected."""
    memory = (m.get("info") or {}).get("memory") or {}
    if not memory.get("total_bytes"):
        return ""
    floor = memory.get("min_max_memory")
    return format_size(memory["total_bytes"]) + (f" (a memory budget ≥ {format_size(floor)} streams it)" if floor else "")


def profile_memory(p: dict[str, Any]) -> str:
    """How a profile ran: 'streamed under 500MB' (one decoder layer at a time), 'whole model', or its budget while
    it waits."""
    budget = (p.get("params") or {}).get("max_memory")
    model = (p.get("summary") or {}).get("model") or {}
    if "streamed" not in model:
        return f"budget {budget}" if budget else ""
    if not model["streamed"]:
        return "whole model"
    ran = ((p.get("job") or {}).get("timings") or {}).get("max_memory_bytes")  # the server's budget where it set none
    return "streamed under " + (budget or (format_size(int(ran)) if ran else "a memory budget"))


def _predicted(v: dict[str, Any]) -> html.Span:
    """The conversion's predicted speed per phase (its record's, from this machine's kernel table), the words on
    hover; the measured one is its evaluations'."""
    text, title = predicted_cell(v.get("summary"))
    slower = slower_phases((v.get("summary") or {}).get("predicted_speed") or {})
    return html.Span(text, title=title, className="slower" if slower else None)


def _status(it: dict):
    job = it.get("job")
    if it["status"] in ("queued", "running") and job:
        return progress(job)
    if it["status"] in ("failed", "cancelled") and job:
        return html.Span([html.Span([it["status"], ": ", job.get("error") or ""], className=f"state-{it['status']}"), " ",
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


#: pattern-matching id types of a conversion row's GGUF controls: {"type", "id": conversion id}
GGUF_TYPE, GGUF_BUTTON = "ws-gguf-type", "ws-gguf"
#: the GGUF types offered, in this order (the API's ``gguf.types`` decides which exist)
GGUF_ORDER = ("f16", "q8_0", "f32")
GGUF_HELP = {"f16": "f16: half precision, the usual choice", "q8_0": "q8_0: 8-bit, about half the size of f16",
             "f32": "f32: full precision, exact, twice the size of f16"}


def human_bytes(n) -> str:
    """12345678 → '12.3 MB' (a file's size as a download dialog says it)."""
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return ""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def export_line(e: dict) -> html.Div:
    """One export of a conversion: its file to download once ready (through this server), its job's
    progress while it runs, why it failed otherwise."""
    what = f"GGUF {e.get('type')}"
    if e.get("status") == "ready" and e.get("file"):
        link = html.A(f"⤓ {e['file']} ({human_bytes(e.get('bytes'))})", href=export_download_url(e["id"], e["file"]),
                      download=e["file"], className="gguf-file", title=f"{what} file for llama.cpp / Ollama")
        note = (e.get("summary") or {}).get("note")  # what llama.cpp does slowly with these experts, and the counts that fit
        return html.Div([link, html.Div(ui_words(note), className="note gguf-note")] if note else link)
    job = e.get("job") or {}
    if e.get("status") in ("queued", "running"):
        return progress(job, title=f"{what} export")
    return html.Div(f"{what} export {e.get('status')}: {job.get('error') or 'no reason recorded'} — press Download as GGUF "
                    "to try again", className="state-failed")


def gguf_cell(v: dict):
    """A ready conversion's GGUF column: the type choice and 'Download as GGUF' with its exports below,
    or why its layout does not export (the API's reason, in its words)."""
    check = v.get("gguf")
    if v.get("status") != "ready" or not check:
        return ""
    if not check.get("exportable"):
        return html.Div(f"no GGUF: {ui_words(check.get('reason') or '')}", className="note gguf-refusal", id={"type": "ws-gguf-refusal", "id": v["id"]})
    types = [t for t in GGUF_ORDER if t in (check.get("types") or GGUF_ORDER)]
    choice = dcc.RadioItems(id={"type": GGUF_TYPE, "id": v["id"]}, options=[{"label": t, "value": t, "title": GGUF_HELP[t]}
                                                                             for t in types],
                            value=types[0], inline=True, persistence=True, persistence_type="memory", className="gguf-types")
    button = html.Button("Download as GGUF", id={"type": GGUF_BUTTON, "id": v["id"]}, className="small",
                         title="export the model as one .gguf file that llama.cpp and Ollama run (a job), then download it")
    exports = [e for e in v.get("exports") or [] if e.get("format", "gguf") == "gguf"]
    return html.Div([html.Div([choice, button], className="controls gguf-controls"), *[export_line(e) for e in exports]],
                    className="gguf")


@callback(Output(f"{N}-exported", "children"), Input({"type": GGUF_BUTTON, "id": ALL}, "n_clicks"),
          State({"type": GGUF_TYPE, "id": ALL}, "value"), State({"type": GGUF_TYPE, "id": ALL}, "id"), prevent_initial_call=True)
def _export_gguf(_clicks, types, type_ids):
    """Start (or find) the conversion's GGUF export of the chosen type; its row then follows the job and
    offers the file once written."""
    clicked = _clicked()
    if clicked is None:
        return no_update
    cid = clicked["id"]
    gguf_type = next((t for t, i in zip(types or [], type_ids or []) if i["id"] == cid and t), GGUF_ORDER[0])
    try:
        e = api().create_export(cid, gguf_type)
    except ApiError as exc:
        return error_box(f"could not export {cid} as GGUF {gguf_type}: {exc}")
    if e.get("status") == "ready" and e.get("file"):
        return html.Div(["GGUF ", gguf_type, f" of {cid} is ready: ",
                         html.A(f"download {e['file']}", href=export_download_url(e["id"], e["file"]), download=e["file"])],
                        className="note")
    return html.Div(f"exporting {cid} as GGUF {gguf_type} (job {e.get('job_id')}); the file is offered in its row once written",
                    className="note")


def ppl(value) -> str:
    """A perplexity as read: 25.12, 1,234 (a tiny or broken model's 52,070, not 5.207e+04)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return ""
    return f"{value:.2f}" if abs(value) < 1000 else f"{value:,.0f}"


def _task_options(task_dir: str | None = None) -> list[dict[str, str]]:
    return [{"label": t["name"] + (f" ({t['domain']})" if t.get("domain") else ""), "value": t["name"]}
            for t in api().tasks(task_dir or None)]


@callback(Output(f"{N}-eval-tasks", "options"), Input(f"{N}-poll", "n_intervals"), State(f"{N}-eval-tasks", "options"))
def _builtin_tasks(_n, shown):
    """The tasks an evaluation can run here (GET /tasks: built-in ones, offline), asked once per page."""
    if shown:
        return no_update
    try:
        return _task_options()
    except ApiError:
        return no_update


@callback(Output(f"{N}-eval-tasks", "options", allow_duplicate=True), Output(f"{N}-eval-task-note", "children"),
          Input(f"{N}-eval-task-dir", "value"), prevent_initial_call=True)
def _directory_tasks(task_dir):
    """A directory's tasks beside the built-in ones, or why the API refuses it. Apart from the poll: indexing a new
    directory takes seconds, and Dash drops an answer whose inputs changed meanwhile."""
    try:
        return _task_options(task_dir), ""
    except ApiError as exc:
        return no_update, error_box(f"task directory: {exc}") if task_dir else ""


def evaluation_cells(e: dict, conversion: dict | None) -> dict[str, str]:
    """An evaluation's row in words: held-out text, windows × tokens per window (what was read),
    dense and converted perplexity, their ratio, the conversion's FFN cost (its ``ffn_flops_fraction``) and its
    measured speed over dense's per phase."""
    held = FC.heldout_of(e)
    variants = (e.get("summary") or {}).get("variants") or {}
    dense = (variants.get("dense") or {}).get("perplexity")
    conv = variants.get("converted") or {}
    ratio = perplexity_ratio(e.get("summary"), "converted")
    extra = [v for v in variants if v not in ("dense", "converted")]
    return {"held-out text": heldout_text(e), "windows × seq_len": f"{fmt(held['windows'])} × {fmt(held['seq_len'])}",
            "dense ppl": ppl(dense), "converted ppl": ppl(conv.get("perplexity")), "ratio": ratio_ci(ratio, conv.get("perplexity_ratio_ci")),
            "ffn cost": fmt(((conversion or {}).get("summary") or {}).get("ffn_flops_fraction"), 3),
            "speed": speed_cell(e.get("summary")),
            "baselines": ", ".join(extra) if extra else ("yes" if (e.get("params") or {}).get("baselines") else "no"),
            "tasks": accuracy_cell(e.get("summary"))}


def _evaluation_table(evals: list[dict], convs: dict[str, dict], conv_names: dict[str, str], refusal: dict | None) -> html.Div:
    def cell(key: str):
        return lambda e: evaluation_cells(e, convs.get(e.get("conversion_id")))[key]

    def conversion(e: dict):
        cid = e.get("conversion_id")
        return html.Span([conv_names.get(cid, cid), " ", html.Span(cid, className="note")])

    def actions(e: dict):
        cid = e.get("conversion_id")
        links = [dcc.Link("compare", href=f"/compare?ids={cid}", title="this conversion's perplexity and cost next to others"), " · ",
                 dcc.Link("routing", href=f"/routing?conversion={cid}&a={e['id']}"), " "] if e["status"] == "ready" else []
        return html.Span([*links, _delete_button("evaluations", e)])

    cols = [("conversion", conversion), ("id", lambda e: html.Span(e["id"], className="note")), ("held-out text", cell("held-out text")),
            ("windows × seq_len", cell("windows × seq_len")), ("dense ppl", cell("dense ppl")), ("converted ppl", cell("converted ppl")),
            ("ratio", cell("ratio")), ("ffn cost", cell("ffn cost")),
            ("speed × dense (decode b1 / b8 / prefill)", lambda e: html.Span(cell("speed")(e), title=how_timed(e.get("summary")))),
            ("baselines", cell("baselines")),
            ("task accuracy (converted / dense)", cell("tasks")), ("status", _status),
            ("open", actions)]
    return _table("Evaluations", evals, cols, "evaluations", refusal)


def cv_note(group_by: str | None, stats: dict | None) -> str:
    """One line under 'CV across': what auto picks, and for the chosen set what each choice gives."""
    if not stats:
        return AUTO_NOTE
    tasks, domains = len(stats.get("tasks") or {}), len(stats.get("domains") or {})
    auto = "its tasks" if tasks >= 2 else "each sample"
    line = f"{AUTO_NOTE} — this set has {tasks} task{'s' if tasks != 1 else ''} and {domains} domain{'s' if domains != 1 else ''}, so auto takes {auto}"
    need = {"task": tasks, "domain": domains}.get(group_by or "auto")
    if need is not None and need < 2:
        line += f"; '{group_by}s' needs at least 2 distinct {group_by}s (the API will refuse it)"
    return line


@callback(Output(f"{N}-group-note", "children"), Input(f"{N}-set", "value"), Input(f"{N}-group-by", "value"))
def _group_note(cset, group_by):
    stats = None
    if cset:
        try:
            stats = api().calibration_set(cset).get("stats")
        except ApiError:
            stats = None
    return cv_note(group_by, stats)


@callback(Output(f"{N}-lists", "children"), Output(f"{N}-health", "children"), Output(f"{N}-model", "options"),
          Output(f"{N}-set", "options"), Output(f"{N}-builtin", "options"), Output(f"{N}-start", "children"),
          Output(f"{N}-eval-conversion", "options"), Output(f"{N}-eval-source", "options"),
          Output(f"{N}-shown", "data"),
          Input(f"{N}-poll", "n_intervals"), Input(f"{N}-created", "children"), Input(f"{N}-deleted", "children"),
          Input(f"{N}-cancelled", "children"), Input(f"{N}-exported", "children"), Input(f"{N}-refusal", "data"),
          State(f"{N}-shown", "data"))
def _refresh(_n, _created, _deleted, _job_action, _exported, refusal, shown_digest):
    """The lists, redrawn only when what they show changed: a redraw replaces every button, and a
    click whose callback is still running when its button is replaced is lost (Dash drops the
    answer of a pattern callback whose inputs changed meanwhile)."""
    c = api()
    try:
        health = c.health()
        lists = _lists(c)
        jobs = c.jobs(limit=20)
        builtins = c.builtin_sets()
    except ApiError as exc:
        return (error_box(str(exc)), "", [], [], ["mixed"], None, [], [{"label": "builtin:mixed", "value": "builtin:mixed"}],
                None)
    seen = [[health.get(k) for k in ("status", "workers", "jobs")], lists, jobs, builtins, refusal]  # health's disk figures always move
    digest = hashlib.sha1(json.dumps(seen, sort_keys=True, default=str).encode()).hexdigest()
    if digest == shown_digest:
        return (no_update,) * 9
    models, sets, profiles, convs, evals = (lists[k] for k in ("models", "calibration-sets", "profiles", "conversions", "evaluations"))
    names = Names.from_lists(models, sets, profiles)
    conv_names = {v["id"]: names.conversion(v) for v in convs}
    said = subjects(lists)  # what each job works on, in words

    def table(title, kind, items, cols):
        return _table(title, items, cols, kind, refusal)

    lists_shown = [
        table("Models", "models", models, [("id", lambda m: m["id"]), ("name", lambda m: m["name"]), ("status", _status),
                                           ("layers", lambda m: str((m.get("info") or {}).get("n_layers", ""))),
                                           ("weights", model_weights),
                                           ("", lambda m: _delete_button("models", m))]),
        table("Calibration sets", "calibration-sets", sets,
              [("id", lambda s: dcc.Link(s["id"], href=f"/calibration?set={s['id']}")), ("name", lambda s: s["name"]),
               ("status", _status), ("samples", lambda s: str((s.get("stats") or {}).get("n_samples", ""))),
               ("", lambda s: _delete_button("calibration-sets", s))]),
        table("Profiles", "profiles", profiles,
              [("profile", names.profile), ("id", lambda p: html.Span(p["id"], className="note")),
               ("CV across", lambda p: str((p.get("summary") or {}).get("cv_basis") or (p.get("params") or {}).get("group_by") or "")),
               ("memory", profile_memory), ("status", _status),
               ("open", lambda p: html.Span([dcc.Link("neurons", href=f"/neurons?profile={p['id']}"), " · ",
                                             dcc.Link("layers", href=f"/layers?profile={p['id']}"), " · ",
                                             dcc.Link("design", href=f"/designer?profile={p['id']}")]) if p["status"] == "ready" else ""),
               ("", lambda p: _delete_button("profiles", p))]),
        table("Conversions", "conversions", convs,
              [("conversion", names.conversion), ("id", lambda v: html.Span(v["id"], className="note")),
               ("method", lambda v: v.get("method") or ""), ("router", lambda v: (v.get("params") or {}).get("router") or ""),
               ("sparsity (parameter)", lambda v: fmt_pct((v.get("params") or {}).get("sparsity"))),
               ("ffn_flops_fraction", lambda v: fmt((v.get("summary") or {}).get("ffn_flops_fraction"), 3)),
               ("predicted speed × dense (decode b1 / b8 / prefill)", _predicted),
               ("status", _status), ("open", _conversion_actions), ("GGUF (llama.cpp / Ollama)", gguf_cell)]),
        _evaluation_table(evals, {v["id"]: v for v in convs}, conv_names, refusal),
        html.Div(className="card", id=f"{N}-jobs", children=[html.Div("Recent jobs", className="card-title")] + [_job_row(j, said) for j in jobs]),
    ]
    shown = {r["id"] for k in ("models", "calibration-sets", "profiles", "conversions", "evaluations") for r in lists[k]}
    if refusal and refusal.get("id") not in shown:  # its row is gone meanwhile: say it above the lists
        lists_shown.insert(0, html.Div(_refusal_box({**refusal, "cascade": False}), className="card"))
    text = (f"API {c.base_url}: {health['status']}; workers: {', '.join(health['workers']) or 'none (jobs will wait)'}; "
            f"jobs: {fmt(health['jobs'])}")
    return (lists_shown, text, options(models), options(sets), builtin_options(builtins), getting_started(models, sets, profiles, convs),
            options(convs, names=names), source_options(builtins, sets), digest)


@callback(Output(f"{N}-created", "children"), Input(f"{N}-add-model", "n_clicks"), Input(f"{N}-add-set", "n_clicks"),
          Input(f"{N}-add-profile", "n_clicks"), Input(f"{N}-add-eval", "n_clicks"), State(f"{N}-model-source", "value"),
          State(f"{N}-builtin", "value"), State(f"{N}-samples", "value"), State(f"{N}-model", "value"), State(f"{N}-set", "value"),
          State(f"{N}-max-tokens", "value"), State(f"{N}-group-by", "value"), State(f"{N}-eval-conversion", "value"),
          State(f"{N}-eval-source", "value"), State(f"{N}-eval-windows", "value"), State(f"{N}-eval-seq-len", "value"),
          State(f"{N}-eval-baselines", "value"), State(f"{N}-eval-tasks", "value"), State(f"{N}-eval-task-limit", "value"),
          State(f"{N}-eval-task-dir", "value"), State(f"{N}-max-memory", "value"), prevent_initial_call=True)
def _create(_m, _s, _p, _e, source, builtin, samples, model, cset, max_tokens, group_by, conversion, eval_source, windows, seq_len,
            baselines, tasks, task_limit, task_dir, max_memory):
    c = api()
    try:
        if ctx.triggered_id == f"{N}-add-model":
            created = c.create_model(source or "default")
        elif ctx.triggered_id == f"{N}-add-set":
            created = c.create_builtin_set(builtin, int(samples or CALIBRATION_SAMPLES))
        elif ctx.triggered_id == f"{N}-add-eval":
            if not conversion or not eval_source:
                return error_box("choose a ready conversion and a held-out text first")
            created = c.create_evaluation(conversion, source=eval_source, n_windows=int(windows or 8), seq_len=int(seq_len or 128),
                                          baselines=wants_baselines(baselines), tasks=tasks or None,
                                          limit=int(task_limit) if task_limit else None, task_dir=task_dir or None)
        else:
            if not model or not cset:
                return error_box("choose a ready model and calibration set first")
            mt = int(max_tokens or 256)
            created = c.create_profile(model, cset, max_tokens=mt, batch_tokens=max(2048, mt), group_by=group_by or "auto",
                                       max_memory=memory_budget(max_memory))
    except ApiError as exc:
        return error_box(f"could not create: {exc}")
    return html.Div(f"created {created['id']} (job {created.get('job_id')})", className="note")
