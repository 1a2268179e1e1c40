"""The fine-tuning loss figure and its CSV rows are pure functions of the train-log payload."""

from __future__ import annotations

import plotly.graph_objects as go

from frontend import figures as F

STEPS = [{"step": i, "loss": 4.0 - 0.5 * i, "ntp_loss": 3.9 - 0.5 * i, "aux_loss": 0.1 + 0.01 * i, "lr": 1e-4,
          "tokens": 512 * i, "elapsed_s": 0.3 * i} for i in range(1, 5)]
LOG = {"finetune_id": "ft-0123456789abcdef", "state": "running", "status": "running", "mode": "expertweaver", "total_steps": 10,
       "n_steps": 4, "steps": STEPS, "aggregated": False, "perplexity_before": 41.25, "perplexity_after": None,
       "dense_perplexity": 12.5, "result_conversion_id": None}


def test_loss_curve_has_total_ntp_and_aux_loss_on_its_own_axis():
    fig = F.finetune_loss(LOG)
    assert isinstance(fig, go.Figure)
    fig.to_json()
    by_name = {t.name: t for t in fig.data}
    assert set(by_name) == {"loss (total)", "next-token loss", "aux loss L_LB"}
    assert list(by_name["loss (total)"].x) == [1, 2, 3, 4] and list(by_name["loss (total)"].y) == [3.5, 3.0, 2.5, 2.0]
    assert by_name["aux loss L_LB"].yaxis == "y2" and by_name["loss (total)"].yaxis in (None, "y")
    assert fig.layout.yaxis2.overlaying == "y"
    title = fig.layout.title.text
    assert "expertweaver" in title and "4/10 steps" in title and "perplexity 41.25 → …" in title and "dense 12.50" in title
    assert "aggregated" not in title and not fig.layout.shapes
    resumed = F.finetune_loss({**LOG, "resumed_at": [2]})
    assert [sh.x0 for sh in resumed.layout.shapes] == [2] and resumed.layout.annotations[0].text == "resumed at 2"


def test_loss_curve_shows_the_distillation_loss_beside_the_next_token_loss():
    steps = [{**s, "kd_loss": 0.75 - 0.125 * s["step"], "aux_loss": None} for s in STEPS]
    by_name = {t.name: t for t in F.finetune_loss({**LOG, "steps": steps}).data}
    assert set(by_name) == {"loss (total)", "next-token loss", "distillation loss KL(dense ‖ converted)"}
    assert list(by_name["distillation loss KL(dense ‖ converted)"].y) == [0.625, 0.5, 0.375, 0.25]
    assert by_name["distillation loss KL(dense ‖ converted)"].yaxis in (None, "y")


def test_loss_curve_without_aux_loss_or_ntp_split_has_one_trace_and_says_when_aggregated():
    steps = [{"step": s["step"], "loss": s["loss"], "ntp_loss": s["loss"], "aux_loss": None} for s in STEPS]
    fig = F.finetune_loss({**LOG, "steps": steps, "aggregated": True, "n_steps": 4000, "total_steps": 4000,
                           "perplexity_before": None})
    assert [t.name for t in fig.data] == ["loss (total)"]
    assert "bucket means" in fig.layout.title.text and "4000/4000 steps" in fig.layout.title.text
    assert "perplexity" not in fig.layout.title.text


def test_empty_log_is_a_message_not_an_empty_chart():
    fig = F.finetune_loss({**LOG, "steps": [], "n_steps": 0, "state": "queued"})
    assert not fig.data and "no training step logged yet (job queued)" in fig.layout.annotations[0].text


