"""Where service-side data may come from: Hugging Face Hub names, or files under allowed directories.

Calibration data (``hf`` sources) and registered models are read by the service on the user's
behalf, so what they name is checked here, by the API before queueing and by the worker again before
reading (a row written by an older API, or edited by hand, cannot widen the rule):

* a Hub name (``wikitext``, ``org/name``; see :func:`is_hub_id`) is never resolved against the
  process's working directory; it goes to the Hub;
* anything else must be an absolute path that, with symlinks resolved, lies inside one of
  ``Settings.resolved_data_roots()`` (``DATA_DIR/uploads`` plus ``MOELAB_DATA_ROOTS``); for a
  directory every file under it the loader may open is checked the same way, so a symlink inside a
  root pointing elsewhere is refused;
* the engine's loaders apply the same rule at the read itself when given ``allowed_roots``
  (``moelab.engine.models.load_model``, ``moelab.engine.data.calibration.load_hf_dataset``: the
  engine imports nothing from here), and a worker sets it for every model load
  (``moelab.engine.models.restrict_sources``);
* a relative path, a NUL byte or another malformed string is bad input (:class:`DataRootError`,
  HTTP 422); a path outside the roots is :class:`OutsideDataRoots` (HTTP 403). Callers pick the
  status by type, never by the message's words.

Messages name what the user gave and the roots (the administrator's own setting), never where a
symlink points or another server path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from moelab.engine.sources import SAVED_DATASET_MARKERS, inside_roots, is_hub_id, saved_dataset_refs, tree_entries
#: File suffixes that make a relative string a file name, not a Hub name.
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt", ".arrow")
#: Most entries a source directory may hold (each is checked); more is refused, not walked.
MAX_TREE_ENTRIES = 20000


class DataRootError(ValueError):
    """A reference the server will not read (malformed, relative, missing); the message says what to fix. HTTP 422."""


class OutsideDataRoots(PermissionError, DataRootError):
    """A reference whose real path (symlinks resolved) is outside the allowed data roots. HTTP 403."""


def http_status(exc: DataRootError) -> int:
    """403 for a path outside the roots, 422 for any other refused reference."""
    return 403 if isinstance(exc, OutsideDataRoots) else 422


@dataclass(frozen=True)
class DatasetRef:
    kind: str  # "hub" | "local"
    value: str  # the Hub name, or the resolved absolute path


@dataclass(frozen=True)
class ModelRef:
    kind: str  # "default" | "hub" | "local"
    value: str  # "default", the Hub id, or the real absolute path (what the worker loads)
    given: str  # the user's own string (stripped): what the API shows


def _roots_text(roots: Sequence[Path]) -> str:
    return ", ".join(str(r) for r in roots) or "none"


def _no_nul(text: str, field: str) -> None:
    if "\x00" in text:
        raise DataRootError(f"{field}: contains a NUL byte (\\x00); remove it and give a plain name or absolute path")


def _outside(field: str, given: str, roots: Sequence[Path], what: str = "") -> OutsideDataRoots:
    detail = f" ({what})" if what else ""
    return OutsideDataRoots(
        f"{field}: {given!r}{detail} is outside the directories this server reads from ({_roots_text(roots)}); move it "
        "there, or list its directory in MOELAB_DATA_ROOTS on the server (API and workers)"
    )


def check_tree(path: Path, roots: Sequence[Path], field: str, given: str) -> None:
    """Every entry under directory ``path`` (followed through symlinked directories) must have its
    real path inside ``roots``: a loader pointed at the directory may open any of them."""
    for count, entry in enumerate(tree_entries(path), 1):
        if count > MAX_TREE_ENTRIES:
            raise DataRootError(f"{field}: {given!r} holds more than {MAX_TREE_ENTRIES} files; point to a smaller directory or one file")
        if not inside_roots(entry, roots):
            raise _outside(field, given, roots, f"{entry.relative_to(path)} links to a file outside them")


def _saved_dataset_refs(directory: Path) -> list[Path]:
    """Files and directories a ``save_to_disk`` directory refers to by name in its JSON markers."""
    return [ref for top, _dirs, files in os.walk(directory, followlinks=False)
            for name in files if name in SAVED_DATASET_MARKERS for ref in saved_dataset_refs(Path(top) / name)]


def check_dataset_path(real: Path, roots: Sequence[Path], given: str) -> None:
    """A local dataset file or directory, already known to be inside ``roots``: for a directory,
    every file under it and every file its ``save_to_disk`` markers name must be inside too."""
    if real.is_dir():
        check_tree(real, roots, "dataset", given)
        for ref in _saved_dataset_refs(real):
            if not inside_roots(ref, roots):
                raise _outside("dataset", given, roots, f"its saved dataset names {ref.name}, which resolves outside them")


def resolve_dataset(ref: str, roots: Sequence[Path]) -> DatasetRef:
    """Classify ``ref`` as a Hub name or an allowed local path; raise :class:`DataRootError`
    (:class:`OutsideDataRoots` for a path outside ``roots``) otherwise."""
    _no_nul(ref, "dataset")
    text = ref.strip()
    path_like = (
        text.startswith(("/", ".", "~")) or "\\" in text or ".." in text or text.count("/") > 1
        or text.lower().endswith(_DATA_SUFFIXES)
    )
    if not path_like:
        if is_hub_id(text):
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
    real = Path(os.path.realpath(text))
    if not inside_roots(real, roots):
        raise OutsideDataRoots(
            f"dataset: {ref!r} is outside the directories this server reads data from ({_roots_text(roots)}); "
            "move the data there, list its directory in MOELAB_DATA_ROOTS on the server (API and workers), or upload "
            "the file with POST /api/v1/calibration-sets/upload"
        )
    if not real.exists():
        raise DataRootError(f"dataset: local path {ref!r} does not exist on the server")
    check_dataset_path(real, roots, ref)
    return DatasetRef("local", str(real))


def check_hub_name_is_not_local(name: str, cwd: Path | None = None) -> None:
    """The ``datasets`` library reads a Hub name that also names a file or directory in the working
    directory from disk; a worker refuses that instead of reading a local file under a Hub name."""
    base = cwd or Path.cwd()
    if (base / name).exists():
        raise DataRootError(
            f"dataset: Hub name {name!r} is also a path in the worker's working directory; refusing to read "
            "it from disk. Give an absolute path inside MOELAB_DATA_ROOTS for local data"
        )


def resolve_model_source(source: str, roots: Sequence[Path]) -> ModelRef:
    """A model source the service may load: ``default``, a Hub id, or an absolute (or ``~``) path
    whose real path lies inside ``roots``: a model directory with ``config.json`` (every file under
    it inside the roots too) or a ``.gguf`` file.

    A Hub-shaped string is classified by its text alone (never looked up relative to the working
    directory); a relative path is refused (the server's working directory is not the user's)."""
    _no_nul(source, "source")
    text = source.strip()
    if text == "default":
        return ModelRef("default", text, text)
    if is_hub_id(text) and not text.lower().endswith(".gguf"):
        return ModelRef("hub", text, text)
    if not text.startswith(("/", "~")):
        if text.startswith(("./", "../", ".")) or "/" in text or "\\" in text or text.lower().endswith(".gguf"):
            raise DataRootError(
                f"source: {text!r} is a relative path; give the absolute path of a model directory or .gguf file inside "
                f"a directory listed in MOELAB_DATA_ROOTS ({_roots_text(roots)})"
            )
        raise DataRootError(
            f"source: {text!r} is neither 'default', a Hugging Face id such as 'HuggingFaceTB/SmolLM2-135M' (name or "
            "org/name of letters, digits, '_', '.', '-'), nor an absolute path inside MOELAB_DATA_ROOTS"
        )
    try:
        path = Path(text).expanduser()
    except RuntimeError:  # ~user of an unknown user
        raise DataRootError(f"source: {text!r}: unknown home directory; give an absolute path inside MOELAB_DATA_ROOTS") from None
    if not path.is_absolute():
        raise DataRootError(f"source: {text!r} is a relative path; give an absolute path inside MOELAB_DATA_ROOTS")
    real = Path(os.path.realpath(path))
    if not inside_roots(real, roots):
        raise _outside("source", text, roots)
    if not real.exists():
        raise DataRootError(f"source: local path {text!r} does not exist on the server; give an existing model directory or .gguf file")
    if real.is_file():
        if real.suffix.lower() != ".gguf":
            raise DataRootError(f"source: {text!r} is a file but not a .gguf model; give a model directory (with config.json) or a .gguf file")
        # transformers reads the tokenizer and config next to a .gguf file too
        for sibling in real.parent.glob("*.json"):
            if not inside_roots(sibling, roots):
                raise _outside("source", text, roots, f"{sibling.name} next to it links outside them")
    elif real.is_dir():
        if not (real / "config.json").is_file():
            raise DataRootError(f"source: directory {text!r} has no config.json; save the model with save_pretrained first")
        check_tree(real, roots, "source", text)
    else:
        raise DataRootError(f"source: {text!r} is neither a model directory nor a .gguf file")
    return ModelRef("local", str(real), text)


#: An absolute path in free text (not part of a URL, not an API route).
_ABS_PATH = re.compile(r"(?<![\w.:/\-~])/(?!api/)[^\s'\"()\[\]{},;:<>|*?`]+")


def redact_paths(text: str, roots: Sequence[Path]) -> str:
    """``text`` with every absolute path outside ``roots`` replaced by ``<server path>`` (error
    messages from libraries name cache and working directories the API must not reveal)."""

    def repl(m: re.Match[str]) -> str:
        candidate = m.group(0).rstrip(".")
        tail = m.group(0)[len(candidate):]
        try:
            keep = inside_roots(candidate, roots) or not os.path.isabs(candidate)
        except (OSError, ValueError):
            keep = False
        return m.group(0) if keep else "<server path>" + tail

    return _ABS_PATH.sub(repl, text)
