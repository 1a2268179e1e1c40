"""Deleting resources (409 naming dependants, ?cascade=true, jobs cancelled first, artifacts gone
without leftovers), cancelling inside a long step, and identical concurrent uploads stored once.

Real SQLite file, real Redis, a real worker subprocess (the session fixtures of conftest.py); the
resources deleted here are made here, never the shared session ones.
"""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from .conftest import SMALL_PROFILE
from .helpers import succeeded, wait_idle, wait_job


# A profile that lasts well beyond the polling below on a fast machine (one sample per forward,
# 2,000 forwards): 120 samples in batches of two finished before the test could delete it in CI.
LONG_JOB_SAMPLES = 2000
LONG_JOB_PROFILE = {"max_tokens": 256, "batch_tokens": 256}


def _texts(tag: str, n: int) -> bytes:
    """A .txt upload of ``n`` distinct paragraphs (content unique to this test run)."""
    return "\n\n".join(f"Paragraph {i} of {tag}: a few words about rivers, engines and bread, long enough to keep."
                       for i in range(n)).encode()


def _upload(client, tag: str, n: int = 8) -> str:
    r = client.post("/api/v1/calibration-sets/upload", files={"file": (f"{tag}.txt", _texts(tag, n))})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _artifacts(settings, kind: str) -> list[str]:
    return sorted(p.name for p in (settings.resolved_artifacts_dir() / kind).iterdir())


def _rows(settings, table: str) -> int:
    engine = create_engine(settings.resolved_database_url())
    with engine.connect() as conn:
        n = conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
    engine.dispose()
    return n


def test_cancel_watch_interrupts_a_step_that_never_reports_progress():
    """The worker's watch raises Cancelled inside plain Python work that never calls Progress.update
    (a long engine step), within its poll interval of the request; disarmed, it raises nothing."""
    from workers.cancelwatch import CancelWatch
    from moelab.engine.progress import Cancelled

    asked = threading.Event()
    outcome: dict[str, float | str] = {}

    def step() -> None:
        watch = CancelWatch(asked.is_set, threading.get_ident(), poll_s=0.2)
        watch.start()
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 30:  # a "step" of 30 s with no progress call
                sum(range(1000))
            outcome["result"] = "ran to the end"
        except Cancelled:
            outcome["result"] = "cancelled"
            outcome["after_ask_s"] = time.monotonic() - outcome["asked_at"]  # type: ignore[operator]
        finally:
            try:
                watch.disarm()
            except Cancelled:
                pass
        t1 = time.monotonic()
        while time.monotonic() - t1 < 0.6:  # disarmed: nothing lands any more
            sum(range(1000))
        outcome["after_disarm"] = "quiet"

    worker = threading.Thread(target=step)
    worker.start()
    time.sleep(0.5)
    outcome["asked_at"] = time.monotonic()
    asked.set()
    worker.join(35)
    assert outcome["result"] == "cancelled" and outcome["after_ask_s"] < 1.0, outcome
    assert outcome["after_disarm"] == "quiet"


def test_the_jobs_clean_up_after_a_cancel_is_not_interrupted_and_a_swallowed_cancel_comes_again():
    """Once ``Cancelled`` landed, the job's clean-up (a fine-tune's cancel checkpoint) runs longer than the poll interval
    uninterrupted; a ``Cancelled`` swallowed on the way is raised again after ``refire_s``."""
    from workers.cancelwatch import CancelWatch
    from moelab.engine.progress import Cancelled

    def busy(seconds: float) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            sum(range(1000))

    outcome: dict[str, object] = {}

    def job() -> None:
        watch = CancelWatch(lambda: True, threading.get_ident(), poll_s=0.05, refire_s=1.5)
        watch.start()
        try:
            busy(10)
        except Cancelled:
            t0 = time.monotonic()
            try:
                busy(1.0)  # the clean-up: 20 poll intervals
                outcome["clean_up"] = "finished"
            except Cancelled:
                outcome["clean_up"] = "interrupted"
            try:
                busy(10)  # nobody re-raises: the watch does, after refire_s
            except Cancelled:
                outcome["again_after_s"] = time.monotonic() - t0
        finally:
            try:
                watch.disarm()
            except Cancelled:
                pass

    worker = threading.Thread(target=job)
    worker.start()
    worker.join(20)
    assert outcome["clean_up"] == "finished", outcome
    assert 1.4 <= outcome["again_after_s"] < 5, outcome


