"""The UI in a real browser (Debian's Chromium via Playwright) against a live API, worker and
frontend with a tiny model: every page renders its figures without console errors, an α slider
redraws the allocation plan, Convert reaches 'succeeded', routing compares two sets.
Screenshots go to test-artifacts/."""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest

from moelab.engine.methods.dense2moe import choose_fusion

from .conftest import ARTIFACTS, wait_job

pytestmark = pytest.mark.slow

HAS_DATA = """id => { const g = document.querySelector('#' + CSS.escape(id) + ' .js-plotly-plot');
                      return !!(g && g.data && g.data.length > 0); }"""
DATA = """id => { const g = document.querySelector('#' + CSS.escape(id) + ' .js-plotly-plot');
                  return JSON.stringify({data: g.data, title: g.layout.title && g.layout.title.text}); }"""


FIRST_Y = """id => Array.from(document.querySelector('#' + CSS.escape(id) + ' .js-plotly-plot').data[0].y,
                               v => (v === null || v === undefined || Number.isNaN(v)) ? null : v)"""


def wait_figures(page, *ids: str, timeout: float = 30_000) -> None:
    for graph in ids:
        page.wait_for_function(HAS_DATA, arg=graph, timeout=timeout)


def figure(page, graph: str) -> dict:
    return json.loads(page.evaluate(DATA, graph))


def no_errors(page) -> None:
    assert not page.query_selector(".error"), page.inner_text(".error")
    assert page.errors == [], page.errors


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_pages_render_figures(page, live, profile_id):
    ui = live["ui"]
    page.goto(f"{ui}/")
    page.wait_for_selector(f"text={profile_id}")
    page.fill("#ws-samples", "6")
    page.click("#ws-add-set")
    page.wait_for_selector("#ws-created >> text=created cal-")
    shot(page, "workspace")
    # the Workspace lists every job of the live server, other modules' failed ones among them (in red, as it should):
    # an error on it is one of those jobs' reasons, never this action's
    failed = {j["error"] for j in httpx.get(f"{live['api']}/jobs", params={"state": "failed", "limit": 500}).json()["items"]}
    assert {e.inner_text() for e in page.query_selector_all(".error")} <= failed
    assert page.errors == [], page.errors

    page.goto(f"{ui}/neurons?profile={profile_id}&layer=9")  # API and UI errors are shown in words
    page.wait_for_selector(".error >> text=layer 9 does not exist")
    wait_figures(page, "nx-cv-layers", "nx-tasksim")  # a bad layer blanks only that layer's charts
    assert page.locator(".error").count() == 1 and page.errors == []

    page.goto(f"{ui}/neurons?profile={profile_id}&layer=1&order=cv&tau=0.5")
    wait_figures(page, "nx-cv-hist", "nx-cv-layers", "nx-act", "nx-tasksim", "nx-neuron", "nx-rates", "nx-hvals")
    assert "layer 1" in figure(page, "nx-cv-hist")["title"] and "order: cv" in figure(page, "nx-act")["title"]
    hist = page.evaluate("() => { const l = document.querySelector('#nx-cv-hist .js-plotly-plot').layout; "
                         "return {type: l.yaxis.type, tau: (l.shapes || []).map(s => s.x0), "
                         "log_cv: !!(l.xaxis.ticktext && l.xaxis.ticktext.length)}; }")
    # Counts on a log axis; τ drawn where the CV axis puts 0.5 (log-spaced bins sit on a log10 axis).
    assert hist["type"] == "log"
    assert hist["tau"] == [pytest.approx(math.log10(0.5) if hist["log_cv"] else 0.5)]
    first = figure(page, "nx-neuron")["title"]
    page.locator("#nx-act").scroll_into_view_if_needed()  # the map's middle can lie below the 1000-px viewport
    box = page.locator("#nx-act .nsewdrag").first.bounding_box()
    page.mouse.click(box["x"] + box["width"] * 0.8, box["y"] + box["height"] / 2)  # a neuron column far from column 0
    page.wait_for_function("""t => { const g = document.querySelector('#nx-neuron .js-plotly-plot');
                                     return g && g.layout.title && g.layout.title.text !== t; }""", arg=first)
    shot(page, "neurons")
    no_errors(page)

    # the tiny model has 3 layers: n* = 0 lets §2.3 choose it; the outline must be the engine's choice
    page.goto(f"{ui}/layers?profile={profile_id}&delta=0.5&n_fused=0")
    wait_figures(page, "ls-sl", "ls-sm")
    page.wait_for_selector("#ls-summary >> text=A Dense2MoE conversion")
    sim = httpx.get(f"{live['api']}/profiles/{profile_id}/charts/layer-similarity", params={"n_fused": 0}).json()
    expected = choose_fusion(np.array(sim["S_L"], dtype=float), np.array(sim["S_M"], dtype=float), 0.5, 8)
    lo, hi = expected.layer, expected.layer + expected.n_fused
    shapes = page.evaluate("""() => document.querySelector('#ls-sl .js-plotly-plot').layout.shapes
                                    .map(s => [s.name, s.x0, s.x1, s.y0, s.y1])""")
    assert ["fusion", lo - 0.5, hi + 0.5, lo - 0.5, hi + 0.5] in shapes
    assert f"(l* = {lo}, n* = {hi - lo};" in page.inner_text("#ls-summary")
    href = page.get_attribute("#ls-designer", "href")
    assert href == f"/designer?profile={profile_id}&method=dense2moe&delta=0.5&n_fused=0"
    shot(page, "layers")
    no_errors(page)
    page.click("#ls-designer")  # the designer opens on Dense2MoE with the same parameters and previews the same fusion
    page.wait_for_selector(f"#cd-summary >> text=fuse layers {list(range(lo + 1, hi + 1))} into layer {lo}")
    assert page.locator("#cd-method input[value=dense2moe]").is_checked()
    no_errors(page)

    page.goto(f"{ui}/calibration")
    wait_figures(page, "cs-tokens")
    page.wait_for_selector(".sample")
    # what the page proposes is the calibration that generalised best, and it says why
    assert page.inner_text("#cs-builtin").strip().startswith("mixed: equal parts of code, prose")
    assert page.input_value("#cs-samples") == "240" and "holds up across text" in page.inner_text("#cs-proposed")
    rows = "\n".join(json.dumps({"text": f"sample {i} about {t}", "task": t}) for i, t in enumerate(["cooking", "orbits"] * 3))
    page.set_input_files("#cs-upload input[type=file]", files=[{"name": "mine.jsonl", "mimeType": "application/json", "buffer": rows.encode()}])
    page.wait_for_selector("#cs-created >> text=uploaded cal-")
    shot(page, "calibration")
    no_errors(page)


