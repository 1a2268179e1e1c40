"""A running job's progress moves at least every MOELAB_PROGRESS_TICK_S even inside one long engine step:
the heartbeat thread records that the stage still runs (``JobProgress.tick``), the stage's clock
(``stage_at``) starts only when the stage changes, and the job answers how long its stage has run."""

from __future__ import annotations

import time

from moelab.store import jobs
from moelab.store.db import Database, Job, Model
from workers.jobrun import Heartbeat, JobProgress


def test_ticks_move_progress_inside_one_long_step_and_stage_clock_restarts_on_a_new_stage(tmp_path):
    from backend.views import job_out

    db = Database(f"sqlite:///{tmp_path / 'm.db'}")
    db.init()
    with db.session() as s:
        row = Model(id=jobs.new_id("mod"), name="m", source="default", kind="default")
        s.add(row)
        job = jobs.new_job(s, "inspect_model", "cpu", "models", row.id)
    with db.session() as s:
        assert jobs.claim(s, job.id, "w1")
    tracker = JobProgress(db, job.id, interval=0.0)
    tracker.update("load model", 0, 1)
    with db.session() as s:
        started = s.get(Job, job.id)
        stage_at, first = started.stage_at, started.progress_at
    beat = Heartbeat(db, job.id, interval=30.0, tracker=tracker, tick_s=0.2)
    beat.start()
    seen = set()
    try:
        deadline = time.monotonic() + 1.5  # the engine reports nothing for 1.5 s
        while time.monotonic() < deadline:
            with db.session() as s:
                seen.add(s.get(Job, job.id).progress_at)
            time.sleep(0.05)
    finally:
        beat.stop.set()
        beat.join()
    assert len(seen - {first}) >= 4  # moved about every 0.2–0.3 s, not once in 1.5 s
    with db.session() as s:
        j = s.get(Job, job.id)
        assert (j.stage, j.current, j.total, j.stage_at) == ("load model", 0, 1, stage_at)
        assert job_out(j).progress.stage_s >= 1.4
    tracker.update("load model", 1, 1)  # the same stage goes on: its clock runs on
    tracker.update("profile", 0, 10)  # a new stage: its clock starts
    with db.session() as s:
        j = s.get(Job, job.id)
        assert j.stage_at > stage_at and job_out(j).progress.stage_s < 1.0
    db.dispose()
