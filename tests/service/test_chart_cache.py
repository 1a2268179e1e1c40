"""The chart and preview bodies the API caches (``backend.routes.charts.PAYLOADS``) are never served
stale: a profile whose files are replaced gets the new charts, one whose files are deleted gets 409,
one whose row is deleted gets 404, whatever was cached for it before; and the cache stays bounded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from backend import charts
from backend.routes.charts import PAYLOADS, PayloadCache
from tests.engine.test_profiling import make_set
from moelab.engine.methods import REGISTRY
from moelab.engine.profiling.profiler import ProfileSettings, profile_model
from moelab.engine.profiling.store import StoredProfile, write_profile

HIST = "/api/v1/profiles/{}/charts/cv-histogram?bins=12&scale=linear"
SUMMARY = "/api/v1/profiles/{}/charts/cv-summary?tau=0.5"
PREVIEW = "/api/v1/profiles/{}/preview/expertweaver?tau=0.5&alpha_min=0.1&alpha_max=0.6"


@pytest.fixture(scope="module")
def two_profiles(tiny_model, data_dir, tmp_path_factory) -> tuple[Path, Path]:
    """Two different complete profiles of one tiny model (different calibration texts)."""
    from moelab.engine.models import load_model

    adapter = load_model(str(tiny_model("llama")), data_dir=data_dir)
    root = tmp_path_factory.mktemp("chart-cache-profiles")
    out = []
    for name, seed in (("a", 1), ("b", 2)):
        cset = make_set(n=12, tasks=3, seed=seed)
        res = profile_model(adapter, cset, ProfileSettings(max_tokens=32, batch_tokens=128, atopk_k=4))
        out.append(write_profile(res, cset, root / name))
    return out[0], out[1]


@pytest.fixture()
def api(tmp_path):
    """The API in-process on a fresh data dir with a ready model, calibration set and profile row (no job)."""
    from fastapi.testclient import TestClient

    from backend.app import create_app
    from moelab.settings import Settings
    from moelab.store.db import CalibrationSet, Model, Profile
    from moelab.store.jobs import new_id

    settings = Settings(_env_file=None, data_dir=tmp_path, redis_url="redis://127.0.0.1:6379/13",
                        redis_prefix="moelab-test-chart-cache:", api_token=None)
    app = create_app(settings)
    profile_id = new_id("pr")
    with TestClient(app) as client:
        with app.state.db.session() as s:
            s.add(Model(id="mod-cache", name="tiny", source="default", kind="default", params={}))
            s.add(CalibrationSet(id="cal-cache", name="synthetic", origin="builtin", params={}))
            s.flush()
            s.add(Profile(id=profile_id, model_id="mod-cache", calibration_set_id="cal-cache", params={}))
        yield client, app, profile_id, app.state.store.path("profiles", profile_id)


def _publish(src: Path, dest: Path) -> None:
    """Replace the profile's files as a re-run does: a new directory whose manifest is new."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)


def _expected(path: Path) -> dict[str, object]:
    """What the charts and the preview are for the profile at ``path``, computed directly."""
    prof = StoredProfile.open(path)
    method = REGISTRY["expertweaver"]
    preview = method.preview(prof, method.params(tau=0.5, alpha_min=0.1, alpha_max=0.6))
    return {
        "hist": charts.cv_histograms(prof.cv_by_layer(), 12, 0.99, "linear")["counts"],
        "summary": charts.cv_summary(prof.cv_by_layer(), 0.5)["specialisation_ratio"],
        "preview": json.loads(json.dumps(preview["summary"], default=float)),
    }


def _served(client, profile_id: str) -> dict[str, object]:
    got = {}
    for key, url in (("hist", HIST), ("summary", SUMMARY), ("preview", PREVIEW)):
        r = client.get(url.format(profile_id))
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/json"
        body = r.json()
        assert body["profile_id"] == profile_id
        got[key] = body["counts"] if key == "hist" else body["specialisation_ratio"] if key == "summary" else body["summary"]
    got["preview"].pop("predicted_speed", None)  # the route's addition from this machine's kernel table (test_speed_prediction)
    return got


def _same(got: dict[str, object], want: dict[str, object]) -> bool:
    return got == want  # the same numpy on the same files: exactly equal


def test_cached_bodies_follow_the_profile_files(api, two_profiles):
    client, _app, profile_id, dest = api
    a, b = two_profiles
    want_a, want_b = _expected(a), _expected(b)
    assert not _same(want_a, want_b), "the two fixture profiles must chart differently"

    _publish(a, dest)
    first = _served(client, profile_id)
    hits = PAYLOADS.hits
    again = _served(client, profile_id)
    assert PAYLOADS.hits == hits + 3, "a repeated request is answered from the cache"
    assert first == again and _same(first, want_a)

    _publish(b, dest)  # re-run: new files, new manifest
    assert _same(_served(client, profile_id), want_b)

    shutil.rmtree(dest)  # files deleted: refused, never the cached body
    for url in (HIST, SUMMARY, PREVIEW):
        r = client.get(url.format(profile_id))
        assert r.status_code == 409 and "no stored result" in r.json()["detail"]

    _publish(a, dest)  # back again: a's charts, computed afresh or not, never b's
    assert _same(_served(client, profile_id), want_a)


def test_a_deleted_or_unready_profile_is_refused_despite_cached_bodies(api, two_profiles):
    client, app, profile_id, dest = api
    from moelab.store.db import Job, Profile

    _publish(two_profiles[0], dest)
    _served(client, profile_id)
    with app.state.db.session() as s:  # a re-run queued: 409 while it runs, whatever is cached
        s.add(Job(id="job-cache-rerun", kind="profile", queue="gpu", resource_type="profiles", resource_id=profile_id,
                  state="running"))
        s.flush()
        s.get(Profile, profile_id).job_id = "job-cache-rerun"
    for url in (HIST, SUMMARY, PREVIEW):
        r = client.get(url.format(profile_id))
        assert r.status_code == 409 and "still running" in r.json()["detail"]
    with app.state.db.session() as s:
        s.delete(s.get(Profile, profile_id))
    for url in (HIST, SUMMARY, PREVIEW):
        r = client.get(url.format(profile_id))
        assert r.status_code == 404 and profile_id in r.json()["detail"]


def test_payload_cache_is_a_bounded_lru():
    cache = PayloadCache(max_entries=3, max_bytes=100, max_item_bytes=60)
    for k in "abc":
        cache.put(k, b"x" * 10)
    assert cache.get("a") == b"x" * 10  # a is now the most recent
    cache.put("d", b"y" * 10)  # over 3 entries: the least recent (b) goes
    assert cache.get("b") is None and cache.get("a") is not None and len(cache) == 3
    cache.put("big", b"z" * 61)  # over max_item_bytes: not kept at all
    assert cache.get("big") is None and len(cache) == 3
    cache.put("e", b"w" * 50)
    cache.put("f", b"v" * 50)  # 100 bytes of e + f, plus the rest: the oldest go until ≤ 100
    assert cache.nbytes <= 100 and cache.get("f") is not None
    cache.put("f", b"u" * 5)  # replacing a key counts its new size only
    assert cache.get("f") == b"u" * 5 and cache.nbytes == sum(len(cache.get(k) or b"") for k in "acdef")
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0
