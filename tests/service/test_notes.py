"""Runs as a notebook, through the service: notes and tags on every resource (PATCH …/notes, shown in
each answer, lists filtered by ?tag=, GET /tags), the evaluations list filtered by method, text,
status and words, and one evaluation's per-layer curves checked against its stored report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from .helpers import succeeded

API = "/api/v1"


@pytest.fixture(scope="module")
def two_evaluations(client, conversion_id):
    ids = []
    for source in ("builtin:code", "builtin:prose"):
        r = client.post(f"{API}/evaluations", json={"conversion_id": conversion_id, "source": source, "n_windows": 2, "seq_len": 32,
                                                    "baselines": False, "multiple_choice_per_task": 0})
        assert r.status_code == 202, r.text
        succeeded(client, r.json())
        ids.append(r.json()["id"])
    return ids


def test_notes_and_tags_on_every_resource_and_lists_filter_by_tag(client, model_id, calib_id, profile_id, conversion_id,
                                                                  two_evaluations):
    code_eval, prose_eval = two_evaluations
    for collection, ident in [("models", model_id), ("calibration-sets", calib_id), ("profiles", profile_id),
                              ("conversions", conversion_id), ("evaluations", code_eval)]:
        r = client.patch(f"{API}/{collection}/{ident}/notes", json={"notes": f"my {collection}", "tags": ["nb-run", collection]})
        assert r.status_code == 200, r.text
        assert r.json() == {"id": ident, "resource": collection, "notes": f"my {collection}", "tags": ["nb-run", collection]}
        got = client.get(f"{API}/{collection}/{ident}").json()
        assert got["notes"] == f"my {collection}" and got["tags"] == ["nb-run", collection]
        listed = client.get(f"{API}/{collection}", params={"tag": "nb-run"}).json()
        assert [i["id"] for i in listed["items"]] == [ident] and listed["total"] == 1
        assert client.get(f"{API}/{collection}", params={"tag": "no-such-tag"}).json()["items"] == []

    # add and remove keep the order and never duplicate; notes untouched when not given
    r = client.patch(f"{API}/evaluations/{code_eval}/notes", json={"add_tags": ["code", "nb-run"], "remove_tags": ["evaluations"]})
    assert r.json()["tags"] == ["nb-run", "code"] and r.json()["notes"] == "my evaluations"
    tags = {t["tag"]: t for t in client.get(f"{API}/tags").json()["items"]}
    assert tags["nb-run"]["count"] == 5 and tags["nb-run"]["resources"]["evaluations"] == 1 and tags["code"]["count"] == 1

    # '' clears the notes, [] the tags
    r = client.patch(f"{API}/models/{model_id}/notes", json={"notes": "", "tags": []})
    assert r.json()["notes"] is None and r.json()["tags"] == []


@pytest.mark.parametrize("body, fix", [
    ({}, "nothing to change"),
    ({"tags": ["a"], "add_tags": ["b"]}, "not both"),
    ({"tags": ["bad tag!"]}, "tags"),
    ({"tags": [f"t{i}" for i in range(17)]}, "tags"),
    ({"notes": "x" * 20_001}, "notes"),
    ({"colour": "red"}, "colour"),
])
def test_bad_notes_are_refused_and_nothing_stored_changes(client, conversion_id, body, fix):
    before = client.get(f"{API}/conversions/{conversion_id}").json()
    r = client.patch(f"{API}/conversions/{conversion_id}/notes", json=body)
    assert r.status_code == 422 and fix in r.text, r.text
    after = client.get(f"{API}/conversions/{conversion_id}").json()
    assert (after["notes"], after["tags"]) == (before["notes"], before["tags"])


def test_notes_on_an_unknown_resource_is_404_and_too_many_tags_by_adding_is_422(client, conversion_id):
    r = client.patch(f"{API}/profiles/pr-nothere/notes", json={"notes": "x"})
    assert r.status_code == 404 and "GET /api/v1/profiles" in r.text
    client.patch(f"{API}/conversions/{conversion_id}/notes", json={"tags": [f"t{i}" for i in range(16)]})
    r = client.patch(f"{API}/conversions/{conversion_id}/notes", json={"add_tags": ["one-more"]})
    assert r.status_code == 422 and "at most 16" in r.text
    client.patch(f"{API}/conversions/{conversion_id}/notes", json={"tags": []})


def test_evaluations_list_filters_by_method_text_status_and_words(client, conversion_id, two_evaluations):
    code_eval, prose_eval = two_evaluations
    client.patch(f"{API}/evaluations/{prose_eval}/notes", json={"notes": "Prose looks balanced"})

    def ids(**params):
        r = client.get(f"{API}/evaluations", params={"conversion_id": conversion_id, **params})
        assert r.status_code == 200, r.text
        return [i["id"] for i in r.json()["items"]]

    assert set(ids()) >= {code_eval, prose_eval}
    assert prose_eval in ids(text="builtin:prose") and code_eval not in ids(text="builtin:prose")
    assert set(ids(method="expertweaver")) >= {code_eval, prose_eval} and ids(method="cmoe") == []
    assert set(ids(status="ready")) >= {code_eval, prose_eval} and ids(status="failed") == []
    assert ids(q="prose BALANCED") == [prose_eval] and ids(q="balanced code") == []
    assert client.get(f"{API}/evaluations", params={"status": "done"}).status_code == 422


def test_layer_curves_are_the_stored_report_per_layer(client, data_root, settings, two_evaluations):
    ev = two_evaluations[0]
    curves = client.get(f"{API}/evaluations/{ev}/charts/layers").json()
    report = json.loads((settings.resolved_artifacts_dir() / "evaluations" / ev / "evaluation.json").read_text())
    converted = report["results"]["converted"]
    assert curves["text"] == "builtin:code" and curves["layers"] == list(range(len(converted["reconstruction_error"])))
    assert curves["reconstruction_error"] == pytest.approx(converted["reconstruction_error"])
    cv = converted["routing"]["load_cv"]
    assert curves["load_cv"] == pytest.approx([cv.get(str(i)) for i in curves["layers"]], abs=1e-5)  # 5 decimals
    for i, share in zip(curves["layers"], curves["share"], strict=True):
        load = np.asarray(converted["routing"]["load"][str(i)], dtype=float)
        assert share == pytest.approx((load / load.sum()).tolist(), abs=1e-5)
    r = client.get(f"{API}/evaluations/{ev}/charts/layers", params={"variant": "nope"})
    assert r.status_code == 422 and "no variant 'nope'" in r.text
