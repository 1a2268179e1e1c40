"""A conversion with one worker against the same conversion with two (``workers.fanout``), on the
default model's 30 layers, through the real service: the API in-process, real Celery worker
processes on a real Redis, one thread each, each worker pinned to its own core.

    python tests/benchmarks/bench_fanout.py [--samples 64] [--max-tokens 128] [--repeats 2] [--method expertweaver]

Measures each conversion job's run time (``run_s``: claimed → succeeded, model load, clustering,
slicing and export included) and, from the job's timings, the engine's build time. Writes
tests/benchmarks/results/bench_fanout.json and prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from moelab.settings import Settings, get_settings  # noqa: E402
from moelab.store import liveness  # noqa: E402

OUT = ROOT / "tests" / "benchmarks" / "results" / "bench_fanout.json"


def _worker(env: dict[str, str], core: int, name: str, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-Q", "gpu,cpu", "-P", "solo", "-n", name,
            "--loglevel", "INFO", "--without-mingle", "--without-gossip", "--without-heartbeat"]
    if os.cpu_count() and os.cpu_count() > core:
        argv = ["taskset", "-c", str(core), *argv]
    return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def _wait_workers(client: redis.Redis, prefix: str, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(liveness.alive(client, prefix)) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"{n} workers did not announce themselves in {timeout} s")
        time.sleep(0.2)


def _job(api, job_id: str, timeout: float = 1800) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = api.get(f"/api/v1/jobs/{job_id}").json()
        if job["state"] in ("succeeded", "failed", "cancelled"):
            if job["state"] != "succeeded":
                raise SystemExit(f"job {job_id} {job['state']}: {job.get('error')}")
            return job
        time.sleep(0.2)
    raise SystemExit(f"job {job_id} did not end in {timeout} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--method", default="expertweaver", choices=("expertweaver", "cmoe"))
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    from fastapi.testclient import TestClient

    from backend.app import create_app

    base = get_settings()
    work = Path(tempfile.mkdtemp(prefix="bench-fanout-"))
    prefix = f"bench-fanout-{uuid.uuid4().hex[:6]}:"
    redis_url = base.redis_url or "redis://127.0.0.1:6379/14"
    config = {"data_dir": str(base.data_dir), "database_url": f"sqlite:///{work / 'moelab.db'}", "artifacts_dir": str(work / "artifacts"),
              "redis_url": redis_url, "redis_prefix": prefix, "device": "cpu", "heartbeat_s": 1.0, "progress_interval_s": 0.5}
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOELAB_")}
    env.update({f"MOELAB_{k.upper()}": str(v) for k, v in config.items()})
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    client = redis.Redis.from_url(redis_url)
    host = socket.gethostname()
    procs: list[subprocess.Popen] = []
    results: dict[int, list[dict]] = {}
    try:
        procs.append(_worker(env, 0, "bench1@%h", work / "worker1.log"))
        _wait_workers(client, prefix, 1)
        with TestClient(create_app(Settings(_env_file=None, **config))) as api:
            model = api.post("/api/v1/models", json={"source": "default"}).json()
            _job(api, model["job_id"])
            cset = api.post("/api/v1/calibration-sets", json={"source": "builtin", "name": "mixed", "samples": args.samples}).json()
            _job(api, cset["job_id"])
            prof = api.post("/api/v1/profiles", json={"model_id": model["id"], "calibration_set_id": cset["id"],
                                                      "max_tokens": args.max_tokens}).json()
            print(f"profiling the default model ({args.samples} × {args.max_tokens} tokens) …", flush=True)
            _job(api, prof["job_id"])
            for n in (1, 2):
                if n == 2:
                    procs.append(_worker(env, 1, "bench2@%h", work / "worker2.log"))
                    _wait_workers(client, prefix, 2)
                runs = []
                for r in range(args.repeats + 1):  # the first run of each setting warms the model caches
                    conv = api.post("/api/v1/conversions", json={"method": args.method, "profile_id": prof["id"], args.method: {}}).json()
                    job = _job(api, conv["job_id"])
                    record = json.loads((work / "artifacts" / "conversions" / conv["id"] / "conversion.json").read_text())
                    timing = {"run_s": job["run_s"], "build_s": (job.get("timings") or {}).get("build_s"),
                              "total_s": (job.get("timings") or {}).get("total_s"),
                              # CPU-seconds of layer building, wherever it ran: rises when the workers contend
                              "layers_s": sum(lay.get("seconds") or 0.0 for lay in record["layers"])}
                    print(f"  {n} worker(s), run {r}: {timing}", flush=True)
                    if r:
                        runs.append(timing)
                results[n] = runs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        keys = list(client.scan_iter(f"{prefix}*"))
        if keys:
            client.delete(*keys)
    med = {n: statistics.median(r["run_s"] for r in runs) for n, runs in results.items()}
    layers = {n: statistics.median(r["layers_s"] for r in runs) for n, runs in results.items()}
    speedup = med[1] / med[2]
    report = {
        "method": args.method, "model": "default (SmolLM2-135M, 30 layers)", "profile": {"samples": args.samples, "max_tokens": args.max_tokens},
        "workers": {str(n): runs for n, runs in results.items()}, "median_run_s": {str(n): v for n, v in med.items()},
        "speedup_2_over_1": speedup, "median_layers_s": {str(n): v for n, v in layers.items()}, "cpus": os.cpu_count(), "threads_per_worker": 1, "pinned": bool(os.cpu_count() and os.cpu_count() > 1),
        "load_avg": os.getloadavg(), "host": host,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"bench_fanout: {args.method} conversion of the default model, 1 worker {med[1]:.1f} s, 2 workers {med[2]:.1f} s: "
          f"{speedup:.2f}x (run_s median of {args.repeats}, 1 thread per worker; layer building {layers[1]:.1f} vs {layers[2]:.1f} "
          f"CPU-s summed; load avg {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
