"""Bad input: each request is answered 4xx with a message saying what to fix, and the store
(every SQL row and every artifact file) is exactly as it was before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from sqlalchemy import create_engine, select

from moelab.store.db import Base

from .conftest import MAX_UPLOAD_MB
from .helpers import jsonl, wait_idle


def snapshot(settings) -> tuple[dict[str, list[str]], list[tuple[str, int, int]]]:
    engine = create_engine(settings.resolved_database_url())
    with engine.connect() as conn:
        rows = {t.name: sorted(repr(tuple(r)) for r in conn.execute(select(t))) for t in Base.metadata.sorted_tables}
    engine.dispose()
    root: Path = settings.resolved_artifacts_dir()
    # files with size and mtime; directories by name only (a scratch file coming and going touches theirs)
    files = sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns if p.is_file() else 0)
                   for p in root.rglob("*"))
    return rows, files


@pytest.fixture(scope="module")
def ids(client, model_id, calib_id, profile_id, conversion_id, failed_profile_id) -> dict[str, str]:
    txt = client.post("/api/v1/calibration-sets/upload",
                      files={"file": ("plain.txt", b"An unlabelled paragraph of text.\n\nAnother unlabelled paragraph here.")})
    assert txt.status_code in (200, 201)
    done = client.get("/api/v1/jobs", params={"resource_id": profile_id}).json()["items"][0]["id"]
    return {"model": model_id, "calib": calib_id, "profile": profile_id, "conversion": conversion_id,
            "failed_profile": failed_profile_id, "unlabelled": txt.json()["id"], "done_job": done}


def _profile(ids, **kw: Any) -> dict[str, Any]:
    return {"model_id": ids["model"], "calibration_set_id": ids["calib"], "max_tokens": 32, "batch_tokens": 256, **kw}


def _conversion(ids, method: str = "expertweaver", **params: Any) -> dict[str, Any]:
    return {"profile_id": ids["profile"], "method": method, method: params}


BIG = b'{"text": "' + b"x" * int(MAX_UPLOAD_MB * 1e6 + 1000) + b'"}\n'

# (name, method, path template, request kwargs (a function of ids), expected status, words the message must contain)
CASES: list[tuple[str, str, str, Any, int, str]] = [
    ("unknown model", "get", "/api/v1/models/mod-0000000000000000", None, 404, "GET /api/v1/models"),
    ("unknown job", "get", "/api/v1/jobs/job-nope", None, 404, "no job"),
    ("unknown endpoint", "get", "/api/v1/nothing-here", None, 404, "/docs"),
    ("model path missing", "post", "/api/v1/models", lambda i: {"json": {"source": "/no/such/model"}}, 422, "does not exist"),
    ("model id malformed", "post", "/api/v1/models", lambda i: {"json": {"source": "not a model id!"}}, 422, "Hugging Face id"),
    ("model remote code refused", "post", "/api/v1/models", lambda i: {"json": {"source": "default", "trust_remote_code": True}}, 403, "MOELAB_ALLOW_TRUST_REMOTE_CODE"),
    ("model field typo", "post", "/api/v1/models", lambda i: {"json": {"sauce": "default"}}, 422, "sauce: unknown field"),
    ("body not JSON", "post", "/api/v1/models", lambda i: {"content": b"{nope", "headers": {"content-type": "application/json"}}, 422, "not valid JSON"),
    ("builtin unknown", "post", "/api/v1/calibration-sets", lambda i: {"json": {"source": "builtin", "name": "poetry"}}, 422, "name"),
    ("builtin zero samples", "post", "/api/v1/calibration-sets", lambda i: {"json": {"source": "builtin", "name": "math", "samples": 0}}, 422, "greater than or equal to 1"),
    ("source kind unknown", "post", "/api/v1/calibration-sets", lambda i: {"json": {"source": "ftp", "name": "x"}}, 422, "source"),
    ("upload wrong type", "post", "/api/v1/calibration-sets/upload", lambda i: {"files": {"file": ("data.csv", b"text\nhello")}}, 422, ".jsonl"),
    ("upload bad JSON line", "post", "/api/v1/calibration-sets/upload",
     lambda i: {"files": {"file": ("bad.jsonl", b'{"text": "a fine first sample of text"}\n{"text": oops}\n')}}, 422, "bad.jsonl"),
    ("upload without text", "post", "/api/v1/calibration-sets/upload",
     lambda i: {"files": {"file": ("notext.jsonl", jsonl([{"body": "no text field here at all"}]))}}, 422, "text"),
    ("upload empty", "post", "/api/v1/calibration-sets/upload", lambda i: {"files": {"file": ("empty.txt", b"")}}, 422, "empty"),
    ("upload missing file", "post", "/api/v1/calibration-sets/upload", lambda i: {"data": {"name": "x"}}, 422, "file"),
    ("upload too large", "post", "/api/v1/calibration-sets/upload", lambda i: {"files": {"file": ("big.jsonl", BIG)}}, 413, "MOELAB_MAX_UPLOAD_MB"),
    ("profile unknown model", "post", "/api/v1/profiles", lambda i: {"json": {**_profile(i), "model_id": "mod-1234"}}, 404, "no model"),
    ("profile unknown set", "post", "/api/v1/profiles", lambda i: {"json": {**_profile(i), "calibration_set_id": "cal-1234"}}, 404, "calibration set"),
    ("profile batch < sample", "post", "/api/v1/profiles", lambda i: {"json": _profile(i, max_tokens=512, batch_tokens=256)}, 422, "batch_tokens"),
    ("profile max_tokens 1", "post", "/api/v1/profiles", lambda i: {"json": _profile(i, max_tokens=1)}, 422, "max_tokens"),
    ("profile too many samples", "post", "/api/v1/profiles", lambda i: {"json": _profile(i, samples=500)}, 422, "at most 12"),
    ("profile CV by missing tasks", "post", "/api/v1/profiles",
     lambda i: {"json": {**_profile(i, group_by="task"), "calibration_set_id": i["unlabelled"]}}, 422, "group_by"),
    ("alpha_min > alpha_max", "post", "/api/v1/conversions", lambda i: {"json": _conversion(i, alpha_min=0.8, alpha_max=0.3)}, 422, "alpha_min (0.8) must not exceed alpha_max"),
    ("tau zero", "post", "/api/v1/conversions", lambda i: {"json": _conversion(i, tau=0)}, 422, "tau"),
    ("sparsity 1", "post", "/api/v1/conversions", lambda i: {"json": _conversion(i, sparsity=1.0)}, 422, "sparsity"),
    ("sparsity 0", "post", "/api/v1/conversions", lambda i: {"json": _conversion(i, sparsity=0)}, 422, "sparsity"),
    ("experts do not fit d_ffn", "post", "/api/v1/conversions", lambda i: {"json": _conversion(i, n_experts=200)}, 422, "d_ffn=96"),
    ("S+A > E", "post", "/api/v1/conversions", lambda i: {"json": _conversion(i, method="cmoe", n_experts=4, shared=3, active=2)}, 422, "S·A·E"),
    ("convert a failed profile", "post", "/api/v1/conversions", lambda i: {"json": {**_conversion(i), "profile_id": i["failed_profile"]}}, 409, "some samples have no task"),
    ("convert unknown profile", "post", "/api/v1/conversions", lambda i: {"json": {**_conversion(i), "profile_id": "pr-00"}}, 404, "no profile"),
    ("preview alpha order", "get", "/api/v1/profiles/{profile}/allocation-preview", lambda i: {"params": {"alpha_min": 0.9, "alpha_max": 0.1}}, 422, "alpha_min"),
    ("preview experts too many", "get", "/api/v1/profiles/{profile}/allocation-preview", lambda i: {"params": {"n_experts": 1000}}, 422, "do not fit"),
    ("preview unknown parameter", "get", "/api/v1/profiles/{profile}/allocation-preview", lambda i: {"params": {"alpha-max": 0.5}}, 422, "unknown field"),
    ("chart layer out of range", "get", "/api/v1/profiles/{profile}/charts/activations", lambda i: {"params": {"layer": 9}}, 422, "0 … 2"),
    ("chart of failed profile", "get", "/api/v1/profiles/{failed_profile}/charts/cv-histogram", None, 409, "retry"),
    ("evaluation unknown builtin", "post", "/api/v1/evaluations", lambda i: {"json": {"conversion_id": i["conversion"], "source": "builtin:nope"}}, 422, "builtin:mixed"),
    ("evaluation unknown set", "post", "/api/v1/evaluations", lambda i: {"json": {"conversion_id": i["conversion"], "source": "cal-missing"}}, 422, "calibration set"),
    ("evaluation zero windows", "post", "/api/v1/evaluations", lambda i: {"json": {"conversion_id": i["conversion"], "n_windows": 0}}, 422, "n_windows"),
    ("evaluation unknown conversion", "post", "/api/v1/evaluations", lambda i: {"json": {"conversion_id": "conv-x"}}, 404, "no conversion"),
    ("cancel a finished job", "delete", "/api/v1/jobs/{done_job}", None, 409, "already succeeded"),
    ("retry a finished job", "post", "/api/v1/jobs/{done_job}/retry", None, 409, "only failed or cancelled"),
    ("artifact of failed profile", "get", "/api/v1/artifacts/profiles/{failed_profile}", None, 409, "failed"),
    ("artifact path escape", "get", "/api/v1/artifacts/profiles/{profile}/files/..%2F..%2Fmoelab.db", None, 404, "no file"),
    ("artifact kind unknown", "get", "/api/v1/artifacts/secrets/{profile}", None, 422, "kind"),
    ("samples limit too big", "get", "/api/v1/calibration-sets/{calib}/samples", lambda i: {"params": {"limit": 10000}}, 422, "limit"),
]


def test_table_is_big_enough():
    assert len(CASES) >= 20


def test_bad_requests_answer_4xx_and_change_nothing(client, settings, ids):
    wait_idle(client)
    before = snapshot(settings)
    problems = []
    for name, method, path, kwargs, status, words in CASES:
        r = getattr(client, method)(path.format(**ids), **(kwargs(ids) if kwargs else {}))
        body = r.json()
        ok = r.status_code == status and isinstance(body.get("detail"), str) and words in body["detail"]
        if not ok:
            problems.append(f"{name}: {r.status_code} {body}")
    assert not problems, "\n".join(problems)
    assert snapshot(settings) == before


def test_api_token_guards_mutating_requests(settings, worker, ids):
    from fastapi.testclient import TestClient

    from backend.app import create_app

    guarded = settings.model_copy(update={"api_token": SecretStr("s3cret-token")})
    before = snapshot(settings)
    with TestClient(create_app(guarded)) as c:
        assert c.get("/api/v1/models").status_code == 200  # reading needs no token
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Token": "wrong"}):
            r = c.post("/api/v1/models", json={"source": "default"}, headers=headers)
            assert r.status_code == 401 and "MOELAB_API_TOKEN" in r.json()["detail"]
            r = c.delete(f"/api/v1/jobs/{ids['done_job']}", headers=headers)
            assert r.status_code == 401
        assert snapshot(settings) == before
        r = c.delete(f"/api/v1/jobs/{ids['done_job']}", headers={"Authorization": "Bearer s3cret-token"})
        assert r.status_code == 409  # past the token check, refused for what it is
        r = c.post("/api/v1/calibration-sets/upload", headers={"X-API-Token": "s3cret-token"},
                   files={"file": ("tok.txt", b"A paragraph uploaded with a token, long enough.\n\nAnd a second one too.")})
        assert r.status_code in (200, 201)


def test_chunked_upload_over_the_limit_is_refused(client, settings):
    """No Content-Length: the body is counted as it streams."""
    before = snapshot(settings)

    def chunks():
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
        for _ in range(int(MAX_UPLOAD_MB * 4)):
            yield b"x" * 300_000
        yield b"\r\n--b--\r\n"

    r = client.post("/api/v1/calibration-sets/upload", content=chunks(),
                    headers={"content-type": "multipart/form-data; boundary=b"})
    assert r.status_code == 413 and "MOELAB_MAX_UPLOAD_MB" in r.json()["detail"]
    assert snapshot(settings) == before
