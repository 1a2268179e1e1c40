"""Through HTTP: model → calibration set → profile → conversion → evaluation, each job polled
to success, artifacts downloaded and checked, and every chart endpoint read."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest

from moelab.engine.methods.dense2moe import choose_fusion

from .helpers import jsonl, succeeded, wait_job


def test_health_reports_database_broker_and_worker(client):
    h = client.get("/api/v1/health").json()
    assert h["status"] == "ok" and h["database"] == "ok" and h["broker"] == "ok"
    assert any(w.startswith("moelab-test@") for w in h["workers"])


def test_model_registration_and_layers(client, model_id, tiny_llama):
    again = client.post("/api/v1/models", json={"source": str(tiny_llama)})
    assert again.status_code == 200 and again.json()["id"] == model_id  # registering twice is idempotent
    m = client.get(f"/api/v1/models/{model_id}").json()
    assert m["status"] == "ready" and m["kind"] == "local" and m["job"]["kind"] == "inspect_model"
    layers = client.get(f"/api/v1/models/{model_id}/layers").json()
    assert layers["family"] == "llama" and layers["n_layers"] == 3
    assert [row["d_ffn"] for row in layers["layers"]] == [96, 96, 96]
    assert model_id in [x["id"] for x in client.get("/api/v1/models").json()["items"]]


def test_calibration_set_stats_and_samples(client, calib_id):
    cs = client.get(f"/api/v1/calibration-sets/{calib_id}").json()
    assert cs["status"] == "ready" and cs["content_id"].startswith("cs-")
    assert cs["stats"]["n_samples"] == 12 and len(cs["stats"]["tasks"]) == 6
    page = client.get(f"/api/v1/calibration-sets/{calib_id}/samples", params={"limit": 3, "max_chars": 50}).json()
    assert page["total"] == 12 and len(page["items"]) == 3
    assert all(len(s["text"]) <= 51 and s["truncated"] for s in page["items"])
    math = client.get(f"/api/v1/calibration-sets/{calib_id}/samples", params={"task": "math"}).json()
    assert math["total"] == 2 and {s["task"] for s in math["items"]} == {"math"}
    names = [b["name"] for b in client.get("/api/v1/calibration-sets/builtins").json()]
    assert "mixed" in names and "math" in names


def test_profile_job_and_artifacts(client, profile_id):
    p = client.get(f"/api/v1/profiles/{profile_id}").json()
    assert p["status"] == "ready"
    assert p["summary"]["n_layers"] == 3 and p["summary"]["d_ffn"] == [96, 96, 96] and p["summary"]["cv_basis"] == "task"
    job = p["job"]
    assert job["progress"]["stage"] and job["progress"]["current"] == job["progress"]["total"]
    assert job["started_at"] and job["finished_at"] and job["run_s"] > 0 and "forward_s" in job["timings"]
    art = client.get(f"/api/v1/artifacts/profiles/{profile_id}").json()
    files = {f["path"] for f in art["files"]}
    assert {"manifest.json", "neurons.parquet", "stats.safetensors", "activations.safetensors"} <= files
    manifest = client.get(f"/api/v1/artifacts/profiles/{profile_id}/files/manifest.json")
    assert manifest.status_code == 200 and manifest.json()["status"] == "complete" and manifest.json()["n_layers"] == 3


def test_profile_charts(client, profile_id):
    base = f"/api/v1/profiles/{profile_id}"
    hist = client.get(f"{base}/charts/cv-histogram").json()
    counts = np.array(hist["counts"])
    assert counts.shape == (3, hist["bins"]) and len(hist["edges"]) == hist["bins"] + 1
    assert (counts.sum(1) + np.array(hist["overflow"]) + np.array(hist["not_finite"]) == 96).all()
    fixed = client.get(f"{base}/charts/cv-histogram", params={"bins": 7}).json()
    assert fixed["bins"] == 7

    summary = client.get(f"{base}/charts/cv-summary", params={"tau": 0.6}).json()
    q = np.array(summary["values"], dtype=float)
    assert q.shape == (3, 5) and (np.diff(q, axis=1) >= 0).all()
    assert all(0 <= r <= 1 for r in summary["specialisation_ratio"])

    tiles = client.get(f"{base}/charts/activations", params={"layer": 1, "max_cols": 16}).json()
    assert len(tiles["rows"]) == 6 and np.array(tiles["values"], dtype=float).shape == (6, 16)
    assert tiles["aggregated"] and tiles["neurons_per_column"] == 6 and "mean of 6" in tiles["note"]
    full = client.get(f"{base}/charts/activations", params={"layer": 2, "order": "index", "rows": "samples"}).json()
    assert not full["aggregated"] and np.array(full["values"], dtype=float).shape == (12, 96)

    stats = client.get(f"{base}/charts/neuron-stats", params={"layer": 1, "bins": 10}).json()
    assert sum(stats["rate_counts"]) == stats["n_neurons"] == 96 and len(stats["rate_edges"]) == 11
    assert len(stats["h_edges"]) == len(stats["h_counts"]) + 1 and sum(stats["h_counts"]) > 0
    assert client.get(f"{base}/charts/neuron-stats", params={"layer": 3}).status_code == 422

    sim = np.array(client.get(f"{base}/charts/task-similarity").json()["matrix"], dtype=float)
    assert sim.shape == (6, 6) and np.allclose(np.diag(sim), 1, atol=1e-4) and np.allclose(sim, sim.T, atol=1e-4)

    layers = client.get(f"{base}/charts/layer-similarity", params={"delta": 2.0, "n_fused": 0}).json()
    s_l, s_m = np.array(layers["S_L"], dtype=float), np.array(layers["S_M"], dtype=float)
    assert s_l.shape == (3, 3) and s_m.shape == (3, 3)
    expected = choose_fusion(s_l, s_m, 2.0, 8)  # the engine's choice, with the engine's δ
    f = layers["fusion"]
    assert (f["layer"], f["n_fused"], f["rank"]) == (expected.layer, expected.n_fused, expected.rank) and layers["delta"] == 2.0
    assert layers["removed_layers"] == expected.fused_layers and layers["fusion_error"] is None
    default = client.get(f"{base}/charts/layer-similarity").json()  # n* = 5 (D2 §4.2) does not fit 3 layers: said in words
    assert default["fusion"] is None and "use n_fused ≤ 2, or 0" in default["fusion_error"] and default["params"]["n_fused"] == 5
    for bad in ({"delta": 0.0}, {"delta": 2.5}, {"n_fused": -1}, {"threshold": 0.9}):
        assert client.get(f"{base}/charts/layer-similarity", params=bad).status_code == 422, bad

    plan = client.get(f"{base}/allocation-preview", params={"n_experts": 8, "sparsity": 0.5, "alpha_min": 0.6, "alpha_max": 0.9, "tau": 5}).json()
    assert len(plan["layers"]) == 3 and plan["params"]["n_experts"] == 8
    # the profile job measured this machine's kernel times: the plan comes with its predicted speed per phase
    speed = plan["summary"]["predicted_speed"]
    assert set(speed["phases"]) == {"decode_b1", "decode_b8", "prefill"}, speed
    assert all(v["speedup"] > 0 and v["seconds"] > 0 for v in speed["phases"].values()) and speed["threads"] >= 1
    assert plan["summary"]["clamped_layers"] and "clamped" in plan["layers"][plan["summary"]["clamped_layers"][0]]["note"]
    active = client.get(f"{base}/allocation-preview", params={"n_experts": 8, "sparsity": 0.5, "alpha_basis": "active"}).json()
    assert not active["summary"]["clamped_layers"]
    cmoe = client.get(f"{base}/allocation-preview", params={"method": "cmoe", "n_experts": 8, "shared": 2, "active": 2}).json()
    assert all(row["r"] is None for row in cmoe["layers"])  # NaN in the engine, null in JSON


def test_conversion_job_and_downloaded_model_generates(client, conversion_id, tmp_path):
    conv = client.get(f"/api/v1/conversions/{conversion_id}").json()
    assert conv["status"] == "ready" and len(conv["layers"]) == 3
    assert conv["summary"]["active_fraction"] == pytest.approx(0.75, abs=0.02)
    assert conv["summary"]["active_fraction"] < conv["summary"]["ffn_flops_fraction"] < 1  # the router costs too
    assert set(conv["summary"]["predicted_speed"]["phases"]) == {"decode_b1", "decode_b8", "prefill"}
    files = {f["path"] for f in client.get(f"/api/v1/artifacts/conversions/{conversion_id}").json()["files"]}
    assert {"config.json", "model.safetensors", "conversion.json", "modeling_moelab.py"} <= files
    record = client.get(f"/api/v1/artifacts/conversions/{conversion_id}/files/conversion.json").json()
    assert record["params"]["n_experts"] == 8
    archive = client.get(f"/api/v1/artifacts/conversions/{conversion_id}/archive")
    assert archive.status_code == 200 and archive.headers["content-type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(archive.content)) as zf:
        zf.extractall(tmp_path)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tmp_path / conversion_id
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = model.generate(**tok("def add(a, b):", return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert out.shape[1] > 3


def test_evaluations_and_routing_heatmap_across_sets(client, conversion_id):
    rows = [{"text": f"{topic} sample {i}: " + " ".join([topic] * 30), "task": topic}
            for i in range(4) for topic in ("weather", "finance")]
    up = client.post("/api/v1/calibration-sets/upload", files={"file": ("eval.jsonl", jsonl(rows))}, data={"name": "evalset"})
    assert up.status_code in (200, 201), up.text
    evs = []
    for source in ("builtin:mixed", up.json()["id"]):
        r = client.post("/api/v1/evaluations", json={"conversion_id": conversion_id, "source": source, "n_windows": 2, "seq_len": 32})
        assert r.status_code == 202, r.text
        evs.append(r.json())
    for ev in evs:
        succeeded(client, ev)
    first = client.get(f"/api/v1/evaluations/{evs[0]['id']}").json()
    variants = first["summary"]["variants"]
    assert variants["dense"]["perplexity_ratio"] == 1.0 and variants["converted"]["perplexity"] > 0
    assert {"abstopk", "uniform"} <= set(variants)
    report = client.get(f"/api/v1/artifacts/evaluations/{evs[0]['id']}/files/evaluation.json").json()
    assert report["heldout"]["windows"] == 2 and "routing" in report["results"]["converted"]

    heat = client.get(f"/api/v1/conversions/{conversion_id}/charts/routing",
                      params={"evaluation_id": [e["id"] for e in evs]}).json()
    assert heat["sets"] == ["builtin:mixed", "evalset"] and heat["layers"] == [0, 1, 2]
    share = np.array(heat["share"], dtype=float)
    assert share.shape == (2, 3, heat["n_experts"]) and np.allclose(np.nansum(share, axis=2), 1, atol=1e-3)
    one = client.get(f"/api/v1/evaluations/{evs[1]['id']}/charts/routing").json()
    assert one["sets"] == ["evalset"]
    listed = client.get("/api/v1/evaluations", params={"conversion_id": conversion_id}).json()
    assert {e["id"] for e in evs} <= {e["id"] for e in listed["items"]}


def test_jobs_listing_and_artifact_listing(client, profile_id, conversion_id):
    jobs = client.get("/api/v1/jobs", params={"resource_id": profile_id}).json()
    assert jobs["total"] == 1 and jobs["items"][0]["kind"] == "profile" and jobs["items"][0]["state"] == "succeeded"
    kinds = client.get("/api/v1/jobs", params={"kind": "conversion", "state": "succeeded"}).json()["items"]
    assert conversion_id in [j["resource_id"] for j in kinds]
    arts = client.get("/api/v1/artifacts").json()["items"]
    assert {("profiles", profile_id), ("conversions", conversion_id)} <= {(a["kind"], a["id"]) for a in arts}


def test_upload_of_the_same_content_is_not_stored_twice(client):
    body = b"First paragraph of plain text, long enough.\n\nSecond paragraph, also long enough to keep.\n"
    a = client.post("/api/v1/calibration-sets/upload", files={"file": ("notes.txt", body)})
    b = client.post("/api/v1/calibration-sets/upload", files={"file": ("notes.txt", body)})
    assert a.status_code == 201 and b.status_code == 200 and a.json()["id"] == b.json()["id"]
    assert a.json()["stats"]["n_samples"] == 2 and a.json()["origin"] == "upload"
    assert json.loads(json.dumps(a.json()["params"]))["filename"] == "notes.txt"


def test_calibration_set_from_a_datasets_file(client, data_root):
    """The Hugging Face `datasets` path, on a local data file (the Hub is not reachable here) in MOELAB_DATA_ROOTS."""
    data = data_root / "rows.csv"
    data.write_text("body,label\n" + "".join(f"\"row {i} with enough words to be a sample\",{'x' if i % 2 else 'y'}\n" for i in range(10)))
    r = client.post("/api/v1/calibration-sets", json={"source": "hf", "dataset": str(data), "text_field": "body",
                                                      "task_field": "label", "samples": 6})
    assert r.status_code == 202, r.text
    succeeded(client, r.json())
    cs = client.get(f"/api/v1/calibration-sets/{r.json()['id']}").json()
    assert cs["origin"] == "hf" and cs["stats"]["n_samples"] == 6 and set(cs["stats"]["tasks"]) == {"x", "y"}
    bad = client.post("/api/v1/calibration-sets", json={"source": "hf", "dataset": str(data), "text_field": "nope"})
    job = wait_job(client, bad.json()["job_id"])
    assert job["state"] == "failed" and job["error_type"] == "invalid_input" and "no column 'nope'" in job["error"]


def test_dense2moe_conversion_through_the_api(client, profile_id):
    """Another method through the same endpoint: the job runs the engine's Dense2MoE and the row says so."""
    created = client.post("/api/v1/conversions", json={
        "profile_id": profile_id, "method": "dense2moe", "dense2moe": {"layer": 0, "n_fused": 1, "top_k": 1},
    })
    assert created.status_code == 202, created.text
    succeeded(client, created.json())
    row = client.get(f"/api/v1/conversions/{created.json()['id']}").json()
    assert row["method"] == "dense2moe" and row["summary"]["active_params"] < row["summary"]["dense_active_params"]
    bad = client.post("/api/v1/conversions", json={"profile_id": profile_id, "method": "dense2moe",
                                                    "dense2moe": {"layer": 0, "n_fused": 9}})
    assert bad.status_code == 422 and ("n_fused" in bad.text or "layers" in bad.text), bad.text
    for body, needle in [
        ({"profile_id": profile_id, "method": "midas"}, "extra_profile_ids"),
        ({"method": "hierarchical", "calibration": "builtin:mixed"}, "model_id"),
        ({"profile_id": profile_id, "method": "cmoe", "extra_profile_ids": [profile_id]}, "only midas"),
    ]:
        r = client.post("/api/v1/conversions", json=body)
        assert r.status_code == 422 and needle in r.text, (body, r.text)
