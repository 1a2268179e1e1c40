"""Where calibration data may come from: Hub names, or real paths inside DATA_DIR/uploads and
MOELAB_DATA_ROOTS; the setting's two spellings; and the worker refusing a row that slipped past the API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moelab.settings import Settings
from moelab.store.dataroots import DataRootError, check_hub_name_is_not_local, resolve_dataset

from .helpers import wait_job


def test_setting_takes_a_json_list_or_a_path_list(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELAB_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("MOELAB_DATA_ROOTS", json.dumps([str(tmp_path / "a"), str(tmp_path / "b")]))
    assert Settings(_env_file=None).data_roots == [tmp_path / "a", tmp_path / "b"]
    monkeypatch.setenv("MOELAB_DATA_ROOTS", f"{tmp_path / 'a'}:{tmp_path / 'c'}")
    roots = Settings(_env_file=None).resolved_data_roots()
    assert roots == [(tmp_path / "uploads").resolve(), (tmp_path / "a").resolve(), (tmp_path / "c").resolve()]
    monkeypatch.delenv("MOELAB_DATA_ROOTS")
    assert Settings(_env_file=None).resolved_data_roots() == [(tmp_path / "uploads").resolve()]  # the default: uploads only


def test_resolve_dataset(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "rows.jsonl").write_text("{}\n")
    outside = tmp_path / "secret.txt"
    outside.write_text("x")
    (root / "link.txt").symlink_to(outside)
    roots = [root.resolve()]
    assert resolve_dataset("wikitext", roots).kind == "hub"
    assert resolve_dataset("allenai/c4", roots).value == "allenai/c4"
    assert resolve_dataset(str(root / "sub" / "rows.jsonl"), roots).value == str((root / "sub" / "rows.jsonl").resolve())
    assert resolve_dataset(str(root / "sub"), roots).kind == "local"
    refused = {
        str(outside): "outside", str(root / "link.txt"): "outside", str(root / ".." / "secret.txt"): "outside",
        "/etc/passwd": "MOELAB_DATA_ROOTS", "secret.txt": "relative path", "../x": "relative path", "~/x": "relative path",
        "a/b/c": "relative path", "with space": "not a Hugging Face dataset name", str(root / "nope.csv"): "does not exist",
    }
    for ref, words in refused.items():
        with pytest.raises(DataRootError) as err:
            resolve_dataset(ref, roots)
        assert words in str(err.value), (ref, str(err.value))
    with pytest.raises(DataRootError, match="also a path in the worker's working directory"):
        check_hub_name_is_not_local("root", cwd=tmp_path)
    check_hub_name_is_not_local("not-here", cwd=tmp_path)


def test_worker_refuses_a_row_outside_the_roots(client, settings):
    """A calibration row written before the rule (or by hand) names a server file: the worker checks
    again before reading and the job fails with what to set, reading nothing."""
    from backend.deps import launch
    from moelab.store.db import CalibrationSet
    from moelab.store.jobs import new_id

    params = {"source": "hf", "dataset": "/etc/hostname", "split": "train", "config": None, "text_field": "text",
              "task_field": "task", "domain_field": "domain", "samples": None, "seed": 0}
    with client.app.state.db.session() as session:
        row = CalibrationSet(id=new_id("cal"), name="old", origin="hf", params=params)
        session.add(row)
        session.flush()
        job_id = launch(session, client.app.state.queue, row, "calibration_sets", "build_calibration").id
    job = wait_job(client, job_id)
    assert job["state"] == "failed" and job["error_type"] == "invalid_input", job
    assert "outside the directories" in job["error"] and "MOELAB_DATA_ROOTS" in job["error"]
    assert not Path(settings.resolved_artifacts_dir() / "calibration-sets" / row.id).exists()
    assert client.delete(f"/api/v1/calibration-sets/{row.id}").status_code == 200


# ---------------------------------------------------------------------------- "data roots without bypasses"

import os
import shutil
import uuid

from moelab.store.dataroots import (
    OutsideDataRoots,
    http_status,
    inside_roots,
    is_hub_id,
    redact_paths,
    resolve_model_source,
)

from .conftest import REPO


def test_is_hub_id_is_a_pure_string_rule():
    for ok in ("gpt2", "HuggingFaceTB/SmolLM2-135M", "runs/c1", "relmodel", "a_b.c-d/e.f"):
        assert is_hub_id(ok), ok
    for bad in ("./x", "../x", ".x", "/abs", "a/b/c", "a..b", "org/..", "-x", "a b", "a\x00b", "~/x", "x\\y", "", "a/"):
        assert not is_hub_id(bad), bad


def test_resolve_model_source(tmp_path, monkeypatch):
    root = (tmp_path / "root").resolve()
    model = root / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (root / "w.gguf").write_bytes(b"GGUF")
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    (outside / "weights.safetensors").write_bytes(b"x")
    roots = [root]
    assert resolve_model_source("default", roots).kind == "default"
    # Hub-shaped: classified by text alone, even when the working directory holds such a directory
    (tmp_path / "runs" / "c1").mkdir(parents=True)
    (tmp_path / "runs" / "c1" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_source("runs/c1", roots) == resolve_model_source("runs/c1", roots)
    ref = resolve_model_source("runs/c1", roots)
    assert (ref.kind, ref.value) == ("hub", "runs/c1")
    assert resolve_model_source(f" {model} ", roots).value == str(model)
    assert resolve_model_source(str(root / "w.gguf"), roots).kind == "local"
    monkeypatch.setenv("HOME", str(root))
    home = resolve_model_source("~/m", roots)
    assert (home.kind, home.value, home.given) == ("local", str(model), "~/m")
    # a symlinked model directory (or file inside one) pointing out of the roots
    (root / "link").symlink_to(outside)
    (model / "model.safetensors").symlink_to(outside / "weights.safetensors")
    outside_cases = [str(outside), str(root / "link"), str(root / ".." / "secret"), "/etc", "/no/such/model", str(model)]
    for src in outside_cases:
        with pytest.raises(OutsideDataRoots) as err:
            resolve_model_source(src, roots)
        assert http_status(err.value) == 403 and "MOELAB_DATA_ROOTS" in str(err.value), src
        assert str(outside) not in str(err.value) or str(outside) in src, str(err.value)  # a link's target is never named
    (model / "model.safetensors").unlink()
    bad = {"./x": "relative path", "runs/c1/x": "relative path", "../m": "relative path", "x.gguf": "relative path",
           "not a model id!": "Hugging Face id", "a\x00b": "NUL byte", f"{model}\x00": "NUL byte",
           str(root / "nope"): "does not exist", str(model / "config.json"): "not a .gguf"}
    for src, words in bad.items():
        with pytest.raises(DataRootError) as err:
            resolve_model_source(src, roots)
        assert not isinstance(err.value, OutsideDataRoots) and http_status(err.value) == 422, src
        assert words in str(err.value), (src, str(err.value))


def test_dataset_rules_typed_and_symlinks_inside_directories(tmp_path):
    root = (tmp_path / "root").resolve()
    ds = root / "ds"
    ds.mkdir(parents=True)
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"text": "a secret line that must never be served"}\n')
    (ds / "data.jsonl").symlink_to(secret)
    with pytest.raises(OutsideDataRoots, match="data.jsonl"):
        resolve_dataset(str(ds), [root])
    # the word "outside" in a relative string is still bad input (422), not a 403
    with pytest.raises(DataRootError) as err:
        resolve_dataset("outside/x/y", [root])
    assert http_status(err.value) == 422
    with pytest.raises(DataRootError) as err:
        resolve_dataset(f"{ds}\x00", [root])
    assert http_status(err.value) == 422 and "NUL" in str(err.value)
    # a save_to_disk marker naming a file outside
    saved = root / "saved"
    saved.mkdir()
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": str(secret)}]}))
    (saved / "dataset_info.json").write_text("{}")
    with pytest.raises(OutsideDataRoots):
        resolve_dataset(str(saved), [root])


def test_engine_load_hf_dataset_checks_every_file_it_opens(tmp_path):
    from moelab.engine.data.calibration import CalibrationError, CalibrationOutsideRoots, load_hf_dataset

    root = (tmp_path / "root").resolve()
    good = root / "good"
    good.mkdir(parents=True)
    (good / "train.jsonl").write_text('{"text": "a perfectly ordinary sample of calibration text"}\n')
    assert len(load_hf_dataset(str(good), allowed_roots=[root]).samples) == 1
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"text": "a secret line that must never be served"}\n')
    linked = root / "linked"
    linked.mkdir()
    (linked / "data.jsonl").symlink_to(secret)
    with pytest.raises(CalibrationOutsideRoots):
        load_hf_dataset(str(linked), allowed_roots=[root])
    with pytest.raises(CalibrationOutsideRoots):
        load_hf_dataset(str(linked / "data.jsonl"), allowed_roots=[root])
    # a README whose configs name a data file outside the directory (no symlink at all)
    readme = root / "readme"
    readme.mkdir()
    (readme / "train.jsonl").write_text('{"text": "a perfectly ordinary sample of calibration text"}\n')
    (readme / "README.md").write_text(f"---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: {secret}\n---\n")
    with pytest.raises(CalibrationOutsideRoots):
        load_hf_dataset(str(readme), allowed_roots=[root])
    with pytest.raises(CalibrationError, match="NUL"):
        load_hf_dataset(f"{good}\x00", allowed_roots=[root])
    with pytest.raises(CalibrationError, match="relative path"):
        load_hf_dataset("./good", allowed_roots=[root])


def test_engine_never_loads_a_hub_id_from_the_working_directory(tmp_path, monkeypatch, tiny_llama):
    """With allowed_roots (what a service worker uses) 'runs/c1' goes to the Hub even when the working
    directory holds a loadable model of that name; without (the CLI) the local directory is used."""
    from moelab.engine.models import ModelError, load_model

    shutil.copytree(tiny_llama, tmp_path / "runs" / "c1")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    roots = [tiny_llama.parent.resolve()]
    with pytest.raises(ModelError, match="Hugging Face Hub") as err:
        load_model("runs/c1", data_dir=tmp_path, device="cpu", dtype="float32", allowed_roots=roots)
    assert str(tmp_path) not in str(err.value)
    with pytest.raises(ModelError, match="relative path"):
        load_model("./runs/c1", data_dir=tmp_path, device="cpu", dtype="float32", allowed_roots=roots)
    with pytest.raises(ModelError, match="outside"):
        load_model(str(tmp_path / "runs" / "c1"), data_dir=tmp_path, device="cpu", dtype="float32", allowed_roots=roots)
    inside = load_model(str(tiny_llama), data_dir=tmp_path, device="cpu", dtype="float32", allowed_roots=roots)
    assert inside.source == str(tiny_llama.resolve())
    assert load_model("runs/c1", data_dir=tmp_path, device="cpu", dtype="float32").n_layers >= 1  # the CLI: local is fine


def test_streaming_and_moe_loaders_follow_the_service_rule(tmp_path, monkeypatch, tiny_llama):
    """Layer streaming and the MoE loader resolve sources themselves: under ``restrict_sources`` (a
    service worker) they too send 'runs/c1' to the Hub, never to the working directory."""
    from moelab.engine.models import ModelError, restrict_sources
    from moelab.engine.profiling.moe_experts import load_moe_model
    from moelab.engine.streaming.checkpoint import weights_location

    shutil.copytree(tiny_llama, tmp_path / "runs" / "c1")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert weights_location("runs/c1", tmp_path) == Path("runs/c1")  # the CLI: a local directory is fine
    restrict_sources([tiny_llama.parent.resolve()])
    try:
        for load in (lambda: weights_location("runs/c1", tmp_path), lambda: load_moe_model("runs/c1", device="cpu")):
            with pytest.raises(ModelError, match="Hugging Face Hub"):
                load()
        with pytest.raises(ModelError, match="outside"):
            weights_location(str(tmp_path / "runs" / "c1"), tmp_path)
        assert weights_location(str(tiny_llama), tmp_path) == tiny_llama.resolve()
    finally:
        restrict_sources(None)


def test_redact_paths(tmp_path):
    root = tmp_path.resolve()
    text = f"cannot open /root/.cache/hf/x.json or {root}/a.jsonl; see https://huggingface.co/docs or POST /api/v1/jobs/j/retry."
    out = redact_paths(text, [root])
    assert "/root/.cache" not in out and f"{root}/a.jsonl" in out and "https://huggingface.co/docs" in out
    assert "/api/v1/jobs/j/retry" in out


def _absolute_paths_outside(text: str, roots: list[Path]) -> list[str]:
    import re

    found = re.findall(r"(?<![\w.:/\-~])/(?!api/)[^\s'\"()\[\]{},;:<>|*?`\\]+", text)
    return [p for p in found if not inside_roots(p.rstrip("."), roots)]


def test_api_model_sources(client, settings, tiny_llama):
    """Each bypass is a 403 or 422 before queueing, with a message saying what to fix; NUL bytes are 422."""
    roots = settings.resolved_data_roots()
    outside_dir = REPO / "tests"
    cases = [
        ("./my-model", 422, "relative path"), ("runs/c1/x", 422, "relative path"), ("../x", 422, "relative path"),
        ("a\x00b", 422, "source: holds a NUL character"), (f"{tiny_llama}\x00", 422, "NUL character"), (str(outside_dir), 403, "MOELAB_DATA_ROOTS"),
        ("/etc/passwd", 403, "outside the directories"), ("~root/x", 403, "MOELAB_DATA_ROOTS"),
    ]
    for source, status, words in cases:
        r = client.post("/api/v1/models", json={"source": source})
        assert r.status_code == status and words in r.text, (source, r.status_code, r.text)
    r = client.post("/api/v1/calibration-sets", json={"source": "hf", "dataset": "/x\x00y"})
    assert r.status_code == 422 and "dataset: holds a NUL character" in r.text, r.text
    r = client.post("/api/v1/calibration-sets", json={"source": "hf", "dataset": "outside/of/roots"})
    assert r.status_code == 422 and "relative path" in r.text, r.text  # the status is by type, not the word


def test_hub_shaped_source_is_never_loaded_from_the_workers_cwd(client, settings, tiny_llama):
    """'<dir>/c1' exists relative to the worker's working directory (the repo). The API, offline and without
    a cached copy, refuses it naming the Hub (issue 40: no late failure); with a (broken) cached snapshot it is
    queued, and the worker sends it to the Hub cache, never to the local directory."""
    from .helpers import wait_job

    name = f"tmp-dataroots-{uuid.uuid4().hex[:8]}"
    local = REPO / name / "c1"
    shutil.copytree(tiny_llama, local)
    cached = Path(os.environ["HF_HOME"]) / "hub" / f"models--{name}--c1"
    try:
        r = client.post("/api/v1/models", json={"source": f"{name}/c1"})
        assert r.status_code == 422 and "not in this server's Hugging Face cache" in r.text and str(REPO) not in r.text, r.text
        (cached / "snapshots" / ("0" * 40)).mkdir(parents=True)
        (cached / "snapshots" / ("0" * 40) / "README.md").write_text("not a model")
        r = client.post("/api/v1/models", json={"source": f"{name}/c1"})
        assert r.status_code == 202, r.text
        job = wait_job(client, r.json()["job_id"])
        assert job["state"] == "failed" and str(REPO) not in job["error"], job
        body = client.get(f"/api/v1/models/{r.json()['id']}").text
        assert str(REPO) not in body and r.json()["source"] == f"{name}/c1"
        assert not _absolute_paths_outside(body, settings.resolved_data_roots()), body
    finally:
        shutil.rmtree(REPO / name, ignore_errors=True)
        shutil.rmtree(cached, ignore_errors=True)


def test_hub_names_are_refused_at_request_time_when_the_server_cannot_load_them(client, settings):
    """No cached copy and no Hub (this machine has no route to it; HF_HUB_OFFLINE says the same without asking):
    a Hub model id or dataset name is a 422 saying how to make it available, and nothing is stored or queued."""
    from .test_bad_requests import snapshot

    before = snapshot(settings)
    for offline in (None, "1"):
        saved = os.environ.pop("HF_HUB_OFFLINE", None)
        if offline:
            os.environ["HF_HUB_OFFLINE"] = offline
        try:
            r = client.post("/api/v1/models", json={"source": "someone/some-model"})
            assert r.status_code == 422, r.text
            detail = r.json()["detail"]
            assert detail.startswith("source: model 'someone/some-model' is not in this server's Hugging Face cache")
            assert "huggingface-cli download someone/some-model" in detail and "MOELAB_DATA_ROOTS" in detail
            assert ("HF_HUB_OFFLINE is set" in detail) == bool(offline)
            r = client.post("/api/v1/calibration-sets", json={"source": "hf", "dataset": "someone/texts"})
            assert r.status_code == 422 and "--repo-type dataset someone/texts" in r.json()["detail"], r.text
        finally:
            os.environ.pop("HF_HUB_OFFLINE", None)
            if saved is not None:
                os.environ["HF_HUB_OFFLINE"] = saved
    assert snapshot(settings) == before


def test_model_rows_show_no_server_path_outside_the_roots(client, settings, model_id, tiny_llama):
    roots = settings.resolved_data_roots()
    body = client.get(f"/api/v1/models/{model_id}").json()
    assert body["status"] == "ready" and body["info"]["source"] == body["source"]
    assert not _absolute_paths_outside(json.dumps(body), roots), body
    listing = client.get("/api/v1/models").text
    assert not _absolute_paths_outside(listing, roots)


def test_worker_refuses_a_model_row_outside_the_roots(client, settings, tiny_llama, tmp_path):
    """A model row naming a directory outside the roots (written by hand, or before the rule): the
    worker checks again and loads nothing; the job's error names no server path outside the roots."""
    from backend.deps import launch
    from moelab.store.db import Model
    from moelab.store.jobs import new_id

    from .helpers import wait_job

    outside = tmp_path / "elsewhere"
    shutil.copytree(tiny_llama, outside)
    with client.app.state.db.session() as session:
        row = Model(id=new_id("mod"), name="old", source=str(outside), kind="local", trust_remote_code=False, params={})
        session.add(row)
        session.flush()
        job_id = launch(session, client.app.state.queue, row, "models", "inspect_model").id
    job = wait_job(client, job_id)
    assert job["state"] == "failed" and job["error_type"] == "invalid_input", job
    assert "outside the directories" in job["error"] and "MOELAB_DATA_ROOTS" in job["error"], job
    assert client.get(f"/api/v1/models/{row.id}").json()["info"] is None
    assert client.delete(f"/api/v1/models/{row.id}").status_code == 200


