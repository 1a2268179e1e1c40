"""Training-free quality on the default model: dense vs ExpertWeaver vs CMoE vs baselines.

    python tests/benchmarks/bench_quality.py --profile runs/p1 [--windows 32] [--seq-len 256]

For 25% and 50% sparsity (fraction of FFN neurons not computed per token) it converts the
profiled model with ExpertWeaver (paper defaults α 0.2–0.7, τ 0.6, 64 experts; α read on the
total and on the active budget), CMoE (64 experts, S = A = half the active budget), each with
its paper router and with the gate-mass router, plus AbsTopK-GLU and uniform allocation, and
evaluates all of them with the dense model in one run on held-out text (never calibration
text). Writes tests/benchmarks/results/bench_quality.json and a markdown table next to it,
and prints one summary line.
"""

from __future__ import annotations

import argparse
from typing import Any
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moelab.settings import get_settings  # noqa: E402
from tests.engine.test_conversion import convert  # noqa: E402  (plan + experts + modules, no export)
from workers.engine.core.allocation import summarize  # noqa: E402
from workers.engine.core.slicing import abstopk_modules  # noqa: E402
from workers.engine.methods.cmoe import CMoEParams  # noqa: E402
from workers.engine.methods.expertweaver import ExpertWeaverParams, uniform_params  # noqa: E402
from workers.engine.evaluation.metrics import evaluate_variants, heldout_windows  # noqa: E402
from workers.engine.models import load_model  # noqa: E402
from workers.engine.profiling.store import StoredProfile  # noqa: E402


def configurations(sparsity: float) -> dict[str, Any]:
    active = int(round((1 - sparsity) * 64))
    cm = dict(n_experts=64, shared=active // 2, active=active - active // 2)
    return {
        "expertweaver": ExpertWeaverParams(sparsity=sparsity),
        "expertweaver-gate_mass": ExpertWeaverParams(sparsity=sparsity, router="gate_mass"),
        "expertweaver-active": ExpertWeaverParams(sparsity=sparsity, alpha_basis="active"),
        "expertweaver-active-gate_mass": ExpertWeaverParams(sparsity=sparsity, alpha_basis="active", router="gate_mass"),
        "cmoe": CMoEParams(**cm),
        "cmoe-gate_mass": CMoEParams(**cm, router="gate_mass"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", type=Path, default=ROOT / "runs" / "p1")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "benchmarks" / "results" / "bench_quality.json")
    args = ap.parse_args()

    data_dir = get_settings().data_dir
    profile = StoredProfile.open(args.profile)
    adapter = load_model(profile.manifest["model"]["source"], data_dir=data_dir, dtype="float32")
    windows = heldout_windows(adapter.tokenizer, data_dir, seq_len=args.seq_len, n_windows=args.windows)
    report: dict = {"profile": str(args.profile), "windows": int(len(windows)), "seq_len": args.seq_len, "runs": {}}
    for sparsity in args.sparsity:
        variants: dict = {"dense": None, "abstopk": abstopk_modules(adapter, 1 - sparsity)}
        meta: dict = {}
        for name, params in configurations(sparsity).items():
            t0 = time.perf_counter()
            conv = convert(adapter, profile, params)
            variants[name] = conv.modules
            meta[name] = {"convert_s": time.perf_counter() - t0, "summary": summarize(conv.plan)}
            if name == "expertweaver":
                uni = uniform_params(params, [r.alpha for r in conv.plan])
                t0 = time.perf_counter()
                variants["uniform"] = convert(adapter, profile, uni).modules
                meta["uniform"] = {"convert_s": time.perf_counter() - t0, "alpha": uni.allocation.alpha_min}
        results = evaluate_variants(adapter, variants, windows)
        for name, r in results.items():
            r.update(meta.get(name, {}))
            r.pop("routing", None)  # per-expert loads are large; the CLI shows them per conversion
        report["runs"][str(sparsity)] = results
        del variants

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    lines = ["| sparsity | variant | perplexity | × dense | mean FFN rel. error | convert s |", "|---|---|---|---|---|---|"]
    for sparsity, results in report["runs"].items():
        for name, r in results.items():
            rec = r.get("reconstruction_error")
            mean_rec = f"{sum(rec) / len(rec):.3f}" if rec else "-"
            conv_s = f"{r['convert_s']:.1f}" if "convert_s" in r else "-"
            lines.append(f"| {sparsity} | {name} | {r['perplexity']:.2f} | {r['perplexity_ratio']:.2f} | {mean_rec} | {conv_s} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    summary = ", ".join(
        f"{s}: EW {res['expertweaver']['perplexity_ratio']:.2f}x / EW-gm {res['expertweaver-gate_mass']['perplexity_ratio']:.2f}x "
        f"/ CMoE {res['cmoe']['perplexity_ratio']:.2f}x / AbsTopK {res['abstopk']['perplexity_ratio']:.2f}x"
        for s, res in report["runs"].items()
    )
    print(f"bench_quality: dense ppl {report['runs'][str(args.sparsity[0])]['dense']['perplexity']:.2f}; ppl ratio at sparsity {summary}")


if __name__ == "__main__":
    main()
