"""The neuron card in a real browser: a click on the neuron × task map opens one neuron's card
whose highlighted snippet tokens carry the API's values for that neuron; typing a neuron index
fetches only the card. Screenshot: test-artifacts/neuron-card.png."""

from __future__ import annotations

import json
import re

import pytest

from frontend import figures as F
from frontend.names import fmt, fmt_pct

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
    stats = page.inner_text("#nx-card-stats")
    assert f"CV {fmt(card['cv'])} across tasks" in stats
    # each number names its quantity: the rate is a rank among the layer's neurons (a 0% rate beside a large mean is
    # then no contradiction), the mean is the gate's, and the snippets show h
    assert f"among a token's top-K |h| on {fmt_pct(card['rate'])} of tokens (activation rate, ATopK" in stats
    assert f"mean gate activation act(x·W_gate) {fmt(card['mean'])}" in stats and "snippets show h = act(x·W_gate)·(x·W_up)" in stats

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


def test_without_note_takes_the_note_out_of_the_title():
    fig = F.binned_histogram([0, 1, 2], [3, 4], "h values, layer 1", "h", "values", "2 below and 5 above the range not shown")
    bare, note = F.without_note(fig)
    assert bare.layout.title.text == "h values, layer 1" and note == "2 below and 5 above the range not shown"
    assert fig.layout.title.text == "h values, layer 1<br><sup>2 below and 5 above the range not shown</sup>"  # the input is left as it was
    assert bare.layout.margin.t < fig.layout.margin.t and list(bare.data[0].y) == [3, 4]
    assert F.without_note(F.binned_histogram([0, 1], [1], "t", "x", "n"))[1] == ""


FITS = "sel => { const el = document.querySelector(sel); return [el.scrollWidth, el.clientWidth, el.value]; }"
NOTE = """name => { const el = document.getElementById(JSON.stringify({name: name, type: 'note'}));
                   return {text: el.innerText, scroll: el.scrollWidth, client: el.clientWidth}; }"""
TITLES = """() => Array.from(document.querySelectorAll('.js-plotly-plot'), g => {
    const t = g.querySelector('.gtitle'), box = g.getBoundingClientRect(), tb = t ? t.getBoundingClientRect() : null;
    return {id: g.parentElement.id || g.closest('[id]').id, text: t ? t.textContent : '',
            inside: !tb || (tb.left >= box.left - 1 && tb.right <= box.right + 1)}; })"""


def test_index_boxes_hold_their_values_and_subtitles_wrap(page, live, api, profile_id):
    page.set_viewport_size({"width": 1100, "height": 1000})  # two figure cards a row, ~530 px each: where long notes were cut
    page.goto(f"{live['ui']}/neurons?profile={profile_id}&layer=1&neuron=1160")
    wait_figures(page, "nx-cv-hist", "nx-cv-layers", "nx-rates", "nx-hvals", "nx-tasksim")

    # a 4-digit neuron and a 3-digit layer are shown whole (no "116" for 1160, no "l5" for 15)
    scroll, client, value = page.evaluate(FITS, "#nx-neuron-index")
    assert value == "1160" and scroll <= client, (scroll, client)
    page.fill("#nx-layer", "115")
    scroll, client, value = page.evaluate(FITS, "#nx-layer")
    assert value == "115" and scroll <= client, (scroll, client)
    # the check sees clipping: the box as wide as before the fix (Dash's − / + buttons beside the digits) scrolls
    squeezed = page.evaluate("() => { const el = document.querySelector('#nx-neuron-index'), box = el.parentElement, w = box.style.width; "
                             "box.style.width = '105px'; const r = [el.scrollWidth, el.clientWidth]; box.style.width = w; return r; }")
    assert squeezed[0] > squeezed[1], squeezed

    page.goto(f"{live['ui']}/neurons?profile={profile_id}&layer=1&tau=0.6")
    wait_figures(page, "nx-cv-hist", "nx-cv-layers", "nx-rates", "nx-hvals", "nx-tasksim")
    page.wait_for_function("() => document.getElementById(JSON.stringify({name: 'nx-cv-hist', type: 'note'})).innerText.length > 0")
    hist = api.get(f"/profiles/{profile_id}/charts/cv-histogram").json()
    stats = api.get(f"/profiles/{profile_id}/charts/neuron-stats", params={"layer": 1}).json()
    sim = api.get(f"/profiles/{profile_id}/charts/task-similarity").json()
    basis = api.get(f"/profiles/{profile_id}").json()["summary"]["cv_basis"]
    expected = {"nx-cv-hist": [f"{hist['n_neurons'][1]} neurons", "right of τ: specialised neurons (r_ℓ, EW Eq. 4)"],
                "nx-cv-layers": ["whiskers: 5 % and 95 % quantiles"],
                "nx-rates": [f"{stats['n_neurons']} neurons, mean rate {stats['rate_mean']:.3g}"],
                "nx-hvals": [f"{stats['h_below']} below and {stats['h_above']} above the range not shown"],
                "nx-tasksim": [f"{len(sim['labels'])} {basis}s; {'centred per neuron' if sim.get('centered') else 'raw'}"]}
    for name, parts in expected.items():
        note = page.evaluate(NOTE, name)
        assert all(part in note["text"] for part in parts), (name, note, parts)  # the whole note, said in the page
        assert note["scroll"] <= note["client"], (name, note)  # wrapped to the card, not cut
    for t in page.evaluate(TITLES):  # the plot titles left hold the title alone, inside their plot
        assert t["inside"], t
        assert "neurons;" not in t["text"] and "quantiles" not in t["text"], t
    shot(page, "neuron-subtitles")
    no_errors(page)
