"""The designer's recipes and the Compare page's quality-vs-cost chart say the right values."""

from __future__ import annotations

import pytest

import json

import frontend.app  # noqa: F401  (instantiates the Dash app: the page modules register with it)
from frontend import figures as F
from frontend.pages.designer import _recipe, recipe_values
from moelab.engine.methods import describe_methods


def _methods():
    return json.loads(json.dumps(describe_methods()))


def test_choosing_best_sets_every_control_and_names_the_differences():
    ew = next(m for m in _methods() if m["name"] == "expertweaver")
    ids = [{"type": "cd-param", "method": "expertweaver", "name": p["name"]} for p in ew["params"]]
    current = [0.5 if p["name"] == "sparsity" else p["default"] for p in ew["params"]]
    values, text = _recipe("best", ids, current, _methods())
    chosen = {i["name"]: v for i, v in zip(ids, values)}
    assert chosen["router"] == "ridge" and chosen["plan"] == "budget" and chosen["alpha_basis"] == "active"
    assert chosen["sparsity"] == 0.5  # the cost asked for is kept
    assert chosen["n_experts"] == 128 and "n_experts: 64 → 128" in text  # finer experts
    assert chosen["down_keep"] == 0.5 and "down_keep: 1.0 → 0.5" in text  # TEAL inside the experts
    assert chosen["tau"] == 0.6 and chosen["alpha_min"] == 0.2  # everything else: the paper's
    assert "router: centroid → ridge" in text and "plan: paper → budget" in text and "ffn_flops_fraction ≤ 1 − sparsity" in text
    values, text = _recipe("paper", ids, values, _methods())
    assert {i["name"]: v for i, v in zip(ids, values)}["router"] == "centroid" and text == "paper: the paper's settings"


def test_recipe_values_are_the_defaults_plus_the_overrides():
    cm = next(m for m in _methods() if m["name"] == "cmoe")
    values, diff = recipe_values(cm, "paper")
    assert values == {p["name"]: p["default"] for p in cm["params"]} and diff == []


def test_quality_vs_cost_plots_one_series_per_text_with_the_recorded_numbers():
    pts = [{"label": "EW paper", "text": "builtin:mixed (32×256 tokens)", "ffn_flops_fraction": 0.764, "perplexity_ratio": 1.96},
           {"label": "best", "text": "builtin:mixed (32×256 tokens)", "ffn_flops_fraction": 0.75, "perplexity_ratio": 1.4},
           {"label": "best", "text": "builtin:code (8×256 tokens)", "ffn_flops_fraction": 0.75, "perplexity_ratio": 1.3},
           {"label": "old", "text": "builtin:code (8×256 tokens)", "ffn_flops_fraction": None, "perplexity_ratio": 2.0}]
    fig = F.quality_vs_cost(pts)
    by_name = {t.name: t for t in fig.data}
    assert set(by_name) == {"builtin:mixed (32×256 tokens)", "builtin:code (8×256 tokens)"}
    mixed = by_name["builtin:mixed (32×256 tokens)"]
    assert list(mixed.x) == [0.75, 0.764] and list(mixed.y) == [1.4, 1.96] and list(mixed.text) == ["best", "EW paper"]
    assert list(by_name["builtin:code (8×256 tokens)"].x) == [0.75]  # the unrecorded cost is left out, not guessed
    assert fig.layout.yaxis.type == "log" and "ffn_flops_fraction" in fig.layout.xaxis.title.text
    assert "no evaluated conversion" in F.quality_vs_cost([]).layout.annotations[0].text


