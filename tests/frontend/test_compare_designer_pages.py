"""What the Compare, Designer and Calibration pages *say*: labels, values, units, widths.

Unit tests check the pure pieces (figure builders, parameter steps and bounds, units, notes);
browser tests (Debian's Chromium against a live ``moelab serve`` with the tiny model) check the
pages themselves against the API: the quality-vs-cost labels name the calibration set and are not
cut, its CSV is exactly the points shown, perplexity tick labels stay out of the next panel, the
page fits a 1024-px window; τ steps by 0.05 and a refused value shows its bound; the recipe starts
at 'paper' or the URL's; a budget plan's preview says what it cannot show; the result card gives
each timing its unit, one line per distinct note, and a failed evaluation's error with Evaluate
enabled; the calibration card plots characters and says so."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest

import frontend.app  # noqa: F401  (instantiates the Dash app: the page modules register with it)
from frontend import figures as F
from frontend.names import Names
from frontend.names import calibration_of, chart_label, recipe_of
from frontend.pages.designer import (
    bound_text,
    budget_banner,
    collapse_notes,
    fmt_measure,
    initial_recipe,
    initial_values,
    param_bounds,
    param_problem,
    param_step,
    planned_top_k,
)
from moelab.engine.methods import describe_methods

from .conftest import ARTIFACTS, wait_job

HAS_DATA = """id => { const g = document.querySelector('#' + CSS.escape(id) + ' .js-plotly-plot');
                      return !!(g && g.data && g.data.length > 0); }"""
FIGURE = """id => { const g = document.querySelector('#' + CSS.escape(id) + ' .js-plotly-plot');
                    return JSON.stringify({data: g.data, layout: g.layout}); }"""
Y = """([id, i]) => { const y = document.querySelector('#' + CSS.escape(id) + ' .js-plotly-plot').data[i].y;
                     return Array.from(y._inputArray || y); }"""  # a numpy column arrives base64-encoded (bdata)


def _methods() -> list[dict]:
    return json.loads(json.dumps(describe_methods()))


def _method(name: str) -> dict:
    return next(m for m in _methods() if m["name"] == name)


def _spec(method: str, name: str) -> dict:
    return next(p for p in _method(method)["params"] if p["name"] == name)


# --------------------------------------------------------------------------- designer: steps, bounds, units (unit tests)


def test_tau_steps_by_005_above_its_strict_bound_of_0():
    tau = _spec("expertweaver", "tau")
    assert tau["gt"] == 0 and tau["ge"] is None  # the engine's bound (ExpertWeaverParams.tau)
    assert param_step(tau) == 0.05 and param_bounds(tau) == (0.05, None)
    assert bound_text(tau) == "> 0"
    assert param_problem(tau, 0) == "tau = 0 is out of bounds: it must be > 0"
    assert param_problem(tau, None) == "tau: enter a number > 0, in steps of 0.05"  # what the box hands over for an invalid entry
    assert param_problem(tau, 0.63) is None and param_problem(tau, 3) is None


def test_every_numeric_parameter_steps_sensibly_within_its_bounds():
    for m in _methods():
        for p in m["params"]:
            if p["type"] not in ("int", "float") or p["choices"]:
                continue
            step, (lo, hi) = param_step(p), param_bounds(p)
            if p["type"] == "int":
                assert step == 1, p
                continue
            lo_b = p["ge"] if p["ge"] is not None else p["gt"]
            hi_b = p["le"] if p["le"] is not None else p["lt"]
            if lo_b is not None and hi_b is not None and hi_b - lo_b <= 2:
                assert step in (0.05, 0.01), p  # a share in [0, 1] (or δ in (0, 2]): 5-point steps
            else:
                assert 0 < step <= abs(p["default"] or 1) / 5, p  # τ 0.6: 0.05, never 1
            # the stepper's ends are values the engine accepts: a strict bound lies one step inside
            if p["gt"] is not None:
                assert lo == pytest.approx(p["gt"] + step) and param_problem(p, lo) is None, p
            if p["lt"] is not None:
                assert hi == pytest.approx(p["lt"] - step) and param_problem(p, hi) is None, p
            assert param_problem(p, p["default"]) is None, p


def test_recipe_starts_at_paper_or_the_urls_and_the_url_values_win():
    ew = _method("expertweaver")
    assert initial_recipe(ew, {}) == "paper" and initial_recipe(ew, {"recipe": "best"}) == "best"
    assert initial_recipe(ew, {"recipe": "nonsense"}) == "paper" and initial_recipe(_method("cmoe"), {}) is None  # cmoe: one recipe
    best = initial_values(ew, {"recipe": "best", "sparsity": "0.5"})
    assert (best["router"], best["plan"], best["alpha_basis"], best["compensation"]) == ("ridge", "budget", "active", "skipped_mean")
    assert best["sparsity"] == 0.5 and best["tau"] == 0.6
    assert initial_values(ew, {"recipe": "best", "router": "centroid"})["router"] == "centroid"
    assert initial_values(ew, {})["router"] == "centroid"


def test_timings_and_memory_carry_their_own_units():
    shown = [fmt_measure(k, v) for k, v in {"total_s": 6.2427, "peak_rss_mib": 1667.703, "max_memory_bytes": 2 * 2**30,
                                              "seconds_per_layer": 0.1, "n_tokens": 12}.items()]
    assert shown == ["total 6.24 s", "peak rss 1,667.7 MiB", "max memory 2.00 GiB", "seconds per layer 0.10 s", "n tokens 12"]
    assert not any("MiB s" in s or "GiB s" in s for s in shown)


def test_a_budget_plans_top_k_says_dense_where_the_plan_kept_the_dense_ffn():
    layers = [{"n_routed": 0, "top_k": 0, "d_shared": 1536}, {"n_routed": 84, "top_k": 54}, {"n_routed": 84, "top_k": 0}]
    assert planned_top_k(layers) == "dense, 54/84, 0/84"


def test_identical_per_layer_notes_collapse_into_one_line():
    notes = [{"layer": i, "note": "budget plan: top-k chosen by calibration error"} for i in range(30)]
    notes += [{"layer": 4, "note": "clamped"}, {"layer": 9, "note": "clamped"}]
    assert collapse_notes(notes) == ["layers 0–29 (30 layers): budget plan: top-k chosen by calibration error",
                                     "layers 4, 9 (2 layers): clamped"]
    assert collapse_notes([{"layer": 3, "note": "static"}]) == ["layer 3: static"]


PREVIEW = {"params": {"plan": "budget", "sparsity": 0.25, "router": "ridge", "alpha_basis": "active", "compensation": "skipped_mean"},
           "layers": [{"layer": i, "d_shared": 12, "top_k": 5, "d_expert": 12, "d_ffn": 96, "r": 0.9} for i in range(3)],
           "summary": {"active_fraction": 0.75, "ffn_flops_fraction": 0.7747}}


def test_a_budget_plan_preview_says_it_is_the_starting_plan_and_the_cap():
    text = budget_banner(PREVIEW)
    assert "per-layer top-k is fitted on calibration tokens at conversion" in text and "starting plan" in text
    assert "router ridge, alpha_basis active, compensation skipped_mean" in text and "ffn_flops_fraction ≤ 0.75 (1 − sparsity)" in text
    fig = F.allocation_plan(PREVIEW)
    assert fig.layout.title.text.startswith("Starting plan of the budget plan: per-layer top-k is fitted at conversion")
    assert budget_banner({**PREVIEW, "params": {**PREVIEW["params"], "plan": "paper"}}) is None
    assert "(EW Fig. 7)" in F.allocation_plan({**PREVIEW, "params": {"plan": "paper"}}).layout.title.text
    cmoe = {**PREVIEW, "params": {"plan": "budget", "router": "ridge"}}  # CMoE: capped at the paper plan's own cost
    assert "ffn_flops_fraction ≤ 0.775 (the paper plan's cost)" in budget_banner(cmoe)


# --------------------------------------------------------------------------- compare: labels, CSV rows, layout (unit tests)


NAMES = Names.from_lists([{"id": "m", "name": "llama"}], [{"id": "s1", "name": "code"}, {"id": "s2", "name": "literature"}],
                         [{"id": "p1", "model_id": "m", "calibration_set_id": "s1"}, {"id": "p2", "model_id": "m", "calibration_set_id": "s2"}])
BEST = {"router": "ridge", "alpha_basis": "active", "plan": "budget", "compensation": "skipped_mean", "down_keep": 0.5,
        "max_routed_share": 0.65, "speed_guard": "machine", "speed_margin": 0.05}


def test_chart_labels_name_the_calibration_set_method_and_recipe():
    methods = {m["name"]: m for m in _methods()}
    a = {"id": "c1", "profile_id": "p1", "method": "expertweaver", "params": {"n_experts": 8, "router": "centroid", "plan": "paper"}}
    b = {"id": "c2", "profile_id": "p2", "method": "expertweaver", "params": {"n_experts": 8, **BEST}}
    c = {"id": "c3", "profile_id": "p2", "method": "expertweaver", "params": {"n_experts": 8, "router": "ridge"}}
    d = {"id": "c4", "profile_id": "p1", "method": "cmoe", "params": {"shared": 1, "active": 2, "n_experts": 8},
         "label": "S1·A2·E8"}
    assert chart_label(a, NAMES, methods) == ("code · expertweaver paper", "paper")
    assert chart_label(b, NAMES, methods) == ("literature · expertweaver best", "best")
    assert chart_label(c, NAMES, methods) == ("literature · expertweaver own recipe", None)
    before_cap = {**b, "params": {**b["params"], "max_routed_share": 1.0}}  # the recipe before its routed-share cap
    assert chart_label(before_cap, NAMES, methods) == ("literature · expertweaver own recipe", None)
    assert chart_label(d, NAMES, methods) == ("code · cmoe S1·A2·E8", None)
    assert calibration_of({"params": {"calibration": "builtin:mixed"}}, NAMES) == "builtin:mixed"
    assert recipe_of(methods["expertweaver"], {"router": "centroid"}) == "paper"


def _points() -> list[dict]:
    return [{"conversion_id": "c1", "conversion": "llama · code · expertweaver · 8 experts", "label": "code · expertweaver paper",
             "calibration_set": "code", "method": "expertweaver", "recipe": "paper", "text": "builtin:code · 2 × 32", "evaluation_id": "e1",
             "ffn_flops_fraction": 0.771, "perplexity_ratio": 1.0012},
            {"conversion_id": "c2", "conversion": "llama · literature · expertweaver · 8 experts", "label": "literature · expertweaver paper",
             "calibration_set": "literature", "method": "expertweaver", "recipe": "paper", "text": "builtin:code · 2 × 32",
             "evaluation_id": "e2", "ffn_flops_fraction": 0.771, "perplexity_ratio": 1.0009},
            {"conversion_id": "c3", "conversion": "x", "label": "code · expertweaver best", "calibration_set": "code", "method": "expertweaver",
             "recipe": "best", "text": "builtin:code · 2 × 32", "evaluation_id": "e3", "ffn_flops_fraction": None, "perplexity_ratio": 2.0}]


def test_quality_vs_cost_labels_are_distinct_full_and_inside_the_padded_ranges():
    fig = F.quality_vs_cost(_points())
    (trace,) = fig.data
    assert list(trace.text) == ["code · expertweaver paper", "literature · expertweaver paper"]  # the set tells them apart
    assert [c[0] for c in trace.customdata] == ["llama · code · expertweaver · 8 experts", "llama · literature · expertweaver · 8 experts"]
    assert trace.cliponaxis is False
    # two points at the same place: their labels in different slots, never on top of each other
    assert len(set(trace.textposition)) == 2
    x0, x1 = fig.layout.xaxis.range
    assert x0 < 0.771 - 0.04 and x1 > 0.771 + 0.04  # room on both sides of the points for their labels
    y0, y1 = fig.layout.yaxis.range  # log10 units
    assert y0 < 0 < math.log10(1.0012) < y1
    rows = F.quality_cost_points(_points())
    assert [r["conversion_id"] for r in rows] == ["c1", "c2"]  # the CSV: exactly the drawn points (no unrecorded cost)
    assert list(rows[0]) == list(F.QUALITY_COST_COLUMNS)


def test_perplexity_tick_labels_are_horizontal_and_the_gap_holds_them():
    long = "llama · literature · expertweaver · 64 experts, α 0.2–0.7, τ 0.6, sparsity 25%, ridge router, budget plan"
    rows = [{"text": t, "text_key": t, "conversion": long if c == "c1" else "code · expertweaver paper", "conversion_id": c,
             "evaluation_id": "e", "variant": v, "perplexity": 10.0, "ratio_to_dense": 1.0}
            for t in ("A", "B") for c in ("c1", "c2") for v in ("dense", "converted")]
    fig = F.compare_perplexity(rows)
    ticks = {x for t in fig.data for x in t.x}
    assert all(fig.layout[f"xaxis{i}"].tickangle == 0 for i in ("", "2"))  # never rotated into the next panel
    width = max(12, min(32, 64 // 2))
    for tick in ticks:
        lines = [re.sub("<[^>]+>", "", line) for line in tick.split("<br>")]
        assert all(len(line) <= width or " " not in line for line in lines), tick
    lines = max(t.count("<br>") + 1 for t in ticks)
    # pixels between panel 1's plot bottom and panel 2's top hold every label line and the next title
    plot_px = fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
    gap_px = (fig.layout.yaxis.domain[0] - fig.layout.yaxis2.domain[1]) * plot_px
    assert gap_px >= F.TICK_LINE_PX * lines + 40
    assert fig.layout.margin.b >= F.TICK_LINE_PX * lines  # and below the last panel


# --------------------------------------------------------------------------- calibration: characters, said as such (unit test)


def test_calibration_sizes_are_characters_unless_tokens_were_counted():
    stats = {"tasks": {"code": {"samples": 2, "chars": 120}}, "domains": {"ast": {"samples": 1, "chars": 70}, "os": {"samples": 1, "chars": 50}}}
    fig = F.calibration_sizes(stats)
    assert fig.layout.title.text.startswith("Characters by task and domain") and fig.layout.yaxis.title.text == "characters"
    assert [list(t.y) for t in fig.data] == [[120], [70, 50]]
    tokens = {g: {k: {**v, "tokens": v["chars"] // 4} for k, v in e.items()} for g, e in stats.items()}
    fig = F.calibration_sizes(tokens)
    assert fig.layout.title.text == "Tokens by task and domain" and fig.layout.yaxis.title.text == "tokens"
    assert [list(t.y) for t in fig.data] == [[30], [17, 12]]


# --------------------------------------------------------------------------- the pages in a browser


def wait_figures(page, *ids: str, timeout: float = 30_000) -> None:
    for graph in ids:
        page.wait_for_function(HAS_DATA, arg=graph, timeout=timeout)


def figure(page, graph: str) -> dict:
    return json.loads(page.evaluate(FIGURE, graph))


def param(method: str, name: str) -> str:
    """CSS selector of a designer parameter control (Dash writes pattern-matching ids as sorted JSON)."""
    return f"""[id='{{"method":"{method}","name":"{name}","type":"cd-param"}}']"""


def recipe(method: str, value: str) -> str:
    return f"""[id='{{"method":"{method}","type":"cd-recipe"}}'] input[value={value}]"""


def no_errors(page) -> None:
    assert not page.query_selector(".error"), page.inner_text(".error")
    assert page.errors == [], page.errors


def _ratio(evaluation: dict) -> float:
    v = evaluation["summary"]["variants"]
    return v["converted"].get("perplexity_ratio") or v["converted"]["perplexity"] / v["dense"]["perplexity"]


@pytest.fixture(scope="module")
def two_sets(api, profile_id):
    """The same ExpertWeaver conversion calibrated on builtin code and on literature, each evaluated
    on two held-out texts: {set name: conversion id}."""
    model_id = api.get(f"/profiles/{profile_id}").json()["model_id"]
    out = {}
    for name in ("code", "literature"):
        s = api.post("/calibration-sets", json={"source": "builtin", "name": name, "samples": 12}).json()
        wait_job(api, s["job_id"])
        p = api.post("/profiles", json={"model_id": model_id, "calibration_set_id": s["id"], "max_tokens": 32, "batch_tokens": 256}).json()
        wait_job(api, p["job_id"])
        c = api.post("/conversions", json={"profile_id": p["id"], "expertweaver": {"n_experts": 8, "alpha_max": 0.5}}).json()
        wait_job(api, c["job_id"])
        for source in ("builtin:code", "builtin:prose"):
            e = api.post("/evaluations", json={"conversion_id": c["id"], "source": source, "n_windows": 2, "seq_len": 32,
                                               "baselines": False, "multiple_choice_per_task": 0}).json()
            wait_job(api, e["job_id"])
        out[api.get(f"/calibration-sets/{s['id']}").json()["name"]] = c["id"]
    return out


@pytest.mark.slow
def test_compare_labels_csv_panels_and_width(page, live, api, two_sets):
    page.set_viewport_size({"width": 1024, "height": 900})
    ids = list(two_sets.values())
    page.goto(f"{live['ui']}/compare?ids={','.join(ids)}")
    wait_figures(page, "cc-ppl", "cc-cost", "cc-active")

    # 1. each point's label names its calibration set and recipe; the hover has the full name and id
    cost = figure(page, "cc-cost")
    labels = {t for trace in cost["data"] for t in trace["text"]}
    assert labels == {f"{name} · expertweaver paper" for name in two_sets}
    hover_ids = {c[1] for trace in cost["data"] for c in trace["customdata"]}
    assert hover_ids == set(ids)
    # ... and no label is cut: every label's box lies inside the chart
    boxes = page.evaluate("""() => { const svg = document.querySelector('#cc-cost svg.main-svg').getBoundingClientRect();
        return {svg: [svg.left, svg.top, svg.right, svg.bottom], labels: Array.from(document.querySelectorAll('#cc-cost .textpoint text'))
          .map(t => { const b = t.getBoundingClientRect(); return [t.textContent, b.left, b.top, b.right, b.bottom]; })}; }""")
    sl, st, sr, sb = boxes["svg"]
    assert len(boxes["labels"]) == 4  # two conversions × two texts
    for text, left, top, right, bottom in boxes["labels"]:
        assert text in labels and sl <= left and right <= sr and st <= top and bottom <= sb, (text, left, right, boxes["svg"])

    # 2. the chart's CSV is exactly its points, with the API's numbers
    with page.expect_download() as dl:
        page.click("""[id='{"name":"cc-cost","type":"csv-btn"}']""")
    assert dl.value.suggested_filename == "quality_vs_cost.csv"
    rows = list(csv.DictReader(Path(dl.value.path()).read_text().splitlines()))
    expected = set()
    for name, cid in two_sets.items():
        conv = api.get(f"/conversions/{cid}").json()
        for e in api.get("/evaluations", params={"conversion_id": cid}).json()["items"]:
            if e["status"] != "ready":
                continue
            expected.add((cid, e["id"], name, f"{name} · expertweaver paper", conv["summary"]["ffn_flops_fraction"], _ratio(e)))
    got = {(r["conversion_id"], r["evaluation_id"], r["calibration_set"], r["label"], float(r["ffn_flops_fraction"]),
            float(r["perplexity_ratio"])) for r in rows}
    assert len(rows) == 4 and {g[:4] for g in got} == {e[:4] for e in expected}
    for g in got:
        e = next(x for x in expected if x[:2] == g[:2])
        assert g[4] == pytest.approx(e[4]) and g[5] == pytest.approx(e[5])

    # 3. perplexity: horizontal tick labels that end above the next panel's title and plot
    ppl = figure(page, "cc-ppl")
    assert ppl["layout"]["xaxis"]["tickangle"] == 0 and ppl["layout"]["xaxis2"]["tickangle"] == 0
    geo = page.evaluate("""() => { const g = document.querySelector('#cc-ppl');
        const bottom = sel => Math.max(...Array.from(g.querySelectorAll(sel)).map(t => t.getBoundingClientRect().bottom));
        const top = el => el.getBoundingClientRect().top;
        return {ticks1: bottom('.cartesianlayer .subplot.xy .xaxislayer-above text'),
                ticks2: bottom('.cartesianlayer .subplot.x2y2 .xaxislayer-above text'),
                plot2: top(g.querySelector('.draglayer .x2y2 .nsewdrag')),
                titles: Array.from(g.querySelectorAll('.annotation')).map(a => [a.textContent, top(a)]),
                legend: top(g.querySelector('.legend')), svg: g.querySelector('svg.main-svg').getBoundingClientRect().bottom}; }""")
    title2 = next(t for text, t in geo["titles"] if text == ppl["layout"]["annotations"][1]["text"])
    assert geo["ticks1"] < title2 < geo["plot2"], geo
    assert geo["ticks2"] < geo["legend"] <= geo["svg"], geo  # the last panel's labels above the legend, inside the chart

    # 4. at 1024 px the page is not wider than the window (a wide table scrolls in its own box)
    assert page.evaluate("document.documentElement.scrollWidth") <= 1024
    page.screenshot(path=str(ARTIFACTS / "compare-1024.png"), full_page=True)
    no_errors(page)


@pytest.mark.slow
def test_designer_tau_steps_and_bounds(page, live, profile_id):
    page.goto(f"{live['ui']}/designer?profile={profile_id}&n_experts=8")
    wait_figures(page, "cd-plan")
    tau = page.locator(param("expertweaver", "tau"))
    assert tau.get_attribute("step") == "0.05" and tau.get_attribute("min") == "0.05"
    box = tau.locator("xpath=..")
    box.locator(".dash-stepper-increment").click()
    page.wait_for_function("() => location.search.includes('tau=0.65')")
    assert tau.input_value() == "0.65"
    for _ in range(14):  # 0.65 → 0.05, and no further: the engine wants tau > 0
        if box.locator(".dash-stepper-decrement").is_disabled():
            break
        box.locator(".dash-stepper-decrement").click()
    assert tau.input_value() == "0.05" and box.locator(".dash-stepper-decrement").is_disabled()
    page.wait_for_function("() => location.search.includes('tau=0.05')")
    page.wait_for_function("() => !document.querySelector('.error')")

    tau.fill("0")  # typed past the bound: the bound in words, in the error and on the chart
    tau.press("Enter")
    page.wait_for_selector(".error >> text=tau: enter a number > 0, in steps of 0.05")
    page.wait_for_function("""() => { const g = document.querySelector('#cd-plan .js-plotly-plot');
                                     return g && (g.layout.annotations || []).some(a => a.text.includes('tau: enter a number > 0')); }""")
    tau.fill("0.8")
    tau.press("Enter")
    page.wait_for_function("() => !document.querySelector('.error') && location.search.includes('tau=0.8')")
    wait_figures(page, "cd-plan")
    assert page.errors == [], page.errors


@pytest.mark.slow
def test_designer_recipe_budget_preview_result_card_and_failed_evaluation(page, live, api, profile_id):
    page.goto(f"{live['ui']}/designer?profile={profile_id}&n_experts=8")
    wait_figures(page, "cd-plan")
    assert page.locator(recipe("expertweaver", "paper")).is_checked()  # the default is said, not left blank
    assert not page.locator(recipe("expertweaver", "best")).is_checked()
    assert page.inner_text("#cd-banner") == ""

    # a too-short text to evaluate on (uploaded before the page lists the sets): its evaluation fails
    short = api.post("/calibration-sets/upload", files={"file": ("short.txt", b"A short text of a few words, one sentence only.\n")},
                     data={"name": "too-short"}).json()
    assert short["status"] == "ready"

    page.goto(f"{live['ui']}/designer?profile={profile_id}&n_experts=8&recipe=best")
    page.wait_for_selector("#cd-banner >> text=Budget plan")
    assert page.locator(recipe("expertweaver", "best")).is_checked()
    assert "router: centroid → ridge" in page.inner_text("""[id='{"method":"expertweaver","type":"cd-recipe-diff"}']""")
    banner = page.inner_text("#cd-banner")
    assert "per-layer top-k is fitted on calibration tokens at conversion" in banner and "starting plan" in banner
    assert "router ridge, alpha_basis active, compensation skipped_mean" in banner and "ffn_flops_fraction ≤ 0.75" in banner
    # the chart is the API's preview for the recipe's parameters (alpha_basis active: a smaller shared share than paper's)
    best = api.get(f"/profiles/{profile_id}/preview/expertweaver",
                   params={"n_experts": 8, "router": "ridge", "alpha_basis": "active", "plan": "budget", "compensation": "skipped_mean"}).json()
    paper = api.get(f"/profiles/{profile_id}/preview/expertweaver", params={"n_experts": 8}).json()
    shared = [r["d_shared"] / r["d_ffn"] for r in best["layers"]]
    assert shared != [r["d_shared"] / r["d_ffn"] for r in paper["layers"]]
    wait_figures(page, "cd-plan")  # the banner can land before the chart on a busy machine
    fig = figure(page, "cd-plan")
    assert fig["layout"]["title"]["text"].startswith("Starting plan of the budget plan")
    assert fig["data"][0]["name"] == "shared (always on)" and page.evaluate(Y, ["cd-plan", 0]) == pytest.approx(shared)
    assert "recipe=best" in page.evaluate("location.search")
    page.screenshot(path=str(ARTIFACTS / "designer-best.png"), full_page=True)

    page.click("#cd-convert")
    page.wait_for_selector("#cd-job >> text=succeeded", timeout=180_000)
    card = page.wait_for_selector("#cd-result-card").inner_text()
    conversion = re.search(r"(conv-[0-9a-f]+)", card).group(1)
    timings = api.get(f"/conversions/{conversion}").json()["job"]["timings"]
    assert re.search(r"peak rss [\d,]+\.\d MiB", card) and f"{timings['peak_rss_mib']:,.1f} MiB" in card
    assert not re.search(r"MiB s\b", card) and f"total {timings['total_s']:.2f} s" in card
    # every layer's note once, grouped: the budget plan's top-k, or (the recipe's routed-share cap) left dense
    notes = api.get(f"/conversions/{conversion}").json()["summary"]["notes"]
    assert sorted(n["layer"] for n in notes) == [0, 1, 2]
    assert {n["note"] for n in notes} <= {"budget plan: top-k chosen by calibration error", "left dense (all neurons kept)"}
    for line in collapse_notes(notes):
        assert card.count(line) == 1, line
    layers = api.get(f"/conversions/{conversion}").json()["layers"]  # each layer's top-k of its experts, or 'dense'
    said = page.inner_text("#cd-top-k").split(": ", 1)[1].split(", ")
    assert said == ["dense" if not r["n_routed"] else f"{r['top_k']}/{r['n_routed']}" for r in layers]
    # the recipe's speed guard says what this machine's kernel table let each layer run, and from when
    guard = api.get(f"/conversions/{conversion}").json()["summary"]["speed_guard"]
    assert guard.startswith("each layer offered only the top-k") and f"speed_guard: {guard}" in card
    assert not page.is_disabled("#cd-evaluate")

    page.click("#cd-eval-source")
    page.click(f".dash-dropdown-content .dash-dropdown-option:has(input[value='{short['id']}'])")
    page.click("#cd-evaluate")
    page.wait_for_selector("#cd-job >> text=failed", timeout=180_000)
    failed = page.wait_for_selector("#cd-eval-failed").inner_text()
    assert "shorter than one 64-token window" in failed and "try again" in failed
    assert "Not evaluated yet" not in page.inner_text("#cd-result-card")
    page.wait_for_function("() => !document.querySelector('#cd-evaluate').disabled")  # the text and the button agree: retry
    page.screenshot(path=str(ARTIFACTS / "designer-eval-failed.png"), full_page=True)
    page.errors.clear()

    page.click("#cd-eval-source")
    page.click(".dash-dropdown-content .dash-dropdown-option:has(input[value='builtin:mixed'])")
    page.click("#cd-evaluate")
    page.wait_for_selector("#cd-job >> text=succeeded", timeout=180_000)
    wait_figures(page, "cd-ppl")
    assert page.locator("#cd-eval-failed").count() == 0 and page.errors == []


@pytest.mark.slow
def test_calibration_card_plots_characters_and_says_so(page, live, api, profile_id):
    set_id = api.get(f"/profiles/{profile_id}").json()["calibration_set_id"]
    stats = api.get(f"/calibration-sets/{set_id}").json()["stats"]
    assert "n_tokens" not in stats  # a set is stored without a tokenizer: no token counts to show
    page.goto(f"{live['ui']}/calibration?set={set_id}")
    wait_figures(page, "cs-tokens")
    card = page.locator(".card", has=page.locator("#cs-tokens"))
    assert card.locator(".card-title").inner_text() == "Size by task / domain"
    fig = figure(page, "cs-tokens")
    assert fig["layout"]["title"]["text"].startswith("Characters by task and domain") and fig["layout"]["yaxis"]["title"]["text"] == "characters"
    by_name = {t["name"]: dict(zip(t["x"], t["y"])) for t in fig["data"]}
    assert by_name["by task"] == {k: v["chars"] for k, v in stats["tasks"].items()}
    assert by_name["by domain"] == {k: v["chars"] for k, v in stats["domains"].items()}
    assert "token" not in page.inner_text(".card:has(#cs-tokens) .card-title").lower()
    assert page.errors == [], page.errors


def test_quality_vs_cost_marks_points_in_and_out_of_the_calibration_domains():
    points = [{**p, "ffn_flops_fraction": 0.75, "domain": d} for p, d in zip(_points()[:2], ("in domain", "out of domain"), strict=True)]
    fig = F.quality_vs_cost(points)
    (trace,) = fig.data
    assert list(trace.marker.symbol) == ["circle", "x"] and [c[2] for c in trace.customdata] == ["in domain", "out of domain"]
    title = fig.layout.title.text
    assert "● in domain (text of the conversion's calibration set)" in title and "✕ out of domain (text not of" in title
    assert [r["domain"] for r in F.quality_cost_points(points)] == ["in domain", "out of domain"]


@pytest.mark.slow
def test_designer_asks_before_pruning_layers_and_cancels_what_it_started(page, live, api, profile_id):
    """A plan that leaves layers without any routed expert (a fixed prune) is said in red with its measured damage, and
    Convert refuses it until 'convert even with pruned layers' is ticked; the conversion it then starts is cancelled
    from the designer's own Cancel."""
    params = next(p for p in ({"n_experts": 8, "sparsity": s, "alpha_min": a, "alpha_max": a}
                              for s in (0.875, 0.75, 0.8) for a in (0.9, 0.7, 0.5))
                  if api.get(f"/profiles/{profile_id}/preview/expertweaver", params=p).json()["summary"].get("static_layers"))
    static = api.get(f"/profiles/{profile_id}/preview/expertweaver", params=params).json()["summary"]["static_layers"]
    query = "&".join(f"{k}={v}" for k, v in params.items())
    page.goto(f"{live['ui']}/designer?profile={profile_id}&{query}")
    warning = page.wait_for_selector("#cd-pruned").inner_text()
    assert f"runs no routed expert in layer{'s' if len(static) > 1 else ''} " in warning and "20× dense perplexity" in warning
    assert "error" in page.get_attribute("#cd-pruned", "class")
    before = len(api.get("/conversions").json()["items"])
    page.click("#cd-convert")
    refused = page.wait_for_selector("#cd-job .error").inner_text()
    assert refused.startswith("not converted: This plan runs no routed expert") and "convert even with pruned layers" in refused
    assert len(api.get("/conversions").json()["items"]) == before  # nothing was queued
    page.check("#cd-allow-pruned input[value='allow']")
    page.click("#cd-convert")
    page.wait_for_selector("#cd-job .job-label")
    page.click("#cd-cancel")
    # the cancel is heard at once ('cancel requested', then 'cancelled'); a tiny conversion may have finished first
    page.wait_for_selector("#cd-job .job-label >> text=/cancel|succeeded/", timeout=120_000)
    convs = api.get("/conversions").json()["items"]
    assert len(convs) == before + 1
    job = api.get(f"/jobs/{convs[0]['job_id']}").json()
    assert job["cancel_requested"] or job["state"] in ("cancelled", "succeeded"), job  # a tiny conversion may finish first
    assert page.errors == [], page.errors