def param(method: str, name: str) -> str:
    """CSS selector of a designer parameter control (Dash writes pattern-matching ids as sorted JSON)."""
    return f"""[id='{{"method":"{method}","name":"{name}","type":"cd-param"}}']"""


def test_alpha_slider_redraws_plan_and_convert_succeeds(page, live, profile_id):
    page.goto(f"{live['ui']}/designer?profile={profile_id}&n_experts=8&alpha_max=0.7&alpha_min=0.2")
    wait_figures(page, "cd-plan")
    before_raw = page.evaluate(DATA, "cd-plan")
    before = json.loads(before_raw)
    # the tiny random model's layers are all specialised (r_ℓ ≈ 0.9), so their α sits near α_min (EW Eq. 5)
    thumb = page.locator(f"{param('expertweaver', 'alpha_min')} [role=slider]").first
    thumb.focus()
    for _ in range(8):  # 0.2 → 0.6, one preview request per step
        page.keyboard.press("ArrowRight")
    page.wait_for_function("""before => { const g = document.querySelector('#cd-plan .js-plotly-plot');
                                           return JSON.stringify({data: g.data, title: g.layout.title && g.layout.title.text}) !== before; }""",
                           arg=before_raw)
    after = figure(page, "cd-plan")
    assert after["data"] != before["data"]
    page.wait_for_function("() => location.search.includes('alpha_min=0.6')")
    # the plan's predicted speed per phase, as the API predicts it from this machine's kernel times, slower phases named
    preview = httpx.get(f"{live['api']}/profiles/{profile_id}/preview/expertweaver",
                        params={"n_experts": 8, "alpha_max": 0.7, "alpha_min": 0.6}).json()["summary"]["predicted_speed"]
    page.wait_for_selector("#cd-speed")
    said = page.inner_text("#cd-speed")
    for phase, name in (("decode_b1", "decode b1"), ("decode_b8", "decode b8"), ("prefill", "prefill")):
        assert f"{name} {preview['phases'][phase]['speedup']:.2f}×" in said, (said, preview)
    slow = [p for p, v in preview["phases"].items() if v["speedup"] < 1]
    assert ("slower than dense in" in said) == bool(slow) and page.get_attribute("#cd-speed", "class") == ("slower" if slow else "note")
    assert preview["note"] in said and "this machine's" in preview["note"]  # the profile timed this machine's kernels
    shot(page, "designer")
    no_errors(page)

    page.goto(f"{live['ui']}/designer?profile={profile_id}&method=cmoe&n_experts=8&shared=2&active=2")  # CMoE S·A·E
    wait_figures(page, "cd-plan")
    assert page.input_value(param("cmoe", "shared")) == "2" and "active 50.0%" in figure(page, "cd-plan")["title"]
    # the panel offers exactly CMoE's parameters (from GET /methods): no EW slider it would ignore
    assert page.locator(param("cmoe", "tau")).count() == 0 and page.is_hidden(param("expertweaver", "tau"))
    page.fill(param("cmoe", "active"), "9")  # S + A > E: the API's 422 in words
    page.wait_for_selector(".error >> text=exceeds the 8 experts")
    page.errors.clear()  # the browser logs the 422 response itself
    page.fill(param("cmoe", "active"), "2")
    page.wait_for_function("() => !document.querySelector('.error')")

    page.click("#cd-convert")
    page.wait_for_selector("#cd-job >> text=succeeded", timeout=120_000)
    page.wait_for_selector("#cd-result-card")
    page.click("#cd-evaluate")
    page.wait_for_selector("#cd-job >> text=evaluation", timeout=10_000)
    page.wait_for_selector("#cd-job >> text=succeeded", timeout=120_000)
    wait_figures(page, "cd-ppl", "cd-recon")
    assert {t["name"] for t in figure(page, "cd-ppl")["data"]} >= {"dense", "converted"}
    shot(page, "designer-converted")
    no_errors(page)


