"""The suite keeps to its own directory: every process it starts gets a home, data dir, model cache and
HF cache under ``.moelab/`` in the clone (or ``MOELAB_TEST_DATA_DIR``'s parent), and a guard compares the
user's real home before and after the run.

The environment is set once, when ``tests/conftest.py`` is imported, before anything reads settings:
child processes (the CLI, ``moelab serve``, Celery workers, llama.cpp's converter, Chromium) inherit it.
``HOME`` alone is not enough: ``MOELAB_*`` variables from the user's shell would point the suite at
their data, broker or database, so every one of them but the ``MOELAB_TEST_*`` knobs is dropped.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Watched recursively in the real home; anything else there is watched by name (a new entry is caught).
WATCHED = (".local", ".cache", ".config")


def suite_paths(repo: Path) -> dict[str, Path]:
    """Where the suite keeps its state: the persistent data dir (the default model is dequantised there
    once per clone) and a home of its own beside it."""
    data = Path(os.environ.get("MOELAB_TEST_DATA_DIR", repo / ".moelab" / "test-data")).resolve()
    home = data.parent / "test-home"
    return {"data": data, "home": home}


def isolated_environment(environ: dict[str, str], repo: Path) -> dict[str, str]:
    """``environ`` with the home, caches and moelab's data dir moved under the suite's directory."""
    paths = suite_paths(repo)
    home = paths["home"]
    env = {k: v for k, v in environ.items() if not k.startswith("MOELAB_") or k.startswith("MOELAB_TEST_")}
    env.update(
        HOME=str(home),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        XDG_CACHE_HOME=str(home / ".cache"),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_STATE_HOME=str(home / ".local" / "state"),
        HF_HOME=str(home / ".cache" / "huggingface"),
        TORCH_HOME=str(home / ".cache" / "torch"),
        MPLCONFIGDIR=str(home / ".config" / "matplotlib"),
        MOELAB_DATA_DIR=str(paths["data"]),
        # Every evaluation times both models; the suite checks that timing's plumbing, not its precision
        # (tests/engine/test_speed*.py pass the full protocol): one round of 2 steps and a 64-token prefill.
        MOELAB_SPEED_REPEATS="1",
        MOELAB_SPEED_DECODE_STEPS="2",
        MOELAB_SPEED_PREFILL_TOKENS="64",
        # A CLI profile of each new model would time this machine's kernels (10-30 s a model, on every tiny model a
        # test builds). The table is checked where it is the subject: tests/engine/test_speed_prediction.py, and the
        # service's worker and `moelab serve` (tests/service/helpers.env_for keeps the setting's default, on).
        MOELAB_TIME_KERNELS="0",
        HF_HUB_OFFLINE="1",  # no test needs the Hub; without this a lookup spends ~20 s in retries
    )
    return env


def snapshot(home: Path) -> dict[str, tuple[int, int]]:
    """``relative path -> (size, mtime_ns)`` of every entry in the watched folders of ``home``, and of
    every other top-level entry by name (their contents are the user's, e.g. a Python installation)."""
    seen: dict[str, tuple[int, int]] = {}
    if not home.is_dir():
        return seen
    for top in home.iterdir():
        try:
            st = top.lstat()
        except FileNotFoundError:
            continue
        seen[top.name] = (0, 0) if top.is_dir() else (st.st_size, st.st_mtime_ns)
        if top.name in WATCHED and top.is_dir() and not top.is_symlink():
            for root, dirs, files in os.walk(top):
                for name in dirs + files:
                    path = Path(root) / name
                    try:
                        st = path.lstat()
                    except FileNotFoundError:
                        continue
                    size = 0 if name in dirs else st.st_size
                    seen[str(path.relative_to(home))] = (size, 0 if name in dirs else st.st_mtime_ns)
    return seen


def changes(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """What a run did to the home: ``created X``, ``changed X``, ``removed X``, sorted."""
    out = [f"created {p}" for p in after.keys() - before.keys()]
    out += [f"removed {p}" for p in before.keys() - after.keys()]
    out += [f"changed {p}" for p in before.keys() & after.keys() if before[p] != after[p]]
    return sorted(out)
