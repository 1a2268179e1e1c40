"""The compare-profiles figures and tables say what the payload says: the scatter's points, colours and
axis titles, the per-layer share bars, the most-specific tables and their links to neuron cards, and
the page's refusals of profiles of different models (pure functions, no browser)."""

from __future__ import annotations

import pytest

import frontend.app  # noqa: F401  (instantiates the Dash app: the page modules register with it)
from frontend import figures as F
from frontend.names import Names
from frontend.pages import profile_compare as P


def _neuron(layer: int, neuron: int, d: float, piece: str = " def") -> dict:
    top = [{"rank": 0, "token": 5, "sample": 0, "position": 3, "value": 1.5, "task": "t0", "domain": None, "group": "t0",
            "snippet": [{"token": 4, "position": 2, "piece": " x", "value": None, "top": False},
                        {"token": 5, "position": 3, "piece": piece, "value": 1.5, "top": True}]}]
    return {"layer": layer, "neuron": neuron, "specificity": d, "mean_a": 0.7, "mean_b": -0.1, "std_a": 0.2, "std_b": 0.2,
            "rate_a": 0.6, "rate_b": 0.1, "cv_a": 0.1, "cv_b": 0.2, "top_a": top, "top_b": []}


PAYLOAD = {
    "a": "pr-aaaaaaaaaaaaaaaa", "b": "pr-bbbbbbbbbbbbbbbb", "model": "tiny", "n_layers": 3, "d_ffn": [4, 4, 4], "n_samples_a": 10,
    "n_samples_b": 12, "threshold": 1.0, "fdr": 0.05, "score": "d", "layer": 1,
    "scatter": {"layer": 1, "neurons": [0, 1, 2, 3], "mean_a": [0.1, 0.7, -0.2, 0.3], "mean_b": [0.1, -0.1, 0.4, 0.3],
                "specificity": [0.0, 5.9, -3.0, 0.2], "sampled": False, "note": "all 4 neurons of layer 1"},
    "layers": [{"layer": i, "d_ffn": 4, "n_specific_a": a, "n_specific_b": b, "share": (a + b) / 4, "share_a": a / 4, "share_b": b / 4,
                "n_large_a": a + 1, "n_large_b": b} for i, (a, b) in enumerate([(0, 0), (1, 1), (2, 0)])],
    "top_a": [_neuron(1, 1, 5.9), _neuron(2, 3, 1.2)], "top_b": [_neuron(1, 2, -3.0, " rain")], "note": "10 samples of A against 12 of B",
}


def test_scatter_puts_each_neuron_at_its_two_means_coloured_by_d():
    fig = F.specificity_scatter(PAYLOAD, ("code", "literature"))
    trace = fig.data[0]
    assert list(trace.x) == [0.1, 0.7, -0.2, 0.3] and list(trace.y) == [0.1, -0.1, 0.4, 0.3]
    assert list(trace.marker.color) == [0.0, 5.9, -3.0, 0.2]
    assert [int(c[0]) for c in trace.customdata] == [0, 1, 2, 3]  # hover names the neuron
    assert trace.marker.cmin == -trace.marker.cmax and trace.marker.cmax >= 2.0  # symmetric: white at d = 0
    assert fig.layout.xaxis.title.text == "mean gate activation on A: code"
    assert fig.layout.yaxis.title.text == "mean gate activation on B: literature"
    assert "Layer 1" in fig.layout.title.text and "|d| ≥ 1" in fig.layout.title.text
    diagonal = fig.layout.shapes[0]
    assert (diagonal.x0, diagonal.y0, diagonal.x1, diagonal.y1) == (-0.2, -0.2, 0.7, 0.7)


