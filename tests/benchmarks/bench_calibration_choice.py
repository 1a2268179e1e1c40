"""Which calibration set and size generalise: ``--recipe best`` calibrated three ways, scored out of domain.

Issue 27 asks for the calibration default (set, size) that generalises best, with the numbers that
chose it. For each fold of ``bench_frontier``'s leave-domain-out protocol (a scored domain left out
of calibration with its companions, ``LEAVE_OUT``), ``--recipe best`` is converted from:

- ``mix-240``: the fold's mix of every other part of ``builtin:mixed``, 240 samples (the fold
  profile ``bench_frontier`` builds, reused from ``--work`` when it is there);
- ``mix-60``: the same mix, 60 samples (a quarter of the text: the fit reads what the text holds);
- ``one-240``: a single other part, 240 samples (``prose``, or ``chat`` where prose is left out);

and scored on the four domains' held-out windows (the same windows and dense perplexities as
``bench_frontier``). ``out``: the ratio to dense on the left-out domain; ``others``: the geomean on
the three other domains (all in the calibration of ``mix-*``; one of them in ``one-240``'s). Writes ``results/bench_calibration_choice.json`` and prints one
summary line.

    python tests/benchmarks/bench_calibration_choice.py --folds literature code --level 0.75
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_frontier import (DOMAINS, LEAVE_OUT, RESULTS, _geomean, fit_inputs_for, fold_calibration,  # noqa: E402
                            fold_profile_dir, profile_at)

from moelab.settings import get_settings  # noqa: E402
from moelab.engine.core.slicing import partition_modules  # noqa: E402
from moelab.engine.evaluation.metrics import evaluate_variants, heldout_windows  # noqa: E402
from moelab.engine.methods import expertweaver, get_method  # noqa: E402
from moelab.engine.models import load_model  # noqa: E402


def single_part(domain: str) -> str:
    """The one other part a fold's ``one-240`` calibration reads: prose, or chat where prose is left out."""
    return "builtin:chat" if "prose" in LEAVE_OUT[domain] else "builtin:prose"


def calibrations(domain: str, work: Path) -> dict[str, tuple[str, int, Path]]:
    """Name -> (calibration spec, samples, profile directory) of one fold."""
    name = domain.split(":", 1)[1]
    mix = fold_calibration(domain)
    return {"mix-240": (mix, 240, fold_profile_dir(work, domain)),
            "mix-60": (mix, 60, work / f"profile-without-{name}-60"),
            "one-240": (single_part(domain), 240, work / f"profile-{single_part(domain).split(':')[1]}-for-{name}")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folds", nargs="+", default=["literature", "code"], help="left-out domains (builtin:<name>)")
    ap.add_argument("--level", type=float, default=0.75, help="ffn_flops_fraction budget (1 − sparsity)")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "frontier_ldo")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_calibration_choice.json")
    ap.add_argument("--resume", action="store_true", help="keep the folds already in --out at the same level and parameters")
    args = ap.parse_args()
    t0 = time.perf_counter()
    data_dir = get_settings().data_dir
    adapter = load_model("default", data_dir=data_dir, dtype="float32")
    windows = {dom: heldout_windows(adapter.tokenizer, data_dir, seq_len=256, n_windows=args.windows, source=dom)
               for dom in DOMAINS}
    dense = {dom: evaluate_variants(adapter, {"dense": None}, w, reconstruction=False)["dense"]["perplexity"]
             for dom, w in windows.items()}
    params = get_method("expertweaver").recipe("best", sparsity=round(1 - args.level, 6))
    report: dict[str, Any] = {"model": "default", "level": args.level, "params": params.to_dict(), "dense": dense,
                              "heldout": {"windows": args.windows, "seq_len": 256}, "folds": {}}
    old = json.loads(args.out.read_text()) if args.resume and args.out.is_file() else {}
    if all(old.get(k) == report[k] for k in ("level", "params", "dense", "heldout")):
        report["folds"] = old.get("folds", {})
    for fold in args.folds:
        domain = f"builtin:{fold}"
        if domain in report["folds"]:
            continue
        rows = report["folds"][domain] = {}
        for name, (spec, samples, pdir) in calibrations(domain, args.work).items():
            profile = profile_at(pdir, "default", spec, samples, data_dir)
            calib = fit_inputs_for(adapter, profile, data_dir)(params.fit_tokens)
            _, _, modules, _ = partition_modules(adapter, profile, params, expertweaver.plan_for(profile, params),
                                                 expertweaver.layer_builder(profile, params), data_dir=data_dir, calib=calib)
            ratios = {dom: evaluate_variants(adapter, {name: modules}, w, reconstruction=False)[name]["perplexity"] / dense[dom]
                      for dom, w in windows.items()}
            rows[name] = {"calibration": spec, "samples": samples, "fit_tokens": calib.n_tokens, "ratio_by_domain": ratios,
                          "out": ratios[domain], "others": _geomean([r for d, r in ratios.items() if d != domain])}
            print(f"{domain} {name}: out {rows[name]['out']:.2f}x others {rows[name]['others']:.2f}x ({calib.n_tokens} fit tokens)",
                  flush=True)
    names = ("mix-240", "mix-60", "one-240")
    report["summary"] = {n: {"out": _geomean([f[n]["out"] for f in report["folds"].values()]),
                             "others": _geomean([f[n]["others"] for f in report["folds"].values()])} for n in names}
    report["seconds"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(args.out)
    print(f"bench_calibration_choice ({', '.join(args.folds)} left out, cost ≤ {args.level}): ppl/dense out / others: "
          + ", ".join(f"{n} {v['out']:.2f}x/{v['others']:.2f}x" for n, v in report["summary"].items()))


if __name__ == "__main__":
    main()