def test_symlinked_data_file_in_an_hf_directory_is_refused(client, settings, data_root, tmp_path):
    """An hf directory inside a root whose data.jsonl links outside: 403 at the API, and a row that
    slipped past (inserted directly) fails in the worker; no line of the outside file is ever served."""
    from backend.deps import launch
    from moelab.store.db import CalibrationSet
    from moelab.store.jobs import new_id

    from .helpers import wait_job

    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"text": "TOP-SECRET line from outside the data roots, long enough"}\n')
    ds = data_root / f"linked-{uuid.uuid4().hex[:6]}"
    ds.mkdir()
    (ds / "data.jsonl").symlink_to(secret)
    r = client.post("/api/v1/calibration-sets", json={"source": "hf", "dataset": str(ds)})
    assert r.status_code == 403 and "data.jsonl" in r.text and "MOELAB_DATA_ROOTS" in r.text, r.text
    assert str(tmp_path) not in r.text  # the link's target is not revealed
    params = {"source": "hf", "dataset": str(ds), "split": "train", "config": None, "text_field": "text",
              "task_field": "task", "domain_field": "domain", "samples": None, "seed": 0}
    with client.app.state.db.session() as session:
        row = CalibrationSet(id=new_id("cal"), name="linked", origin="hf", params=params)
        session.add(row)
        session.flush()
        job_id = launch(session, client.app.state.queue, row, "calibration_sets", "build_calibration").id
    job = wait_job(client, job_id)
    assert job["state"] == "failed" and job["error_type"] == "invalid_input" and "outside" in job["error"], job
    assert str(tmp_path) not in job["error"]
    samples = client.get(f"/api/v1/calibration-sets/{row.id}/samples")
    assert samples.status_code == 409 and "TOP-SECRET" not in samples.text
    assert not Path(settings.resolved_artifacts_dir() / "calibration-sets" / row.id).exists()
    assert client.delete(f"/api/v1/calibration-sets/{row.id}").status_code == 200


def test_hf_set_shows_the_users_string(client, settings, data_root):
    from .helpers import succeeded

    d = data_root / f"plain-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(json.dumps({"text": f"Ordinary sample number {i} with enough text."}) + "\n" for i in range(4)))
    r = client.post("/api/v1/calibration-sets", json={"source": "hf", "dataset": f"{d}/"})
    assert r.status_code == 202, r.text
    succeeded(client, r.json())
    body = client.get(f"/api/v1/calibration-sets/{r.json()['id']}").json()
    assert body["params"]["dataset"] == f"{d}/" and body["stats"]["n_samples"] == 4
    assert not _absolute_paths_outside(json.dumps(body), settings.resolved_data_roots())
