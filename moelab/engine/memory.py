"""A job's peak resident memory, measured from the job's start; the freed heap given back between a streamed job's
layers.

A worker process runs many jobs, and ``ru_maxrss`` reports the largest peak of them all; Linux keeps a
resettable peak (``VmHWM`` in ``/proc/self/status``, reset by writing 5 to ``/proc/self/clear_refs``), so a
job resets it when it starts and reads it when it ends. Elsewhere the process-wide peak is the fallback.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
from pathlib import Path
from typing import Any


def reset_peak_rss() -> None:
    """Start this job's peak at the current resident memory (Linux ≥ 4.0; a no-op elsewhere)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mib() -> float:
    """The peak resident memory since :func:`reset_peak_rss` where the kernel allows it, else the process's."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def give_back_freed_heap() -> None:
    """Return the heap memory freed so far to the kernel (glibc's ``malloc_trim``; a no-op elsewhere). A streamed job
    calls it as each layer's weights and activations go: glibc keeps freed blocks below its mmap threshold (up to 32
    MiB) for reuse, and across the default model's 30 layers a streamed ``--recipe best`` fit kept 285 MiB of them, the
    resident memory growing some 20 MiB a layer past what ``--max-memory`` budgets."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
