"""Figure builders are pure functions of the API's chart JSON: tested on fixed payloads."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import pytest

from frontend import figures as F

HIST = {"edges": [0.0, 0.5, 1.0, 1.5], "layers": [0, 1], "counts": [[3, 2, 1], [0, 4, 2]], "overflow": [1, 0],
        "not_finite": [0, 0], "n_neurons": [7, 6], "bins": 3, "clipped_at": 1.5, "note": "n"}
SUMMARY = {"layers": [0, 1, 2], "quantiles": [0.05, 0.25, 0.5, 0.75, 0.95],
           "values": [[0.1, 0.2, 0.3, 0.4, 0.5], [0.2, 0.3, 0.4, 0.5, 0.9], [0.3, 0.4, 0.6, 0.8, None]],
           "mean": [0.3, 0.45, 0.55], "median": [0.3, 0.4, 0.6], "tau": 0.5, "specialisation_ratio": [0.1, 0.3, 0.6]}
TILES = {"layer": 1, "values": [[1.0, -1.0, 0.5], [0.0, 2.0, None]], "rows": ["code", "math"], "neuron_order": "cv",
         "normalize": "none", "n_rows": 2, "n_neurons": 6, "neurons_per_column": 2, "rows_per_row": 1,
         "column_first_neuron": [4, 0, 2], "aggregated": True, "note": "each column is the mean of 2 consecutive neurons"}
SIM = {"labels": ["a", "b"], "matrix": [[1.0, 0.2], [0.2, 1.0]], "centered": True, "metric": "cosine", "note": "full resolution"}
LAYERS = {"layers": [0, 1, 2, 3], "S_L": np.eye(4).tolist(), "S_M": np.eye(4).tolist(), "adjacent_S_L": [0.9, 0.5, 0.95],
          "adjacent_S_M": [0.9, 0.5, 0.95], "delta": 0.3, "params": {"delta": 0.3, "n_fused": 2},
          "fusion": {"layer": 1, "n_fused": 2, "s_layer": 0.91, "s_mlp": 0.8, "delta": 0.3, "rank": 0, "n_candidates": 2,
                     "candidates": []},
          "removed_layers": [2, 3], "fusion_error": None}
PREVIEW = {"params": {}, "summary": {"active_fraction": 0.75, "clamped_layers": [1], "static_layers": []},
           "layers": [{"layer": i, "d_ffn": 96, "r": r, "alpha": 0.3, "d_expert": 12, "n_shared": 2, "d_shared": 24,
                       "n_routed": 6, "top_k": 4, "active_neurons": 72, "active_fraction": 0.75, "static": False,
                       "clamped": i == 1, "note": ""} for i, r in enumerate([0.2, 0.5])]}
HEAT = {"sets": ["code", "prose"], "layers": [0, 1], "n_experts": 3, "evaluations": ["e1", "e2"],
        "share": [[[0.5, 0.25, 0.25], [None, None, None]], [[0.25, 0.25, 0.5], [1 / 3, 1 / 3, 1 / 3]]],
        "counts": [[[2, 1, 1], [None] * 3], [[1, 1, 2], [1, 1, 1]]], "load_cv": [[0.3, None], [0.3, 0.0]], "note": ""}


def _json_ok(fig: go.Figure) -> None:
    assert isinstance(fig, go.Figure)
    fig.to_json()  # serialisable for Dash
    assert all(t.type != "heatmapgl" for t in fig.data)


def test_cv_histogram_uses_server_bins_and_reports_overflow():
    fig = F.cv_histogram(HIST, 0)
    _json_ok(fig)
    assert list(fig.data[0].y) == [3, 2, 1] and np.allclose(fig.data[0].x, [0.25, 0.75, 1.25])
    assert "1 above 1.5" in fig.layout.title.text


def test_cv_by_layer_boxes_from_quantiles_and_tau_line():
    fig = F.cv_by_layer(SUMMARY)
    _json_ok(fig)
    box = fig.data[0]
    assert list(box.median) == [0.3, 0.4, 0.6] and list(box.q1) == [0.2, 0.3, 0.4] and np.isnan(box.upperfence[2])
    assert any(s.y0 == 0.5 for s in fig.layout.shapes)
    assert list(F.specialisation_ratio(SUMMARY).data[0].y) == [0.1, 0.3, 0.6]


def test_activation_heatmap_says_it_is_aggregated_and_profiles_a_column():
    fig = F.activation_heatmap(TILES)
    _json_ok(fig)
    assert fig.data[0].type == "heatmap" and "aggregated server-side" in fig.layout.title.text
    assert np.asarray(fig.data[0].customdata)[0].tolist() == [4, 0, 2]
    prof = F.neuron_profile(TILES, 1)
    assert list(prof.data[0].y) == [-1.0, 2.0] and "neurons from 0" in prof.layout.title.text


def test_similarity_heatmaps_outline_the_apis_fusion():
    _json_ok(F.task_similarity(SIM))
    fig = F.layer_similarity(LAYERS, "S_L")
    _json_ok(fig)
    block, pair = fig.layout.shapes
    assert (block.name, block.x0, block.x1, block.y0, block.y1) == ("fusion", 0.5, 3.5, 0.5, 3.5)  # blocks l* = 1 … l* + n* = 3
    assert (pair.name, pair.x0, pair.x1, pair.y0, pair.y1) == ("fusion-pair", 2.5, 3.5, 0.5, 1.5)  # the compared cell [1, 3]
    assert F.fusion_outline(LAYERS) == (1, 3)
    title = fig.layout.title.text
    assert "l* = 1, n* = 2 (blocks 2–3 pruned)" in title and "S_L[1, 3] = 0.9100" in title and "0.2000 < δ = 0.3" in title
    assert "S_M[1, 3] = 0.8000" in F.layer_similarity(LAYERS, "S_M").layout.title.text
    given = F.layer_similarity({**LAYERS, "fusion": {**LAYERS["fusion"], "rank": None}}, "S_L")
    assert "no δ test" in given.layout.title.text
    refused = F.layer_similarity({**LAYERS, "fusion": None, "removed_layers": None, "fusion_error": "dense2moe: no pair"}, "S_M")
    assert len(refused.layout.shapes) == 0 and "refused" in refused.layout.title.text


STATS = {"layer": 0, "rate_edges": [0.0, 0.25, 0.5], "rate_counts": [3, 1], "rate_mean": 0.2, "n_neurons": 4,
         "h_edges": [-1.0, 0.0, 1.0], "h_counts": [10, 20], "h_below": 1, "h_above": 2, "note": ""}


def test_value_histograms():
    fig = F.value_histogram([0.1, 0.2, 0.2, np.nan, 0.9], "t", "x")
    _json_ok(fig)
    assert sum(fig.data[0].y) == 4
    assert F.value_histogram([], "empty", "x").layout.annotations[0].text.endswith("no finite value")
    rates = F.activation_rate_histogram(STATS)
    _json_ok(rates)
    assert list(rates.data[0].y) == [3, 1] and np.allclose(rates.data[0].x, [0.125, 0.375]) and "CM Fig. 2" in rates.layout.title.text
    h = F.h_value_histogram(STATS)
    assert list(h.data[0].y) == [10, 20] and "1 below and 2 above" in h.layout.title.text
    assert len(F.table("rates", STATS)) == 2 and F.table("h-values", STATS)[1]["count"] == 20


def test_allocation_plan_stacks_to_one_and_flags_clamped():
    fig = F.allocation_plan(PREVIEW)
    _json_ok(fig)
    bars = [t for t in fig.data if t.type == "bar"]
    total = np.sum([np.asarray(b.y) for b in bars], axis=0)
    assert np.allclose(total, 1.0) and np.allclose(bars[0].y, 24 / 96) and np.allclose(bars[1].y, 48 / 96)
    assert list(fig.data[-1].y) == [0.2, 0.5] and "CLAMPED layers [1]" in fig.layout.title.text


def test_js_divergence_properties():
    p = np.array([[0.5, 0.5], [1.0, 0.0], [np.nan, np.nan]])
    q = np.array([[0.5, 0.5], [0.0, 1.0], [0.5, 0.5]])
    js = F.js_divergence(p, q)
    assert js[0] == pytest.approx(0) and js[1] == pytest.approx(1) and np.isnan(js[2])


def test_routing_figures():
    for fig in (F.routing_heatmap(HEAT, 0), F.routing_heatmap(HEAT, 1), F.routing_difference(HEAT, 0, 1),
                F.routing_js_line(HEAT, 0, 1), F.load_cv_by_layer(HEAT)):
        _json_ok(fig)
    diff = np.asarray(F.routing_difference(HEAT, 0, 1).data[0].z, dtype=float)
    assert np.allclose(diff[0], [0.25, 0, -0.25]) and np.isnan(diff[1]).all()
    js = F.routing_js_line(HEAT, 0, 1).data[0].y
    assert js[0] > 0 and np.isnan(js[1])
    assert len(F.load_cv_by_layer(HEAT).data) == 2


def test_reconstruction_error_per_variant():
    fig = F.reconstruction_error({"results": {"converted": {"reconstruction_error": [0.1, 0.2]},
                                              "uniform": {"reconstruction_error": {"1": 0.4, "0": 0.3}}, "dense": {}}})
    _json_ok(fig)
    assert [t.name for t in fig.data] == ["converted", "uniform"] and list(fig.data[1].y) == [0.3, 0.4]
    assert F.reconstruction_error({"results": {}}).layout.annotations


def test_compare_figures():
    rows = [{"conversion": "c1", "variant": "dense", "perplexity": 10.0}, {"conversion": "c1", "variant": "converted", "perplexity": 12.0}]
    assert len(F.compare_perplexity(rows).data) == 2
    _json_ok(F.compare_active({"c1": PREVIEW["layers"]}))


def test_tables_to_csv():
    assert len(F.table("cv-histogram", HIST)) == 6
    assert F.table("cv-summary", SUMMARY)[2]["r"] == 0.6
    assert len(F.table("activations", TILES)) == 6
    assert len(F.table("task-similarity", SIM)) == 4
    assert len(F.table("layer-similarity", LAYERS)) == 16
    assert len(F.table("routing", HEAT)) == 12
    csv = F.csv_text(F.table("allocation", PREVIEW))
    assert csv.splitlines()[0].startswith("layer,d_ffn") and len(csv.splitlines()) == 3
    with pytest.raises(ValueError):
        F.table("nope", {})
