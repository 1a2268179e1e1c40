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
    assert fig.layout.yaxis.type == "log" and not fig.layout.shapes  # counts span decades; no τ given, no line


def test_cv_histogram_draws_tau_and_names_the_groups():
    fig = F.cv_histogram(HIST, 1, tau=0.6, basis="sample")
    (line,) = fig.layout.shapes
    assert (line.x0, line.x1) == (0.6, 0.6) and any("τ = 0.6" in a.text for a in fig.layout.annotations)
    assert fig.layout.xaxis.title.text == "CV across samples"
    assert F.cv_histogram(HIST, 1, basis="task").layout.xaxis.title.text == "CV across tasks"


def test_cv_histogram_on_log_bins_draws_log10_positions_labelled_in_cv():
    hist = {**HIST, "edges": [0.1, 1.0, 10.0, 100.0], "scale": "log", "underflow": [2, 0], "clipped_at": 100.0}
    fig = F.cv_histogram(hist, 0, tau=0.6)
    _json_ok(fig)
    bar = fig.data[0]
    assert np.allclose(bar.x, [-0.5, 0.5, 1.5]) and np.allclose(bar.width, [1, 1, 1]) and list(bar.y) == [3, 2, 1]
    assert np.allclose(np.asarray(bar.customdata)[:, 0], [0.1, 1.0, 10.0])  # hover in CV units
    labels = dict(zip(fig.layout.xaxis.ticktext, fig.layout.xaxis.tickvals))
    assert labels["1"] == 0 and labels["10"] == 1 and labels["0.2"] == pytest.approx(np.log10(0.2))
    (line,) = fig.layout.shapes
    assert line.x0 == pytest.approx(np.log10(0.6))
    assert "2 with CV ≤ 0 not shown" in fig.layout.title.text and "CV on a log axis" in fig.layout.title.text


def test_single_topic_profiles_are_titled_by_samples_not_tasks():
    sim = {**SIM, "labels": [str(i) for i in range(48)], "matrix": np.eye(48).tolist()}
    fig = F.task_similarity(sim, "sample")
    assert fig.layout.title.text.startswith("Sample × sample activation similarity") and "48 samples" in fig.layout.title.text
    assert "Task" not in fig.layout.title.text
    assert F.task_similarity(SIM, "task").layout.title.text.startswith("Task × task")
    heat = F.activation_heatmap(TILES, "sample")
    assert "Neuron × sample activations" in heat.layout.title.text and heat.layout.yaxis.title.text == "sample"
    assert F.neuron_profile(TILES, 0, "sample").layout.title.text.startswith("Per-sample profile")
    assert F.activation_heatmap(TILES, "domain").layout.yaxis.title.text == "domain"


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
    for hist in (fig, rates, h):  # counts on log axes: the tail is visible next to the one full bin
        assert hist.layout.yaxis.type == "log" and "(log)" in hist.layout.yaxis.title.text
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


# EW's layer-adaptive α: layer 0 has 4 routed experts, layer 1 only 2 (padded with None), layer 2 is static
PADDED = {"sets": ["code", "prose"], "layers": [0, 1, 2], "n_experts": 4, "evaluations": ["e1", "e2"],
          "share": [[[0.4, 0.3, 0.2, 0.1], [0.75, 0.25, None, None], [None] * 4],
                    [[0.25, 0.25, 0.25, 0.25], [0.5, 0.5, None, None], [None] * 4]],
          "counts": [[[4, 3, 2, 1], [3, 1, None, None], [None] * 4], [[1, 1, 1, 1], [2, 2, None, None], [None] * 4]],
          "load_cv": [[0.4, 0.5, None], [0.0, 0.0, None]], "note": ""}


