"""A job's peak resident memory, measured from the job's start.

A worker process runs many jobs, and ``ru_maxrss`` reports the largest peak of them all; Linux keeps a
resettable peak (``VmHWM`` in ``/proc/self/status``, reset by writing 5 to ``/proc/self/clear_refs``), so a
job resets it when it starts and reads it when it ends. Elsewhere the process-wide peak is the fallback.
"""

from __future__ import annotations

import resource
from pathlib import Path


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
