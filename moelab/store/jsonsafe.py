"""Engine output made JSON-safe for the SQL store and the API (numpy scalars and arrays, NaN → None)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def finite_list(a: np.ndarray | Sequence[Any], digits: int = 6) -> list[Any]:
    """A (nested) list with NaN/±inf as None (JSON has no NaN), floats rounded to ``digits``."""
    arr = np.asarray(a)
    if arr.dtype.kind in "iub":
        return arr.tolist()
    arr = np.round(arr.astype(np.float64), digits)
    out = arr.astype(object)
    out[~np.isfinite(arr)] = None
    return out.tolist()


def jsonable(obj: Any) -> Any:
    """Recursively make engine output JSON-safe (numpy scalars/arrays, NaN → None)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return finite_list(obj)
    if isinstance(obj, (np.floating, float)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj
