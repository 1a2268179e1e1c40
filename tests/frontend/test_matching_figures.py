"""Experts matched across conversions in the UI, on a fixed matching payload: B's experts are named
after A's matched ids ("B e2 ≙ A e0 (J=0.75)"), drawn in the colour of that A expert, placed in its
column; an unmatched expert says so and gets a colour no A expert has."""

from __future__ import annotations

import numpy as np

from frontend import figures as F
from frontend.token_view import expert_colour, routed_tokens


def _expert(e, size, match, j, best, best_j):
    return {"expert": e, "size": size, "match": match, "jaccard": j, "best": best, "best_jaccard": best_j}


#: layer 1: A has 2 experts, B 3: A e0 ≙ B e2 (0.75), A e1 ≙ B e0 (0.5); B e1 unmatched (best A e1, 0.2)
ENTRY = {"layer": 1, "n_a": 2, "n_b": 3, "mean_jaccard": 0.625, "shared_jaccard": 0.9, "shared_sizes": [10, 11],
         "a": [_expert(0, 4, 2, 0.75, 2, 0.75), _expert(1, 4, 0, 0.5, 0, 0.5)],
         "b": [_expert(0, 4, 1, 0.5, 1, 0.5), _expert(1, 2, None, None, 1, 0.2), _expert(2, 4, 0, 0.75, 0, 0.75)],
         "jaccard": [[0.0, 0.0, 0.75], [0.5, 0.2, 0.0]]}
MATCHING = {"a": "conv-a", "b": "conv-b", "method_a": "expertweaver", "method_b": "cmoe", "layers": [ENTRY],
            "skipped": [{"layer": 0, "reason": "layer 0 of conv-b is kept dense (no experts)"}]}


def test_labels_name_both_ids_and_the_overlap():
    assert F.matched_label(ENTRY, "b", 2) == "B e2 ≙ A e0 (J=0.75)"
    assert F.matched_label(ENTRY, "a", 1) == "A e1 ≙ B e0 (J=0.50)"
    assert F.matched_label(ENTRY, "b", 1) == "B e1, unmatched (most overlap: A e1, J=0.20)"
    assert F.best_match_text(ENTRY, "a", 0).startswith("best match in B: e2 (Jaccard 0.75 of their neurons); layer's mean")
    assert F.matched_layer(MATCHING, 1) is ENTRY and F.matched_layer(MATCHING, 0) is None
    assert F.skipped_reason(MATCHING, 0) == "layer 0 of conv-b is kept dense (no experts)"


def test_matched_b_experts_take_the_colour_of_their_a_expert():
    assert F.matched_colour_ids(ENTRY) == {0: 1, 2: 0, 1: 2}  # unmatched B e1: index 2, after A's two experts
    result = {"tokens": ["x", "y", "z"], "token_ids": [1, 2, 3],
              "layers": [{"layer": 1, "n_routed": 3, "top_k": 1, "experts": [[2], [0], [1]], "load": [1, 1, 1]}]}
    labels = {e: F.matched_label(ENTRY, "b", e) for e in range(3)}
    view = routed_tokens(result, 1, colour_ids=F.matched_colour_ids(ENTRY), labels=labels)
    spans = view.children[2].children
    assert [s.style["backgroundColor"] for s in spans] == [expert_colour(0), expert_colour(1), expert_colour(2)]
    assert [s.to_plotly_json()["props"]["data-expert"] for s in spans] == ["2", "0", "1"]  # B's own ids stay in the page
    assert spans[0].title == "token 0 'x' → experts B e2 ≙ A e0 (J=0.75) (best first)"
    chips = view.children[3].children[1:]
    assert [c.children for c in chips] == ["B e0 ≙ A e1 (J=0.50): 1", "B e1, unmatched (most overlap: A e1, J=0.20): 1",
                                           "B e2 ≙ A e0 (J=0.75): 1"]
    assert [c.style["backgroundColor"] for c in chips] == [expert_colour(1), expert_colour(2), expert_colour(0)]
    b_view = routed_tokens(result, 1, expert=2, colour_ids=F.matched_colour_ids(ENTRY), labels=labels)
    assert "expert B e2 ≙ A e0 (J=0.75): 1 of 3 tokens" in b_view.children[1].children


def test_overlap_heatmap_puts_matched_pairs_on_the_diagonal():
    fig = F.expert_overlap(ENTRY)
    fig.to_json()
    (hm,) = fig.data
    assert list(hm.x) == ["B e2 ≙ A e0 (J=0.75)", "B e0 ≙ A e1 (J=0.50)", "B e1, unmatched (most overlap: A e1, J=0.20)"]
    assert np.allclose(hm.z, [[0.75, 0.0, 0.0], [0.0, 0.5, 0.2]])
    assert hm.text[0][0] == "A e0 × B e2: J=0.75 (matched)" and "shared experts' Jaccard 0.90" in fig.layout.title.text


def test_matching_map_and_b_routing_at_a_ids():
    fig = F.matching_by_layer(MATCHING)
    fig.to_json()
    (hm,) = fig.data
    assert list(hm.y) == [0, 1] and [list(r) for r in hm.text] == [["", ""], ["B e2", "B e0"]]
    assert np.isnan(hm.z[0]).all() and list(hm.z[1]) == [0.75, 0.5]
    assert hm.customdata[0][0] == "layer 0 of conv-b is kept dense (no experts)"
    assert hm.customdata[1][0].startswith("layer 1: A e0 ≙ B e2 (J=0.75); best match in B: e2")
    heat = {"sets": ["code"], "layers": [0, 1], "n_experts": 3, "evaluations": ["e"], "load_cv": [[None, 0.1]],
            "share": [[[None] * 3, [0.5, 0.3, 0.2]]], "counts": [[[None] * 3, [5, 3, 2]]]}
    fig = F.routing_at_matched_ids(heat, MATCHING)
    fig.to_json()
    (hm,) = fig.data
    assert np.allclose(hm.z[1], [0.2, 0.5, 0.3])  # A e0's column: B e2; A e1's: B e0; then B's unmatched e1
    assert hm.customdata[1][0] == "layer 1: B e2 ≙ A e0 (J=0.75): share 0.2000"
    assert hm.customdata[0][0] == "layer 0: layer 0 of conv-b is kept dense (no experts)"
    rows = F.table("matching", MATCHING)
    assert rows[0] == {"layer": 1, "expert_a": 0, "expert_b": 2, "jaccard": 0.75, "best_b": 2, "best_jaccard": 0.75,
                       "mean_jaccard": 0.625, "shared_jaccard": 0.9}
