"""A calibration set: named, ordered text samples with a content id, statistics and an on-disk form.

The data model every calibration source builds (:mod:`moelab.engine.data.calibration` reads user
files and ``datasets`` and resolves spec strings; :mod:`moelab.engine.data.builtin` makes the
built-in sets), with the line-based text chunking both use. ``calibration`` re-exports all of it.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..atomic import atomic_directory, write_json_atomic

SAMPLES_FILE = "samples.parquet"
META_FILE = "calibration.json"
FORMAT_VERSION = 1

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
# text chunking (shared by the user-file readers and the built-in sets)
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
