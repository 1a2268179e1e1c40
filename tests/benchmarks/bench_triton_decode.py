"""One MoE layer's decode step on a GPU, in parts, against the dense FFN it replaces, and the Triton decode kernels'
block sizes (``moelab_triton``) swept; then, with the fastest, whole models (``bench_gpu_speed.run_shape``).

    python tests/benchmarks/bench_triton_decode.py [--shape 8b] [--whole default 8b] [--out FILE]

Each time is a CUDA graph of ``CALLS`` back-to-back calls replayed ``REPLAYS`` times (median per call), so launch
costs are what a graphed decode step pays. Parts: the dense FFN (three GEMVs), the MoE layer under each kernel, its
shared expert alone, its router and top-k alone, and its routed experts alone; for the routed experts, the rate at
which they read the selected weights (GB/s). Random bf16 weights, uniform routing. Writes JSON, prints one line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "benchmarks"))

from bench_gpu_speed import SHAPES, layouts, run_shape  # noqa: E402
from moelab.engine.runtime import moelab_triton  # noqa: E402
from moelab.engine.runtime.moelab_moe import MoeFFN  # noqa: E402

CALLS, REPLAYS = 20, 15
CONFIGS = [dict(BLOCK_N=n, BLOCK_D=2 * n, BLOCK_K=k, NUM_WARPS=w, TARGET_PROGRAMS=t)
           for n, k, w, t in itertools.product((64, 128), (32, 64, 128), (4, 8), (1024, 4096))]


def graphed_ms(fn) -> float:
    """Median milliseconds of one ``fn()`` inside a graph of ``CALLS`` calls (NaN where ``fn`` reads the host, which
    a capture cannot hold: its failure would leave the stream capturing)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError:
        return float("nan")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / CALLS)
    return statistics.median(times)


@torch.inference_mode()
def layer_parts(shape: dict, layout: str, tokens: int) -> dict:
    d, D = shape["hidden_size"], shape["intermediate_size"]
    spec = layouts(d, D)[layout]["spec"]
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    gate, up, down = (torch.randn(D, d, device=dev, dtype=dt) * 0.02, torch.randn(D, d, device=dev, dtype=dt) * 0.02,
                      torch.randn(d, D, device=dev, dtype=dt) * 0.02)
    with torch.device(dev):
        moe = MoeFFN(spec).to(dt).eval()
    x = torch.randn(tokens, d, device=dev, dtype=dt)
    top = torch.stack([torch.randperm(moe.n_routed, device=dev)[:moe.top_k] for _ in range(tokens)])
    out = {"layout": layout, "tokens": tokens, "top_k": moe.top_k, "n_routed": moe.n_routed, "expert_size": moe.expert_size}
    out["dense_ms"] = graphed_ms(lambda: F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down))
    for impl in ("triton", "gather", "grouped_mm"):
        moe.experts_impl = impl
        out[f"moe_{impl}_ms"] = graphed_ms(lambda: moe(x))
    moe.experts_impl = "triton"
    out["shared_ms"] = graphed_ms(lambda: moe._shared(x))
    out["router_topk_ms"] = graphed_ms(lambda: moe.router.select(moe.router(x)[0]))
    w = (moe.experts.gate_up_proj, moe.experts.down_proj)
    selected_bytes = len(top.unique()) * 3 * moe.expert_size * d * 2
    out["routed_triton_ms"] = graphed_ms(lambda: moelab_triton.routed_decode(moe.experts, x, w, top, None))
    out["routed_triton_GBps"] = selected_bytes / out["routed_triton_ms"] / 1e6
    out["dense_GBps"] = 3 * D * d * 2 / out["dense_ms"] / 1e6
    return out


@torch.inference_mode()
def sweep(shape: dict, layout: str, tokens: int) -> list[dict]:
    """The routed experts' time under each ``CONFIGS`` entry (module constants of ``moelab_triton``)."""
    d, D = shape["hidden_size"], shape["intermediate_size"]
    with torch.device("cuda"):
        moe = MoeFFN(layouts(d, D)[layout]["spec"]).to(torch.bfloat16).eval()
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    top = torch.stack([torch.randperm(moe.n_routed, device="cuda")[:moe.top_k] for _ in range(tokens)])
    w = (moe.experts.gate_up_proj, moe.experts.down_proj)
    rows = []
    for cfg in CONFIGS:
        for key, value in cfg.items():
            setattr(moelab_triton, key, value)
        try:
            ms = graphed_ms(lambda: moelab_triton.routed_decode(moe.experts, x, w, top, None))
        except Exception as exc:  # noqa: BLE001 - a config the chip cannot run is reported, not fatal
            rows.append({**cfg, "error": str(exc)[:200]})
            continue
        rows.append({**cfg, "ms": ms})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--whole", nargs="*", default=["default", "8b"])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "benchmarks" / "results" / "bench_triton_decode.json")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    result = {"shape": args.shape, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    t0 = time.perf_counter()
    defaults = {k: getattr(moelab_triton, k) for k in CONFIGS[0]}
    result["parts"] = [layer_parts(shape, layout, t) for layout in ("portable", "paper") for t in (1, 8)]
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    result["sweep"] = {f"{layout}/{t}": sweep(shape, layout, t) for layout in ("portable", "paper") for t in (1,)}
    both = [(a["ms"] + b["ms"], a) for a, b in zip(result["sweep"]["portable/1"], result["sweep"]["paper/1"])
            if "ms" in a and "ms" in b]
    best = min(both, key=lambda pair: pair[0])[1]
    result["chosen"] = {k: best[k] for k in defaults}
    result["defaults"] = defaults
    for key, value in result["chosen"].items():
        setattr(moelab_triton, key, value)
    result["parts_chosen"] = [layer_parts(shape, layout, 1) for layout in ("portable", "paper")]
    result["sweep_s"] = round(time.perf_counter() - t0, 1)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    result["whole"] = []
    for name in args.whole:
        result["whole"].append(run_shape(name, SHAPES[name], "cuda", torch.bfloat16, ["triton"], 3))
        torch.cuda.empty_cache()
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    p = {r["layout"] + "/" + str(r["tokens"]): r for r in result["parts"]}
    print("bench_triton_decode: " + f"{args.shape} layer, one token: dense {p['portable/1']['dense_ms']:.3f} ms, portable "
          f"triton {p['portable/1']['moe_triton_ms']:.3f} / gather {p['portable/1']['moe_gather_ms']:.3f} ms; chosen "
          f"{result['chosen']}; whole models (× dense, graphed, decode b1): " + ", ".join(
              f"{w['shape']} {row['layout']} {row['speedup']['graphs']['triton']['decode_b1']:.2f}"
              for w in result["whole"] for row in w["rows"]))


if __name__ == "__main__":
    main()
