"""GGUF export through the service (issue 25 item 5), with a real worker: a conversion's JSON says
whether it exports to GGUF and why not; a layout llama.cpp cannot express is refused 409 with that
reason before anything is queued; an ExpertWeaver conversion with one α for every layer, recovered
1 step in mode expertweaver through the API (EW Eq. 11: softmax router, weighted combine), exports
as a job whose file downloads as a GGUF that llama.cpp loads; asking again returns the same export;
deleting the conversion deletes its exports."""

from __future__ import annotations

import io
import zipfile

import pytest

from .helpers import succeeded, wait_job

#: EW with one α for every layer (2 shared experts of 12 neurons, top-4 of 6 routed on the tiny model)
UNIFORM = {"n_experts": 8, "sparsity": 0.25, "alpha_min": 0.25, "alpha_max": 0.25, "tau": 0.3}
ONE_STEP = {"mode": "expertweaver", "steps": 1, "batch_size": 1, "seq_len": 16, "eval_windows": 1, "source": "builtin:math"}


@pytest.fixture(scope="module")
def exportable_id(client, profile_id) -> str:
    """A conversion whose layout exports: the uniform EW conversion fine-tuned 1 step in mode expertweaver."""
    r = client.post("/api/v1/conversions", json={"profile_id": profile_id, "expertweaver": UNIFORM})
    assert r.status_code == 202, r.text
    succeeded(client, r.json())
    ft = client.post("/api/v1/finetunes", json={"conversion_id": r.json()["id"], **ONE_STEP})
    assert ft.status_code == 202, ft.text
    succeeded(client, ft.json())
    result = client.get(f"/api/v1/finetunes/{ft.json()['id']}").json()["result_conversion_id"]
    assert result, ft.json()
    return result


def test_a_layout_that_does_not_export_is_refused_with_the_reason(client, conversion_id):
    conv = client.get(f"/api/v1/conversions/{conversion_id}").json()
    check = conv["gguf"]
    assert check["exportable"] is False and check["types"] == ["f32", "f16", "q8_0"], check
    # the training-free EW combine (Eq. 10, 'sum'), and the conversion that would export
    assert "combines its experts with 'sum'" in check["reason"] and "--recipe portable" in check["reason"], check
    listed = next(c for c in client.get("/api/v1/conversions").json()["items"] if c["id"] == conversion_id)
    assert listed["gguf"] == check and listed["exports"] == []

    r = client.post(f"/api/v1/conversions/{conversion_id}/exports", json={"format": "gguf", "type": "f16"})
    assert r.status_code == 409, r.text
    assert r.json()["detail"] == f"conversion {conversion_id} does not export to GGUF: {check['reason']}"
    listing = client.get(f"/api/v1/conversions/{conversion_id}/exports").json()
    assert listing["total"] == 0 and listing["gguf"] == check  # nothing queued, nothing stored


@pytest.mark.parametrize("body, status, words", [
    ({"format": "gguf", "type": "q4_0"}, 422, "type: Input should be 'f32', 'f16' or 'q8_0'"),
    ({"format": "onnx", "type": "f16"}, 422, "format: Input should be 'gguf'"),
    ({"format": "gguf", "typ": "f16"}, 422, "typ: unknown field"),
])
def test_bad_export_requests_say_what_to_fix(client, conversion_id, body, status, words):
    r = client.post(f"/api/v1/conversions/{conversion_id}/exports", json=body)
    assert r.status_code == status and words in r.json()["detail"], r.text


def test_unknown_conversion_or_export_is_404(client):
    r = client.post("/api/v1/conversions/conv-0000000000000000/exports", json={"type": "f16"})
    assert r.status_code == 404 and "GET /api/v1/conversions" in r.json()["detail"], r.text
    assert client.get("/api/v1/conversions/conv-0000000000000000/exports").status_code == 404
    r = client.get("/api/v1/exports/exp-0000000000000000/files/x.gguf")
    assert r.status_code == 404 and "GET /api/v1/exports" in r.json()["detail"], r.text


