"""The SQL store (job state machine, additive migration, SQLite and Postgres), the artifact
store's id-only paths, and the worker's model cache."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import IntegrityError

from moelab.store import jobs
from moelab.store.artifacts import ArtifactMissing, ArtifactStore
from moelab.store.db import SCHEMA_VERSION, CalibrationSet, Database, Job, Model, Profile, migrate, utcnow
from workers.model_cache import ModelCache


def _state_machine(db: Database) -> None:
    with db.session() as s:
        row = Model(id=jobs.new_id("mod"), name="m", source="default", kind="default")
        s.add(row)
        job = jobs.new_job(s, "inspect_model", "cpu", "models", row.id)
        row.job = job
        other = jobs.new_job(s, "inspect_model", "cpu", "models", row.id)
    with db.session() as s:
        assert jobs.claim(s, job.id, "w1") and not jobs.claim(s, job.id, "w2")  # one claim wins
        jobs.record_progress(s, job.id, "load model", 1, 2)
        j = s.get(Job, job.id)
        assert (j.state, j.stage, j.current, j.total, j.worker) == ("running", "load model", 1, 2, "w1")
        j = jobs.request_cancel(s, j)
        assert j.state == "running" and jobs.cancel_requested(s, job.id)
        assert jobs.running_with_cancel(s, job.id) == (True, True)  # the worker's watch interrupts it
        assert jobs.finish(s, job.id, jobs.CANCELLED, error="stop") and not jobs.finish(s, job.id, jobs.FAILED)
        # ended: a watch that outlived its job never interrupts the worker's next work
        assert jobs.running_with_cancel(s, job.id) == (False, True)
        assert jobs.running_with_cancel(s, "job-none") == (False, False)
        o = jobs.request_cancel(s, s.get(Job, other.id))  # queued: cancelled at once, never claimable
        assert o.state == "cancelled" and not jobs.claim(s, other.id, "w1")
    with db.session() as s:
        stale = jobs.new_job(s, "profile", "gpu", "profiles", "pr-x")
        fresh = jobs.new_job(s, "profile", "gpu", "profiles", "pr-y")
    with db.session() as s:
        assert jobs.claim(s, stale.id, "w9") and jobs.claim(s, fresh.id, "w9")
        s.get(Job, stale.id).heartbeat_at = utcnow() - timedelta(seconds=100)
        s.commit()
        assert jobs.reap_stale(s, timeout_s=30) == [stale.id]
        j = s.get(Job, stale.id)
        s.refresh(j)
        assert j.state == "failed" and j.error_type == "worker_lost" and "heartbeats" in j.error
        assert jobs.fail_orphans_of(s, "w9") == [fresh.id]


def test_job_state_machine_on_sqlite(tmp_path):
    db = Database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    _state_machine(db)
    db.dispose()


def test_migration_adds_missing_columns(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    engine = create_engine(url)
    with engine.begin() as conn:  # an older schema: models without 'summary' and 'trust_remote_code'
        conn.execute(text("CREATE TABLE models (id VARCHAR(40) PRIMARY KEY, created_at DATETIME, params JSON, "
                          "job_id VARCHAR(40), name VARCHAR(200), source VARCHAR(1000), kind VARCHAR(16))"))
        conn.execute(text("INSERT INTO models (id, name, source, kind, params) VALUES ('mod-old', 'old', 'default', 'default', '{}')"))
    migrate(engine)
    migrate(engine)  # idempotent
    cols = {c["name"] for c in inspect(engine).get_columns("models")}
    assert {"summary", "trust_remote_code"} <= cols and "jobs" in inspect(engine).get_table_names()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT name, trust_remote_code FROM models")).one() == ("old", 0)
        assert conn.execute(text("SELECT value FROM moelab_meta")).scalar() == str(SCHEMA_VERSION)


def test_migration_makes_conversion_profile_optional_and_keeps_rows(tmp_path):
    """Schema 1 -> 2 on SQLite: conversions.profile_id loses NOT NULL (hierarchical conversions have
    no profile) by a table rebuild that keeps every conversion and the evaluations pointing at them."""
    url = f"sqlite:///{tmp_path / 'v1.sqlite'}"
    db = Database(url)
    with db.session() as s:
        s.add(Model(id="mod-1", name="m", source="default", kind="default"))
        s.add(CalibrationSet(id="cal-1", name="c", origin="builtin"))
        s.add(Profile(id="prof-1", model_id="mod-1", calibration_set_id="cal-1"))
    engine = db.engine
    with engine.begin() as conn:  # turn the fresh schema back into schema 1
        conn.execute(text("DROP TABLE conversions"))
        conn.execute(text(
            "CREATE TABLE conversions (id VARCHAR(40) PRIMARY KEY, created_at DATETIME, params JSON, summary JSON, "
            "job_id VARCHAR(40) REFERENCES jobs(id), profile_id VARCHAR(40) NOT NULL REFERENCES profiles(id))"
        ))
        conn.execute(text("UPDATE moelab_meta SET value = '1' WHERE key = 'schema_version'"))
        conn.execute(text("INSERT INTO conversions (id, created_at, profile_id, params) VALUES "
                          "('conv-1', '2026-11-20 10:00:00.000000', 'prof-1', '{\"router\": \"paper\"}')"))
        conn.execute(text("INSERT INTO evaluations (id, created_at, conversion_id, params) VALUES "
                          "('eval-1', '2026-11-20 10:00:00.000000', 'conv-1', '{}')"))
    db.dispose()
    db = Database(url)
    db.init()
    cols = {c["name"]: c for c in inspect(db.engine).get_columns("conversions")}
    assert cols["profile_id"]["nullable"] and "model_id" in cols
    with db.engine.begin() as conn:
        assert conn.execute(text("SELECT id, profile_id, params FROM conversions")).one() == ("conv-1", "prof-1", '{"router": "paper"}')
        assert conn.execute(text("SELECT conversion_id FROM evaluations")).scalar() == "conv-1"
        assert conn.execute(text("PRAGMA foreign_key_check")).all() == []
        assert conn.execute(text("SELECT value FROM moelab_meta")).scalar() == str(SCHEMA_VERSION)
        conn.execute(text("INSERT INTO conversions (id, created_at, model_id, params) VALUES "
                          "('conv-2', '2026-11-20 10:00:00.000000', 'mod-1', '{}')"))
    db.dispose()


def test_migration_to_unique_upload_keys_keeps_duplicates_of_old(tmp_path):
    """Schema 2 -> 3: a database holding the duplicate uploads the old check-then-insert let through
    keeps every row; the oldest upload of each content gets the unique key, and from then on the
    database refuses a second row with that key (what makes concurrent identical uploads store one)."""
    url = f"sqlite:///{tmp_path / 'v2.sqlite'}"
    db = Database(url)
    db.init()
    with db.engine.begin() as conn:  # back to schema 2: no upload_key column, no index
        conn.execute(text("DROP INDEX uq_calibration_sets_upload_key"))
        conn.execute(text("ALTER TABLE calibration_sets DROP COLUMN upload_key"))
        conn.execute(text("UPDATE moelab_meta SET value = '2' WHERE key = 'schema_version'"))
        for ident, created, content in [("cal-b", "10:00:02", "cs-1"), ("cal-a", "10:00:01", "cs-1"),
                                        ("cal-c", "10:00:03", "cs-1"), ("cal-d", "10:00:04", "cs-2"),
                                        ("cal-e", "10:00:05", None)]:
            conn.execute(text("INSERT INTO calibration_sets (id, created_at, params, name, origin, content_id) VALUES "
                              f"(:i, '2026-11-20 {created}.000000', '{{}}', 'n', 'upload', :c)"), {"i": ident, "c": content})
        conn.execute(text("INSERT INTO calibration_sets (id, created_at, params, name, origin, content_id) VALUES "
                          "('cal-h', '2026-11-20 09:00:00.000000', '{}', 'n', 'hf', 'cs-2')"))
    db.dispose()
    for _ in range(2):  # idempotent
        db = Database(url)
        db.init()
        db.dispose()
    with db.engine.begin() as conn:
        keys = dict(conn.execute(text("SELECT id, upload_key FROM calibration_sets")).all())
        assert keys == {"cal-a": "cs-1", "cal-b": None, "cal-c": None, "cal-d": "cs-2", "cal-e": None, "cal-h": None}
        assert conn.execute(text("SELECT value FROM moelab_meta")).scalar() == str(SCHEMA_VERSION) == "5"
    with pytest.raises(IntegrityError):
        with db.engine.begin() as conn:
            conn.execute(text("INSERT INTO calibration_sets (id, created_at, params, name, origin, content_id, upload_key) "
                              "VALUES ('cal-x', '2026-11-21 00:00:00.000000', '{}', 'n', 'upload', 'cs-1', 'cs-1')"))
    db.dispose()


def test_artifact_remove_is_one_rename_then_delete(tmp_path):
    """A removed artifact stops existing at the rename; a crash after it leaves only a temporary
    sibling that cleanup() deletes at the next start, never a half-deleted artifact that reads as one."""
    store = ArtifactStore(tmp_path)
    store.ensure()
    ident = jobs.new_id("pr")
    (store.path("profiles", ident) / "sub").mkdir(parents=True)
    (store.path("profiles", ident) / "sub" / "x.bin").write_bytes(b"x" * 10)
    assert store.remove("profiles", ident) and not store.exists("profiles", ident) and not store.remove("profiles", ident)
    assert list((tmp_path / "profiles").iterdir()) == []
    # a crash between rename and delete: the leftover is invisible to readers and cleaned at start
    leftover = tmp_path / "profiles" / f".{ident}.tmp-trash-0123abcd"
    (leftover / "sub").mkdir(parents=True)
    old_zip = tmp_path / ".uploads" / "zip-0123456789abcdef.zip"  # what older versions left per download
    old_zip.write_bytes(b"PK")
    fresh = tmp_path / ".uploads" / "up-0123456789abcdef.jsonl"  # an upload being parsed right now
    fresh.write_bytes(b"{}")
    stale = tmp_path / ".uploads" / "up-fedcba9876543210.txt"
    stale.write_bytes(b"x")
    os.utime(stale, (0, 1_000_000))
    assert store.cleanup() == 3
    assert not leftover.exists() and not old_zip.exists() and not stale.exists() and fresh.exists()


def _postgres_url() -> str | None:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return None
    url = os.environ.get("MOELAB_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
    try:
        create_engine(url, connect_args={"connect_timeout": 2}).connect().close()
    except Exception:
        return None
    return url


@contextmanager
def fresh_postgres_schema(prefix: str = "moelab_test") -> Iterator[tuple[str, str, Any]]:
    """A fresh schema on the test PostgreSQL (skips the test without one): ``(url, schema, admin engine)``; dropped after."""
    url = _postgres_url()
    if url is None:
        pytest.skip("no PostgreSQL with psycopg reachable")
    schema = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(url)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        yield url, schema, admin
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


@pytest.fixture
def postgres_schema():
    """A fresh schema on the test PostgreSQL: (engine whose search_path is that schema), dropped after."""
    with fresh_postgres_schema() as (url, schema, _admin):
        engine = create_engine(url, connect_args={"options": f"-csearch_path={schema}"})
        try:
            yield engine
        finally:
            engine.dispose()


def test_job_state_machine_on_postgres(postgres_schema):
    from sqlalchemy.orm import sessionmaker

    db = Database(_postgres_url())
    db.engine.dispose()
    db.engine = postgres_schema
    db._sessions = sessionmaker(db.engine, expire_on_commit=False)
    _state_machine(db)


def test_artifact_store_takes_ids_only(tmp_path):
    store = ArtifactStore(tmp_path)
    store.ensure()
    ident = jobs.new_id("pr")
    with pytest.raises(ValueError):
        store.path("profiles", "../../etc")
    with pytest.raises(ValueError):
        store.path("secrets", ident)
    base = store.path("profiles", ident)
    base.mkdir()
    (base / "manifest.json").write_text("{}")
    (base / ".manifest.json.tmp-file-1234").write_text("partial")
    (tmp_path / "outside.txt").write_text("secret")
    (base / "link.txt").symlink_to(tmp_path / "outside.txt")
    assert [f.path for f in store.files("profiles", ident)] == ["link.txt", "manifest.json"]
    assert store.file("profiles", ident, "manifest.json").read_text() == "{}"
    for bad in ("../outside.txt", "/etc/passwd", ".manifest.json.tmp-file-1234", "link.txt"):
        with pytest.raises(ArtifactMissing):
            store.file("profiles", ident, bad)
    assert store.cleanup() == 0 and store.exists("profiles", ident)


def test_model_cache_checks_models_out():
    cache = ModelCache(2)
    cache.give(("a",), "A")
    cache.give(("b",), "B")
    cache.give(("c",), "C")  # evicts the least recently returned
    assert len(cache) == 2 and cache.take(("a",)) is None
    assert cache.take(("b",)) == "B" and cache.take(("b",)) is None  # in use: not handed out twice
    ModelCache(0).give(("x",), "X")


def test_migration_to_unique_upload_keys_on_postgres(postgres_schema):
    engine = postgres_schema
    migrate(engine)
    with engine.begin() as conn:  # back to schema 2, with duplicates
        conn.execute(text("DROP INDEX uq_calibration_sets_upload_key"))
        conn.execute(text("ALTER TABLE calibration_sets DROP COLUMN upload_key"))
        conn.execute(text("UPDATE moelab_meta SET value = '2' WHERE key = 'schema_version'"))
        for ident, sec in [("cal-b", 2), ("cal-a", 1), ("cal-c", 3)]:
            conn.execute(text("INSERT INTO calibration_sets (id, created_at, params, name, origin, content_id) VALUES "
                              f"(:i, '2026-11-20 10:00:0{sec}+00', '{{}}', 'n', 'upload', 'cs-1')"), {"i": ident})
    migrate(engine)
    migrate(engine)
    with engine.begin() as conn:
        assert dict(conn.execute(text("SELECT id, upload_key FROM calibration_sets")).all()) == {
            "cal-a": "cs-1", "cal-b": None, "cal-c": None}
        assert conn.execute(text("SELECT value FROM moelab_meta")).scalar() == str(SCHEMA_VERSION)
    with pytest.raises(IntegrityError):
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO calibration_sets (id, created_at, params, name, origin, upload_key) "
                              "VALUES ('cal-x', now(), '{}', 'n', 'upload', 'cs-1')"))


_INIT_AT = """
import sys, time
from moelab.store.db import Database
start = float(sys.argv[2])
while time.time() < start:  # every process starts migrating at the same instant
    pass