def test_js_line_has_a_value_for_every_layer_with_routed_experts():
    assert F.routed_experts(PADDED).tolist() == [4, 2, 0]
    fig = F.routing_js_line(PADDED, 0, 1)
    _json_ok(fig)
    js = np.asarray(fig.data[0].y, dtype=float)
    assert np.isfinite(js[:2]).all() and np.isnan(js[2])  # padding no longer blanks layer 1; static layer 2 has no value
    m = np.array([0.625, 0.375])  # layer 1 over its own two experts
    kl = lambda x: float(np.sum(x * np.log2(x / m)))  # noqa: E731
    assert js[1] == pytest.approx(0.5 * kl(np.array([0.75, 0.25])) + 0.5 * kl(np.array([0.5, 0.5])))
    assert "static layers [2]" in fig.layout.title.text and list(fig.data[0].customdata) == [4, 2, 0]


def test_routing_heatmap_explains_blank_cells():
    fig = F.routing_heatmap(PADDED, 0)
    _json_ok(fig)
    text = fig.data[0].text
    assert text[0][0] == "layer 0, expert 0: share 0.4000"
    assert text[1][3] == "layer 1 has 2 routed experts: no expert 3 (padding)"
    assert text[2][0] == "layer 2: static, no routed expert"
    assert "blank cells: padding" in fig.layout.title.text and fig.data[0].hoverongaps
    diff = F.routing_difference(PADDED, 0, 1)
    assert diff.data[0].text[1][2].endswith("(padding)") and "blank cells" in diff.layout.title.text
    assert "A = code<br>B = prose" in diff.layout.title.text and diff.layout.margin.t > 70  # long set names, one line each
    full = {**PADDED, "n_experts": 2, "layers": [1], "share": [[r[1][:2]] for r in PADDED["share"]],
            "counts": [[r[1][:2]] for r in PADDED["counts"]], "load_cv": [[0.5], [0.0]]}
    assert "blank cells" not in F.routing_heatmap(full, 0).layout.title.text  # nothing blank, nothing to explain


def test_routing_figures():
    for fig in (F.routing_heatmap(HEAT, 0), F.routing_heatmap(HEAT, 1), F.routing_difference(HEAT, 0, 1),
                F.routing_js_line(HEAT, 0, 1), F.load_cv_by_layer(HEAT)):
        _json_ok(fig)
    diff = np.asarray(F.routing_difference(HEAT, 0, 1).data[0].z, dtype=float)
    assert np.allclose(diff[0], [0.25, 0, -0.25]) and np.isnan(diff[1]).all()
    js = np.asarray(F.routing_js_line(HEAT, 0, 1).data[0].y, dtype=float)
    assert js[0] > 0 and np.isnan(js[1])
    assert len(F.load_cv_by_layer(HEAT).data) == 2


def test_reconstruction_error_per_variant():
    fig = F.reconstruction_error({"results": {"converted": {"reconstruction_error": [0.1, 0.2]},
                                              "uniform": {"reconstruction_error": {"1": 0.4, "0": 0.3}}, "dense": {}}})
    _json_ok(fig)
    assert [t.name for t in fig.data] == ["converted", "uniform"] and list(fig.data[1].y) == [0.3, 0.4]
    assert F.reconstruction_error({"results": {}}).layout.annotations


def _ev(ev_id: str, source: str, windows: int, seq_len: int, ppl: dict[str, float], label: str | None = None) -> dict:
    dense = ppl["dense"]
    return {"id": ev_id, "status": "ready", "params": {"source": source, "label": label or source, "n_windows": windows, "seq_len": seq_len},
            "summary": {"heldout": {"source": source, "split": "heldout", "windows": windows, "seq_len": seq_len},
                        "variants": {v: {"perplexity": x, "perplexity_ratio": x / dense} for v, x in ppl.items()}}}


# the reported bug: three evaluations of one conversion on three texts drawn as one "dense ≈ 190" bar
EVALS = {"c1": [_ev("e3", "builtin:code", 4, 64, {"dense": 16.4, "converted": 20.5}),  # newest first, as the API lists
                _ev("e2", "builtin:prose", 4, 64, {"dense": 33.8, "converted": 50.7}),
                _ev("e1", "cal-9", 2, 32, {"dense": 140.1, "converted": 170.0}, label="mine-heldout"),
                _ev("e0", "builtin:code", 4, 64, {"dense": 99.0, "converted": 999.0})],  # older run, same text and size
         "c2": [_ev("f1", "builtin:code", 4, 64, {"dense": 16.4, "converted": 18.0, "uniform": 900.0, "teal": 19.0}),
                _ev("f0", "builtin:code", 8, 128, {"dense": 15.0, "converted": 17.0})]}  # same text, other size
