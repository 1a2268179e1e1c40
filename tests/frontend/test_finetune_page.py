"""The Fine-tune page in a real browser against a live API, worker and frontend: the mode defaults
from the conversion's method, Start queues a fine-tune of a tiny model, the loss curve gets its
points from the live log, Cancel stops it and Resume continues from its checkpoint, and the result
shows perplexity before → after with a link to the fine-tuned conversion. Screenshot in
test-artifacts/."""

from __future__ import annotations

import re
import time

import pytest

from frontend.components import duration

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
    assert page.errors == [], page.errors
    assert not page.query_selector("#ft-job .error")  # the cancelled job's reason is a note: the user asked for it


def test_with_every_worker_busy_the_jobs_list_says_each_jobs_place_and_time_left_and_cancels(page, live, api, conversion_id):
    """Every job worker runs a long fine-tune and one more waits: the Workspace's job list says the waiting job's place in
    line and a running one's estimated time left in its stage (both as the API computes them), and its Cancel button ends
    the waiting job."""
    workers = [w for w in api.get("/health").json()["workers"] if not w.startswith("moelab-light@")]
    long = {"conversion_id": conversion_id, "steps": 100_000, "batch_size": 1, "seq_len": 16, "checkpoint_every": 100_000,
            "eval_windows": 1, "source": "builtin:math"}
    jobs = [api.post("/finetunes", json=long).json()["job_id"] for _ in range(len(workers) + 1)]
    try:
        deadline = time.monotonic() + 120
        while True:  # which job waits depends on which worker took which message first
            states = {j: api.get(f"/jobs/{j}").json() for j in jobs}
            running = [s for s in states.values() if s["state"] == "running" and s["progress"].get("stage_left_s") is not None
                       and s["progress"].get("current", 0) >= 20]  # the pace of the first steps still moves a lot
            waiting = [s for s in states.values() if s["state"] == "queued"]
            if len(running) == len(workers) and len(waiting) == 1:
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.5)
        (queued,) = waiting
        assert queued["queue_position"] == 1, queued
        page.goto(f"{live['ui']}/")
        row = page.locator("#ws-jobs > div", has=page.locator(f"text=(job {queued['id']})"))
        row.locator(".job-label >> text=queued · 1st in line").wait_for(timeout=30_000)
        busy = running[0]["id"]
        label = page.locator("#ws-jobs > div", has=page.locator(f"text=(job {busy})")).locator(".job-label")
        label.locator("text=left in this stage").wait_for(timeout=30_000)
        shown = re.search(r"about (.+) left in this stage", label.inner_text()).group(1)
        now = api.get(f"/jobs/{busy}").json()["progress"]
        if shown != duration(now["stage_left_s"]):  # the estimate moved between the page's read and this one: close to it
            h, m, sec = re.fullmatch(r"(?:(\d+) h )?(?:(\d+) min)?(?:(\d+) s)?", shown).groups(default="0")
            assert abs(int(h) * 3600 + int(m) * 60 + int(sec) - now["stage_left_s"]) <= 0.5 * now["stage_left_s"] + 60, (shown, now)
        assert re.search(r"— train \d+/100000", label.inner_text()), label.inner_text()
        shot(page, "jobs-in-line")
        row.locator("button:text-is('Cancel')").click()
        deadline = time.monotonic() + 30
        while api.get(f"/jobs/{queued['id']}").json()["state"] != "cancelled":
            assert time.monotonic() < deadline, "the waiting job's Cancel did not cancel it"
            time.sleep(0.3)
        row.locator(".job-label >> text=cancelled").wait_for(timeout=30_000)
    finally:
        for job_id in jobs:
            api.delete(f"/jobs/{job_id}")
        for job_id in jobs:
            deadline = time.monotonic() + 60
            while api.get(f"/jobs/{job_id}").json()["state"] in ("queued", "running") and time.monotonic() < deadline:
                time.sleep(0.3)
