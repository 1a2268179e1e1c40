"""A worker that ``moelab serve`` started ends within a second of serve's death, whatever its job is doing.

serve arms its children with Linux's parent-death signal (SIGTERM), but a Celery worker answers SIGTERM
with a warm shutdown: its running job stops only at its next progress step, which a long engine step
(a layer's fitting, a model load) may reach a minute later, while a restarted serve already runs next to
it. So a worker whose environment names its serve (``MOELAB_SERVE_PID``) watches its parent: once that is
gone, it records its running jobs as failed with the cause and exits at once (``os._exit``: nothing of the
job's half-written output is committed; artifacts are written atomically, so nothing stored is corrupted).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from moelab.store import jobs

log = logging.getLogger("moelab.worker")

POLL_S = 0.25
#: exit status of a worker that ended because its moelab serve did
EXIT_PARENT_GONE = 76
_watched: tuple[str, int] | None = None  # (this worker's node name, its serve's pid) once ``watch`` started


def serve_pid() -> int | None:
    """The pid of the ``moelab serve`` that started this process, when it did (and is still its parent)."""
    given = os.environ.get("MOELAB_SERVE_PID", "")
    return int(given) if given.isdigit() and int(given) == os.getppid() else None


def _parent_gone(node: str, parent: int) -> None:
    from workers.jobrun import database

    def reason(job) -> str:
        return (f"moelab serve (pid {parent}), which ran this job's worker {node}, ended at stage {job.stage!r} "
                f"{job.current}/{job.total}, and the worker stopped with it; start `moelab serve` again and re-run the job "
                f"with POST /api/v1/jobs/{job.id}/retry")

    try:
        with database().session() as session:
            failed = jobs.fail_jobs_of(session, node, reason)
        if failed:
            log.error("moelab serve (pid %d) ended: failed %s; worker exits", parent, ", ".join(failed))
    finally:
        logging.shutdown()
        os._exit(EXIT_PARENT_GONE)


def exit_if_serve_gone() -> None:
    """When the watched serve is gone: its running jobs failed with that cause, and exit now. The watch polls this;
    Celery's shutdown signal calls it too, since that signal may be the parent-death SIGTERM, and the warm shutdown it
    would start records only "the worker shut down"."""
    if _watched is not None and os.getppid() != _watched[1]:
        _parent_gone(*_watched)


def watch(node: str, poll_s: float = POLL_S) -> threading.Thread | None:
    """Start the watch for worker ``node`` (a daemon thread); None when no serve started this process."""
    global _watched
    parent = serve_pid()
    if parent is None:
        return None
    _watched = (node, parent)

    def run() -> None:
        while True:
            time.sleep(poll_s)
            exit_if_serve_gone()

    thread = threading.Thread(target=run, name="serve-watch", daemon=True)
    thread.start()
    return thread
