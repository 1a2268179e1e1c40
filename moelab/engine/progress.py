"""Progress reporting and cooperative cancellation shared by every long engine call.

The engine calls ``progress.update(stage, current, total)`` at natural boundaries (a batch,
a layer). The CLI turns that into a progress bar; a job worker writes it to the job row and
answers ``should_cancel`` from the job's state, so cancelling is cooperative and a cancelled
run never leaves a half-written artifact (writers only publish complete results).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

ProgressCallback = Callable[[str, int, int], None]


class Cancelled(Exception):
    """Raised inside the engine when the caller asked to stop."""


@dataclass
class Progress:
    """Where the engine reports ``(stage, current, total)`` and asks whether to stop."""

    callback: ProgressCallback | None = None
    should_cancel: Callable[[], bool] | None = None

    def update(self, stage: str, current: int, total: int) -> None:
        if self.should_cancel is not None and self.should_cancel():
            raise Cancelled(f"cancelled during {stage!r} at {current}/{total}")
        if self.callback is not None:
            self.callback(stage, current, total)

    @contextmanager
    def step(self, stage: str) -> Iterator[None]:
        """One indivisible piece of work (loading a model, reading text) as ``stage 0/1`` then ``1/1``,
        so a watcher sees what runs instead of the previous stage frozen."""
        self.update(stage, 0, 1)
        yield
        self.update(stage, 1, 1)

    def within(self, prefix: str) -> Progress:
        """The same reporting and cancellation with stages named ``'prefix: stage'``: a routine
        reused inside a larger job (clustering experts for an evaluation's baseline) says whose
        step it is instead of looking like the conversion itself."""
        return Progress(callback=lambda stage, current, total: self.update(f"{prefix}: {stage}", current, total))


NO_PROGRESS = Progress()
