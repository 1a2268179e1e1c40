"""The neuron card in a real browser: a click on the neuron × task map opens one neuron's card
whose highlighted snippet tokens carry the API's values for that neuron; typing a neuron index
fetches only the card. Screenshot: test-artifacts/neuron-card.png."""

from __future__ import annotations

import json
import re

import pytest

from frontend.names import fmt

from .test_browser import no_errors, shot, wait_figures

pytestmark = pytest.mark.slow

TITLE_IS = "t => document.querySelector('#nx-card-title').innerText === t"
CENTRES = """() => Array.from(document.querySelectorAll('#nx-snippets .tok.centre'),
                              s => ({text: s.innerText, title: s.title, value: s.dataset.value, bg: s.style.backgroundColor}))"""


def test_click_opens_one_neuron_card_with_highlighted_tokens(page, live, api, profile_id):
    page.goto(f"{live['ui']}/neurons?profile={profile_id}&layer=1&order=cv")
    wait_figures(page, "nx-act", "nx-neuron")
    page.wait_for_function(TITLE_IS, arg="layer 1 · neuron 0")
    page.locator("#nx-act").scroll_into_view_if_needed()
    box = page.locator("#nx-act .nsewdrag").first.bounding_box()
    page.mouse.click(box["x"] + box["width"] * 0.8, box["y"] + box["height"] / 2)
    page.wait_for_function("() => /[?&]neuron=[1-9]/.test(location.search)")
    neuron = int(re.search(r"[?&]neuron=(\d+)", page.evaluate("() => location.search")).group(1))
    tiles = api.get(f"/profiles/{profile_id}/charts/activations", params={"layer": 1, "order": "cv", "max_cols": 4096}).json()
    assert tiles["neurons_per_column"] == 1 and neuron in tiles["column_first_neuron"]  # one neuron per column
    page.wait_for_function(TITLE_IS, arg=f"layer 1 · neuron {neuron}")
    assert "averaged" not in page.inner_text("#nx-card")
    card = api.get(f"/profiles/{profile_id}/neurons/1/{neuron}").json()
    assert f"CV {fmt(card['cv'])} across tasks" in page.inner_text("#nx-card-stats")

    page.wait_for_selector("#nx-snippets .tok.centre")
    centres = page.evaluate(CENTRES)
    assert len(centres) == len(card["top"]) == 8
    for shown, top in zip(centres, card["top"], strict=True):
        piece = next(t["piece"] for t in top["snippet"] if t["top"])
        assert shown["text"] == piece.replace("\n", "⏎ ")  # the highlighted token is the top token's text
        assert float(shown["value"]) == top["value"]  # the API's h for this neuron
        assert f"layer 1 · neuron {neuron}: h = {fmt(top['value'])}" in shown["title"]
        assert shown["bg"].startswith("rgba(220, 38, 38" if top["value"] >= 0 else "rgba(37, 99, 235")
    assert f"· {card['top'][0]['task']}" in page.inner_text("#nx-snippets .snippet-head >> nth=0")
    shot(page, "neuron-card")
    no_errors(page)

    # typing a neuron index fetches the card only (and the URL): no map, histogram or similarity refetch
    fired: list[str] = []
    page.on("request", lambda r: fired.append(json.loads(r.post_data)["output"]) if "_dash-update-component" in r.url else None)
    page.fill("#nx-neuron-index", "3")
    page.press("#nx-neuron-index", "Enter")
    page.wait_for_function(TITLE_IS, arg="layer 1 · neuron 3")
    page.wait_for_function("() => location.search.includes('neuron=3')")
    assert fired and all(o.startswith(("..nx-card-title.", "nx-url.")) for o in fired), fired
    no_errors(page)
