"""Parameter dataclasses from stored dicts (``conversion.json``, job rows), refusing unknown keys."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


def from_known_fields(cls: type[T], d: Mapping[str, Any], what: str, error: type[Exception]) -> T:
    """``cls(**d)``, or ``error`` naming the keys ``cls`` does not have (a typo must not pass silently)."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise error(f"unknown {what} parameters: {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**d)
