"""Conversion-designer slider round trip: HTTP allocation preview + plan figure (target < 200 ms).

    python tests/benchmarks/bench_designer_roundtrip.py --api http://127.0.0.1:8000/api/v1 --profile PROFILE_ID

Runs against a live ``moelab serve`` and a stored profile (the default model's has 30 layers).
Each step is what one slider move costs the UI: the GET of /profiles/{id}/allocation-preview
over HTTP and building the per-layer plan figure from its JSON. Writes
tests/benchmarks/results/bench_designer_roundtrip.json and prints one summary line.
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

from frontend import figures  # noqa: E402
from moelab.api_client import ApiClient  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--api", required=True)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--moves", type=int, default=50)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "benchmarks" / "results" / "bench_designer_roundtrip.json")
    args = ap.parse_args()
    client = ApiClient(base_url=args.api)
    client.allocation_preview(args.profile)  # warm: the API caches the opened profile
    http_ms, fig_ms = [], []
    for i in range(args.moves):
        params = {"alpha_min": round(0.05 + 0.005 * i, 3), "alpha_max": 0.7, "tau": round(0.3 + 0.01 * i, 3),
                  "n_experts": 64, "sparsity": 0.25 if i % 2 else 0.5}
        t0 = time.perf_counter()
        preview = client.allocation_preview(args.profile, **params)
        t1 = time.perf_counter()
        figures.allocation_plan(preview).to_plotly_json()
        t2 = time.perf_counter()
        http_ms.append(1000 * (t1 - t0))
        fig_ms.append(1000 * (t2 - t1))
    total = np.array(http_ms) + np.array(fig_ms)
    record = {"api": args.api, "profile": args.profile, "layers": len(preview["layers"]), "moves": args.moves,
              "http_median_ms": float(np.median(http_ms)), "figure_median_ms": float(np.median(fig_ms)),
              "round_trip_median_ms": float(np.median(total)), "round_trip_p95_ms": float(np.percentile(total, 95))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"bench_designer_roundtrip: {record['layers']} layers, round trip median {record['round_trip_median_ms']:.1f} ms "
          f"(HTTP {record['http_median_ms']:.1f} + figure {record['figure_median_ms']:.1f}), p95 {record['round_trip_p95_ms']:.1f} ms (target < 200 ms)")


if __name__ == "__main__":
    main()
