"""Compare profiles in a real browser against the live service: two synthetic profiles of one model
(``tests.engine.synthetic_profiles``: a neuron planted on the code text, another on the prose) are
published where the service keeps profiles, with their rows in its database. The page's top specific
neuron of each side is the planted one, linked to its card, and a token search finds the planted neuron
and opens its card in the Neuron explorer. Screenshot: test-artifacts/profile-compare.png."""

from __future__ import annotations

from datetime import datetime

import pytest

from tests.engine.synthetic_profiles import CODE_NEURON, PROSE_NEURON, code_and_prose

from .test_browser import figure, no_errors, shot, wait_figures

pytestmark = pytest.mark.slow

IDS = {"code": "pr-c0de0000000000b1", "prose": "pr-b00c0000000000b2"}
SETS = {"code": ("cal-c0de0000000000b1", "code words"), "prose": ("cal-b00c0000000000b2", "prose words")}
MODEL = "mod-5e0000000000000b"
FIRST_ROW = "sel => { const a = document.querySelector(sel + ' tr td a.neuron-link'); return a ? [a.innerText, a.getAttribute('href')] : null; }"


@pytest.fixture(scope="module")
def pair(live, api, service_config, tmp_path_factory):
    """Two ready synthetic profiles in the live service (rows dated 2000 so no other page picks them as
    the newest); deleted through the API afterwards."""
    from moelab.settings import Settings
    from moelab.store.artifacts import ArtifactStore
    from moelab.store.db import CalibrationSet, Database, Model, Profile

    settings = Settings(_env_file=None, api_token=None, **service_config)
    db, store = Database(settings.resolved_database_url()), ArtifactStore(settings.resolved_artifacts_dir())
    made = dict(zip(("code", "prose"), code_and_prose(tmp_path_factory.mktemp("compare-browser")), strict=True))
    old = datetime(2000, 1, 1)
    with db.session() as s:
        s.add(Model(id=MODEL, name="tiny synthetic GLU", source="synthetic/tiny-glu", kind="hf", params={}, created_at=old))
        for name, (set_id, set_name) in SETS.items():
            s.add(CalibrationSet(id=set_id, name=set_name, origin="builtin", params={}, created_at=old))
        s.flush()
        for name, ident in IDS.items():
            s.add(Profile(id=ident, model_id=MODEL, calibration_set_id=SETS[name][0], params={}, created_at=old,
                          summary={"n_layers": 3, "cv_basis": "task", "d_ffn": [48] * 3}))
            made[name].rename(store.path("profiles", ident))
    yield IDS
    for kind, ident in [("profiles", i) for i in IDS.values()] + [("calibration-sets", s[0]) for s in SETS.values()] + [("models", MODEL)]:
        api.delete(f"/{kind}/{ident}")
    db.dispose()


def test_compare_page_shows_the_planted_neurons_and_search_opens_their_card(page, live, api, pair):
    a, b = pair["code"], pair["prose"]
    page.goto(f"{live['ui']}/profiles/compare?a={a}&b={b}")
    wait_figures(page, "pc-scatter", "pc-shares")
    page.wait_for_selector("#pc-top-a tr.specific-a")
    body = api.get("/profiles/compare", params={"a": a, "b": b, "top": 10}).json()

    text, href = page.evaluate(FIRST_ROW, "#pc-top-a")
    assert text == "layer {} · neuron {}".format(*CODE_NEURON) == f"layer {body['top_a'][0]['layer']} · neuron {body['top_a'][0]['neuron']}"
    assert href == f"/neurons?profile={a}&layer={CODE_NEURON[0]}&neuron={CODE_NEURON[1]}"
    text, href = page.evaluate(FIRST_ROW, "#pc-top-b")
    assert text == "layer {} · neuron {}".format(*PROSE_NEURON) and href.startswith(f"/neurons?profile={b}&")
    assert "Most specific to A: code words" in page.inner_text("#pc-top-a-title")
    heads = page.evaluate("() => Array.from(document.querySelectorAll('#pc-top-a th'), h => [h.innerText, h.title])")
    assert heads[3] == ["mean gate act. A", "mean over A's samples of act(x·W_gate), the quantity d compares"], heads
    assert heads[5][0] == "top-K rate A" and heads[7] == ["top tokens in A (h)", "its strongest tokens in A's text, coloured by h = act(x·W_gate)·(x·W_up)"]
    assert "' def'" not in page.inner_text("#pc-top-b") and " def" in page.inner_text("#pc-top-a tr.specific-a >> nth=0")

    scatter = figure(page, "pc-scatter")
    assert f"Layer {body['layer']}" in scatter["title"]
    shown = page.evaluate("() => { const l = document.querySelector('#pc-scatter .js-plotly-plot').layout; "
                          "return [l.xaxis.title.text, l.yaxis.title.text]; }")
    assert shown == ["mean gate activation on A: code words", "mean gate activation on B: prose words"]
    colours = page.evaluate("() => Array.from(document.querySelector('#pc-scatter .js-plotly-plot')._fullData[0].marker.color)")
    assert colours == pytest.approx(body["scatter"]["specificity"], rel=1e-5)  # each neuron coloured by its d
    # the shares chart says what the significance test kept, at the rate asked for, as the API counts it
    kept = sum(r["n_specific_a"] + r["n_specific_b"] for r in body["layers"])
    large = sum(r["n_large_a"] + r["n_large_b"] for r in body["layers"])
    assert f"false-discovery rate q ≤ 0.05 (Benjamini–Hochberg over every neuron): {kept} of the {large} neurons" in \
        page.inner_text("""[id='{"name":"pc-shares","type":"note"}']""")
    assert page.input_value("#pc-fdr") == "0.05"
    shot(page, "profile-compare")
    no_errors(page)

    page.fill("#pc-s-token", "def")
    page.press("#pc-s-token", "Enter")
    page.wait_for_selector("#pc-s-results tr td a.neuron-link")
    assert page.inner_text("#pc-s-results").startswith("1 neuron matches")  # the whole token 'def', nothing containing it
    page.click("#pc-s-results tr td a.neuron-link")
    page.wait_for_function("t => document.querySelector('#nx-card-title') && document.querySelector('#nx-card-title').innerText === t",
                           arg="layer {} · neuron {}".format(*CODE_NEURON))
    assert f"profile={a}" in page.evaluate("() => location.search")
    page.wait_for_selector("#nx-snippets .tok.centre")
    assert page.inner_text("#nx-snippets .tok.centre >> nth=0").strip() == "def"
