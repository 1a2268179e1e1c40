"""Downstream accuracy in a real browser against the live service: the Workspace launches an evaluation with
lm-eval tasks, the Workspace and the Evaluations page say each task's converted and dense accuracy as the API
stores them, and Compare draws accuracy against cost and against the speed measured in that evaluation, with
each task's domain relation to the conversion's calibration. Screenshot: test-artifacts/task-accuracy.png."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import frontend.app  # noqa: F401  (instantiates the Dash app: the page modules register with it)
from frontend.names import fmt
from frontend.speed import PHASES, kernel_words, phase_speedup, speed_cell, teal_words
from moelab.engine.evaluation.kernel_gain import NAME as KERNEL_DENSE, sparsity_gain
from frontend.task_accuracy import accuracy_cell

from .conftest import wait_job
from .test_browser import figure, no_errors, shot, wait_figures
from .test_workspace_actions import _choose, _row, conversion  # noqa: F401  (conversion: a fixture)

pytestmark = pytest.mark.slow


def test_tasks_from_the_workspace_shown_in_evaluations_and_compare(page, live, api, conversion, service_config):  # noqa: F811
    page.goto(f"{live['ui']}/")
    _choose(page, "ws-eval-conversion", conversion)
    page.fill("#ws-eval-windows", "2")
    page.fill("#ws-eval-seq-len", "32")
    page.wait_for_function("() => document.querySelector('#ws-eval-tasks') !== null")
    page.click("#ws-eval-tasks")
    page.wait_for_selector(".dash-dropdown-content .dash-dropdown-option:has(input[value='moelab_chat_qa'])")
    labels = page.locator(".dash-dropdown-content .dash-dropdown-option").all_inner_texts()
    assert [t.strip() for t in labels[:4]] == ["moelab_chat_qa (builtin:chat)", "moelab_lastword (builtin:literature)",
                                               "moelab_math_qa (builtin:math)", "moelab_humaneval (builtin:code_problems)"], labels
    page.keyboard.press("Escape")
    # a directory of the user's own task YAMLs (inside the data roots) adds its tasks; one outside is refused in words
    page.fill("#ws-eval-task-dir", "/etc")
    page.keyboard.press("Enter")
    page.wait_for_selector("#ws-eval-task-note >> text=outside MOELAB_DATA_ROOTS", timeout=120_000)
    mine = Path(json.loads(service_config["data_roots"])[0]) / "ui-tasks"
    mine.mkdir(parents=True, exist_ok=True)
    (mine / "t.jsonl").write_text('{"q": "1 plus 1 is", "choices": ["2", "3"], "label": 0}\n')
    (mine / "t.yaml").write_text(f"task: ui_sums\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {mine / 't.jsonl'}\n"
                                 "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_choice: choices\n"
                                 "doc_to_target: label\nmetric_list:\n  - metric: acc\n")
    page.fill("#ws-eval-task-dir", str(mine))
    page.keyboard.press("Enter")
    # a new directory builds lm-eval's task index over it (seconds; a minute on a busy machine)
    page.wait_for_function("() => !document.querySelector('#ws-eval-task-note').innerText.includes('outside')", timeout=180_000)
    page.click("#ws-eval-tasks")
    page.wait_for_selector(".dash-dropdown-content .dash-dropdown-option:has(input[value='ui_sums'])")
    page.click(".dash-dropdown-content .dash-dropdown-option:has(input[value='moelab_chat_qa'])")
    page.keyboard.press("Escape")
    page.fill("#ws-eval-task-limit", "8")
    page.click("#ws-add-eval")
    page.wait_for_selector("#ws-created >> text=created ev-")
    ev_id = page.inner_text("#ws-created").split()[1]
    ev = api.get(f"/evaluations/{ev_id}").json()
    assert ev["params"]["tasks"] == ["moelab_chat_qa"] and ev["params"]["limit"] == 8, ev["params"]
    assert ev["params"]["task_dir"] == str(mine)
    wait_job(api, ev["job_id"], timeout=300)
    ev = api.get(f"/evaluations/{ev_id}").json()
    by = ev["summary"]["tasks"]["moelab_chat_qa"]
    conv_acc, dense_acc = by["converted"]["acc"], by["dense"]["acc"]
    want = f"moelab_chat_qa {100 * conv_acc:.1f}% / {100 * dense_acc:.1f}% dense"
    assert accuracy_cell(ev["summary"]) == want and by["converted"]["n"] == 8
    _row(page, "evaluations", ev_id).locator(f"text={want}").wait_for()  # the Workspace's row says it
    assert speed_cell(ev["summary"]).count("×") == 3 and speed_cell(ev["summary"]) in _row(page, "evaluations", ev_id).inner_text()

    page.goto(f"{live['ui']}/evaluations?q={ev_id}")
    page.wait_for_selector("#ev-count:has-text('1 evaluation matches the filters')")
    headers = page.locator("#ev-table th").all_inner_texts()
    cells = page.locator("#ev-table tr").nth(1).locator("td").all_inner_texts()
    got = dict(zip(headers, cells))
    assert got["task accuracy (converted / dense)"] == want + " CSV · Markdown"
    # the paper-style table downloads from the cell, relayed by the UI's server: what the API's table says
    for name, fmt_ in (("CSV", "csv"), ("Markdown", "markdown")):
        href = page.locator("#ev-table tr").nth(1).locator(f"a:has-text('{name}')").get_attribute("href")
        got_table = page.request.get(f"{live['ui']}{href}")
        assert got_table.status == 200 and "attachment" in got_table.headers["content-disposition"]
        assert got_table.text() == api.get(f"/evaluations/{ev_id}/tasks-table", params={"format": fmt_}).text
        assert "moelab_chat_qa" in got_table.text() and f"{100 * conv_acc:.1f}" in got_table.text()
    # the whole models' speed in each phase, as this evaluation timed them (dense and converted, one process)
    speed = ev["summary"]["speed"]
    for phase, name in PHASES.items():
        value, rounds = speed["phases"][phase]["speedup"]["converted"], speed["phases"][phase]["rounds"]
        below, n = sum(d < c for d, c in zip(rounds["dense"], rounds["converted"])), len(rounds["dense"])
        words = "" if value >= 1 else " (slower)" if below == n else f" (slower in {below} of {n} rounds)"
        assert got[f"{name} speed × dense"] == f"{value:.2f}×" + words, (phase, got)
    title = page.locator("#ev-table tr").nth(1).locator("td").nth(headers.index("decode b8 speed × dense")).get_attribute("title")
    ms = 1e3 * speed["phases"]["decode_b8"]["seconds"]["converted"]
    assert title.startswith("one decode step of batch 8: dense ") and f"converted {ms:.1f} ms" in title and "threads" in title
    # TEAL at the conversion's cost, timed in the same rounds when baselines run: its speeds and perplexity ratio
    teal_col = got["TEAL at the same cost (speed b1 / b8 / prefill)"]
    if ev["params"]["baselines"]:
        teal = [speed["phases"][p]["speedup"]["teal"] for p in PHASES]
        assert teal_col == teal_words(ev["summary"]) and teal_col.startswith(" / ".join(f"{v:.2f}×" for v in teal)), teal_col
        assert f"ppl {ev['summary']['variants']['teal']['perplexity_ratio']:.2f}× dense" in teal_col
    else:
        assert teal_col == ""
    # the dense model in moelab's kernels, timed in the same rounds, and the conversion's speed over it
    kernel_col = got["dense in moelab's kernels (speed b1 / b8 / prefill)"]
    kernels = [speed["phases"][p]["speedup"][KERNEL_DENSE] for p in PHASES]
    gain = sparsity_gain(speed)
    assert kernel_col == kernel_words(ev["summary"]) and kernel_col.startswith(" / ".join(f"{v:.2f}×" for v in kernels))
    assert "; the conversion over it " + " / ".join(f"{gain[p]:.2f}×" for p in PHASES) in kernel_col, kernel_col

    page.goto(f"{live['ui']}/compare?ids={conversion}")
    wait_figures(page, "cc-acc-cost", "cc-acc-speed")
    page.wait_for_function("() => (document.querySelector('#cc-acc-cost .js-plotly-plot').data || []).length == 2")
    cost = figure(page, "cc-acc-cost")
    point, dense = cost["data"]
    ffn = api.get(f"/conversions/{conversion}").json()["summary"]["ffn_flops_fraction"]
    assert point["name"] == "moelab_chat_qa" and point["x"] == [pytest.approx(ffn)] and point["y"] == [pytest.approx(100 * conv_acc)]
    assert dense["name"] == "moelab_chat_qa: dense" and dense["x"] == [1.0] and dense["y"] == [pytest.approx(100 * dense_acc)]
    assert "in domain" in point["text"][0]  # the tiny profile's builtin:mixed holds chat
    drawn = figure(page, "cc-acc-speed")
    assert drawn["data"][0]["x"] == [pytest.approx(phase_speedup(ev["summary"], "decode_b1"))]
    assert drawn["title"].startswith("Accuracy vs measured decode b1 speed")
    page.click("#cc-phase input[value=prefill]")  # the phase chosen: both speed charts follow, and the URL keeps it
    page.wait_for_function("() => location.search.includes('phase=prefill')")
    page.wait_for_function("() => document.querySelector('#cc-acc-speed .js-plotly-plot').layout.title.text.includes('prefill')")
    assert figure(page, "cc-acc-speed")["data"][0]["x"] == [pytest.approx(phase_speedup(ev["summary"], "prefill"))]
    page.wait_for_function("() => document.querySelector('#cc-speed .js-plotly-plot').layout.xaxis.title.text.includes('prefill')")
    quality = figure(page, "cc-speed")
    assert quality["title"].startswith("Quality vs measured speed")
    assert ev["summary"]["variants"]["converted"]["perplexity_ratio"] == pytest.approx(quality["data"][0]["y"][0])
    assert quality["data"][0]["x"] == [pytest.approx(phase_speedup(ev["summary"], "prefill"))]
    # the dense model in moelab's kernels, timed in that evaluation, marked at dense perplexity beside it
    (mark,) = [t for t in quality["data"] if t["name"].endswith(": dense in moelab's kernels")]
    assert mark["x"] == [pytest.approx(phase_speedup(ev["summary"], "prefill", KERNEL_DENSE))] and mark["y"] == [1.0]
    shot(page, "task-accuracy")
    no_errors(page)
