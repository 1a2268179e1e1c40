"""'Download as GGUF' in a real browser against a live API and worker (issue 25 item 5): the Workspace
offers the type choice and the button for a conversion whose layout exports (a uniform ExpertWeaver
conversion recovered 1 step in mode expertweaver), runs the export job and offers the file through
the frontend's relay (a GGUF the browser downloads); a conversion whose layout does not export says
why in its row, in the API's words. The designer says whether the conversion being designed will
export (the engine's rules, ``moelab.engine.runtime.export_plan``, through ``POST /methods/{method}/export-plan``)."""

from __future__ import annotations

import pytest

from frontend.exportability import ui_words
from moelab.engine.runtime.export_plan import AFTER_RECOVERY, NATIVE_FAMILIES, planned_export

from .conftest import ARTIFACTS, wait_job

UNIFORM = {"n_experts": 8, "sparsity": 0.25, "alpha_min": 0.25, "alpha_max": 0.25, "tau": 0.3}
ONE_STEP = {"mode": "expertweaver", "steps": 1, "batch_size": 1, "seq_len": 16, "eval_windows": 1, "source": "builtin:math"}


def _id(**parts: str) -> str:
    body = ",".join(f'"{k}":"{v}"' for k, v in sorted(parts.items()))
    return f"[id='{{{body}}}']"


def _row(page, conversion_id: str):
    return page.locator("tr", has=page.locator(_id(type="ws-del", kind="conversions", id=conversion_id)))


# ----------------------------------------------------------------------------- the designer's rules (pure)


@pytest.mark.parametrize("method, params, family, verdict, words", [
    ("expertweaver", {"plan": "leading", "router": "ridge", "alpha_basis": "active"}, None, "after_recovery", AFTER_RECOVERY),
    ("expertweaver", {"alpha_min": 0.3, "alpha_max": 0.3}, "llama", "after_recovery", "to GGUF (llama.cpp / Ollama) and native"),
    ("expertweaver", {}, None, "no", "alpha_min 0.2 ≠ alpha_max 0.7"),  # the paper's defaults: α per layer
    ("expertweaver", {"plan": "budget"}, None, "no", "plan 'budget' gives layers their own"),
    ("expertweaver", {"plan": "someday"}, None, "no", "plan 'someday'"),  # a plan this check does not know: not promised
    ("expertweaver", {"plan": "leading", "compensation": "skipped_mean"}, None, "no", "compensation 'skipped_mean'"),
    ("expertweaver", {"plan": "leading", "down_keep": 0.5}, None, "no", "down_keep 0.5 runs only part of each active expert"),
    ("expertweaver", {"plan": "leading", "combine": "weighted", "router": "ridge"}, None, "no", "use combine sum"),
    ("expertweaver", {"plan": "leading", "combine": "weighted"}, None, "as_converted", "exportable as converted"),
    ("expertweaver", {"plan": "leading"}, "qwen3", "after_recovery", "native transformers only: GGUF exports Llama and Mistral"),
    ("expertweaver", {"plan": "leading"}, "phi3", "no", "source family 'phi3'"),
    ("cmoe", {}, None, "no", "not planned for cmoe"),
])
def test_designer_says_whether_the_planned_conversion_exports(method, params, family, verdict, words):
    got, text = planned_export(method, params, family)
    assert got == verdict and words in text, (got, text)


def test_the_native_families_are_the_native_exporters():
    from moelab.engine.runtime.native_export import SOURCE_TARGETS

    assert set(NATIVE_FAMILIES) == set(SOURCE_TARGETS)


def test_the_designer_shows_the_apis_export_plan_in_its_own_words(monkeypatch):
    """The designer's note is the API's answer (the real route function behind a mock transport) in the UI's words:
    no export rule is copied into the UI; an unknown method is a 404 that says which methods there are."""
    import httpx

    import frontend.app  # noqa: F401  (the pages register when the app is made)
    from backend.errors import ApiError as RouteError
    from backend.routes.methods import export_plan
    from backend.schemas import ExportPlanIn
    from frontend.pages import designer
    from moelab.api_client import ApiClient

    def handler(request: httpx.Request) -> httpx.Response:
        method = request.url.path.split("/")[-2]
        try:
            return httpx.Response(200, json=export_plan(method, ExportPlanIn.model_validate_json(request.content)).model_dump())
        except RouteError as exc:
            return httpx.Response(exc.status, json={"detail": exc.detail})

    client = ApiClient(base_url="http://api.test/api/v1", token="", transport=httpx.MockTransport(handler))
    monkeypatch.setattr(designer, "api", lambda: client)
    plan = client.export_plan("cmoe", {})
    assert plan["verdict"] == "no" and plan["text"].endswith("this one exports with --format moelab")
    ids = [{"type": designer.PARAM, "method": "expertweaver", "name": n} for n in ("plan", "combine")]
    note = designer._export_note("expertweaver", ["leading", "weighted"], "llama", ids)
    assert note.className == "export-as_converted" and note.children == (
        "GGUF / native export: exportable as converted, to GGUF (llama.cpp / Ollama) and native transformers")
    note = designer._export_note("cmoe", [], None, [])
    assert note.className == "export-no" and note.children.endswith("this one downloads in moelab's format (zip)")
    assert "--" not in note.children
    note = designer._export_note("expertweaver", ["leading", "sum"], "qwen3", ids)
    assert "(the Fine-tune page, mode expertweaver)" in note.children and "native transformers only" in note.children
    missing = designer._export_note("nosuch", [], None, [])
    assert missing.className == "export-no" and "no method 'nosuch': choose one of expertweaver" in missing.children