CONVS = [{"id": "c1"}, {"id": "c2"}]


def test_perplexity_rows_keep_texts_and_sizes_apart():
    rows = F.perplexity_rows(CONVS, EVALS, {"c1": "tiny · mixed · expertweaver"})
    texts = {r["text"] for r in rows}
    assert texts == {"builtin:code · 4 windows × 64 tokens = 256 tokens", "builtin:prose · 4 windows × 64 tokens = 256 tokens",
                     "mine-heldout (cal-9) · 2 windows × 32 tokens = 64 tokens", "builtin:code · 8 windows × 128 tokens = 1,024 tokens"}
    dense_c1 = sorted(r["perplexity"] for r in rows if r["conversion_id"] == "c1" and r["variant"] == "dense")
    assert dense_c1 == [16.4, 33.8, 140.1]  # one per text; the older re-run (99.0) on the same text is not added
    conv = next(r for r in rows if r["evaluation_id"] == "f1" and r["variant"] == "converted")
    assert conv["ratio_to_dense"] == pytest.approx(18.0 / 16.4) and conv["conversion"] == "c2"
    assert next(r for r in rows if r["conversion_id"] == "c1")["conversion"] == "tiny · mixed · expertweaver"


def test_compare_chart_never_mixes_texts_and_says_values_and_ratios():
    rows = F.perplexity_rows(CONVS, EVALS)
    fig = F.compare_perplexity(rows)
    _json_ok(fig)
    assert fig.layout.barmode == "group"
    titles = [a.text for a in fig.layout.annotations]
    assert len(titles) == 4 and "builtin:prose · 4 windows × 64 tokens = 256 tokens" in titles
    by_text = {r["evaluation_id"]: r["text"] for r in rows}
    for trace in fig.data:
        texts = {c[0] for c in trace.customdata}
        assert len(texts) == 1  # every bar of a trace measured on one text and size …
        axis = trace.yaxis.replace("y", "") or "1"
        assert titles[int(axis) - 1] in texts  # … the one its panel is titled with
        assert all(by_text[c[1]] in texts for c in trace.customdata)
    code = [t for t in fig.data if t.customdata[0][0].startswith("builtin:code · 4 windows")]
    dense = next(t for t in code if t.name == "dense")
    assert list(dense.y) == [16.4, 16.4] and list(dense.text) == ["16.4", "16.4"]  # never 16.4 + 33.8 + 140.1
    conv = next(t for t in code if t.name == "converted")
    assert list(conv.text) == ["20.5 (1.25× dense)", "18.0 (1.10× dense)"]
    uniform = next(t for t in code if t.name == "uniform")
    assert list(uniform.text) == ["900.0 (54.9× dense)"]
    assert F._bar_label({"variant": "converted", "perplexity": 49560.0, "ratio_to_dense": 0.9969}) == "49,560 (0.997× dense)"
    assert fig.layout[f"yaxis{code[0].yaxis[1:]}"].type == "log"  # 900 vs 16: log axis so dense stays visible
    teal = next(t for t in code if t.name == "teal")  # the TEAL baseline: its own colour and label, after the others
    assert list(teal.text) == ["19.0 (1.16× dense)"] and teal.marker.color == F.VARIANT_COLOURS["teal"]
    assert len(set(F.VARIANT_COLOURS.values())) == len(F.VARIANT_COLOURS)
    assert [t.name for t in code] == ["dense", "converted", "uniform", "teal"]
    assert sum(t.showlegend for t in fig.data) == 4  # one legend entry per variant
    assert "no evaluation" in F.compare_perplexity([]).layout.annotations[0].text


