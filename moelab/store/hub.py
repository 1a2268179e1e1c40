"""Whether this server can load a Hugging Face Hub name now: from its local cache, or from the Hub itself.

The API asks before it queues a job, so a Hub model id or dataset name on a server without Hub access is
refused at request time (422 saying what to do) instead of being accepted and failing in the worker. The
answer is "yes" when the name is in the cache (``HF_HOME``/``HF_HUB_CACHE``, and the ``datasets`` cache for
datasets) or when the Hub answers; ``HF_HUB_OFFLINE=1`` means the Hub is never asked. The Hub's answer is
remembered for a minute, so a burst of requests probes it once.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Literal

RepoType = Literal["model", "dataset"]
_TRUE = {"1", "on", "yes", "true"}
_PROBE_TTL_S = 60.0
_lock = threading.Lock()
_probe: tuple[float, str | None] | None = None  # (when, why the Hub is unreachable or None)


def _hf_home() -> Path:
    return Path(os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface").expanduser()


def in_cache(name: str, repo_type: RepoType) -> bool:
    """Whether a snapshot of ``name`` is in the Hub cache (or, for a dataset, in ``datasets``' own cache)."""
    hub = Path(os.environ.get("HF_HUB_CACHE") or _hf_home() / "hub").expanduser()
    snapshots = hub / f"{repo_type}s--{name.replace('/', '--')}" / "snapshots"
    if snapshots.is_dir() and any(snapshots.iterdir()):
        return True
    if repo_type == "dataset":
        processed = Path(os.environ.get("HF_DATASETS_CACHE") or _hf_home() / "datasets").expanduser()
        return (processed / name.replace("/", "___")).is_dir()
    return False


def hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """Why the Hub cannot be reached from here (``HF_HUB_OFFLINE``, no route, no answer), or None when it answers."""
    global _probe
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
        return "HF_HUB_OFFLINE is set"
    with _lock:
        if _probe is not None and time.monotonic() - _probe[0] < _PROBE_TTL_S:
            return _probe[1]
        import httpx

        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        try:
            httpx.head(endpoint, timeout=timeout_s)
            why = None
        except httpx.HTTPError as exc:
            why = f"{endpoint} did not answer ({type(exc).__name__})"
        _probe = (time.monotonic(), why)
        return why


def hub_refusal(name: str, repo_type: RepoType) -> str | None:
    """A message saying how to make ``name`` loadable when this server has neither a cached copy nor Hub
    access; None when it can load it."""
    if in_cache(name, repo_type):
        return None
    why = hub_unreachable()
    if why is None:
        return None
    what = "model" if repo_type == "model" else "dataset"
    return (f"{what} {name!r} is not in this server's Hugging Face cache (HF_HOME) and the Hub cannot be reached ({why}): "
            f"download it where there is network (huggingface-cli download{' --repo-type dataset' if repo_type == 'dataset' else ''} "
            f"{name}) into this server's HF_HOME, or copy it into a directory under MOELAB_DATA_ROOTS and give that path")
