"""How fast the service answers a researcher, on the default model with two built-in sets (code, prose),
through ``moelab serve`` as a user runs it (API, one worker, UI; a private database and artifact store):

    python tests/benchmarks/bench_answers.py [--samples 48] [--max-tokens 128] [--shots DIR]

Profiles both sets, converts each profile (ExpertWeaver, the paper's recipe), then times what a user
asks next, each twice where the second may reuse what the first loaded or stored: an evaluation of
256 tokens with baselines (then on the other text, then the first text again), a routing probe, a
generation probe (32 tokens), an activation probe, and the API's own answers (profiles compared,
neuron search, experts matched, per-layer curves). For every job it records the time from the
request to the job's first working stage ("starts": queueing and model loading included) and the
longest time its progress stood still (``progress_at`` polled every 0.1 s). ``--shots DIR``: screenshots
of the new views (Chromium, playwright). Writes tests/benchmarks/results/bench_answers.json and prints
one summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

OUT = ROOT / "tests" / "benchmarks" / "results" / "bench_answers.json"
#: stages that are not yet the job's own work: a job "starts" at the first stage outside these
PREPARING = {None, "starting", "load model", "load converted model", "load reference model", "read held-out text"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _when(stamp: str | None) -> float | None:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else None


class Service:
    """``moelab serve`` in a scratch directory, and an HTTP client of its API."""

    def __init__(self, work: Path) -> None:
        self.api_port, self.ui_port = _free_port(), _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOELAB_")}
        env.update(MOELAB_DATABASE_URL=f"sqlite:///{work / 'moelab.db'}", MOELAB_ARTIFACTS_DIR=str(work / "artifacts"),
                   MOELAB_PORT=str(self.api_port), MOELAB_FRONTEND_PORT=str(self.ui_port), MOELAB_DEVICE="cpu",
                   MOELAB_REDIS_URL=os.environ.get("MOELAB_REDIS_URL", "redis://127.0.0.1:6379/12"),
                   MOELAB_REDIS_PREFIX=f"bench-answers-{uuid.uuid4().hex[:6]}:", HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "moelab.cli", "serve"], cwd=ROOT, env=env, start_new_session=True,
                                     stdout=open(work / "serve.log", "wb"), stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.api_port}/api/v1", timeout=120)
        self.ui = f"http://127.0.0.1:{self.ui_port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if self.http.get("/health").json().get("workers"):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        else:
            raise SystemExit(f"moelab serve did not come up; see {work / 'serve.log'}")

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(60)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post(path, json=body)
        if r.status_code >= 400:
            raise SystemExit(f"POST {path}: {r.status_code} {r.text}")
        return r.json()

    def run(self, path: str, body: dict[str, Any], timeout: float = 3600) -> dict[str, Any]:
        """POST a job and follow it: seconds to its first working stage, to its end, and the longest
        stretch its progress stood still."""
        t0 = time.monotonic()
        made = self.post(path, body)
        job_id, last, still, moved_at, started = made["job_id"], None, 0.0, None, None
        while time.monotonic() - t0 < timeout:
            job = self.http.get(f"/jobs/{job_id}").json()
            now = time.monotonic()
            stage = job["progress"]["stage"]
            if started is None and job["state"] == "running" and stage not in PREPARING:
                started = now - t0
            if job["state"] == "running":
                mark = (job.get("progress_at"), stage, job["progress"]["current"])
                if mark != last:
                    last, moved_at = mark, now
                elif moved_at is not None:
                    still = max(still, now - moved_at)
            if job["state"] in ("succeeded", "failed", "cancelled"):
                if job["state"] != "succeeded":
                    raise SystemExit(f"{path} job {job_id} {job['state']}: {job.get('error')}")
                done = now - t0
                return {"id": made["id"], "total_s": round(done, 2), "starts_s": round(started if started is not None else done, 2),
                        "run_s": job["run_s"], "queued_s": job["queued_s"], "longest_still_s": round(still, 2),
                        "timings": job.get("timings")}
            time.sleep(0.1)
        raise SystemExit(f"{path} job {job_id} did not end in {timeout} s")

    def timed_get(self, path: str, **params: Any) -> tuple[float, Any]:
        t0 = time.perf_counter()
        r = self.http.get(path, params=params)
        if r.status_code >= 400:
            raise SystemExit(f"GET {path}: {r.status_code} {r.text}")
        return round(time.perf_counter() - t0, 3), r.json()


def _setup(svc: Service, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = svc.run("/models", {"source": "default"})
    out["model"] = model
    for name in ("code", "prose"):
        cset = svc.run("/calibration-sets", {"source": "builtin", "name": name, "samples": args.samples})
        prof = svc.run("/profiles", {"model_id": model["id"], "calibration_set_id": cset["id"], "max_tokens": args.max_tokens})
        conv = svc.run("/conversions", {"profile_id": prof["id"], "method": "expertweaver", "expertweaver": {}})
        out[name] = {"set": cset, "profile": prof, "conversion": conv}
        print(f"  {name}: profile {prof['total_s']:.0f} s (still ≤ {prof['longest_still_s']:.1f} s), "
              f"conversion {conv['total_s']:.0f} s (still ≤ {conv['longest_still_s']:.1f} s)", flush=True)
    return out


def _answers(svc: Service, made: dict[str, Any]) -> dict[str, Any]:
    conv_a, conv_b = made["code"]["conversion"]["id"], made["prose"]["conversion"]["id"]
    prof_a, prof_b = made["code"]["profile"]["id"], made["prose"]["profile"]["id"]
    ev = {"conversion_id": conv_a, "n_windows": 2, "seq_len": 128, "baselines": True, "multiple_choice_per_task": 0}
    a: dict[str, Any] = {}
    a["evaluation_code_1"] = svc.run("/evaluations", {**ev, "source": "builtin:code"})
    a["evaluation_prose"] = svc.run("/evaluations", {**ev, "source": "builtin:prose"})
    a["evaluation_code_2"] = svc.run("/evaluations", {**ev, "source": "builtin:code"})
    a["evaluation_code_no_baselines"] = svc.run("/evaluations", {**ev, "source": "builtin:code", "baselines": False})
    text = "def mean(values):\n    return sum(values) / len(values)\n\nThe river ran quietly past the old mill."
    for i in (1, 2):
        a[f"routing_probe_{i}"] = svc.run("/probes", {"conversion_id": conv_a, "kind": "routing", "text": text})
    for i in (1, 2):
        a[f"generation_probe_{i}"] = svc.run("/probes", {"conversion_id": conv_a, "kind": "generate", "text": text, "max_new_tokens": 32})
    for i in (1, 2):
        a[f"activation_probe_{i}"] = svc.run("/activation-probes", {"profile_id": prof_a, "layer": 20, "neurons": list(range(16)),
                                                                   "text": text})
    for i in (1, 2):
        a[f"compare_profiles_{i}_s"], cmp = svc.timed_get("/profiles/compare", a=prof_a, b=prof_b)
        a[f"neuron_search_{i}_s"], _ = svc.timed_get(f"/profiles/{prof_a}/neurons/search", token="def")
        a[f"matching_{i}_s"], _ = svc.timed_get(f"/conversions/{conv_a}/matching/{conv_b}")
        a[f"layer_curves_{i}_s"], _ = svc.timed_get(f"/evaluations/{a['evaluation_code_1']['id']}/charts/layers")
    a["most_code_specific"] = [{"layer": n["layer"], "neuron": n["neuron"], "d": n.get("specificity")} for n in cmp["top_a"][:10]]
    a["specific_share_by_layer"] = [{"layer": x["layer"], "code": x["share_a"], "prose": x["share_b"]} for x in cmp["layers"]]
    return a


def _shots(svc: Service, made: dict[str, Any], answers: dict[str, Any], where: Path) -> list[str]:
    from playwright.sync_api import sync_playwright

    where.mkdir(parents=True, exist_ok=True)
    pa, pb = made["code"]["profile"]["id"], made["prose"]["profile"]["id"]
    ca, cb = made["code"]["conversion"]["id"], made["prose"]["conversion"]["id"]
    top = answers["most_code_specific"][0]
    evs = f"{answers['evaluation_code_1']['id']},{answers['evaluation_prose']['id']}"
    pages = {
        "compare-profiles": (f"/profiles/compare?a={pa}&b={pb}", ".js-plotly-plot"),
        "neuron-card": (f"/neurons?profile={pa}&layer={top['layer']}&neuron={top['neuron']}", ".js-plotly-plot"),
        "routing-matched": (f"/routing?conversion={ca}&a={answers['evaluation_code_1']['id']}&b={answers['evaluation_prose']['id']}"
                            f"&match={cb}", ".js-plotly-plot"),
        "evaluations-overlay": (f"/evaluations?ids={evs}&metric=js&against=builtin:prose", "#ev-overlay .js-plotly-plot"),
        "evaluations-recon": (f"/evaluations?ids={evs}&metric=reconstruction_error", "#ev-overlay .js-plotly-plot"),
    }
    saved = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        for name, (path, ready) in pages.items():
            page.goto(svc.ui + path)
            page.wait_for_selector(ready, state="attached", timeout=120_000)
            page.wait_for_load_state("networkidle")
            page.wait_for_timeout(3000)  # let every callback of the page land
            page.screenshot(path=str(where / f"{name}.png"), full_page=True)
            saved.append(str(where / f"{name}.png"))
        browser.close()
    return saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--shots", type=Path, default=None, help="save screenshots of the new views here")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-answers-"))
    svc = Service(work)
    try:
        print(f"profiling and converting the default model on builtin:code and builtin:prose ({args.samples} × {args.max_tokens}) …",
              flush=True)
        made = _setup(svc, args)
        answers = _answers(svc, made)
        jobs = {k: v for k, v in {**{f"setup_{n}_{k}": v for n in ("code", "prose") for k, v in made[n].items()}, **answers}.items()
                if isinstance(v, dict) and "total_s" in v}
        still = max(v["longest_still_s"] for v in jobs.values())
        report = {"model": "default (SmolLM2-135M)", "samples": args.samples, "max_tokens": args.max_tokens, "setup": made,
                  "answers": answers, "longest_still_s": still, "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        if args.shots:
            report["screenshots"] = _shots(svc, made, answers, args.shots)
            args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    finally:
        svc.stop()
    a = answers
    print(f"bench_answers: evaluation 256 tok with baselines {a['evaluation_code_1']['total_s']:.1f} s first, "
          f"{a['evaluation_code_2']['total_s']:.1f} s again ({a['evaluation_code_no_baselines']['total_s']:.1f} s without baselines); "
          f"routing probe starts {a['routing_probe_1']['starts_s']:.2f}/{a['routing_probe_2']['starts_s']:.2f} s, "
          f"ends {a['routing_probe_2']['total_s']:.2f} s; generation starts {a['generation_probe_2']['starts_s']:.2f} s, "
          f"ends {a['generation_probe_2']['total_s']:.2f} s; activation probe {a['activation_probe_2']['total_s']:.2f} s; "
          f"compare {a['compare_profiles_2_s']:.3f} s; progress never still > {still:.1f} s")


if __name__ == "__main__":
    main()