def test_heldout_label_falls_back_to_the_request():
    ev = {"id": "e", "params": {"source": "builtin:mixed", "label": "builtin:mixed", "n_windows": 4, "seq_len": 64}, "summary": None}
    assert F.heldout_label(ev) == "builtin:mixed · 4 windows × 64 tokens = 256 tokens"
    assert F.heldout_key(ev) == ("builtin:mixed", 4, 64)


def test_compare_active():
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


def test_layer_lines_break_where_layers_have_no_routed_experts():
    """Layers 2–4 pruned to dense (left out of the payload, as the routing API does): the JS and load-CV lines
    have a null at each, so Plotly breaks the line there instead of joining layer 1 to layer 5."""
    heat = {"sets": ["code", "prose"], "layers": [0, 1, 5], "n_experts": 2, "evaluations": ["e1", "e2"],
            "share": [[[0.5, 0.5], [0.75, 0.25], [0.6, 0.4]], [[0.25, 0.75], [0.5, 0.5], [0.6, 0.4]]],
            "counts": [[[1, 1], [3, 1], [3, 2]], [[1, 3], [2, 2], [3, 2]]], "load_cv": [[0.1, 0.2, 0.3], [0.0, 0.4, 0.5]], "note": ""}
    js = F.routing_js_line(heat, 0, 1)
    _json_ok(js)
    assert list(js.data[0].x) == [0, 1, 2, 3, 4, 5] and js.data[0].y[2:5] == (None, None, None)
    assert js.data[0].y[5] == pytest.approx(0.0) and js.data[0].y[0] > 0 and not js.data[0].connectgaps
    assert "layers [2, 3, 4] have no routed experts here" in js.layout.title.text
    cv = F.load_cv_by_layer(heat)
    assert [list(t.y) for t in cv.data] == [[0.1, 0.2, None, None, None, 0.3], [0.0, 0.4, None, None, None, 0.5]]
    assert "the lines break there" in cv.layout.title.text


def test_perplexity_carries_its_interval_over_windows():
    from frontend.names import ratio_ci

    assert ratio_ci(1.5312, [1.4101, 1.6644]) == "1.53× (1.41–1.66)" and ratio_ci(1.5312, None) == "1.53×" and ratio_ci(None, None) == ""
    row = {"variant": "converted", "perplexity": 20.5, "ratio_to_dense": 1.25, "ratio_ci": [1.1, 1.42]}
    assert F._bar_label(row) == "20.5 (1.25× dense, 95% CI 1.10–1.42)"
    rows = [{**row, "text": "t", "text_key": "t", "conversion": "c", "conversion_id": "c", "evaluation_id": "e",
             "perplexity_ci": [18.0, 24.0]}]
    bar = F.compare_perplexity(rows).data[0]
    assert list(bar.error_y.array) == [3.5] and list(bar.error_y.arrayminus) == [2.5] and not bar.error_y.symmetric
    assert F.compare_perplexity([{**rows[0], "perplexity_ci": None}]).data[0].error_y.array is None  # none measured: no bars


def test_a_long_message_wraps_inside_the_figure():
    text = ("conversion B has no evaluation on builtin:code · 4 windows × 64 tokens = 256 tokens: choose B above "
            "and evaluate it on that text from this page")
    shown = F.message_figure(text).layout.annotations[0].text
    lines = shown.split("<br>")
    assert len(lines) > 1 and all(len(line) <= F.MESSAGE_LINE_CHARS for line in lines) and " ".join(lines) == text


def test_figures_are_one_module_per_page_and_pure():
    """frontend/figures/: a module per page (plus common, matching, tables), none importing Dash, HTTP or the API client:
    a figure is a pure function of the data the page fetched."""
    import ast
    from pathlib import Path

    folder = Path(F.__file__).parent
    modules = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    pages = {p.stem for p in (folder.parent / "pages").glob("*.py")}
    assert modules - {"common", "matching", "tables"} <= pages, modules - pages
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.split(".")[0] in ("dash", "httpx", "requests") or "api_client" in n], (path.name, names)
