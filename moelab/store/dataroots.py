"""Where calibration data may come from: Hugging Face Hub names, or files under allowed directories.

A ``hf`` calibration source used to accept any path on the server, so an API user could read any
file the service can read (and then page through it as "samples"). Now a dataset reference is
either a Hub name (``wikitext`` or ``org/name``: nothing path-like) or an absolute path that,
with symlinks resolved, lies inside one of ``Settings.resolved_data_roots()`` (``DATA_DIR/uploads``
plus ``MOELAB_DATA_ROOTS``). The API checks it before queueing and the worker checks it again
before reading, so a row written by an older API (or edited by hand) cannot widen the rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: A Hub dataset id: ``name`` or ``org/name``; letters, digits, ``_ . -``; no leading dot or dash.
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.\-]{0,95}(/[A-Za-z0-9][\w.\-]{0,95})?$")
#: File suffixes that make a relative string a file name, not a Hub name.
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt", ".arrow")


class DataRootError(ValueError):
    """A dataset reference outside what the server allows; the message says what to set."""


@dataclass(frozen=True)
class DatasetRef:
    kind: str  # "hub" | "local"
    value: str  # the Hub name, or the resolved absolute path


def _roots_text(roots: list[Path]) -> str:
    return ", ".join(str(r) for r in roots) or "none"


def resolve_dataset(ref: str, roots: list[Path]) -> DatasetRef:
    """Classify ``ref`` as a Hub name or an allowed local path; raise :class:`DataRootError` otherwise."""
    text = ref.strip()
    path_like = (
        text.startswith(("/", ".", "~")) or "\\" in text or ".." in text or text.count("/") > 1
        or text.lower().endswith(_DATA_SUFFIXES) or "\x00" in text
    )
    if not path_like:
        if _HUB_NAME.match(text):
            return DatasetRef("hub", text)
        raise DataRootError(
            f"dataset: {ref!r} is not a Hugging Face dataset name (such as 'wikitext' or 'org/name'); for a file on the "
            "server give its absolute path inside a directory listed in MOELAB_DATA_ROOTS"
        )
    if not text.startswith("/"):
        raise DataRootError(
            f"dataset: {ref!r} looks like a relative path; give an absolute path inside one of the allowed data "
            f"directories ({_roots_text(roots)}; set MOELAB_DATA_ROOTS on the server to add one), or upload the file "
            "with POST /api/v1/calibration-sets/upload"
        )
    real = Path(text).resolve()
    if not any(real == root or root in real.parents for root in roots):
        raise DataRootError(
            f"dataset: {ref!r} is outside the directories this server reads data from ({_roots_text(roots)}); "
            "move the data there, list its directory in MOELAB_DATA_ROOTS on the server (API and workers), or upload "
            "the file with POST /api/v1/calibration-sets/upload"
        )
    if not real.exists():
        raise DataRootError(f"dataset: local path {ref!r} does not exist on the server")
    return DatasetRef("local", str(real))


def check_hub_name_is_not_local(name: str, cwd: Path | None = None) -> None:
    """The ``datasets`` library reads a Hub name that also names a file or directory in the working
    directory from disk; a worker refuses that instead of reading a local file under a Hub name."""
    base = cwd or Path.cwd()
    if (base / name).exists():
        raise DataRootError(
            f"dataset: Hub name {name!r} is also a path in the worker's working directory ({base}); refusing to read "
            "it from disk. Give an absolute path inside MOELAB_DATA_ROOTS for local data"
        )
