"""GET /conversions/{a}/matching/{b} through the service: two conversions of one model (k-means
seeds 0 and 1) matched by their neuron sets as the experts endpoint lists them, the assignment
optimal; unknown ids 404; a conversion of another model 422 saying what to choose."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from tests.conftest import build_tiny_model, tiny_models_root

from .conftest import SMALL_PROFILE
from .helpers import succeeded

EW = {"n_experts": 8, "alpha_max": 0.5}


def _convert(client, profile_id: str, **params) -> str:
    r = client.post("/api/v1/conversions", json={"profile_id": profile_id, "expertweaver": {**EW, **params}})
    assert r.status_code == 202, r.text
    succeeded(client, r.json())
    return r.json()["id"]


@pytest.fixture(scope="module")
def reseeded(client, profile_id) -> str:
    return _convert(client, profile_id, seed=1)


def _sets(client, conversion: str, layer: int) -> tuple[list[set[int]], set[int]]:
    got = client.get(f"/api/v1/conversions/{conversion}/experts/{layer}").json()
    return [set(e["neurons"]) for e in got["experts"]], set(got["shared"])


def test_two_conversions_of_one_model_are_matched_by_their_neurons(client, conversion_id, reseeded):
    r = client.get(f"/api/v1/conversions/{conversion_id}/matching/{reseeded}")
    assert r.status_code == 200, r.text
    whole = r.json()
    assert (whole["a"], whole["b"], whole["method_a"], whole["skipped"]) == (conversion_id, reseeded, "expertweaver", [])
    assert [m["layer"] for m in whole["layers"]] == [0, 1, 2] and all(m["jaccard"] is None for m in whole["layers"])
    for entry in whole["layers"]:
        layer = entry["layer"]
        one = client.get(f"/api/v1/conversions/{conversion_id}/matching/{reseeded}", params={"layer": layer}).json()
        (m,) = one["layers"]
        assert {**m, "jaccard": None} == entry  # one layer = that layer of the whole answer (plus its matrix)
        (a, shared_a), (b, shared_b) = _sets(client, conversion_id, layer), _sets(client, reseeded, layer)
        hand = np.array([[len(x & y) / len(x | y) for y in b] for x in a])
        assert np.allclose(m["jaccard"], hand, atol=1e-4)
        rows, cols = linear_sum_assignment(hand, maximize=True)
        matched = [(e["expert"], e["match"]) for e in m["a"] if e["match"] is not None]
        assert sum(hand[i, j] for i, j in matched) == pytest.approx(hand[rows, cols].sum(), abs=1e-9)  # optimal
        assert m["mean_jaccard"] == pytest.approx(hand[rows, cols].mean(), abs=1e-4)
        assert all(m["b"][j]["match"] == i and m["b"][j]["jaccard"] == e["jaccard"]
                   for i, j in matched for e in [m["a"][i]])
        assert [e["best_jaccard"] for e in m["a"]] == pytest.approx(hand.max(axis=1).tolist(), abs=1e-4)
        assert m["shared_jaccard"] == pytest.approx(len(shared_a & shared_b) / len(shared_a | shared_b), abs=1e-4)
    same = client.get(f"/api/v1/conversions/{conversion_id}/matching/{conversion_id}").json()
    assert all(e["match"] == e["expert"] and e["jaccard"] == 1.0 for m in same["layers"] for e in m["a"])


def test_refusals_say_what_to_fix(client, conversion_id, calib_id, tmp_path_factory, default_model_dir):
    r = client.get(f"/api/v1/conversions/{conversion_id}/matching/conv-0000000000000000")
    assert r.status_code == 404 and "no conversion with id 'conv-0000000000000000'" in r.json()["detail"]
    r = client.get(f"/api/v1/conversions/{conversion_id}/matching/{conversion_id}", params={"layer": 3})
    assert r.status_code == 422 and "layer 3 does not exist: the model has 3 layers, use 0 … 2" in r.json()["detail"]

    path = build_tiny_model("qwen2", tiny_models_root(tmp_path_factory) / "matching-qwen2", default_model_dir, seed=1)
    m = client.post("/api/v1/models", json={"source": str(path)})
    if m.status_code == 202:
        succeeded(client, m.json())
    p = client.post("/api/v1/profiles", json={"model_id": m.json()["id"], "calibration_set_id": calib_id, **SMALL_PROFILE})
    succeeded(client, p.json())
    other = _convert(client, p.json()["id"])
    r = client.get(f"/api/v1/conversions/{conversion_id}/matching/{other}")
    detail = r.json()["detail"]
    assert r.status_code == 422 and f"{other} is a conversion of {path}" in detail, detail
    assert "different dense models" in detail and "choose two conversions of the same model" in detail
