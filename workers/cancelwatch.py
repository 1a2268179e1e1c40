"""Cancel a running job within seconds, even in the middle of a long engine step.

Cooperative cancellation (``Progress.update`` raising ``Cancelled``) waits for the engine's next
progress call; on a real model one profiling batch is a 35 s step, so a cancel took 24 s. A
:class:`CancelWatch` thread reads the job's cancel flag every ``poll_s`` and, once it is set, raises
``Cancelled`` inside the job's thread (``PyThreadState_SetAsyncExc``). That lands at the thread's
next Python-level call, i.e. between two torch operations, and the job ends the way a cooperative
cancel ends it (``classify`` → cancelled; artifacts are published by atomic rename, so an
interrupted step leaves at most a ``.tmp-`` leftover that the next start removes). It is raised
again every ``refire_s`` until the job's thread disarms the watch, in case some ``except Exception``
on the way swallowed it. Not every ``poll_s``: the job's own clean-up after the first one (a fine-tune
saving the checkpoint a Resume continues from) must not be interrupted in turn; re-raised each second,
a cancelled fine-tune on a busy machine lost that checkpoint and resumed from the previous one.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

from moelab.engine.progress import Cancelled

log = logging.getLogger("moelab.worker")

#: Seconds between a fired ``Cancelled`` and the next, while the job's thread has not disarmed the watch.
REFIRE_S = 30.0


def _set_async_exc(thread_id: int, exc_type: type[BaseException] | None) -> None:
    """Schedule ``exc_type`` in thread ``thread_id`` (None clears one still pending)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc_type) if exc_type else None)


class CancelWatch(threading.Thread):
    """Interrupts ``thread_id`` with ``Cancelled`` once ``check()`` says the job should stop."""

    def __init__(self, check: Callable[[], bool], thread_id: int, poll_s: float, name: str = "cancel-watch",
                 refire_s: float = REFIRE_S) -> None:
        super().__init__(name=name, daemon=True)
        self.check, self.thread_id, self.poll_s, self.refire_s = check, thread_id, poll_s, refire_s
        self.fired = 0
        self._armed = True
        self._lock = threading.Lock()
        self._quit = threading.Event()  # not _stop: threading.Thread's join() and is_alive() call a method of that name

    def run(self) -> None:
        while not self._quit.wait(self.refire_s if self.fired else self.poll_s):
            try:
                wanted = self.check()
            except Exception:  # a missed read is retried at the next poll
                log.warning("%s: cancel flag not read", self.name, exc_info=True)
                continue
            if not wanted:
                continue
            with self._lock:
                if not self._armed:
                    return
                _set_async_exc(self.thread_id, Cancelled)
                self.fired += 1

    def disarm(self) -> None:
        """Called by the job's own thread as soon as its body returned or raised: no interruption
        lands after this returns (one scheduled but not yet delivered is cleared). One delivered while it
        runs, before the lock is taken, would leave the watch armed and firing into every later job of this
        thread (the worker's next job was cancelled "on request" with no request made): so it tries again
        until the watch is off, then raises that ``Cancelled`` for the caller to ignore or record."""
        late: Cancelled | None = None
        while True:
            try:
                with self._lock:
                    self._armed = False
                    self._quit.set()
                    if self.fired:
                        _set_async_exc(self.thread_id, None)
                break
            except Cancelled as exc:
                late = exc
        if late is not None:
            raise late
