"""Conversion designer, every method: ExpertWeaver sliders (α_min, α_max, τ, experts, sparsity) redraw the
per-layer shared/routed plan and r_ℓ (EW Fig. 7) from the allocation preview on every move;
S·A·E inputs for CMoE; parameter panels for Dense2MoE, MIDAS and hierarchical conversion; 'Convert' launches the job and follows it; the result shows the plan,
timings and evaluations (perplexity dense vs converted vs baselines).
State in the URL: ?profile=…&method=…&alpha_min=…&alpha_max=…&tau=…&n_experts=…&sparsity=…&shared=…&active=…"""

from __future__ import annotations

import dash
from dash import Input, Output, State, callback, ctx, dcc, html, no_update

from frontend import figures as F
from frontend.api_client import ApiError, api
from frontend.components import error_box, figure_card, num, options, profile_picker, progress, to_search

dash.register_page(__name__, path="/designer", name="Conversion designer", order=4)

N = "cd"
PARAMS = ("alpha_min", "alpha_max", "tau", "n_experts", "sparsity")


def _slider(name: str, label: str, lo: float, hi: float, step: float, value: float, marks: dict) -> html.Div:
    return html.Div(className="slider", children=[
        html.Label(label),
        dcc.Slider(id=f"{N}-{name}", min=lo, max=hi, step=step, value=value, marks=marks, updatemode="drag"),
    ])


def layout(profile: str | None = None, method: str = "expertweaver", alpha_min: str = "0.2", alpha_max: str = "0.7", tau: str = "0.6",
           n_experts: str = "8", sparsity: str = "0.25", alpha_basis: str = "total", shared: str = "1", active: str = "1",
           router: str = "paper", **extra):
    picker, profile, err = profile_picker(N, profile)
    return html.Div([
        dcc.Location(id=f"{N}-url", refresh=False),
        html.H2("Conversion designer"),
        error_box(err),
        html.Div(className="controls", children=[
            picker,
            html.Div([html.Label("method"), dcc.RadioItems(id=f"{N}-method", options=METHOD_OPTIONS, value=method, inline=True)]),
            html.Div([html.Label("α basis"), dcc.Dropdown(id=f"{N}-alpha_basis", options=["total", "active"], value=alpha_basis, clearable=False, style={"width": 110})]),
            html.Div([html.Label("router"), dcc.Dropdown(id=f"{N}-router", options=["paper", "gate_mass"], value=router, clearable=False, style={"width": 130})]),
        ]),
        html.Div(className="controls", id=f"{N}-ew", children=[
            _slider("alpha_min", "α_min (EW Eq. 5)", 0, 1, 0.05, num(alpha_min, 0.2), {0: "0", 0.5: "0.5", 1: "1"}),
            _slider("alpha_max", "α_max (EW Eq. 5)", 0, 1, 0.05, num(alpha_max, 0.7), {0: "0", 0.5: "0.5", 1: "1"}),
            _slider("tau", "τ (EW Eq. 4)", 0.05, 3, 0.05, num(tau, 0.6), {0.5: "0.5", 1: "1", 2: "2", 3: "3"}),
            _slider("n_experts", "experts per layer (N_e / E)", 2, 64, 1, int(num(n_experts, 8)), {2: "2", 16: "16", 32: "32", 64: "64"}),
            _slider("sparsity", "sparsity", 0.05, 0.95, 0.05, num(sparsity, 0.25), {0.25: "25%", 0.5: "50%", 0.75: "75%"}),
        ]),
        html.Div(className="controls", id=f"{N}-cmoe", children=[
            html.Div([html.Label("S: shared experts (CMoE)"), dcc.Input(id=f"{N}-shared", type="number", min=0, step=1, value=int(num(shared, 1)))]),
            html.Div([html.Label("A: active routed experts (CMoE)"), dcc.Input(id=f"{N}-active", type="number", min=0, step=1, value=int(num(active, 1)))]),
        ]),
        _method_panels(extra),
        html.Div(id=f"{N}-error"),
        html.Div(id=f"{N}-summary", className="note"),
        html.Div(className="row", children=[figure_card(f"{N}-plan", "Per-layer plan", loading=False)]),
        html.Div(className="controls", children=[
            html.Button("Convert", id=f"{N}-convert", className="primary"),
            html.Button("Evaluate result (builtin:mixed)", id=f"{N}-evaluate", disabled=True),
        ]),
        html.Div(id=f"{N}-job"),
        html.Div(id=f"{N}-result"),
        dcc.Store(id=f"{N}-job-id"),
        dcc.Store(id=f"{N}-conversion-id"),
        dcc.Interval(id=f"{N}-poll", interval=1000, disabled=True),
    ])


