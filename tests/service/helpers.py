"""Helpers of the service tests: the worker subprocess, job polling, environments."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TERMINAL = ("succeeded", "failed", "cancelled")


def env_for(config: dict[str, Any], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOELAB_")}
    env.update({f"MOELAB_{k.upper()}": str(v) for k, v in config.items()})
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **extra)
    return env


class Worker:
    """A real ``celery worker`` subprocess on queues gpu,cpu (solo pool)."""

    def __init__(self, env: dict[str, str], logdir: Path, name: str = "moelab-test@%h") -> None:
        self.env, self.logdir, self.name = env, logdir, name
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.log: Path | None = None

    def start(self, timeout: float = 90) -> None:
        self.starts += 1
        self.log = self.logdir / f"worker-{self.starts}.log"
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-Q", "gpu,cpu", "-P", "solo",
                 "-n", self.name, "--loglevel", "INFO", "--without-mingle", "--without-gossip", "--without-heartbeat"],
                env=self.env, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            if " ready." in self.log.read_text(errors="replace"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"worker not ready in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def wait_job(client, job_id: str, timeout: float = 120, until: tuple[str, ...] = TERMINAL) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = client.get(f"/api/v1/jobs/{job_id}").json()
        if job["state"] in until:
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} not in {until} after {timeout} s: {job}")


def wait_idle(client, timeout: float = 120) -> None:
    """No queued or running job (so nothing changes the store in the background)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = client.get("/api/v1/jobs", params={"limit": 500}).json()["items"]
        if all(j["state"] in TERMINAL for j in jobs):
            return
        time.sleep(0.2)
    raise AssertionError("jobs still queued or running")


def succeeded(client, created: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    job = wait_job(client, created["job_id"], timeout)
    assert job["state"] == "succeeded", job
    return job


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "\n".join(json.dumps(r) for r in rows).encode()


def save_wide_llama(tokenizer_from: Path, target: Path) -> Path:
    """A random Llama of 16 layers × 2048 FFN neurons (tokenizer of ``tokenizer_from``): enough layers and neurons that
    building a conversion's layers takes a while (fan-out tests)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=2048, num_hidden_layers=16,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(target)
    tok.save_pretrained(target)
    return target
