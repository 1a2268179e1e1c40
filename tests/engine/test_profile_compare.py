"""Two profiles compared neuron by neuron (``profiling.compare``) and neuron search (``profiling.search``)
on synthetic stored profiles with planted set-specific neurons (``synthetic_profiles``)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.engine.synthetic_profiles import CODE_NEURON, CODE_WORDS, PROSE_NEURON, code_and_prose, synthetic_profile
from moelab.engine.profiling.compare import CompareError, DifferentModels, compare_profiles, sample_moments, specificity
from moelab.engine.profiling.search import NeuronQuery, NeuronTable, SearchError, TopTokenIndex, search_neurons
from moelab.engine.profiling.store import StoredProfile


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    a, b = code_and_prose(tmp_path_factory.mktemp("compare"))
    return StoredProfile.open(a), StoredProfile.open(b)


def test_planted_neurons_rank_first_with_their_sign(pair):
    comp = compare_profiles(*pair)
    first_a, first_b = comp.top(3, "a")[0], comp.top(3, "b")[0]
    assert (first_a["layer"], first_a["neuron"]) == CODE_NEURON and first_a["d"] > 4
    assert (first_b["layer"], first_b["neuron"]) == PROSE_NEURON and first_b["d"] < -3
    assert first_a["mean_a"] > first_a["mean_b"] and first_b["mean_b"] > first_b["mean_a"]
    # ordered: d descending on A's side, ascending on B's
    assert [r["d"] for r in comp.top(10, "a")] == sorted((r["d"] for r in comp.top(10, "a")), reverse=True)
    assert [r["d"] for r in comp.top(10, "b")] == sorted(r["d"] for r in comp.top(10, "b"))
    # swapping the profiles swaps the sides and the sign
    swapped = compare_profiles(pair[1], pair[0]).top(1, "a")[0]
    assert (swapped["layer"], swapped["neuron"]) == PROSE_NEURON and swapped["d"] == pytest.approx(-first_b["d"], rel=1e-6)
    assert comp.n_samples == (10, 10) and comp.d_ffn == [48, 48, 48]


def test_one_neurons_specificity_matches_the_formula_by_hand(pair):
    """d of neuron (0, 3) from the stored per-sample means with plain Python statistics."""
    layer, neuron = 0, 3
    xa = [float(v) for v in load_file(str(pair[0].path / "activations.safetensors"))[f"layers.{layer}.sample_means"][:, neuron]]
    xb = [float(v) for v in load_file(str(pair[1].path / "activations.safetensors"))[f"layers.{layer}.sample_means"][:, neuron]]
    mu_a, mu_b = statistics.fmean(xa), statistics.fmean(xb)
    sd_a, sd_b = statistics.stdev(xa), statistics.stdev(xb)  # ddof 1
    by_hand = (mu_a - mu_b) / math.sqrt((sd_a**2 + sd_b**2) / 2 + 1e-12)
    lay = compare_profiles(*pair).layers[layer]
    assert float(lay.d[neuron]) == pytest.approx(by_hand, rel=1e-5)
    assert float(lay.mean_a[neuron]) == pytest.approx(mu_a, rel=1e-5) and float(lay.std_b[neuron]) == pytest.approx(sd_b, rel=1e-5)
    rates = pair[0].column_by_layer("rate")[layer]
    assert float(lay.rate_a[neuron]) == pytest.approx(float(rates[neuron]))


def test_shares_count_large_gaps_that_survive_the_false_discovery_control(pair):
    comp = compare_profiles(*pair)
    for threshold in (0.5, 1.0, 2.0):
        for fdr in (0.05, 0.2):
            for row, lay in zip(comp.shares(threshold, fdr), comp.layers, strict=True):
                assert row["n_large_a"] == int((lay.d >= threshold).sum()) and row["n_large_b"] == int((lay.d <= -threshold).sum())
                assert row["n_specific_a"] == int(((lay.d >= threshold) & (lay.q <= fdr)).sum())
                assert row["n_specific_b"] == int(((lay.d <= -threshold) & (lay.q <= fdr)).sum())
                assert row["share"] == pytest.approx((row["n_specific_a"] + row["n_specific_b"]) / 48)
    # the planted neurons are found; of the noise neurons' large gaps (10 samples a side) the test keeps none
    rows = comp.shares(0.5)
    assert sum(r["n_specific_a"] + r["n_specific_b"] for r in rows) == 2
    assert sum(r["n_large_a"] + r["n_large_b"] for r in rows) > 20
    assert rows[CODE_NEURON[0]]["n_specific_a"] >= 1 and rows[PROSE_NEURON[0]]["n_specific_b"] >= 1
    with pytest.raises(CompareError, match="threshold must be > 0"):
        comp.shares(0)
    with pytest.raises(CompareError, match="fdr must be in"):
        comp.shares(1.0, 0)


def test_the_test_and_its_correction_match_scipy_on_the_raw_samples(pair):
    """Welch's p of neuron (0, 3) from the stored per-sample means with scipy's own t-test, and BH by hand
    over every neuron of every layer (one family)."""
    from scipy.stats import ttest_ind

    layer, neuron = 0, 3
    xa = load_file(str(pair[0].path / "activations.safetensors"))[f"layers.{layer}.sample_means"][:, neuron].astype(np.float64)
    xb = load_file(str(pair[1].path / "activations.safetensors"))[f"layers.{layer}.sample_means"][:, neuron].astype(np.float64)
    comp = compare_profiles(*pair)
    assert comp.layers[layer].p[neuron] == pytest.approx(ttest_ind(xa, xb, equal_var=False).pvalue, rel=1e-6)
    p = np.concatenate([lay.p for lay in comp.layers])
    m, order = p.size, np.argsort(p)
    ranked = p[order] * m / np.arange(1, m + 1)
    by_hand = np.empty(m)
    by_hand[order] = np.minimum(1, np.minimum.accumulate(ranked[::-1])[::-1])
    assert np.allclose(np.concatenate([lay.q for lay in comp.layers]), by_hand)
    row = comp.top(1, "a")[0]
    assert row["q"] <= 0.05 and row["p"] <= row["q"]


def test_a_constant_neuron_is_not_specific():
    same = sample_moments(np.ones((4, 2)))
    assert specificity(same, same).tolist() == [0.0, 0.0]


def test_profiles_of_different_models_are_refused(pair, tmp_path):
    other = StoredProfile.open(synthetic_profile(tmp_path / "other", CODE_WORDS, seed=3, source="someone/else"))
    with pytest.raises(DifferentModels, match="different models.*choose two profiles of the same model"):
        compare_profiles(pair[0], other)
    wider = StoredProfile.open(synthetic_profile(tmp_path / "wider", CODE_WORDS, seed=3, d_ffn=64))
    with pytest.raises(DifferentModels, match="d_ffn 48.*d_ffn 64.*models of different shapes"):
        compare_profiles(pair[0], wider)
    single = StoredProfile.open(synthetic_profile(tmp_path / "single", CODE_WORDS, seed=3, n_samples=1))
    with pytest.raises(CompareError, match="at least 2 samples"):
        compare_profiles(pair[0], single)


def test_search_filters_sorts_and_pages(pair):
    profile = pair[0]
    table, top = NeuronTable.of(profile), TopTokenIndex.of(profile)
    comp = compare_profiles(*pair)

    hits = search_neurons(table, NeuronQuery(token="DEF"), comp, top)  # case-insensitive by default
    assert hits.total == 1 and (hits.items[0]["layer"], hits.items[0]["neuron"]) == CODE_NEURON
    assert hits.items[0]["tokens"] == [" def"] and hits.items[0]["specificity"] > 4
    assert search_neurons(table, NeuronQuery(token="DEF", case_sensitive=True), comp, top).total == 0

    d = np.concatenate([lay.d for lay in comp.layers])
    specific = search_neurons(table, NeuronQuery(min_specificity=1.0, limit=500), comp)
    assert specific.sort == "specificity" and specific.total == int((d >= 1.0).sum())
    assert [i["specificity"] for i in specific.items] == sorted((i["specificity"] for i in specific.items), reverse=True)

    cv = profile.neurons.sort_values(["layer", "neuron"])["cv"].to_numpy()
    ranged = search_neurons(table, NeuronQuery(cv_min=0.1, cv_max=0.5, layer=2, descending=False, limit=500))
    inside = (cv >= 0.1) & (cv <= 0.5) & (table.layer == 2)
    assert ranged.total == int(inside.sum()) and all(0.1 <= i["cv"] <= 0.5 and i["layer"] == 2 for i in ranged.items)
    assert [i["cv"] for i in ranged.items] == sorted(i["cv"] for i in ranged.items)

    whole = search_neurons(table, NeuronQuery(sort="rate", limit=40)).items
    pages = search_neurons(table, NeuronQuery(sort="rate", limit=20)).items + search_neurons(table, NeuronQuery(sort="rate", offset=20, limit=20)).items
    assert [(i["layer"], i["neuron"]) for i in pages] == [(i["layer"], i["neuron"]) for i in whole]


@pytest.mark.parametrize("query, compared, message", [
    (NeuronQuery(cv_min=2, cv_max=1), False, "cv: the lower bound"),
    (NeuronQuery(rate_min=1.5), False, "rate_min: an activation rate is a fraction"),
    (NeuronQuery(min_specificity=1), False, "add vs=<profile id>"),
    (NeuronQuery(sort="specificity"), False, "add vs=<profile id>"),
    (NeuronQuery(layer=3), True, "the profile has 3 layers, use 0 … 2"),
    (NeuronQuery(token="  "), True, "only whitespace"),
    (NeuronQuery(limit=501), True, "limit: 1 … 500"),
])
def test_bad_searches_say_what_to_change(query, compared, message):
    with pytest.raises(SearchError, match=message):
        query.check(n_layers=3, compared=compared, has_top_tokens=True)


def test_a_token_search_needs_top_tokens():
    with pytest.raises(SearchError, match="keeps no top tokens.*re-profile"):
        NeuronQuery(token="def").check(n_layers=3, compared=False, has_top_tokens=False)
