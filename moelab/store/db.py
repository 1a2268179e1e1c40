"""The SQL store: the record of every model, calibration set, profile, conversion,
evaluation and job (the truth for job history; Redis only carries messages).

SQLite by default, any SQLAlchemy URL (Postgres) via ``MOELAB_DATABASE_URL``. The schema is
created at start and migrated additively (missing tables are created, missing columns added),
with the version recorded in ``moelab_meta``; both the API and the workers run it, idempotently.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    create_engine,
    event,
    inspect,
    text,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError, ProgrammingError
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    mapped_column,
    relationship,
    sessionmaker,
)

SCHEMA_VERSION = 5  # 5: notes and tags on every resource, jobs.stage_at


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite drops the zone otherwise)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, datetime: UTCDateTime}


class Job(Base):
    """One run of a task. ``id`` is also the Celery task id. A re-run is a new row (``retry_of``)."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))  # inspect_model | build_calibration | profile | conversion | evaluation | finetune | probe | activation_probe | export
    queue: Mapped[str] = mapped_column(String(16))
    resource_type: Mapped[str] = mapped_column(String(32))
    resource_id: Mapped[str] = mapped_column(String(40), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True, default="queued")
    stage: Mapped[str | None] = mapped_column(String(200), default=None)
    current: Mapped[int] = mapped_column(Integer, default=0)
    total: Mapped[int] = mapped_column(Integer, default=0)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    error_type: Mapped[str | None] = mapped_column(String(32), default=None)
    worker: Mapped[str | None] = mapped_column(String(200), default=None)
    retry_of: Mapped[str | None] = mapped_column(String(40), default=None)
    timings: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    heartbeat_at: Mapped[datetime | None] = mapped_column(default=None)
    progress_at: Mapped[datetime | None] = mapped_column(default=None)
    stage_at: Mapped[datetime | None] = mapped_column(default=None)  # when the present stage began (schema 5)


class _Resource:
    """Columns every job-backed resource has; its status is its latest job's state."""

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"), default=None)
    # the user's own words on a run (schema 5): free text and short labels to find it again
    notes: Mapped[str | None] = mapped_column(Text, default=None)
    tags: Mapped[list[str] | None] = mapped_column(JSON, default=None)


class Model(_Resource, Base):
    __tablename__ = "models"

    name: Mapped[str] = mapped_column(String(200))
    source: Mapped[str] = mapped_column(String(1000))  # "default" | local path | Hugging Face id
    kind: Mapped[str] = mapped_column(String(16))  # default | local | hf
    trust_remote_code: Mapped[bool] = mapped_column(Boolean, default=False)
    job: Mapped[Job | None] = relationship(lazy="joined")


class CalibrationSet(_Resource, Base):
    __tablename__ = "calibration_sets"

    name: Mapped[str] = mapped_column(String(200))
    origin: Mapped[str] = mapped_column(String(16))  # builtin | upload | hf
    content_id: Mapped[str | None] = mapped_column(String(40), index=True, default=None)  # engine's cs-… id
    # An upload's content id, unique (index UPLOAD_KEY_INDEX): the database, not a check-then-insert,
    # decides which of several identical concurrent uploads is stored. NULL for other origins and for
    # duplicates stored before schema 3.
    upload_key: Mapped[str | None] = mapped_column(String(40), default=None)
    job: Mapped[Job | None] = relationship(lazy="joined")

    __table_args__ = (Index("uq_calibration_sets_upload_key", "upload_key", unique=True),)


class Profile(_Resource, Base):
    __tablename__ = "profiles"

    model_id: Mapped[str] = mapped_column(ForeignKey("models.id"), index=True)
    calibration_set_id: Mapped[str] = mapped_column(ForeignKey("calibration_sets.id"), index=True)
    job: Mapped[Job | None] = relationship(lazy="joined")


class Conversion(_Resource, Base):
    __tablename__ = "conversions"

    # Profile-based methods read a profile; hierarchical conversion reads a model + calibration set.
    profile_id: Mapped[str | None] = mapped_column(ForeignKey("profiles.id"), index=True, nullable=True)
    model_id: Mapped[str | None] = mapped_column(ForeignKey("models.id"), default=None, nullable=True)
    job: Mapped[Job | None] = relationship(lazy="joined")


class Evaluation(_Resource, Base):
    __tablename__ = "evaluations"

    conversion_id: Mapped[str] = mapped_column(ForeignKey("conversions.id"), index=True)
    job: Mapped[Job | None] = relationship(lazy="joined")


class Finetune(_Resource, Base):
    """Recovery fine-tuning of a conversion; its work dir (train log, checkpoints) survives re-runs,
    and on success the fine-tuned model becomes the conversion ``result_conversion_id``."""

    __tablename__ = "finetunes"

    conversion_id: Mapped[str] = mapped_column(ForeignKey("conversions.id"), index=True)
    result_conversion_id: Mapped[str | None] = mapped_column(ForeignKey("conversions.id"), default=None)
    job: Mapped[Job | None] = relationship(lazy="joined")


