"""Recovery fine-tuning through HTTP with a real worker: create → the job runs → the live log
has steps → succeeded → the fine-tuned model is a conversion that evaluates like any other;
cancel mid-run and re-run continues from the checkpoint; bad input is a 4xx that says what to fix."""

from __future__ import annotations

import time

import pytest

from .helpers import succeeded, wait_idle, wait_job

# a handful of short steps on the tiny model: seconds, not minutes (builtin:math builds in 0.1 s, mixed in 1 s)
SMALL = {"steps": 4, "batch_size": 1, "seq_len": 16, "checkpoint_every": 2, "eval_windows": 1, "source": "builtin:math"}


def _create(client, conversion_id: str, **params) -> dict:
    r = client.post("/api/v1/finetunes", json={"conversion_id": conversion_id, **SMALL, **params})
    assert r.status_code == 202, r.text
    return r.json()


def _log(client, finetune_id: str, **params) -> dict:
    r = client.get(f"/api/v1/finetunes/{finetune_id}/log", params=params)
    assert r.status_code == 200, r.text
    return r.json()


# --------------------------------------------------------------------------- the log's thinning (pure)


def test_long_logs_are_thinned_to_bucket_means_keeping_the_last_step():
    from backend.routes.finetunes import thin_steps

    steps = [{"step": i, "loss": float(i), "ntp_loss": float(i), "aux_loss": None if i % 2 else 1.0, "lr": 0.1,
              "tokens": 10 * i, "elapsed_s": 0.5 * i} for i in range(1, 11)]
    same, aggregated = thin_steps(steps, 10)
    assert same is steps and not aggregated
    out, aggregated = thin_steps(steps, 4)  # buckets of 3: {1,2,3} {4,5,6} {7,8,9} {10}
    assert aggregated and [s["step"] for s in out] == [3, 6, 9, 10]
    assert [s["loss"] for s in out] == [2.0, 5.0, 8.0, 10.0]
    assert [s["aux_loss"] for s in out] == [1.0, 1.0, 1.0, 1.0]  # missing values do not count as zeros
    assert [s["tokens"] for s in out] == [30, 60, 90, 100] and out[-1]["elapsed_s"] == 5.0
    only_odd, _ = thin_steps([s for s in steps if s["step"] % 2], 2)  # no aux loss at all in a bucket stays missing
    assert [s["aux_loss"] for s in only_odd] == [None, None]


# --------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def cancelled_conversion_id(settings, profile_id) -> str:
    """A conversion whose only job was cancelled before it started (the real job state machine)."""
    from moelab.store import jobs
    from moelab.store.db import Conversion, Database

    db = Database(settings.resolved_database_url())
    with db.session() as session:
        row = Conversion(id=jobs.new_id("conv"), profile_id=profile_id, params={"allocation": {"method": "cmoe"}})
        session.add(row)
        row.job = jobs.new_job(session, "conversion", "gpu", "conversions", row.id)
        session.commit()
        jobs.request_cancel(session, row.job)
        ident = row.id
    db.dispose()
    return ident


@pytest.mark.parametrize("body, status, words", [
    ({"conversion_id": "conv-0000000000000000"}, 404, "GET /api/v1/conversions"),
    ({"steps": 0}, 422, "steps: Input should be greater than or equal to 1"),
    ({"lr": -1}, 422, "lr: Input should be greater than 0"),
    ({"mode": "lora"}, 422, "mode: Input should be 'expertweaver', 'cmoe', 'dense2moe' or 'midas'"),
    ({"source": "builtin:poetry"}, 422, "unknown built-in set 'builtin:poetry'"),
    ({"source": "cal-0000000000000000"}, 422, "neither builtin:NAME nor the id of a stored calibration set"),
    ({"stepz": 5}, 422, "stepz: unknown field"),
    ({"distill": 1.5}, 422, "distill: Input should be less than or equal to 1"),
])
def test_bad_requests_say_what_to_fix(client, conversion_id, body, status, words):
    before = client.get("/api/v1/finetunes").json()["total"]
    r = client.post("/api/v1/finetunes", json={"conversion_id": conversion_id, **body})
    assert r.status_code == status and words in r.json()["detail"], r.text
    assert client.get("/api/v1/finetunes").json()["total"] == before  # nothing stored, nothing queued


def test_a_conversion_without_a_result_is_409(client, cancelled_conversion_id):
    r = client.post("/api/v1/finetunes", json={"conversion_id": cancelled_conversion_id})
    assert r.status_code == 409, r.text
    assert "has no usable result" in r.json()["detail"] and "/retry" in r.json()["detail"]


def test_bigbench_text_needs_the_set_installed(client, settings, conversion_id):
    from moelab.engine.data.builtin import bigbench_installed

    if bigbench_installed(settings.data_dir):
        pytest.skip("BIG-bench is installed in this data dir: there is nothing to refuse")
    r = client.post("/api/v1/finetunes", json={"conversion_id": conversion_id, "source": "builtin:bigbench"})
    assert r.status_code == 409 and "moelab data install bigbench" in r.json()["detail"], r.text


