"""What every task does around its engine call: claim the job row, beat, report progress,
honour cancellation, and record how it ended.

* **claim**: ``queued → running`` in one conditional update. A job that is not queued
  (cancelled before it started, or a message Redis redelivered after the job ended) is skipped.
* **heartbeat**: a thread writes ``heartbeat_at`` every ``heartbeat_s`` while the job runs, so
  the API can fail the job of a worker that died (``backend.jobs.reap_stale``).
* **progress**: the engine's ``Progress`` callback writes ``{stage, current, total}`` to the row,
  at most every ``progress_interval_s`` (and on every stage change).
* **cancel**: ``should_cancel`` reads the row's ``cancel_requested`` flag (throttled) and the
  worker's shutdown flag; the engine then raises ``Cancelled`` at its next step.
* **end**: succeeded (with the resource's summary, in the same transaction) | cancelled |
  failed with a message a person can act on. Nothing is returned through Celery.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from moelab.store import jobs
from moelab.store.artifacts import ArtifactStore, artifacts_label, is_disk_full
from moelab.store.dataroots import redact_paths
from moelab.store.db import RESOURCE_TABLES, Conversion, Database, Job, Model, Profile
from moelab.settings import Settings, get_settings
from workers.cancelwatch import CancelWatch
from moelab.engine.atomic import free_bytes, human_bytes
from moelab.engine.progress import Cancelled, Progress

log = logging.getLogger("moelab.worker")

#: set by the worker_shutting_down signal: running jobs stop at their next progress step
SHUTDOWN = threading.Event()
#: exit status of a worker that killed itself because a job overran its time limit in one step
EXIT_TIME_LIMIT = 75


@lru_cache(maxsize=1)
def database() -> Database:
    return Database(get_settings().resolved_database_url())


@lru_cache(maxsize=1)
def store() -> ArtifactStore:
    settings = get_settings()
    s = ArtifactStore(settings.resolved_artifacts_dir(), label=artifacts_label(settings))
    s.ensure()
    return s


@dataclass
class Outcome:
    """What a successful job leaves on its resource row (besides its artifact)."""

    summary: dict[str, Any] | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] | None = None


@dataclass
class JobContext:
    job_id: str
    resource_type: str
    resource_id: str
    settings: Settings
    db: Database
    store: ArtifactStore
    progress: Progress
    worker: str = "worker"  # this worker's Celery node name

    def resource(self) -> Any:
        """The job's resource row, detached (read its params; write back through the Outcome)."""
        with self.db.session() as session:
            return session.get(RESOURCE_TABLES[self.resource_type], self.resource_id)

    def row(self, table: type, ident: str) -> Any:
        with self.db.session() as session:
            found = session.get(table, ident)
        if found is None:
            raise ValueError(f"{table.__tablename__} {ident} no longer exists")
        return found


class Heartbeat(threading.Thread):
    """Beats every ``interval``; past ``kill_at`` (monotonic) it is also the job's hard time limit.

    Celery's own time limits do nothing in the solo and threads pools, and a job stuck inside one
    engine step never reaches the progress check that enforces the soft limit. So, like Celery's
    prefork pool killing a child, the worker records the job as failed and exits; ``moelab serve``
    (or the container's restart policy) starts a fresh one.
    """

    def __init__(self, db: Database, job_id: str, interval: float, kill_at: float | None = None,
                 limit_s: float | None = None, tracker: JobProgress | None = None, tick_s: float = 0.0) -> None:
        super().__init__(name=f"heartbeat-{job_id}", daemon=True)
        self.db, self.job_id, self.interval = db, job_id, interval
        self.kill_at, self.limit_s = kill_at, limit_s
        self.tracker, self.tick_s = tracker, tick_s  # progress ticks between beats (``JobProgress.tick``)
        self.stop = threading.Event()

    def _overran(self) -> None:
        message = (
            f"the job ran past its time limit of {self.limit_s:g} s (MOELAB_JOB_TIME_LIMIT_S) and did not stop at a "
            "progress step, so its worker was ended; make the job smaller (fewer samples or tokens) or raise the limit, "
            f"then re-run it with POST /api/v1/jobs/{self.job_id}/retry"
        )
        try:
            with self.db.session() as session:
                jobs.finish(session, self.job_id, jobs.FAILED, error=message, error_type="time_limit")
        finally:
            log.error("job %s overran its hard time limit: worker exits (%d)", self.job_id, EXIT_TIME_LIMIT)
            logging.shutdown()
            os._exit(EXIT_TIME_LIMIT)

    def run(self) -> None:
        ticking = self.tracker is not None and self.tick_s > 0
        wake = min(self.interval, self.tick_s / 3) if ticking else self.interval  # a gap of at most tick_s + tick_s / 3
        next_beat = time.monotonic() + self.interval
        while not self.stop.wait(wake):
            if self.kill_at is not None and time.monotonic() >= self.kill_at and not self.stop.is_set():
                self._overran()
            if ticking:
                self.tracker.tick(self.tick_s)
            if time.monotonic() < next_beat:
                continue
            next_beat = time.monotonic() + self.interval
            try:
                with self.db.session() as session:
                    jobs.beat(session, self.job_id)
            except Exception:  # a missed beat is survivable; the next one may succeed
                log.exception("heartbeat of %s failed", self.job_id)


