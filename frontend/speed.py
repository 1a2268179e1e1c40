"""Measured speed in the UI: an evaluation's whole-model timing (``summary.speed``: the converted model against its
dense model in the same process, per phase) as table cells and chart axes. Pure functions of the API's data."""

from __future__ import annotations

from typing import Any

from moelab.engine.core.speed_prediction import PREDICTION_ERROR, close_phases, kernel_dense_words, slower_phases
from moelab.engine.evaluation.busy_machine import busy_note
from moelab.engine.evaluation.kernel_gain import (LABEL as KERNEL_LABEL, NAME as KERNEL_DENSE, round_ratios,
                                                 slower_words, sparsity_gain)

#: The phases an evaluation times (the keys of ``summary.speed.phases``) and their short names.
PHASES = {"decode_b1": "decode b1", "decode_b8": "decode b8", "prefill": "prefill"}
#: how a hover names a timed model whose key says less to a reader
MODEL_NAMES = {"teal": "TEAL", KERNEL_DENSE: KERNEL_LABEL}


def _phase(summary: dict[str, Any] | None, phase: str) -> dict[str, Any]:
    """One phase of an evaluation's timing (``summary.speed.phases[phase]``; {} when not timed)."""
    return (((summary or {}).get("speed") or {}).get("phases") or {}).get(phase) or {}


def phase_speedup(summary: dict[str, Any] | None, phase: str, name: str = "converted") -> float | None:
    """Model ``name``'s speed over dense's in ``phase`` (dense time ÷ its time): the converted model's, or ``teal``'s
    (TEAL at the conversion's cost, timed in the same rounds); None when not timed."""
    value = (_phase(summary, phase).get("speedup") or {}).get(name)
    return float(value) if isinstance(value, (int, float)) else None


def how_timed(summary: dict[str, Any] | None) -> str:
    """'cpu: x86_64, float32, 2 threads, PyTorch eager …; median of 3 interleaved rounds': where the times come from."""
    speed = (summary or {}).get("speed") or {}
    if not speed:
        return "not timed (an evaluation from before moelab timed models, or run with speed off)"
    p = speed.get("protocol") or {}
    busy = busy_note(speed)
    return (f"{speed.get('device')}, {speed.get('dtype')}, {speed.get('threads')} threads, {speed.get('runtime')}; "
            f"median of {p.get('repeats')} interleaved rounds" + (f"; {busy}" if busy else "")
            + (f"; {speed['old_runtime']}" if speed.get("old_runtime") else ""))


def phase_text(summary: dict[str, Any] | None, phase: str) -> str:
    """'1.27×', '0.81× (slower)', '0.99× (slower in 2 of 3 rounds)' (``slower_words``) or '–'; the seconds are in
    :func:`phase_title`."""
    value = phase_speedup(summary, phase)
    if value is None:
        return "–"
    words = slower_words(value, round_ratios(_phase(summary, phase), "converted", "dense"))
    return f"{value:.2f}×" + (f" ({words})" if words else "")


def phase_title(summary: dict[str, Any] | None, phase: str) -> str:
    """A cell's hover: both models' times in this phase, the converted model's ratio in each round (how far the
    machine moved it) and how they were measured."""
    entry = _phase(summary, phase)
    seconds = entry.get("seconds") or {}
    if not seconds:
        return how_timed(summary)
    what = f"prefill of {entry.get('tokens')} tokens" if phase == "prefill" else f"one decode step of batch {entry.get('batch')}"
    timed = ", ".join(f"{MODEL_NAMES.get(name, name)} {1e3 * s:.1f} ms" for name, s in seconds.items())
    ratios = round_ratios(entry, "converted", "dense")
    spread = f"; converted over dense by round {', '.join(f'{r:.2f}×' for r in ratios)}" if len(ratios) > 1 else ""
    return f"{what}: {timed}{spread}; " + how_timed(summary)


def speed_cell(summary: dict[str, Any] | None, name: str = "converted") -> str:
    """'1.31× / 0.82× / 0.90×': every phase's speed over dense, in :data:`PHASES` order, marked '(busy machine)' when
    other processes took a share of the CPUs that makes the ratios unreliable (``busy_note``) and '(older runtime)'
    when the export ran a runtime older than moelab's (``old_runtime``); '' when not timed."""
    values = [phase_speedup(summary, phase, name) for phase in PHASES]
    if not any(v is not None for v in values):
        return ""
    speed = (summary or {}).get("speed") or {}
    marks = [mark for mark, on in (("busy machine", busy_note(speed)), ("older runtime", speed.get("old_runtime"))) if on]
    return " / ".join("–" if v is None else f"{v:.2f}×" for v in values) + (f" ({', '.join(marks)})" if marks else "")


def perplexity_ratio(summary: dict[str, Any] | None, name: str) -> float | None:
    """Variant ``name``'s perplexity over dense's in an evaluation's summary (its stored ratio, else the quotient of
    the two perplexities); None when either is missing."""
    variants = (summary or {}).get("variants") or {}
    d, dense = variants.get(name) or {}, (variants.get("dense") or {}).get("perplexity")
    ratio = d.get("perplexity_ratio")
    if ratio is None and isinstance(d.get("perplexity"), (int, float)) and isinstance(dense, (int, float)) and dense:
        ratio = d["perplexity"] / dense
    return float(ratio) if isinstance(ratio, (int, float)) else None


