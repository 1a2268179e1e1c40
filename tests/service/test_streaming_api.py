"""A profile job with ``max_memory`` below the model's weights streams layer by layer on a real
worker and stores the same statistics as the in-memory job of the same parameters."""

from __future__ import annotations

import numpy as np
import pandas as pd
from safetensors.numpy import load_file

from .conftest import SMALL_PROFILE
from .helpers import succeeded


def test_profile_job_streams_under_max_memory(client, settings, model_id, calib_id, profile_id):
    memory = client.get(f"/api/v1/models/{model_id}").json()["info"]["memory"]
    assert memory["min_max_memory"] < memory["total_bytes"]
    r = client.post("/api/v1/profiles", json={"model_id": model_id, "calibration_set_id": calib_id, **SMALL_PROFILE,
                                              "max_memory": str(memory["min_max_memory"])})
    assert r.status_code == 202, r.text
    job = succeeded(client, r.json())
    assert job["timings"]["streamed"] == 1.0 and job["timings"]["hidden_states_on_disk"] == 1.0
    assert job["timings"]["peak_rss_mib"] > 0
    root = settings.resolved_artifacts_dir() / "profiles"
    streamed, in_memory = root / r.json()["id"], root / profile_id
    a, b = pd.read_parquet(streamed / "neurons.parquet"), pd.read_parquet(in_memory / "neurons.parquet")
    np.testing.assert_allclose(a[["mean", "std", "cv", "rate"]], b[["mean", "std", "cv", "rate"]], rtol=1e-5, atol=1e-6)
    for f in ("stats.safetensors", "second_moment.safetensors"):
        x, y = load_file(str(streamed / f)), load_file(str(in_memory / f))
        for k in y:
            np.testing.assert_allclose(x[k], y[k], rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(y[k]).max())), err_msg=k)


def test_conversion_job_streams_under_max_memory(client, settings, model_id, profile_id, conversion_id):
    """The session's conversion again with a budget below the model's weights: one layer at a time on
    the worker, the same weights; a recipe that needs the whole model, or a budget below one layer: 422."""
    memory = client.get(f"/api/v1/models/{model_id}").json()["info"]["memory"]
    params = client.get(f"/api/v1/conversions/{conversion_id}").json()["params"]
    block = {k: v for k, v in params.items() if k not in ("method", "max_memory")}
    # the model's own dtype sets its footprint; the conversion reads float32: twice the floor holds one layer either way
    budget = str(2 * memory["min_max_memory"])
    r = client.post("/api/v1/conversions", json={"profile_id": profile_id, "expertweaver": block, "max_memory": budget})
    assert r.status_code == 202, r.text
    job = succeeded(client, r.json())
    assert job["timings"]["streamed"] == 1.0 and job["timings"]["peak_rss_mib"] > 0
    root = settings.resolved_artifacts_dir() / "conversions"
    x = {}
    for f in (root / r.json()["id"]).glob("model-*-of-*.safetensors"):  # a shard per layer, then the rest
        x |= load_file(str(f))
    y = load_file(str(root / conversion_id / "model.safetensors"))
    assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in y)
    bad = [({**block, "router": "ridge", "plan": "budget", "plan_error": "fisher"}, budget,
            "plan_error 'fisher' reads the loss gradient of the whole model"),
           (block, str(memory["min_max_memory"] // 2), "cannot hold one layer"),
           (block, "lots", "max_memory")]
    for b, mm, words in bad:
        r = client.post("/api/v1/conversions", json={"profile_id": profile_id, "expertweaver": b, "max_memory": mm})
        assert r.status_code == 422 and words in r.text, r.text


def test_the_best_recipe_streams_from_the_api(client, settings, model_id, profile_id):
    """``--recipe best`` (as the designer sends it: the recipe's fields) under a budget that holds the largest layer
    and the fit but not the model: fitted and built layer by layer on the worker, the same weights as the in-memory
    job; a budget that holds the layer but not the fit beside it: 422, saying how much to give."""
    from moelab.engine.core.params import fit_bytes
    from moelab.engine.methods import params_from_dict

    methods = client.get("/api/v1/methods").json()["items"]
    recipe = next(m for m in methods if m["name"] == "expertweaver")["recipes"]["best"]
    block = {**recipe, "n_experts": 8, "fit_tokens": 1024, "sparsity": 0.5}
    model = client.get(f"/api/v1/models/{model_id}").json()["info"]
    memory = model["memory"]
    work = fit_bytes(params_from_dict({"method": "expertweaver", **block}), model["d_model"], max(model["d_ffn"]),
                     model["n_layers"])
    budget = 2 * memory["min_max_memory"] + work
    assert work > 0 and budget < memory["total_bytes"] + work
    r = client.post("/api/v1/conversions", json={"profile_id": profile_id, "expertweaver": block,
                                                 "max_memory": str(memory["min_max_memory"] + work // 2)})
    assert r.status_code == 422 and "fewer fit_tokens" in r.text, r.text
    ids = {}
    for name, extra in (("whole", {}), ("streamed", {"max_memory": str(budget)})):
        r = client.post("/api/v1/conversions", json={"profile_id": profile_id, "expertweaver": block, **extra})
        assert r.status_code == 202, r.text
        job = succeeded(client, r.json())
        assert ("streamed" in job["timings"]) == (name == "streamed")
        ids[name] = r.json()["id"]
    root = settings.resolved_artifacts_dir() / "conversions"
    weights = {}
    for name, i in ids.items():
        weights[name] = {}
        for f in (root / i).glob("model*.safetensors"):
            weights[name] |= load_file(str(f))
    x, y = weights["streamed"], weights["whole"]
    assert any(k.endswith("skip_mean") for k in y)  # compensated: the fit's second pass ran
    assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in y)
