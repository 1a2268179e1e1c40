"""Whether a speed was timed on a busy machine: ``evaluation.speed`` records ``others_cpu_share``, the share of the
CPUs other processes took during the timing, and every place that shows the ratios says when it is too large to trust
them. Torch-free, so the UI reads it too."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: from this share of the CPUs taken by other processes during a timing, its ratios are called unreliable
BUSY_SHARE = 0.1


def busy_note(speed: Mapping[str, Any] | None) -> str | None:
    """A warning when other processes took ``BUSY_SHARE`` or more of the CPUs while ``speed`` (a
    ``time_phases`` result) was timed; None otherwise, or for a timing from before the share was recorded."""
    share = (speed or {}).get("others_cpu_share")
    if not isinstance(share, (int, float)) or share < BUSY_SHARE:
        return None
    return (f"timed on a busy machine: other processes took {share:.0%} of the CPUs, which slows a converted model's "
            f"many small parallel calls more than the dense model's; time again with the machine to itself")
