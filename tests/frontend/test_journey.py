"""The whole journey in one browser session, as a new user walks it: workspace → calibration set →
neuron card → designer (convert) → token routing → compare → playground. Each step checks what the
page says against the API, leaves a numbered screenshot in test-artifacts/journey-NN-*.png and its
wall time in test-artifacts/journey.json (the closing notes' walk-through is read from there)."""

from __future__ import annotations

import json
import re
import time

import pytest

import frontend.app  # noqa: F401  (instantiates the Dash app: the page modules register with it)

from .conftest import ARTIFACTS


class Journey:
    def __init__(self, page) -> None:
        self.page, self.steps, self.t0 = page, [], time.monotonic()

    def step(self, name: str, what: str) -> None:
        """Close the step begun at the previous call: its screenshot and wall time."""
        n = len(self.steps) + 1
        shot = f"journey-{n:02d}-{name}.png"
        self.page.screenshot(path=str(ARTIFACTS / shot), full_page=True)
        now = time.monotonic()
        self.steps.append({"step": n, "page": name, "what": what, "seconds": round(now - self.t0, 2), "screenshot": shot})
        self.t0 = now
        assert self.page.errors == [], self.page.errors


@pytest.mark.slow
def test_the_journey_from_model_to_playground(page, live, api, profile_id):
    ui, j = live["ui"], Journey(page)
    profile = api.get(f"/profiles/{profile_id}").json()

    page.goto(f"{ui}/")
    page.wait_for_selector(f"text={profile_id}")
    j.step("workspace", "models, sets and the profile, named; the getting-started path")

    page.goto(f"{ui}/calibration?set={profile['calibration_set_id']}")
    page.wait_for_function("id => document.body.innerText.includes(id)", arg=profile["calibration_set_id"])
    j.step("calibration", "the calibration set the profile read")

    page.goto(f"{ui}/neurons?profile={profile_id}&layer=1&neuron=5")
    page.wait_for_selector("text=layer 1 · neuron 5")
    card = api.get(f"/profiles/{profile_id}/neurons/1/5").json()
    page.wait_for_selector(".snippets .tok.hl")
    assert page.locator(".snippets .snippet").count() == len(card["top"])
    j.step("neuron-card", "one neuron's CV, per-task means and its top-activating tokens, highlighted")

    page.goto(f"{ui}/designer?profile={profile_id}&n_experts=8&alpha_max=0.5&sparsity=0.5")
    page.wait_for_selector("#cd-plan .js-plotly-plot")
    page.click("#cd-convert")
    page.wait_for_selector("#cd-job >> text=succeeded", timeout=120_000)
    head = page.wait_for_selector("#cd-result-card h3").inner_text()
    conversion = re.search(r"(conv-[0-9a-f]+)", head).group(1)
    assert api.get(f"/conversions/{conversion}").json()["status"] == "ready"
    j.step("designer-convert", "the plan preview, then Convert: the job's progress and the result")

    page.goto(f"{ui}/tokens?a={conversion}")
    page.fill("#tk-text", "The cat sat on the mat. def f(x): return x + 1")
    page.click("#tk-run")
    page.wait_for_selector(".token-routing .token-text .tok", timeout=120_000)
    probe = re.search(r"pa=([\w-]+)", page.evaluate("() => location.search")).group(1)
    result = api.get(f"/probes/{probe}/result").json()
    assert page.locator(".token-routing .token-text .tok").count() == len(result["tokens"])
    j.step("token-routing", "every token coloured by its expert in one layer")

    page.goto(f"{ui}/compare?ids={conversion}")
    page.wait_for_selector(f"#cc-table >> text={conversion}")
    cost = api.get(f"/conversions/{conversion}").json()["summary"]["ffn_flops_fraction"]
    assert page.locator(f"#cc-table >> text={cost:.3f}").count() >= 1  # the cost it was built at
    j.step("compare", "the conversion's parameters and cost next to the others")

    page.goto(f"{ui}/playground?conversion={conversion}")
    page.fill("#pg-prompt", "Once upon a time")
    page.fill("#pg-tokens", "8")
    page.click("#pg-run")
    page.wait_for_selector(".speedup >> text=×", timeout=120_000)
    j.step("playground", "dense and converted continuations side by side, with tokens/s")

    (ARTIFACTS / "journey.json").write_text(json.dumps({"steps": j.steps, "total_s": round(sum(s["seconds"] for s in j.steps), 2)},
                                                       indent=2) + "\n")
    assert [s["page"] for s in j.steps] == ["workspace", "calibration", "neuron-card", "designer-convert", "token-routing",
                                            "compare", "playground"]
