"""MoE FFN speed against the dense FFN it was sliced from, and whole-model tokens/s.

    python tests/benchmarks/bench_moe_ffn.py [--repeats 15] [--tokens 512] [--layer 15]

Everything runs in one process with ``torch.set_num_threads(2)``, under ``inference_mode``.
The FFN inputs are the real hidden states entering the MLP of ``--layer`` of the default model
(SmolLM2-135M: d_model 576, d_ffn 1536) on ``--tokens`` tokens of stdlib source text, and the
weights are that layer's real weights, so routing is as (un)balanced as it would be in use.

Expert layouts: 64 experts of 24 neurons and 16 experts of 96, each with 192 neurons (1/8)
in the always-active shared expert. Sparsity = fraction of FFN neurons NOT computed:
25 % (75 % active) and 50 % (50 % active); top_k is set accordingly. Every router kind is
timed with both dispatch modes (``auto`` = what the runtime picks on CPU, the per-expert
loop; ``padded`` = capacity-padded batched matmul).
Variants are timed interleaved (rotating order per round) after warm-up; medians reported.
speed-up = dense / MoE; ideal = 1 / activated fraction; fraction_of_ideal = speed-up / ideal.

Whole model: all 30 MLPs replaced by random-partition MoeFFNs at 50 % sparsity (centroid
router, auto dispatch); a 512-token forward (``logits_to_keep=1``, i.e. a prefill) timed
interleaved with the dense model (the MLP modules are swapped between runs).

Writes ``tests/benchmarks/results/bench_moe_ffn.json`` and prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from workers.engine.runtime.modeling_moelab import MoeFFN  # noqa: E402
from workers.engine.models import load_model  # noqa: E402

ROUTERS = {  # router -> combine
    "centroid": "sum",
    "representative": "sum",
    "gate_mass": "sum",
    "softmax": "weighted",
}
LAYOUTS = {"64x24": (64, 24), "16x96": (16, 96)}  # total experts (incl. shared part), neurons each
SHARED_FRACTION = 1 / 8
SPARSITIES = (0.25, 0.5)
DISPATCHES = ("auto", "padded")  # auto = one matmul chain per expert on CPU


def timed_interleaved(fns: dict, repeats: int, warmup: int = 2, seed: int = 0) -> dict[str, list[float]]:
    """Seconds per call of every fn, interleaved round by round in a rotating random order."""
    rng = random.Random(seed)
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    with torch.inference_mode():
        for _ in range(warmup):
            for name in names:
                fns[name]()
        for _ in range(repeats):
            rng.shuffle(names)
            for name in names:
                t0 = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - t0)
    return times


def bench_text(tokenizer, n_tokens: int) -> torch.Tensor:
    import argparse as _a
    import textwrap as _t

    text = ""
    for mod in (_a, _t, json, random):
        text += Path(mod.__file__).read_text() + "\n"
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        if ids.shape[1] >= n_tokens:
            return ids[:, :n_tokens]
    raise RuntimeError("not enough text for the benchmark")


def moe_from_layer(lay, act, E_total, m, active, router, combine, seed):
    d_ffn = lay.d_ffn
    d_shared = int(round(E_total * SHARED_FRACTION)) * m
    n_routed = (d_ffn - d_shared) // m
    k = int(round((active * d_ffn - d_shared) / m))
    perm = torch.randperm(d_ffn, generator=torch.Generator().manual_seed(seed))
    shared, routed = perm[:d_shared], perm[d_shared : d_shared + n_routed * m].reshape(n_routed, m)
    extra = {}
    if router == "representative":  # CMoE: a representative neuron's gate/up rows per expert
        rep = routed[:, 0]
        extra = {"router_gate": lay.gate_weight()[rep], "router_up": lay.up_weight()[rep]}
    mod = MoeFFN.from_dense(lay.gate_weight(), lay.up_weight(), lay.down_weight(), act, shared, routed,
                            k, router, combine, **extra)
    return mod.eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--model-repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "benchmarks" / "results" / "bench_moe_ffn.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    t_start = time.perf_counter()
    load_before = os.getloadavg()

    data_dir = Path(os.environ.get("MOELAB_DATA_DIR", "/tmp/mldata"))
    adapter = load_model("default", data_dir=data_dir)
    model, act = adapter.model, adapter.activation
    ids = bench_text(adapter.tokenizer, args.tokens)
    lay = adapter.layers[args.layer]
    captured = {}
    handle = lay.mlp.register_forward_pre_hook(lambda mod, inp: captured.setdefault("x", inp[0].detach()))
    with torch.inference_mode():
        adapter.decoder()(input_ids=ids, use_cache=False)
    handle.remove()
    x = captured["x"].reshape(-1, adapter.d_model).clone()
    T, d_ffn = x.shape[0], lay.d_ffn

    # ------------------------------------------------------------------ FFN
    records = []
    for layout, (E_total, m) in LAYOUTS.items():
        for sparsity in SPARSITIES:
            active = 1 - sparsity
            fns = {"dense": lambda: lay.mlp(x)}
            mods = {}
            for router, combine in ROUTERS.items():
                mod = moe_from_layer(lay, act, E_total, m, active, router, combine, seed=1)
                for dispatch in DISPATCHES:
                    variant = mod if dispatch == "auto" else _copy_with_dispatch(mod, dispatch)
                    mods[(router, dispatch)] = variant
                    fns[f"{router}/{dispatch}"] = (lambda v=variant: v(x))
            times = timed_interleaved(fns, args.repeats)
            dense_s = statistics.median(times["dense"])
            for (router, dispatch), mod in mods.items():
                seen = []
                mod.recorder = seen.append
                with torch.inference_mode():
                    mod(x)
                mod.recorder = None
                counts = torch.bincount(seen[0].reshape(-1), minlength=mod.n_experts).float()
                frac = (mod.d_shared + mod.top_k * mod.expert_size) / d_ffn
                med = statistics.median(times[f"{router}/{dispatch}"])
                speedup = dense_s / med
                records.append({
                    "layout": layout, "sparsity": sparsity, "router": router, "combine": mod.combine,
                    "dispatch": dispatch, "d_shared": mod.d_shared, "n_experts": mod.n_experts,
                    "expert_size": mod.expert_size, "top_k": mod.top_k, "active_fraction": frac,
                    "dense_ms": dense_s * 1e3, "moe_ms": med * 1e3,
                    "moe_min_ms": min(times[f"{router}/{dispatch}"]) * 1e3,
                    "speedup": speedup, "ideal_speedup": 1 / frac, "fraction_of_ideal": speedup * frac,
                    "load_max_over_mean": float(counts.max() / counts.mean()),
                })

    # ------------------------------------------------------------------ whole model
    whole = {}
    dense_mlps = {lay_.index: lay_.mlp for lay_ in adapter.layers}
    blocks = [lay_.block for lay_ in adapter.layers]

    def install(mlps):
        for i, blk in enumerate(blocks):
            blk.mlp = mlps[i]

    def forward():
        model(input_ids=ids, use_cache=False, logits_to_keep=1)

    for layout in ("64x24", "16x96"):
        E_total, m = LAYOUTS[layout]
        moe_mlps = {lay_.index: moe_from_layer(lay_, act, E_total, m, 0.5, "centroid", "sum", seed=lay_.index)
                    for lay_ in adapter.layers}

        def run_dense():
            install(dense_mlps)
            forward()

        def run_moe():
            install(moe_mlps)
            forward()

        times = timed_interleaved({"dense": run_dense, "moe": run_moe}, args.model_repeats, warmup=1)
        install(dense_mlps)
        td, tm = statistics.median(times["dense"]), statistics.median(times["moe"])
        whole[layout] = {
            "sparsity": 0.5, "router": "centroid", "dispatch": "auto", "top_k": moe_mlps[0].top_k,
            "d_shared": moe_mlps[0].d_shared, "n_experts": moe_mlps[0].n_experts,
            "dense_tokens_per_s": T / td, "moe_tokens_per_s": T / tm, "tokens_per_s_ratio": td / tm,
            "dense_s": times["dense"], "moe_s": times["moe"],
        }
        del moe_mlps

    # ------------------------------------------------------------------ report
    def pick(layout, sparsity, router="centroid", dispatch="auto"):
        return next(r for r in records if (r["layout"], r["sparsity"], r["router"], r["dispatch"])
                    == (layout, sparsity, router, dispatch))

    auto = [r for r in records if r["dispatch"] == "auto"]
    summary = {
        "speedup_25": {lo: pick(lo, 0.25)["speedup"] for lo in LAYOUTS},
        "speedup_50": {lo: pick(lo, 0.5)["speedup"] for lo in LAYOUTS},
        "fraction_of_ideal_min_auto": min(r["fraction_of_ideal"] for r in auto),
        "fraction_of_ideal_min_auto_excl_gate_mass": min(
            r["fraction_of_ideal"] for r in auto if r["router"] != "gate_mass"),
        "whole_model_ratio": {lo: w["tokens_per_s_ratio"] for lo, w in whole.items()},
    }
    result = {
        "model": "default", "layer": args.layer, "tokens": T, "d_model": adapter.d_model, "d_ffn": d_ffn,
        "threads": torch.get_num_threads(), "repeats": args.repeats, "torch": torch.__version__,
        "ffn": records, "whole_model": whole, "summary": summary,
        "elapsed_s": time.perf_counter() - t_start,
        "loadavg_before_after": [load_before, os.getloadavg()],  # the machine may be shared
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    def fmt(layout):
        a, b = pick(layout, 0.25), pick(layout, 0.5)
        return (f"{layout}: 25% {a['speedup']:.2f}x ({a['fraction_of_ideal']:.2f} of ideal) "
                f"50% {b['speedup']:.2f}x ({b['fraction_of_ideal']:.2f})")

    print(
        f"moe_ffn T={T} centroid/auto {fmt('64x24')}; {fmt('16x96')}; "
        f"min fraction of ideal over routers {summary['fraction_of_ideal_min_auto']:.2f} "
        f"(excl. gate_mass {summary['fraction_of_ideal_min_auto_excl_gate_mass']:.2f}); "
        f"whole model 50% tokens/s ratio 64x24 {whole['64x24']['tokens_per_s_ratio']:.2f}x "
        f"16x96 {whole['16x96']['tokens_per_s_ratio']:.2f}x -> {args.out}"
    )


def _copy_with_dispatch(mod: MoeFFN, dispatch: str) -> MoeFFN:
    """A second module object sharing ``mod``'s parameters, with a forced dispatch mode."""
    other = MoeFFN.__new__(MoeFFN)
    other.__dict__ = dict(mod.__dict__)
    other.dispatch = dispatch
    return other


if __name__ == "__main__":
    main()
