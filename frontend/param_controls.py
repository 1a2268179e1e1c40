"""A declared parameter (the API's ``ParamOut``: type, default, ``ge``/``gt``/``le``/``lt``) as a numeric
control: its step and its inclusive bounds. Shared by the pages that draw controls from declarations (the
designer's method parameters, the Fine-tune page's budget)."""

from __future__ import annotations

import math
from typing import Any


def _nice(x: float) -> float:
    """The 1-2-5 number at or below ``x`` (0.06 → 0.05, 0.3 → 0.2)."""
    e = math.floor(math.log10(x))
    return next(m * 10.0**e for m in (5, 2, 1) if m * 10.0**e <= x * (1 + 1e-9))


def param_step(spec: dict[str, Any]) -> float | int:
    """The step of a numeric control: 1 for an int; for a float, 0.05 on a bounded range of at most 2
    (a share in [0, 1]; a twentieth of a narrower range), a hundredth of a wider one, else a tenth of
    its default's size (τ 0.6: 0.05), rounded down to 1-2-5 (0.01 when the default is 0 or absent)."""
    if spec["type"] == "int":
        return 1
    lo = spec["ge"] if spec["ge"] is not None else spec["gt"]
    hi = spec["le"] if spec["le"] is not None else spec["lt"]
    if lo is not None and hi is not None and hi > lo:
        return min(0.05, _nice((hi - lo) / 20)) if hi - lo <= 2 else _nice((hi - lo) / 100)
    default = spec.get("default")
    return _nice(abs(default) / 10) if isinstance(default, (int, float)) and default else 0.01


def param_bounds(spec: dict[str, Any], step: float | int | str | None = None) -> tuple[float | None, float | None]:
    """The control's inclusive ``min``/``max``: ``ge``/``le`` as they are, a strict ``gt``/``lt`` one
    step inside (τ > 0 with step 0.05: min 0.05), so the stepper never lands on a refused value.
    ``step``: the control's (default :func:`param_step`); ``"any"`` (a number typed freely) has no step to stay
    inside by, so a strict bound is the control's bound and the API refuses the bound itself."""
    step = param_step(spec) if step is None else step

    def inside(bound: float, sign: int) -> float:
        return bound if step == "any" else round(bound + sign * step, 6)

    lo = spec["ge"] if spec["ge"] is not None else (inside(spec["gt"], 1) if spec["gt"] is not None else None)
    hi = spec["le"] if spec["le"] is not None else (inside(spec["lt"], -1) if spec["lt"] is not None else None)
    return lo, hi