def test_a_cancel_delivered_while_disarming_still_disarms_the_watch():
    """A ``Cancelled`` that lands inside ``disarm`` before it takes the lock must not leave the watch armed: it would
    fire into every later job of the worker's thread. disarm finishes, then hands that ``Cancelled`` on."""
    from workers.cancelwatch import CancelWatch
    from moelab.engine.progress import Cancelled

    watch = CancelWatch(lambda: False, threading.get_ident(), poll_s=0.05)
    watch.start()
    lock, entered = watch._lock, []

    class LandsOnFirstEntry:  # the interruption arrives as disarm reaches the lock the first time
        def __enter__(self):
            entered.append(1)
            if len(entered) == 1:
                raise Cancelled("delivered while disarming")
            return lock.__enter__()

        def __exit__(self, *exc):
            return lock.__exit__(*exc)

    watch._lock = LandsOnFirstEntry()
    with pytest.raises(Cancelled, match="while disarming"):
        watch.disarm()
    watch.join(2)
    assert len(entered) == 2 and not watch._armed and not watch.is_alive()


def test_delete_refuses_while_used_then_cascades_the_tree(client, settings, model_id):
    wait_idle(client)
    tag = uuid.uuid4().hex[:8]
    cal = _upload(client, f"tree-{tag}")
    prof = client.post("/api/v1/profiles", json={"model_id": model_id, "calibration_set_id": cal, **SMALL_PROFILE}).json()
    succeeded(client, prof)
    conv = client.post("/api/v1/conversions", json={"profile_id": prof["id"], "expertweaver": {"n_experts": 8, "alpha_max": 0.5}}).json()
    succeeded(client, conv)
    ev = client.post("/api/v1/evaluations", json={"conversion_id": conv["id"], "source": cal, "n_windows": 1, "seq_len": 16,
                                                  "baselines": False, "multiple_choice_per_task": 0}).json()
    succeeded(client, ev)
    before = {k: _artifacts(settings, k) for k in ("calibration-sets", "profiles", "conversions", "evaluations")}
    rows_before = {t: _rows(settings, t) for t in ("calibration_sets", "profiles", "conversions", "evaluations", "jobs")}

    # refused while used, naming what uses it, and nothing changes
    r = client.delete(f"/api/v1/calibration-sets/{cal}")
    assert r.status_code == 409, r.text
    detail = r.json()["detail"]
    assert f"profile {prof['id']}" in detail and f"evaluation {ev['id']}" in detail and "?cascade=true" in detail, detail
    r = client.delete(f"/api/v1/profiles/{prof['id']}")
    assert r.status_code == 409 and f"is used by conversion {conv['id']}" in r.json()["detail"]
    r = client.delete(f"/api/v1/conversions/{conv['id']}")
    assert r.status_code == 409 and f"evaluation {ev['id']}" in r.json()["detail"]
    assert {k: _artifacts(settings, k) for k in before} == before
    assert {t: _rows(settings, t) for t in rows_before} == rows_before

    # cascade: the whole tree, dependants first; the model (read, not reading) stays; job history stays
    r = client.delete(f"/api/v1/calibration-sets/{cal}", params={"cascade": "true"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [(d["type"], d["id"]) for d in out["deleted"]] == [
        ("evaluations", ev["id"]), ("conversions", conv["id"]), ("profiles", prof["id"]), ("calibration_sets", cal)]
    assert out["artifacts_removed"] == 4 and out["cancelled_jobs"] == []
    for path in (f"calibration-sets/{cal}", f"profiles/{prof['id']}", f"conversions/{conv['id']}", f"evaluations/{ev['id']}"):
        got = client.get(f"/api/v1/{path}")
        assert got.status_code == 404 and "no " in got.json()["detail"], path
    assert client.get(f"/api/v1/models/{model_id}").status_code == 200
    assert client.get(f"/api/v1/jobs/{conv['job_id']}").json()["state"] == "succeeded"
    for kind, ident in (("calibration-sets", cal), ("profiles", prof["id"]), ("conversions", conv["id"]), ("evaluations", ev["id"])):
        left = _artifacts(settings, kind)
        assert ident not in left and not [n for n in left if ident in n], (kind, left)  # no trash left behind
        assert client.get(f"/api/v1/artifacts/{kind}/{ident}").status_code == 404
    assert _rows(settings, "jobs") == rows_before["jobs"]
    assert _rows(settings, "evaluations") == rows_before["evaluations"] - 1

    # the upload's content is free again: the same file is stored anew
    again = client.post("/api/v1/calibration-sets/upload", files={"file": (f"tree-{tag}.txt", _texts(f"tree-{tag}", 8))})
    assert again.status_code == 201 and again.json()["id"] != cal
    r = client.delete(f"/api/v1/calibration-sets/{again.json()['id']}")  # nothing uses it: no cascade needed
    assert r.status_code == 200 and r.json()["deleted"] == [{"type": "calibration_sets", "id": again.json()["id"]}]


def test_deleting_a_resource_whose_job_runs_cancels_it_first(client, settings, model_id):
    wait_idle(client)
    cal = _upload(client, f"long-{uuid.uuid4().hex[:8]}", n=LONG_JOB_SAMPLES)
    prof = client.post("/api/v1/profiles", json={"model_id": model_id, "calibration_set_id": cal,
                                                 **LONG_JOB_PROFILE}).json()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until it is inside the profiling loop
        job = client.get(f"/api/v1/jobs/{prof['job_id']}").json()
        if job["state"] == "running" and job["progress"]["stage"] == "profile" and job["progress"]["current"] >= 1:
            break
        assert job["state"] in ("queued", "running"), job
        time.sleep(0.05)
    t0 = time.monotonic()
    r = client.delete(f"/api/v1/profiles/{prof['id']}")
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert r.json()["cancelled_jobs"] == [prof["job_id"]] and took < 5, (r.json(), took)
    job = wait_job(client, prof["job_id"], timeout=5)
    assert job["state"] == "cancelled" and "cancelled on request" in job["error"], job
    assert client.get(f"/api/v1/profiles/{prof['id']}").status_code == 404
    assert not [n for n in _artifacts(settings, "profiles") if prof["id"] in n]  # no artifact, no temporary
    # the worker is fine and the set is free now
    assert client.delete(f"/api/v1/calibration-sets/{cal}").status_code == 200


def test_cancelling_a_running_job_takes_effect_within_5_s(client, model_id):
    wait_idle(client)
    cal = _upload(client, f"cancel-{uuid.uuid4().hex[:8]}", n=LONG_JOB_SAMPLES)
    prof = client.post("/api/v1/profiles", json={"model_id": model_id, "calibration_set_id": cal,
                                                 **LONG_JOB_PROFILE}).json()
    wait_job(client, prof["job_id"], timeout=60, until=("running", "succeeded", "failed", "cancelled"))
    t0 = time.monotonic()
    r = client.delete(f"/api/v1/jobs/{prof['job_id']}")
    assert r.status_code in (200, 202), r.text
    job = wait_job(client, prof["job_id"], timeout=5)
    assert job["state"] == "cancelled" and time.monotonic() - t0 < 5, job
    assert client.delete(f"/api/v1/calibration-sets/{cal}", params={"cascade": "true"}).status_code == 200


@pytest.mark.parametrize("precheck", ["real", "always misses"])
def test_identical_concurrent_uploads_store_one_set(client, settings, monkeypatch, precheck):
    """20 uploads of the same bytes at once: the unique upload key lets one insert win; the other 19
    get that same set with 200 (idempotent, documented), and exactly one artifact is left. With the
    look-up before the insert made to miss every time (all 20 inside the race window), the database's
    unique index alone decides."""
    if precheck == "always misses":
        from backend.routes import calibration_sets as route

        real, seen = route._stored_upload, weakref.WeakSet()

        def first_call_misses(session, store, cset):
            if session in seen:
                return real(session, store, cset)
            seen.add(session)
            return None

        monkeypatch.setattr(route, "_stored_upload", first_call_misses)
    body = _texts(f"same-{uuid.uuid4().hex[:8]}", 6)
    before_rows, before_dirs = _rows(settings, "calibration_sets"), set(_artifacts(settings, "calibration-sets"))

    def upload(_: int):
        r = client.post("/api/v1/calibration-sets/upload", files={"file": ("same.txt", body)})
        return r.status_code, r.json()

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(upload, range(20)))
    codes = sorted(code for code, _ in answers)
    ids = {a["id"] for _, a in answers}
    assert codes == [200] * 19 + [201], codes
    assert len(ids) == 1 and all(a["stats"]["n_samples"] == 6 for _, a in answers)
    assert _rows(settings, "calibration_sets") == before_rows + 1
    assert set(_artifacts(settings, "calibration-sets")) - before_dirs == ids  # the losers' artifacts were removed
    ident = ids.pop()
    assert client.get(f"/api/v1/calibration-sets/{ident}/samples").json()["total"] == 6
    assert client.delete(f"/api/v1/calibration-sets/{ident}").status_code == 200
    assert not Path(settings.resolved_artifacts_dir() / "calibration-sets" / ident).exists()


def test_fine_tune_and_its_result_conversion(client, settings, profile_id):
    """A fine-tune reads its conversion (409 on deleting that conversion, naming the fine-tune); its
    result is a conversion of its own: deleting the result only unlinks it from the fine-tune, and
    deleting the fine-tune removes its work dir and leaves the result conversion standing."""
    wait_idle(client)
    conv = client.post("/api/v1/conversions", json={"profile_id": profile_id, "expertweaver": {"n_experts": 8, "alpha_max": 0.5}}).json()
    succeeded(client, conv)
    small = {"steps": 2, "batch_size": 1, "seq_len": 16, "checkpoint_every": 2, "eval_windows": 1, "source": "builtin:math"}
    ft = [client.post("/api/v1/finetunes", json={"conversion_id": conv["id"], **small}).json() for _ in range(2)]
    for f in ft:
        succeeded(client, f, timeout=180)
    ft = [client.get(f"/api/v1/finetunes/{f['id']}").json() for f in ft]
    results = [f["result_conversion_id"] for f in ft]
    assert all(results)

    r = client.delete(f"/api/v1/conversions/{conv['id']}")
    assert r.status_code == 409 and f"fine-tune {ft[0]['id']}" in r.json()["detail"], r.text

    r = client.delete(f"/api/v1/conversions/{results[0]}")
    assert r.status_code == 200 and r.json()["deleted"] == [{"type": "conversions", "id": results[0]}]
    unlinked = client.get(f"/api/v1/finetunes/{ft[0]['id']}").json()
    assert unlinked["result_conversion_id"] is None and unlinked["summary"]["result_conversion_id"] is None

    r = client.delete(f"/api/v1/finetunes/{ft[1]['id']}")
    assert r.status_code == 200 and r.json()["artifacts_removed"] == 1
    assert not (settings.resolved_artifacts_dir() / "finetunes" / ft[1]["id"]).exists()
    assert client.get(f"/api/v1/conversions/{results[1]}").json()["status"] == "ready"
    assert client.get(f"/api/v1/artifacts/conversions/{results[1]}").status_code == 200

    r = client.delete(f"/api/v1/conversions/{conv['id']}", params={"cascade": "true"})
    assert r.status_code == 200, r.text
    assert {(d["type"], d["id"]) for d in r.json()["deleted"]} == {("finetunes", ft[0]["id"]), ("conversions", conv["id"])}
    for ident in (conv["id"], results[0]):
        assert client.get(f"/api/v1/conversions/{ident}").status_code == 404
    assert client.delete(f"/api/v1/conversions/{results[1]}").status_code == 200


def test_a_resource_deleted_under_a_create_request_answers_409(client, settings, model_id, monkeypatch):
    """A calibration set deleted between a POST /profiles' look-up and its insert: the foreign key
    refuses the insert, and the client gets 409 saying what happened (not a 500), with nothing stored."""
    from backend.routes import profiles as route
    from moelab.store.db import CalibrationSet

    wait_idle(client)
    cal = _upload(client, f"gone-{uuid.uuid4().hex[:8]}")
    real = route.lookup

    def lookup_then_lose_it(session, table, ident, what, listing):
        row = real(session, table, ident, what, listing)
        if table is CalibrationSet:
            assert client.delete(f"/api/v1/calibration-sets/{ident}").status_code == 200  # another client, meanwhile
        return row

    monkeypatch.setattr(route, "lookup", lookup_then_lose_it)
    rows = {t: _rows(settings, t) for t in ("profiles", "jobs")}
    r = client.post("/api/v1/profiles", json={"model_id": model_id, "calibration_set_id": cal, **SMALL_PROFILE})
    assert r.status_code == 409 and "deleted or created meanwhile" in r.json()["detail"], r.text
    assert {t: _rows(settings, t) for t in rows} == rows


def test_concurrent_deletes_of_one_resource_do_not_wait_on_the_first(client, settings, monkeypatch):
    """Eight DELETEs of one resource at once: one deletes it (waiting, here, as on a running job
    that must stop first), the other seven answer 202 "being deleted" at once instead of holding
    seven more API threads for the whole wait; afterwards it is gone (404)."""
    from backend import deletion

    cal = _upload(client, f"racing-{uuid.uuid4().hex[:8]}")
    release, entered = threading.Event(), threading.Event()
    real_wait = deletion._wait_ended

    def slow_wait(session, job_ids, wait_s):  # the first DELETE holds on until the others have answered
        entered.set()
        release.wait(20)
        return real_wait(session, job_ids, wait_s)

    monkeypatch.setattr(deletion, "_wait_ended", slow_wait)

    def delete(_: int) -> tuple[int, str, float]:
        t0 = time.monotonic()
        r = client.delete(f"/api/v1/calibration-sets/{cal}")
        return r.status_code, r.json().get("detail", ""), time.monotonic() - t0

    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(delete, 0)
        assert entered.wait(10), "the first DELETE never reached its wait"
        others = [pool.submit(delete, i) for i in range(1, 8)]
        answers = [f.result(timeout=10) for f in others]  # they must not wait on the first
        assert not first.done()  # ... which is still deleting
        release.set()
        code, _, _ = first.result(timeout=30)
    assert code == 200
    assert [a[0] for a in answers] == [202] * 7, answers
    assert all(took < 3 for _, _, took in answers), answers
    assert all(f"calibration set {cal} is being deleted by another request" in d and f"/calibration-sets/{cal}" in d
               for _, d, _ in answers), answers
    assert client.get(f"/api/v1/calibration-sets/{cal}").status_code == 404
    assert client.delete(f"/api/v1/calibration-sets/{cal}").status_code == 404  # the guard is released
    assert not [n for n in _artifacts(settings, "calibration-sets") if cal in n]
