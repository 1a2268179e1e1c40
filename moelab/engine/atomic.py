"""Atomic publication of artifacts: write into a private temporary place, then rename.

A reader never sees a half-written file or directory: either the old complete artifact or
the new complete one. Interrupted writes leave only ``.tmp-*`` siblings, which readers ignore
and ``remove_stale_temporaries`` cleans up. A temporary's name carries its writer's host and
process id, so the cleanup that an API or worker runs at start removes what dead writers left,
never the conversion another worker is writing at that moment.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

TMP_MARK = ".tmp-"

#: the errors a full file system (or an exhausted quota) raises
DISK_FULL_ERRNOS = frozenset(e for e in (getattr(errno, "ENOSPC", None), getattr(errno, "EDQUOT", None)) if e is not None)
#: how libraries that wrap the OSError (SQLite, torch's stream writer, safetensors, Arrow) say the same
_DISK_FULL_TEXT = ("no space left on device", "disk quota exceeded", "database or disk is full", "not enough space on the disk")


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from, or during) is a full disk or quota:
    an ``OSError`` with ENOSPC/EDQUOT, or a library's wrapper of one that only keeps its text."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        text = str(exc).lower()
        if any(t in text for t in _DISK_FULL_TEXT):
            return True
        orig = getattr(exc, "orig", None)  # SQLAlchemy's DBAPIError keeps the driver's error here
        if isinstance(orig, BaseException) and is_disk_full(orig):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_bytes(path: Path) -> int | None:
    """Free bytes for an unprivileged writer on the file system of ``path`` (its nearest existing
    ancestor), or None when it cannot be read."""
    path = Path(path)
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "unknown"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


#: this host, as it appears in temporaries' names (process ids only mean something on their host)
HOST_TAG = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
_OWNER = re.compile(r"-([0-9a-f]{8})-(\d+)-[0-9a-f]{8}$")


def temporary_sibling(path: Path, kind: str) -> Path:
    """``.{name}.tmp-{kind}-{host}-{pid}-{random}`` next to ``path``: hidden from readers, owned by this process."""
    path = Path(path)
    return path.with_name(f".{path.name}{TMP_MARK}{kind}-{HOST_TAG}-{os.getpid()}-{uuid.uuid4().hex[:8]}")



def write_bytes_atomic(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path, "file")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk (or anything else) leaves no partial temporary behind
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it replaces ``final`` as a whole.

    An existing ``final`` is moved aside first and deleted only once the new one is in
    place, so a re-run overwrites atomically (idempotent jobs) and a failure keeps the old.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(final, "dir")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:  # a failed write (a full disk included) leaves nothing: the temporary goes
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    try:
        if final.exists():
            old = temporary_sibling(final, "old")
            os.replace(final, old)
        os.replace(tmp, final)
    except BaseException:
        if old is not None and not final.exists():
            os.replace(old, final)  # put the previous artifact back
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def is_stale_temporary(path: Path, foreign_age_s: float = 86_400.0) -> bool:
    """Whether a ``.tmp-`` entry is a leftover rather than a write in progress.

    Written on this host: stale once its writer process is gone. Written on another host (a
    container sharing the data volume): its process cannot be checked, so stale only when
    untouched for ``foreign_age_s``. Names without an owner come from versions before owners were
    recorded and are stale (their writers stopped at the upgrade).
    """
    match = _OWNER.search(path.name)
    if match is None:
        return True
    host, pid = match.group(1), int(match.group(2))
    if host == HOST_TAG:
        return not _pid_alive(pid)
    try:
        return time.time() - path.stat().st_mtime > foreign_age_s
    except FileNotFoundError:
        return False


def remove_stale_temporaries(folder: Path, foreign_age_s: float = 86_400.0) -> int:
    """Delete leftovers of interrupted writes under ``folder`` (not recursive), keeping writes in
    progress (``is_stale_temporary``). Returns a count."""
    n = 0
    for p in Path(folder).glob(f".*{TMP_MARK}*"):
        if not is_stale_temporary(p, foreign_age_s):
            continue
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        n += 1
    return n
