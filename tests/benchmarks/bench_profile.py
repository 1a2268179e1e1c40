"""Profiling throughput against a plain forward pass, measured in the same run.

    python tests/benchmarks/bench_profile.py [--samples 240] [--max-tokens 256]

Both passes see the same tokens in the same batches (the profiler's length-sorted batches),
so the ratio isolates the cost of the hooks and statistics. The plain pass runs before and
after the profile and its mean is used, to damp drift on a noisy machine. Writes
``tests/benchmarks/results/bench_profile.json`` and prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moelab.settings import get_settings  # noqa: E402
from moelab.engine.data.calibration import load_calibration  # noqa: E402
from moelab.engine.models import load_model  # noqa: E402
from moelab.engine.profiling.profiler import ProfileSettings, length_sorted_batches, profile_model  # noqa: E402


def plain_forward(adapter, texts: list[str], settings: ProfileSettings) -> float:
    tok = adapter.tokenizer
    enc = tok(texts, truncation=True, max_length=settings.max_tokens)
    lengths = torch.tensor([len(x) for x in enc["input_ids"]]).numpy()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for rows in length_sorted_batches(lengths, settings.batch_tokens):
            batch = tok.pad({"input_ids": [enc["input_ids"][r] for r in rows]}, return_tensors="pt")
            adapter.decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--calib", default="builtin:mixed")
    ap.add_argument("--samples", type=int, default=240)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "benchmarks" / "results" / "bench_profile.json")
    args = ap.parse_args()

    data_dir = get_settings().data_dir
    adapter = load_model(args.model, data_dir=data_dir)
    cset = load_calibration(args.calib, samples=args.samples, seed=0, data_dir=data_dir)
    settings = ProfileSettings(max_tokens=args.max_tokens)
    texts = [s.text for s in cset.samples]

    plain_before = plain_forward(adapter, texts, settings)
    t0 = time.perf_counter()
    result = profile_model(adapter, cset, settings)
    profile_total = time.perf_counter() - t0
    plain_after = plain_forward(adapter, texts, settings)
    plain = (plain_before + plain_after) / 2
    tokens = result.n_tokens
    record = {
        "model": args.model,
        "calibration": args.calib,
        "samples": args.samples,
        "max_tokens": args.max_tokens,
        "tokens": tokens,
        "threads": torch.get_num_threads(),
        "plain_forward_s": [plain_before, plain_after],
        "profile_forward_s": result.timings["forward_s"],
        "profile_total_s": profile_total,
        "plain_tokens_per_s": tokens / plain,
        "profile_tokens_per_s": tokens / result.timings["forward_s"],
        "profile_cost_ratio": result.timings["forward_s"] / plain,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"bench_profile: {tokens} tokens, profile {record['profile_tokens_per_s']:.0f} tok/s vs plain "
        f"{record['plain_tokens_per_s']:.0f} tok/s = {record['profile_cost_ratio']:.2f}x cost, "
        f"profile {profile_total:.1f}s, peak RSS {record['peak_rss_mib']:.0f} MiB"
    )


if __name__ == "__main__":
    main()