METHOD_OPTIONS = [
    {"label": "ExpertWeaver", "value": "expertweaver"}, {"label": "CMoE (S·A·E)", "value": "cmoe"},
    {"label": "Dense2MoE (layer fusion)", "value": "dense2moe"}, {"label": "MIDAS (low-rank experts)", "value": "midas"},
    {"label": "Hierarchical (MoE → sub-experts)", "value": "hierarchical"},
]
#: Which parameter panels each method shows.
PANELS = {"expertweaver": ("ew",), "cmoe": ("ew", "cmoe"), "dense2moe": ("d2",), "midas": ("midas",), "hierarchical": ("hier",)}
METHOD_NOTES = {
    "dense2moe": "D2 §2.3 / Eq. 6: blocks l*+1…l*+n* lose their attention; their MLPs join layer l* as experts next to N copies "
                 "of its own MLP, behind a softmax top-k router. Leave l* and n* empty to choose them from S_L and S_M with δ.",
    "midas": "MI §3.2: one low-rank expert per calibration set (whitened SVD of the FFN, MI Eqs. 1–2) and a new top-k gate. "
             "Pick ≥ 1 more profile of the same model made on other calibration sets.",
    "hierarchical": "AF §4.4 / Eq. 10: every expert of an existing MoE model becomes shared + routed sub-experts with a sub-router "
                    "(S·A·E per expert). Needs a registered MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE), not a profile.",
}


def _num_input(name: str, label: str, value, **kw) -> html.Div:
    return html.Div([html.Label(label), dcc.Input(id=f"{N}-{name}", type="number", value=value, debounce=True, **kw)])


def _method_panels(q: dict) -> html.Div:
    """Parameter panels of Dense2MoE, MIDAS and hierarchical conversion (shown by method)."""
    try:
        profiles, models = options(api().profiles()), options(api().models())
    except ApiError:
        profiles, models = [], []
    return html.Div([
        html.Div(className="controls", id=f"{N}-d2", children=[
            _num_input("d2_delta", "δ: max MLP-input distance 1 − S_M", num(q.get("delta"), 0.1), min=0, max=2, step=0.01),
            _num_input("d2_layer", "l* (empty: choose)", q.get("layer"), min=0, step=1),
            _num_input("d2_n_fused", "n* (empty: choose)", q.get("n_fused"), min=1, step=1),
            _num_input("d2_own", "N copies of l*'s MLP", int(num(q.get("own_copies"), 1)), min=1, step=1),
            _num_input("d2_fused", "M copies of each fused MLP", int(num(q.get("fused_copies"), 1)), min=1, step=1),
            _num_input("d2_top_k", "top-k experts", int(num(q.get("top_k"), 2)), min=1, step=1),
        ]),
        html.Div(className="controls", id=f"{N}-midas", children=[
            html.Div([html.Label("other calibration sets' profiles"),
                      dcc.Dropdown(id=f"{N}-midas_profiles", options=profiles, multi=True, style={"width": 420})]),
            _num_input("midas_keep", "keep ratio (MI §4.1)", num(q.get("keep_ratio"), 0.25), min=0.01, max=1, step=0.01),
            _num_input("midas_top_k", "top-k experts", int(num(q.get("top_k"), 2)), min=1, step=1),
        ]),
        html.Div(className="controls", id=f"{N}-hier", children=[
            html.Div([html.Label("MoE model"), dcc.Dropdown(id=f"{N}-hier_model", options=models, style={"width": 320})]),
            html.Div([html.Label("calibration"), dcc.Input(id=f"{N}-hier_calib", value=q.get("calibration", "builtin:mixed"), debounce=True)]),
            _num_input("hier_experts", "sub-experts per expert", int(num(q.get("sub_experts"), 8)), min=1, step=1),
            _num_input("hier_shared", "S: shared sub-experts", int(num(q.get("sub_shared"), 2)), min=0, step=1),
            _num_input("hier_active", "A: active routed sub-experts", int(num(q.get("sub_active"), 2)), min=0, step=1),
        ]),
    ])


