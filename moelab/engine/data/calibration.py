"""Calibration sets: named lists of text samples that profiling, conversion and evaluation run on.

Every method in moelab is driven by activations recorded on a calibration set (EW §3.1 builds
its activation matrix from "5 few-shot samples per task"; MIDAS builds one expert per set), and
the UI compares routing across sets. So a set is a first-class object here: it has a
deterministic content ``id`` (same text -> same id, whatever its source), per-task and
per-domain statistics, a preview, and a durable on-disk form (``samples.parquet`` +
``calibration.json``). That type, :class:`CalibrationSet`, is defined in
:mod:`moelab.engine.data.sets` (below both this module and the built-in sets) and re-exported here.

Where the samples come from:

* user uploads: JSONL (``text`` plus optional ``task``/``domain``) or plain ``.txt``;
* Hugging Face ``datasets`` (hub names, local data files/dirs, ``save_to_disk`` dirs);
* the built-in offline sets of :mod:`moelab.engine.data.builtin` (``builtin:NAME``).

:func:`load_calibration` turns a one-string *spec* (what the CLI, API and UI pass around)
into a :class:`CalibrationSet`.

Errors are :class:`CalibrationError` and always name the file (and 1-based line) plus what
to change, because the message ends up verbatim in a failed job's row.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

from ..text import text_problem
from ..sources import SAVED_DATASET_MARKERS, inside_roots, saved_dataset_refs, tree_entries
from .builtin import builtin_set
# The set itself (and the chunking builtin shares) lives in ``sets``, below both; re-exported here.
from .sets import META_FILE, CalibrationError, CalibrationSet, Sample, chunk_text  # noqa: F401

#: Accepted ``load_calibration`` spec forms, shown in error messages.
SPEC_FORMS = (
    "builtin:NAME (see `moelab data list`)",
    "hf:DATASET_NAME_OR_PATH[@split]",
    "a directory saved by CalibrationSet.save (holds calibration.json)",
    "a .jsonl / .json file with a 'text' field per line",
    "a .txt file (samples separated by blank lines)",
)


# --------------------------------------------------------------------------------------------
# user files
# --------------------------------------------------------------------------------------------


def _read_utf8(path: Path) -> str:
    """Read a file as UTF-8 (a BOM is accepted) and refuse missing/empty/non-UTF-8 files.

    The line of the first undecodable byte is reported so the user can fix that line instead
    of re-encoding blindly.
    """
    path = Path(path)
    if not path.exists():
        raise CalibrationError(f"{path}: file not found; check the path")
    if path.is_dir():
        raise CalibrationError(f"{path}: is a directory, expected a file")
    data = path.read_bytes()
    if not data.strip():
        raise CalibrationError(f"{path}: file is empty; add samples (one per line for JSONL, blank-line separated for .txt)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise CalibrationError(
            f"{path}:{line}: bytes that are not UTF-8 (first at byte {exc.start}); "
            "save the file as UTF-8"
        ) from exc


def _filter_short(samples: list[Sample], path: Path, min_chars: int) -> list[Sample]:
    kept = [s for s in samples if len(s.text.strip()) >= min_chars]
    if not kept:
        raise CalibrationError(
            f"{path}: every sample is shorter than {min_chars} characters; "
            "use longer texts (a few sentences each) or lower min_chars"
        )
    return kept


def _label(value: Any, key: str, path: Path, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise CalibrationError(f"{path}:{where}: '{key}' must be a string, got {type(value).__name__}; quote it or remove it")
    return _storable(value, key, path, where) or None


def _storable(value: str, key: str, path: Path, where: str) -> str:
    problem = text_problem(value)
    if problem:
        raise CalibrationError(f"{path}:{where}: '{key}' {problem}")
    return value


def _record_to_sample(obj: Any, path: Path, where: str) -> Sample:
    if not isinstance(obj, dict):
        raise CalibrationError(
            f"{path}:{where}: expected a JSON object like {{\"text\": \"...\"}}, got {type(obj).__name__}"
        )
    if "text" not in obj:
        raise CalibrationError(f"{path}:{where}: missing 'text' field; every record needs \"text\": \"...\"")
    text = obj["text"]
    if not isinstance(text, str):
        raise CalibrationError(f"{path}:{where}: 'text' must be a string, got {type(text).__name__}")
    return Sample(_storable(text, "text", path, where), _label(obj.get("task"), "task", path, where), _label(obj.get("domain"), "domain", path, where))


def read_jsonl(path: Path, min_chars: int = 20) -> list[Sample]:
    """Samples from a JSONL file: one object per line with ``text`` and optional ``task``/``domain``.

    A ``.json`` file holding one JSON array of such objects is accepted too (errors then name
    the array element). Blank lines are ignored; samples shorter than ``min_chars`` are skipped
    as long as some remain.
    """
    path = Path(path)
    content = _read_utf8(path)
    samples: list[Sample] = []
    stripped = content.lstrip()
    if path.suffix.lower() == ".json" and stripped.startswith("["):
        try:
            array = json.loads(content)
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}); fix the syntax") from exc
        except RecursionError as exc:  # the parser recurses per nesting level
            raise CalibrationError(f"{path}: JSON nested too deeply; give an array of flat {{\"text\": ...}} objects") from exc
        for i, obj in enumerate(array):
            samples.append(_record_to_sample(obj, path, f"element {i}"))
    else:
        for lineno, line in enumerate(content.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationError(
                    f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                    "each line must be one JSON object"
                ) from exc
            except RecursionError as exc:  # the parser recurses per nesting level: thousands of [[[… end here
                raise CalibrationError(
                    f"{path}:{lineno}: JSON nested too deeply; each line must be one flat object like "
                    '{"text": "...", "task": "...", "domain": "..."}'
                ) from exc
            samples.append(_record_to_sample(obj, path, str(lineno)))
    if not samples:
        raise CalibrationError(f"{path}: file holds no records; add one JSON object per line")
    return _filter_short(samples, path, min_chars)


TXT_CHUNK_CHARS = 1500


def read_txt(path: Path, min_chars: int = 20) -> list[Sample]:
    """Samples from plain text: paragraphs separated by blank lines are samples.

    A file that is one single paragraph (e.g. a book without blank lines) is cut into
    ~1500-character pieces at line boundaries instead, so it gives many samples rather than one
    that the profiler would truncate. Paragraphs longer than twice that are cut the same way.
    """
    path = Path(path)
    content = _read_utf8(path).replace("\r\n", "\n").replace("\r", "\n")
    paragraphs = [p.strip() for p in re.split(r"\n[ \t]*\n", content) if p.strip()]
    if len(paragraphs) == 1:
        texts = chunk_text(paragraphs[0], target=TXT_CHUNK_CHARS, min_chars=1)
    else:
        texts = []
        for p in paragraphs:
            texts.extend(chunk_text(p, target=TXT_CHUNK_CHARS, min_chars=1) if len(p) > 2 * TXT_CHUNK_CHARS else [p])
    return _filter_short([Sample(t) for t in texts], path, min_chars)


# --------------------------------------------------------------------------------------------
# Hugging Face datasets
# --------------------------------------------------------------------------------------------

_DATA_FILE_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
    ".txt": "text",
    ".arrow": "arrow",
}
_SAVE_TO_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def _column(ds: Any, name: str) -> list[Any]:
    return list(ds[name])


def load_hf_dataset(
    name_or_path: str,
    split: str = "train",
    text_field: str = "text",
    task_field: str = "task",
    domain_field: str = "domain",
    config: str | None = None,
    limit: int | None = None,
    trust_remote_code: bool = False,
    allowed_roots: Sequence[Path] | None = None,
) -> CalibrationSet:
    """A calibration set from the ``datasets`` library.

    * a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` ->
      ``load_from_disk`` (``split`` picks from a DatasetDict);
    * a local data file (.jsonl/.json/.parquet/.csv/.txt/.arrow) -> the matching packaged
      builder, the file mapped to ``split``;
    * a local directory of data files, or a Hub dataset name -> ``load_dataset``.

    ``task_field``/``domain_field`` are used when the columns exist. ``trust_remote_code`` is
    forwarded only to ``datasets`` versions that still run dataset scripts (newer ones never do).

    ``allowed_roots`` (a service): a local source must be an absolute path whose real path, and that
    of every data file the loader will open (symlinks resolved), lies inside these roots
    (``moelab.store.dataroots``); otherwise ``DataRootError`` / ``OutsideDataRoots`` and nothing is read.
    """
    import datasets  # heavy import, only when this source is used

    ref = name_or_path
    if allowed_roots is not None:
        name_or_path = _checked_local(name_or_path, allowed_roots)  # the real path: what was checked is what is read
    path = Path(name_or_path).expanduser()
    looks_local = name_or_path.startswith(("/", ".", "~")) or path.suffix.lower() in _DATA_FILE_BUILDERS
    if looks_local and not path.exists():
        raise CalibrationError(f"{path}: file or directory not found; check the path")
    try:
        if path.is_dir() and any((path / m).exists() for m in _SAVE_TO_DISK_MARKERS):
            ds = _load_saved(datasets, path, split, limit, name_or_path)
            name = path.name
        else:
            sel = split if limit is None else f"{split}[:{int(limit)}]"
            kwargs: dict[str, Any] = {}
            if trust_remote_code:
                import inspect

                if "trust_remote_code" in inspect.signature(datasets.load_dataset).parameters:
                    kwargs["trust_remote_code"] = True
            if path.is_file():
                builder = _DATA_FILE_BUILDERS.get(path.suffix.lower())
                if builder is None:
                    raise CalibrationError(
                        f"{path}: unsupported data file type {path.suffix!r}; use one of {sorted(_DATA_FILE_BUILDERS)}"
                    )
                if path.suffix.lower() == ".tsv":
                    kwargs["delimiter"] = "\t"
                ds = datasets.load_dataset(builder, data_files={split: str(path)}, split=sel, **kwargs)
                name = path.stem
            elif path.is_dir() and allowed_roots is not None:
                ds = _load_checked_dir(datasets, path, config, sel, allowed_roots, ref, kwargs)
                name = path.name
            elif path.is_dir():
                ds = datasets.load_dataset(str(path), config, split=sel, **kwargs)
                name = path.name
            else:
                ds = datasets.load_dataset(name_or_path, config, split=sel, **kwargs)
                name = name_or_path.rstrip("/").split("/")[-1]
    except CalibrationError:
        raise
    except ConnectionError as exc:
        raise CalibrationError(
            f"{ref}: the Hugging Face Hub is not reachable ({exc}); use a local copy instead "
            "(hf:/path/to/data.parquet, a data directory or a save_to_disk directory)"
        ) from exc
    except (FileNotFoundError, ValueError, KeyError, OSError) as exc:
        raise CalibrationError(
            f"{ref}: cannot load with the datasets library ({type(exc).__name__}: {exc}); "
            "check the name, config and split, or point to a local file/directory"
        ) from exc
    except Exception as exc:  # datasets has its own exception types (DatasetNotFoundError, ...)
        raise CalibrationError(f"{ref}: cannot load with the datasets library ({type(exc).__name__}: {exc})") from exc

    if isinstance(ds, datasets.IterableDataset):  # pragma: no cover - we never ask for streaming
        raise CalibrationError(f"{ref}: streaming datasets are not supported")
    samples = _dataset_samples(ds, ref, split, text_field, task_field, domain_field)
    return CalibrationSet(name=name, samples=samples, source=f"hf:{ref}@{split}")


def _load_saved(datasets: Any, path: Path, split: str, limit: int | None, name_or_path: str) -> Any:
    """``load_from_disk`` of a ``save_to_disk`` directory: its ``split`` if it holds a ``DatasetDict``,
    the first ``limit`` rows."""
    obj = datasets.load_from_disk(str(path))
    if isinstance(obj, datasets.DatasetDict):
        if split not in obj:
            raise CalibrationError(
                f"{path}: no split {split!r} in this saved dataset (has {sorted(obj)}); "
                f"use hf:{name_or_path}@<split>"
            )
        ds = obj[split]
    else:
        ds = obj
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return ds


def _dataset_samples(ds: Any, ref: str, split: str, text_field: str, task_field: str, domain_field: str,
                     ) -> list[Sample]:
    """The non-empty ``text_field`` rows of ``ds`` as samples, labelled from ``task_field`` /
    ``domain_field`` where those columns exist."""
    columns = list(ds.column_names)
    if text_field not in columns:
        raise CalibrationError(
            f"{ref}: no column {text_field!r} (available columns: {', '.join(columns)}); "
            "pass text_field=<one of them>"
        )
    texts = _column(ds, text_field)
    tasks = _column(ds, task_field) if task_field in columns else [None] * len(texts)
    domains = _column(ds, domain_field) if domain_field in columns else [None] * len(texts)
    samples: list[Sample] = []
    for i, (t, k, d) in enumerate(zip(texts, tasks, domains)):
        if t is None:
            continue
        if not isinstance(t, str):
            raise CalibrationError(f"{ref}: row {i}: column {text_field!r} must hold strings, got {type(t).__name__}")
        if not t.strip():
            continue
        samples.append(Sample(t, None if k is None else str(k) or None, None if d is None else str(d) or None))
    if not samples:
        raise CalibrationError(f"{ref}: split {split!r} has no non-empty {text_field!r} values")
    return samples


class CalibrationOutsideRoots(PermissionError, CalibrationError):
    """A service-side source whose real path, or that of a file it names, is outside the data roots."""


def _checked_local(name_or_path: str, roots: Sequence[Path]) -> str:
    """For a service (``allowed_roots``): a local ``hf`` source's real path, after checking that it,
    every file under it and every file its ``save_to_disk`` markers name lie inside ``roots``. A Hub
    name is returned as is (the service checks its form before queueing). The API checks the same
    rule with its own messages (``moelab.store.dataroots``); this is the check at the read itself."""
    if "\x00" in name_or_path:
        raise CalibrationError("dataset path contains a NUL byte; remove it")
    text = name_or_path.strip()
    if not text.startswith(("/", ".", "~")) and "\\" not in text and ".." not in text and text.count("/") <= 1 \
            and not text.lower().endswith(tuple(_DATA_FILE_BUILDERS)):
        return text  # a Hub name
    if not text.startswith("/"):
        raise CalibrationError(f"{text!r} is a relative path; give an absolute path inside MOELAB_DATA_ROOTS")
    if not inside_roots(text, roots):
        raise CalibrationOutsideRoots(f"{text!r} is outside the directories this server reads data from; "
                                      "list its directory in MOELAB_DATA_ROOTS (API and workers)")
    real = Path(os.path.realpath(text))
    for entry in tree_entries(real) if real.is_dir() else ():
        marker = entry.name in SAVED_DATASET_MARKERS and entry.is_file()
        for r in [entry, *(saved_dataset_refs(entry) if marker else ())]:
            if not inside_roots(r, roots):
                raise CalibrationOutsideRoots(
                    f"{text!r}: {entry.relative_to(real)} refers to a file outside the directories this server "
                    "reads data from; copy the data into the directory instead of linking it")
    return str(real)


def _load_checked_dir(datasets: Any, path: Path, config: str | None, sel: str, roots: Sequence[Path], ref: str,
                      kwargs: dict[str, Any]) -> Any:
    """``load_dataset`` of a data directory, with every data file the builder resolved (from file
    names or a README's ``configs``) checked against ``roots`` before any is opened."""
    builder = datasets.load_dataset_builder(str(path), config, **kwargs)
    data_files = getattr(builder.config, "data_files", None) or {}
    for f in (f for split_files in data_files.values() for f in split_files):
        text = str(f).removeprefix("file://")
        if "://" in text or not inside_roots(path / text, roots):  # an absolute ``text`` replaces ``path``
            raise CalibrationOutsideRoots(f"{ref}: data file {Path(text).name} resolves outside the directories this "
                                          "server reads data from; move it into MOELAB_DATA_ROOTS")
    builder.download_and_prepare()
    return builder.as_dataset(split=sel)


# --------------------------------------------------------------------------------------------
# one-string specs
# --------------------------------------------------------------------------------------------


def _forms() -> str:
    return "; ".join(SPEC_FORMS)


def load_calibration(
    spec: str,
    *,
    samples: int | None = None,
    seed: int = 0,
    data_dir: Path | None = None,
    split: str = "calibration",
) -> CalibrationSet:
    """Resolve a spec string into a calibration set (what CLI flags and API fields carry).

    ``builtin:NAME`` builds a built-in set with ``samples`` samples (240 by default) from the
    given ``split`` ("calibration" or "heldout", see :mod:`moelab.engine.data.builtin`); ``hf:X[@split]``
    loads with ``datasets`` (split defaults to "train"; ``split`` here does not apply);
    a saved set directory, a ``.jsonl``/``.json`` or a ``.txt`` file are read as-is. For all
    but builtins, ``samples`` takes a deterministic, task-balanced subsample.
    """
    spec = spec.strip()
    if not spec:
        raise CalibrationError(f"empty calibration spec; use one of: {_forms()}")
    if spec.startswith("builtin:"):
        return builtin_set(
            spec[len("builtin:") :], n_samples=240 if samples is None else samples, seed=seed, split=split, data_dir=data_dir
        )
    if spec.startswith("hf:"):
        ref = spec[len("hf:") :]
        hf_split = "train"
        head, sep, tail = ref.rpartition("@")
        if sep and head and tail and "/" not in tail:
            ref, hf_split = head, tail
        if not ref:
            raise CalibrationError(f"{spec!r}: missing dataset name after 'hf:'; e.g. hf:my_org/my_data@train")
        cs = load_hf_dataset(ref, split=hf_split)
    else:
        path = Path(spec).expanduser()
        suffix = path.suffix.lower()
        if path.is_dir():
            if not (path / META_FILE).is_file():
                raise CalibrationError(
                    f"{path}: directory has no {META_FILE}; it is not a saved calibration set "
                    f"(for a datasets directory use hf:{spec})"
                )
            cs = CalibrationSet.load(path)
        elif suffix in (".jsonl", ".json"):
            cs = CalibrationSet(path.stem, read_jsonl(path), source=str(path))
        elif suffix == ".txt":
            cs = CalibrationSet(path.stem, read_txt(path), source=str(path))
        else:
            hint = "file not found; " if not path.exists() else ""
            raise CalibrationError(f"{spec}: {hint}not a calibration source; use one of: {_forms()}")
    if samples is not None:
        cs = cs.subsample(samples, seed)
    return cs