class Probe(_Resource, Base):
    """A short look at one conversion on one text: token-level routing or a side-by-side generation
    with the dense model (``params.kind``); its result is the artifact ``probes/<id>/probe.json``."""

    __tablename__ = "probes"

    conversion_id: Mapped[str] = mapped_column(ForeignKey("conversions.id"), index=True)
    job: Mapped[Job | None] = relationship(lazy="joined")


class ActivationProbe(_Resource, Base):
    """Chosen neurons of one layer of a profile's dense model on one text: their FFN activation h on
    every token (``params``: text or held-out sample, layer, neurons); its result is the artifact
    ``activation-probes/<id>/activations.json``. A table of its own, not a ``Probe`` kind: probes
    target a conversion (their ``conversion_id`` is required), a neuron's activation belongs to the
    dense model a profile describes."""

    __tablename__ = "activation_probes"

    profile_id: Mapped[str] = mapped_column(ForeignKey("profiles.id"), index=True)
    job: Mapped[Job | None] = relationship(lazy="joined")


class Export(_Resource, Base):
    """A conversion written in another format (``format`` ``gguf``: one ``.gguf`` file for llama.cpp /
    Ollama, of ``type`` f32 | f16 | q8_0), stored inside the conversion's artifact
    (``conversions/<conv-id>/exports/<exp-id>/``), so it goes with the conversion. One per conversion,
    format and type (a unique index: concurrent requests for the same file make one export)."""

    __tablename__ = "exports"

    conversion_id: Mapped[str] = mapped_column(ForeignKey("conversions.id"), index=True)
    format: Mapped[str] = mapped_column(String(16))
    type: Mapped[str] = mapped_column(String(16))
    job: Mapped[Job | None] = relationship(lazy="joined")

    __table_args__ = (Index("uq_exports_conversion_format_type", "conversion_id", "format", "type", unique=True),)


class Meta(Base):
    __tablename__ = "moelab_meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(200))


RESOURCE_TABLES: dict[str, type[_Resource]] = {
    "models": Model,
    "calibration_sets": CalibrationSet,
    "profiles": Profile,
    "conversions": Conversion,
    "evaluations": Evaluation,
    "finetunes": Finetune,
    "probes": Probe,
    "activation_probes": ActivationProbe,
    "exports": Export,
}


# --------------------------------------------------------------------------- engine and schema


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    """WAL lets the API read while a worker writes progress; busy_timeout rides out short locks."""
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        from pathlib import Path

        db_path = url.split("///", 1)[-1]
        if db_path and db_path != ":memory:":
            Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        # Connections are kept for the API's requests: one opened and closed per request past the pool's
        # size re-runs the PRAGMAs below each time, which showed up under 50 concurrent clients. A request
        # holds its session's connection from its first query until the response is sent (the session
        # dependency closes after it), so with N clients up to N are checked out at once although only
        # the thread pool's few threads run queries: 64 kept (an idle SQLite connection is a file handle
        # and a small page cache) covers 50 clients with no churn; 64 more are opened past that.
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, pool_size=64, max_overflow=64)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True)


def migrate(engine: Engine) -> None:
    """Create missing tables and add missing (nullable or defaulted) columns; record the version.

    Additive only: a column is never dropped or retyped, so an older worker and a newer API can
    share one database during a rolling upgrade.
    """
    try:
        Base.metadata.create_all(engine)
    except (OperationalError, ProgrammingError):  # another process created a table concurrently
        Base.metadata.create_all(engine)
    _conversion_profile_optional(engine)
    existing = inspect(engine)
    with engine.begin() as conn:
        for table in Base.metadata.sorted_tables:
            have = {c["name"] for c in existing.get_columns(table.name)}
            for column in table.columns:
                if column.name in have:
                    continue
                ddl = column.type.compile(dialect=engine.dialect)
                default = ""
                if column.default is not None and getattr(column.default, "is_scalar", False):
                    value = column.default.arg
                    default = f" DEFAULT {int(value) if isinstance(value, bool) else repr(value)}"
                conn.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {ddl}{default}'))
        _unique_upload_keys(conn)
        row = conn.execute(text("SELECT value FROM moelab_meta WHERE key = 'schema_version'")).first()
        if row is None:
            conn.execute(text("INSERT INTO moelab_meta (key, value) VALUES ('schema_version', :v)"), {"v": str(SCHEMA_VERSION)})
        elif int(row[0]) < SCHEMA_VERSION:
            conn.execute(text("UPDATE moelab_meta SET value = :v WHERE key = 'schema_version'"), {"v": str(SCHEMA_VERSION)})


