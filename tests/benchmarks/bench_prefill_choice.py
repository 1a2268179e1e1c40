"""A conversion's long forward passes with the prefill's choice between the pairs kernel and two GEMMs over every
expert as this machine measures it (``moelab_native.dense_shares``) against the fixed shares (``NATIVE_DENSE_SHARE``,
``NATIVE_DENSE_SHARE_LONG``: 70% and 55%, measured on a Xeon), and the dense model, in one process, interleaved.

    python tests/benchmarks/bench_prefill_choice.py CONVERSION [--threads 2] [--repeats 4] [--out FILE]

CONVERSION: a ``moelab convert`` output (e.g. the README's ``--recipe best --sparsity 0.25``), loaded with its own
bundled runtime replaced by this checkout's (re-exported into a temporary directory). Passes: an evaluation's
perplexity batch (8 windows of 256 tokens: 2,048 tokens a call), one 2,048-token sequence and one of 512 tokens, all
positions' logits (as perplexity computes them). Writes tests/benchmarks/results/bench_prefill_choice.json and prints
one summary line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moelab.engine.models import load_model  # noqa: E402
from moelab.engine.runs import read_conversion  # noqa: E402
from moelab.engine.runtime.export import copy_runtime, load_exported  # noqa: E402
from moelab.settings import get_settings  # noqa: E402

OUT = ROOT / "tests" / "benchmarks" / "results" / "bench_prefill_choice.json"
PASSES = {"8x256": (8, 256), "1x2048": (1, 2048), "1x512": (1, 512)}


def runtime_modules() -> list:
    """Every loaded copy of the native kernels' module (moelab's and the exported model's)."""
    return [m for name, m in sys.modules.items() if name.endswith("moelab_native") and hasattr(m, "_shares")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("conversion", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    record = read_conversion(args.conversion)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(args.conversion, tmp, dirs_exist_ok=True)
        copy_runtime(Path(tmp))  # this checkout's runtime, not the one bundled when it was converted
        converted = load_exported(tmp).eval()
    dense = load_model(record["model"]["source"], data_dir=get_settings().data_dir, device="cpu",
                       dtype="float32").model.eval()
    mods = runtime_modules()
    measured = mods[0].dense_shares()
    fixed = (mods[0].NATIVE_DENSE_SHARE, mods[0].NATIVE_DENSE_SHARE_LONG)
    gen = torch.Generator().manual_seed(0)
    inputs = {name: torch.randint(0, dense.config.vocab_size, shape, generator=gen) for name, shape in PASSES.items()}

    def with_shares(shares):
        def run(x):
            for m in mods:
                m._shares.clear()
                m._shares[torch.get_num_threads()] = shares
            converted(input_ids=x, use_cache=False)
        return run

    models = {"dense": lambda x: dense(input_ids=x, use_cache=False), "fixed": with_shares(fixed),
              "measured": with_shares(measured)}
    times = {p: {name: [] for name in models} for p in PASSES}
    with torch.inference_mode():
        for round_ in range(args.repeats + 1):  # round 0 untimed
            for p, x in inputs.items():
                for name, run in models.items():
                    t0 = time.perf_counter()
                    run(x)
                    if round_:
                        times[p][name].append(time.perf_counter() - t0)
    result = {"conversion": str(args.conversion), "threads": args.threads, "repeats": args.repeats,
              "measured_shares": list(measured), "fixed_shares": list(fixed), "passes": {}}
    for p, by in times.items():
        med = {name: statistics.median(v) for name, v in by.items()}
        result["passes"][p] = {"seconds": by, "median_s": med, "fixed_over_measured": med["fixed"] / med["measured"],
                               "speedup_fixed": med["dense"] / med["fixed"], "speedup_measured": med["dense"] / med["measured"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    words = "; ".join(f"{p} {v['speedup_fixed']:.2f}× → {v['speedup_measured']:.2f}× dense" for p, v in result["passes"].items())
    print(f"prefill choice, shares {fixed[0]:.2f}/{fixed[1]:.2f} → measured {measured[0]:.2f}/{measured[1]:.2f}: {words}")


if __name__ == "__main__":
    main()
