"""Browser-test fixtures: a live API (uvicorn) + Celery worker + frontend (``python -m
frontend.app``) as subprocesses sharing one SQLite file, artifact root and Redis DB index (the
service fixtures' patterns), a tiny model profiled through the API, and Debian's Chromium
driven by Playwright."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import _free_port, redis_url, service_config, tiny_llama, worker  # noqa: F401  (fixtures)
from tests.service.helpers import env_for

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
TERMINAL = ("succeeded", "failed", "cancelled")


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not up in {timeout} s:\n{log.read_text()[-3000:]}")


def _spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as fh:
        return subprocess.Popen(argv, env=env, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: serve stops its children in order
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def live(service_config, worker, tmp_path_factory) -> Iterator[dict[str, str]]:  # noqa: F811
    """``moelab serve`` (API, a worker and the frontend) on free loopback ports, sharing the
    service fixtures' SQLite file, artifact root and Redis DB index; yields the base URLs."""
    logs = tmp_path_factory.mktemp("live-logs")
    api_port, ui_port = _free_port(), _free_port()
    api_url = f"http://127.0.0.1:{api_port}/api/v1"
    env = env_for(service_config, MOELAB_HOST="127.0.0.1", MOELAB_PORT=str(api_port), MOELAB_FRONTEND_PORT=str(ui_port))
    env.pop("MOELAB_API_URL", None)  # serve tells the frontend where its API is
    serve = _spawn([sys.executable, "-m", "moelab.cli", "serve"], env, logs / "serve.log")
    try:
        _wait_http(f"{api_url}/health", serve, logs / "serve.log", 90)
        _wait_http(f"http://127.0.0.1:{ui_port}/", serve, logs / "serve.log", 60)
        yield {"api": api_url, "ui": f"http://127.0.0.1:{ui_port}"}
    finally:
        _stop(serve)


def wait_job(api: httpx.Client, job_id: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = api.get(f"/jobs/{job_id}").json()
        if job["state"] in TERMINAL:
            assert job["state"] == "succeeded", (job.get("error"), job)
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not finished after {timeout} s")


@pytest.fixture(scope="session")
def api(live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live["api"], timeout=30) as client:
        yield client


@pytest.fixture(scope="session")
def profile_id(api, tiny_llama) -> str:  # noqa: F811
    m = api.post("/models", json={"source": str(tiny_llama)}).json()
    if m.get("job_id"):
        wait_job(api, m["job_id"])
    s = api.post("/calibration-sets", json={"source": "builtin", "name": "mixed", "samples": 12}).json()
    wait_job(api, s["job_id"])
    p = api.post("/profiles", json={"model_id": m["id"], "calibration_set_id": s["id"], "max_tokens": 32, "batch_tokens": 256}).json()
    wait_job(api, p["job_id"])
    return p["id"]


@pytest.fixture(scope="session")
def evaluated(api, profile_id) -> tuple[str, list[str]]:
    """A conversion of the profiled tiny model and its evaluations on builtin:code and builtin:prose (in that order):
    built once for every page test that reads them."""
    c = api.post("/conversions", json={"profile_id": profile_id, "expertweaver": {"n_experts": 8, "alpha_max": 0.5}}).json()
    wait_job(api, c["job_id"])
    evs = []
    for source in ("builtin:code", "builtin:prose"):
        e = api.post("/evaluations", json={"conversion_id": c["id"], "source": source, "n_windows": 2, "seq_len": 32,
                                           "baselines": False, "multiple_choice_per_task": 0}).json()
        evs.append(e)
    for e in evs:
        wait_job(api, e["job_id"])
    return c["id"], [e["id"] for e in evs]


@pytest.fixture
def page(browser):
    """A fresh page that records console errors and uncaught exceptions in ``page.errors``."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    p = context.new_page()
    p.errors = []  # type: ignore[attr-defined]
    p.on("console", lambda m: p.errors.append(f"console: {m.text}") if m.type == "error" else None)
    p.on("pageerror", lambda e: p.errors.append(f"pageerror: {e}"))
    p.set_default_timeout(30_000)
    yield p
    context.close()
