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
def ids(client, settings, model_id, calib_id, profile_id, conversion_id, failed_profile_id) -> dict[str, str]:
    txt = client.post("/api/v1/calibration-sets/upload",
                      files={"file": ("plain.txt", b"An unlabelled paragraph of text.\n\nAnother unlabelled paragraph here.")})
    assert txt.status_code in (200, 201)
    done = client.get("/api/v1/jobs", params={"resource_id": profile_id}).json()["items"][0]["id"]
    root = Path(settings.resolved_data_roots()[1])
    link = root / "escape.txt"
    if not link.is_symlink():
        link.symlink_to("/etc/hostname")
    return {"model": model_id, "calib": calib_id, "profile": profile_id, "conversion": conversion_id,
            "failed_profile": failed_profile_id, "unlabelled": txt.json()["id"], "done_job": done,
            "root": str(root), "link": str(link), "db_path": settings.resolved_database_url().split("///", 1)[1]}


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
    ("model path missing", "post", "/api/v1/models", lambda i: {"json": {"source": i["root"] + "/no-such-model"}}, 422, "does not exist"),
    ("model path outside the roots", "post", "/api/v1/models", lambda i: {"json": {"source": "/etc"}}, 403, "MOELAB_DATA_ROOTS"),
    ("model path missing outside the roots", "post", "/api/v1/models", lambda i: {"json": {"source": "/no/such/model"}}, 403, "outside the directories"),
    ("model path relative", "post", "/api/v1/models", lambda i: {"json": {"source": "./my-llama"}}, 422, "relative path"),
    ("model path dot-dot out of a root", "post", "/api/v1/models", lambda i: {"json": {"source": i["root"] + "/../.."}}, 403, "outside"),
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
    ("profile max_memory unreadable", "post", "/api/v1/profiles", lambda i: {"json": _profile(i, max_memory="lots")}, 422, "cannot read memory size"),
    ("profile max_memory below one layer", "post", "/api/v1/profiles", lambda i: {"json": _profile(i, max_memory="1KB")}, 422, "give at least"),
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
    # --- where calibration data may come from (issue 15 item 3): Hub names, or paths inside MOELAB_DATA_ROOTS
    ("hf: any server file", "post", "/api/v1/calibration-sets", lambda i: {"json": {"source": "hf", "dataset": "/etc/passwd"}}, 403, "MOELAB_DATA_ROOTS"),
    ("hf: the service's own DB", "post", "/api/v1/calibration-sets", lambda i: {"json": {"source": "hf", "dataset": i["db_path"]}}, 403, "outside the directories"),
    ("hf: relative path", "post", "/api/v1/calibration-sets", lambda i: {"json": {"source": "hf", "dataset": "../moelab.db"}}, 422, "MOELAB_DATA_ROOTS"),
    ("hf: home path", "post", "/api/v1/calibration-sets", lambda i: {"json": {"source": "hf", "dataset": "~/.ssh/id_rsa"}}, 422, "relative path"),
    ("hf: dot-dot out of a root", "post", "/api/v1/calibration-sets", lambda i: {"json": {"source": "hf", "dataset": i["root"] + "/../../moelab.db"}}, 403, "outside"),
    ("hf: symlink out of a root", "post", "/api/v1/calibration-sets", lambda i: {"json": {"source": "hf", "dataset": i["link"]}}, 403, "outside"),
    ("hf: relative file name", "post", "/api/v1/calibration-sets", lambda i: {"json": {"source": "hf", "dataset": "pyproject.toml/x/y"}}, 422, "relative path"),
    ("hf: data file name", "post", "/api/v1/calibration-sets", lambda i: {"json": {"source": "hf", "dataset": "rows.jsonl"}}, 422, "relative path"),
    ("hf: not a Hub name", "post", "/api/v1/calibration-sets", lambda i: {"json": {"source": "hf", "dataset": "a b|c"}}, 422, "not a Hugging Face dataset name"),
    ("hf: missing file in a root", "post", "/api/v1/calibration-sets", lambda i: {"json": {"source": "hf", "dataset": i["root"] + "/nope.jsonl"}}, 422, "does not exist"),
    # --- inputs (item 4): nested JSON, non-finite numbers in bodies and query parameters
    ("upload deeply nested JSON line", "post", "/api/v1/calibration-sets/upload",
     lambda i: {"files": {"file": ("deep.jsonl", NESTED)}}, 422, "deep.jsonl:2: JSON nested too deeply"),
    ("upload deeply nested JSON array", "post", "/api/v1/calibration-sets/upload",
     lambda i: {"files": {"file": ("deep.json", b"[" * 200_000 + b"]" * 200_000)}}, 422, "nested too deeply"),
    ("upload JSON line not an object", "post", "/api/v1/calibration-sets/upload",
     lambda i: {"files": {"file": ("list.jsonl", b'{"text": "a fine first sample of text"}\n[1, 2]\n')}}, 422, "list.jsonl:2: expected a JSON object"),
    ("tau Infinity in a body", "post", "/api/v1/conversions", lambda i: _raw(_conversion(i), "tau", "Infinity"), 422, "expertweaver.tau: Input should be a finite number"),
    ("tau NaN in a body", "post", "/api/v1/conversions", lambda i: _raw(_conversion(i), "tau", "NaN"), 422, "finite number"),
    ("tau -Infinity in a body", "post", "/api/v1/conversions", lambda i: _raw(_conversion(i), "tau", "-Infinity"), 422, "finite number"),
    ("alpha 1e999 in a body", "post", "/api/v1/conversions", lambda i: _raw(_conversion(i), "alpha_max", "1e999"), 422, "finite number"),
    ("fine-tune lr NaN", "post", "/api/v1/finetunes", lambda i: _raw({"conversion_id": i["conversion"]}, "lr", "NaN", block=None), 422, "lr: Input should be a finite number"),
    ("fine-tune lora_alpha Infinity", "post", "/api/v1/finetunes", lambda i: _raw({"conversion_id": i["conversion"]}, "lora_alpha", "Infinity", block=None), 422, "finite number"),
    ("profile seed Infinity", "post", "/api/v1/profiles", lambda i: _raw(_profile(i), "seed", "Infinity", block=None), 422, "seed"),
    ("preview tau=inf", "get", "/api/v1/profiles/{profile}/allocation-preview", lambda i: {"params": {"tau": "inf"}}, 422, "tau: Input should be a finite number"),
    ("preview tau=nan", "get", "/api/v1/profiles/{profile}/preview/expertweaver", lambda i: {"params": {"tau": "nan"}}, 422, "finite number"),
    ("preview alpha_max=-infinity", "get", "/api/v1/profiles/{profile}/preview/expertweaver", lambda i: {"params": {"alpha_max": "-infinity"}}, 422, "finite number"),
    ("cv-summary tau=inf", "get", "/api/v1/profiles/{profile}/charts/cv-summary", lambda i: {"params": {"tau": "inf"}}, 422, "tau: Input should be a finite number"),
    ("cv-histogram clip_quantile=nan", "get", "/api/v1/profiles/{profile}/charts/cv-histogram", lambda i: {"params": {"clip_quantile": "nan"}}, 422, "finite number"),
    ("layer-similarity delta=inf", "get", "/api/v1/profiles/{profile}/charts/layer-similarity", lambda i: {"params": {"delta": "inf"}}, 422, "finite number"),
    # --- every input bounded: work that grows without limit is refused up front, naming the limit
    ("evaluation tokens over the limit", "post", "/api/v1/evaluations",
     lambda i: {"json": {"conversion_id": i["conversion"], "n_windows": 4096, "seq_len": 32768}}, 422, "MOELAB_MAX_EVAL_TOKENS"),
    ("evaluation seq_len beyond the model's positions", "post", "/api/v1/evaluations",
     lambda i: {"json": {"conversion_id": i["conversion"], "n_windows": 2, "seq_len": 1024}}, 422, "max_position_embeddings (512)"),
    ("fine-tune lora_rank over d_model", "post", "/api/v1/finetunes",
     lambda i: {"json": {"conversion_id": i["conversion"], "lora_rank": 4096}}, 422, "lora_rank 4096 exceeds d_model (64)"),
    ("fine-tune seq_len beyond the model's positions", "post", "/api/v1/finetunes",
     lambda i: {"json": {"conversion_id": i["conversion"], "seq_len": 1024}}, 422, "max_position_embeddings (512)"),
    ("fine-tune held-out tokens over the limit", "post", "/api/v1/finetunes",
     lambda i: {"json": {"conversion_id": i["conversion"], "eval_windows": 4096, "seq_len": 512}}, 422, "MOELAB_MAX_EVAL_TOKENS"),
    ("midas extra profile = profile", "post", "/api/v1/conversions",
     lambda i: {"json": {"profile_id": i["profile"], "method": "midas", "extra_profile_ids": [i["profile"]]}}, 422, "more than once"),
    ("midas extra profiles repeated", "post", "/api/v1/conversions",
     lambda i: {"json": {"profile_id": i["profile"], "method": "midas", "extra_profile_ids": ["pr-0000000000000001", "pr-0000000000000001"]}},
     422, "pr-0000000000000001 given more than once"),
    ("profile atopk_k over d_ffn", "post", "/api/v1/profiles", lambda i: {"json": _profile(i, atopk_k=4096)}, 422, "atopk_k 4096 exceeds d_ffn (96"),
    # --- deleting (item 6): unknown ids, and what something depends on without cascade
    ("delete unknown model", "delete", "/api/v1/models/mod-0000000000000000", None, 404, "no model"),
    ("delete unknown calibration set", "delete", "/api/v1/calibration-sets/cal-0000000000000000", None, 404, "no calibration set"),
    ("delete unknown profile", "delete", "/api/v1/profiles/pr-0000000000000000", None, 404, "no profile"),
    ("delete unknown conversion", "delete", "/api/v1/conversions/conv-0000000000000000", None, 404, "no conversion"),
    ("delete unknown evaluation", "delete", "/api/v1/evaluations/ev-0000000000000000", None, 404, "no evaluation"),
    ("delete unknown fine-tune", "delete", "/api/v1/finetunes/ft-0000000000000000", None, 404, "no fine-tune"),
    ("delete a model in use", "delete", "/api/v1/models/{model}", None, 409, "is used by profile"),
    ("delete a set in use", "delete", "/api/v1/calibration-sets/{calib}", None, 409, "cascade=true"),
    ("delete a profile in use", "delete", "/api/v1/profiles/{profile}", None, 409, "is used by conversion conv-"),
    ("delete with a bad cascade flag", "delete", "/api/v1/profiles/{profile}", lambda i: {"params": {"cascade": "maybe"}}, 422, "cascade"),
    # --- text a store would refuse later, booleans that are not booleans (issue 40 items 2, 3)
    ("upload JSONL with a lone surrogate", "post", "/api/v1/calibration-sets/upload",
     lambda i: {"files": {"file": ("sur.jsonl", b'{"text": "a fine first sample of text"}\n{"text": "half a pair \\ud800 here, long enough"}\n')}},
     422, "sur.jsonl:2: 'text' holds a lone UTF-16 surrogate (\\ud800)"),
    ("upload JSONL with a NUL in a label", "post", "/api/v1/calibration-sets/upload",
     lambda i: {"files": {"file": ("nul.jsonl", b'{"text": "a fine first sample of text", "task": "co\\u0000de"}\n')}},
     422, "nul.jsonl:1: 'task' holds a NUL character"),
    ("upload name with a NUL", "post", "/api/v1/calibration-sets/upload",
     lambda i: {"files": {"file": ("ok.txt", b"A paragraph of text, long enough.\n\nAnother one, long enough too.")}, "data": {"name": "a\x00b"}},
     422, "name: holds a NUL character"),
    ("NUL in a text_field", "post", "/api/v1/calibration-sets",
     lambda i: {"json": {"source": "hf", "dataset": "someone/data", "text_field": "te\u0000xt"}}, 422, "text_field: holds a NUL character"),
    ("NUL in notes", "patch", "/api/v1/profiles/{profile}/notes", lambda i: {"json": {"notes": "fine\u0000not"}}, 422, "notes: holds a NUL character"),
    ("lone surrogate in notes", "patch", "/api/v1/profiles/{profile}/notes", lambda i: {"content": b'{"notes": "x \\udfff y"}',
     "headers": {"content-type": "application/json"}}, 422, "notes: holds a lone UTF-16 surrogate (\\udfff)"),
    ("NUL in a nested method parameter", "post", "/api/v1/conversions",
     lambda i: {"json": _conversion(i, router="pa\u0000per")}, 422, "expertweaver.router: holds a NUL character (\\u0000) at position 2"),
    ("NUL in a query parameter", "get", "/api/v1/evaluations", lambda i: {"params": {"q": "ab\x00c"}}, 422, "NUL character"),
    ("string for a boolean", "post", "/api/v1/evaluations", lambda i: {"json": {"conversion_id": i["conversion"], "baselines": "no"}},
     422, "baselines: Input should be a valid boolean"),
    ("number for a boolean", "post", "/api/v1/models", lambda i: {"json": {"source": "default", "trust_remote_code": 0}}, 422,
     "trust_remote_code: Input should be a valid boolean"),
]