# ----------------------------------------------------------------------------- in the browser


@pytest.fixture(scope="module")
def conversions(api, profile_id) -> dict[str, str]:
    """One conversion that does not export (EW Eq. 10's training-free sum, α per layer) and one that does."""
    plain = api.post("/conversions", json={"profile_id": profile_id, "expertweaver": {"n_experts": 8, "alpha_max": 0.5}}).json()
    uniform = api.post("/conversions", json={"profile_id": profile_id, "expertweaver": UNIFORM}).json()
    wait_job(api, plain["job_id"])
    wait_job(api, uniform["job_id"])
    ft = api.post("/finetunes", json={"conversion_id": uniform["id"], **ONE_STEP}).json()
    wait_job(api, ft["job_id"])
    return {"plain": plain["id"], "exportable": api.get(f"/finetunes/{ft['id']}").json()["result_conversion_id"]}


@pytest.mark.slow
def test_workspace_exports_a_gguf_and_says_why_another_does_not(page, live, api, conversions, tmp_path):
    plain, good = conversions["plain"], conversions["exportable"]
    reason = api.get(f"/conversions/{plain}").json()["gguf"]["reason"]
    page.goto(f"{live['ui']}/")

    refusal = _row(page, plain).locator(".gguf-refusal")
    refusal.wait_for()
    assert "combines its experts with 'sum'" in reason and "--recipe portable" in reason  # the API speaks to scripts …
    shown = refusal.inner_text()  # … the page says the same in its own words: recipe, Fine-tune page, download format
    assert shown == f"no GGUF: {ui_words(reason)}" and "--" not in shown and "the 'portable' recipe" in shown
    assert "the Fine-tune page, mode expertweaver" in shown and "moelab's format (zip)" in shown
    assert _row(page, plain).locator(_id(type="ws-gguf", id=plain)).count() == 0  # no button where it cannot export

    row = _row(page, good)
    button = row.locator(_id(type="ws-gguf", id=good))
    assert button.inner_text() == "Download as GGUF" and row.locator(".gguf-refusal").count() == 0
    assert row.locator(_id(type="ws-gguf-type", id=good)).inner_text().split() == ["f16", "q8_0", "f32"]
    row.locator(_id(type="ws-gguf-type", id=good)).locator("label", has_text="q8_0").click()
    button.click()
    page.wait_for_selector(f"#ws-exported >> text=exporting {good} as GGUF q8_0 (job")
    link = _row(page, good).locator("a.gguf-file")
    link.wait_for(timeout=60_000)  # the row follows the job, then offers the file
    name = f"{good}-q8_0.gguf"
    assert link.inner_text().startswith(f"⤓ {name} (")
    export = next(e for e in api.get(f"/conversions/{good}/exports").json()["items"] if e["type"] == "q8_0")
    assert link.get_attribute("href") == f"/download/exports/{export['id']}/{name}"  # this server's relay, not the API
    # 8 experts of 12 neurons are not whole q8_0 blocks: the row says so, with the expert count that fits, in its words
    note = export["summary"]["note"]
    assert "experts of 12 neurons are not whole 32-value blocks" in note and "--n-experts 3 (experts of 32)" in note
    assert _row(page, good).locator(".gguf-note").inner_text() == ui_words(note) and "n_experts 3" in ui_words(note)
    with page.expect_download() as dl:
        link.click()
    saved = tmp_path / name
    dl.value.save_as(saved)
    assert dl.value.suggested_filename == name
    data = saved.read_bytes()
    assert data[:4] == b"GGUF" and len(data) == export["bytes"]
    page.screenshot(path=str(ARTIFACTS / "workspace-gguf.png"), full_page=True)

    # asked again: the same file at once, no second job
    button = _row(page, good).locator(_id(type="ws-gguf", id=good))
    _row(page, good).locator(_id(type="ws-gguf-type", id=good)).locator("label", has_text="q8_0").click()
    button.click()
    page.wait_for_selector(f"#ws-exported >> text=GGUF q8_0 of {good} is ready")
    assert len([e for e in api.get(f"/conversions/{good}/exports").json()["items"] if e["type"] == "q8_0"]) == 1
    r = api.get(f"{live['ui']}/download/exports/exp-0000000000000000/{name}")  # a missing export: the API's words
    assert r.status_code == 404 and "exp-0000000000000000" in r.text, r.text
    assert page.errors == [], page.errors


@pytest.mark.slow
def test_designer_says_whether_the_design_will_export(page, live, profile_id):
    page.goto(f"{live['ui']}/designer?profile={profile_id}&method=expertweaver&recipe=portable")
    page.wait_for_selector(f"#cd-export-note >> text={ui_words(AFTER_RECOVERY)}")  # the API's plan, in the page's words
    assert "to GGUF (llama.cpp / Ollama) and native transformers" in page.inner_text("#cd-export-note")  # a Llama source
    page.goto(f"{live['ui']}/designer?profile={profile_id}&method=expertweaver")  # the paper recipe: α per layer
    page.wait_for_selector("#cd-export-note >> text=not exportable")
    assert "alpha_min 0.2 ≠ alpha_max 0.7" in page.inner_text("#cd-export-note")
    assert page.errors == [], page.errors
