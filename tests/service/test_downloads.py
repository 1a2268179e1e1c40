"""Zip archives are streamed as they are made (no temporary copy on disk, bounded memory), at most
MOELAB_MAX_CONCURRENT_DOWNLOADS at once (429 beyond, with Retry-After), a slot comes back when a
client goes away mid-download, and what older versions or a killed API left behind is removed at start."""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import os
import zipfile

from fastapi.testclient import TestClient

from backend.app import create_app
from backend.routes.artifacts import DownloadSlots, _stream

from .test_bad_requests import snapshot


def test_archive_is_the_artifact_streamed_without_a_temporary_copy(client, settings, conversion_id):
    listing = client.get(f"/api/v1/artifacts/conversions/{conversion_id}").json()
    before = snapshot(settings)
    scratch = settings.resolved_artifacts_dir() / ".uploads"
    touched = scratch.stat().st_mtime_ns  # a file created and removed there (the old temporary zip) changes it
    r = client.get(f"/api/v1/artifacts/conversions/{conversion_id}/archive")
    assert r.status_code == 200 and r.headers["content-type"] == "application/zip"
    assert r.headers["content-disposition"] == f'attachment; filename="{conversion_id}.zip"'
    assert snapshot(settings) == before and scratch.stat().st_mtime_ns == touched  # nothing written, not even for a moment
    zf = zipfile.ZipFile(io.BytesIO(r.content))
    assert zf.testzip() is None
    assert zf.namelist() == [f"{conversion_id}/{f['path']}" for f in listing["files"]]
    for f in listing["files"]:
        assert zf.read(f"{conversion_id}/{f['path']}") == client.get(f["url"]).content
    root = settings.resolved_artifacts_dir() / "conversions" / conversion_id
    assert zf.read(f"{conversion_id}/config.json") == (root / "config.json").read_bytes()


def test_archive_pieces_are_bounded_by_the_chunk_size(client, settings, conversion_id):
    """Memory per download: one read chunk plus zip headers, whatever the artifact's size."""
    store = client.app.state.store
    total = store.size("conversions", conversion_id)
    pieces = [len(p) for p in store.iter_zip("conversions", conversion_id, chunk_size=4096)]
    assert max(pieces) <= 4096 + 1024 and sum(pieces) > total and len(pieces) > total // 4096


def test_downloads_over_the_limit_get_429_and_slots_come_back(settings, worker, conversion_id):
    limited = settings.model_copy(update={"max_concurrent_downloads": 1})
    url = f"/api/v1/artifacts/conversions/{conversion_id}/archive"
    with TestClient(create_app(limited)) as c:
        slots: DownloadSlots = c.app.state.download_slots
        assert slots.try_acquire()  # one download in flight
        r = c.get(url)
        assert r.status_code == 429 and r.headers["retry-after"] == "5"
        assert "MOELAB_MAX_CONCURRENT_DOWNLOADS" in r.json()["detail"] and "1 archive" in r.json()["detail"]
        slots.release()
        for _ in range(3):  # each finished download gives its slot back
            assert c.get(url).status_code == 200
        assert slots.try_acquire()
        slots.release()


def test_a_client_that_goes_away_gives_the_slot_back(client, conversion_id):
    store = client.app.state.store
    slots = DownloadSlots(1)
    assert slots.try_acquire()
    pieces = store.iter_zip("conversions", conversion_id, chunk_size=1024)

    async def read_one_then_leave() -> bytes:
        stream = _stream(pieces, slots)
        first = await stream.__anext__()
        await stream.aclose()  # what Starlette does when the client disconnects
        return first

    # in a thread of its own: earlier tests in the same process (Playwright's sync API) can leave an
    # event loop running in this one, and asyncio.run() refuses to start inside it
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(asyncio.run, read_one_then_leave()).result(timeout=60)
    assert first.startswith(b"PK")
    assert pieces.gi_frame is None  # the generator (and its open file) is closed
    assert slots.try_acquire()


def test_start_removes_what_killed_downloads_and_deletes_left(settings, worker):
    root = settings.resolved_artifacts_dir()
    old_zip = root / ".uploads" / "zip-00000000deadbeef.zip"  # a full copy the pre-streaming API wrote per download
    old_zip.parent.mkdir(parents=True, exist_ok=True)
    old_zip.write_bytes(b"PK" + b"\0" * 1000)
    trash = root / "conversions" / ".conv-00000000deadbeef.tmp-trash-0000abcd"  # a DELETE killed after its rename
    (trash / "sub").mkdir(parents=True)
    stale_upload = root / ".uploads" / "up-00000000deadbeef.jsonl"
    stale_upload.write_bytes(b"{}")
    os.utime(stale_upload, (0, 1_000_000))
    with TestClient(create_app(settings)) as c:
        assert c.get("/api/v1/health").status_code == 200
    assert not old_zip.exists() and not trash.exists() and not stale_upload.exists()
