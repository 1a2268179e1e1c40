"""Downstream accuracy through the service: GET /tasks, an evaluation with lm-eval tasks (a built-in one and a task
directory inside the data roots) run by the real worker, the paper-style table export, and the refusals made at
request time (unknown task, a task directory outside the roots, lm-eval data this server cannot reach)."""

from __future__ import annotations

import json

import pytest

from .helpers import succeeded

API = "/api/v1"


@pytest.fixture(scope="module")
def task_dir(data_root):
    d = data_root / "my-tasks"
    d.mkdir(parents=True, exist_ok=True)
    rows = [{"q": f"{a} plus {b} is", "choices": [str(a + b), str(a + b + 1)], "label": 0} for a, b in [(1, 2), (3, 4)]]
    (d / "sums.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (d / "sums.yaml").write_text(
        "task: api_sums\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " + str(d / "sums.jsonl") + "\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n")
    return d


def test_the_task_list_names_the_builtin_and_the_directorys_tasks(client, task_dir):
    listed = client.get(f"{API}/tasks").json()
    assert [t["name"] for t in listed["items"]] == ["moelab_chat_qa", "moelab_lastword", "moelab_math_qa", "moelab_humaneval",
                                                    "moelab_bigbench_mc"]
    assert listed["items"][-1]["needs"] == "moelab data install bigbench"
    with_dir = client.get(f"{API}/tasks", params={"task_dir": str(task_dir)}).json()["items"]
    assert {"name": "api_sums", "source": "task_dir", "offline": True, "domain": None, "needs": None} in with_dir
    everything = client.get(f"{API}/tasks", params={"registry": "true"}).json()
    assert everything["total"] > 1000 and {"name": "arc_easy", "source": "lm-eval", "offline": False, "domain": None, "needs": None} in everything["items"]
    r = client.get(f"{API}/tasks", params={"task_dir": "/etc"})
    assert r.status_code == 422 and "outside MOELAB_DATA_ROOTS" in r.json()["detail"]


@pytest.mark.parametrize("body, status, words", [
    ({"tasks": ["no_such_task"]}, 422, "unknown task(s) no_such_task"),
    ({"tasks": ["arc_easy"]}, 422, "task 'arc_easy' cannot load its data here"),
    ({"tasks": ["bad name!"]}, 422, "tasks"),
    ({"tasks": ["moelab_chat_qa"], "task_dir": "/etc"}, 422, "outside MOELAB_DATA_ROOTS"),
    ({"tasks": ["moelab_chat_qa"], "task_dir": "relative/dir"}, 422, "absolute path"),
    ({"tasks": ["moelab_chat_qa"], "limit": 0}, 422, "limit"),
    ({"tasks": ["moelab_chat_qa"], "num_fewshot": 65}, 422, "num_fewshot"),
])
def test_bad_task_requests_are_refused_before_queueing(client, conversion_id, body, status, words):
    before = client.get(f"{API}/evaluations").json()["total"]
    r = client.post(f"{API}/evaluations", json={"conversion_id": conversion_id, "n_windows": 2, "seq_len": 16, "baselines": False,
                                                **body})
    assert r.status_code == status and words in json.dumps(r.json()), r.text
    assert client.get(f"{API}/evaluations").json()["total"] == before


def test_an_evaluation_with_tasks_stores_accuracy_per_model_and_exports_the_table(client, conversion_id, task_dir):
    r = client.post(f"{API}/evaluations", json={
        "conversion_id": conversion_id, "n_windows": 2, "seq_len": 16, "baselines": True, "multiple_choice_per_task": 0,
        "tasks": ["moelab_chat_qa", "api_sums"], "limit": 6, "num_fewshot": 1, "task_dir": str(task_dir)})
    assert r.status_code == 202, r.text
    succeeded(client, r.json(), timeout=600)
    ev = client.get(f"{API}/evaluations/{r.json()['id']}").json()
    tasks = ev["summary"]["tasks"]
    assert ev["summary"]["task_settings"] == {"tasks": ["moelab_chat_qa", "api_sums"], "num_fewshot": 1, "limit": 6,
                                              "task_dir": str(task_dir)}
    assert set(tasks["moelab_chat_qa"]) >= {"dense", "converted", "abstopk", "teal"}  # the baselines too
    for variant, m in tasks["moelab_chat_qa"].items():
        assert m["n"] == 6 and m["num_fewshot"] == 1 and 0 <= m["acc"] <= 1 and m["acc_stderr"] is not None, variant
    assert tasks["api_sums"]["dense"]["n"] == 2
    table = client.get(f"{API}/evaluations/{ev['id']}/tasks-table", params={"format": "csv"})
    assert table.status_code == 200 and table.headers["content-type"].startswith("text/csv")
    lines = table.text.splitlines()
    assert lines[0] == "model,moelab_chat_qa,api_sums"
    dense = tasks["moelab_chat_qa"]["dense"]
    assert lines[1].startswith(f"dense,{100 * dense['acc']:.1f} ± {100 * dense['acc_stderr']:.1f},")
    md = client.get(f"{API}/evaluations/{ev['id']}/tasks-table").text
    assert md.startswith("| model | moelab_chat_qa | api_sums |\n|---|---|---|\n| dense |")


def test_the_table_of_an_evaluation_without_tasks_is_409(client, conversion_id):
    r = client.post(f"{API}/evaluations", json={"conversion_id": conversion_id, "n_windows": 2, "seq_len": 16, "baselines": False,
                                                "multiple_choice_per_task": 0})
    succeeded(client, r.json())
    t = client.get(f"{API}/evaluations/{r.json()['id']}/tasks-table")
    assert t.status_code == 409 and "ran no tasks" in t.json()["detail"]
