"""Probes through the service: a real worker routes a text's tokens through a conversion and
generates from a prompt with the dense and the converted model; the API only queues and reads."""

from __future__ import annotations

from .helpers import succeeded

TEXT = "def add(a, b):\n    return a + b  # the sum of two numbers"


def test_routing_probe_colours_every_token_of_the_text(client, conversion_id):
    r = client.post("/api/v1/probes", json={"conversion_id": conversion_id, "kind": "routing", "text": TEXT})
    assert r.status_code == 202, r.text
    probe = r.json()
    assert probe["status"] == "queued" and probe["params"]["kind"] == "routing"
    succeeded(client, probe)
    got = client.get(f"/api/v1/probes/{probe['id']}").json()
    result = client.get(f"/api/v1/probes/{probe['id']}/result").json()
    n = len(result["tokens"])
    assert got["summary"]["n_tokens"] == n == len(result["token_ids"]) and "".join(result["tokens"]).startswith("def add")
    conv = client.get(f"/api/v1/conversions/{conversion_id}").json()
    routed = {lay["layer"]: lay for lay in conv["layers"] if (lay.get("top_k") or 0) > 0}
    assert [lay["layer"] for lay in result["layers"]] == sorted(routed) == got["summary"]["layers"]
    for lay in result["layers"]:  # every token has the layer's top-k distinct experts, all in range
        assert len(lay["experts"]) == n and all(len(set(e)) == lay["top_k"] == len(e) for e in lay["experts"])
        assert all(0 <= x < lay["n_routed"] for e in lay["experts"] for x in e) and sum(lay["load"]) == n * lay["top_k"]
    listed = client.get("/api/v1/probes", params={"conversion_id": conversion_id, "kind": "routing"}).json()
    assert probe["id"] in [p["id"] for p in listed["items"]]


def test_held_out_sample_and_generation(client, conversion_id):
    r = client.post("/api/v1/probes", json={"conversion_id": conversion_id, "kind": "generate", "sample_source": "builtin:prose",
                                            "sample": 2, "max_new_tokens": 5})
    assert r.status_code == 202, r.text
    succeeded(client, r.json())
    s = client.get(f"/api/v1/probes/{r.json()['id']}").json()["summary"]
    for side in ("dense", "converted"):
        assert 1 <= s[side]["new_tokens"] <= 5 and s[side]["tokens_per_s"] > 0
    assert s["speedup"] == s["converted"]["tokens_per_s"] / s["dense"]["tokens_per_s"]
    assert s["text"]  # the held-out sample's text, resolved by the worker


def test_bad_probes_are_refused_with_what_to_fix(client, conversion_id, profile_id):
    cases = [
        ({"conversion_id": conversion_id, "kind": "routing"}, 422, "exactly one of text or sample_source"),
        ({"conversion_id": conversion_id, "text": "hi", "sample_source": "builtin:code"}, 422, "exactly one"),
        ({"conversion_id": conversion_id, "text": "   "}, 422, "blank"),
        ({"conversion_id": conversion_id, "sample_source": "builtin:nope"}, 422, "builtin:code"),
        ({"conversion_id": conversion_id, "sample_source": "builtin:code", "sample": 48}, 422, "sample"),
        ({"conversion_id": conversion_id, "text": "hi", "kind": "train"}, 422, "kind"),
        ({"conversion_id": conversion_id, "text": "hi", "max_new_tokens": 10_000}, 422, "max_new_tokens"),
        ({"conversion_id": "conv-nope", "text": "hi"}, 404, "conversion"),
        ({"conversion_id": profile_id, "text": "hi"}, 404, "conversion"),
    ]
    before = client.get("/api/v1/probes").json()["total"]
    for body, status, words in cases:
        r = client.post("/api/v1/probes", json=body)
        assert r.status_code == status and words in r.text, (body, r.status_code, r.text)
    assert client.get("/api/v1/probes").json()["total"] == before
    assert client.get("/api/v1/probes/pb-nope").status_code == 404


def test_an_experts_neurons_partition_the_layer(client, settings, conversion_id, profile_id):
    from moelab.engine.profiling.store import StoredProfile

    conv = client.get(f"/api/v1/conversions/{conversion_id}").json()
    lay = next(x for x in conv["layers"] if x.get("n_routed"))
    got = client.get(f"/api/v1/conversions/{conversion_id}/experts/{lay['layer']}").json()
    assert len(got["experts"]) == lay["n_routed"] and all(len(e["neurons"]) == lay["expert_size"] for e in got["experts"])
    assert len(got["shared"]) == lay["d_shared"]
    every = got["shared"] + [n for e in got["experts"] for n in e["neurons"]]
    assert sorted(every) == list(range(len(every)))  # shared + routed experts partition the layer's neurons
    cv = StoredProfile.open(settings.resolved_artifacts_dir() / "profiles" / profile_id).cv_by_layer()[lay["layer"]]
    for e in got["experts"]:  # each neuron's CV is the profile's (EW Eq. 3)
        assert e["cv"] == [float(cv[n]) for n in e["neurons"]]
    r = client.get(f"/api/v1/conversions/{conversion_id}/experts/999")
    assert r.status_code == 422 and "converted layers" in r.text
