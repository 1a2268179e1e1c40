"""Token routing and the playground in a real browser on a served app: every token of the text is
shown, coloured by the expert the API's probe says it is routed to; an expert's view colours
exactly the tokens routed to it; the playground shows both models' text and speed as measured."""

from __future__ import annotations

import re

import pytest

import frontend.app  # noqa: F401  (instantiates the Dash app: the page modules register with it)
from frontend.token_view import expert_colour, routed_tokens

from .conftest import ARTIFACTS, wait_job

RESULT = {  # a probe's result as the worker writes it (two tokens, one routed layer)
    "tokens": ["def", " f"], "token_ids": [1, 2],
    "layers": [{"layer": 3, "n_routed": 4, "top_k": 2, "experts": [[2, 0], [1, 2]], "load": [1, 1, 2, 0]}],
}


def _spans(div) -> list:
    return [c for c in div.children[2].children]


def test_routed_tokens_colour_by_best_expert_and_expert_view():
    spans = _spans(routed_tokens(RESULT, 3))
    assert [s.children for s in spans] == ["def", " f"]
    assert [s.style["backgroundColor"] for s in spans] == [expert_colour(2), expert_colour(1)]
    assert "experts 2, 0 (best first)" in spans[0].title
    view = routed_tokens(RESULT, 3, expert=0)
    assert [s.style["backgroundColor"] for s in _spans(view)] == [expert_colour(0), "transparent"]
    assert "expert 0: 1 of 2 tokens routed to it" in view.children[1].children
    assert "routes nothing" in routed_tokens(RESULT, 5).children and "routed layers: 3" in routed_tokens(RESULT, 5).children


def _rgb(hex_colour: str) -> str:
    h = hex_colour.lstrip("#")
    return "rgb({}, {}, {})".format(*(int(h[i:i + 2], 16) for i in (0, 2, 4)))


@pytest.fixture(scope="module")
def conversion(api, profile_id) -> str:
    c = api.post("/conversions", json={"profile_id": profile_id, "expertweaver": {"n_experts": 4, "alpha_max": 0.5, "sparsity": 0.5}}).json()
    assert wait_job(api, c["job_id"])["state"] == "succeeded"
    return c["id"]


@pytest.mark.slow
def test_token_routing_page_colours_every_token(page, live, api, conversion):
    page.goto(f"{live['ui']}/tokens?a={conversion}")
    page.fill("#tk-text", "for i in range(10):\n    print(i * i)")
    page.click("#tk-run")
    page.wait_for_selector(".token-text .tok", timeout=120_000)
    url = page.evaluate("() => window.location.search")
    probe_id = re.search(r"pa=([\w-]+)", url).group(1)
    layer = int(re.search(r"layer=(\d+)", url).group(1))
    result = api.get(f"/probes/{probe_id}/result").json()
    lay = next(x for x in result["layers"] if x["layer"] == layer)
    spans = page.locator(".token-text .tok")
    assert spans.count() == len(result["tokens"])
    shown = page.evaluate("() => [...document.querySelectorAll('.token-text .tok')].map(s => [s.textContent, s.dataset.expert, "
                          "getComputedStyle(s).backgroundColor])")
    assert [t for t, _, _ in shown] == result["tokens"]
    assert [int(e) for _, e, _ in shown] == [x[0] for x in lay["experts"]]  # best-scoring expert of every token
    assert [c for _, _, c in shown] == [_rgb(expert_colour(x[0])) for x in lay["experts"]]
    page.screenshot(path=str(ARTIFACTS / "token-routing.png"), full_page=True)
    expert = max(range(len(lay["load"])), key=lambda e: lay["load"][e])
    page.fill("#tk-expert", str(expert))
    page.press("#tk-expert", "Enter")
    page.wait_for_selector(f"text=expert {expert}: {lay['load'][expert]} of {len(result['tokens'])} tokens routed to it")
    assert page.locator(".token-text .tok-hit").count() == lay["load"][expert]
    neurons = api.get(f"/conversions/{conversion}/experts/{layer}").json()["experts"][expert]["neurons"]
    page.wait_for_selector(f"text=expert {expert} of layer {layer}: {len(neurons)} neurons")
    hrefs = page.eval_on_selector_all(".expert-neurons a", "els => els.map(e => e.getAttribute('href'))")
    assert [int(h.rsplit("neuron=", 1)[1]) for h in hrefs] == neurons[:48]  # each neuron links to its card
    assert page.errors == [], page.errors


@pytest.mark.slow
def test_playground_shows_both_models_text_and_speed(page, live, api, conversion):
    page.goto(f"{live['ui']}/playground?conversion={conversion}")
    page.fill("#pg-prompt", "Once upon a time")
    page.fill("#pg-tokens", "4")
    page.click("#pg-run")
    page.wait_for_selector(".speedup >> text=×", timeout=120_000)
    probe_id = re.search(r"probe=([\w-]+)", page.evaluate("() => window.location.search")).group(1)
    s = api.get(f"/probes/{probe_id}").json()["summary"]
    texts = page.locator(".generated").all_inner_texts()
    assert [t.strip() for t in texts] == [s["dense"]["text"].strip(), s["converted"]["text"].strip()]
    assert page.inner_text(".speedup") == f"converted / dense speed: {s['speedup']:.2f}×"
    speeds = page.locator(".speed").all_inner_texts()
    assert f"{s['dense']['tokens_per_s']:.1f} tokens/s" in speeds[0] and f"{s['converted']['tokens_per_s']:.1f} tokens/s" in speeds[1]
    page.screenshot(path=str(ARTIFACTS / "playground.png"), full_page=True)
    assert page.errors == [], page.errors