def teal_wins(summary: dict[str, Any] | None) -> list[str]:
    """The phases where TEAL at the conversion's cost is both faster than the conversion and no worse in perplexity
    (the same text, the same rounds); empty when it is worse or was not timed."""
    teal, conv = perplexity_ratio(summary, "teal"), perplexity_ratio(summary, "converted")
    if teal is None or conv is None or teal > conv:
        return []
    return [phase for phase in PHASES
            if (t := phase_speedup(summary, phase, "teal")) is not None and (c := phase_speedup(summary, phase)) is not None
            and t > c]


def teal_words(summary: dict[str, Any] | None) -> str:
    """'1.45× / 0.80× / 0.85×, ppl 1.02× dense — better and faster than the conversion in decode b1': TEAL at the
    conversion's cost, timed beside it; '' when the evaluation has no TEAL timing."""
    cell = speed_cell(summary, "teal")
    if not cell:
        return ""
    teal, conv = perplexity_ratio(summary, "teal"), perplexity_ratio(summary, "converted")
    text = cell + (f", ppl {teal:.2f}× dense" if teal is not None else "")
    wins = teal_wins(summary)
    if wins:
        return text + " — better and faster than the conversion in " + " and ".join(PHASES[p] for p in wins)
    if teal is not None and conv is not None and teal <= conv:
        return text + " — better than the conversion, not faster"
    return text


def kernel_words(summary: dict[str, Any] | None) -> str:
    """'1.51× / 1.26× / 1.00×; the conversion over it 1.05× / 1.02× / 1.15×': the dense model in moelab's kernels
    (the same weights, the same outputs) over dense, timed in the same rounds, and the conversion's speed over that
    baseline: what its sparsity bought beyond the kernels, '(slower)' where the conversion loses to it. The reason
    where it was not timed; '' for an evaluation from before it."""
    speed = (summary or {}).get("speed") or {}
    cell = speed_cell(summary, KERNEL_DENSE)
    if not cell:
        return f"not timed: {speed['kernel_dense_note']}" if speed.get("kernel_dense_note") else ""
    gain = sparsity_gain(speed)
    values = [gain.get(p) for p in PHASES]
    return (cell + "; the conversion over it " + " / ".join("–" if v is None else f"{v:.2f}×" for v in values)
            + (" (slower)" if any(v is not None and v < 1 for v in values) else ""))


def predicted_cell(summary: dict[str, Any] | None) -> tuple[str, str]:
    """A conversion's predicted speed over dense, '1.46× / 1.31× / 0.92× (slower)' in :data:`PHASES` order ('(close to
    dense)' where a phase is within the prediction's error of dense), and its hover (:func:`predicted_speed_words`);
    '–' with the reason when nothing was predicted, ('', '') for a conversion from before predictions."""
    predicted = (summary or {}).get("predicted_speed")
    if not predicted:
        return "", ""
    phases = predicted.get("phases") or {}
    values = [(phases.get(p) or {}).get("speedup") for p in PHASES]
    if not any(isinstance(v, (int, float)) for v in values):
        return "–", predicted_speed_words(predicted)
    text = " / ".join(f"{v:.2f}×" if isinstance(v, (int, float)) else "–" for v in values)
    mark = " (slower)" if slower_phases(predicted) else " (close to dense)" if close_phases(predicted) else ""
    return text + mark, predicted_speed_words(predicted)


def predicted_speed_words(predicted: dict[str, Any]) -> str:
    """'Predicted speed × dense: decode b1 1.21×, decode b8 0.85×, prefill 0.70× — slower than dense in decode b8 and
    prefill; the dense model in moelab's kernels 1.45× / 1.22× / 1.00×, the plan over it 0.83× / 0.70× / 0.70× (cpu: …,
    2 threads).' or 'Predicted speed × dense: none (why).'"""
    phases = predicted.get("phases") or {}
    if not phases:
        return f"Predicted speed × dense: none ({predicted['note']})." if predicted.get("note") else ""
    said = ", ".join(f"{PHASES.get(p, p)} {v['speedup']:.2f}×" for p, v in phases.items() if isinstance(v.get("speedup"), (int, float)))
    slow = slower_phases(predicted)
    verdict = (" — slower than dense in " + " and ".join(PHASES.get(p, p) for p in slow)) if slow else " — no phase slower than dense"
    if close := close_phases(predicted):
        verdict += (f"{' and' if slow else ', but'} within the prediction's {PREDICTION_ERROR:.0%} error of dense in "
                    + " and ".join(PHASES.get(p, p) for p in close) + ": it may measure slower")
    return (f"Predicted speed × dense: {said}{verdict}{kernel_dense_words(predicted)} ({predicted.get('machine')}, "
            f"{predicted.get('dtype')}, {predicted.get('threads')} threads; {predicted.get('note') or 'from measured kernel times'}).")