NESTED = b'{"text": "a fine first sample of text"}\n{"text": "x", "meta": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"


def _raw(body: dict[str, Any], field: str, literal: str, block: str | None = "expertweaver") -> dict[str, Any]:
    """A JSON body with a non-standard literal (``Infinity``, ``NaN``) that ``json.dumps`` would not write."""
    import json

    target = body[block] if block else body
    target[field] = "__RAW__"
    text = json.dumps(body).replace('"__RAW__"', literal)
    return {"content": text.encode(), "headers": {"content-type": "application/json"}}


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


HUGE = (2**31, 2**53, 2**53 + 1, 2**63 - 1, 2**63, 2**64)


def test_every_integer_parameter_refuses_overflow_in_words(client, settings, ids):
    """Every integer parameter of every GET operation (pagination, layers, neurons, seeds, bins …) is answered
    without a server error at any size, and past ``MAX_INT`` (2**53) with a 4xx saying what to fix
    (``offset=2**64`` once overflowed SQLite: a 500)."""
    import json

    from backend.openapi import render
    from backend.schemas import MAX_INT

    values = {"set_id": ids["calib"], "conversion_id": ids["conversion"], "other_id": ids["conversion"],
              "profile_id": ids["profile"], "a": ids["profile"], "b": ids["profile"], "finetune_id": "ft-0000000000000000"}
    tried, problems = 0, []
    for path, ops in json.loads(render())["paths"].items():
        params = (ops.get("get") or {}).get("parameters", [])
        ints = [p for p in params if "integer" in json.dumps(p["schema"])]
        for target in ints:
            for big in HUGE:
                given = {p["name"]: big if p is target else values.get(p["name"], 0) for p in params
                         if p["in"] == "path" or p is target or (p.get("required") and p["name"] in values)}
                url = path.format(**{k: v for k, v in given.items() if "{" + k + "}" in path})
                r = client.get(url, params={k: v for k, v in given.items() if "{" + k + "}" not in path})
                tried += 1
                refused = 400 <= r.status_code < 500 and r.json().get("detail")
                if r.status_code >= 500 or (big > MAX_INT and not refused):
                    problems.append(f"{url} {target['name']}={big}: {r.status_code} {r.text[:200]}")
    assert tried > 60 and not problems, "\n".join(problems)


