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