def test_quality_vs_measured_speed_plots_each_phase_with_dense_in_view():
    pts = [{"label": "best", "text": "builtin:mixed", "ffn_flops_fraction": 0.5, "perplexity_ratio": 1.4,
            "speed_decode_b1": 1.31, "speed_decode_b8": 0.82, "speed_prefill": 0.9},
           {"label": "paper", "text": "builtin:mixed", "ffn_flops_fraction": 0.75, "perplexity_ratio": 2.0,
            "speed_decode_b1": 1.12, "speed_decode_b8": 0.95, "speed_prefill": 1.05},
           {"label": "old", "text": "builtin:mixed", "ffn_flops_fraction": 0.75, "perplexity_ratio": 1.9}]  # never timed
    fig = F.quality_vs_cost(pts, "speed_decode_b8")
    (trace,) = fig.data
    assert list(trace.x) == [0.82, 0.95] and list(trace.y) == [1.4, 2.0] and list(trace.text) == ["best", "paper"]
    assert fig.layout.title.text.startswith("Quality vs measured speed") and "decode b8" in fig.layout.xaxis.title.text
    assert fig.layout.xaxis.range[1] > 1.0  # dense's speed (1×) in view, a dotted line there: left of it is slower
    assert any(s.x0 == 1 and s.x1 == 1 for s in fig.layout.shapes)
    assert "lower-right is better" in fig.layout.title.text
    rows = F.quality_cost_points(pts, "speed_prefill")
    assert [r["speed_prefill"] for r in rows] == [0.9, 1.05] and [r["label"] for r in rows] == ["best", "paper"]
    assert "timed" in F.quality_vs_cost(pts[2:], "speed_decode_b1").layout.annotations[0].text


def test_the_dense_model_in_moelabs_kernels_is_marked_on_the_speed_axis_per_text():
    """Per held-out text, a mark at dense perplexity and the median of its evaluations' measured speed of the dense
    model in moelab's kernels; none on the cost axis; the CSV carries each evaluation's."""
    pts = [{"label": "best", "text": "builtin:mixed", "ffn_flops_fraction": 0.5, "perplexity_ratio": 1.4,
            "speed_decode_b1": 1.55, "kernels_decode_b1": 1.44},
           {"label": "paper", "text": "builtin:mixed", "ffn_flops_fraction": 0.5, "perplexity_ratio": 20.0,
            "speed_decode_b1": 1.65, "kernels_decode_b1": 1.48},
           {"label": "best", "text": "builtin:code", "ffn_flops_fraction": 0.5, "perplexity_ratio": 1.3,
            "speed_decode_b1": 1.50, "kernels_decode_b1": 1.41},
           {"label": "old", "text": "builtin:chat", "ffn_flops_fraction": 0.5, "perplexity_ratio": 1.3, "speed_decode_b1": 1.2}]
    fig = F.quality_vs_cost(pts, "speed_decode_b1")
    marks = {t.name: t for t in fig.data if t.name.endswith(F.KERNELS_LABEL)}
    assert set(marks) == {"builtin:mixed: dense in moelab's kernels", "builtin:code: dense in moelab's kernels"}
    assert list(marks["builtin:mixed: dense in moelab's kernels"].x) == [pytest.approx(1.46)]  # median of 1.44, 1.48
    assert list(marks["builtin:code: dense in moelab's kernels"].x) == [1.41]
    assert all(list(t.y) == [1.0] and list(t.text) == ["dense in moelab's kernels"] for t in marks.values())
    assert [t.name for t in F.quality_vs_cost(pts).data] == ["builtin:chat", "builtin:code", "builtin:mixed"]
    assert [r["kernels_decode_b1"] for r in F.quality_cost_points(pts, "speed_decode_b1")] == [1.44, 1.48, 1.41, None]


def test_the_portable_recipe_is_labelled_exportable_and_sets_the_leading_plan():
    from dash import dcc

    from frontend.pages.designer import method_panel

    ew = next(m for m in _methods() if m["name"] == "expertweaver")
    panel = method_panel(ew, {}, True)
    radios = [c for c in _walk(panel) if isinstance(c, dcc.RadioItems)]
    labels = {o["value"]: o["label"] for o in radios[0].options}
    assert labels["portable"] == "portable (exportable to GGUF / native HF)" and labels["best"] == "best"
    ids = [{"type": "cd-param", "method": "expertweaver", "name": p["name"]} for p in ew["params"]]
    values, text = _recipe("portable", ids, [p["default"] for p in ew["params"]], _methods())
    chosen = {i["name"]: v for i, v in zip(ids, values)}
    assert chosen["plan"] == "leading" and chosen["compensation"] == "none"
    assert "plan: paper → leading" in text and "exports to GGUF / native HF" in text


def _walk(component):
    yield component
    children = getattr(component, "children", None)
    for child in children if isinstance(children, (list, tuple)) else [children] if children is not None else []:
        if hasattr(child, "to_plotly_json"):
            yield from _walk(child)
