"""A conversion fanned out by layer to two real worker processes: the same export as one worker
builds alone, the second worker really built layers, and a worker killed while it holds a layer
fails the job within seconds, naming the layer, after which a retry succeeds."""

from __future__ import annotations

import re
import socket
import time

import pytest
import redis
from safetensors.numpy import load_file

from moelab.store import liveness

from .helpers import Worker, env_for, save_wide_llama, succeeded, wait_job

PARAMS = {"n_experts": 16, "alpha_max": 0.5, "sparsity": 0.5, "max_iter": 200}


@pytest.fixture(scope="module")
def big_profile(client, calib_id, tiny_model, tmp_path_factory) -> str:
    """A profile of a tiny Llama with enough layers and neurons that building them takes a while."""
    from tests.conftest import tiny_models_root

    target = save_wide_llama(tiny_model("llama"), tiny_models_root(tmp_path_factory) / "llama-16x2048")
    r = client.post("/api/v1/models", json={"source": str(target)})
    succeeded(client, r.json())
    r = client.post("/api/v1/profiles", json={"model_id": r.json()["id"], "calibration_set_id": calib_id,
                                              "max_tokens": 32, "batch_tokens": 256})
    assert r.status_code == 202, r.text
    succeeded(client, r.json())
    return r.json()["id"]


def _convert(client, profile_id: str) -> dict:
    r = client.post("/api/v1/conversions", json={"profile_id": profile_id, "expertweaver": PARAMS})
    assert r.status_code == 202, r.text
    return r.json()


def _weights(settings, conversion_id: str) -> dict:
    return load_file(str(settings.resolved_artifacts_dir() / "conversions" / conversion_id / "model.safetensors"))


@pytest.fixture
def second_worker(service_config, settings, tmp_path):
    w = Worker(env_for(service_config), tmp_path, name="moelab-test2@%h")
    w.start()
    name = f"moelab-test2@{socket.gethostname()}"
    client = redis.Redis.from_url(settings.redis_url)
    deadline = time.monotonic() + 30
    while name not in liveness.alive(client, settings.redis_prefix):
        assert time.monotonic() < deadline, "the second worker never announced itself"
        time.sleep(0.2)
    yield w, name
    w.stop()
    liveness.withdraw(client, settings.redis_prefix, name)  # a killed worker's presence would stand until its TTL


@pytest.fixture(scope="module")
def alone(client, settings, big_profile) -> dict:
    """The conversion built by the one session worker (made before a second worker starts)."""
    created = _convert(client, big_profile)
    succeeded(client, created)
    return _weights(settings, created["id"])


@pytest.mark.slow
def test_two_workers_build_the_same_export_as_one(client, settings, worker, big_profile, alone, second_worker):
    w2, _ = second_worker
    created = _convert(client, big_profile)
    succeeded(client, created)
    shared = _weights(settings, created["id"])
    assert alone.keys() == shared.keys()
    for key in alone:
        assert (alone[key] == shared[key]).all(), key
    logs = worker.log.read_text() + w2.log.read_text()  # the leader says how many layers the other one built
    assert re.search(rf"conversion job {created['job_id']}: [1-9]\d* of 16 layers built by moelab-test", logs), logs[-2000:]


@pytest.mark.slow
def test_a_worker_killed_holding_a_layer_fails_the_job_then_a_retry_succeeds(client, settings, big_profile, second_worker):
    w2, name = second_worker
    r = redis.Redis.from_url(settings.redis_url)
    for _ in range(8):  # either idle worker may take the job: kill the second one only while it helps the other
        created = _convert(client, big_profile)
        job = wait_job(client, created["job_id"], until=("running", "succeeded", "failed", "cancelled"))
        if job["worker"] != name:
            break
        assert wait_job(client, created["job_id"])["state"] == "succeeded"
    else:
        pytest.fail("the second worker led every conversion")
    owners = f"{settings.redis_prefix}fanout:{created['job_id']}:owner"
    deadline = time.monotonic() + 60
    while name.encode() not in r.hvals(owners):  # the second worker holds a layer
        assert time.monotonic() < deadline, "the second worker never took a layer"
        time.sleep(0.005)
    w2.kill()
    t0 = time.monotonic()
    job = wait_job(client, created["job_id"], timeout=60)
    assert job["state"] == "failed" and f"worker {name} died while building layer" in job["error"], job
    assert time.monotonic() - t0 < 30  # the leader notices between its own layers (a few seconds each on a slow machine)
    retry = client.post(f"/api/v1/jobs/{created['job_id']}/retry")
    assert retry.status_code in (200, 201, 202), retry.text
    assert wait_job(client, retry.json()["id"], timeout=120)["state"] == "succeeded"