def test_export_job_writes_a_gguf_that_downloads_and_loads(client, settings, exportable_id, tmp_path):
    conv = client.get(f"/api/v1/conversions/{exportable_id}").json()
    assert conv["gguf"] == {"exportable": True, "reason": None, "types": ["f32", "f16", "q8_0"]}, conv["gguf"]
    r = client.post(f"/api/v1/conversions/{exportable_id}/exports", json={"format": "gguf", "type": "f16"})
    assert r.status_code == 202, r.text
    created = r.json()
    assert created["status"] == "queued" and created["job"]["kind"] == "export" and created["download_url"] is None
    estimate = created["params"]["estimate"]
    assert estimate["disk_bytes"] > estimate["file_bytes"] > 0 and estimate["memory_bytes"] > estimate["disk_bytes"]
    again = client.post(f"/api/v1/conversions/{exportable_id}/exports", json={"type": "f16"})  # while it is queued or running
    assert again.status_code == 200 and again.json()["id"] == created["id"] and again.json()["job_id"] == created["job_id"]

    job = wait_job(client, created["job_id"], timeout=120)
    assert job["state"] == "succeeded", job
    export = client.get(f"/api/v1/exports/{created['id']}").json()
    assert export["status"] == "ready" and export["file"] == f"{exportable_id}-f16.gguf", export
    assert export["summary"]["architecture"] == "deepseek" and export["summary"]["layout"]["num_experts"] == 6
    assert {f["path"] for f in export["files"]} == {export["file"], "Modelfile", "conversion.json", "README.md"}
    assert "/" not in str(export["summary"].get("file")) and str(settings.resolved_artifacts_dir()) not in str(export)

    r = client.get(export["download_url"])
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream", r.headers
    assert r.headers["content-disposition"] == f'attachment; filename="{export["file"]}"'
    assert r.content[:4] == b"GGUF" and len(r.content) == export["bytes"]
    stored = settings.resolved_artifacts_dir() / "conversions" / exportable_id / "exports" / created["id"] / export["file"]
    assert stored.read_bytes() == r.content  # inside the conversion's artifact area
    zf = zipfile.ZipFile(io.BytesIO(client.get(export["archive_url"]).content))
    assert zf.read(f"{created['id']}/Modelfile") == f"FROM ./{export['file']}\n".encode()

    # the conversion's own files and zip stay the model directory: the export is listed apart
    listing = client.get(f"/api/v1/artifacts/conversions/{exportable_id}").json()
    assert not any(f["path"].startswith("exports/") for f in listing["files"]), listing["files"]
    listed = next(c for c in client.get("/api/v1/conversions").json()["items"] if c["id"] == exportable_id)
    assert [(e["id"], e["status"], e["download_url"]) for e in listed["exports"]] == [(created["id"], "ready", export["download_url"])]
    ready_again = client.post(f"/api/v1/conversions/{exportable_id}/exports", json={"format": "gguf", "type": "f16"})
    assert ready_again.status_code == 200 and ready_again.json()["job_id"] == created["job_id"]  # no second job

    llama_cpp = pytest.importorskip("llama_cpp")
    path = tmp_path / export["file"]
    path.write_bytes(r.content)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, verbose=False)
    assert llm.n_vocab() == conv_vocab(client, exportable_id)
    assert len(llm.tokenize(b"Hello world")) > 0
    out = llm("Hello", max_tokens=3, temperature=0.0)
    assert out["usage"]["completion_tokens"] >= 1


def conv_vocab(client, conversion_id: str) -> int:
    config = client.get(f"/api/v1/artifacts/conversions/{conversion_id}/files/config.json").json()
    return config["base_config"]["vocab_size"]


def test_deleting_a_conversion_deletes_its_exports(client, settings, exportable_id):
    """(After the export test: it deletes the module's exportable conversion.)"""
    r = client.post(f"/api/v1/conversions/{exportable_id}/exports", json={"format": "gguf", "type": "q8_0"})
    assert r.status_code == 202, r.text
    q8 = r.json()
    assert wait_job(client, q8["job_id"], timeout=120)["state"] == "succeeded"
    exports = client.get(f"/api/v1/conversions/{exportable_id}/exports").json()["items"]
    assert {e["type"] for e in exports} >= {"q8_0"} and all(e["status"] == "ready" for e in exports)
    folder = settings.resolved_artifacts_dir() / "conversions" / exportable_id / "exports"
    assert (folder / q8["id"]).is_dir()
    f16 = next((e for e in exports if e["type"] == "f16"), None)
    if f16 is not None:  # one export alone: its files go, the conversion stays
        r = client.delete(f"/api/v1/exports/{f16['id']}")
        assert r.status_code == 200, r.text
        assert r.json()["deleted"] == [{"type": "exports", "id": f16["id"]}] and r.json()["artifacts_removed"] == 1
        assert not (folder / f16["id"]).exists() and (folder / q8["id"]).is_dir()
        assert client.get(f"/api/v1/conversions/{exportable_id}").json()["status"] == "ready"
        exports = [e for e in exports if e["id"] != f16["id"]]

    r = client.delete(f"/api/v1/conversions/{exportable_id}")  # exports are parts of it: no cascade asked for
    assert r.status_code == 200, r.text
    deleted = {(d["type"], d["id"]) for d in r.json()["deleted"]}
    assert deleted == {("conversions", exportable_id), *{("exports", e["id"]) for e in exports}}, deleted
    assert not folder.parent.exists()
    for e in exports:
        assert client.get(f"/api/v1/exports/{e['id']}").status_code == 404
    assert all(e["conversion_id"] != exportable_id for e in client.get("/api/v1/exports").json()["items"])


def test_a_schema_3_database_gains_the_exports_table(tmp_path):
    """Schema 3 -> 4: the exports table and its unique (conversion, format, type) index are added; nothing else changes."""
    from sqlalchemy import inspect, text
    from sqlalchemy.exc import IntegrityError

    from moelab.store.db import SCHEMA_VERSION, Database

    url = f"sqlite:///{tmp_path / 'v3.sqlite'}"
    db = Database(url)
    db.init()
    with db.engine.begin() as conn:
        conn.execute(text("DROP TABLE exports"))
        conn.execute(text("UPDATE moelab_meta SET value = '3' WHERE key = 'schema_version'"))
        conn.execute(text("INSERT INTO conversions (id, created_at, params) VALUES ('conv-1', '2026-11-20 10:00:00.000000', '{}')"))
    db.dispose()
    db = Database(url)
    db.init()
    assert "uq_exports_conversion_format_type" in {i["name"] for i in inspect(db.engine).get_indexes("exports")}
    with db.engine.begin() as conn:
        assert conn.execute(text("SELECT value FROM moelab_meta")).scalar() == str(SCHEMA_VERSION) == "5"
        conn.execute(text("INSERT INTO exports (id, created_at, params, conversion_id, format, type) VALUES "
                          "('exp-1', '2026-11-20 10:00:00.000000', '{}', 'conv-1', 'gguf', 'f16')"))
    with pytest.raises(IntegrityError), db.engine.begin() as conn:  # one export per conversion, format and type
        conn.execute(text("INSERT INTO exports (id, created_at, params, conversion_id, format, type) VALUES "
                          "('exp-2', '2026-11-20 10:00:01.000000', '{}', 'conv-1', 'gguf', 'f16')"))
    db.dispose()
