"""A full disk is an operator's matter with a clear answer, not a bug: a request that meets ENOSPC
is answered 507 naming the place by its setting and the free space there; a job fails with
``error_type`` ``storage``; the worker lives on; no partial artifact is left.

The disk-full cases run for real: the artifacts dir of a separate API app (in-process, TestClient)
and of its own worker subprocess (its own Redis prefix, so it takes only these jobs) is a 2 MB
tmpfs, filled to the last byte. They are skipped where mounting a tmpfs is not permitted.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .helpers import Worker, env_for, wait_job


# --------------------------------------------------------------------------- without a full disk


def test_disk_full_is_recognised_through_library_wrappers():
    from sqlalchemy.exc import OperationalError

    from moelab.engine.atomic import is_disk_full

    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(OperationalError("INSERT …", {}, sqlite3.OperationalError("database or disk is full")))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0") from inner
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(ValueError("bad input"))


def test_a_full_disk_in_a_job_is_a_storage_error_not_a_bug(tmp_path):
    from moelab.store.artifacts import ArtifactStore, InsufficientStorage
    from workers.jobrun import classify

    store = ArtifactStore(tmp_path / "artifacts", label="the artifacts dir (MOELAB_ARTIFACTS_DIR)")
    state, kind, message = classify(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x")), "export", "job-1", store)
    assert (state, kind) == ("failed", "storage")
    assert message.startswith("no space left under the artifacts dir (MOELAB_ARTIFACTS_DIR) during 'export': ") and " free" in message
    assert "bug" not in message and str(tmp_path) not in message and "/api/v1/jobs/job-1/retry" in message
    _, kind, message = classify(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "data" / "hub" / "x")), "load", "job-1",
                                store, tmp_path / "data")
    assert kind == "storage" and message.startswith("no space left under MOELAB_DATA_DIR during 'load': ") and str(tmp_path) not in message

    with pytest.raises(InsufficientStorage) as refused:  # a step that knows its size is refused up front
        store.require_free(10**18, "this conversion's export")
    assert "this conversion's export needs ~1000000.0 TB" in str(refused.value) and str(tmp_path) not in str(refused.value)
    assert classify(refused.value, "starting", "job-2", store)[1] == "storage"
    store.require_free(1, "a byte")  # room enough: no refusal


def test_atomic_writes_leave_nothing_when_a_write_fails(tmp_path, monkeypatch):
    from moelab.engine.atomic import TMP_MARK, atomic_directory, write_bytes_atomic

    final = tmp_path / "artifact"
    with pytest.raises(OSError):
        with atomic_directory(final) as tmp:
            (tmp / "part.bin").write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert list(tmp_path.iterdir()) == []
    with atomic_directory(final) as tmp:
        (tmp / "whole.bin").write_bytes(b"all")
    with pytest.raises(OSError):  # a failed re-run keeps the previous artifact whole
        with atomic_directory(final) as tmp:
            raise OSError(errno.ENOSPC, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact"] and (final / "whole.bin").read_bytes() == b"all"

    def full(_fd):  # the data reaches the disk at fsync: that is where a full disk shows
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("moelab.engine.atomic.os.fsync", full)
    with pytest.raises(OSError):
        write_bytes_atomic(tmp_path / "file.json", b"{}")
    assert not [p for p in tmp_path.iterdir() if TMP_MARK in p.name]


def test_health_reports_free_space(client):
    h = client.get("/api/v1/health").json()
    assert set(h["disk"]) == {"artifacts", "data"}
    for place in h["disk"].values():
        assert place["free_bytes"] > 0 and place["total_bytes"] >= place["free_bytes"] and place["state"] in ("ok", "low")
    assert h["disk_state"] in ("ok", "low") and isinstance(h["warnings"], list)


# --------------------------------------------------------------------------- a real full disk


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory) -> Iterator[Path]:
    mount = tmp_path_factory.mktemp("small-disk")
    if os.geteuid() != 0:
        pytest.skip("mounting a 2 MB tmpfs needs root; the full-disk tests run where it is permitted")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({done.stderr.strip() or done.returncode})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(disk: Path) -> Path:
    """Write until the file system is full; returns the filler (delete it to free the space)."""
    filler = disk / "filler.bin"
    with open(filler, "ab", buffering=0) as fh:
        for size in (65536, 4096, 512, 1):  # big pieces, then the last pages
            while True:
                try:
                    fh.write(b"\0" * size)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
    return filler


def _leftovers(artifacts: Path, kind: str) -> list[str]:
    return sorted(p.name for p in (artifacts / kind).iterdir())


@pytest.fixture(scope="module")
def full_disk_service(small_disk, service_config, tmp_path_factory):
    """An API app and a worker whose artifacts dir is the small tmpfs (database elsewhere: the
    failure must be recordable), with a Redis prefix of their own."""
    from fastapi.testclient import TestClient

    from backend.app import create_app
    from moelab.settings import Settings

    root = tmp_path_factory.mktemp("full-disk-service")
    config = {**service_config, "artifacts_dir": str(small_disk / "artifacts"),
              "database_url": f"sqlite:///{root / 'moelab.db'}", "redis_prefix": f"moelab-diskfull-{uuid.uuid4().hex[:8]}:"}
    settings = Settings(_env_file=None, api_token=None, allow_trust_remote_code=False, **config)
    worker = Worker(env_for(config), root, name="moelab-diskfull@%h")
    worker.start()
    try:
        with TestClient(create_app(settings)) as client:
            yield client, settings, worker
    finally:
        worker.stop()
        _forget_prefix(config["redis_url"], config["redis_prefix"])


def _forget_prefix(redis_url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(f"{prefix}*", count=500))
    if keys:
        client.delete(*keys)


def _multipart(name: str, data: bytes) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n"
            "Content-Type: text/plain\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def _paragraphs(n: int) -> bytes:
    return "\n\n".join(f"Paragraph {i} {uuid.uuid4().hex}: some words about rivers and bread, long enough to keep."
                       for i in range(n)).encode()


def test_a_full_disk_answers_507_and_fails_jobs_as_storage(full_disk_service, small_disk):
    client, settings, worker = full_disk_service
    artifacts = settings.resolved_artifacts_dir()
    filler = _fill(small_disk)
    try:
        data = _paragraphs(2000)  # ~190 kB: under the 1 MB upload limit, over the free space

        # a declared size over the free space: refused from the headers, before the body is read
        r = client.post("/api/v1/calibration-sets/upload", files={"file": ("big.txt", data)})
        assert r.status_code == 507, r.text
        detail = r.json()["detail"]
        assert detail.startswith("no space left under the artifacts dir (MOELAB_ARTIFACTS_DIR): ") and "this upload needs ~" in detail
        assert str(small_disk) not in detail and "bug" not in detail

        # no size declared (chunked): the write itself meets ENOSPC, and that is a 507 too, not a 500
        body, content_type = _multipart("big.txt", data)
        r = client.post("/api/v1/calibration-sets/upload", content=iter([body[:100_000], body[100_000:]]),
                        headers={"Content-Type": content_type})
        assert r.status_code == 507, r.text
        detail = r.json()["detail"]
        assert detail.startswith("no space left under the artifacts dir (MOELAB_ARTIFACTS_DIR): ") and " free" in detail
        assert str(small_disk) not in detail and "internal error" not in detail
        assert _leftovers(artifacts, "calibration-sets") == [] and _leftovers(artifacts, ".uploads") == []

        health = client.get("/api/v1/health").json()
        assert health["disk"]["artifacts"]["state"] == "low" and health["disk_state"] == "low", health
        assert health["disk"]["artifacts"]["free_bytes"] < 100_000
        assert any("MOELAB_ARTIFACTS_DIR" in w for w in health["warnings"]) and not any(str(small_disk) in w for w in health["warnings"])

        # a job writing its artifact: failed, typed storage (not internal), the worker still the same process
        r = client.post("/api/v1/calibration-sets", json={"source": "builtin", "name": "mixed", "samples": 12})
        assert r.status_code == 202, r.text
        job = wait_job(client, r.json()["job_id"], timeout=120)
        assert job["state"] == "failed" and job["error_type"] == "storage", job
        assert job["error"].startswith("no space left under the artifacts dir (MOELAB_ARTIFACTS_DIR)"), job["error"]
        assert "bug in moelab" not in job["error"] and str(small_disk) not in job["error"]
        assert worker.alive and worker.starts == 1
        assert _leftovers(artifacts, "calibration-sets") == []  # no partial artifact, no temporary
    finally:
        filler.unlink(missing_ok=True)

    # space again: the same job re-runs on the same worker and succeeds
    r = client.post(f"/api/v1/jobs/{job['id']}/retry")
    assert r.status_code == 202, r.text
    again = wait_job(client, r.json()["id"], timeout=120)
    assert again["state"] == "succeeded", again
    assert worker.alive and worker.starts == 1
    assert client.get("/api/v1/health").json()["disk"]["artifacts"]["free_bytes"] > 100_000
    r = client.post("/api/v1/calibration-sets/upload", files={"file": ("small.txt", _paragraphs(8))})
    assert r.status_code == 201, r.text


def test_a_full_database_disk_answers_507(small_disk, service_config):
    """The job/metadata store on a full disk too (SQLite: "database or disk is full"): creating a
    resource is a 507 naming the database's setting, not a 500."""
    from fastapi.testclient import TestClient

    from backend.app import create_app
    from moelab.settings import Settings

    place = small_disk / f"db-{uuid.uuid4().hex[:6]}"
    place.mkdir()
    config = {**service_config, "artifacts_dir": str(place / "artifacts"), "database_url": f"sqlite:///{place / 'moelab.db'}",
              "redis_prefix": f"moelab-diskfull-{uuid.uuid4().hex[:8]}:"}
    settings = Settings(_env_file=None, api_token=None, allow_trust_remote_code=False, **config)
    with TestClient(create_app(settings)) as client:
        filler = _fill(small_disk)
        try:
            answers = [client.post("/api/v1/calibration-sets", json={"source": "builtin", "name": "mixed", "samples": 12})
                       for _ in range(3)]  # a row may still fit in a page; a few cannot
            full = [r for r in answers if r.status_code != 202]
            assert full and all(r.status_code == 507 for r in full), [(r.status_code, r.text) for r in answers]
            detail = full[0].json()["detail"]
            assert detail.startswith("no space left under the database (MOELAB_DATABASE_URL): ") and " free" in detail, detail
            assert str(small_disk) not in detail
            assert client.get("/api/v1/health").json()["disk_state"] == "low"
        finally:
            filler.unlink(missing_ok=True)
        assert client.post("/api/v1/calibration-sets", json={"source": "builtin", "name": "mixed", "samples": 12}).status_code == 202
    _forget_prefix(config["redis_url"], config["redis_prefix"])  # the queued jobs no worker of this prefix takes
