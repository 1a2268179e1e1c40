"""API latency under load: N concurrent clients on the cheap GETs the UI makes (method previews on
every slider move, CV charts, activation tiles, job lists, a model, health) for S seconds.

    python tests/benchmarks/bench_api_load.py [--clients 50] [--seconds 30] [--api-workers 2]
                                              [--profile runs/p1] [--label after] [--per-endpoint]

Builds (or takes) a profile of the default model, stores it in a fresh data directory as a ready
profile row, starts ``uvicorn backend.app:create_app`` on it (``--api-workers`` processes; the
broker is MOELAB_REDIS_URL or redis://127.0.0.1:6379/13 under a key prefix of its own; no job
runs), then drives it from one asyncio process over keep-alive HTTP/1.1 connections (one per client). Prints p50/p95/p99, requests/s and the
5xx count and the 1-minute load average (``os.getloadavg()``) when the script starts and when the
drive ends on one summary line (``--per-endpoint`` adds a line per endpoint), and adds the run under
``--label`` to tests/benchmarks/results/bench_api_load.json (per endpoint too, and ``load_avg_1m``).
The load generator shares the machine with the API: on a 2-core box it takes a good part of one
core, so these are figures for this machine, not the API's ceiling. Read them beside the load
average: the start value is what else ran (other tests, builds); the end value includes this run's
own server and client (about 2 on a saturated 2-core box), so much more than that means the
machine was shared and the latencies are pessimistic.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "tests" / "benchmarks" / "results" / "bench_api_load.json"


def build_profile(out: Path, model_cache: Path) -> Path:
    """A small real profile of the default model (30 layers × 1,536 neurons) via the CLI."""
    env = {**os.environ, "MOELAB_DATA_DIR": str(model_cache), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "moelab.cli", "profile", "--model", "default", "--calib", "builtin:mixed",
                    "--samples", "24", "--max-tokens", "64", "--batch-tokens", "512", "--no-second-moment", "--quiet",
                    "--out", str(out)], check=True, env=env, cwd=ROOT)
    return out


def seed_service(data_dir: Path, profile_dir: Path) -> dict[str, str]:
    """Rows for a ready model, set and profile (no jobs), the profile's files in the artifact store."""
    from moelab.settings import Settings
    from moelab.store.artifacts import ArtifactStore
    from moelab.store.db import CalibrationSet, Database, Model, Profile
    from moelab.store.jobs import new_id

    settings = Settings(_env_file=None, data_dir=data_dir)
    db = Database(settings.resolved_database_url())
    db.init()
    store = ArtifactStore(settings.resolved_artifacts_dir())
    store.ensure()
    manifest = json.loads((profile_dir / "manifest.json").read_text())
    ids = {"model": new_id("mod"), "calib": new_id("cal"), "profile": new_id("pr")}
    shutil.copytree(profile_dir, store.path("profiles", ids["profile"]))
    with db.session() as s:
        s.add(Model(id=ids["model"], name="SmolLM2-135M-Instruct", source="default", kind="default", params={}))
        s.add(CalibrationSet(id=ids["calib"], name="mixed", origin="builtin", params={}))
        s.flush()
        s.add(Profile(id=ids["profile"], model_id=ids["model"], calibration_set_id=ids["calib"], params={},
                      summary={"n_layers": manifest["n_layers"], "d_ffn": manifest["d_ffn"], "n_tokens": manifest["n_tokens"]}))
    db.dispose()
    ids["n_layers"] = str(manifest["n_layers"])
    return ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def requests_for(ids: dict[str, str], rng: random.Random) -> tuple[str, str, dict[str, str]]:
    """(endpoint label, path, query) of one request, the mix a designer session makes."""
    pr, layers = ids["profile"], int(ids["n_layers"])
    kind = rng.choices(["ew-preview", "cmoe-preview", "cv-summary", "cv-histogram", "activations", "neuron-stats",
                        "jobs", "model", "health"], weights=[30, 10, 15, 10, 10, 5, 10, 5, 5])[0]
    if kind == "ew-preview":
        return kind, f"/api/v1/profiles/{pr}/preview/expertweaver", {
            "tau": f"{rng.uniform(0.2, 1.2):.3f}", "alpha_min": f"{rng.uniform(0.0, 0.3):.2f}",
            "alpha_max": f"{rng.uniform(0.4, 0.8):.2f}", "sparsity": rng.choice(["0.25", "0.5"])}
    if kind == "cmoe-preview":
        return kind, f"/api/v1/profiles/{pr}/preview/cmoe", {"shared": str(rng.randint(1, 3)), "active": "3", "n_experts": "16"}
    if kind == "cv-summary":
        return kind, f"/api/v1/profiles/{pr}/charts/cv-summary", {"tau": f"{rng.uniform(0.2, 1.2):.3f}"}
    if kind == "cv-histogram":
        return kind, f"/api/v1/profiles/{pr}/charts/cv-histogram", {}
    if kind == "activations":
        return kind, f"/api/v1/profiles/{pr}/charts/activations", {"layer": str(rng.randrange(layers)), "max_cols": "256"}
    if kind == "neuron-stats":
        return kind, f"/api/v1/profiles/{pr}/charts/neuron-stats", {"layer": str(rng.randrange(layers))}
    if kind == "jobs":
        return kind, "/api/v1/jobs", {"limit": "20"}
    if kind == "model":
        return kind, f"/api/v1/models/{ids['model']}", {}
    return kind, "/api/v1/health", {}