METHOD_STATES = [State(f"{N}-{n}", p) for n, p in (
    ("d2_delta", "value"), ("d2_layer", "value"), ("d2_n_fused", "value"), ("d2_own", "value"), ("d2_fused", "value"),
    ("d2_top_k", "value"), ("midas_profiles", "value"), ("midas_keep", "value"), ("midas_top_k", "value"),
    ("hier_model", "value"), ("hier_calib", "value"), ("hier_experts", "value"), ("hier_shared", "value"), ("hier_active", "value"),
)]


def _method_body(method: str, v: list) -> dict:
    """The API body of a Dense2MoE / MIDAS / hierarchical conversion from the panel values ``v``."""
    d2_delta, d2_layer, d2_n, d2_own, d2_fused, d2_k, m_profiles, m_keep, m_k, h_model, h_calib, h_e, h_s, h_a = v
    if method == "dense2moe":
        return {"method": method, "dense2moe": {"delta": d2_delta, "layer": d2_layer, "n_fused": d2_n, "own_copies": d2_own,
                                                "fused_copies": d2_fused, "top_k": d2_k}}
    if method == "midas":
        return {"method": method, "extra_profile_ids": list(m_profiles or []), "midas": {"keep_ratio": m_keep, "top_k": m_k}}
    return {"method": method, "model_id": h_model, "calibration": h_calib,
            "hierarchical": {"n_experts": h_e, "shared": h_s, "active": h_a}}


def _allocation(method, alpha_min, alpha_max, tau, n_experts, sparsity, alpha_basis, shared, active) -> dict:
    if method == "cmoe":
        return {"method": "cmoe", "n_experts": int(n_experts), "shared": int(shared or 0), "active": int(active or 0)}
    return {"method": "expertweaver", "alpha_min": alpha_min, "alpha_max": alpha_max, "tau": tau, "n_experts": int(n_experts),
            "sparsity": sparsity, "alpha_basis": alpha_basis}


INPUTS = [Input(f"{N}-profile", "value"), Input(f"{N}-method", "value")] + [Input(f"{N}-{p}", "value") for p in PARAMS] + [
    Input(f"{N}-alpha_basis", "value"), Input(f"{N}-shared", "value"), Input(f"{N}-active", "value"), Input(f"{N}-router", "value")]


@callback(*[Output(f"{N}-{panel}", "style") for panel in ("ew", "cmoe", "d2", "midas", "hier")], Input(f"{N}-method", "value"))
def _panels(method):
    shown = PANELS.get(method, ())
    return [{} if panel in shown else {"display": "none"} for panel in ("ew", "cmoe", "d2", "midas", "hier")]


@callback(Output(f"{N}-plan", "figure"), Output({"type": "csv-data", "name": f"{N}-plan"}, "data"), Output(f"{N}-summary", "children"),
          Output(f"{N}-error", "children"), Output(f"{N}-url", "search"), *INPUTS)
def _preview(profile, method, alpha_min, alpha_max, tau, n_experts, sparsity, alpha_basis, shared, active, router):
    if method in METHOD_NOTES:
        return F.message_figure("no neuron allocation for this method"), None, METHOD_NOTES[method], error_box(None), to_search(
            profile=profile, method=method)
    alloc = _allocation(method, alpha_min, alpha_max, tau, n_experts, sparsity, alpha_basis, shared, active)
    search = to_search(profile=profile, router=router, **alloc)
    if not profile:
        return F.message_figure("choose a ready profile"), None, "", error_box("no profile chosen: create one on the Workspace page"), search
    try:
        preview = api().allocation_preview(profile, **alloc)
    except ApiError as exc:
        return F.message_figure(str(exc)), None, "", error_box(str(exc)), search
    s = preview["summary"]
    text = [f"active {s['active_fraction']:.1%} of FFN neurons (sparsity {s['sparsity']:.1%}), mean α {s['mean_alpha']:.2f}."]
    if s.get("clamped_layers"):
        text.append(html.Span(f" Clamped layers {s['clamped_layers']}: Eq. 6 asked for more shared experts than the active budget; "
                              "lower α_max, raise τ or use α basis 'active'.", className="aggregated"))
    if s.get("static_layers"):
        text.append(html.Span(f" Static layers {s['static_layers']}: no routed expert runs there (a fixed prune).", className="aggregated"))
    return F.allocation_plan(preview), {"kind": "allocation", "data": preview, "filename": "allocation_plan"}, text, error_box(None), search


