"""The supervisor of ``moelab serve`` on stand-in children (no Redis, API or worker): restarts
with doubling back-off, and the jobs of a worker that dies read failed with the cause at once."""

from __future__ import annotations

import signal
import sys
import time

from moelab.serve import BACKOFF_START_S, WORKER_NAME, Supervisor, death_hint, exit_cause
from moelab.settings import Settings


def _supervisor(tmp_path) -> tuple[Supervisor, list[str]]:
    said: list[str] = []
    settings = Settings(_env_file=None, data_dir=tmp_path, database_url=f"sqlite:///{tmp_path / 'moelab.db'}")
    return Supervisor(settings, say=said.append), said


def _supervise_for(sup: Supervisor, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sup.supervise()
        time.sleep(0.05)


def test_a_child_that_keeps_dying_is_restarted_with_doubling_back_off(tmp_path):
    sup, said = _supervisor(tmp_path)
    steady = sup.spawn("api", [sys.executable, "-c", "import time; time.sleep(30)"])
    crashing = sup.spawn("frontend", [sys.executable, "-c", "raise SystemExit(3)"])
    try:
        _supervise_for(sup, 4 * BACKOFF_START_S + 2.5)  # deaths at ~0, 0.5+, 1.5+, 3.5+ s
        delays = [float(m.split("restarting it in ")[1].split(" s")[0]) for m in said if "frontend" in m and "restarting" in m]
        assert delays[:3] == [BACKOFF_START_S, 2 * BACKOFF_START_S, 4 * BACKOFF_START_S], said
        assert all("exited with code 3" in m for m in said if "restarting" in m)
        assert crashing.restarts >= 2 and steady.restarts == 0 and steady.proc.poll() is None  # the others stay up
    finally:
        sup.stop()
    assert steady.proc.poll() is not None


def test_the_jobs_of_a_killed_worker_fail_at_once_with_the_cause(tmp_path):
    from moelab.store import jobs
    from moelab.store.db import Database, Job

    sup, said = _supervisor(tmp_path)
    db = Database(sup.settings.resolved_database_url())
    db.init()
    with db.session() as session:
        mine = jobs.new_job(session, "profile", "gpu", "profile", "pr-1")
        other = jobs.new_job(session, "profile", "gpu", "profile", "pr-2")
        session.flush()
        ids = (mine.id, other.id)
    with db.session() as session:
        assert jobs.claim(session, ids[0], WORKER_NAME) and jobs.claim(session, ids[1], "moelab@elsewhere")
        jobs.record_progress(session, ids[0], "profile", 3, 60)
    worker = sup.spawn("worker", [sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        worker.proc.send_signal(signal.SIGKILL)
        worker.proc.wait(10)
        sup.supervise()
        with db.session() as session:
            dead, alive = session.get(Job, ids[0]), session.get(Job, ids[1])
            assert dead.state == "failed" and dead.error_type == "worker_lost"
            assert "was killed by SIGKILL at stage 'profile' 3/60" in dead.error and "out-of-memory" in dead.error
            assert f"POST /api/v1/jobs/{ids[0]}/retry" in dead.error
            assert alive.state == "running"  # another worker's job is not touched
        assert any(f"job {ids[0]} failed" in m for m in said)
        _supervise_for(sup, BACKOFF_START_S + 0.5)
        assert worker.restarts == 1 and worker.proc.poll() is None
    finally:
        sup.stop()
        db.dispose()


def test_exit_causes_read_as_a_person_would_say_them():
    assert exit_cause(-9) == "was killed by SIGKILL" and "out-of-memory" in death_hint(-9)
    assert exit_cause(-11) == "was killed by SIGSEGV" and "native code" in death_hint(-11)
    assert exit_cause(75) == "exited with code 75" and "MOELAB_JOB_TIME_LIMIT_S" in death_hint(75)
    assert exit_cause(1) == "exited with code 1" and "log" in death_hint(1)


def test_serve_refuses_to_bind_beyond_loopback_without_a_token_unless_told(tmp_path, monkeypatch):
    from moelab.serve import exposure_refusal, is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.5", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "192.168.1.4", "myhost.example"))

    def settings(**kw) -> Settings:
        return Settings(_env_file=None, data_dir=tmp_path, **kw)

    assert exposure_refusal(settings(host="127.0.0.1"), insecure=False) is None
    assert exposure_refusal(settings(host="0.0.0.0", api_token="t0ken"), insecure=False) is None
    assert exposure_refusal(settings(host="0.0.0.0"), insecure=True) is None
    refusal = exposure_refusal(settings(host="0.0.0.0"), insecure=False)
    assert refusal and "MOELAB_API_TOKEN" in refusal and "--insecure" in refusal
    assert exposure_refusal(settings(host="10.1.2.3", api_token=""), insecure=False)  # an empty token is none
    monkeypatch.delenv("MOELAB_INSECURE", raising=False)
    assert settings().insecure is False
    monkeypatch.setenv("MOELAB_INSECURE", "1")
    assert settings().insecure is True


def test_children_are_armed_to_die_with_the_supervisor(tmp_path):
    """Each child has SIGTERM as its parent-death signal (field 'PDeathSig' is not in /proc; read it back
    with prctl(PR_GET_PDEATHSIG) from inside the child)."""
    sup, _said = _supervisor(tmp_path)
    code = ("import ctypes, signal, sys; v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v)); "
            "sys.exit(0 if v.value == signal.SIGTERM else 1)")
    child = sup.spawn("probe", [sys.executable, "-c", code])
    try:
        assert child.proc.wait(30) == 0
    finally:
        sup.stop()
