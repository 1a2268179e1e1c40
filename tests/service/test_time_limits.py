"""Job time limits hold in the solo/threads pools, where Celery's own do nothing: past
``job_time_limit_s`` a job stops at its next progress step, or inside a long Python-level step
(the cancel watch), failed with ``time_limit``; a job stuck in native code is failed by its
worker's heartbeat thread, which then ends the worker (exit 75) so a supervisor replaces it. ``run_job`` runs in a subprocess: the hard limit ends the process."""

from __future__ import annotations

import subprocess
import sys
import time

from .helpers import REPO, env_for

SCRIPT = """
import sys, time
from moelab.store import jobs
from workers.jobrun import Outcome, database, run_job

db = database()
db.init()
with db.session() as session:
    job_id = jobs.new_job(session, "profile", "gpu", "profile", "pr-timelimit").id

def steps(ctx):
    for i in range(10_000):
        ctx.progress.update("profile", i, 10_000)
        time.sleep(0.02)
    return Outcome()

def long_step(ctx):
    ctx.progress.update("profile", 0, 1)
    t_end = time.monotonic() + 60
    while time.monotonic() < t_end:  # one long step in Python (between torch ops): no progress call
        sum(range(1000))
    return Outcome()

def leaks_a_path(ctx):
    ctx.progress.update("profile", 0, 1)
    raise ValueError(f"could not read {ctx.settings.resolved_artifacts_dir()}/profiles/x/stats.safetensors: truncated")

def stuck(ctx):
    ctx.progress.update("profile", 0, 1)
    time.sleep(60)  # one engine step that never reports progress
    return Outcome()

print(job_id, flush=True)
print(run_job(job_id, "moelab@test", {"steps": steps, "long_step": long_step, "stuck": stuck, "leaks_a_path": leaks_a_path}[sys.argv[1]]), flush=True)
"""


def _run(tmp_path, mode: str, **limits: float) -> tuple[subprocess.CompletedProcess, dict, float]:
    from moelab.store.db import Database, Job

    url = f"sqlite:///{tmp_path / 'moelab.db'}"
    env = env_for({"database_url": url, "artifacts_dir": tmp_path / "artifacts", "data_dir": tmp_path,
                   "heartbeat_s": 0.2, **limits})
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    elapsed = time.monotonic() - t0
    job_id = done.stdout.split()[0]
    db = Database(url)
    with db.session() as session:
        row = session.get(Job, job_id)
        job = {"state": row.state, "error_type": row.error_type, "error": row.error}
    db.dispose()
    return done, job, elapsed


def test_a_job_past_its_time_limit_stops_at_its_next_step(tmp_path):
    done, job, elapsed = _run(tmp_path, "steps", job_time_limit_s=1.0)
    assert done.returncode == 0 and done.stdout.split()[1] == "failed", done.stderr[-2000:]
    assert job["state"] == "failed" and job["error_type"] == "time_limit", job
    assert "time limit of 1 s (MOELAB_JOB_TIME_LIMIT_S) during 'profile'" in job["error"] and "/retry" in job["error"]
    assert elapsed < 15, elapsed


def test_a_long_step_is_interrupted_at_the_time_limit(tmp_path):
    done, job, elapsed = _run(tmp_path, "long_step", job_time_limit_s=1.0, cancel_poll_s=0.2)
    assert done.returncode == 0 and done.stdout.split()[1] == "failed", done.stderr[-2000:]
    assert job["state"] == "failed" and job["error_type"] == "time_limit", job
    assert elapsed < 15, elapsed  # not the 60 s of the step


def test_a_job_stuck_in_one_step_is_failed_and_its_worker_ends(tmp_path):
    done, job, elapsed = _run(tmp_path, "stuck", job_time_limit_s=0.5, job_kill_after_s=0.5)
    assert done.returncode == 75, (done.returncode, done.stderr[-2000:])  # workers.jobrun.EXIT_TIME_LIMIT
    assert job["state"] == "failed" and job["error_type"] == "time_limit", job
    assert "did not stop at a progress step" in job["error"]
    assert elapsed < 15, elapsed


def test_a_job_error_shows_no_server_path_outside_the_data_roots(tmp_path):
    """The API shows job errors: a path outside the data roots (here the artifacts dir) is replaced,
    the rest of the message kept (the worker's log keeps the whole text for the operator)."""
    done, job, _ = _run(tmp_path, "leaks_a_path")
    assert job["state"] == "failed" and job["error_type"] == "invalid_input", (job, done.stderr[-2000:])
    assert job["error"] == "could not read <server path>: truncated", job["error"]