def test_unknown_finetune_is_404(client):
    for path in ("/api/v1/finetunes/ft-0000000000000000", "/api/v1/finetunes/ft-0000000000000000/log"):
        r = client.get(path)
        assert r.status_code == 404 and "GET /api/v1/finetunes" in r.json()["detail"], r.text
    assert client.get("/api/v1/finetunes/x/log", params={"max_points": 1}).status_code == 422


def test_api_defaults_are_the_engines():
    from typing import get_args

    from backend.schemas import FinetuneCreate, FinetuneMode
    from moelab.engine.training.params import MODES, FinetuneParams

    assert set(get_args(FinetuneMode)) == set(MODES)

    api = FinetuneCreate(conversion_id="conv-0000000000000000").model_dump(exclude={"conversion_id", "mode"})
    engine = FinetuneParams().to_dict()
    engine.pop("mode")
    assert api == engine


@pytest.mark.parametrize("body, words", [
    ({"mode": "cmoe", "lora_rank": 0}, "mode 'cmoe' trains LoRA adapters: use lora_rank ≥ 1"),
])
def test_the_engines_own_checks_are_422_with_its_message(client, conversion_id, body, words):
    r = client.post("/api/v1/finetunes", json={"conversion_id": conversion_id, **body})
    assert r.status_code == 422 and r.json()["detail"].startswith("fine-tuning: ") and words in r.json()["detail"], r.text


# --------------------------------------------------------------------------- a run, its log and its result


@pytest.fixture(scope="module")
def finetuned(client, conversion_id) -> dict:
    wait_idle(client)
    created = _create(client, conversion_id)  # no mode: the conversion's method decides
    first = _log(client, created["id"])
    assert first["steps"] == [] and first["n_steps"] == 0 and first["total_steps"] == SMALL["steps"]  # before the first step
    succeeded(client, created, timeout=180)
    return created


def test_finetune_job_logs_steps_and_publishes_a_conversion(client, conversion_id, finetuned):
    assert finetuned["params"]["mode"] == "expertweaver" and finetuned["job"]["kind"] == "finetune"
    ft = client.get(f"/api/v1/finetunes/{finetuned['id']}").json()
    s = ft["summary"]
    assert ft["status"] == "ready" and s["steps"] == SMALL["steps"] and s["tokens"] == SMALL["steps"] * 1 * 16
    assert all(s[k] > 1 for k in ("perplexity_before", "perplexity_after", "dense_perplexity"))
    assert "model" not in s and "params" not in s  # no server paths in the API's summary

    log = _log(client, finetuned["id"])
    assert log["state"] == "succeeded" and log["status"] == "done" and log["mode"] == "expertweaver" and not log["aggregated"]
    assert [st["step"] for st in log["steps"]] == list(range(1, SMALL["steps"] + 1)) and log["resumed_at"] == []
    assert all(st["loss"] > 0 and st["aux_loss"] is not None for st in log["steps"])  # EW Eq. 12 runs on softmax routers
    assert log["perplexity_after"] == pytest.approx(s["perplexity_after"]) and log["result_conversion_id"] == ft["result_conversion_id"]
    thinned = _log(client, finetuned["id"], max_points=3)  # buckets of 2 steps
    assert thinned["aggregated"] and [st["step"] for st in thinned["steps"]] == [2, 4] and thinned["n_steps"] == 4
    assert thinned["steps"][0]["loss"] == pytest.approx((log["steps"][0]["loss"] + log["steps"][1]["loss"]) / 2)

    result = client.get(f"/api/v1/conversions/{ft['result_conversion_id']}").json()
    parent = client.get(f"/api/v1/conversions/{conversion_id}").json()
    assert result["status"] == "ready" and result["job_id"] == ft["job_id"]
    assert (result["method"], result["profile_id"], result["model_id"]) == (parent["method"], parent["profile_id"], parent["model_id"])
    assert result["params"] == {**parent["params"], "finetune_of": conversion_id, "finetune_id": ft["id"]}
    assert result["summary"]["finetuned"] and result["summary"]["perplexity_after"] == pytest.approx(s["perplexity_after"])
    assert len(result["layers"]) == len(parent["layers"])
    files = {f["path"] for f in client.get(f"/api/v1/artifacts/conversions/{result['id']}").json()["files"]}
    assert {"config.json", "model.safetensors", "conversion.json", "modeling_moelab.py"} <= files
    record = client.get(f"/api/v1/artifacts/conversions/{result['id']}/files/conversion.json").json()
    assert record["finetune"]["steps"] == SMALL["steps"]

    assert [f["id"] for f in client.get("/api/v1/finetunes", params={"conversion_id": conversion_id}).json()["items"]][0] == ft["id"]
    assert client.get("/api/v1/finetunes", params={"conversion_id": result["id"]}).json()["total"] == 0
    assert ft["job_id"] in [j["id"] for j in client.get("/api/v1/jobs", params={"kind": "finetune"}).json()["items"]]


