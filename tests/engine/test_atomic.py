"""Atomic artifacts: the start-up cleanup removes what dead writers left and keeps writes in
progress (another worker's conversion, an API's delete), told apart by the owner in the name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from moelab.engine.atomic import HOST_TAG, atomic_directory, remove_stale_temporaries, temporary_sibling


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_cleanup_keeps_a_live_writers_directory_and_removes_a_dead_ones(tmp_path):
    final = tmp_path / "conv-1"
    with atomic_directory(final) as work:  # a write in progress in this (live) process
        (work / "model.safetensors").write_bytes(b"x")
        dead = tmp_path / f".conv-2.tmp-dir-{HOST_TAG}-{_dead_pid()}-0123abcd"
        (dead / "sub").mkdir(parents=True)
        assert remove_stale_temporaries(tmp_path) == 1
        assert work.is_dir() and not dead.exists()
    assert (final / "model.safetensors").read_bytes() == b"x"


def test_cleanup_of_other_hosts_waits_for_age_and_legacy_names_go(tmp_path):
    foreign_fresh = tmp_path / ".conv-3.tmp-dir-deadbeef-1-0123abcd"
    foreign_old = tmp_path / ".conv-4.tmp-dir-deadbeef-1-0123abcd"
    legacy = tmp_path / ".conv-5.tmp-trash-0123abcd"  # written before owners were recorded
    for p in (foreign_fresh, foreign_old, legacy):
        p.mkdir()
    os.utime(foreign_old, (0, 1_000_000))
    assert remove_stale_temporaries(tmp_path, foreign_age_s=3600) == 2
    assert foreign_fresh.exists() and not foreign_old.exists() and not legacy.exists()


def test_temporary_names_carry_this_process():
    name = temporary_sibling(Path("/x/conv-1"), "dir").name
    assert name.startswith(".conv-1.tmp-dir-") and f"-{HOST_TAG}-{os.getpid()}-" in name