def _unique_upload_keys(conn: Any) -> None:
    """Schema 3: uploads are de-duplicated by a unique index on ``calibration_sets.upload_key``.

    A database from before may hold several uploads of the same content (the old check-then-insert
    raced): the oldest of each keeps the key, the others stay as they are with none (they may be in
    use), then the index is created. Idempotent, and the same SQL on SQLite and Postgres."""
    conn.execute(text(
        "UPDATE calibration_sets SET upload_key = content_id "
        "WHERE origin = 'upload' AND content_id IS NOT NULL AND upload_key IS NULL "
        "AND id = (SELECT c2.id FROM calibration_sets c2 WHERE c2.origin = 'upload' "
        "          AND c2.content_id = calibration_sets.content_id ORDER BY c2.created_at, c2.id LIMIT 1) "
        "AND NOT EXISTS (SELECT 1 FROM calibration_sets c3 WHERE c3.upload_key = calibration_sets.content_id)"
    ))
    conn.execute(text("CREATE UNIQUE INDEX IF NOT EXISTS uq_calibration_sets_upload_key ON calibration_sets (upload_key)"))


def _conversion_profile_optional(engine: Engine) -> None:
    """Schema 2: ``conversions.profile_id`` becomes nullable (hierarchical conversions have no
    profile). Postgres alters the column. SQLite cannot, so the table is rebuilt with its rows in
    one transaction on a connection of its own, with foreign keys off (they cannot be switched
    inside a transaction) and the legacy rename, so evaluations keep pointing at ``conversions``."""
    column = next(c for c in inspect(engine).get_columns("conversions") if c["name"] == "profile_id")
    if column["nullable"]:
        return
    if engine.dialect.name != "sqlite":
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE conversions ALTER COLUMN profile_id DROP NOT NULL"))
        return
    from sqlalchemy.schema import CreateIndex, CreateTable

    table = Conversion.__table__
    old = [c["name"] for c in inspect(engine).get_columns("conversions")]
    names = ", ".join(f'"{n}"' for n in old if n in table.columns)
    raw = engine.raw_connection()
    try:
        raw.driver_connection.isolation_level = None  # explicit BEGIN/COMMIT below
        cur = raw.cursor()
        cur.execute("PRAGMA foreign_keys=OFF")
        cur.execute("PRAGMA legacy_alter_table=ON")
        cur.execute("BEGIN")
        for index in inspect(engine).get_indexes("conversions"):
            cur.execute(f'DROP INDEX IF EXISTS "{index["name"]}"')
        cur.execute("ALTER TABLE conversions RENAME TO conversions_v1")
        cur.execute(str(CreateTable(table).compile(dialect=engine.dialect)))
        for index in table.indexes:
            cur.execute(str(CreateIndex(index).compile(dialect=engine.dialect)))
        cur.execute(f"INSERT INTO conversions ({names}) SELECT {names} FROM conversions_v1")
        cur.execute("DROP TABLE conversions_v1")
        if cur.execute("PRAGMA foreign_key_check").fetchall():
            cur.execute("ROLLBACK")
            raise RuntimeError("rebuilding the conversions table would break foreign keys; database left unchanged")
        cur.execute("COMMIT")
    finally:
        cur.execute("PRAGMA legacy_alter_table=OFF")
        cur.execute("PRAGMA foreign_keys=ON")
        raw.driver_connection.isolation_level = ""
        raw.close()


_PG_MIGRATION_LOCK = 0x6D6F656C  # pg_advisory_lock key of moelab's schema migration ("moel")


@contextmanager
def migration_lock(engine: Engine) -> Iterator[None]:
    """Serialise ``migrate`` across processes: the API, its extra uvicorn workers and every job
    worker migrate at start, often at the same moment on a fresh data directory, and two
    ``CREATE TABLE``/``ADD COLUMN`` passes racing fail with "already exists". SQLite files take an
    exclusive ``flock`` on ``<db>.migrate.lock`` beside them; Postgres a session advisory lock;
    an in-memory SQLite database is private to its process and needs none."""
    name = engine.dialect.name
    if name == "postgresql":
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_MIGRATION_LOCK})
                conn.commit()
        return
    database = engine.url.database if name == "sqlite" else None
    if not database or database == ":memory:" or database.startswith("file::memory:"):
        yield
        return
    import fcntl
    from pathlib import Path

    lock_path = Path(database).with_name(Path(database).name + ".migrate.lock")
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class Database:
    """An engine plus a session factory; the schema is migrated once, on first use."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._ready = False
        self._lock = threading.Lock()

    def init(self) -> None:
        with self._lock:
            if not self._ready:
                with migration_lock(self.engine):
                    migrate(self.engine)
                self._ready = True

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits on success and rolls back on error."""
        self.init()
        with self._sessions() as session:
            try:
                yield session
                session.commit()
            except BaseException:
                session.rollback()
                raise

    def ping(self) -> None:
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def dispose(self) -> None:
        self.engine.dispose()
