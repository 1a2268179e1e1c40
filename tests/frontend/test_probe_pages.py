"""Token routing and the playground in a real browser on a served app: every token of the text is
shown, coloured by the expert the API's probe says it is routed to, in black or white text,
whichever reads on that colour (WCAG contrast ≥ 4.5 for every colour of the palette); an expert's
view colours exactly the tokens routed to it; a shared URL opens with the controls it was made with;
the playground shows both models' text and speed as measured; a second conversion's experts are named
and coloured after the first one's matched experts."""

from __future__ import annotations

import re

import pytest

import frontend.app  # noqa: F401  (instantiates the Dash app: the page modules register with it)
from frontend import figures as F
from frontend.pages.tokens import DEFAULT_TEXT, initial_controls
from frontend.token_view import PALETTE, contrast_ratio, expert_colour, relative_luminance, routed_tokens, text_colour

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


def test_token_text_is_black_or_white_by_luminance_and_readable_on_every_expert_colour():
    assert contrast_ratio("#000000", "#ffffff") == pytest.approx(21.0) and contrast_ratio("#777777", "#777777") == 1.0
    assert relative_luminance("#ffffff") == pytest.approx(1.0) and relative_luminance("rgb(0, 0, 0)") == 0.0
    assert text_colour("#000000") == "#ffffff" and text_colour("#ffffff") == "#000000"
    assert text_colour("#222A2A") == "#ffffff" and text_colour("#FED4C4") == "#000000"  # Dark24's near-black; Light24's pale pink
    for colour in PALETTE:
        assert contrast_ratio(colour, text_colour(colour)) >= 4.5, colour
    spans = _spans(routed_tokens(RESULT, 3))
    assert [s.style["color"] for s in spans] == [text_colour(expert_colour(2)), text_colour(expert_colour(1))]
    chips = routed_tokens(RESULT, 3).children[3].children[1:]
    assert all(c.style["color"] == text_colour(c.style["backgroundColor"]) for c in chips)


def test_controls_start_from_the_url_then_the_probe():
    sample_probe = {"conversion_id": "conv-a", "params": {"kind": "routing", "sample_source": "builtin:code", "sample": 7}}
    text_probe = {"conversion_id": "conv-b", "params": {"kind": "routing", "text": "hello there"}}
    got = initial_controls({"layer": "2", "expert": "5"}, sample_probe, text_probe, default_a="conv-newest")
    assert got == {"a": "conv-a", "b": "conv-b", "source": "builtin:code", "sample": 7, "text": DEFAULT_TEXT, "layer": 2, "expert": 5}
    got = initial_controls({"a": "conv-x"}, text_probe, None, default_a="conv-newest")
    assert (got["a"], got["b"], got["source"], got["text"], got["layer"], got["expert"]) == ("conv-x", None, "text", "hello there", None, None)
    got = initial_controls({"source": "builtin:math", "sample": "3"}, None, None, "conv-newest")
    assert (got["a"], got["source"], got["sample"]) == ("conv-newest", "builtin:math", 3)
    assert initial_controls({"source": "nonsense"}, None, None)["source"] == "text"  # only the offered texts


def _rgb(hex_colour: str) -> str:
    h = hex_colour.lstrip("#")
    return "rgb({}, {}, {})".format(*(int(h[i:i + 2], 16) for i in (0, 2, 4)))


EW = {"n_experts": 4, "alpha_max": 0.5, "sparsity": 0.5}


@pytest.fixture(scope="module")
def conversion(api, profile_id) -> str:
    c = api.post("/conversions", json={"profile_id": profile_id, "expertweaver": EW}).json()
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
                          "getComputedStyle(s).backgroundColor, getComputedStyle(s).color])")
    assert [t for t, _, _, _ in shown] == result["tokens"]
    assert [int(e) for _, e, _, _ in shown] == [x[0] for x in lay["experts"]]  # best-scoring expert of every token
    assert [c for _, _, c, _ in shown] == [_rgb(expert_colour(x[0])) for x in lay["experts"]]
    assert [t for _, _, _, t in shown] == [_rgb(text_colour(expert_colour(x[0]))) for x in lay["experts"]]  # readable on it
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
def test_shared_url_opens_with_its_controls(page, live, api, conversion, profile_id):
    sampled = api.post("/probes", json={"conversion_id": conversion, "kind": "routing", "sample_source": "builtin:code", "sample": 3}).json()
    wait_job(api, sampled["job_id"])
    layer = [x["layer"] for x in api.get(f"/probes/{sampled['id']}/result").json()["layers"]][-1]
    page.goto(f"{live['ui']}/tokens?pa={sampled['id']}&layer={layer}&expert=1")  # a link with the probe and the view only
    page.wait_for_selector(f"text=layer {layer}, expert 1:")
    assert conversion in page.inner_text("#tk-a")  # the probe's conversion, not the newest one
    assert "held-out sample of builtin:code" in page.inner_text("#tk-source")
    assert page.input_value("#tk-sample") == "3"
    assert page.inner_text("#tk-layer").strip() == str(layer)
    assert page.input_value("#tk-expert") == "1"
    search = page.evaluate("() => location.search")
    assert "source=builtin%3Acode" in search and "sample=3" in search, search  # the URL now says which text it routed

    text = "print('a shared text')\nfor k in range(3): pass"
    typed = api.post("/probes", json={"conversion_id": conversion, "kind": "routing", "text": text}).json()
    wait_job(api, typed["job_id"])
    page.goto(f"{live['ui']}/tokens?a={conversion}&pa={typed['id']}&layer={layer}")
    page.wait_for_selector(".token-text .tok")
    assert page.input_value("#tk-text") == text  # the routed text, not the default one
    assert "type a text" in page.inner_text("#tk-source") and page.input_value("#tk-expert") == ""
    assert page.errors == [], page.errors

    # B, another conversion of the model (k-means seed 1): its experts named and coloured after A's matched ones
    other = api.post("/conversions", json={"profile_id": profile_id, "expertweaver": {**EW, "seed": 1}}).json()
    wait_job(api, other["job_id"])
    b_probe = api.post("/probes", json={"conversion_id": other["id"], "kind": "routing", "sample_source": "builtin:code", "sample": 3}).json()
    wait_job(api, b_probe["job_id"])
    page.goto(f"{live['ui']}/tokens?pa={sampled['id']}&pb={b_probe['id']}&layer={layer}")
    page.wait_for_selector("#tk-overlap .js-plotly-plot")
    entry = api.get(f"/conversions/{conversion}/matching/{other['id']}", params={"layer": layer}).json()["layers"][0]
    best = [x[0] for x in next(x for x in api.get(f"/probes/{b_probe['id']}/result").json()["layers"] if x["layer"] == layer)["experts"]]
    shown = page.evaluate("() => [...document.querySelectorAll('#tk-view > .col')[1].querySelectorAll('.token-text .tok')]"
                          ".map(s => [s.dataset.expert, getComputedStyle(s).backgroundColor])")
    colours = F.matched_colour_ids(entry)
    assert [(int(e), c) for e, c in shown] == [(e, _rgb(expert_colour(colours[e]))) for e in best]
    chips = page.locator("#tk-view > .col").nth(1).locator(".legend .chip").all_inner_texts()
    assert chips and all(c.startswith(F.matched_label(entry, "b", int(re.match(r"B e(\d+)", c).group(1)))) for c in chips), chips
    assert any("≙ A e" in c for c in chips), chips
    page.screenshot(path=str(ARTIFACTS / "token-routing-matched.png"), full_page=True)
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