def test_the_finetuned_conversion_evaluates_like_any_other(client, finetuned):
    result_id = client.get(f"/api/v1/finetunes/{finetuned['id']}").json()["result_conversion_id"]
    r = client.post("/api/v1/evaluations", json={"conversion_id": result_id, "n_windows": 2, "seq_len": 32, "baselines": False,
                                                 "multiple_choice_per_task": 0})
    assert r.status_code == 202, r.text
    succeeded(client, r.json())
    variants = client.get(f"/api/v1/evaluations/{r.json()['id']}").json()["summary"]["variants"]
    assert variants["converted"]["perplexity"] > 1 and variants["dense"]["perplexity_ratio"] == 1.0
    heat = client.get(f"/api/v1/conversions/{result_id}/charts/routing", params={"evaluation_id": r.json()["id"]})
    assert heat.status_code == 200 and heat.json()["layers"], heat.text


# --------------------------------------------------------------------------- cancel, then resume


def _wait_steps(client, finetune_id: str, n: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = _log(client, finetune_id)
        assert log["state"] in ("queued", "running"), log
        if log["n_steps"] >= n:
            return log
        time.sleep(0.05)
    raise AssertionError(f"fine-tune {finetune_id} did not log {n} steps in {timeout} s")


def test_cancel_mid_run_then_rerun_resumes_from_the_checkpoint(client, settings, conversion_id):
    wait_idle(client)
    steps = 20  # enough that the cancel lands mid-run: a step of the tiny model takes ≥ 0.1 s, the cancel ≤ 0.5 s
    created = _create(client, conversion_id, steps=steps, checkpoint_every=4)
    live = _wait_steps(client, created["id"], 3)
    assert live["state"] == "running" and live["status"] == "training" and live["n_steps"] < steps  # read mid-run
    job = client.get(f"/api/v1/jobs/{created['job_id']}").json()
    assert job["progress"]["stage"] == "train" and job["progress"]["total"] == steps

    assert client.delete(f"/api/v1/jobs/{created['job_id']}").status_code == 202
    assert wait_job(client, created["job_id"], timeout=60)["state"] == "cancelled"
    before = _log(client, created["id"])
    k = before["n_steps"]
    assert before["state"] == "cancelled" and before["status"] == "cancelled" and 3 <= k < steps
    ft = client.get(f"/api/v1/finetunes/{created['id']}").json()
    assert ft["status"] == "cancelled" and ft["result_conversion_id"] is None
    work = settings.resolved_artifacts_dir() / "finetunes" / created["id"]
    assert (work / "checkpoints").is_dir() and not (work / "model").exists()

    r = client.post(f"/api/v1/jobs/{created['job_id']}/retry")
    assert r.status_code == 202 and r.json()["retry_of"] == created["job_id"], r.text
    assert wait_job(client, r.json()["id"], timeout=180)["state"] == "succeeded"
    after = _log(client, created["id"])
    assert after["resumed_at"] == [k]  # the cancel checkpointed its last step; the re-run started there
    assert [st["step"] for st in after["steps"]] == list(range(1, steps + 1))
    assert after["steps"][:k] == before["steps"]  # the first run's steps are kept as measured, not re-run
    assert after["perplexity_before"] == before["perplexity_before"]
    ft = client.get(f"/api/v1/finetunes/{created['id']}").json()
    assert ft["status"] == "ready" and ft["job_id"] == r.json()["id"] and ft["result_conversion_id"]
    history = client.get("/api/v1/jobs", params={"resource_id": created["id"]}).json()["items"]
    assert [j["state"] for j in history] == ["succeeded", "cancelled"]


def test_a_distilled_run_mixes_the_dense_teachers_kl_into_its_loss(client, conversion_id):
    """distill 0.5 through the service: the worker loads the dense model the conversion names as the teacher, and
    every logged step's loss is (1 − w)·L_NTP + w·L_KD + λ·L_LB (EW Eq. 12, λ = 0.01 by default)."""
    wait_idle(client)
    created = _create(client, conversion_id, steps=2, distill=0.5)
    assert created["params"]["distill"] == 0.5
    succeeded(client, created, timeout=180)
    steps = _log(client, created["id"])["steps"]
    assert len(steps) == 2 and all(st["kd_loss"] is not None and st["kd_loss"] > -1e-6 for st in steps)
    for st in steps:
        assert st["loss"] == pytest.approx(0.5 * st["ntp_loss"] + 0.5 * st["kd_loss"] + 0.01 * st["aux_loss"], rel=1e-5)
