"""The workspace as a home: the getting-started path (pure), and in a real browser against a live
API and worker with a tiny model — delete refused with the dependants named, then the cascade after
a confirm; Retry re-runs a failed job; a converted model downloads as a zip holding config.json.
And what was missing: a new calibration set joins the list without a reload, the fine-tune form
shows a run's settings after a reload, evaluation offers every built-in set."""

from __future__ import annotations

import shutil
import time
import zipfile

import pytest

import frontend.app  # noqa: F401  (instantiates the Dash app: the page modules register with it)
from frontend.components import source_options
from frontend.pages.finetune import form_values
from frontend.pages.workspace import getting_started

from .conftest import ARTIFACTS, wait_job


def _id(**parts: str) -> str:
    """CSS selector of a pattern-matching id (Dash writes it as JSON with sorted keys)."""
    body = ",".join(f'"{k}":"{v}"' for k, v in sorted(parts.items()))
    return f"[id='{{{body}}}']"


def _accept_dialogs(page) -> list[str]:
    said: list[str] = []

    def on_dialog(dialog) -> None:
        said.append(dialog.message)
        dialog.accept()

    page.on("dialog", on_dialog)
    return said


def _final(api, job_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = api.get(f"/jobs/{job_id}").json()
        if job["state"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not finished after {timeout} s")


def test_getting_started_ticks_steps_until_a_profile_is_ready():
    card = str(getting_started([], [], [], []))
    assert all(step in card for step in ("Add a model", "Build a calibration set", "Profile the model on the set", "Design a conversion"))
    assert "✓" not in card
    model = {"id": "mod-1", "status": "ready"}
    assert str(getting_started([model], [{"id": "cal-1", "status": "running"}], [], [])).count("✓") == 1  # only ready ones count
    assert getting_started([model], [], [{"id": "pr-1", "status": "ready"}], []) is None


@pytest.mark.slow
def test_delete_refused_names_dependants_then_cascade(page, live, api, profile_id):
    model_id = api.get(f"/profiles/{profile_id}").json()["model_id"]
    s = api.post("/calibration-sets", json={"source": "builtin", "name": "prose", "samples": 5}).json()
    wait_job(api, s["job_id"])
    p = api.post("/profiles", json={"model_id": model_id, "calibration_set_id": s["id"], "max_tokens": 16, "batch_tokens": 256}).json()
    wait_job(api, p["job_id"])

    said = _accept_dialogs(page)
    page.goto(f"{live['ui']}/")
    page.click(_id(type="ws-del", kind="calibration-sets", id=s["id"]))
    page.wait_for_selector("#ws-deleted >> text=not deleted")
    text = page.inner_text("#ws-deleted")
    assert f"calibration set {s['id']} is used by profile {p['id']}" in text, text  # the dependant by name
    assert "?cascade" not in text and "Delete it with everything that depends on it" in text  # words, not the API's query syntax
    assert said == [f"Delete calibration set {s['id']}? This cannot be undone."]
    page.screenshot(path=str(ARTIFACTS / "workspace-delete-refused.png"), full_page=True)
    assert api.get(f"/calibration-sets/{s['id']}").status_code == 200

    page.click(_id(type="ws-cascade", kind="calibration-sets", id=s["id"]))
    page.wait_for_selector(f"#ws-deleted >> text=deleted {s['id']} and 1 that depended on it")
    assert "together with everything that depends on it" in said[-1]
    assert api.get(f"/calibration-sets/{s['id']}").status_code == 404 and api.get(f"/profiles/{p['id']}").status_code == 404
    page.wait_for_selector(_id(type="ws-del", kind="profiles", id=p["id"]), state="detached")  # the lists redrawn without it


@pytest.mark.slow
def test_retry_reruns_a_failed_job(page, live, api, tiny_llama):
    broken = tiny_llama.parent / "tiny-retry-model"  # inside MOELAB_DATA_ROOTS, like the tiny models
    shutil.copytree(tiny_llama, broken, dirs_exist_ok=True)
    weights = sorted(broken.glob("*.safetensors"))
    assert weights
    for w in weights:
        w.write_bytes(b"not a safetensors file")
    m = api.post("/models", json={"source": str(broken)}).json()
    failed = _final(api, m["job_id"])
    assert failed["state"] == "failed", failed

    for w in weights:  # the cause fixed: the same job re-run now succeeds
        shutil.copy(tiny_llama / w.name, w)
    page.goto(f"{live['ui']}/")
    page.click(_id(type="ws-retry", job=failed["id"], at="row"))
    page.wait_for_selector(f"#ws-cancelled >> text={failed['id']} re-runs as job")
    new_job = page.inner_text("#ws-cancelled").rsplit(" ", 1)[-1]
    rerun = _final(api, new_job)
    assert rerun["state"] == "succeeded" and rerun["retry_of"] == failed["id"], rerun
    row = page.locator("tr", has=page.locator(_id(type="ws-del", kind="models", id=m["id"])))
    row.locator("text=ready (").wait_for()  # the model row says ready and how long its job ran
    assert row.locator(".state-failed").count() == 0  # (the failed job itself stays in Recent jobs as history)
    assert page.errors == [], page.errors


@pytest.fixture(scope="module")
def conversion(api, profile_id) -> str:
    c = api.post("/conversions", json={"profile_id": profile_id, "expertweaver": {"n_experts": 4, "alpha_max": 0.5}}).json()
    wait_job(api, c["job_id"])
    return c["id"]


@pytest.mark.slow
def test_download_converted_model_and_finetune_link(page, live, api, conversion, tmp_path):
    c = {"id": conversion}
    page.goto(f"{live['ui']}/")
    link = page.locator(f"a[href='/download/conversions/{c['id']}.zip']")
    link.wait_for()
    assert page.locator(f"a[href='/finetune?conversion={c['id']}']").count() == 1
    with page.expect_download() as dl:
        link.click()
    path = tmp_path / "model.zip"
    dl.value.save_as(path)
    assert dl.value.suggested_filename == f"{c['id']}.zip"
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        assert zf.testzip() is None
    assert any(n.endswith("/config.json") for n in names), names
    assert any(n.endswith(".safetensors") for n in names), names

    # a missing conversion: the relay answers the API's message in words, not a broken zip
    r = api.get(f"{live['ui']}/download/conversions/conv-missing.zip")
    assert r.status_code == 404 and "conv-missing" in r.text, r.text
    assert page.errors == [], page.errors


def test_evaluation_offers_every_builtin_set_and_ready_sets():
    builtins = [{"name": n, "spec": f"builtin:{n}", "description": d} for n, d in (("mixed", "all"), ("code", "stdlib"), ("math", "word problems"))]
    opts = source_options(builtins, [{"id": "cal-1", "name": "mine", "status": "ready"}, {"id": "cal-2", "name": "x", "status": "running"}])
    assert [o["value"] for o in opts] == ["builtin:mixed", "builtin:code", "builtin:math", "cal-1"]
    assert opts[2]["label"] == "builtin:math: word problems"


def test_form_values_from_a_runs_params():
    v = form_values({"mode": "cmoe", "steps": 7, "lr": 0.002, "source": "builtin:code"})
    assert (v["mode"], v["steps"], v["lr"], v["source"], v["seq_len"]) == ("cmoe", 7, 0.002, "builtin:code", 256)
    assert form_values(None)["mode"] is None and form_values(None)["source"] == "builtin:mixed"


@pytest.mark.slow
def test_new_set_joins_the_list_without_reload(page, live, api):
    page.goto(f"{live['ui']}/calibration")
    page.fill("#cs-samples", "4")
    page.click("#cs-build")
    page.wait_for_selector("#cs-created >> text=is ready", timeout=60_000)
    new = page.inner_text("#cs-created").split(" — ", 1)[1].split(" ", 1)[0]
    assert api.get(f"/calibration-sets/{new}").json()["status"] == "ready"
    page.wait_for_selector(f"#cs-set >> text={new}")  # selected in the dropdown, its samples shown
    page.wait_for_selector("#cs-stats >> text=4 samples")
    assert page.errors == [], page.errors


@pytest.mark.slow
def test_finetune_form_shows_the_runs_settings_after_reload(page, live, api, conversion):
    ft = api.post("/finetunes", json={"conversion_id": conversion, "steps": 3, "batch_size": 2, "seq_len": 32, "lr": 0.002,
                                      "source": "builtin:code"}).json()
    assert "id" in ft, ft
    page.goto(f"{live['ui']}/finetune?finetune={ft['id']}")
    page.wait_for_selector("#ft-steps")
    assert (page.input_value("#ft-steps"), page.input_value("#ft-seq_len"), page.input_value("#ft-lr")) == ("3", "32", "0.002")
    assert "builtin:code" in page.inner_text("#ft-source")
    page.reload()  # the URL keeps the run, the form its settings
    page.wait_for_selector("#ft-steps")
    assert page.input_value("#ft-batch_size") == "2"
    page.wait_for_selector("#ft-job >> text=succeeded", timeout=120_000)  # let the short run end before the next test
