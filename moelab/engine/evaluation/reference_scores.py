"""The dense model's scores kept between evaluations: every evaluation of a conversion scores the
dense model it came from on the same held-out windows, and that number does not change from one
conversion to the next. It is stored once per (model, text, protocol) under
``DATA_DIR/reference-scores/`` and reused, so an evaluation runs the dense model only the first time.

What is reused: perplexity and multiple-choice accuracy, which depend only on the model and the
windows. What is not: tokens/s, a speed that is only comparable within one run on one machine
state (a reused entry has ``tokens_per_s: null`` and says when it was measured).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..atomic import write_json_atomic

DIR = "reference-scores"
REUSED = ("perplexity", "perplexity_ci", "window_nll", "multiple_choice")


def fingerprint(model_record: dict[str, Any], model: nn.Module, windows: torch.Tensor, protocol: dict[str, Any]) -> str:
    """A key for the dense scores of ``model`` on ``windows``: the model's manifest (source, family,
    sizes), a checksum of its first and last parameters (a directory whose weights were replaced
    under the same path gets a new key), the windows' tokens and the protocol (batch size,
    multiple-choice items)."""
    h = hashlib.sha256(json.dumps({"model": model_record, **protocol}, sort_keys=True, default=str).encode())
    params = list(model.parameters())
    for p in (params[0], params[-1]) if params else ():
        h.update(repr(float(p.detach().float().sum())).encode())
    h.update(windows.to(torch.int64).cpu().numpy().tobytes())
    return h.hexdigest()[:32]


def load(data_dir: Path | None, key: str) -> dict[str, Any] | None:
    """The stored dense entry for ``key``, or None."""
    if data_dir is None:
        return None
    path = Path(data_dir) / DIR / f"{key}.json"
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return {**{k: stored[k] for k in REUSED if k in stored}, "tokens_per_s": None,
            "reused": {"measured_at": stored.get("measured_at"), "key": key}}


#: TEAL thresholds kept between evaluations (``runs._teal_baseline``): calibrating them reads thousands of
#: calibration tokens through the dense model and searches every layer's split, about 45 s on the default
#: model, and they depend only on the model, the profile's text, the token count and the cost
TEAL_DIR = "teal-thresholds"


def teal_key(model_record: dict[str, Any], model: nn.Module, calibration: dict[str, Any], protocol: dict[str, Any]) -> str:
    """A key for TEAL thresholds: the model (as ``fingerprint``), the profile's calibration text (its
    content id and when the profile was written) and the protocol (tokens, cost, allocation, step)."""
    return fingerprint(model_record, model, torch.zeros(0, dtype=torch.int64), {"calibration": calibration, **protocol})


def load_teal(data_dir: Path | None, key: str) -> dict[str, Any] | None:
    if data_dir is None:
        return None
    try:
        return json.loads((Path(data_dir) / TEAL_DIR / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None


def save_teal(data_dir: Path | None, key: str, entry: dict[str, Any]) -> None:
    if data_dir is not None:
        write_json_atomic(Path(data_dir) / TEAL_DIR / f"{key}.json", entry)


def save(data_dir: Path | None, key: str, entry: dict[str, Any]) -> None:
    if data_dir is None or "reused" in entry:
        return
    write_json_atomic(Path(data_dir) / DIR / f"{key}.json",
                      {**{k: entry[k] for k in REUSED if k in entry}, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
