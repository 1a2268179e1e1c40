"""Measured speed in the UI: an evaluation's whole-model timing (``summary.speed``: the converted model against its
dense model in the same process, per phase) as table cells and chart axes. Pure functions of the API's data."""

from __future__ import annotations

from typing import Any

#: The phases an evaluation times (the keys of ``summary.speed.phases``) and their short names.
PHASES = {"decode_b1": "decode b1", "decode_b8": "decode b8", "prefill": "prefill"}


def phase_speedup(summary: dict[str, Any] | None, phase: str) -> float | None:
    """The converted model's speed over dense's in ``phase`` (dense time ÷ converted time); None when not timed."""
    entry = (((summary or {}).get("speed") or {}).get("phases") or {}).get(phase) or {}
    value = (entry.get("speedup") or {}).get("converted")
    return float(value) if isinstance(value, (int, float)) else None


def how_timed(summary: dict[str, Any] | None) -> str:
    """'cpu: x86_64, float32, 2 threads, PyTorch eager …; median of 3 interleaved rounds': where the times come from."""
    speed = (summary or {}).get("speed") or {}
    if not speed:
        return "not timed (an evaluation from before moelab timed models, or run with speed off)"
    p = speed.get("protocol") or {}
    return (f"{speed.get('device')}, {speed.get('dtype')}, {speed.get('threads')} threads, {speed.get('runtime')}; "
            f"median of {p.get('repeats')} interleaved rounds")


def phase_text(summary: dict[str, Any] | None, phase: str) -> str:
    """'1.27×' or '0.81× (slower)' or '–'; the seconds are in :func:`phase_title`."""
    value = phase_speedup(summary, phase)
    if value is None:
        return "–"
    return f"{value:.2f}×" + (" (slower)" if value < 1 else "")


def phase_title(summary: dict[str, Any] | None, phase: str) -> str:
    """A cell's hover: both models' times in this phase and how they were measured."""
    entry = ((((summary or {}).get("speed") or {}).get("phases") or {}).get(phase)) or {}
    seconds = entry.get("seconds") or {}
    if not seconds:
        return how_timed(summary)
    what = f"prefill of {entry.get('tokens')} tokens" if phase == "prefill" else f"one decode step of batch {entry.get('batch')}"
    return (f"{what}: dense {1e3 * seconds['dense']:.1f} ms, converted {1e3 * seconds['converted']:.1f} ms; "
            + how_timed(summary))


def speed_cell(summary: dict[str, Any] | None) -> str:
    """'1.31× / 0.82× / 0.90×': every phase's speed over dense, in :data:`PHASES` order; '' when not timed."""
    values = [phase_speedup(summary, phase) for phase in PHASES]
    return " / ".join("–" if v is None else f"{v:.2f}×" for v in values) if any(v is not None for v in values) else ""


def slower_phases(predicted: dict[str, Any]) -> list[str]:
    """The phases a predicted plan runs slower than dense in (``summary.predicted_speed`` of a preview)."""
    return [phase for phase, v in (predicted.get("phases") or {}).items()
            if isinstance(v.get("speedup"), (int, float)) and v["speedup"] < 1]


def predicted_speed_words(predicted: dict[str, Any]) -> str:
    """'Predicted speed × dense: decode b1 1.21×, decode b8 0.85×, prefill 0.70× — slower than dense in decode b8 and
    prefill (cpu: …, 2 threads).' or the note saying why there is no prediction."""
    phases = predicted.get("phases") or {}
    if not phases:
        return predicted.get("note") or ""
    said = ", ".join(f"{PHASES.get(p, p)} {v['speedup']:.2f}×" for p, v in phases.items() if isinstance(v.get("speedup"), (int, float)))
    slow = slower_phases(predicted)
    verdict = (" — slower than dense in " + " and ".join(PHASES.get(p, p) for p in slow)) if slow else " — no phase slower than dense"
    return (f"Predicted speed × dense: {said}{verdict} ({predicted.get('machine')}, {predicted.get('dtype')}, "
            f"{predicted.get('threads')} threads; from measured kernel times).")
