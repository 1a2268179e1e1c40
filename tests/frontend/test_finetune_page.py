"""The Fine-tune page in a real browser against a live API, worker and frontend: the mode defaults
from the conversion's method, Start queues a fine-tune of a tiny model, the loss curve gets its
points from the live log, Cancel stops it and Resume continues from its checkpoint, and the result
shows perplexity before → after with a link to the fine-tuned conversion. Screenshot in
test-artifacts/."""

from __future__ import annotations

import pytest

from .conftest import wait_job
from .test_browser import figure, no_errors, shot

pytestmark = pytest.mark.slow

STEPS = 150  # long enough to cancel mid-run from the page on a quiet machine (a tiny-model step takes ≥ 0.1 s; 20 raced the 1 s poll)

POINTS = """n => { const g = document.querySelector('#ft-loss .js-plotly-plot');
                   return !!(g && g.data && g.data.length && g.data[0].x && g.data[0].x.length >= n); }"""


@pytest.fixture(scope="module")
def conversion_id(api, profile_id) -> str:
    c = api.post("/conversions", json={"profile_id": profile_id, "expertweaver": {"n_experts": 8, "alpha_max": 0.5}}).json()
    wait_job(api, c["job_id"])
    return c["id"]


def test_finetune_from_the_page_draws_the_loss_curve_and_shows_the_result(page, live, api, conversion_id):
    page.goto(f"{live['ui']}/finetune?conversion={conversion_id}")
    page.wait_for_selector("#ft-mode-help >> text=EW Eq. 12")  # an ExpertWeaver conversion: its mode is the default
    assert page.locator("#ft-mode input[value=expertweaver]").is_checked()
    assert page.is_disabled("#ft-cancel") and page.is_disabled("#ft-resume")
    page.fill("#ft-steps", str(STEPS))
    page.fill("#ft-batch_size", "1")
    page.fill("#ft-seq_len", "16")
    page.click("#ft-start")

    page.wait_for_function("() => location.search.includes('finetune=ft-')")
    finetune_id = page.evaluate("() => new URLSearchParams(location.search).get('finetune')")
    page.wait_for_function(POINTS, arg=2, timeout=120_000)  # the curve grows from the live log while the job runs
    page.wait_for_function("() => !document.querySelector('#ft-cancel').disabled")
    page.click("#ft-cancel")
    page.wait_for_selector("#ft-job >> text=cancelled", timeout=60_000)
    page.wait_for_function("() => !document.querySelector('#ft-resume').disabled")
    assert page.is_disabled("#ft-cancel")
    cancelled_at = api.get(f"/finetunes/{finetune_id}/log").json()["n_steps"]
    assert 2 <= cancelled_at < STEPS
    page.click("#ft-resume")
    page.wait_for_selector("#ft-job >> text=succeeded", timeout=180_000)
    page.wait_for_selector("#ft-result-ppl >> text=perplexity")

    ft = api.get(f"/finetunes/{finetune_id}").json()
    assert ft["status"] == "ready" and ft["params"]["mode"] == "expertweaver" and ft["params"]["steps"] == STEPS
    log = api.get(f"/finetunes/{finetune_id}/log").json()
    assert log["resumed_at"] == [cancelled_at]  # Resume continued from the cancel's checkpoint
    loss = next(t for t in figure(page, "ft-loss")["data"] if t["name"] == "loss (total)")
    assert loss["x"] == list(range(1, STEPS + 1)) and loss["y"] == pytest.approx([s["loss"] for s in log["steps"]])
    text = page.inner_text("#ft-result-ppl")
    assert f"{log['perplexity_before']:.2f} → {log['perplexity_after']:.2f}" in text
    result = ft["result_conversion_id"]
    assert page.get_attribute("#ft-result-card a[href^='/routing']", "href") == f"/routing?conversion={result}"
    assert page.is_disabled("#ft-cancel") and page.is_disabled("#ft-resume")  # a finished run: nothing to stop or resume
    shot(page, "finetune")
    no_errors(page)


def test_the_page_reconnects_to_a_running_finetune_and_its_picker_follows_the_status(page, live, api, conversion_id):
    """A fine-tune started elsewhere (the API) and running: the page opened on its conversion shows that run (not an
    empty picker), follows it live, and once it ends the picker says so (not 'queued')."""
    ft = api.post("/finetunes", json={"conversion_id": conversion_id, "steps": 400, "batch_size": 1, "seq_len": 16,
                                      "eval_windows": 1, "source": "builtin:math"}).json()
    page.goto(f"{live['ui']}/finetune?conversion={conversion_id}")
    page.wait_for_function("id => location.search.includes('finetune=' + id)", arg=ft["id"])
    page.wait_for_selector("#ft-job .job-label")
    assert ft["id"] in page.inner_text("#ft-run")
    page.wait_for_function(POINTS, arg=2, timeout=120_000)  # its live curve
    api.delete(f"/jobs/{ft['job_id']}")  # ends it (at its next step) without waiting for 400 of them
    page.wait_for_selector("#ft-job >> text=cancelled", timeout=60_000)
    page.wait_for_function("() => document.querySelector('#ft-run').innerText.includes(': cancelled')", timeout=30_000)
    assert page.errors == [], page.errors  # (the cancelled job's reason is shown as an error on purpose)
