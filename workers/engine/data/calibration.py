"""Calibration sets: named lists of text samples that profiling, conversion and evaluation run on.

Every method in moelab is driven by activations recorded on a calibration set (EW §3.1 builds
its activation matrix from "5 few-shot samples per task"; MIDAS builds one expert per set), and
the UI compares routing across sets. So a set is a first-class object here: it has a
deterministic content ``id`` (same text -> same id, whatever its source), per-task and
per-domain statistics, a preview, and a durable on-disk form (``samples.parquet`` +
``calibration.json``).

Where the samples come from:

* user uploads: JSONL (``text`` plus optional ``task``/``domain``) or plain ``.txt``;
* Hugging Face ``datasets`` (hub names, local data files/dirs, ``save_to_disk`` dirs);
* the built-in offline sets of :mod:`workers.engine.data.builtin` (``builtin:NAME``).

:func:`load_calibration` turns a one-string *spec* (what the CLI, API and UI pass around)
into a :class:`CalibrationSet`.

Errors are :class:`CalibrationError` and always name the file (and 1-based line) plus what
to change, because the message ends up verbatim in a failed job's row.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..atomic import atomic_directory, write_json_atomic
from ..sources import SAVED_DATASET_MARKERS, inside_roots, saved_dataset_refs, tree_entries

SAMPLES_FILE = "samples.parquet"
META_FILE = "calibration.json"
FORMAT_VERSION = 1

#: Accepted ``load_calibration`` spec forms, shown in error messages.
SPEC_FORMS = (
    "builtin:NAME (see `moelab data list`)",
    "hf:DATASET_NAME_OR_PATH[@split]",
    "a directory saved by CalibrationSet.save (holds calibration.json)",
    "a .jsonl / .json file with a 'text' field per line",
    "a .txt file (samples separated by blank lines)",
)


class CalibrationError(ValueError):
    """A calibration source cannot be used; the message names the file/line and the fix."""


@dataclass(frozen=True)
class Sample:
    """One calibration text. ``task`` groups samples for ExpertWeaver's per-task means (EW Eq. 3);
    ``domain`` is a finer source label used for routing heatmaps per domain (EW Fig. 8)."""

    text: str
    task: str | None = None
    domain: str | None = None


# --------------------------------------------------------------------------------------------
# text chunking (shared with builtin_data)
# --------------------------------------------------------------------------------------------


def _split_long_line(line: str, max_chars: int) -> list[str]:
    """Cut a line longer than ``max_chars`` at the last whitespace before the limit (hard cut
    when there is none), so minified or one-line files still give bounded samples."""
    # Walk an index instead of re-slicing the remainder (``line = line[cut:]`` copied the rest of
    # the line once per piece: quadratic, 10 s for a one-line 16 MB upload and 516 s for 49 MB).
    parts: list[str] = []
    start, n = 0, len(line)
    while n - start > max_chars:
        cut = line.rfind(" ", start + max_chars // 2, start + max_chars)
        cut = start + max_chars if cut < 0 else cut + 1
        parts.append(line[start:cut])
        start = cut
    if start < n:
        parts.append(line[start:])
    return parts


def chunk_text(text: str, target: int = 1500, max_chars: int | None = None, min_chars: int = 1) -> list[str]:
    """Split ``text`` at line boundaries into pieces of about ``target`` characters.

    A piece is closed as soon as it reaches ``target``, or earlier when the next line would push
    it past ``max_chars`` (default ``target * 4 // 3``). Lines longer than ``max_chars`` are cut
    at whitespace. Pieces shorter than ``min_chars`` (after trimming blank lines) are dropped,
    which is how callers discard a short tail. Loops over lines, never over tokens.
    """
    max_chars = max_chars or target * 4 // 3
    chunks: list[str] = []
    buf: list[str] = []
    size = 0

    def close() -> None:
        nonlocal buf, size
        if buf:
            piece = "".join(buf).strip("\n").rstrip()
            if len(piece.strip()) >= min_chars:
                chunks.append(piece)
        buf, size = [], 0

    for line in text.splitlines(keepends=True):
        for part in _split_long_line(line, max_chars) if len(line) > max_chars else (line,):
            if size and size + len(part) > max_chars:
                close()
            if not buf and not part.strip():
                continue  # never start a piece with blank lines
            buf.append(part)
            size += len(part)
            if size >= target:
                close()
    close()
    return chunks


# --------------------------------------------------------------------------------------------
# the set
# --------------------------------------------------------------------------------------------


def _label_stats(samples: list[Sample], labels: list[str | None], tokens: list[int] | None) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for i, (s, lab) in enumerate(zip(samples, labels)):
        if lab is None:
            continue
        entry = out.setdefault(lab, {"samples": 0, "chars": 0, **({"tokens": 0} if tokens is not None else {})})
        entry["samples"] += 1
        entry["chars"] += len(s.text)
        if tokens is not None:
            entry["tokens"] += tokens[i]
    return dict(sorted(out.items()))


@dataclass
class CalibrationSet:
    """A named, ordered list of samples with where it came from (``source``) and the seed that
    chose them (``seed``; ``None`` when nothing random was involved)."""

    name: str
    samples: list[Sample]
    source: str
    seed: int | None = None

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def id(self) -> str:
        """``cs-`` + 12 hex digits of SHA-256 over the canonical JSON of name and samples.

        Content-addressed so that re-creating the same set (same builtin, same seed) gives the
        same id and stored profiles can be reused, while any edit to the text gives a new id.
        ``source``/``seed`` are provenance, not content, and are left out on purpose.
        """
        payload = {"name": self.name, "samples": [[s.text, s.task, s.domain] for s in self.samples]}
        blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
        return "cs-" + hashlib.sha256(blob.encode("utf-8")).hexdigest()[:12]

    def tasks(self) -> list[str]:
        """Distinct task labels, sorted (the grouping EW's CV uses)."""
        return sorted({s.task for s in self.samples if s.task is not None})

    def domains(self) -> list[str]:
        """Distinct domain labels, sorted."""
        return sorted({s.domain for s in self.samples if s.domain is not None})

    def to_frame(self) -> pd.DataFrame:
        """Samples as a table with columns ``text``, ``task``, ``domain`` (None kept as missing)."""
        return pd.DataFrame(
            {
                "text": pd.Series([s.text for s in self.samples], dtype="object"),
                "task": pd.Series([s.task for s in self.samples], dtype="object"),
                "domain": pd.Series([s.domain for s in self.samples], dtype="object"),
            }
        )

    def stats(self, tokenizer: Any = None) -> dict[str, Any]:
        """Sizes overall, per task and per domain, JSON-serialisable (for the UI and the API).

        With a tokenizer, token counts come from one batched ``tokenizer(texts,
        add_special_tokens=False)`` call, so a 240-sample set costs one fast-tokenizer call.
        Samples without a task (domain) label are counted overall only.
        """
        texts = [s.text for s in self.samples]
        tokens: list[int] | None = None
        out: dict[str, Any] = {
            "id": self.id,
            "name": self.name,
            "n_samples": len(texts),
            "n_chars": sum(len(t) for t in texts),
        }
        if tokenizer is not None:
            if texts:
                enc = tokenizer(texts, add_special_tokens=False)
                tokens = [len(ids) for ids in enc["input_ids"]]
            else:
                tokens = []
            out["n_tokens"] = int(sum(tokens))
            out["tokens_per_sample"] = {
                "min": int(min(tokens)) if tokens else 0,
                "mean": float(sum(tokens) / len(tokens)) if tokens else 0.0,
                "max": int(max(tokens)) if tokens else 0,
            }
        out["tasks"] = _label_stats(self.samples, [s.task for s in self.samples], tokens)
        out["domains"] = _label_stats(self.samples, [s.domain for s in self.samples], tokens)
        return out

    def preview(self, n: int = 5, max_chars: int = 300) -> list[dict[str, Any]]:
        """The first ``n`` samples, text cut to ``max_chars`` (with an ellipsis), for list views."""
        rows = []
        for i, s in enumerate(self.samples[: max(0, n)]):
            text = s.text if len(s.text) <= max_chars else s.text[:max_chars].rstrip() + "…"
            rows.append({"index": i, "text": text, "chars": len(s.text), "task": s.task, "domain": s.domain})
        return rows

    # ------------------------------------------------------------------ persistence

    def save(self, directory: Path) -> Path:
        """Write ``samples.parquet`` + ``calibration.json`` as one atomic directory.

        Readers (and a concurrent job) see either the previous complete set or this one, never
        a parquet without its metadata.
        """
        directory = Path(directory)
        table = pa.table(
            {
                "text": pa.array([s.text for s in self.samples], type=pa.string()),
                "task": pa.array([s.task for s in self.samples], type=pa.string()),
                "domain": pa.array([s.domain for s in self.samples], type=pa.string()),
            }
        )
        meta = {
            "format_version": FORMAT_VERSION,
            "id": self.id,
            "name": self.name,
            "source": self.source,
            "seed": self.seed,
            "n_samples": len(self.samples),
            "tasks": self.tasks(),
            "domains": self.domains(),
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        with atomic_directory(directory) as tmp:
            pq.write_table(table, tmp / SAMPLES_FILE)
            write_json_atomic(tmp / META_FILE, meta)
        return directory

    @classmethod
    def load(cls, directory: Path) -> "CalibrationSet":
        """Read a directory written by :meth:`save`; refuse incomplete or altered ones."""
        directory = Path(directory)
        if not directory.is_dir():
            raise CalibrationError(f"{directory}: no such calibration set directory; build it first (CalibrationSet.save)")
        meta_path, table_path = directory / META_FILE, directory / SAMPLES_FILE
        missing = [p.name for p in (meta_path, table_path) if not p.is_file()]
        if missing:
            raise CalibrationError(
                f"{directory}: incomplete calibration set, missing {', '.join(missing)}; "
                "delete the directory and save the set again"
            )
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CalibrationError(f"{meta_path}: not valid JSON ({exc}); save the set again") from exc
        if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
            raise CalibrationError(f"{meta_path}: must be a JSON object with a 'name'; save the set again")
        try:
            table = pq.read_table(table_path)
        except Exception as exc:  # pyarrow raises several types for a damaged file
            raise CalibrationError(f"{table_path}: cannot read parquet ({exc}); save the set again") from exc
        if "text" not in table.column_names:
            raise CalibrationError(f"{table_path}: no 'text' column (has {table.column_names}); save the set again")
        n = table.num_rows
        texts = table.column("text").to_pylist()
        tasks = table.column("task").to_pylist() if "task" in table.column_names else [None] * n
        domains = table.column("domain").to_pylist() if "domain" in table.column_names else [None] * n
        cs = cls(
            name=meta["name"],
            samples=[Sample(t, k, d) for t, k, d in zip(texts, tasks, domains)],
            source=str(meta.get("source", str(directory))),
            seed=meta.get("seed"),
        )
        if meta.get("id") and meta["id"] != cs.id:
            raise CalibrationError(
                f"{directory}: samples do not match the stored id {meta['id']} (content id is {cs.id}); "
                "the files were edited or mixed up — save the set again"
            )
        return cs

    # ------------------------------------------------------------------ selection

    def subsample(self, n: int, seed: int) -> "CalibrationSet":
        """A deterministic subset of ``n`` samples, kept in their original order.

        When samples carry tasks, tasks are visited round-robin (in a seeded order), so a
        subset keeps tasks balanced — EW's CV (Eq. 3) is computed over task means and a task
        with one sample would be a noisy mean. Unlabelled samples form one extra group.
        """
        if n < 0:
            raise CalibrationError(f"{self.name}: cannot take {n} samples; ask for a positive number")
        if n >= len(self.samples):
            return CalibrationSet(self.name, list(self.samples), self.source, self.seed)
        rng = random.Random(f"subsample:{seed}")
        groups: dict[str | None, list[int]] = {}
        for i, s in enumerate(self.samples):
            groups.setdefault(s.task, []).append(i)
        order = sorted(groups, key=lambda k: (k is None, k or ""))
        rng.shuffle(order)
        for key in order:
            rng.shuffle(groups[key])
        chosen: list[int] = []
        depth = 0
        while len(chosen) < n:
            for key in order:
                if depth < len(groups[key]):
                    chosen.append(groups[key][depth])
                    if len(chosen) == n:
                        break
            depth += 1
        return CalibrationSet(self.name, [self.samples[i] for i in sorted(chosen)], self.source, seed)


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
    return value or None


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
    return Sample(text, _label(obj.get("task"), "task", path, where), _label(obj.get("domain"), "domain", path, where))


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
    return CalibrationSet(name=name, samples=samples, source=f"hf:{ref}@{split}")


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
    given ``split`` ("calibration" or "heldout", see :mod:`builtin_data`); ``hf:X[@split]``
    loads with ``datasets`` (split defaults to "train"; ``split`` here does not apply);
    a saved set directory, a ``.jsonl``/``.json`` or a ``.txt`` file are read as-is. For all
    but builtins, ``samples`` takes a deterministic, task-balanced subsample.
    """
    spec = spec.strip()
    if not spec:
        raise CalibrationError(f"empty calibration spec; use one of: {_forms()}")
    if spec.startswith("builtin:"):
        from .builtin import builtin_set

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


def as_samples(texts: Iterable[str], task: str | None = None, domain: str | None = None) -> list[Sample]:
    """Wrap plain strings as samples (convenience for scripts and tests)."""
    return [Sample(t, task, domain) for t in texts]