Database(sys.argv[1]).init()
"""


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_processes_migrating_one_fresh_database_at_once_all_succeed(tmp_path, backend):
    """The API, its extra uvicorn workers and the job workers all migrate at start; on a fresh
    database they raced ("table already exists", about 4 runs in 5 with two processes) until
    ``migration_lock`` serialised them."""
    import subprocess
    import sys
    import time

    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'fresh.db'}"
    else:
        pg = _postgres_url()
        if pg is None:
            pytest.skip("no PostgreSQL with psycopg reachable")
        schema = f"moelab_race_{uuid.uuid4().hex[:8]}"
        url = f"{pg}?options=-csearch_path%3D{schema}"
        admin = create_engine(pg)
    try:
        for _ in range(3):  # a race shows in most rounds; three make a pass by luck unlikely
            if backend == "sqlite":
                for f in tmp_path.glob("fresh.db*"):
                    f.unlink()
            else:
                with admin.begin() as conn:
                    conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
                    conn.execute(text(f"CREATE SCHEMA {schema}"))
            start = time.time() + 2.0
            procs = [subprocess.Popen([sys.executable, "-c", _INIT_AT, url, str(start)], stderr=subprocess.PIPE, text=True)
                     for _ in range(4)]
            errors = [p.communicate(timeout=120)[1] for p in procs]
            assert [p.returncode for p in procs] == [0] * 4, errors
            engine = create_engine(url)
            with engine.connect() as conn:
                version = conn.execute(text("SELECT value FROM moelab_meta WHERE key = 'schema_version'")).scalar_one()
            engine.dispose()
            assert int(version) == SCHEMA_VERSION
    finally:
        if backend == "postgres":
            with admin.begin() as conn:
                conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))


def test_migration_to_notes_tags_and_stage_clock_keeps_rows(tmp_path):
    """Schema 4 -> 5: every resource table gains notes and tags, jobs gain stage_at; old rows read as
    no notes and no tags."""
    from backend.views import model_out

    url = f"sqlite:///{tmp_path / 'v4.sqlite'}"
    db = Database(url)
    db.init()
    with db.session() as s:
        s.add(Model(id="mod-old", name="old", source="default", kind="default"))
    with db.engine.begin() as conn:  # back to schema 4
        for table in ("models", "calibration_sets", "profiles", "conversions", "evaluations", "finetunes", "probes",
                      "activation_probes", "exports"):
            conn.execute(text(f"ALTER TABLE {table} DROP COLUMN notes"))
            conn.execute(text(f"ALTER TABLE {table} DROP COLUMN tags"))
        conn.execute(text("ALTER TABLE jobs DROP COLUMN stage_at"))
        conn.execute(text("UPDATE moelab_meta SET value = '4' WHERE key = 'schema_version'"))
    db.dispose()
    db = Database(url)
    db.init()
    with db.session() as s:
        out = model_out(s.get(Model, "mod-old"))
        assert (out.notes, out.tags, out.name) == (None, [], "old")
    db.dispose()
