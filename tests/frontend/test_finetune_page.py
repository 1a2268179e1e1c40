"""The Fine-tune page in a real browser against a live API, worker and frontend: the mode defaults
from the conversion's method, Start queues a fine-tune of a tiny model, the loss curve gets its
points from the live log, and the result shows perplexity before → after with a link to the
fine-tuned conversion. Screenshot in test-artifacts/."""

from __future__ import annotations

import pytest

from .conftest import wait_job
from .test_browser import figure, no_errors, shot, wait_figures

pytestmark = pytest.mark.slow

STEPS = 8


@pytest.fixture(scope="module")
def conversion_id(api, profile_id) -> str:
    c = api.post("/conversions", json={"profile_id": profile_id, "allocation": {"n_experts": 8, "alpha_max": 0.5}}).json()
    wait_job(api, c["job_id"])
    return c["id"]


def test_finetune_from_the_page_draws_the_loss_curve_and_shows_the_result(page, live, api, conversion_id):
    page.goto(f"{live['ui']}/finetune?conversion={conversion_id}")
    page.wait_for_selector("#ft-mode-help >> text=EW Eq. 12")  # an ExpertWeaver conversion: its mode is the default
    assert page.locator("#ft-mode input[value=expertweaver]").is_checked()
    assert page.is_disabled("#ft-cancel") and page.is_disabled("#ft-resume")
    page.fill("#ft-steps", str(STEPS))
    page.fill("#ft-batch_size", "2")
    page.fill("#ft-seq_len", "32")
    page.click("#ft-start")

    page.wait_for_function("() => location.search.includes('finetune=ft-')")
    wait_figures(page, "ft-loss", timeout=120_000)  # the first logged steps, before the job has ended
    page.wait_for_selector("#ft-job >> text=succeeded", timeout=180_000)
    page.wait_for_selector("#ft-result-ppl >> text=perplexity")
    finetune_id = page.evaluate("() => new URLSearchParams(location.search).get('finetune')")
    ft = api.get(f"/finetunes/{finetune_id}").json()
    assert ft["status"] == "ready" and ft["params"]["mode"] == "expertweaver" and ft["params"]["steps"] == STEPS

    loss = next(t for t in figure(page, "ft-loss")["data"] if t["name"] == "loss (total)")
    assert loss["x"] == list(range(1, STEPS + 1)) and all(y > 0 for y in loss["y"])
    log = api.get(f"/finetunes/{finetune_id}/log").json()
    assert loss["y"] == pytest.approx([s["loss"] for s in log["steps"]])
    text = page.inner_text("#ft-result-ppl")
    assert f"{log['perplexity_before']:.3f} → {log['perplexity_after']:.3f}" in text
    result = ft["result_conversion_id"]
    assert page.get_attribute("#ft-result-card a[href^='/routing']", "href") == f"/routing?conversion={result}"
    assert page.is_disabled("#ft-cancel") and page.is_disabled("#ft-resume")  # a finished run: nothing to stop or resume
    shot(page, "finetune")
    no_errors(page)
