"""Cancellation, a worker killed mid-job (failed with a reason within seconds, from its closed
broker connection), and a re-run on a restarted worker."""

from __future__ import annotations

import time

import pytest

from moelab.store import liveness

from .conftest import HEARTBEAT_TIMEOUT_S, REAPER_INTERVAL_S
from .helpers import succeeded, wait_idle, wait_job

# ~60 forward batches of the tiny model: long enough to act on while it runs, short to re-run.
LONG_PROFILE = {"max_tokens": 256, "batch_tokens": 512, "samples": 120}


@pytest.fixture(scope="module")
def big_calib_id(client) -> str:
    r = client.post("/api/v1/calibration-sets", json={"source": "builtin", "name": "mixed", "samples": 120})
    succeeded(client, r.json())
    return r.json()["id"]


def _long_profile(client, model_id: str, calib_id: str) -> dict:
    r = client.post("/api/v1/profiles", json={"model_id": model_id, "calibration_set_id": calib_id, **LONG_PROFILE})
    assert r.status_code == 202, r.text
    return r.json()


def _wait_profiling(client, job_id: str, timeout: float = 60) -> dict:
    """Until the job is inside the profiling loop (a forward batch done)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/api/v1/jobs/{job_id}").json()
        assert job["state"] in ("queued", "running"), job
        if job["state"] == "running" and job["progress"]["stage"] == "profile" and job["progress"]["current"] >= 1:
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not start profiling: {job}")


def _no_temporaries(settings) -> bool:
    root = settings.resolved_artifacts_dir() / "profiles"
    return not [p for p in root.iterdir() if ".tmp-" in p.name]


def test_cancel_queued_and_running_jobs(client, settings, model_id, big_calib_id):
    wait_idle(client)
    running = _long_profile(client, model_id, big_calib_id)
    queued = _long_profile(client, model_id, big_calib_id)  # waits behind it: one solo worker
    job = _wait_profiling(client, running["job_id"])
    assert job["worker"] and job["heartbeat_at"] and job["progress"]["total"] > 1

    r = client.delete(f"/api/v1/jobs/{queued['job_id']}")
    assert r.status_code == 200 and r.json()["state"] == "cancelled"  # never started: cancelled at once

    t0 = time.monotonic()
    r = client.delete(f"/api/v1/jobs/{running['job_id']}")
    assert r.status_code == 202 and r.json()["cancel_requested"] and r.json()["state"] == "running"
    done = wait_job(client, running["job_id"], timeout=30)
    assert done["state"] == "cancelled" and "cancelled on request during 'profile'" in done["error"]
    assert time.monotonic() - t0 < 10
    assert client.get(f"/api/v1/profiles/{running['id']}").json()["status"] == "cancelled"
    assert not settings.resolved_artifacts_dir().joinpath("profiles", running["id"]).exists()  # nothing half-written
    assert _no_temporaries(settings)

    wait_idle(client)
    later = client.get(f"/api/v1/jobs/{queued['job_id']}").json()
    assert later["state"] == "cancelled" and later["started_at"] is None  # the worker skipped the revoked message
    assert client.delete(f"/api/v1/jobs/{queued['job_id']}").status_code == 200  # cancelling twice is harmless


def test_killed_worker_fails_the_job_and_a_rerun_succeeds(client, settings, worker, model_id, big_calib_id):
    wait_idle(client)
    created = _long_profile(client, model_id, big_calib_id)
    _wait_profiling(client, created["job_id"])
    worker.kill()
    t_kill = time.monotonic()
    failed = wait_job(client, created["job_id"], timeout=HEARTBEAT_TIMEOUT_S + 20)
    elapsed = time.monotonic() - t_kill
    assert failed["state"] == "failed" and failed["error_type"] == "worker_lost"
    # no supervisor here: the API saw the worker's named Redis connection close (moelab.store.liveness),
    # well before the heartbeat timeout (which stays the bound when a host vanishes without closing sockets)
    assert "its connection to the broker closed" in failed["error"] and "/retry" in failed["error"], failed["error"]
    assert elapsed <= liveness.CONFIRM_S + 2 * REAPER_INTERVAL_S + 2 < HEARTBEAT_TIMEOUT_S, elapsed
    assert not settings.resolved_artifacts_dir().joinpath("profiles", created["id"]).exists()
    health = client.get("/api/v1/health").json()
    assert health["jobs"]["running"] == 0

    worker.start()
    assert _no_temporaries(settings)  # the restarted worker removed the killed run's temporary directory
    r = client.post(f"/api/v1/jobs/{created['job_id']}/retry")
    assert r.status_code == 202 and r.json()["retry_of"] == created["job_id"]
    rerun = wait_job(client, r.json()["id"], timeout=120)
    assert rerun["state"] == "succeeded", rerun
    profile = client.get(f"/api/v1/profiles/{created['id']}").json()
    assert profile["status"] == "ready" and profile["job_id"] == rerun["id"] and profile["summary"]["n_layers"] == 3
    history = client.get("/api/v1/jobs", params={"resource_id": created["id"]}).json()
    assert [j["state"] for j in history["items"]] == ["succeeded", "failed"]  # the SQL store keeps the history
    # the old job is not the latest any more: it cannot be retried again
    assert client.post(f"/api/v1/jobs/{created['job_id']}/retry").status_code == 409