class JobProgress:
    """Engine progress → job row (throttled); cancel flag ← job row (throttled)."""

    def __init__(self, db: Database, job_id: str, interval: float, deadline: float | None = None) -> None:
        self.db, self.job_id, self.interval = db, job_id, interval
        self.deadline = deadline  # monotonic time of the job's (soft) time limit
        self.timed_out = False
        self._last_write = 0.0
        self._last_stage: str | None = None
        self._last_check = 0.0
        self._cancel = False
        self.stage: str | None = None

    def update(self, stage: str, current: int, total: int) -> None:
        self.stage = stage
        now = time.monotonic()
        if stage != self._last_stage or current >= total or now - self._last_write >= self.interval:
            try:
                with self.db.session() as session:
                    jobs.record_progress(session, self.job_id, stage, current, total, new_stage=stage != self._last_stage)
            except Exception:  # progress is best effort: a locked or briefly unreachable database must not fail the job
                log.warning("progress of %s not recorded", self.job_id, exc_info=True)
                return
            self._last_write, self._last_stage = now, stage

    def tick(self, every_s: float) -> None:
        """From the heartbeat thread: when the engine has not reported for ``every_s``, say the stage
        still runs (``jobs.touch_progress``), so a watcher sees the job move at least that often."""
        if self._last_stage is None or time.monotonic() - self._last_write < every_s:
            return
        try:
            with self.db.session() as session:
                jobs.touch_progress(session, self.job_id)
            self._last_write = time.monotonic()
        except Exception:
            log.warning("progress tick of %s not recorded", self.job_id, exc_info=True)

    def past_deadline(self) -> bool:
        """The job's soft time limit passed (it then stops like a cancelled one, recorded as time_limit)."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.timed_out = True
        return self.timed_out

    def should_cancel(self) -> bool:
        if SHUTDOWN.is_set():
            return True
        if self.past_deadline():
            return True
        now = time.monotonic()
        if not self._cancel and now - self._last_check >= min(self.interval, 0.5):
            try:
                with self.db.session() as session:
                    self._cancel = jobs.cancel_requested(session, self.job_id)
            except Exception:
                log.warning("cancel flag of %s not read", self.job_id, exc_info=True)
            self._last_check = now
        return self._cancel


def _full_place(exc: BaseException, store: ArtifactStore | None, data_dir: Path | None) -> tuple[str, Path] | None:
    """(setting, path) of the full place when the failed write was under the data dir but not under
    the artifacts dir (None: the artifacts dir, or not known)."""
    name = getattr(exc, "filename", None)
    if not name or data_dir is None:
        return None
    try:
        path, data = Path(name).resolve(), Path(data_dir).resolve()
        if store is not None and Path(store.root).resolve() in (path, *path.parents):
            return None
        if data in (path, *path.parents):
            return "MOELAB_DATA_DIR", data
    except (OSError, ValueError):
        pass
    return None


def classify(exc: BaseException, stage: str | None, job_id: str, store: ArtifactStore | None = None,
             data_dir: Path | None = None) -> tuple[str, str, str]:
    """(state, error_type, message) for an exception that ended a job."""
    where = f" during {stage!r}" if stage else ""
    retry = f"POST /api/v1/jobs/{job_id}/retry"
    if is_disk_full(exc):  # an operator's matter (a full disk or quota), not a bug: say where and how much is free
        then = f"re-run it with {retry}"
        place = _full_place(exc, store, data_dir)
        if place is not None:  # not the artifacts' disk: the data dir's (model cache, database)
            free = human_bytes(free_bytes(place[1]))
            return jobs.FAILED, "storage", (f"no space left under {place[0]}{where}: {free} free; free space there or move it "
                                            f"to a larger disk, then {then}")
        if store is not None:
            return jobs.FAILED, "storage", store.storage_error(exc, where, then).message
        return jobs.FAILED, "storage", f"no space left on the artifacts' disk{where}; free space there, then {then}"
    if isinstance(exc, Cancelled):
        if SHUTDOWN.is_set():
            return jobs.FAILED, "worker_shutdown", f"the worker shut down{where}; start a worker and re-run the job with {retry}"
        return jobs.CANCELLED, "cancelled", f"cancelled on request{where}"
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return jobs.FAILED, "out_of_memory", (
            f"out of memory{where}: use fewer samples, a smaller max_tokens/batch_tokens or seq_len, or a worker with more memory"
        )
    if isinstance(exc, (ValueError, FileNotFoundError)):  # engine errors: AllocationError, ModelError, CalibrationError …
        return jobs.FAILED, "invalid_input", str(exc)
    if isinstance(exc, OSError):
        return jobs.FAILED, "io", f"file system error{where}: {exc}; check free disk space and permissions of the artifacts dir"
    return jobs.FAILED, "internal", f"{type(exc).__name__}{where}: {exc} (a bug in moelab; the worker log has the traceback)"


def estimated_bytes(ctx: JobContext) -> tuple[int, str] | None:
    """About how many bytes the job will write, where that is cheap to know (None otherwise):
    a conversion exports roughly its model's weight bytes; a GGUF export stages an fp32 checkpoint
    and writes the file (``limits.gguf_export_footprint``, from the conversion's stored weights)."""
    if ctx.resource_type == "exports":
        return _export_bytes(ctx)
    if ctx.resource_type != "conversions":
        return None
    try:
        with ctx.db.session() as session:
            conv = session.get(Conversion, ctx.resource_id)
            model_id = conv.model_id if conv is not None else None
            if conv is not None and model_id is None and conv.profile_id is not None:
                profile = session.get(Profile, conv.profile_id)
                model_id = profile.model_id if profile is not None else None
            model = session.get(Model, model_id) if model_id else None
            total = ((model.summary or {}).get("memory") or {}).get("total_bytes") if model is not None else None
    except Exception:  # an estimate only: never a reason to fail the job
        log.debug("size estimate of job %s skipped", ctx.job_id, exc_info=True)
        return None
    if not isinstance(total, int) or total <= 0:
        return None
    return total, "this conversion's export (about its model's weight bytes)"


def _export_bytes(ctx: JobContext) -> tuple[int, str] | None:
    from moelab.engine.limits import gguf_export_footprint

    try:
        row = ctx.resource()
        footprint = gguf_export_footprint(ctx.store.path("conversions", row.conversion_id), row.type) if row is not None else None
    except Exception:  # an estimate only: never a reason to fail the job
        log.debug("size estimate of job %s skipped", ctx.job_id, exc_info=True)
        return None
    if footprint is None:
        return None
    return footprint["disk_bytes"], f"this GGUF {row.type} export (its fp32 staging checkpoint and the file)"


def _finish_failed(db: Database, job_id: str, state: str, message: str, kind: str, timings: dict[str, Any]) -> None:
    """Record a job's end; a database that is briefly unwritable (its disk full too) is retried, and
    a failure to record is logged, never raised: the worker lives on (the reaper ends the job)."""
    for attempt in range(3):
        try:
            with db.session() as session:
                jobs.finish(session, job_id, state, error=message, error_type=kind, timings=timings)
            return
        except Exception:
            if attempt == 2:
                log.exception("job %s ended (%s: %s) but that could not be recorded", job_id, kind, message)
                return
            time.sleep(0.5 * (attempt + 1))


def _interrupt_wanted(db: Database, job_id: str, tracker: JobProgress) -> bool:
    """What the job's ``CancelWatch`` asks: is the job, still running, asked to stop or past its time limit? Never
    once it has ended. Every ending disarms the watch, yet in one CI run a watch fired again 30 s after its fine-tune
    was cancelled and recorded, into the worker's idle event loop, and the worker died of it (every later job stayed
    queued); the row's state is the second lock on that door."""
    with db.session() as session:
        running, cancel = jobs.running_with_cancel(session, job_id)
    return running and (cancel or tracker.past_deadline())


def run_job(job_id: str, worker: str, body: Callable[[JobContext], Outcome]) -> str:
    """Run ``body`` as job ``job_id``; returns the job's final state (or 'skipped')."""
    settings, db = get_settings(), database()
    with db.session() as session:
        job = session.get(Job, job_id)
        if job is None:
            log.warning("job %s: no such row (another database?); message dropped", job_id)
            return "skipped"
        resource_type, resource_id = job.resource_type, job.resource_id
        if not jobs.claim(session, job_id, worker):
            log.info("job %s is %s, not queued: skipped (cancelled before start, or redelivered)", job_id, job.state)
            return "skipped"
    started = time.monotonic()
    tracker = JobProgress(db, job_id, settings.progress_interval_s, deadline=started + settings.job_time_limit_s)
    ctx = JobContext(job_id, resource_type, resource_id, settings, db, store(),
                     Progress(callback=tracker.update, should_cancel=tracker.should_cancel), worker=worker)
    beat = Heartbeat(db, job_id, settings.heartbeat_s, kill_at=started + settings.job_time_limit_s + settings.job_kill_after_s,
                     limit_s=settings.job_time_limit_s, tracker=tracker, tick_s=settings.progress_tick_s)
    beat.start()
    # the watch also enforces the time limit inside a long engine step, not only at its next progress call
    watch = CancelWatch(lambda: _interrupt_wanted(db, job_id, tracker), threading.get_ident(),
                        settings.cancel_poll_s, name=f"cancel-watch-{job_id}")
    watch.start()
    t0 = time.perf_counter()
    try:
        ctx.progress.update("starting", 0, 1)
        need = estimated_bytes(ctx)
        if need is not None:  # refuse up front rather than fill the disk and fail at the end
            ctx.store.require_free(need[0], need[1])
        outcome = body(ctx)
        watch.disarm()  # a cancel delivered here still counts: the except below records it
    except BaseException as exc:  # noqa: BLE001 - every ending is recorded, then non-Exceptions re-raised
        try:
            watch.disarm()
        except Cancelled:  # the watch's interruption, arriving late: exc already ends the job
            pass
        state, kind, message = classify(exc, tracker.stage, job_id, ctx.store, settings.data_dir)
        if tracker.timed_out and isinstance(exc, Cancelled):
            state, kind, message = jobs.FAILED, "time_limit", (
                f"the job ran past its time limit of {settings.job_time_limit_s:g} s (MOELAB_JOB_TIME_LIMIT_S) during "
                f"{tracker.stage!r}; make it smaller (fewer samples or tokens) or raise the limit, then re-run it with "
                f"POST /api/v1/jobs/{job_id}/retry"
            )
        if kind in ("internal", "io"):
            log.exception("job %s failed", job_id)
        elif kind == "storage":
            log.error("job %s failed: %s", job_id, message)
        else:
            log.info("job %s %s: %s", job_id, state, message)
        # the API shows the error: server paths outside the data roots (a library naming its cache, the
        # working directory, the artifacts dir) are replaced; the log above keeps them for the operator
        message = redact_paths(message, settings.resolved_data_roots())
        _finish_failed(db, job_id, state, message, kind, {"run_s": time.perf_counter() - t0})
        if not isinstance(exc, Exception):
            raise
        return state
    finally:
        beat.stop.set()
    with db.session() as session:
        if jobs.finish(session, job_id, jobs.SUCCEEDED, timings={"run_s": time.perf_counter() - t0, **(outcome.timings or {})}):
            row = session.get(RESOURCE_TABLES[resource_type], resource_id)
            if row is None:  # deleted meanwhile (DELETE waits for running jobs, so only in a race)
                log.warning("job %s succeeded but its %s %s no longer exists", job_id, resource_type, resource_id)
                return jobs.SUCCEEDED
            row.summary = outcome.summary
            for name, value in outcome.fields.items():
                setattr(row, name, value)
        else:
            log.warning("job %s finished but was no longer running (reaped?); its result stays unpublished in the row", job_id)
    return jobs.SUCCEEDED