def test_api_token_guards_reads_and_writes(settings, worker, ids):
    """With MOELAB_API_TOKEN set every route needs it, reads included (weights, samples, job errors,
    charts); only /health and the OpenAPI docs stay open. Refusals say what to send and store nothing."""
    from fastapi.testclient import TestClient

    from backend.app import create_app

    guarded = settings.model_copy(update={"api_token": SecretStr("s3cret-token")})
    before = snapshot(settings)
    reads = [
        "/api/v1/models", f"/api/v1/models/{ids['model']}", "/api/v1/methods", "/api/v1/jobs",
        f"/api/v1/jobs/{ids['done_job']}", f"/api/v1/calibration-sets/{ids['calib']}/samples",
        "/api/v1/artifacts", f"/api/v1/artifacts/conversions/{ids['conversion']}",
        f"/api/v1/artifacts/conversions/{ids['conversion']}/archive",
        f"/api/v1/artifacts/conversions/{ids['conversion']}/files/config.json",
        f"/api/v1/profiles/{ids['profile']}/charts/cv-summary", f"/api/v1/profiles/{ids['profile']}/allocation-preview",
        f"/api/v1/conversions/{ids['conversion']}",
    ]
    with TestClient(create_app(guarded)) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Token": "wrong"}, {"Authorization": "Basic czNjcmV0"}):
            for path in reads:
                r = c.get(path, headers=headers)
                assert r.status_code == 401 and "MOELAB_API_TOKEN" in r.json()["detail"], (path, headers, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
            r = c.post("/api/v1/models", json={"source": "default"}, headers=headers)
            assert r.status_code == 401 and "MOELAB_API_TOKEN" in r.json()["detail"]
            for path in (f"/api/v1/jobs/{ids['done_job']}", f"/api/v1/profiles/{ids['profile']}?cascade=true"):
                assert c.delete(path, headers=headers).status_code == 401
        assert snapshot(settings) == before
        assert c.get("/api/v1/health").status_code == 200  # probes need no secret
        assert c.get("/docs").status_code == 200 and c.get("/openapi.json").status_code == 200
        ok = {"Authorization": "Bearer s3cret-token"}
        for path in reads:
            assert c.get(path, headers=ok).status_code == 200, path
        assert c.get(reads[0], headers={"X-API-Token": "s3cret-token"}).status_code == 200
        r = c.delete(f"/api/v1/jobs/{ids['done_job']}", headers=ok)
        assert r.status_code == 409  # past the token check, refused for what it is
        r = c.post("/api/v1/calibration-sets/upload", headers={"X-API-Token": "s3cret-token"},
                   files={"file": ("tok.txt", b"A paragraph uploaded with a token, long enough.\n\nAnd a second one too.")})
        assert r.status_code in (200, 201)


def test_frontend_client_sends_the_token_on_reads(settings, ids):
    """The UI's API client (the one place its URLs live) carries MOELAB_API_TOKEN on every call."""
    from fastapi.testclient import TestClient

    from backend.app import create_app
    from moelab.api_client import ApiClient, ApiError

    import httpx

    guarded = settings.model_copy(update={"api_token": SecretStr("ui-token")})
    with TestClient(create_app(guarded)) as c:
        def forward(request: httpx.Request) -> httpx.Response:  # the in-process app, headers as the client sent them
            r = c.request(request.method, request.url.raw_path.decode(), headers=dict(request.headers), content=request.content)
            return httpx.Response(r.status_code, headers=r.headers, content=r.content)

        transport = httpx.MockTransport(forward)
        client = ApiClient(base_url="http://api/api/v1", token="ui-token", transport=transport)
        assert client.samples(ids["calib"], limit=2)["items"] and client.cv_summary(ids["profile"], tau=0.5)["tau"] == 0.5
        assert client.job(ids["done_job"])["state"] == "succeeded"
        anonymous = ApiClient(base_url="http://api/api/v1", token="", transport=transport)
        with pytest.raises(ApiError) as err:
            anonymous.samples(ids["calib"])
        assert err.value.status == 401 and "MOELAB_API_TOKEN" in err.value.message


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


#: the cases of the table about text a store refuses, run again on PostgreSQL (which refuses NUL in text)
TEXT_CASES = [c for c in CASES if any(w in c[0] for w in ("NUL", "surrogate", "boolean"))]


def test_text_postgres_refuses_is_refused_before_it_gets_there(settings, tmp_path):
    """The same API on PostgreSQL: NUL characters, lone surrogates and non-booleans are 422 at the request
    (PostgreSQL itself would fail the INSERT: a late 500), big offsets page past the end or are refused,
    any other Unicode is stored and read back as sent; nothing refused is stored."""
    from .test_store import fresh_postgres_schema

    with fresh_postgres_schema("moelab_bad") as (url, schema, admin):
        _bad_text_on_postgres(settings, tmp_path, url, schema, admin)


def _bad_text_on_postgres(settings, tmp_path, url: str, schema: str, admin) -> None:
    from fastapi.testclient import TestClient
    from sqlalchemy import text

    from backend.app import create_app

    pg = settings.model_copy(update={"database_url": f"{url}?options=-csearch_path%3D{schema}", "data_dir": tmp_path,
                                     "artifacts_dir": tmp_path / "artifacts"})
    with TestClient(create_app(pg)) as c:
        up = c.post("/api/v1/calibration-sets/upload",
                    files={"file": ("pg.txt", b"A paragraph stored on PostgreSQL, long enough.\n\nAnd another one, long enough.")})
        assert up.status_code == 201, up.text
        ids = {"profile": "pr-0000000000000000", "conversion": "conv-0000000000000000", "root": str(tmp_path)}
        before = snapshot(pg)
        problems = []
        cases = [(n, m, p.replace("/profiles/{profile}/notes", f"/calibration-sets/{up.json()['id']}/notes"), k, s, w)
                 for n, m, p, k, s, w in TEXT_CASES]
        for name, method, path, kwargs, status, words in cases:
            r = getattr(c, method)(path.format(**ids), **(kwargs(ids) if kwargs else {}))
            if r.status_code != status or words not in r.json().get("detail", ""):
                problems.append(f"{name}: {r.status_code} {r.text[:300]}")
        for offset, status in ((2**53, 200), (2**53 + 1, 422), (2**64, 422)):
            r = c.get("/api/v1/jobs", params={"offset": offset})
            if r.status_code != status:
                problems.append(f"offset {offset}: {r.status_code} {r.text[:200]}")
        assert not problems, "\n".join(problems)
        assert snapshot(pg) == before
        odd = "zero\u200bwidth, emoji 🧪, RTL \u202eabc, combining e\u0301, CJK 漢字, max \U0010ffff"
        r = c.patch(f"/api/v1/calibration-sets/{up.json()['id']}/notes", json={"notes": odd})
        assert r.status_code == 200 and c.get(f"/api/v1/calibration-sets/{up.json()['id']}").json()["notes"] == odd
    with admin.begin() as conn:  # what the check saves us from: PostgreSQL refuses NUL in text outright
        with pytest.raises(Exception, match="0x00|NUL|null character"):
            conn.execute(text(f"UPDATE {schema}.calibration_sets SET notes = :n"), {"n": "a\x00b"})
