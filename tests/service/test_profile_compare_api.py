"""GET /profiles/compare and GET /profiles/{id}/neurons/search through HTTP against the real app and
stored profiles: synthetic profiles with planted set-specific neurons (``tests.engine.synthetic_profiles``)
published where the API keeps profiles, with their rows in its database (no job: ready)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from backend.profile_compare import scatter
from backend.routes.charts import PAYLOADS
from tests.engine.synthetic_profiles import CODE_NEURON, CODE_WORDS, PROSE_NEURON, code_and_prose, synthetic_profile
from moelab.engine.profiling.compare import LayerComparison, compare_profiles
from moelab.engine.profiling.store import StoredProfile

COMPARE = "/api/v1/profiles/compare"


@pytest.fixture(scope="module")
def api(tmp_path_factory, redis_url):
    """The API in-process on a fresh data dir with three ready profiles: code and prose of one model, and one of another model."""
    from fastapi.testclient import TestClient

    from backend.app import create_app
    from moelab.settings import Settings
    from moelab.store.db import CalibrationSet, Model, Profile

    root = tmp_path_factory.mktemp("profile-compare")
    settings = Settings(_env_file=None, data_dir=root / "data", redis_url=redis_url, redis_prefix="moelab-test-profile-compare:", api_token=None)
    app = create_app(settings)
    ids = {"code": "pr-c0de00000000000a", "prose": "pr-b00c00000000000b", "other": "pr-0e4e00000000000c"}
    with TestClient(app) as client:
        store = app.state.store
        code, prose = code_and_prose(root / "made")
        paths = {"code": code, "prose": prose,
                 "other": synthetic_profile(root / "made" / "other", CODE_WORDS, seed=3, source="someone/else")}
        with app.state.db.session() as s:
            s.add(Model(id="mod-cmp", name="tiny", source="default", kind="default", params={}))
            s.add(CalibrationSet(id="cal-cmp", name="synthetic", origin="builtin", params={}))
            s.flush()
            for name, ident in ids.items():
                s.add(Profile(id=ident, model_id="mod-cmp", calibration_set_id="cal-cmp", params={}))
                store.path("profiles", ident).parent.mkdir(parents=True, exist_ok=True)
                paths[name].rename(store.path("profiles", ident))
        yield client, ids, {k: StoredProfile.open(store.path("profiles", v)) for k, v in ids.items()}


def _get(client, url: str, **params):
    r = client.get(url, params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_compare_ranks_the_planted_neurons_with_their_snippets(api):
    client, ids, stored = api
    body = _get(client, COMPARE, a=ids["code"], b=ids["prose"], top=5, snippets=2)
    want = compare_profiles(stored["code"], stored["prose"])
    assert (body["a"], body["b"], body["n_layers"], body["d_ffn"]) == (ids["code"], ids["prose"], 3, [48, 48, 48])
    first_a, first_b = body["top_a"][0], body["top_b"][0]
    assert (first_a["layer"], first_a["neuron"]) == CODE_NEURON and first_a["specificity"] > 4
    assert (first_b["layer"], first_b["neuron"]) == PROSE_NEURON and first_b["specificity"] < -3
    engine = want.top(1, "a")[0]
    for key in ("mean_a", "mean_b", "std_a", "std_b", "rate_a", "rate_b", "cv_a", "cv_b"):
        assert first_a[key] == pytest.approx(engine[key], rel=1e-6), key
    assert first_a["specificity"] == pytest.approx(engine["d"], rel=1e-6)
    # snippets from each profile: A's strongest tokens for the planted neuron are " def"
    assert len(first_a["top_a"]) == 2 and len(first_a["top_b"]) == 2
    centre = [t for t in first_a["top_a"][0]["snippet"] if t["top"]]
    assert centre[0]["piece"] == " def" and all(t["piece"].strip() != "def" for s in first_a["top_b"] for t in s["snippet"])
    # shares and the scatter of the layer with most specific neurons (the default)
    assert body["layers"] == [pytest.approx(row) for row in want.shares(1.0)]
    assert body["layer"] == want.busiest_layer(1.0) and body["scatter"]["layer"] == body["layer"]
    one = _get(client, COMPARE, a=ids["code"], b=ids["prose"], layer=CODE_NEURON[0], threshold=2.5)
    sc, lay = one["scatter"], want.layers[CODE_NEURON[0]]
    assert sc["neurons"] == list(range(48)) and not sc["sampled"]
    assert sc["mean_a"] == pytest.approx(lay.mean_a.tolist(), rel=1e-5) and sc["specificity"] == pytest.approx(lay.d.tolist(), rel=1e-5)
    assert one["threshold"] == 2.5 and one["layers"][CODE_NEURON[0]]["n_specific_a"] == int((lay.d >= 2.5).sum())


def test_compare_swapped_flips_the_sides(api):
    client, ids, _ = api
    body = _get(client, COMPARE, a=ids["prose"], b=ids["code"], top=1, snippets=0)
    assert (body["top_a"][0]["layer"], body["top_a"][0]["neuron"]) == PROSE_NEURON and body["top_a"][0]["specificity"] > 3
    assert body["top_a"][0]["top_a"] == [] and (body["top_b"][0]["layer"], body["top_b"][0]["neuron"]) == CODE_NEURON


def test_compare_refusals_say_what_to_fix(api):
    client, ids, _ = api
    r = client.get(COMPARE, params={"a": ids["code"], "b": "pr-0000000000000000"})
    assert r.status_code == 404 and "no profile with id 'pr-0000000000000000'" in r.json()["detail"]
    r = client.get(COMPARE, params={"a": ids["code"], "b": ids["other"]})
    assert r.status_code == 422 and "someone/else" in r.json()["detail"] and "choose two profiles of the same model" in r.json()["detail"]
    r = client.get(COMPARE, params={"a": ids["code"], "b": ids["code"]})
    assert r.status_code == 422 and "same profile" in r.json()["detail"]
    r = client.get(COMPARE, params={"a": ids["code"], "b": ids["prose"], "layer": 3})
    assert r.status_code == 422 and "use 0 … 2" in r.json()["detail"]
    for bad in ({"threshold": 0}, {"threshold": "inf"}, {"top": 101}, {"max_points": 5}):
        assert client.get(COMPARE, params={"a": ids["code"], "b": ids["prose"], **bad}).status_code == 422, bad
    assert client.get(COMPARE, params={"a": ids["code"]}).status_code == 422  # b missing


def test_compare_bodies_are_cached_per_pair(api):
    client, ids, _ = api
    params = {"a": ids["code"], "b": ids["prose"], "layer": 0, "threshold": 1.25}
    t0 = time.perf_counter()
    first = client.get(COMPARE, params=params)
    cold = time.perf_counter() - t0
    hits = PAYLOADS.hits
    t0 = time.perf_counter()
    again = client.get(COMPARE, params=params)
    warm = time.perf_counter() - t0
    assert PAYLOADS.hits == hits + 1 and again.content == first.content
    print(f"compare on a 3 × 48-neuron profile pair: {cold * 1000:.1f} ms first, {warm * 1000:.1f} ms cached")


def test_scatter_of_a_wide_layer_keeps_every_specific_neuron():
    n = 5000
    d = np.zeros(n, dtype=np.float32)
    d[[7, 4000, 4999]] = [3.0, -2.0, 1.5]
    zeros = np.zeros(n, dtype=np.float32)
    lay = LayerComparison(layer=4, d=d, p=zeros, q=zeros, mean_a=np.arange(n, dtype=np.float32), mean_b=zeros, std_a=zeros, std_b=zeros, rate_a=zeros,
                          rate_b=zeros, cv_a=zeros, cv_b=zeros)
    out = scatter(lay, threshold=1.0, max_points=200)
    assert out["sampled"] and len(out["neurons"]) == 200 and {7, 4000, 4999} <= set(out["neurons"])
    assert out["neurons"] == sorted(out["neurons"]) and out["mean_a"] == [float(i) for i in out["neurons"]]
    assert "200 of 5000 neurons of layer 4: all 3 drawn specific ones" in out["note"]


def test_search_by_token_range_and_specificity(api):
    client, ids, stored = api
    url = f"/api/v1/profiles/{ids['code']}/neurons/search"
    hits = _get(client, url, token="def")
    assert hits["total"] == 1 and (hits["items"][0]["layer"], hits["items"][0]["neuron"]) == CODE_NEURON
    assert hits["items"][0]["tokens"] == [" def"] and hits["items"][0]["specificity"] is None
    # whole tokens by default ("in" is not "print" or "import"); a part of a token on request; case as asked
    whole, part = _get(client, url, token=" in ", limit=500), _get(client, url, token="in", match="substring", limit=500)
    assert {t for i in whole["items"] for t in i["tokens"]} == {" in"}
    assert {" in", " print"} <= {t for i in part["items"] for t in i["tokens"]} and part["total"] > whole["total"]
    assert _get(client, url, token="DEF")["total"] == 1 and _get(client, url, token="DEF", case_sensitive="true")["total"] == 0
    t0 = time.perf_counter()
    vs = _get(client, url, vs=ids["prose"], min_specificity=1.0, limit=500)
    took = time.perf_counter() - t0
    d = np.concatenate([lay.d for lay in compare_profiles(stored["code"], stored["prose"]).layers])
    assert vs["sort"] == "specificity" and vs["total"] == int((d >= 1.0).sum())
    assert (vs["items"][0]["layer"], vs["items"][0]["neuron"]) == CODE_NEURON and "against profile" in vs["note"]
    cv = stored["code"].neurons["cv"].to_numpy()
    ranged = _get(client, url, cv_min=0.05, cv_max=0.2, sort="cv", descending="false", limit=7, offset=3)
    assert ranged["total"] == int(((cv >= 0.05) & (cv <= 0.2)).sum()) and len(ranged["items"]) == 7
    everything = _get(client, url, cv_min=0.05, cv_max=0.2, sort="cv", descending="false", limit=500)["items"]
    assert ranged["items"] == everything[3:10]
    print(f"search with vs on a 3 × 48-neuron profile pair: {took * 1000:.1f} ms")


@pytest.mark.parametrize("params, status, message", [
    ({"cv_min": 2, "cv_max": 1}, 422, "cv: the lower bound (2) is above the upper bound (1)"),
    ({"min_specificity": 1}, 422, "add vs=<profile id>"),
    ({"sort": "specificity"}, 422, "add vs=<profile id>"),
    ({"vs": "pr-0e4e00000000000c"}, 422, "choose two profiles of the same model"),
    ({"vs": "pr-c0de00000000000a"}, 422, "same profile"),
    ({"vs": "pr-0000000000000000"}, 404, "no profile with id"),
    ({"layer": 5}, 422, "use 0 … 2"),
    ({"limit": 501}, 422, "500"),
    ({"rate_max": 2}, 422, "1"),
    ({"cv_min": "nan"}, 422, ""),
    ({"token": "   "}, 422, "only whitespace"),
])
def test_search_refusals_name_the_filter(api, params, status, message):
    client, ids, _ = api
    r = client.get(f"/api/v1/profiles/{ids['code']}/neurons/search", params=params)
    assert r.status_code == status, r.text
    assert message in str(r.json()["detail"])
