"""Whether ``down_keep`` saves time where its multiply-adds say it does: one MoE layer at equal
``ffn_flops_fraction``, whole experts against half of each active expert's down projection, against
the dense FFN it was sliced from.

    python tests/benchmarks/bench_down_keep.py [--layer 15] [--cost 0.5 0.75] [--experts 128] [--threads 2]

Layer ``--layer`` of the default model, its real weights and the real hidden states entering its MLP
on stdlib source text (``bench_moe_ffn.bench_text``). The partition is random (speed does not depend
on which neurons an expert holds), 1/8 of the experts shared, ridge-shaped linear router (the
centroid router's cost), ``sum`` combine. At each ``--cost`` the whole-expert layer runs the largest
top-k whose ``active_param_count`` is within the cost, the ``down_keep`` 0.5 layer the largest top-k
within the same cost (more experts, half their down rows). Phases as ``bench_moe_ffn``: ``decode_b1``,
``decode_b8`` and ``prefill`` (``--tokens`` rows), timed interleaved after warm-up (medians), so
every ratio comes from one machine state. speed-up = dense time / layer time.

The CPU decode kernel (``gather_rows``) reads only the kept rows of the down projection; prefill
kernels multiply the zeroed rows too, so at prefill ``down_keep`` pays for its larger top-k.
Writes ``tests/benchmarks/results/bench_down_keep.json`` and prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_moe_ffn import DenseGLU, bench_text, calibrate_inner, timed_interleaved  # noqa: E402
from moelab.engine.models import load_model  # noqa: E402
from moelab.engine.core.slicing import moe_from_dense  # noqa: E402
from moelab.engine.runtime.modeling_moelab import MoeFFN  # noqa: E402
from moelab.engine.runtime.moelab_routers import ffn_macs  # noqa: E402

OUT = ROOT / "tests" / "benchmarks" / "results" / "bench_down_keep.json"


def layer_at_cost(weights: tuple[torch.Tensor, ...], act: str, n_experts: int, cost: float, down_keep: float) -> MoeFFN:
    """A random-partition layer of ``n_experts`` (1/8 shared) at the largest top-k within ``cost``."""
    gate_w, up_w, down_w = weights
    d_ffn, d = gate_w.shape
    m = d_ffn // n_experts
    shared_n = n_experts // 8
    perm = torch.randperm(d_ffn, generator=torch.Generator().manual_seed(0))
    shared, routed = perm[: shared_n * m], perm[shared_n * m : n_experts * m].reshape(n_experts - shared_n, m)
    fits = [k for k in range(1, len(routed))
            if ffn_macs(d, len(shared), len(routed), m, k, "ridge", "sum", down_keep) <= cost * 3 * d * d_ffn]
    if not fits:
        raise SystemExit(f"no top-k fits cost {cost} with {n_experts} experts")
    return moe_from_dense(gate_w, up_w, down_w, act, shared, routed, fits[-1], "ridge", "sum",
                          router_offset=torch.zeros(len(routed)),
                          **({"down_keep": down_keep} if down_keep < 1 else {})).eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--cost", type=float, nargs="+", default=[0.5, 0.75])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--down-keep", type=float, default=0.5)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started, load_before = time.perf_counter(), os.getloadavg()
    data_dir = Path(os.environ.get("MOELAB_DATA_DIR", ROOT / ".moelab" / "test-data"))
    adapter = load_model("default", data_dir=data_dir, dtype="float32")
    lay = adapter.layers[args.layer]
    captured: dict[str, torch.Tensor] = {}
    handle = lay.mlp.register_forward_pre_hook(lambda mod, inp: captured.setdefault("x", inp[0].detach()))
    with torch.inference_mode():
        adapter.decoder()(input_ids=bench_text(adapter.tokenizer, args.tokens), use_cache=False)
    handle.remove()
    x = captured["x"].reshape(-1, adapter.d_model).clone()
    weights = (lay.gate_weight(), lay.up_weight(), lay.down_weight())
    dense = DenseGLU(*weights).eval()
    dense_macs = 3 * adapter.d_model * lay.d_ffn
    phases = {"decode_b1": x[100:101].clone(), "decode_b8": x[100:108].clone(), "prefill": x}
    rows = []
    for cost in args.cost:
        layers = {"whole": layer_at_cost(weights, adapter.activation, args.experts, cost, 1.0),
                  "down_keep": layer_at_cost(weights, adapter.activation, args.experts, cost, args.down_keep)}
        for phase, xp in phases.items():
            fns = {"dense": lambda xp=xp: dense(xp), **{n: (lambda m=m, xp=xp: m(xp)) for n, m in layers.items()}}
            times = timed_interleaved(fns, args.repeats, inner=calibrate_inner(fns, "cpu"))
            med = {n: statistics.median(t) for n, t in times.items()}
            for name, mod in layers.items():
                rows.append({"cost_cap": cost, "phase": phase, "rows": int(xp.shape[0]), "variant": name,
                             "down_keep": mod.down_keep, "top_k": mod.top_k, "n_routed": mod.n_routed,
                             "d_shared": mod.d_shared, "expert_size": mod.expert_size,
                             "ffn_flops_fraction": mod.active_param_count() / dense_macs,
                             "dense_ms": med["dense"] * 1e3, "ms": med[name] * 1e3, "speedup": med["dense"] / med[name]})
                r = rows[-1]
                print(f"  cost ≤ {cost} {phase:9s} {name:9s} top-{r['top_k']:3d} cost {r['ffn_flops_fraction']:.3f} "
                      f"{r['ms']:.3f} ms, {r['speedup']:.2f}x dense", flush=True)
    result = {"model": "default", "layer": args.layer, "experts": args.experts, "down_keep": args.down_keep,
              "threads": args.threads, "repeats": args.repeats, "torch": torch.__version__, "rows": rows,
              "elapsed_s": time.perf_counter() - started, "loadavg_before_after": [load_before, os.getloadavg()]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("bench_down_keep: speed-up over dense, whole experts / down_keep " + f"{args.down_keep} at equal cost: " + "; ".join(
        f"≤{c} {p} {w['speedup']:.2f}x/{k['speedup']:.2f}x"
        for c in args.cost for p in phases
        for w, k in [[next(r for r in rows if (r["cost_cap"], r["phase"], r["variant"]) == (c, p, v)) for v in ("whole", "down_keep")]]))


if __name__ == "__main__":
    main()