def test_share_bars_stack_each_sides_percentage_per_layer():
    fig = F.specific_share_bars(PAYLOAD, ("code", "literature"))
    a, b = fig.data
    assert list(a.x) == [0, 1, 2] and list(a.y) == [0, 25, 50] and list(b.y) == [0, 25, 0]
    assert a.name == "specific to A: code" and b.name == "specific to B: literature"
    assert list(a.customdata) == [0, 1, 2] and fig.layout.barmode == "stack"
    assert list(a.marker.line.width) == [0, 2, 0]  # the scatter's layer outlined
    assert fig.layout.xaxis.title.text == "layer" and fig.layout.yaxis.title.text == "% of the layer's neurons"
    # the note says what the test kept: 4 specific of the 7 with a large gap, at the stated q
    assert "false-discovery rate q ≤ 0.05 (Benjamini–Hochberg over every neuron): 4 of the 7 neurons with that gap" in fig.layout.title.text


def test_tables_list_the_most_specific_neurons_with_links_to_their_cards():
    rows = F.specific_rows(PAYLOAD, "a")
    assert [(r["rank"], r["layer"], r["neuron"], r["d"]) for r in rows] == [(1, 1, 1, 5.9), (2, 2, 3, 1.2)]
    table = P.specific_table(PAYLOAD, "a")
    first = table.children[1]
    links = [c for c in first.children[1].children if hasattr(c, "href")]
    assert links[0].children == "layer 1 · neuron 1" and links[0].href == "/neurons?profile=pr-aaaaaaaaaaaaaaaa&layer=1&neuron=1"
    assert links[1].href == "/neurons?profile=pr-bbbbbbbbbbbbbbbb&layer=1&neuron=1"
    assert first.children[2].children == "5.9"
    b_table = P.specific_table(PAYLOAD, "b")
    assert b_table.children[1].children[1].children[0].href == "/neurons?profile=pr-bbbbbbbbbbbbbbbb&layer=1&neuron=2"
    assert F.table("profile-compare", PAYLOAD)[1] == {"layer": 1, "neuron": 1, "mean_a": 0.7, "mean_b": -0.1, "d": 5.9}


def test_search_results_link_to_the_searched_profile():
    found = {"profile_id": "pr-aaaaaaaaaaaaaaaa", "note": "1 neurons match", "items": [
        {"layer": 1, "neuron": 17, "cv": 0.1, "rate": 0.6, "mean": 0.7, "abs_mean": 0.7, "std": 0.1, "specificity": 5.9, "tokens": [" def"]}]}
    out = P.search_table(found)
    row = out.children[1].children[1]
    assert row.children[0].children.href == "/neurons?profile=pr-aaaaaaaaaaaaaaaa&layer=1&neuron=17"
    assert row.children[5].children == "' def'"


NAMES = Names.from_lists(
    [{"id": "mod-1", "name": "SmolLM2"}, {"id": "mod-2", "name": "Other"}],
    [{"id": "cal-1", "name": "code"}, {"id": "cal-2", "name": "literature"}],
    [{"id": "pr-1", "model_id": "mod-1", "calibration_set_id": "cal-1"}, {"id": "pr-2", "model_id": "mod-1", "calibration_set_id": "cal-2"},
     {"id": "pr-3", "model_id": "mod-2", "calibration_set_id": "cal-2"}],
)


@pytest.mark.parametrize("a, b, said", [
    ("pr-1", "pr-3", "A is a profile of SmolLM2, B of Other: these are different models"),
    ("pr-1", "pr-1", "the same profile"),
    ("pr-1", None, "choose two ready profiles of the same model"),
    ("pr-1", "pr-2", None),
])
def test_profiles_of_different_models_are_refused_in_words(a, b, said):
    problem = P.model_problem(a, b, NAMES)
    assert (problem is None) if said is None else (said in problem)


def test_b_offers_profiles_of_as_model_first_and_disables_the_others():
    options = [{"label": f"p{i}", "value": f"pr-{i}"} for i in (3, 2, 1)]
    out = P.b_options(options, "pr-1", NAMES)
    assert [o["value"] for o in out] == ["pr-2", "pr-1", "pr-3"]
    assert out[2]["disabled"] and out[2]["label"] == "p3 (another model)" and not out[0].get("disabled")
    assert P.set_names("pr-1", "pr-2", NAMES) == ("code", "literature")
