"""Allocation preview latency (the UI calls it on every slider move; target < 50 ms).

    python tests/benchmarks/bench_allocation_preview.py [--profile runs/p1]

Uses a stored profile when given, else synthetic CVs of a large model's shape (32 × 14,336).
Writes tests/benchmarks/results/bench_allocation_preview.json and prints one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moelab.engine.methods.expertweaver import ExpertWeaverParams as AllocationParams, preview  # noqa: E402
from moelab.engine.profiling.store import StoredProfile  # noqa: E402


class SyntheticProfile:
    def __init__(self, layers: int = 32, d_ffn: int = 14336) -> None:
        rng = np.random.default_rng(0)
        self._cv = [np.abs(rng.normal(0.5, 0.5, d_ffn)).astype(np.float32) for _ in range(layers)]

    def cv_by_layer(self):
        return self._cv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "benchmarks" / "results" / "bench_allocation_preview.json")
    args = ap.parse_args()
    prof = StoredProfile.open(args.profile) if args.profile else SyntheticProfile()
    t0 = time.perf_counter()
    preview(prof, AllocationParams())  # first call loads the per-neuron table
    first = time.perf_counter() - t0
    times = []
    for i in range(50):
        params = AllocationParams(alpha_min=0.1 + i * 0.002, alpha_max=0.7, tau=0.3 + i * 0.01, sparsity=0.25 + (i % 2) * 0.25)
        t = time.perf_counter()
        preview(prof, params)
        times.append(time.perf_counter() - t)
    record = {"source": str(args.profile or "synthetic 32x14336"), "first_call_s": first,
              "median_ms": 1000 * float(np.median(times)), "max_ms": 1000 * float(np.max(times))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"bench_allocation_preview: {record['source']}: median {record['median_ms']:.2f} ms, "
          f"max {record['max_ms']:.2f} ms, first call {first * 1000:.0f} ms (target < 50 ms)")


if __name__ == "__main__":
    main()