def test_summary_text_and_csv_rows():
    assert F.finetune_summary_text({"perplexity_before": 41.25, "perplexity_after": 18.0, "dense_perplexity": None}) == \
        "perplexity 41.25 → 18.00"
    assert F.finetune_summary_text({"perplexity_before": None, "perplexity_after": None}) is None
    rows = F.table("finetune-log", LOG)
    assert len(rows) == 4 and rows[0] == {"step": 1, "loss": 3.5, "ntp_loss": 3.4, "kd_loss": None, "aux_loss": 0.11, "lr": 1e-4,
                                          "tokens": 512, "elapsed_s": 0.3}
    assert F.csv_text(rows).splitlines()[0] == "step,loss,ntp_loss,kd_loss,aux_loss,lr,tokens,elapsed_s"


def test_the_page_offers_every_recovery_mode_and_the_apis_budget_without_a_copy(monkeypatch):
    """The Fine-tune page's modes, their words and the budget's defaults and bounds come from the API (GET /methods,
    GET /finetunes/params, answered here by the real route functions): a method registered with a recovery is
    offered, with its summary, and no default or bound is copied into the UI."""
    import sys

    import httpx

    import frontend.app  # noqa: F401  (Dash imports the pages, as "pages.<name>", when the app is made)
    import moelab.engine.methods as registry
    from backend.routes.finetunes import finetune_params
    from backend.routes.methods import list_methods
    from frontend.param_controls import param_bounds
    from moelab.api_client import ApiClient
    from moelab.engine.methods.base import Method, Recovery
    from moelab.engine.training.params import FinetuneParams

    page = sys.modules["pages.finetune"]
    added = Method(name="prune_head", title="Prune", paper="-", summary="keep the first neurons",
                   params=registry.REGISTRY["expertweaver"].params, needs="profile", build=lambda *a: None,
                   recovery=Recovery(paper="-", summary="Prune: trains nothing but the LoRA adapters."))
    monkeypatch.setattr(registry, "REGISTRY", {**registry.REGISTRY, "prune_head": added})

    def handler(request: httpx.Request) -> httpx.Response:
        routes = {"/api/v1/methods": list_methods, "/api/v1/finetunes/params": finetune_params}
        return httpx.Response(200, json=routes[request.url.path]().model_dump(mode="json"))

    client = ApiClient(base_url="http://api.test/api/v1", token="", transport=httpx.MockTransport(handler))
    monkeypatch.setattr(page, "api", lambda: client)
    known = page.modes()
    assert set(known) == {"expertweaver", "cmoe", "dense2moe", "midas", "prune_head"}  # hierarchical has no recovery
    assert known["prune_head"] == "Prune: trains nothing but the LoRA adapters."
    assert known["cmoe"].startswith("CMoE: top-k of s′ + b") and "(AF Eq. 9)" in known["cmoe"]
    assert page._mode_help("prune_head", None, {}, known) == known["prune_head"]
    declared = {s.name: s for s in FinetuneParams.specs()}
    fields = page.budget_fields()
    assert set(fields) == {name for name, *_ in page.BUDGET}
    for name, field in fields.items():
        spec = declared[name]
        assert (field["default"], field["ge"], field["gt"], field["le"]) == (spec.default, spec.ge, spec.gt, spec.le), name
    assert page.form_values(None, fields, known) == {**{n: declared[n].default for n in fields}, "source": "builtin:mixed", "mode": None}
    assert page.form_values({"mode": "prune_head", "steps": 7}, fields, known)["mode"] == "prune_head"
    assert param_bounds(fields["lr"], "any") == (0, 1)  # a strict bound is the control's when typed freely


def test_finetune_perplexity_says_what_text_and_how_much():
    assert F.finetune_eval_text({"source": "builtin:code", "eval_windows": 16, "seq_len": 256}) == \
        "on builtin:code held-out · 16 windows × 256 tokens"
    assert F.finetune_eval_text({"source": "cal-1", "eval_source": None, "eval_windows": 4, "seq_len": 64}).startswith("on builtin:mixed")
    assert F.finetune_eval_text({"source": "cal-1", "eval_source": "builtin:prose"}).startswith("on builtin:prose")
