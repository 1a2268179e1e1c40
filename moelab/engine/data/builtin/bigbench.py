"""BIG-bench (``builtin:bigbench``): installing its JSON tasks (:func:`install_bigbench`), reading
them (index, tasks, per-split examples), rendering few-shot prompts and building the set; one unit
per task example, so both splits cover the same tasks with disjoint examples."""

from __future__ import annotations

import functools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from ...atomic import TMP_MARK, atomic_directory, write_json_atomic
from ..sets import CalibrationError, Sample
from .packing import MAX_CHARS, TARGET_CHARS, Built, _allocate, _check_split, _interleave, unit_split

BIGBENCH_REQUIREMENT = "bigbench==1.0.0"
BIGBENCH_PER_TASK = 5
BIGBENCH_MAX_SHOTS = 8
_BB_MEMBER = re.compile(r"(?:^|/)bigbench/benchmark_tasks/([A-Za-z0-9_\-][A-Za-z0-9_.\-]*)/(?:([A-Za-z0-9_\-][A-Za-z0-9_.\-]*)/)?task\.json$")
_PIP_ATTEMPTS: tuple[tuple[str, ...], ...] = (
    # --no-clean keeps pip's unpacked source tree even when building the metadata fails
    ("--no-deps", "--no-binary", ":all:", "--no-build-isolation", "--no-clean"),
    ("--no-deps", "--no-clean"),
)


def _bigbench_root(data_dir: Path | None) -> Path:
    """``<data_dir>/bigbench``. The engine reads no settings: callers pass the data dir
    (``moelab.settings``' ``data_dir``, where ``moelab data install bigbench`` puts it)."""
    if data_dir is None:
        raise CalibrationError(
            "builtin:bigbench needs data_dir (the directory `moelab data install bigbench` installed into)"
        )
    return Path(data_dir) / "bigbench"


def bigbench_installed(data_dir: Path | None = None) -> bool:
    """Whether :func:`install_bigbench` has run for this data dir."""
    if data_dir is None:
        return False
    root = _bigbench_root(data_dir)
    return (root / "index.json").is_file() and (root / "tasks").is_dir()


def _task_summary(key: str, task: Any) -> dict[str, Any] | None:
    """Index entry of one task.json (what selection needs without re-reading 300 MB of JSON)."""
    if not isinstance(task, dict):
        return None
    examples = task.get("examples")
    examples = examples if isinstance(examples, list) else []
    raw_keywords = task.get("keywords")
    keywords = [str(k) for k in raw_keywords if isinstance(k, str)] if isinstance(raw_keywords, list) else []
    return {
        "key": key,
        "parent": key.split("/", 1)[0],
        "name": str(task.get("name", key)),
        "description": str(task.get("description", ""))[:500],
        "keywords": keywords,
        "n_examples": len(examples),
        "multiple_choice": any(isinstance(e, dict) and "target_scores" in e for e in examples[:50]),
    }


def _iter_task_files(source: Path, report: Callable[[str, int, int], None]) -> Iterator[tuple[str, bytes]]:
    """``(task key, task.json bytes)`` from an sdist archive (streamed) or an unpacked tree."""
    if source.is_dir():
        files = sorted(p for p in source.rglob("task.json") if "benchmark_tasks" in p.parts)
        for i, p in enumerate(files):
            m = _BB_MEMBER.search(p.relative_to(source).as_posix())
            if m:
                report("extract", i + 1, len(files))
                yield (m.group(1) + (f"/{m.group(2)}" if m.group(2) else "")), p.read_bytes()
        return
    total = source.stat().st_size
    try:
        with open(source, "rb") as raw, tarfile.open(fileobj=raw, mode="r|*") as tf:
            for count, member in enumerate(tf):
                if count % 256 == 0:
                    report("extract", raw.tell(), total)
                if not member.isfile():
                    continue
                m = _BB_MEMBER.search(member.name)
                if not m:
                    continue
                fh = tf.extractfile(member)
                if fh is not None:
                    yield (m.group(1) + (f"/{m.group(2)}" if m.group(2) else "")), fh.read()
            report("extract", total, total)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise CalibrationError(f"{source}: cannot read as a .tar.gz sdist ({exc}); download it again") from exc