class KeepAliveConnection:
    """One HTTP/1.1 keep-alive connection speaking just enough of the protocol for GETs of JSON.

    Why not httpx: driving 50 clients, httpx's per-request work kept one of the two cores at 95%
    at ~300 req/s while the API used 60% of the other, so the latencies measured the load
    generator's own event loop. Writing a request line and reading a Content-Length body costs a
    few tens of microseconds, which leaves the machine to the server being measured.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, target: str) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(f"GET {target} HTTP/1.1\r\nHost: {self.host}\r\nAccept: application/json\r\n\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        if "content-length" in headers:
            await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return status

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = self.reader = None


async def drive(base: str, ids: dict[str, str], clients: int, seconds: float) -> list[tuple[str, int, float]]:
    from urllib.parse import urlencode, urlsplit

    url = urlsplit(base)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    samples: list[tuple[str, int, float]] = []
    warm = KeepAliveConnection(host, port)
    for path in ("/api/v1/health", f"/api/v1/profiles/{ids['profile']}/charts/cv-summary"):  # warm caches
        for _ in range(4):
            if await warm.get(path) != 200:
                raise RuntimeError(f"warm-up GET {path} failed")
    await warm.close()
    end = time.perf_counter() + seconds

    async def client(seed: int) -> None:
        rng = random.Random(seed)
        conn = KeepAliveConnection(host, port)
        while time.perf_counter() < end:
            label, path, query = requests_for(ids, rng)
            target = f"{path}?{urlencode(query)}" if query else path
            t0 = time.perf_counter()
            try:
                status = await conn.get(target)
            except (OSError, asyncio.IncompleteReadError, ValueError):
                status = 599
                await conn.close()
            samples.append((label, status, time.perf_counter() - t0))
        await conn.close()

    await asyncio.gather(*(client(i) for i in range(clients)))
    return samples


def summarise(samples: list[tuple[str, int, float]], seconds: float) -> dict[str, object]:
    def stats(rows: list[tuple[str, int, float]]) -> dict[str, float | int]:
        ms = np.array([r[2] for r in rows]) * 1000
        return {"n": len(rows), "p50_ms": round(float(np.percentile(ms, 50)), 1), "p95_ms": round(float(np.percentile(ms, 95)), 1),
                "p99_ms": round(float(np.percentile(ms, 99)), 1), "max_ms": round(float(ms.max()), 1),
                "errors_5xx": sum(1 for r in rows if r[1] >= 500), "errors_4xx": sum(1 for r in rows if 400 <= r[1] < 500)}

    out: dict[str, object] = {**stats(samples), "requests_per_s": round(len(samples) / seconds, 1)}
    out["by_endpoint"] = {label: stats([r for r in samples if r[0] == label]) for label in sorted({r[0] for r in samples})}
    return out


def _load_1m() -> float | None:
    """The 1-minute load average (runnable + waiting processes), None where the OS has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _fmt_load(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--api-workers", type=int, default=None,
                    help="uvicorn worker processes (default: what `moelab serve` starts: MOELAB_API_WORKERS, else "
                         "one per CPU up to 4)")
    ap.add_argument("--profile", type=Path, default=None, help="a profile directory to serve (default: build a small one)")
    ap.add_argument("--model-cache", type=Path, default=ROOT / ".moelab" / "test-data", help="MOELAB_DATA_DIR holding the default model")
    ap.add_argument("--label", default="run")
    ap.add_argument("--per-endpoint", action="store_true", help="also print a line per endpoint")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.api_workers is None:
        from moelab.settings import Settings

        args.api_workers = Settings(_env_file=None).api_workers

    load_start = _load_1m()
    work = Path(tempfile.mkdtemp(prefix="moelab-bench-load-"))
    proc = None
    try:
        profile = args.profile or build_profile(work / "profile", args.model_cache)
        ids = seed_service(work / "data", profile)
        port = _free_port()
        env = {**os.environ, "MOELAB_DATA_DIR": str(work / "data"),
               "MOELAB_REDIS_URL": os.environ.get("MOELAB_REDIS_URL", "redis://127.0.0.1:6379/13"),
               "MOELAB_REDIS_PREFIX": f"moelab-bench-{port}:"}
        env.pop("MOELAB_API_TOKEN", None)
        proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "backend.app:create_app", "--factory", "--host", "127.0.0.1",
                                 "--port", str(port), "--workers", str(args.api_workers), "--log-level", "warning"],
                                env=env, cwd=ROOT, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/api/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the API did not start")
            time.sleep(0.3)
        load_drive = _load_1m()
        samples = asyncio.run(drive(base, ids, args.clients, args.seconds))
        load_end = _load_1m()
        record = {"label": args.label, "clients": args.clients, "seconds": args.seconds, "api_workers": args.api_workers,
                  "cpus": os.cpu_count(), "profile": str(args.profile or "built: default model, 24 samples × 64 tokens"),
                  "load_avg_1m": {"start": load_start, "drive_start": load_drive, "end": load_end},
                  **summarise(samples, args.seconds)}
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    runs = json.loads(args.out.read_text()) if args.out.is_file() else {}
    runs[args.label] = record
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(runs, indent=2) + "\n")
    print(f"bench_api_load [{args.label}]: {args.clients} clients × {args.seconds:g} s, {args.api_workers} API process(es), "
          f"{os.cpu_count()} CPUs: p50 {record['p50_ms']} ms, p95 {record['p95_ms']} ms, p99 {record['p99_ms']} ms, "
          f"{record['requests_per_s']} req/s, 5xx {record['errors_5xx']}, 4xx {record['errors_4xx']}; "
          f"load avg 1 min {_fmt_load(load_start)} at start, {_fmt_load(load_end)} at end")
    if args.per_endpoint:
        for label, s in record["by_endpoint"].items():  # type: ignore[union-attr]
            print(f"  {label:13s} n={s['n']:5d} p50 {s['p50_ms']:7.1f} ms  p95 {s['p95_ms']:7.1f} ms  p99 {s['p99_ms']:7.1f} ms  "
                  f"5xx {s['errors_5xx']}")


if __name__ == "__main__":
    main()
