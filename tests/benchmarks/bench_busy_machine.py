"""moelab on a machine it shares: the default model's (or ``--model``'s, a conversion's directory) decode step and
512-token prefill, alone and beside another 2-thread torch process, with libgomp's own spin (``GOMP_SPINCOUNT=300000``)
and with a short one (1000); optionally ``moelab convert --recipe best --sparsity 0.5`` of a profile timed the same way.

    python tests/benchmarks/bench_busy_machine.py [--repeats 2] [--spins 300000 1000] [--convert PROFILE_DIR]
        [--model CONVERSION_DIR] [--out FILE]

Each measurement is a fresh process (libgomp reads the spin once, when torch loads it) with the spin in its
environment, 2 torch threads, the dense model from ``--model-cache``. "busy": a 2-thread loop of 1024² products runs
beside it for the whole measurement, started without moelab (libgomp's default spin, as other software has). Rounds
interleave the settings so each ratio comes from one machine state; medians over ``--repeats`` rounds. Writes
tests/benchmarks/results/bench_busy_machine.json and prints one summary line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "benchmarks" / "results" / "bench_busy_machine.json"
LIBGOMP_DEFAULT = "300000"

TIMING = """
import json, statistics, sys, time
import moelab
import torch
torch.set_num_threads(2)
if sys.argv[2] == "default":
    from moelab.engine.models import load_model
    model = load_model("default", data_dir=sys.argv[1]).model.eval()
else:  # a conversion, in moelab's runtime (its native CPU kernels)
    from moelab.engine.runtime.export import load_exported
    model = load_exported(sys.argv[2]).eval()
short, long = torch.randint(100, 20000, (1, 8)), torch.randint(100, 20000, (1, 512))
def decode():
    t = time.perf_counter(); model.generate(short, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    return (time.perf_counter() - t) / 32 * 1e3
def prefill():
    t = time.perf_counter(); model(long); return (time.perf_counter() - t) * 1e3
with torch.no_grad():
    decode(); prefill()
    out = {"decode_ms": statistics.median(decode() for _ in range(5)), "prefill_ms": statistics.median(prefill() for _ in range(3))}
print(json.dumps(out))
"""

COMPETITOR = """
import torch
torch.set_num_threads(2)
a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
while True:
    a @ b
"""


def _env(spin: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if spin is not None:
        env["GOMP_SPINCOUNT"] = spin
    return {**env, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


@contextlib.contextmanager
def _busy(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", COMPETITOR], env=_env(None), stdout=subprocess.DEVNULL)
    time.sleep(2)  # its threads are up and spinning
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def _timed(spin: str, busy: bool, model_cache: Path, model: str, convert: Path | None) -> dict:
    with _busy(busy):
        run = subprocess.run([sys.executable, "-c", TIMING, str(model_cache), model], env=_env(spin), check=True,
                             capture_output=True, text=True, cwd=ROOT)
        row = json.loads(run.stdout.strip().splitlines()[-1])
        if convert is not None:
            with tempfile.TemporaryDirectory() as out:
                t = time.perf_counter()
                subprocess.run([sys.executable, "-m", "moelab.cli", "convert", "--profile", str(convert), "--recipe", "best",
                                "--sparsity", "0.5", "--quiet", "--out", str(Path(out) / "c")],
                               env={**_env(spin), "MOELAB_DATA_DIR": str(model_cache)}, check=True, cwd=ROOT,
                               stdout=subprocess.DEVNULL)
                row["convert_s"] = time.perf_counter() - t
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--spins", nargs="+", default=[LIBGOMP_DEFAULT, "1000"], help="GOMP_SPINCOUNT values to compare")
    ap.add_argument("--convert", type=Path, default=None, help="a profile of the default model: also time `moelab convert "
                    "--recipe best --sparsity 0.5` of it (busy, and alone with the last spin)")
    ap.add_argument("--model", default="default", help="a conversion's directory to time instead of the default model")
    ap.add_argument("--model-cache", type=Path, default=ROOT / ".moelab" / "test-data", help="MOELAB_DATA_DIR holding the default model")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    rows: dict[str, list[dict]] = {}
    for round_ in range(args.repeats):
        for busy in (False, True):
            for spin in args.spins:
                # one conversion per setting: busy with every spin, alone with the last
                convert = args.convert if busy or spin == args.spins[-1] else None
                name = f"{'busy' if busy else 'alone'} spin={spin}"
                rows.setdefault(name, []).append(_timed(spin, busy, args.model_cache, args.model,
                                                        convert if round_ == 0 else None))
                print(f"round {round_ + 1}, {name}: {rows[name][-1]}", file=sys.stderr, flush=True)
    result = {"model": args.model, "cpu_count": os.cpu_count(), "threads": 2, "repeats": args.repeats, "spins": args.spins,
              "settings": {}}
    for name, runs in rows.items():
        result["settings"][name] = {key: statistics.median(r[key] for r in runs if key in r)
                                    for key in ("decode_ms", "prefill_ms", "convert_s") if any(key in r for r in runs)}
    s = result["settings"]
    base, ours = args.spins[0], args.spins[-1]
    for key, label in (("decode_ms", "decode"), ("prefill_ms", "prefill"), ("convert_s", "convert")):
        if key in s[f"busy spin={base}"] and key in s[f"busy spin={ours}"]:
            result[f"busy_speedup_{label}"] = s[f"busy spin={base}"][key] / s[f"busy spin={ours}"][key]
    result["alone_decode_ratio"] = s[f"alone spin={base}"]["decode_ms"] / s[f"alone spin={ours}"]["decode_ms"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"bench_busy_machine ({args.model}): beside a 2-thread torch process, spin {ours} vs {base}: decode "
          f"{s[f'busy spin={base}']['decode_ms']:.0f} -> {s[f'busy spin={ours}']['decode_ms']:.0f} ms "
          f"({result['busy_speedup_decode']:.2f}x), prefill {result['busy_speedup_prefill']:.2f}x"
          + (f", convert {result['busy_speedup_convert']:.2f}x" if "busy_speedup_convert" in result else "")
          + f"; alone, decode {s[f'alone spin={base}']['decode_ms']:.0f} vs {s[f'alone spin={ours}']['decode_ms']:.0f} ms")


if __name__ == "__main__":
    main()