def _find_fetched(dest: Path, pip_tmp: Path) -> Path | None:
    """pip's kept source tree (fast to read) or the saved sdist archive, whichever exists."""
    for pattern in ("*/bigbench/benchmark_tasks", "*/*/bigbench/benchmark_tasks"):
        for hit in sorted(pip_tmp.glob(pattern)):
            if hit.is_dir():
                return hit.parent.parent
    archives = sorted(dest.glob("bigbench-*.tar.gz")) or sorted(dest.glob("*.tar.gz"))
    return archives[0] if archives else None


def _fetch_bigbench(work: Path, report: Callable[[str, int, int], None]) -> Path:
    """Run ``pip download`` for the BIG-bench sdist (it cannot be pip-installed: building its
    metadata may fail), keeping pip's unpacked tree with ``--no-clean``."""
    dest, pip_tmp = work / "dist", work / "pip-tmp"
    dest.mkdir(parents=True, exist_ok=True)
    pip_tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TMPDIR": str(pip_tmp), "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    errors: list[str] = []
    for i, flags in enumerate(_PIP_ATTEMPTS):
        report("download", i, len(_PIP_ATTEMPTS))
        cmd = [sys.executable, "-m", "pip", "download", *flags, BIGBENCH_REQUIREMENT, "-d", str(dest)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        found = _find_fetched(dest, pip_tmp)
        if found is not None:
            report("download", len(_PIP_ATTEMPTS), len(_PIP_ATTEMPTS))
            return found
        tail = " ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
        errors.append(f"`{' '.join(cmd[2:])}` exited {proc.returncode}: {tail}")
    raise CalibrationError(
        f"could not fetch {BIGBENCH_REQUIREMENT} with pip ({'; '.join(errors)}). "
        f"Download it by hand with `pip download --no-deps --no-clean {BIGBENCH_REQUIREMENT} -d DIR` "
        "and install from the file: `moelab data install bigbench --sdist DIR/bigbench-1.0.0.tar.gz`"
    )


def install_bigbench(
    data_dir: Path,
    progress: Callable[[str, int, int], None] | None = None,
    sdist: Path | None = None,
) -> Path:
    """Install BIG-bench's JSON tasks under ``<data_dir>/bigbench`` and return that directory.

    The PyPI sdist (``bigbench==1.0.0``, ~358 MB) is fetched with ``pip download`` unless
    ``sdist`` points to an already downloaded ``.tar.gz`` (or an unpacked source tree). Only
    ``bigbench/benchmark_tasks/<task>/task.json`` and ``<task>/<subtask>/task.json`` are kept,
    as ``tasks/<task>[/<subtask>]/task.json``, with an ``index.json`` summarising every task
    (keywords, example counts) so building a set later reads only the tasks it uses.
    The directory is published atomically: a failed or cancelled install leaves the previous
    one (or none) in place. ``progress(stage, current, total)`` gets "download" and "extract".
    """
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    report = progress or (lambda stage, current, total: None)
    work = Path(tempfile.mkdtemp(prefix=f".bigbench{TMP_MARK}fetch-", dir=data_dir))
    try:
        if sdist is not None:
            source = Path(sdist).expanduser()
            if not source.exists():
                raise CalibrationError(f"{source}: sdist not found; pass the bigbench-1.0.0.tar.gz that pip downloaded")
        else:
            source = _fetch_bigbench(work, report)
        target = data_dir / "bigbench"
        with atomic_directory(target) as tmp:
            entries: list[dict[str, Any]] = []
            skipped: list[str] = []
            for key, blob in _iter_task_files(source, report):
                try:
                    summary = _task_summary(key, json.loads(blob.decode("utf-8")))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    summary = None
                if summary is None:
                    skipped.append(key)
                    continue
                out = tmp / "tasks" / key / "task.json"
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(blob)
                entries.append(summary)
            if not entries:
                raise CalibrationError(
                    f"{source}: no bigbench/benchmark_tasks/*/task.json inside; is this the bigbench sdist?"
                )
            write_json_atomic(
                tmp / "index.json",
                {
                    "source": str(sdist) if sdist is not None else BIGBENCH_REQUIREMENT,
                    "installed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "n_tasks": len(entries),
                    "skipped": sorted(skipped),
                    "tasks": sorted(entries, key=lambda e: e["key"]),
                },
            )
        return target
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _require_bigbench(data_dir: Path | None) -> Path:
    root = _bigbench_root(data_dir)
    if not bigbench_installed(data_dir):
        raise CalibrationError(
            f"{root}: BIG-bench is not installed; run `moelab data install bigbench` "
            "(downloads the 358 MB bigbench==1.0.0 sdist once and keeps only its task.json files)"
        )
    return root


@functools.lru_cache(maxsize=4)
def _bigbench_index_cached(index_path: str, stamp: int) -> tuple[dict[str, Any], ...]:
    with open(index_path, encoding="utf-8") as fh:
        return tuple(json.load(fh).get("tasks", ()))


def _bigbench_index(data_dir: Path | None) -> tuple[dict[str, Any], ...]:
    path = _require_bigbench(data_dir) / "index.json"
    return _bigbench_index_cached(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _bigbench_task_cached(path: str, stamp: int) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def bigbench_task_names(data_dir: Path | None = None) -> list[str]:
    """Installed tasks that hold examples: ``task`` or ``task/subtask`` (e.g.
    ``goal_step_wikihow/goal_inference``), sorted."""
    return sorted(e["key"] for e in _bigbench_index(data_dir) if e["n_examples"] > 0)


def bigbench_task(name: str, data_dir: Path | None = None) -> dict[str, Any]:
    """The raw ``task.json`` of an installed task or subtask (``task/subtask``)."""
    root = _require_bigbench(data_dir)
    if not re.fullmatch(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]*(?:/[A-Za-z0-9_\-][A-Za-z0-9_.\-]*)?", name):
        raise CalibrationError(f"{name!r}: not a BIG-bench task name")
    path = root / "tasks" / name / "task.json"
    if not path.is_file():
        known = bigbench_task_names(data_dir)
        near = [k for k in known if k.startswith(name.split("/")[0])][:10]
        raise CalibrationError(f"{path}: no BIG-bench task {name!r}" + (f"; did you mean one of {near}" if near else ""))
    try:
        return _bigbench_task_cached(str(path), path.stat().st_mtime_ns)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"{path}: not valid JSON ({exc}); reinstall with `moelab data install bigbench`") from exc


def bigbench_examples(name: str, split: str = "heldout", data_dir: Path | None = None) -> list[dict[str, Any]]:
    """Examples of one task in one split (each with its original ``index`` added).

    The split is per example (unit ``bigbench:<task>:<index>``), the same partition the
    ``bigbench`` calibration set uses, so evaluating on ``heldout`` never scores an example
    that was used for calibration.
    """
    _check_split(split)
    task = bigbench_task(name, data_dir)
    out = []
    for i, ex in enumerate(task.get("examples") or []):
        if isinstance(ex, dict) and isinstance(ex.get("input"), str) and unit_split(f"bigbench:{name}:{i}") == split:
            out.append({**ex, "index": i})
    return out


def _bb_target(ex: dict[str, Any]) -> str | None:
    scores = ex.get("target_scores")
    if isinstance(scores, dict) and scores:
        best = max(scores.values(), key=lambda v: v if isinstance(v, (int, float)) else -1e9)
        return next(str(k) for k, v in scores.items() if v == best)
    target = ex.get("target")
    if isinstance(target, list):
        target = target[0] if target else None
    return None if target is None else str(target)


def render_bigbench_example(task: dict[str, Any], ex: dict[str, Any], with_target: bool = True) -> str:
    """One example the way BIG-bench's own JSON-task few-shot prompts look: input prefix
    (default ``"\\nQ: "``), input, the choices appended for multiple-choice examples
    (``"\\n  choice: ..."``), output prefix (``"\\nA: "``) and, optionally, the target."""
    in_pre = task.get("example_input_prefix", "\nQ: ")
    out_pre = task.get("example_output_prefix", "\nA: ")
    choice_pre = task.get("choice_prefix", "\n  choice: ")
    text = in_pre + ex["input"]
    scores = ex.get("target_scores")
    if isinstance(scores, dict) and scores and task.get("append_choices_to_input", True):
        text += "".join(choice_pre + str(c) for c in scores)
    text += out_pre
    if with_target:
        text += _bb_target(ex) or ""
    return text


def _build_bigbench(n: int, rng: random.Random, split: str, data_dir: Path | None) -> Built:
    """48 tasks x 5 (for n=240; ``ceil(n / 5)`` tasks in general), like EW App. F.

    Tasks are drawn round-robin across their first keyword (the domain), so the set spans
    many kinds of task rather than 48 variants of one. A task with subtasks pools their
    examples. Each sample is one example of this split rendered as a BIG-bench few-shot
    prompt: other examples of the same (sub)task and split as shots (until ~1200 characters,
    at most 8, never over 1600), then the example itself with its target (for multiple
    choice: the highest-scoring choice). Examples whose own prompt exceeds 1600 characters
    are used only when a task has nothing shorter.
    """
    index = _bigbench_index(data_dir)
    by_parent: dict[str, list[dict[str, Any]]] = {}
    for e in index:
        if e["n_examples"] > 0:
            by_parent.setdefault(e["parent"], []).append(e)
    parent_meta = {e["parent"]: e for e in index if e["key"] == e["parent"]}
    domains: dict[str, list[str]] = {}
    for parent, entries in sorted(by_parent.items()):
        kws = (parent_meta.get(parent) or entries[0])["keywords"] or entries[0]["keywords"]
        domains.setdefault(kws[0] if kws else "other", []).append(parent)
    n_tasks = min(len(by_parent), -(-n // BIGBENCH_PER_TASK))  # 240 -> 48 tasks x 5
    dom_order = sorted(domains)
    rng.shuffle(dom_order)
    for d in dom_order:
        rng.shuffle(domains[d])
    chosen: list[tuple[str, str]] = []  # (parent, domain)
    depth = 0
    while len(chosen) < n_tasks:
        for d in dom_order:
            if depth < len(domains[d]) and len(chosen) < n_tasks:
                chosen.append((domains[d][depth], d))
        depth += 1

    pools: dict[str, list[tuple[str, dict[str, Any], dict[str, Any]]]] = {}  # parent -> (key, task, example)
    for parent, _ in chosen:
        pool = []
        for e in by_parent[parent]:
            task = bigbench_task(e["key"], data_dir)
            pool.extend((e["key"], task, ex) for ex in bigbench_examples(e["key"], split, data_dir))
        pools[parent] = pool
    order = [p for p, _ in chosen]
    counts = _allocate({p: len(pools[p]) for p in order}, n, order, allow_repeat=False)

    groups: list[Built] = []
    for parent, domain in chosen:
        pool = pools[parent]
        rendered = [render_bigbench_example(task, ex) for key, task, ex in pool]
        fits = [i for i, r in enumerate(rendered) if len(r) <= MAX_CHARS] or list(range(len(pool)))
        picks = rng.sample(fits, min(counts[parent], len(fits)))
        group: Built = []
        for i in picks:
            key, task, ex = pool[i]
            same = [j for j in fits if j != i and pool[j][0] == key]
            rng.shuffle(same)
            shots: list[int] = []
            size = len(rendered[i]) + len(task.get("task_prefix", ""))
            for j in same[: 4 * BIGBENCH_MAX_SHOTS]:
                if len(shots) == BIGBENCH_MAX_SHOTS or size >= TARGET_CHARS:
                    break
                if size + len(rendered[j]) <= MAX_CHARS:
                    shots.append(j)
                    size += len(rendered[j])
            sep = task.get("few_shot_example_separator", "\n")
            body = sep.join([rendered[j] for j in shots] + [rendered[i]])
            text = (task.get("task_prefix", "") + body).lstrip("\n")
            units = tuple(f"bigbench:{pool[j][0]}:{pool[j][2]['index']}" for j in [*shots, i])
            group.append((units, Sample(text, parent, domain)))
        groups.append(group)
    return _interleave(groups)
