"""How long torch's OpenMP threads spin before they sleep, set before torch is imported.

On Linux torch's CPU wheel runs its intra-op threads on libgomp. After each parallel region an idle thread spins
``GOMP_SPINCOUNT`` times (libgomp's default: 300,000, a fraction of a millisecond) waiting for the next one. On a machine
of its own that spin hides the wake-up; on a shared one it burns the time slices the other process needed, and both
slow down many times over: the default model's decode step took 355 ms instead of 70 ms beside one other 2-thread
torch process on 2 cores, and a loop of small products and SVDs (MIDAS's shape of work) 16-86 s instead of 5 s. With
a spin of 1,000 the same step took 112 ms there and the same 70-74 ms alone (``tests/benchmarks/bench_busy_machine.py``).

libgomp reads the variable once, when torch loads it, so this runs on ``import moelab`` (the CLI, the API and the
Celery workers import moelab before torch). A value already in the environment wins; code that imports torch before
moelab keeps libgomp's default.
"""

from __future__ import annotations

import os

#: Spins before an idle OpenMP thread sleeps (libgomp's default is 300,000).
SPIN_COUNT = "1000"


def limit_spinning() -> None:
    """Set ``GOMP_SPINCOUNT`` for this process and its children unless the user set it."""
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
