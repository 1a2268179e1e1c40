"""A timing's dense-in-moelab's-kernels baseline read back (``evaluation.kernel_dense`` builds and times it): its
name among the timed models and the sparsity's own gain over it. Standard library only, so the UI reads it as data."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

#: the name a timing gives the baseline (``evaluation.speed.time_phases``' models)
NAME = "dense_kernels"
#: how a reader is told of it
LABEL = "dense in moelab's kernels"


def sparsity_gain(speed: Mapping[str, Any], name: str = "converted") -> dict[str, float]:
    """Per phase, model ``name``'s speed over the dense model in moelab's kernels: the median over rounds of the
    baseline's time over ``name``'s in the same round (as ``time_phases`` computes a speed-up), or, where the rounds
    were not kept, the quotient of the two speed-ups over dense. What the sparsity bought beyond the kernels; empty
    where the timing has no such baseline."""
    out = {}
    for phase, entry in (speed.get("phases") or {}).items():
        ratios = entry.get("speedup") or {}
        if in_rounds := round_ratios(entry, name, NAME):
            out[phase] = statistics.median(in_rounds)
        elif isinstance(ratios.get(NAME), (int, float)) and isinstance(ratios.get(name), (int, float)) and ratios[NAME] > 0:
            out[phase] = float(ratios[name]) / float(ratios[NAME])
    return out


def round_ratios(entry: Mapping[str, Any], model: str, ref: str) -> list[float]:
    """One phase of a timing (``time_phases``' ``phases[p]``): ``model``'s speed over ``ref``'s in each interleaved
    round, ``ref``'s time over its own (a speed-up is their median). Their spread is how far the machine moved the
    ratio while it was timed; [] where the rounds were not kept."""
    rounds = entry.get("rounds") or {}
    return [r / m for r, m in zip(rounds.get(ref) or [], rounds.get(model) or []) if m > 0]


def slower_words(speedup: float, ratios: Sequence[float]) -> str:
    """What a median ``speedup`` below 1 says of the rounds it came from (``round_ratios``): 'slower' where every
    round was slower (or none was kept), 'slower in 2 of 3 rounds' where some round was not (the median below 1 by
    how far the machine moved while it was timed: the dense model in moelab's kernels prefills with dense's own GEMMs
    and read 1.00x, rounds 0.99-1.02); '' at 1 or above."""
    if speedup >= 1:
        return ""
    below = sum(r < 1 for r in ratios)
    return "slower" if below == len(ratios) else f"slower in {below} of {len(ratios)} rounds"
