"""Memory sizes as people write them (``2GiB``, ``512MB``): parsed and printed without torch,
so the API can validate a job's ``max_memory`` and the engine can budget by it."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1.5G"`` (a bare letter is binary, like ``GiB``), ``"1000000"`` → bytes."""
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"memory size must be positive, got {text}")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}: use a number with a unit such as 2GiB, 512MB, 1.5G")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return size


def format_size(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number ≥ 1 (``1.50 GiB``)."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
