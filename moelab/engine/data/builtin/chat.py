"""chatterbot-corpus (``builtin:chat``): short multilingual dialogues, one unit per corpus file,
split stratified by language and volume (:func:`_chat_partition`)."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import random
from pathlib import Path

import yaml

from ..sets import CalibrationError, Sample
from .packing import TARGET_CHARS, Built, _allocate, _interleave, _pack, unit_split


@functools.lru_cache(maxsize=1)
def _chat_files() -> tuple[tuple[str, str, str], ...]:
    """``(language, unit name, path)`` for every corpus file, found without importing the
    package (its parent project pulls in heavy dependencies)."""
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise CalibrationError(
            "builtin:chat needs chatterbot-corpus: pip install --no-deps chatterbot-corpus "
            "(scripts/install.sh does this)"
        )
    root = Path(list(spec.submodule_search_locations)[0]) / "data"
    out = []
    for p in sorted(root.glob("*/*.yml")):
        out.append((p.parent.name, f"{p.parent.name}/{p.name}", str(p)))
    return tuple(out)


@functools.lru_cache(maxsize=512)
def _conversations(path: str) -> tuple[str, ...]:
    """Each conversation as dialogue lines, speakers alternating ``A:``/``B:``."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=loader)
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return ()
    convs = data.get("conversations") if isinstance(data, dict) else None
    out = []
    for conv in convs or ():
        if not isinstance(conv, list):
            continue
        turns = [str(t).strip() for t in conv if t is not None and str(t).strip()]
        if len(turns) >= 2:
            out.append("\n".join(f"{'AB'[i % 2]}: {t}" for i, t in enumerate(turns)))
    return tuple(dict.fromkeys(out))  # the corpus repeats some conversations verbatim


@functools.lru_cache(maxsize=1)
def _chat_partition() -> dict[str, str]:
    """Split of every corpus file, stratified by language and by volume.

    A plain per-file hash can leave a language with no usable held-out text (English has 21
    files of very unequal size). So within each language, files are visited in hash order and
    moved to the held-out split while that keeps it under 30 % of the language's characters,
    until it holds at least 15 %; at least one file always stays in calibration. A language
    with one file (or where no file fits) falls back to the plain hash of each file.
    """
    by_lang: dict[str, list[tuple[str, int]]] = {}
    for lang, unit, path in _chat_files():
        by_lang.setdefault(lang, []).append((unit, sum(len(c) for c in _conversations(path))))
    split: dict[str, str] = {}
    for lang, files in by_lang.items():
        total = sum(size for _, size in files) or 1
        ranked = sorted(files, key=lambda f: hashlib.sha256(f"chatterbot:{f[0]}".encode()).hexdigest())
        held: list[str] = []
        held_chars = 0
        for unit, size in ranked:
            if held_chars >= 0.15 * total or len(held) == len(files) - 1:
                break
            if held_chars + size <= 0.30 * total:
                held.append(unit)
                held_chars += size
        for unit, _ in files:
            if held:
                split[unit] = "heldout" if unit in held else "calibration"
            else:
                split[unit] = unit_split(f"chatterbot:{unit}")
    return split


@functools.lru_cache(maxsize=1)
def _chat_calibration_texts() -> frozenset[str]:
    partition = _chat_partition()
    return frozenset(c for _, unit, path in _chat_files() if partition[unit] == "calibration" for c in _conversations(path))


def _build_chat(n: int, rng: random.Random, split: str, data_dir: Path | None) -> Built:
    pieces: dict[str, list[tuple[str, str]]] = {}
    partition = _chat_partition()
    # a conversation that also occurs in a calibration file is not held-out text
    seen: set[str] = set(_chat_calibration_texts()) if split == "heldout" else set()
    for lang, unit, path in _chat_files():
        if partition[unit] == split:
            for conv in _conversations(path):
                if conv not in seen:  # identical conversations recur across topic files
                    seen.add(conv)
                    pieces.setdefault(lang, []).append((f"chatterbot:{unit}", conv))
    langs = sorted(k for k, v in pieces.items() if v)
    rng.shuffle(langs)
    capacity = {}
    for lang in langs:
        total = sum(len(c) + 2 for _, c in pieces[lang])
        capacity[lang] = total // TARGET_CHARS or (1 if total >= TARGET_CHARS // 2 else 0)
    counts = _allocate(capacity, n, langs, allow_repeat=True)
    groups = [
        [(units, Sample(text, "chat", lang)) for units, text in _pack(pieces[lang], counts[lang], rng)] for lang in langs
    ]
    return _interleave(groups)
