"""Downstream accuracy of the recipes through lm-evaluation-harness, in and out of the calibration domain.

    python tests/benchmarks/bench_tasks.py [--work runs/bench_tasks] [--limit 200] [--samples 64]
        [--tasks moelab_chat_qa,moelab_lastword] [--costs 0.75 0.5] [--ood-costs 0.5] [--recipes paper best portable]

Everything goes through the command line a user runs (``moelab profile``, ``convert``, ``evaluate --tasks --json``),
on the default model, 2 CPU threads. Two calibrations (profiles of ``--samples`` × 256 tokens):

* ``in-domain``: ``builtin:mixed`` (its chat and literature parts are the tasks' domains);
* ``out-of-domain``: ``builtin:code+prose+math``: no chat, no literature, so both built-in tasks are out of domain.

For every calibration, recipe (``--recipe paper|best|portable``) and FFN cost (``--sparsity 1 - cost``) the conversion
is scored on the tasks (``--limit`` items each) beside held-out perplexity on ``builtin:mixed``; the ``paper``
evaluation also builds the baselines at its cost (AbsTopK, TEAL: the evaluation's own, matched to that
conversion's ``ffn_flops_fraction``). Conversions and evaluations are cached in ``--work``.

Writes tests/benchmarks/results/bench_tasks.json and prints one summary line, then the tables (Markdown).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CALIBRATIONS = {"in-domain": "builtin:mixed", "out-of-domain": "builtin:code+prose+math"}
BASELINES = ("abstopk", "teal")


def moelab(*args: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    done = subprocess.run([sys.executable, "-m", "moelab.cli", *args], env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"moelab {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_tasks")
    ap.add_argument("--tasks", default="moelab_chat_qa,moelab_lastword")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--costs", type=float, nargs="+", default=[0.75, 0.5])
    ap.add_argument("--ood-costs", type=float, nargs="+", default=None, help="costs of the out-of-domain calibration (default: --costs)")
    ap.add_argument("--recipes", nargs="+", default=["paper", "best", "portable"])
    ap.add_argument("--calibrations", nargs="+", default=list(CALIBRATIONS), choices=list(CALIBRATIONS))
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "benchmarks" / "results" / "bench_tasks.json")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for calib_name in args.calibrations:
        calib = CALIBRATIONS[calib_name]
        prof = args.work / f"profile-{calib_name}"
        if not (prof / "manifest.json").is_file():
            moelab("profile", "--model", "default", "--calib", calib, "--samples", str(args.samples), "--max-tokens", "256",
                   "--out", str(prof), "--quiet")
        for cost in (args.ood_costs or args.costs) if calib_name == "out-of-domain" else args.costs:
            for recipe in args.recipes:
                conv = args.work / f"{calib_name}-{recipe}-{cost}"
                t0 = time.perf_counter()
                if not (conv / "conversion.json").is_file():
                    moelab("convert", "--profile", str(prof), "--recipe", recipe, "--sparsity", f"{1 - cost:.4f}",
                           "--out", str(conv), "--quiet")
                convert_s = time.perf_counter() - t0
                ev_file = args.work / f"{conv.name}.evaluation.json"
                t1 = time.perf_counter()
                if not ev_file.is_file():
                    out = moelab("evaluate", str(conv), "--windows", "16", "--seq-len", "256", "--tasks", args.tasks,
                                 "--limit", str(args.limit), "--json", "--quiet", *([] if recipe == "paper" else ["--no-baselines"]))
                    ev_file.write_text(out)
                report = json.loads(ev_file.read_text())
                evaluate_s = time.perf_counter() - t1
                variants = ["dense", "converted", *(BASELINES if recipe == "paper" else ())]
                for variant in variants:
                    res = report["results"].get(variant)
                    if res is None:
                        continue
                    cost_of = (report["summary"]["ffn_flops_fraction"] if variant == "converted"
                               else res.get("ffn_flops_fraction", 1.0 if variant == "dense" else cost))
                    rows.append({
                        "calibration": calib_name, "target_cost": cost,
                        "variant": variant if variant != "converted" else recipe,
                        "ffn_flops_fraction": cost_of, "perplexity_ratio": res.get("perplexity_ratio", 1.0),
                        "tasks": {t: report["tasks"][t].get(variant) for t in report["tasks"]},
                        "convert_s": convert_s if variant == "converted" else None,
                        "evaluate_s": report["timings"]["total_s"],
                    })
    result = {"tasks": args.tasks.split(","), "limit": args.limit, "samples": args.samples, "rows": rows,
              "total_s": time.perf_counter() - t_start}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    best = [r for r in rows if r["variant"] == "best" and r["calibration"] == "out-of-domain"]
    print("bench_tasks: " + "; ".join(
        f"best@{r['target_cost']} out of domain " + ", ".join(f"{t} {100 * (m or {}).get('acc', float('nan')):.1f}%"
                                                              for t, m in r["tasks"].items()) for r in best)
          + f" ({result['total_s']:.0f} s)")
    print(markdown(result))


def markdown(result: dict[str, Any]) -> str:
    """One table per calibration: a row per variant and cost, a column per task (acc % ± stderr), perplexity beside."""
    out = []
    for calib in dict.fromkeys(r["calibration"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["calibration"] == calib]
        seen: set[tuple[str, float]] = set()
        out.append(f"\n{calib} ({CALIBRATIONS[calib]})\n")
        out.append("| variant | cost | " + " | ".join(result["tasks"]) + " | perplexity × dense |")
        out.append("|---|---|" + "---|" * (len(result["tasks"]) + 1))
        for r in rows:
            key = (r["variant"], round(r["ffn_flops_fraction"], 3))
            if key in seen:
                continue
            seen.add(key)
            cells = []
            for t in result["tasks"]:
                m = r["tasks"].get(t) or {}
                cells.append(f"{100 * m['acc']:.1f} ± {100 * m['acc_stderr']:.1f}" if m.get("acc") is not None else "")
            out.append(f"| {r['variant']} | {r['ffn_flops_fraction']:.3f} | " + " | ".join(cells) + f" | {r['perplexity_ratio']:.2f}× |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
