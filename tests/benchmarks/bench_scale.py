"""Profiling and converting an 8B-shaped model under a memory budget, one decoder layer at a time.

    python tests/benchmarks/bench_scale.py [--layers 4] [--max-memory 2GiB] [--samples 32] [--max-tokens 64]
        [--recipe paper] [--fit-tokens N] [--work runs/bench_scale] [--device cpu]

The model: a Llama with Llama-3-8B layer shapes (d_model 4096, d_ffn 14336, 32 query / 8 key-value
heads), ``--layers`` decoder layers, the default model's tokenizer (vocabulary 49,152), random
weights saved as float32 safetensors shards (written one tensor at a time; made once and kept in
``--work``). Then, as a user runs them, each in its own process:

    moelab profile --model <it> --calib builtin:mixed --max-memory 2GiB …
    moelab convert --profile <that> --method expertweaver --recipe paper --max-memory 2GiB …

``--recipe best`` (or ``portable``) converts with a fit streamed in two passes; its fit is held beside the largest
layer (``core.params.fit_bytes``: 4.5 GiB at 16,384 fit tokens for this shape, 1.3 GiB at 4,096, so
``--fit-tokens`` or a larger budget); ``--out`` then defaults to ``bench_scale_<recipe>.json``.

Recorded per command: the process's peak RSS (the kernel's high-water mark, from ``wait4``), wall
time, the engine's seconds per layer, and the extrapolation to 32 layers (8B) and 80 layers (70B)
at the same per-layer cost (embeddings and the rest added once). When CUDA is present, ``--device
cuda`` runs the same commands there. Writes tests/benchmarks/results/bench_scale.json and prints
one summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "tests" / "benchmarks" / "results" / "bench_scale.json"
SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False)


def make_model(target: Path, layers: int, data_dir: Path) -> Path:
    """The random 8B-shaped Llama, written shard by shard (never whole in memory)."""
    import torch
    import transformers
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moelab.engine.models import cache_default_model

    if (target / "model.safetensors.index.json").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(cache_default_model(data_dir))
    config = transformers.LlamaConfig(vocab_size=len(tok), num_hidden_layers=layers, pad_token_id=tok.pad_token_id,
                                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **SHAPE)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(0)
    weight_map, shard, size, n = {}, {}, 0, 0

    def flush() -> None:
        nonlocal shard, size, n
        if shard:
            n += 1
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(target / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for name, p in skeleton.named_parameters():
        t = torch.ones(p.shape) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * 0.02
        shard[name] = t
        size += t.numel() * 4
        if size >= 1 << 30:
            flush()
    flush()
    total = sum((target / f).stat().st_size for f in set(weight_map.values()))
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config.save_pretrained(target)
    tok.save_pretrained(target)
    return target


def run(argv: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall s, peak RSS MiB, output) of one moelab command in its own process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "moelab.cli", *argv], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"moelab {' '.join(argv)} failed:\n{out[-3000:]}")
    return wall, usage.ru_maxrss / 1024, out


def main() -> None:
    from moelab.settings import get_settings
    from moelab.engine.sizes import parse_size

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-memory", default="2GiB")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--recipe", default="paper", choices=["paper", "best", "portable"])
    ap.add_argument("--fit-tokens", type=int, default=None, help="the fitted recipes' calibration tokens")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_scale")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out = args.out or (OUT if args.recipe == "paper" else OUT.with_name(f"bench_scale_{args.recipe}.json"))

    data_dir = get_settings().data_dir
    model = args.work / f"llama3-8b-shaped-{args.layers}L"
    if args.make_only:
        make_model(model, args.layers, data_dir)
        return
    t0 = time.perf_counter()
    # In a process of its own: a child's peak RSS (wait4) starts from its parent's RSS at fork time,
    # so this process must stay small.
    subprocess.run([sys.executable, __file__, "--make-only", "--layers", str(args.layers), "--work", str(args.work)], check=True)
    make_s = time.perf_counter() - t0
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    env = {**os.environ, "MOELAB_DEVICE": args.device, "HF_HUB_OFFLINE": "1"}
    prof, conv = args.work / "profile", args.work / "conversion"
    p_wall, p_rss, _ = run(["profile", "--model", str(model), "--calib", "builtin:mixed", "--samples", str(args.samples),
                            "--max-tokens", str(args.max_tokens), "--max-memory", args.max_memory, "--out", str(prof),
                            "--quiet"], env)
    fit = ["--fit-tokens", str(args.fit_tokens)] if args.fit_tokens else []
    c_wall, c_rss, _ = run(["convert", "--profile", str(prof), "--method", "expertweaver", "--recipe", args.recipe,
                            *fit, "--max-memory", args.max_memory, "--out", str(conv), "--quiet"], env)
    pt = json.loads((prof / "manifest.json").read_text())["timings"]
    record = json.loads((conv / "conversion.json").read_text())
    ct = record["timings"]
    p_layer = pt["seconds_per_layer"]
    c_layer = ct["build_s"] / args.layers
    p_rest, c_rest = p_wall - p_layer * args.layers, c_wall - c_layer * args.layers  # once per command, whatever the depth
    budget = parse_size(args.max_memory)
    aim = budget / 2**30 + 0.75  # the budget and the Python/torch runtime (2.75 GiB at 2 GiB)
    report = {
        "model": {"shape": SHAPE, "layers": args.layers, "vocab": 49152, "weights_bytes": weights, "made_s": make_s},
        "device": args.device, "max_memory": args.max_memory, "max_memory_bytes": budget, "recipe": args.recipe,
        "fit_tokens": (record.get("fit") or {}).get("fit_tokens"),
        "calibration": {"set": "builtin:mixed", "samples": args.samples, "max_tokens": args.max_tokens},
        # peak_rss_mib: the whole process's (wait4); engine_peak_rss_mib: from the job's start (imports excluded)
        "profile": {"wall_s": p_wall, "peak_rss_mib": p_rss, "engine_peak_rss_mib": pt.get("peak_rss_mib"),
                    "seconds_per_layer": p_layer, "timings": pt},
        "convert": {"wall_s": c_wall, "peak_rss_mib": c_rss, "engine_peak_rss_mib": ct.get("peak_rss_mib"),
                    "seconds_per_layer": c_layer, "timings": ct},
        # a streamed profile times the FFN layers (never the whole model), which the recipe's speed guard reads
        "speed_guard": {k: v for k, v in ((record.get("fit") or {}).get("speed_guard") or {}).items() if k != "top_k_offered"},
        "kernel_timing_s": p_wall - pt["total_s"],  # after the profile's own work: the FFN table, once per model
        "extrapolated_s": {f"{n} layers": {"profile": p_rest + p_layer * n, "convert": c_rest + c_layer * n} for n in (32, 80)},
        "aim_peak_rss_gib": aim, "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    gib = 1024
    ex = report["extrapolated_s"]
    print(f"bench_scale: {args.layers}-layer 8B-shaped Llama ({weights / 2**30:.1f} GiB fp32), --recipe {args.recipe}, under "
          f"--max-memory {args.max_memory} on "
          f"{args.device}: profile peak RSS {p_rss / gib:.2f} GiB, {p_layer:.1f} s/layer; convert peak RSS {c_rss / gib:.2f} GiB, "
          f"{c_layer:.1f} s/layer; 8B (32 layers) ≈ {ex['32 layers']['profile'] / 60:.0f} + {ex['32 layers']['convert'] / 60:.0f} min, "
          f"70B-deep (80) ≈ {ex['80 layers']['profile'] / 60:.0f} + {ex['80 layers']['convert'] / 60:.0f} min (aim ≤ {aim:.2f} GiB)"
          + (f"; speed guard {'applied' if report['speed_guard'].get('applied') else 'not applied'}"
             if report["speed_guard"] else ""))


if __name__ == "__main__":
    main()
