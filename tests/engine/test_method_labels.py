"""A conversion's key parameters in words, from its method's declaration (``Method.label``): what the
API returns as ``label`` and every page shows after the method's name."""

from __future__ import annotations

import pytest

from moelab.engine.methods import conversion_label
from moelab.engine.methods.labels import num, pct


@pytest.mark.parametrize("params, words", [
    ({"method": "expertweaver", "n_experts": 64, "alpha_min": 0.2, "alpha_max": 0.7, "tau": 0.6, "sparsity": 0.25,
      "router": "centroid", "plan": "paper"}, "64 experts, α 0.2–0.7, τ 0.6, sparsity 25%, centroid router"),
    # an option the record lacks is left out, never shown blank
    ({"method": "expertweaver", "n_experts": 8, "sparsity": 0.5}, "8 experts, sparsity 50%"),
    ({"method": "expertweaver", "n_experts": 128, "sparsity": 0.5, "down_keep": 0.5, "compensation": "skipped_mean"},
     "128 experts, sparsity 50%, skipped-expert means, down 50% kept"),
    ({"method": "cmoe", "n_experts": 64, "shared": 1, "active": 1, "router": "representative", "plan": "budget"},
     "S1·A1·E64, representative router, budget plan"),
    ({"method": "hierarchical", "n_experts": 4, "shared": 0, "active": 2}, "S0·A2·E4"),
    ({"method": "dense2moe", "delta": 0.3, "layer": None, "n_fused": 0, "top_k": 1}, "δ 0.3, l* auto, n* auto, top-1"),
    ({"method": "dense2moe", "delta": 0.3, "layer": 5, "n_fused": 3, "top_k": 2}, "δ 0.3, l* 5, n* 3, top-2"),
    ({"method": "midas", "keep_ratio": 0.25, "top_k": 2}, "keep 25%, top-2"),
    # a record from before the method registry (allocation block) reads as today's
    ({"allocation": {"method": "cmoe", "n_experts": 8, "shared": 2, "active": 2}}, "S2·A2·E8"),
])
def test_each_method_names_its_conversions_in_its_papers_words(params, words):
    assert conversion_label(params) == words


def test_values_read_as_a_person_reads_them():
    assert num(0.5182291666666666) == "0.5182" and num(None) == "?" and num(3) == "3"
    assert pct(0.969) == "96.9%" and pct(0.25) == "25%" and pct(None) == "?" and pct(True) == "?"


def test_an_unknown_method_still_gets_words():
    assert conversion_label({"method": "gone", "k": 2, "ratio": 0.125, "tau": 0.5, "x": 1}) == "k 2, ratio 0.125, tau 0.5"
