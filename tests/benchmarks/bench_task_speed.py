"""How long downstream accuracy takes: moelab's three log-likelihood built-in tasks × ``--limit`` items on the default
model, through lm-evaluation-harness (``evaluation.harness.run_tasks``, batched log-likelihoods), 2 CPU threads.

    python tests/benchmarks/bench_task_speed.py [--limit 200] [--batch-size 8 16]

Aim (issue 39): three built-in tasks × 200 items in under 3 minutes on 2 cores. Task loading (the data built from
the installed packages) is timed apart from scoring. Writes tests/benchmarks/results/bench_task_speed.json and
prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
TASKS = ("moelab_chat_qa", "moelab_lastword", "moelab_math_qa")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "benchmarks" / "results" / "bench_task_speed.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from moelab.settings import get_settings
    from moelab.engine.evaluation.harness import TaskRequest, load_tasks, run_tasks
    from moelab.engine.models import load_model

    adapter = load_model("default", data_dir=get_settings().data_dir, device="cpu", dtype="float32")
    runs = []
    for batch in args.batch_size:
        request = TaskRequest(tasks=TASKS, limit=args.limit, batch_size=batch)
        t0 = time.perf_counter()
        tasks = load_tasks(request)
        t1 = time.perf_counter()
        scores = run_tasks(adapter.model, adapter.tokenizer, request, tasks)
        t2 = time.perf_counter()
        runs.append({"batch_size": batch, "load_tasks_s": t1 - t0, "score_s": t2 - t1, "total_s": t2 - t0,
                     "scores": scores})
    best = min(runs, key=lambda r: r["total_s"])
    result = {"tasks": list(TASKS), "limit": args.limit, "threads": args.threads, "runs": runs,
              "aim_s": 180, "met": best["total_s"] < 180}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    accs = ", ".join(f"{t} {100 * best['scores'][t]['acc']:.1f}%" for t in TASKS)
    print(f"bench_task_speed: 3 tasks x {args.limit} items in {best['total_s']:.0f} s at batch {best['batch_size']} "
          f"(aim < 180 s: {'met' if result['met'] else 'NOT met'}); " + "; ".join(
              f"batch {r['batch_size']}: {r['total_s']:.0f} s" for r in runs) + f"; dense {accs}")


if __name__ == "__main__":
    main()
