"""The Evaluations page in a real browser against the live service: the overlay draws each chosen run's
per-layer curve with the values the API stores, the routing divergence of a run against another text
equals the JS divergence of that conversion's two routings (from the routing heatmap, another path),
notes and tags typed in the page reach the API, and the tag filter then lists only that run.
Screenshot: test-artifacts/evaluations.png."""

from __future__ import annotations

import numpy as np
import pytest

from frontend.figures import js_divergence

from .test_browser import figure, no_errors, shot, wait_figures

pytestmark = pytest.mark.slow

YS = "id => document.querySelector('#' + id + ' .js-plotly-plot').data.map(t => [t.name, Array.from(t.y)])"


def test_overlay_notes_and_tag_filter(page, live, api, evaluated):
    conversion, (a, b) = evaluated
    page.goto(f"{live['ui']}/evaluations?ids={a},{b}&metric=reconstruction_error")
    wait_figures(page, "ev-overlay")
    page.wait_for_function("() => (document.querySelector('#ev-overlay .js-plotly-plot').data || []).length == 2")
    lines = dict(page.evaluate(YS, "ev-overlay"))
    for ident, text in ((a, "builtin:code"), (b, "builtin:prose")):
        want = api.get(f"/evaluations/{ident}/charts/layers").json()["reconstruction_error"]
        (name,) = [n for n in lines if n.endswith(f"on {text}")]
        assert lines[name] == pytest.approx(want)
    assert "Reconstruction error per layer" in figure(page, "ev-overlay")["title"]

    # divergence of run A's routing against the prose text: the conversion's code vs prose routing
    page.goto(f"{live['ui']}/evaluations?ids={a},{b}&metric=js&against=builtin:prose")
    wait_figures(page, "ev-overlay")
    page.wait_for_function("() => (document.querySelector('#ev-overlay .js-plotly-plot').data || []).length == 1")
    heat = api.get(f"/conversions/{conversion}/charts/routing", params={"evaluation_id": [a, b]}).json()
    share = np.array([[[np.nan if v is None else v for v in row] for row in s] for s in heat["share"]], dtype=float)
    want = js_divergence(share[0], share[1])
    (name, got), = page.evaluate(YS, "ev-overlay")
    assert name.endswith("on builtin:code vs builtin:prose")
    assert np.array([np.nan if v is None else v for v in got], dtype=float) == pytest.approx(want, abs=1e-4, nan_ok=True)
    # run B is itself the prose evaluation: no other one to measure against, and the figure says so
    assert "no evaluation on builtin:prose of" in figure(page, "ev-overlay")["title"]
    shot(page, "evaluations")
    no_errors(page)

    # notes and tags typed in the page reach the API; the tag filter then lists that run alone
    page.goto(f"{live['ui']}/evaluations?q={a}")  # the words filter: one run listed, the editor opens on it
    page.wait_for_selector("#ev-count:has-text('1 evaluation matches the filters')")
    page.wait_for_selector(f"#ev-edit:has-text('{a}')")
    page.wait_for_load_state("networkidle")  # the chosen run's stored notes load into the fields first
    page.fill("#ev-notes", "code routes differently from prose in the last layer")
    page.fill("#ev-tags", "browser-note, code")
    page.click("#ev-save")
    page.wait_for_selector("#ev-save-msg:has-text('saved: 2 tag(s)')")
    got = api.get(f"/evaluations/{a}").json()
    assert got["notes"] == "code routes differently from prose in the last layer" and got["tags"] == ["browser-note", "code"]
    page.click("#ev-tag")  # the new tag is offered by the filter at once, without a reload
    page.wait_for_selector(".dash-dropdown-content .dash-dropdown-option:has(input[value='browser-note'])")
    page.keyboard.press("Escape")
    page.goto(f"{live['ui']}/evaluations?tag=browser-note")
    page.wait_for_selector("#ev-count:has-text('1 evaluation matches the filters')")
    rows = page.locator("#ev-table tr").all_inner_texts()
    assert len(rows) == 2 and a in rows[1] and "browser-note, code" in rows[1] and "code routes differently" in rows[1]
    no_errors(page)


def test_cli_notes_and_lists_runs_through_the_live_api(live, api, evaluated):
    import os
    import subprocess
    import sys

    _, (a, b) = evaluated
    env = {**os.environ, "MOELAB_API_URL": live["api"]}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "moelab.cli", "runs", *args], env=env, capture_output=True, text=True)

    done = cli("note", "evaluations", b, "--notes", "prose run from the CLI", "--tag", "cli-tag", "--tag", "prose")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"evaluations {b}: tags cli-tag, prose; notes: prose run from the CLI"
    got = api.get(f"/evaluations/{b}").json()
    assert got["notes"] == "prose run from the CLI" and got["tags"] == ["cli-tag", "prose"]
    listed = cli("list", "--tag", "cli-tag")
    assert listed.returncode == 0 and listed.stdout.splitlines()[0].startswith(b) and "1 evaluation(s)" in listed.stdout
    assert "# prose run from the CLI" in listed.stdout and "cli-tag,prose" in listed.stdout
    bad = cli("note", "evaluations", "ev-nothere", "--tag", "x")
    assert bad.returncode != 0 and "no evaluation with id 'ev-nothere'" in bad.stderr
    assert cli("note", "evaluations", b).returncode == 2  # nothing to change: a usage error
