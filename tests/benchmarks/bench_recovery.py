"""Recovery fine-tuning on the default model: perplexity before vs after a short CPU run, per conversion.

    python tests/benchmarks/bench_recovery.py [--work runs/bench_recovery] [--runs best-0.75 best-0.5 ...]
        [--steps 90] [--profile runs/p1]

Every run converts the default model (profiles and conversions are made once and cached in
``--work``; ``--profile`` reuses a stored ``builtin:mixed`` profile instead), fine-tunes it with
``FinetuneParams`` in the run's mode (defaults unless overridden here) and reads the run's summary:
held-out perplexity of the training-free conversion (before), where training starts (start:
differs from before only when the mode changes the model, EW Eq. 11), after, and the dense
model's on the same windows; the conversion's ``ffn_flops_fraction``, steps, tokens, seconds,
peak RSS. Runs (``RUNS``):

* cmoe / cmoe-0.5: CMoE 24·24·64 / 16·16·64 (25% / 50% sparsity, representative router);
* expertweaver / expertweaver-0.5: paper settings at 25% / 50% sparsity (centroid router);
* best-0.75 / best-0.5: ``--recipe best`` at ``ffn_flops_fraction`` ≤ 0.75 / 0.5 (ridge router,
  budget plan), fine-tuned in mode ``cmoe`` (gate scale u, balancing bias b and LoRA on the
  training-free sum: the same function at step 0, so the fitted router is kept; mode
  ``expertweaver`` would replace it by a softmax router initialised from gate centroids);
* portable-0.75 / portable-0.5: ``--recipe portable`` at ``ffn_flops_fraction`` ≤ 0.75 / 0.5, fine-tuned
  in mode ``expertweaver`` (EW Eq. 11: softmax router, weighted combine), whose result must export:
  the run records ``native_layout`` and ``gguf_layout`` of the fine-tuned model (or why not);
* dense2moe: the defaults (D2 §4.2: n* = 5 pruned blocks, 6 experts, top-1; δ 0.3);
* midas: one expert per built-in set (code, prose, literature, chat), keep ratio 0.25, top-2.

``--leave-out DOMAIN`` (code, prose, literature or chat): the run out of domain, as
``bench_frontier --protocol leave-domain-out`` measures it: converted from that fold's profile
(``--fold-work``, built there when missing), fine-tuned on the fold's calibration text (every part of
``builtin:mixed`` but the domain and its companions) and scored on the left-out domain's held-out
text; recorded as ``NAME@without-DOMAIN``.

"≤ 15 minutes of CPU fine-tuning" is a number of steps only on a given machine: ``--recipe best`` at 0.5 takes
6.3 to 12.4 s a step of 4 × 256 tokens on 2 idle cores (9.5 s with ``--distill``, the teacher's forward); size
``--steps`` from ``seconds_per_step``. ``train_s`` is the wall time measured (longer when the machine is shared).

Writes tests/benchmarks/results/bench_recovery.json (a finished run is not re-run unless
``--fresh`` or its parameters changed) and prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moelab.settings import get_settings  # noqa: E402
from moelab.engine.methods import get_method  # noqa: E402
from moelab.engine.methods.cmoe import CMoEParams  # noqa: E402
from moelab.engine.methods.expertweaver import ExpertWeaverParams  # noqa: E402
from moelab.engine.methods.dense2moe import Dense2MoEParams  # noqa: E402
from moelab.engine.training.finetune import FinetuneParams, read_train_log, run_finetune  # noqa: E402
from moelab.engine.methods.midas import MidasParams  # noqa: E402
from moelab.engine.profiling.profiler import ProfileSettings  # noqa: E402
from moelab.engine.runs import run_conversion, run_profile  # noqa: E402

MIDAS_SETS = ("code", "prose", "literature", "chat")
_best = get_method("expertweaver").recipe
#: run name -> (fine-tuning mode, conversion parameters)
RUNS: dict[str, tuple[str, Any]] = {
    "cmoe": ("cmoe", CMoEParams(n_experts=64, shared=24, active=24)),
    "cmoe-0.5": ("cmoe", CMoEParams(n_experts=64, shared=16, active=16)),
    "expertweaver": ("expertweaver", ExpertWeaverParams()),
    "expertweaver-0.5": ("expertweaver", ExpertWeaverParams(sparsity=0.5)),
    "best-0.75": ("cmoe", _best("best", sparsity=0.25)),
    "best-0.5": ("cmoe", _best("best", sparsity=0.5)),
    "portable-0.75": ("expertweaver", _best("portable", sparsity=0.25)),
    "portable-0.5": ("expertweaver", _best("portable", sparsity=0.5)),
    "dense2moe": ("dense2moe", Dense2MoEParams()),
    "midas": ("midas", MidasParams()),
}


def profile(work: Path, calib: str, samples: int, data_dir: Path) -> Path:
    out = work / "profiles" / calib.replace(":", "-")
    if not (out / "manifest.json").is_file():
        t0 = time.perf_counter()
        run_profile("default", calib, out, ProfileSettings(), samples=samples, data_dir=data_dir)
        print(f"  profiled {calib} ({samples} samples) in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def conversion(work: Path, name: str, samples: int, data_dir: Path, mixed: Path | None, tag: str = "") -> Path:
    """The run's conversion, made once (``mixed``: a stored profile to convert from; ``tag``: its fold)."""
    out = work / "conversions" / (name + tag)
    params = RUNS[name][1]
    if (out / "conversion.json").is_file() and json.loads((out / "conversion.json").read_text())["params"] == params.to_dict():
        return out
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    if params.method == "midas":
        profs = [profile(work, f"builtin:{s}", samples // 2, data_dir) for s in MIDAS_SETS]
        run_conversion(profs[0], params, out, data_dir=data_dir, extra_profiles=profs[1:])
    else:
        run_conversion(mixed or profile(work, "builtin:mixed", samples, data_dir), params, out, data_dir=data_dir)
    print(f"  converted {name} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def exportable(model_dir: Path) -> dict[str, Any]:
    """The native HF and GGUF layouts of a fine-tuned model, or why each is refused."""
    from moelab.engine.runtime.gguf_export import GgufExportError, gguf_layout
    from moelab.engine.runtime.modeling_moelab import MoelabForCausalLM
    from moelab.engine.runtime.native_export import NativeExportError, native_layout

    out: dict[str, Any] = {}
    try:
        out["native_layout"] = native_layout(MoelabForCausalLM.from_pretrained(str(model_dir)))
    except NativeExportError as exc:
        out["native_layout"] = f"refused: {exc}"
    try:
        layout = gguf_layout(json.loads((Path(model_dir) / "config.json").read_text()))
        out["gguf_layout"] = {k: v for k, v in layout.items() if k != "shared_padding"}
    except GgufExportError as exc:
        out["gguf_layout"] = f"refused: {exc}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_recovery")
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    ap.add_argument("--profile", type=Path, default=None, help="a stored builtin:mixed profile to convert from")
    ap.add_argument("--samples", type=int, default=120, help="profile samples (MIDAS: half, per set)")
    ap.add_argument("--steps", type=int, default=None, help="override FinetuneParams.steps")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--router-lr", type=float, default=None)
    ap.add_argument("--distill", type=float, default=None, help="override FinetuneParams.distill (dense teacher's weight)")
    ap.add_argument("--fresh", action="store_true", help="re-run runs already in the results file")
    ap.add_argument("--prepare", action="store_true", help="only make the profiles and conversions")
    ap.add_argument("--leave-out", choices=("code", "prose", "literature", "chat"), default=None,
                    help="out of domain: convert and fine-tune without this domain, score on it")
    ap.add_argument("--fold-work", type=Path, default=ROOT / "runs" / "frontier_ldo", help="the folds' profiles")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "benchmarks" / "results" / "bench_recovery.json")
    args = ap.parse_args()
    fold: dict[str, str] = {}
    if args.leave_out:
        from bench_frontier import fold_calibration, fold_profile_dir, profile_at

        domain = f"builtin:{args.leave_out}"
        args.profile = fold_profile_dir(args.fold_work, domain)
        profile_at(args.profile, "default", fold_calibration(domain), 240, get_settings().data_dir)
        fold = {"source": fold_calibration(domain), "eval_source": domain}
    tag = f"@without-{args.leave_out}" if args.leave_out else ""

    data_dir = get_settings().data_dir
    report = json.loads(args.out.read_text()) if args.out.is_file() and not args.fresh else {"runs": {}}
    if args.prepare:
        for name in args.runs:
            conversion(args.work, name, args.samples, data_dir, args.profile, tag)
        return
    overrides = {k: v for k, v in (("steps", args.steps), ("lr", args.lr), ("router_lr", args.router_lr),
                                    ("distill", args.distill)) if v is not None}
    for name in args.runs:
        mode, conv_params = RUNS[name]
        params = FinetuneParams(mode=mode, **overrides, **fold)
        done = report["runs"].get(name + tag)
        if done and done["params"] == params.to_dict() and done.get("conversion_params") == conv_params.to_dict():
            continue
        print(f"{name}{tag}:", flush=True)
        conv = conversion(args.work, name, args.samples, data_dir, args.profile, tag)
        out = args.work / "finetunes" / (name + tag)
        if out.exists() and (read_train_log(out) or {}).get("params") != params.to_dict():
            shutil.rmtree(out)  # a different configuration: start over (same one: resume)
        summary = run_finetune(conv, params, out, data_dir=data_dir)
        log = read_train_log(out)
        steps = log["steps"]
        conv_summary = json.loads((conv / "conversion.json").read_text())["summary"]
        report["runs"][name + tag] = {
            **summary,
            "conversion_params": conv_params.to_dict(),
            "conversion_summary": conv_summary,
            "ffn_flops_fraction": conv_summary.get("ffn_flops_fraction"),
            "ratio_before": summary["perplexity_before"] / summary["dense_perplexity"],
            "ratio_after": summary["perplexity_after"] / summary["dense_perplexity"],
            "loss_first": [s["ntp_loss"] for s in steps[:5]],
            "loss_last": [s["ntp_loss"] for s in steps[-5:]],
            "load_cv_first": steps[0].get("load_cv"), "load_cv_last": steps[-1].get("load_cv"),
            "seconds_per_step": summary["train_s"] / max(1, summary["steps"]),
            "improved": summary["perplexity_after"] < summary["perplexity_before"],
            **(exportable(Path(summary["model"])) if name.startswith("portable") else {}),
        }
        print(f"  {name}: ppl {summary['perplexity_before']:.2f} -> {summary['perplexity_after']:.2f} "
              f"(start {summary['perplexity_start']:.2f}, dense {summary['dense_perplexity']:.2f}) in "
              f"{summary['train_s']:.0f} s", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(args.out)
    runs = report["runs"]
    line = "; ".join(
        f"{m} {r['perplexity_before']:.2f}->{r['perplexity_after']:.2f}"
        + (f" @{r['ffn_flops_fraction']:.3f}" if r.get("ffn_flops_fraction") is not None else "")
        + f" ({r['steps']} steps, {r['train_s'] / 60:.1f} min)"
        for m, r in runs.items()
    )
    dense = next(iter(runs.values()))["dense_perplexity"] if runs else float("nan")
    print(f"bench_recovery: dense ppl {dense:.2f}; held-out ppl before->after: {line}")


if __name__ == "__main__":
    main()
