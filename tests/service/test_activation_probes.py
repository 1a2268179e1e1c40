"""Activation probes through the service: a real worker computes chosen neurons' h on every token of
a text with the profile's dense model; the API checks the request against the profile, queues the
job and serves the result; a profile's deletion takes its activation probes with it."""

from __future__ import annotations

from .helpers import succeeded, wait_job

TEXT = "def add(a, b):\n    return a + b  # the sum of two numbers"


def test_activation_on_a_text_has_a_value_per_token_and_neuron(client, profile_id):
    r = client.post("/api/v1/activation-probes", json={"profile_id": profile_id, "layer": 1, "neurons": [0, 3], "text": TEXT})
    assert r.status_code == 202, r.text
    probe = r.json()
    assert probe["status"] == "queued" and probe["params"]["neurons"] == [0, 3] and probe["job"]["kind"] == "activation_probe"
    succeeded(client, probe)
    got = client.get(f"/api/v1/activation-probes/{probe['id']}").json()
    result = client.get(f"/api/v1/activation-probes/{probe['id']}/result").json()
    n = len(result["tokens"])
    assert n == len(result["token_ids"]) == got["summary"]["n_tokens"] and "def add" in "".join(result["tokens"])
    assert result["layer"] == 1 and result["neurons"] == [0, 3] and [len(a) for a in result["activations"]] == [n, n]
    assert got["summary"]["max_abs"] == [max(abs(v) for v in a) for a in result["activations"]]
    assert [ref["neuron"] for ref in result["reference"]] == [0, 3]
    card = client.get(f"/api/v1/profiles/{profile_id}/neurons/1/0").json()
    assert result["reference"][0]["gate_mean"] == card["mean"]
    if card["top"]:  # the profile's largest-|h| token of the neuron
        assert result["reference"][0]["top_value"] == card["top"][0]["value"]
    listed = client.get("/api/v1/activation-probes", params={"profile_id": profile_id}).json()
    assert probe["id"] in [p["id"] for p in listed["items"]]


def test_held_out_sample_and_too_long_a_text(client, profile_id):
    r = client.post("/api/v1/activation-probes", json={"profile_id": profile_id, "layer": 0, "neurons": [1],
                                                       "sample_source": "builtin:prose", "sample": 2})
    assert r.status_code == 202, r.text
    succeeded(client, r.json())
    assert client.get(f"/api/v1/activation-probes/{r.json()['id']}").json()["summary"]["text"]
    r = client.post("/api/v1/activation-probes", json={"profile_id": profile_id, "layer": 0, "neurons": [1], "text": "word " * 900})
    assert r.status_code == 202, r.text
    job = wait_job(client, r.json()["job_id"], 120)
    assert job["state"] == "failed" and "at most 512: shorten it" in (job.get("error") or ""), job


def test_bad_activation_probes_are_refused_with_what_to_fix(client, profile_id, conversion_id):
    d_ffn = client.get(f"/api/v1/profiles/{profile_id}/neurons/0/0").json()["d_ffn"]
    base = {"profile_id": profile_id, "layer": 0, "neurons": [0], "text": "hi"}
    cases = [
        ({**base, "layer": 99}, 422, "layer: this profile has layers"),
        ({**base, "neurons": [d_ffn]}, 422, f"layer 0 has {d_ffn} neurons"),
        ({**base, "neurons": []}, 422, "neurons"),
        ({**base, "neurons": list(range(65))}, 422, "neurons"),
        ({**base, "neurons": [1, 1]}, 422, "each neuron once"),
        ({**base, "text": None}, 422, "exactly one of text or sample_source"),
        ({**base, "text": "  "}, 422, "blank"),
        ({**base, "profile_id": "prof-nope"}, 404, "profile"),
        ({**base, "profile_id": conversion_id}, 404, "profile"),
    ]
    before = client.get("/api/v1/activation-probes").json()["total"]
    for body, status, words in cases:
        r = client.post("/api/v1/activation-probes", json=body)
        assert r.status_code == status and words in r.text, (body, r.status_code, r.text)
    assert client.get("/api/v1/activation-probes").json()["total"] == before
    assert client.get("/api/v1/activation-probes/act-nope").status_code == 404
