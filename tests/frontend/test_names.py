"""Human names for ids and readable values (frontend.names): pure functions, fixed records."""

from __future__ import annotations

from frontend.components import options
from frontend.names import Names, fmt, fmt_pct, key_params, short_conversion, with_id

MODELS = [{"id": "m-1", "name": "SmolLM2-135M-Instruct", "status": "ready"}]
SETS = [{"id": "cal-1", "name": "mixed", "status": "ready"}]
PROFILES = [{"id": "pr-e06989ec8ade3ce0", "model_id": "m-1", "calibration_set_id": "cal-1", "params": {"max_tokens": 256},
             "status": "ready"}]
EW = {"id": "cv-1", "method": "expertweaver", "profile_id": "pr-e06989ec8ade3ce0", "status": "ready",
      "params": {"method": "expertweaver", "n_experts": 64, "alpha_min": 0.2, "alpha_max": 0.7, "tau": 0.6, "sparsity": 0.25,
                 "router": "centroid", "plan": "paper"},
      "label": "64 experts, α 0.2–0.7, τ 0.6, sparsity 25%, centroid router"}
CM = {"id": "cv-2", "method": "cmoe", "profile_id": "pr-e06989ec8ade3ce0", "status": "ready",
      "params": {"method": "cmoe", "n_experts": 64, "shared": 1, "active": 1, "router": "representative", "plan": "budget"},
      "label": "S1·A1·E64, representative router, budget plan"}


def test_values_are_formatted_not_printed():
    assert fmt(0.5182291666666666) == "0.5182" and fmt({"queued": 0, "running": 2}) == "queued 0, running 2"
    assert fmt(None) == "" and fmt([1, 2.123456]) == "1, 2.123" and fmt(True) == "yes" and fmt(7) == "7"
    assert fmt(list(range(20))).endswith("… (20 in all)")
    assert fmt_pct(0.25) == "25%" and fmt_pct(0.969) == "96.9%" and fmt_pct(None) == ""


def test_records_are_named_model_set_method_parameters():
    names = Names.from_lists(MODELS, SETS, PROFILES)
    assert names.profile("pr-e06989ec8ade3ce0") == "SmolLM2-135M-Instruct · mixed · 256 tokens/sample"
    assert names.conversion(EW) == ("SmolLM2-135M-Instruct · mixed · expertweaver · 64 experts, α 0.2–0.7, τ 0.6, sparsity 25%, "
                                    "centroid router")
    assert names.conversion(CM) == "SmolLM2-135M-Instruct · mixed · cmoe · S1·A1·E64, representative router, budget plan"
    assert short_conversion(CM) == "cmoe · S1·A1·E64, representative router, budget plan"
    # the words come from the API's label (the method's declaration: tests/engine/test_method_labels.py);
    # a record without one still shows its first parameters, never nothing
    assert key_params({"params": {"method": "new", "width": 3, "gate": 0.25, "nested": {"a": 1}}}) == "width 3, gate 0.25"
    assert Names().conversion(EW).startswith("expertweaver · 64 experts")  # unknown profile: still a name, never only an id
    assert with_id("mixed", "cal-1") == "mixed — cal-1" and with_id("", "cal-1") == "cal-1"


def test_dropdown_options_show_the_name_first_and_the_id_second():
    names = Names.from_lists(MODELS, SETS, PROFILES)
    (conv,) = options([EW, {**CM, "status": "running"}], names=names)
    assert conv["value"] == "cv-1" and conv["label"].startswith("SmolLM2-135M-Instruct · mixed · expertweaver") and conv["label"].endswith("— cv-1")
    (prof,) = options(PROFILES, names=names)
    assert prof["label"] == "SmolLM2-135M-Instruct · mixed · 256 tokens/sample — pr-e06989ec8ade3ce0"
    assert options(SETS) == [{"label": "mixed — cal-1", "value": "cal-1"}]


def test_job_progress_names_what_it_works_on_and_how_long_it_ran():
    from frontend.components import progress

    job = {"id": "job-1", "kind": "profile", "state": "succeeded", "run_s": 3.21, "progress": {}}
    assert progress(job, "tiny · mixed").children[0].children == "profile tiny · mixed — job-1: succeeded in 3.2 s"
    running = {**job, "state": "running", "run_s": 1.0, "progress": {"stage": "profile", "current": 2, "total": 5, "fraction": 0.4}}
    assert progress(running).children[0].children == "profile job-1: running — profile 2/5"
    # the API's estimate of the stage's time left (its pace so far), and a queued job's place in line
    slow = {**running, "progress": {**running["progress"], "stage_s": 240.0, "stage_left_s": 360.0}}
    assert progress(slow).children[0].children == "profile job-1: running — profile 2/5 · 240 s · about 6 min left in this stage"
    stopping = {**running, "cancel_requested": True}
    assert progress(stopping).children[0].children == "profile job-1: running — profile 2/5 · cancel requested: it stops at its next step"
    waiting = {**job, "state": "queued", "queue_position": 2, "progress": {}}
    assert progress(waiting).children[0].children == "profile job-1: queued · 2nd in line"
    # a failed job's reason is an error; a cancelled one's (the user's own request) a note, so no page shows it in red
    failed = progress({**job, "state": "failed", "error": "out of memory during 'profile'"}).children[-1]
    cancelled = progress({**job, "state": "cancelled", "error": "cancelled on request during 'load model'"}).children[-1]
    assert (failed.className, cancelled.className) == ("error", "note")
    assert cancelled.children == "cancelled on request during 'load model'"


