"""The path rule of a service-side read, in one place: what a Hub id is, whether a real path lies
inside the data roots, and which files a directory (or a ``save_to_disk`` marker) lets a loader open.

Pure functions of strings and the file system (no torch): the API's checks before queueing
(``moelab.store.dataroots``) and the engine's loaders at the read itself (``models.load_model`` and
``data.calibration.load_hf_dataset`` with ``allowed_roots``) use them, each raising its own error.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

#: One segment of a Hub id: ASCII letters, digits, ``_ . -``; no leading dot or dash.
_HUB_SEGMENT = r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,95}"
#: A Hub id: ``name`` or ``org/name``.
_HUB_ID = re.compile(rf"^{_HUB_SEGMENT}(/{_HUB_SEGMENT})?$")
#: The markers a ``datasets`` ``save_to_disk`` directory names its files in.
SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")


def is_hub_id(text: str) -> bool:
    """``name`` or ``org/name`` of ``[A-Za-z0-9._-]``, no ``..``, no leading ``.``, ``-`` or ``/``.

    Pure string test: a Hub id is never looked up on the local disk."""
    return bool(_HUB_ID.match(text)) and ".." not in text


def inside_roots(path: str | os.PathLike[str], roots: Sequence[Path]) -> bool:
    """Whether ``path``'s real path (every symlink resolved) is one of ``roots`` or below one.

    ``roots`` are resolved too, so a root that is itself a symlink still matches what lies under it."""
    real = Path(os.path.realpath(path))
    for root in roots:
        r = Path(os.path.realpath(root))
        if real == r or r in real.parents:
            return True
    return False


def tree_entries(path: Path) -> Iterator[Path]:
    """Every entry (directory or file) under directory ``path``, followed through symlinked
    directories, each real directory visited once (a symlink loop ends the branch)."""
    seen: set[str] = set()
    for top, dirs, files in os.walk(path, followlinks=True):
        real_top = os.path.realpath(top)
        if real_top in seen:
            dirs[:] = []
            continue
        seen.add(real_top)
        for name in (*dirs, *files):
            yield Path(top) / name


def saved_dataset_refs(marker: Path) -> list[Path]:
    """The files and directories a ``save_to_disk`` marker (``state.json`` / ``dataset_dict.json``)
    names, as paths next to it; none when it cannot be read (the loader reports a broken marker)."""
    try:
        meta = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if marker.name == "state.json":
        return [marker.parent / d["filename"] for d in meta.get("_data_files", []) or []
                if isinstance(d, dict) and isinstance(d.get("filename"), str)]
    return [marker.parent / s for s in meta.get("splits", []) or [] if isinstance(s, str)]
