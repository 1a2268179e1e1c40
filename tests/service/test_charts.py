"""Chart builders (numpy only) against direct references."""

from __future__ import annotations

import json

import numpy as np
import pytest

from backend import charts
from moelab.store.jsonsafe import jsonable


def test_cv_histograms_count_every_neuron_once():
    rng = np.random.default_rng(0)
    cvs = [rng.lognormal(0, 1, 300), rng.lognormal(0.5, 1, 200), np.array([0.1, np.nan, np.inf, 50.0])]
    out = charts.cv_histograms(cvs)
    counts = np.array(out["counts"])
    assert counts.shape == (3, out["bins"]) and 10 <= out["bins"] <= 80
    totals = counts.sum(1) + np.array(out["overflow"]) + np.array(out["not_finite"]) + np.array(out["underflow"])
    assert totals.tolist() == [300, 200, 4]
    assert out["not_finite"][2] == 2 and out["overflow"][2] == 1 and out["underflow"] == [0, 0, 0]
    edges = np.array(out["edges"])
    assert (np.diff(edges) > 0).all() and edges[-1] == pytest.approx(out["clipped_at"], rel=1e-5)
    # log-spaced by default: equal steps in log CV, from the smallest positive CV
    assert out["scale"] == "log" and np.allclose(np.diff(np.log10(edges)), np.log10(edges[1] / edges[0]), rtol=1e-4)
    assert edges[0] == pytest.approx(min(c[np.isfinite(c)].min() for c in cvs), rel=1e-5)
    ref, _ = np.histogram(cvs[0][cvs[0] <= out["clipped_at"]], bins=edges)
    assert counts[0].tolist() == ref.tolist()
    assert charts.cv_histograms(cvs, bins=5)["bins"] == 5


def test_cv_histograms_log_bins_spread_a_heavy_tail_and_count_zeros_apart():
    """A lognormal CV (as profiles have: ~0.1 … 40): equal-width bins put nearly every neuron in the
    first bins, log bins spread them; a CV of exactly 0 cannot sit on a log axis and is counted apart."""
    rng = np.random.default_rng(2)
    cv = np.concatenate([rng.lognormal(0, 1.2, 2000), [0.0, 0.0]])
    lin = charts.cv_histograms([cv], bins=40, scale="linear")
    log = charts.cv_histograms([cv], bins=40, scale="log")
    share_top2 = lambda out: sum(sorted(out["counts"][0])[-2:]) / len(cv)  # noqa: E731
    assert share_top2(lin) > 0.35 and share_top2(log) < 0.15
    assert lin["underflow"] == [0] and log["underflow"] == [2] and lin["edges"][0] == 0.0
    assert sum(log["counts"][0]) + log["overflow"][0] + log["underflow"][0] == len(cv)
    with pytest.raises(ValueError, match="scale"):
        charts.cv_histograms([cv], scale="sqrt")


def test_cv_summary_quantiles_and_specialisation_ratio():
    cv = [np.linspace(0, 1, 101), np.linspace(0, 2, 101)]
    out = charts.cv_summary(cv, tau=0.5)
    assert out["median"] == pytest.approx([0.5, 1.0])
    assert out["specialisation_ratio"] == pytest.approx([50 / 101, 75 / 101])  # EW Eq. 4: share with CV > τ
    assert "specialisation_ratio" not in charts.cv_summary(cv)


def test_activation_tiles_average_ordered_neurons():
    rng = np.random.default_rng(1)
    values = rng.normal(size=(4, 10))
    cv = rng.uniform(size=10)
    out = charts.activation_tiles(values, ["a", "b", "c", "d"], cv, order="cv", max_cols=3)
    order = np.argsort(-cv)
    assert out["neurons_per_column"] == 4 and np.array(out["values"]).shape == (4, 3) and out["aggregated"]
    assert out["values"][0][0] == pytest.approx(values[0, order[:4]].mean(), abs=1e-5)
    assert out["values"][2][2] == pytest.approx(values[2, order[8:]].mean(), abs=1e-5)  # short last tile
    assert out["column_first_neuron"] == order[::4].tolist()
    full = charts.activation_tiles(values, list("abcd"), cv, order="index", normalize="neuron")
    assert not full["aggregated"] and np.abs(np.array(full["values"])).max(0) == pytest.approx(np.ones(10), abs=1e-5)
    by_task = charts.activation_tiles(values, list("abcd"), cv, order="task")
    peak = np.argmax(values, axis=0)[by_task["column_first_neuron"]]
    assert (np.diff(peak) >= 0).all()  # neurons grouped by the row they peak on
    rows = charts.activation_tiles(values, list("abcd"), cv, max_rows=2)
    assert rows["rows_per_row"] == 2 and len(rows["rows"]) == 2


def test_task_similarity_is_a_cosine_matrix():
    rng = np.random.default_rng(2)
    g = [rng.normal(size=(3, 8)), rng.normal(size=(3, 5))]
    out = charts.task_similarity(g, ["x", "y", "z"], centered=False)
    x = np.concatenate(g, axis=1)
    ref = (x @ x.T) / np.outer(np.linalg.norm(x, axis=1), np.linalg.norm(x, axis=1))
    assert np.array(out["matrix"]) == pytest.approx(ref, abs=1e-4)


def test_routing_heatmap_shares_and_static_layers():
    rec_a = {"results": {"converted": {"routing": {"load": {"0": [1, 3], "2": [2, 2, 4]}, "load_cv": {"0": 0.5, "2": float("nan")}}}}}
    rec_b = {"results": {"converted": {"routing": {"load": {"0": [4, 0]}, "load_cv": {"0": 1.0}}}}}
    out = charts.routing_heatmap([("ev-a", "A", rec_a), ("ev-b", "B", rec_b)])
    assert out["layers"] == [0, 2] and out["n_experts"] == 3 and out["sets"] == ["A", "B"]
    assert out["share"][0][0] == [0.25, 0.75, None] and out["share"][0][1] == [0.25, 0.25, 0.5]
    assert out["share"][1][1] == [None, None, None]  # layer 2 unseen in B
    assert out["load_cv"] == [[0.5, None], [1.0, None]]
    json.dumps(out, allow_nan=False)  # strict JSON
    with pytest.raises(KeyError):
        charts.routing_heatmap([("ev-a", "A", rec_a)], variant="uniform")


def test_jsonable_removes_nan_and_numpy_types():
    out = jsonable({"a": np.float32(np.nan), "b": [np.int64(3), np.array([1.0, np.inf])], 4: np.bool_(True)})
    assert out == {"a": None, "b": [3, [1.0, None]], "4": True}


def test_neuron_stats_histograms_count_every_neuron():
    rate = np.array([0.0, 0.1, 0.1, 0.5, 1.0])
    out = charts.neuron_stats(rate, np.array([1, 2, 3]), np.array([-1.0, 0.0, 0.5, 1.0]), np.array([4, 5]), bins=4)
    assert sum(out["rate_counts"]) == 5 and out["rate_edges"][-1] == 1.0 and out["rate_counts"][0] == 3
    assert out["h_counts"] == [1, 2, 3] and (out["h_below"], out["h_above"]) == (4, 5)
    json.dumps(out)
