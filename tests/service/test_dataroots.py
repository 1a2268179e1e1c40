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
