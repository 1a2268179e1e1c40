"""Recovery fine-tuning on the default model: perplexity before vs after a short CPU run, per mode.

    python tests/benchmarks/bench_recovery.py [--work runs/bench_recovery] [--steps 200] [--modes cmoe ...]

For every mode (cmoe, expertweaver, midas, dense2moe) it converts the default model with that
method (profiles and conversions are made once and cached in ``--work``), fine-tunes it with
``FinetuneParams`` (defaults unless overridden here) and reads the run's summary: held-out
perplexity of the training-free conversion (before), where training starts (start: differs
from before only when the mode changes the model, EW Eq. 11), after, and the dense model's on
the same windows; steps, tokens, seconds, peak RSS. Conversions:

* cmoe: CMoE 24·24·64 (25% sparsity, representative router; as in bench_frontier.py);
* expertweaver: paper defaults (α 0.2–0.7, τ 0.6, 64 experts, 25% sparsity, centroid router);
* dense2moe: the defaults (D2 §4.2: n* = 5 pruned blocks, N = M = 1 so 6 experts, top-1; δ 0.3;
  results recorded before these defaults (n* = 1, top-2, whose router got no gradient) are stale);
* midas: one expert per built-in set (code, prose, literature, chat), keep ratio 0.25, top-2.

Writes tests/benchmarks/results/bench_recovery.json (a finished mode is not re-run unless
``--fresh``) and prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moelab.settings import get_settings  # noqa: E402
from workers.engine.methods.cmoe import CMoEParams  # noqa: E402
from workers.engine.methods.expertweaver import ExpertWeaverParams  # noqa: E402
from workers.engine.methods.dense2moe import Dense2MoEParams  # noqa: E402
from workers.engine.training.finetune import FinetuneParams, read_train_log, run_finetune  # noqa: E402
from workers.engine.methods.midas import MidasParams  # noqa: E402
from workers.engine.profiling.profiler import ProfileSettings  # noqa: E402
from workers.engine.runs import run_conversion, run_profile  # noqa: E402

MODES = ("cmoe", "expertweaver", "midas", "dense2moe")
MIDAS_SETS = ("code", "prose", "literature", "chat")
CONVERSIONS = {
    "cmoe": CMoEParams(n_experts=64, shared=24, active=24),
    "expertweaver": ExpertWeaverParams(),
    "dense2moe": Dense2MoEParams(),
    "midas": MidasParams(),
}


def profile(work: Path, calib: str, samples: int, data_dir: Path) -> Path:
    out = work / "profiles" / calib.replace(":", "-")
    if not (out / "manifest.json").is_file():
        t0 = time.perf_counter()
        run_profile("default", calib, out, ProfileSettings(), samples=samples, data_dir=data_dir)
        print(f"  profiled {calib} ({samples} samples) in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def conversion(work: Path, mode: str, samples: int, data_dir: Path) -> Path:
    out = work / "conversions" / mode
    if (out / "conversion.json").is_file():
        return out
    t0 = time.perf_counter()
    if mode == "midas":
        profs = [profile(work, f"builtin:{name}", samples // 2, data_dir) for name in MIDAS_SETS]
        run_conversion(profs[0], CONVERSIONS[mode], out, data_dir=data_dir, extra_profiles=profs[1:])
    else:
        run_conversion(profile(work, "builtin:mixed", samples, data_dir), CONVERSIONS[mode], out, data_dir=data_dir)
    print(f"  converted {mode} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_recovery")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--samples", type=int, default=120, help="profile samples (MIDAS: half, per set)")
    ap.add_argument("--steps", type=int, default=None, help="override FinetuneParams.steps")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--router-lr", type=float, default=None)
    ap.add_argument("--fresh", action="store_true", help="re-run modes already in the results file")
    ap.add_argument("--prepare", action="store_true", help="only make the profiles and conversions")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "benchmarks" / "results" / "bench_recovery.json")
    args = ap.parse_args()

    data_dir = get_settings().data_dir
    report = json.loads(args.out.read_text()) if args.out.is_file() and not args.fresh else {"runs": {}}
    if args.prepare:
        for mode in args.modes:
            conversion(args.work, mode, args.samples, data_dir)
        return
    overrides = {k: v for k, v in (("steps", args.steps), ("lr", args.lr), ("router_lr", args.router_lr)) if v is not None}
    for mode in args.modes:
        params = FinetuneParams(mode=mode, **overrides)
        if mode in report["runs"] and report["runs"][mode]["params"] == params.to_dict():
            continue
        print(f"{mode}:", flush=True)
        conv = conversion(args.work, mode, args.samples, data_dir)
        out = args.work / "finetunes" / mode
        if out.exists() and (read_train_log(out) or {}).get("params") != params.to_dict():
            shutil.rmtree(out)  # a different configuration: start over (same one: resume)
        summary = run_finetune(conv, params, out, data_dir=data_dir)
        log = read_train_log(out)
        steps = log["steps"]
        report["runs"][mode] = {
            **summary,
            "conversion_summary": json.loads((conv / "conversion.json").read_text())["summary"],
            "loss_first": [s["ntp_loss"] for s in steps[:5]],
            "loss_last": [s["ntp_loss"] for s in steps[-5:]],
            "load_cv_first": steps[0].get("load_cv"), "load_cv_last": steps[-1].get("load_cv"),
            "seconds_per_step": summary["train_s"] / max(1, summary["steps"]),
            "improved": summary["perplexity_after"] < summary["perplexity_before"],
        }
        print(f"  {mode}: ppl {summary['perplexity_before']:.2f} -> {summary['perplexity_after']:.2f} "
              f"(start {summary['perplexity_start']:.2f}, dense {summary['dense_perplexity']:.2f}) in "
              f"{summary['train_s']:.0f} s", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    runs = report["runs"]
    line = "; ".join(
        f"{m} {r['perplexity_before']:.2f}->{r['perplexity_after']:.2f} ({r['steps']} steps, {r['train_s'] / 60:.1f} min)"
        for m, r in runs.items()
    )
    dense = next(iter(runs.values()))["dense_perplexity"] if runs else float("nan")
    print(f"bench_recovery: dense ppl {dense:.2f}; held-out ppl before->after: {line}")


if __name__ == "__main__":
    main()