def test_stage_time_left_is_the_pace_so_far():
    from datetime import timedelta

    from backend.views import job_out
    from moelab.store.db import Job, utcnow

    now = utcnow()
    job = Job(id="job-x", kind="profile", state="running", queue="gpu", resource_type="profiles", resource_id="pr-x",
              stage="profile", current=2, total=5, stage_at=now - timedelta(seconds=100), created_at=now - timedelta(seconds=120),
              started_at=now - timedelta(seconds=110), cancel_requested=False)
    out = job_out(job)
    assert abs(out.progress.stage_left_s - 150.0) < 2 and out.queue_position is None  # 100 s for 2 steps, 3 to go
    assert job_out(Job(**{**{c: getattr(job, c) for c in ("id", "kind", "queue", "resource_type", "resource_id", "created_at",
                                                            "cancel_requested")}, "state": "running", "current": 0, "total": 5,
                          "stage_at": now})).progress.stage_left_s is None  # no step yet: no pace to go by


def test_names_are_a_help_a_list_the_api_does_not_answer_leaves_ids(monkeypatch):
    from frontend import components
    from moelab import api_client

    class Api:
        def models(self):
            raise api_client.ApiError("models: HTTP 500")

        calibration_sets = models

        def profiles(self):
            return PROFILES

    monkeypatch.setattr(api_client, "api", lambda: Api())
    (opt,) = components.named_options("profiles")
    assert opt == {"label": "m-1 · cal-1 · 256 tokens/sample — pr-e06989ec8ade3ce0", "value": "pr-e06989ec8ade3ce0"}


def test_a_text_is_in_out_or_partly_in_the_calibration_domains():
    from frontend.names import builtin_spec, domain_relation

    builtins = {"mixed": ["code", "prose", "literature", "chat", "code_problems", "math"], "code": ["code"], "prose": ["prose"]}
    assert domain_relation("builtin:mixed", "builtin:code", builtins) == "in domain"
    assert domain_relation("builtin:code", "builtin:prose", builtins) == "out of domain"
    assert domain_relation("builtin:code+chat", "builtin:code+prose", builtins) == "partly in domain"  # a mix: its parts
    assert domain_relation("builtin:prose+literature", "builtin:mixed", builtins) == "partly in domain"
    assert domain_relation(None, "builtin:code", builtins) is None  # an uploaded set: unknown, never guessed
    assert domain_relation("builtin:code", "cal-123", builtins) is None
    assert builtin_spec({"origin": "builtin", "params": {"name": "code"}}) == "builtin:code"
    assert builtin_spec({"origin": "upload", "params": {}}) is None


def test_no_page_module_is_imported_twice_by_the_app():
    """Dash imports each page as ``pages.NAME``; a page that imports another page as ``frontend.pages.NAME``
    registers that page a second time and every request to its path fails ('duplicate paths'). Shared
    helpers live in ``frontend.names`` and friends, never in a page."""
    import subprocess
    import sys

    code = ("import sys, frontend.app, dash; "
            "twice = sorted(m for m in sys.modules if m.startswith('frontend.pages.') and m != 'frontend.pages.__init__'); "
            "print(twice)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    assert out == "[]", out


def test_the_proposed_calibration_is_the_mix_when_the_server_has_it():
    from frontend.defaults import CALIBRATION_SAMPLES, default_builtin

    assert default_builtin(["code", "prose", "mixed"]) == "mixed" and CALIBRATION_SAMPLES == 240
    assert default_builtin(["code", "prose"]) == "code" and default_builtin([]) is None


def test_a_conversion_named_in_the_url_but_not_ready_is_said_not_dropped(monkeypatch):
    from moelab import api_client
    from frontend.components import not_offered

    class Api:
        def conversion(self, ident):
            if ident == "conv-gone":
                raise api_client.ApiError("no conversion with id 'conv-gone'", 404)
            return {"id": ident, "status": "cancelled"}

    monkeypatch.setattr(api_client, "api", lambda: Api())
    offered = [{"label": "ready one", "value": "conv-ready"}]
    assert not_offered("conv-ready", offered) == ("conv-ready", None) and not_offered(None, offered) == (None, None)
    assert not_offered("conv-x", offered) == (None, "conversion conv-x (from the link) is cancelled, and only ready "
                                                     "conversions can be shown: choose another")
    assert "does not exist any more" in not_offered("conv-gone", offered)[1]


def test_every_page_joins_the_bar_in_its_own_order():
    import dash

    import frontend.app as app

    orders = {p["path"]: p["order"] for p in dash.page_registry.values()}
    assert len(set(orders.values())) == len(orders), orders  # no two pages claim one place
    assert [name for name, _ in app.nav()] == [  # a user's path: data, exploration, conversion, judging, playing
        "Workspace", "Calibration sets", "Neuron explorer", "Compare profiles", "Layer similarity", "Conversion designer",
        "Fine-tune", "Routing explorer", "Token routing", "Compare conversions", "Evaluations", "Playground"]