@callback(Output(f"{N}-job-id", "data"), Output(f"{N}-conversion-id", "data"), Output(f"{N}-poll", "disabled"),
          Output(f"{N}-job", "children", allow_duplicate=True),
          Input(f"{N}-convert", "n_clicks"), Input(f"{N}-evaluate", "n_clicks"),
          State(f"{N}-conversion-id", "data"), *[State(i.component_id, i.component_property) for i in INPUTS], *METHOD_STATES,
          prevent_initial_call=True)
def _launch(_c, _e, conversion_id, profile, method, alpha_min, alpha_max, tau, n_experts, sparsity, alpha_basis, shared, active, router,
            *method_values):
    try:
        if ctx.triggered_id == f"{N}-evaluate":
            if not conversion_id:
                return no_update, no_update, True, error_box("convert first")
            created = api().create_evaluation(conversion_id, n_windows=4, seq_len=64)
            return created["job_id"], conversion_id, False, progress(created.get("job"))
        if method == "hierarchical":
            created = api().create_conversion(**_method_body(method, list(method_values)))
            return created["job_id"], created["id"], False, progress(created.get("job"))
        if not profile:
            return no_update, no_update, True, error_box("choose a profile first")
        if method in METHOD_NOTES:
            created = api().create_conversion(profile, **_method_body(method, list(method_values)))
            return created["job_id"], created["id"], False, progress(created.get("job"))
        alloc = _allocation(method, alpha_min, alpha_max, tau, n_experts, sparsity, alpha_basis, shared, active)
        created = api().create_conversion(profile, alloc, router=router)
    except ApiError as exc:
        return no_update, no_update, True, error_box(f"could not start: {exc}")
    return created["job_id"], created["id"], False, progress(created.get("job"))


@callback(Output(f"{N}-job", "children"), Output(f"{N}-poll", "disabled", allow_duplicate=True), Output(f"{N}-result", "children"),
          Output(f"{N}-evaluate", "disabled"),
          Input(f"{N}-poll", "n_intervals"), State(f"{N}-job-id", "data"), State(f"{N}-conversion-id", "data"), prevent_initial_call=True)
def _poll(_n, job_id, conversion_id):
    if not job_id:
        return no_update, True, no_update, True
    try:
        job = api().job(job_id)
    except ApiError as exc:
        return error_box(str(exc)), True, no_update, True
    done = job["state"] in ("succeeded", "failed", "cancelled")
    result = no_update
    if done and conversion_id:
        result = _result(conversion_id)
    return progress(job), done, result, not (done and job["state"] == "succeeded" and conversion_id)


def _result(conversion_id: str) -> html.Div:
    """Plan summary, timings, and — once evaluated — perplexity vs baselines and per-layer reconstruction error."""
    try:
        conv = api().conversion(conversion_id)
        evals = [e for e in api().evaluations(conversion_id) if e["status"] == "ready"]
        report = api().evaluation_report(evals[0]["id"]) if evals else None
    except ApiError as exc:
        return error_box(str(exc))
    s = conv.get("summary") or {}
    children = [html.H3(f"Conversion {conversion_id}: {conv['status']}"),
                html.Div(", ".join(f"{k}: {v}" for k, v in s.items() if not isinstance(v, (dict, list))), className="note"),
                dcc.Link("open in routing explorer", href=f"/routing?conversion={conversion_id}"), html.Span(" · "),
                dcc.Link("compare", href=f"/compare?ids={conversion_id}")]
    for note in s.get("notes") or []:
        children.append(html.Div(f"layer {note['layer']}: {note['note']}", className="aggregated"))
    timings = (conv.get("job") or {}).get("timings") or s.get("timings")
    if isinstance(timings, dict):
        children.append(html.Div("timings: " + ", ".join(f"{k} {v:.2f} s" if isinstance(v, (int, float)) else f"{k} {v}"
                                                          for k, v in timings.items()), className="note"))
    if not evals:
        children.append(html.Div("Not evaluated yet: press 'Evaluate result' for perplexity vs dense and baselines.", className="note"))
        return html.Div(children, className="card", id=f"{N}-result-card")
    rows = [{"conversion": conversion_id, "variant": v, "perplexity": d.get("perplexity")}
            for v, d in ((evals[0].get("summary") or {}).get("variants") or {}).items()]
    children.append(html.Div(className="row", children=[
        dcc.Graph(id=f"{N}-ppl", figure=F.compare_perplexity(rows)),
        dcc.Graph(id=f"{N}-recon", figure=F.reconstruction_error(report or {})),
    ]))
    return html.Div(children, className="card", id=f"{N}-result-card")