def test_routing_compares_two_sets_and_compare_page(page, live, api, evaluated, profile_id):
    conversion, (a, b) = evaluated
    page.goto(f"{live['ui']}/routing?conversion={conversion}&a={a}&b={b}")
    wait_figures(page, "rx-heat-a", "rx-heat-b", "rx-diff", "rx-js", "rx-loadcv")
    assert "builtin:code" in figure(page, "rx-heat-a")["title"] and "builtin:prose" in figure(page, "rx-heat-b")["title"]
    assert len(figure(page, "rx-loadcv")["data"]) == 2
    # the JS line has a value for every layer with routed experts (padding cells of narrower layers no longer blank it)
    heat = api.get(f"/conversions/{conversion}/charts/routing", params={"evaluation_id": [a, b]}).json()
    routed = np.isfinite(np.array(heat["counts"][0], dtype=float)).sum(axis=-1)
    js = np.array(page.evaluate(FIRST_Y, "rx-js"), dtype=float)
    assert len(js) == len(heat["layers"]) and np.isfinite(js[routed >= 1]).all() and np.isnan(js[routed == 0]).all(), (js, routed)
    # a layer without routed experts is a gap in both lines, as plotted (not joined across it)
    assert page.evaluate("""() => ['rx-js', 'rx-loadcv'].every(id =>
        document.querySelector('#' + id + ' .js-plotly-plot')._fullData.every(t => t.connectgaps === false))""")
    assert "2 windows × 32 tokens" in figure(page, "rx-heat-a")["title"]  # the set says its size
    shot(page, "routing")
    no_errors(page)

    with page.expect_download() as dl:
        page.click("""[id='{"name":"rx-js","type":"csv-btn"}']""")
    assert dl.value.suggested_filename.endswith(".csv")

    ids = [c["id"] for c in api.get("/conversions").json()["items"] if c["status"] == "ready"]
    assert conversion in ids  # and the designer test's conversion when the whole module runs
    page.goto(f"{live['ui']}/compare?ids={','.join(ids)}")
    wait_figures(page, "cc-ppl", "cc-active")
    assert page.locator("#cc-table tr").count() == len(ids) + 1 and len(figure(page, "cc-active")["data"]) == len(ids)
    # two sets evaluated on one conversion: two panels, never one bar summing both; values and × dense on the bars
    panels = page.evaluate("() => document.querySelector('#cc-ppl .js-plotly-plot').layout.annotations.map(a => a.text)")
    assert {"builtin:code · 2 windows × 32 tokens = 64 tokens", "builtin:prose · 2 windows × 32 tokens = 64 tokens"} <= set(panels)
    for trace in figure(page, "cc-ppl")["data"]:
        assert len({c[0] for c in trace["customdata"]}) == 1, trace  # one text per trace (and per panel)
        if trace["name"] == "converted":
            assert all("× dense, 95% CI " in t for t in trace["text"])  # each ratio with its interval over windows
            assert len(trace["error_y"]["array"]) == len(trace["y"])  # error bars: the perplexity's interval
    assert "expertweaver · 8 experts" in page.inner_text("#cc-table")  # a name, not only the id
    # the experts columns say each conversion's per-layer counts (an ExpertWeaver conversion has no S/A parameters)
    headers = page.locator("#cc-table th").all_inner_texts()
    row = page.locator("#cc-table tr", has=page.locator(f"td:text-is('{conversion}')"))
    cells = dict(zip(headers, row.locator("td").all_inner_texts()))
    layers = api.get(f"/conversions/{conversion}").json()["layers"]
    shared, topk = sorted({r["n_shared"] for r in layers}), sorted({r["top_k"] for r in layers})
    assert cells["shared experts / layer"] == (str(shared[0]) if len(shared) == 1 else f"{shared[0]}–{shared[-1]}")
    assert cells["routed top-k / layer"] == (str(topk[0]) if len(topk) == 1 else f"{topk[0]}–{topk[-1]}")
    shot(page, "compare")
    no_errors(page)

    # another conversion of the model (k-means seed 1), evaluated on set A's text: its experts matched to these
    other = api.post("/conversions", json={"profile_id": profile_id, "expertweaver": {"n_experts": 8, "alpha_max": 0.5, "seed": 1}}).json()
    wait_job(api, other["job_id"])
    e = api.post("/evaluations", json={"conversion_id": other["id"], "source": "builtin:code", "n_windows": 2, "seq_len": 32,
                                       "baselines": False, "multiple_choice_per_task": 0}).json()
    wait_job(api, e["job_id"])
    page.goto(f"{live['ui']}/routing?conversion={conversion}&a={a}&b={b}&match={other['id']}")
    wait_figures(page, "rx-match-map", "rx-match-b")
    matching = api.get(f"/conversions/{conversion}/matching/{other['id']}").json()
    cells = figure(page, "rx-match-map")["data"][0]["text"]
    width = max(m["n_a"] for m in matching["layers"])  # layers with fewer experts are padded with blank cells
    assert cells == [[f"B e{x['match']}" if x["match"] is not None else "–" for x in m["a"]] + [""] * (width - m["n_a"])
                     for m in matching["layers"]]
    hover = [h for row in figure(page, "rx-match-b")["data"][0]["customdata"] for h in row if h]
    assert hover and all(" ≙ A e" in h or "unmatched" in h for h in hover), hover
    assert "at A's expert ids" in figure(page, "rx-match-b")["title"]
    shot(page, "routing-matched")
    no_errors(page)

    # an evaluation started from the routing explorer is cancelled from there (a tiny one may finish first: said so)
    page.goto(f"{live['ui']}/routing?conversion={conversion}&a={a}&b={b}")
    page.click("#rx-evaluate")
    page.wait_for_selector("#rx-job .job-label")
    page.click("#rx-cancel")
    page.wait_for_function("() => /cancel/.test(document.querySelector('#rx-job').innerText)", timeout=60_000)
