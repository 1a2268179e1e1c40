"""What every built-in source shares: sample sizes, the calibration/held-out split of source
units (:func:`unit_split`), and the helpers that turn a source's pieces into balanced samples
(allocate counts over domains, pack pieces, interleave groups)."""

from __future__ import annotations

import hashlib
import random
from typing import Callable, Iterator

from ..sets import CalibrationError, Sample

SPLITS = ("calibration", "heldout")
HELDOUT_PERCENT = 20
TARGET_CHARS = 1200  # a sample is closed once it reaches this ...
MAX_CHARS = 1600  # ... and is never longer than this
MIN_CHARS = 1000  # line-chunked pieces shorter than this (file tails) are dropped

Units = tuple[str, ...]
Built = list[tuple[Units, Sample]]  # every sample with the source units it was made from


def unit_split(unit: str) -> str:
    """``"heldout"`` for ~20 % of unit names, ``"calibration"`` for the rest; stable forever.

    A hash rather than a seeded shuffle so the partition is independent of seed, sample count
    and of which other units exist (installing a newer package version moves no unit).
    """
    h = int.from_bytes(hashlib.sha256(unit.encode("utf-8")).digest()[:8], "big")
    return "heldout" if h % 100 < HELDOUT_PERCENT else "calibration"


def _trim(text: str, max_chars: int = MAX_CHARS) -> str:
    """Cut to ``max_chars`` at the last line break (or space) that keeps most of the text."""
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n", 0, max_chars)
    if cut < max_chars * 0.6:
        cut = text.rfind(" ", 0, max_chars)
    if cut < max_chars * 0.6:
        cut = max_chars
    return text[:cut].rstrip()


def _allocate(capacity: dict[str, int], n: int, order: list[str], allow_repeat: bool) -> dict[str, int]:
    """Spread ``n`` samples over groups round-robin, each up to its capacity.

    Balanced across domains (a small language or play gets as many samples as a large one
    until it runs out). With ``allow_repeat`` the remainder is spread again over non-empty
    groups (a further pass over the same pieces, regrouped).
    """
    counts = {k: 0 for k in order}
    remaining = n
    while remaining > 0:
        progressed = False
        for k in order:
            if remaining == 0:
                break
            if counts[k] < capacity.get(k, 0):
                counts[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            break
    pool = [k for k in order if capacity.get(k, 0) > 0]
    i = 0
    while allow_repeat and remaining > 0 and pool:
        counts[pool[i % len(pool)]] += 1
        remaining -= 1
        i += 1
    return counts


def _interleave(groups: list[Built]) -> Built:
    """Round-robin merge, so the first samples of a set already show every group."""
    out: Built = []
    depth = 0
    while True:
        added = False
        for g in groups:
            if depth < len(g):
                out.append(g[depth])
                added = True
        if not added:
            return out
        depth += 1


def _pack(pieces: list[tuple[str, str]], count: int, rng: random.Random, sep: str = "\n\n") -> list[tuple[Units, str]]:
    """Join shuffled ``(unit, text)`` pieces into ``count`` samples of ~TARGET_CHARS each.

    Pieces are dealt from a shuffled deck; when it runs out it is reshuffled (a new pass), and a
    sample never holds the same piece twice.
    """
    if not pieces or count <= 0:
        return []
    deck = list(range(len(pieces)))
    rng.shuffle(deck)
    pos = 0
    out: list[tuple[Units, str]] = []
    for _ in range(count):
        used: set[int] = set()
        parts: list[str] = []
        units: list[str] = []
        size = 0
        while size < TARGET_CHARS and len(used) < len(pieces):
            if pos >= len(deck):
                rng.shuffle(deck)
                pos = 0
            i = deck[pos]
            pos += 1
            if i in used:
                continue
            used.add(i)
            unit, text = pieces[i]
            parts.append(text)
            units.append(unit)
            size += len(text) + len(sep)
        out.append((tuple(dict.fromkeys(units)), _trim(sep.join(parts))))
    return out


def _round_robin_generators(order: list[str], make: Callable[[str], Iterator[tuple[Units, Sample]]], n: int) -> Built:
    """Take one sample from each group's (lazy) generator in turn until ``n``.

    Lazy so that building 40 code samples reads ~40 files, not the whole standard library.
    """
    gens = {k: make(k) for k in order}
    active = list(order)
    out: Built = []
    while active and len(out) < n:
        still: list[str] = []
        for k in active:
            item = next(gens[k], None)
            if item is None:
                continue
            out.append(item)
            still.append(k)
            if len(out) == n:
                break
        active = still
    return out


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise CalibrationError(f"unknown split {split!r}; use 'calibration' or 'heldout'")
