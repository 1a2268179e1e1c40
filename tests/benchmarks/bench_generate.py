"""Whole converted models against the dense model, as a user runs them: ``from_pretrained`` of a
conversion directory, a prefill of ``--prompt-tokens`` tokens and a greedy decode of ``--new-tokens``.

    python tests/benchmarks/bench_generate.py [--profile runs/p1] [--sparsity 0.5] [--experts 64 16]
        [--prompt-tokens 512] [--new-tokens 64] [--repeats 3] [--threads 2] [--devices cpu cuda] [--work DIR]
        [--conversion NAME=DIR ...]

The conversions are real ones of the default model (``moelab convert --method cmoe``: 1/8 of the
experts shared, the rest routed by CMoE's representative neurons, top-k set by ``--sparsity``; the
paper's training-free combine), built from ``--profile`` or from a small profile made here (speed
does not depend on the calibration size, routing balance does a little). Each conversion directory
is loaded with ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`` exactly as
the README tells a user to. The dense model is the same checkpoint the conversion came from.

Per model, interleaved round by round (so every ratio comes from one machine state):
- prefill: one forward over the prompt (``use_cache=True``, the cache a generation would start from);
- decode: ``generate(max_new_tokens=N, min_new_tokens=N, do_sample=False)`` from a short prompt,
  timed whole, minus that prompt's own prefill, divided by N (so it is the per-token decode cost).
Medians of ``--repeats`` rounds; speed-up = dense time / converted time. On a CUDA machine the same
runs repeat on the GPU (times synchronised). ``ffn_flops_fraction`` is read from each conversion's
``conversion.json``: the cost the speed-up should be compared with.

Writes tests/benchmarks/results/bench_generate.json and prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "tests" / "benchmarks" / "results" / "bench_generate.json"

from bench_moe_ffn import bench_text  # noqa: E402  (this directory: stdlib source text as real tokens)
from moelab.engine.runtime.export import copy_runtime  # noqa: E402
SHARED_FRACTION = 1 / 8


def _cli(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "moelab.cli", *args], check=True, env=env, cwd=ROOT)


def build_profile(out: Path, env: dict[str, str]) -> Path:
    _cli("profile", "--model", "default", "--calib", "builtin:mixed", "--samples", "48", "--max-tokens", "128",
         "--quiet", "--out", str(out), env=env)
    return out


def convert(profile: Path, experts: int, sparsity: float, out: Path, env: dict[str, str]) -> Path:
    """CMoE S·A·E at ``sparsity``: S = E/8 shared, A routed so that (S + A)/E = 1 − sparsity."""
    shared = max(1, round(experts * SHARED_FRACTION))
    active = round((1 - sparsity) * experts) - shared
    if active < 1:
        raise SystemExit(f"--sparsity {sparsity} leaves no routed expert with {experts} experts")
    _cli("convert", "--method", "cmoe", "--profile", str(profile), "--n-experts", str(experts), "--shared", str(shared),
         "--active", str(active), "--out", str(out), "--quiet", env=env)
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timings(models: dict[str, torch.nn.Module], prompt: torch.Tensor, short: torch.Tensor, new_tokens: int,
            repeats: int, device: str, pad_id: int | None) -> dict[str, dict[str, list[float]]]:
    """Seconds per prefill, per short-prompt prefill and per whole generate call, for every model,
    interleaved in a rotating random order after one warm-up round."""
    rng = random.Random(0)
    names = list(models)
    out = {n: {"prefill": [], "short_prefill": [], "generate": []} for n in names}

    def once(name: str, record: bool) -> None:
        model = models[name]
        for key, fn in (
            ("prefill", lambda: model(input_ids=prompt, use_cache=True, logits_to_keep=1)),
            ("short_prefill", lambda: model(input_ids=short, use_cache=True, logits_to_keep=1)),
            ("generate", lambda: model.generate(input_ids=short, attention_mask=torch.ones_like(short),
                                                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                do_sample=False, pad_token_id=pad_id)),
        ):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if record:
                out[name][key].append(time.perf_counter() - t0)

    with torch.inference_mode():
        for name in names:
            once(name, record=False)
        for _ in range(repeats):
            rng.shuffle(names)
            for name in names:
                once(name, record=True)
    return out


def summarise(raw: dict[str, dict[str, list[float]]], prompt_tokens: int, new_tokens: int) -> dict[str, dict[str, float]]:
    rows = {}
    for name, t in raw.items():
        prefill = statistics.median(t["prefill"])
        decode = (statistics.median(t["generate"]) - statistics.median(t["short_prefill"])) / new_tokens
        rows[name] = {"prefill_s": prefill, "prefill_tokens_per_s": prompt_tokens / prefill,
                      "decode_s_per_token": decode, "decode_tokens_per_s": 1.0 / decode, "raw": t}
    dense = rows["dense"]
    for name, r in rows.items():
        r["prefill_speedup"] = dense["prefill_s"] / r["prefill_s"]
        r["decode_speedup"] = dense["decode_s_per_token"] / r["decode_s_per_token"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", type=Path, default=None, help="a profile of the default model (default: make a small one)")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--experts", type=int, nargs="*", default=[64, 16], help="CMoE conversions to make and time (none: only --conversion)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--short-tokens", type=int, default=8, help="prompt of the decode runs")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-cache", type=Path, default=ROOT / ".moelab" / "test-data", help="MOELAB_DATA_DIR holding the default model")
    ap.add_argument("--work", type=Path, default=None, help="keep the profile and conversions here (default: a temporary dir)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--conversion", nargs="+", default=[], metavar="NAME=DIR",
                    help="also time these conversion directories (e.g. --recipe best with and without --down-keep)")
    ap.add_argument("--devices", nargs="+", choices=("cpu", "cuda"), default=None,
                    help="default: cpu, and cuda when a CUDA device is present")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started, load_before = time.perf_counter(), os.getloadavg()
    env = {**os.environ, "MOELAB_DATA_DIR": str(args.model_cache), "HF_HUB_OFFLINE": "1"}
    os.environ.update({"MOELAB_DATA_DIR": str(args.model_cache), "HF_HUB_OFFLINE": "1"})
    work = args.work or Path(tempfile.mkdtemp(prefix="moelab-bench-generate-"))
    work.mkdir(parents=True, exist_ok=True)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moelab.engine.models import cache_default_model

    profile = args.profile or (work / "profile" if (work / "profile" / "manifest.json").is_file() else build_profile(work / "profile", env))
    conversions = {}
    for experts in args.experts:
        out = work / f"cmoe-{experts}-{int(args.sparsity * 100)}"
        if not (out / "conversion.json").is_file():
            convert(profile, experts, args.sparsity, out, env)
        else:  # a conversion kept from an earlier run: time the runtime of this checkout, not the one it bundled
            copy_runtime(out)
        conversions[f"cmoe {experts} experts"] = out
    for item in args.conversion:
        name, sep, path = item.partition("=")
        if not sep or not (Path(path) / "conversion.json").is_file():
            raise SystemExit(f"--conversion {item!r}: use NAME=DIR, DIR a conversion directory (with conversion.json)")
        copy_runtime(Path(path))
        conversions[name] = Path(path)

    dense_dir = cache_default_model(args.model_cache)  # the dequantised checkpoint the conversions start from
    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    prompt, short = bench_text(tokenizer, args.prompt_tokens), bench_text(tokenizer, args.short_tokens)
    devices = args.devices or ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    record: dict[str, object] = {
        "model": "default", "sparsity": args.sparsity, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "short_tokens": args.short_tokens, "repeats": args.repeats, "threads": args.threads, "torch": torch.__version__,
        "conversions": {name: {"dir": str(path), **{k: json.loads((path / "conversion.json").read_text())["summary"].get(k)
                                                   for k in ("ffn_flops_fraction", "active_params", "dense_active_params")}}
                        for name, path in conversions.items()},
        "devices": {},
    }
    for device in devices:
        models = {"dense": AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)}
        for name, path in conversions.items():
            models[name] = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
        for m in models.values():
            m.to(device).eval()
        raw = timings(models, prompt.to(device), short.to(device), args.new_tokens, args.repeats, device, tokenizer.eos_token_id)
        record["devices"][device] = summarise(raw, args.prompt_tokens, args.new_tokens)  # type: ignore[index]
        del models
    record["elapsed_s"] = time.perf_counter() - started
    record["loadavg_before_after"] = [load_before, os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")

    parts = []
    for device, rows in record["devices"].items():  # type: ignore[union-attr]
        for name, r in rows.items():
            if name == "dense":
                parts.append(f"{device} dense prefill {r['prefill_tokens_per_s']:.0f} tok/s decode {r['decode_tokens_per_s']:.1f} tok/s")
                continue
            cost = record["conversions"][name]["ffn_flops_fraction"]  # type: ignore[index]
            parts.append(f"{device} {name} (ffn_flops_fraction {cost:.3f}): prefill {r['prefill_speedup']:.2f}x "
                         f"decode {r['decode_speedup']:.2f}x")
    print(f"bench_generate at sparsity {args.sparsity}, {args.prompt_tokens}-token prefill, {args.new_tokens}-token greedy decode, "
          f"{args.threads} threads: " + "; ".join(parts))


if __name__ == "__main__":
    main()
