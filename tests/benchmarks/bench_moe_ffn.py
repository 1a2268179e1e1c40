"""MoE FFN speed against the dense FFN it was sliced from: prefill and decode, before and after the
fast experts kernels (issue 12), and whole-model prefill tokens/s.

    python tests/benchmarks/bench_moe_ffn.py [--repeats 9] [--tokens 512] [--layer 15]
        [--big-repeats 3] [--skip-big] [--skip-whole-model] [--threads 2] [--devices cpu cuda]
        [--dtype float32|bfloat16]

Everything runs in one process with ``torch.set_num_threads(--threads)`` (2: the cores of the
target machine), under ``inference_mode``; on a CUDA machine the same cases run on the GPU too.

Shapes:
- ``default``: layer ``--layer`` of the default model (SmolLM2-135M: d_model 576, d_ffn 1536), its
  real weights and the real hidden states entering its MLP on ``--tokens`` tokens of stdlib source
  text, so routing is as (un)balanced as in use;
- ``llama3_8b``: one Llama-3-8B-shaped layer (d_model 4096, d_ffn 14336), random weights and
  inputs (routing close to balanced).

Phases: ``prefill`` (``--tokens`` tokens at once), ``decode_b1`` and ``decode_b8`` (one new token
for a batch of 1 or 8 sequences: an FFN input of 1 or 8 rows).
Expert layouts: 16 experts of d_ffn/16 neurons and 64 of d_ffn/64 (the default model: 16x96 and
64x24), each with 1/8 of the neurons in the always-active shared expert. Sparsity = fraction of
FFN neurons NOT computed: 25 % and 50 %; top_k is set accordingly. Centroid router, ``sum``
combine (the training-free default) for the main table; at the default shape's prefill every
router kind is timed too.

Variants of one case are timed interleaved (rotating random order per round) after warm-up, and
the medians compared, so every ratio comes from one run on one machine state. ``--clock``: with
one thread the process CPU time is measured by default (on a shared, oversubscribed machine wall
time mostly measures the scheduler), otherwise wall time. Variants:
``dense`` (the model's own MLP: three Linears), ``before`` (``experts_impl="loop"``: the previous
runtime's per-expert loop, kept as the reference) and ``after`` (``experts_impl="auto"``: what the
runtime runs now; the kernel it resolves to is recorded). Short calls are repeated inside one
timing sample (``inner``) so that a sample lasts a few milliseconds.
speed-up = dense / MoE; ideal = 1 / activated fraction; fraction_of_ideal = speed-up / ideal.

Whole model: all 30 MLPs of the default model replaced by random-partition MoeFFNs at 50 %
sparsity (centroid router); a ``--tokens`` forward (``logits_to_keep=1``, i.e. a prefill), dense vs
MoE before vs after, interleaved (the MLP modules are swapped between runs).

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
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moelab.engine.core.slicing import moe_from_dense  # noqa: E402
from moelab.engine.runtime.modeling_moelab import MoeFFN  # noqa: E402
from moelab.engine.models import load_model  # noqa: E402

ROUTERS = {  # router -> combine
    "centroid": "sum",
    "representative": "sum",
    "gate_mass": "sum",
    "softmax": "weighted",
}
LAYOUTS = {"64x": 64, "16x": 16}  # total experts (incl. the shared part's share); neurons = d_ffn / count
SHARED_FRACTION = 1 / 8
SPARSITIES = (0.25, 0.5)
PHASES = {"prefill": None, "decode_b1": 1, "decode_b8": 8}  # rows of the FFN input (None: --tokens)
MIN_SAMPLE_S = 0.004


class DenseGLU(nn.Module):
    """A Llama MLP: ``down(act(gate x) * up x)`` with three Linears."""

    def __init__(self, gate, up, down):
        super().__init__()
        self.gate_proj = nn.Linear(gate.shape[1], gate.shape[0], bias=False)
        self.up_proj = nn.Linear(up.shape[1], up.shape[0], bias=False)
        self.down_proj = nn.Linear(down.shape[1], down.shape[0], bias=False)
        with torch.no_grad():
            self.gate_proj.weight.copy_(gate)
            self.up_proj.weight.copy_(up)
            self.down_proj.weight.copy_(down)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


CLOCK = {"clock": "wall"}  # "cpu": process CPU time (set by main for single-threaded CPU runs)


def _now(device: str) -> float:
    # CPU time of this process: on a shared machine, time spent descheduled is not counted. With one
    # intra-op thread it is the kernels' own time; with more, OpenMP spin-waits are counted too.
    if CLOCK["clock"] == "cpu" and device == "cpu":
        return time.process_time()
    return time.perf_counter()


def timed_interleaved(fns: dict, repeats: int, device: str = "cpu", warmup: int = 1, seed: int = 0,
                      inner: dict | None = None) -> dict[str, list[float]]:
    """Seconds per call of every fn, interleaved round by round in a rotating random order; fn
    ``name`` runs ``inner[name]`` times per sample (the sample time is divided by it)."""
    rng = random.Random(seed)
    inner = inner or {}
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    with torch.inference_mode():
        for _ in range(warmup):
            for name in names:
                fns[name]()
        for _ in range(repeats):
            rng.shuffle(names)
            for name in names:
                n = inner.get(name, 1)
                _sync(device)
                t0 = _now(device)
                for _ in range(n):
                    fns[name]()
                _sync(device)
                times[name].append((_now(device) - t0) / n)
    return times


def calibrate_inner(fns: dict, device: str) -> dict[str, int]:
    """Calls per timing sample so that one sample lasts at least ``MIN_SAMPLE_S``."""
    out = {}
    with torch.inference_mode():
        for name, fn in fns.items():
            fn()
            _sync(device)
            t0 = _now(device)
            fn()
            _sync(device)
            dt = max(_now(device) - t0, 1e-6)
            out[name] = max(1, min(200, int(MIN_SAMPLE_S / dt)))
    return out


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


def layout_sizes(d_ffn: int, E_total: int, active: float) -> tuple[int, int, int, int]:
    """(expert_size m, d_shared, n_routed, top_k) of a layout at an active fraction."""
    m = d_ffn // E_total
    d_shared = int(round(E_total * SHARED_FRACTION)) * m
    n_routed = (d_ffn - d_shared) // m
    k = int(round((active * d_ffn - d_shared) / m))
    return m, d_shared, n_routed, k


def make_moe(weights, act, E_total, active, router, combine, seed) -> MoeFFN:
    gate_w, up_w, down_w = weights
    d_ffn = gate_w.shape[0]
    m, d_shared, n_routed, k = layout_sizes(d_ffn, E_total, active)
    perm = torch.randperm(d_ffn, generator=torch.Generator().manual_seed(seed))
    shared, routed = perm[:d_shared], perm[d_shared : d_shared + n_routed * m].reshape(n_routed, m)
    extra = {}
    if router == "representative":  # CMoE: a representative neuron's gate/up rows per expert
        rep = routed[:, 0]
        extra = {"router_gate": gate_w[rep.to(gate_w.device)], "router_up": up_w[rep.to(up_w.device)]}
    mod = moe_from_dense(gate_w, up_w, down_w, act, shared, routed, k, router, combine, **extra)
    return mod.eval()


def active_fraction(mod: MoeFFN, d_ffn: int) -> float:
    return (mod.d_shared + mod.top_k * mod.expert_size) / d_ffn


def bench_case(shape: str, device: str, dense: nn.Module, weights, act, inputs: dict[str, torch.Tensor],
               repeats: dict[str, int], routers: dict[str, str], prefill_routers: dict[str, str]) -> list[dict]:
    """Every layout x sparsity x phase of one shape: dense vs before (loop) vs after (auto)."""
    d_ffn = weights[0].shape[0]
    records = []
    for layout, E_total in LAYOUTS.items():
        for sparsity in SPARSITIES:
            active = 1 - sparsity
            mods = {}
            for router, combine in {**routers, **prefill_routers}.items():
                mods[router] = make_moe(weights, act, E_total, active, router, combine, seed=1)
            for phase, x in inputs.items():
                fns = {"dense": lambda x=x: dense(x)}
                use = routers if phase != "prefill" else {**routers, **prefill_routers}
                for router in use:
                    mod = mods[router]
                    fns[f"{router}/before"] = lambda mod=mod, x=x: _run(mod, x, "loop")
                    fns[f"{router}/after"] = lambda mod=mod, x=x: _run(mod, x, "auto")
                inner = calibrate_inner(fns, device)
                times = timed_interleaved(fns, repeats[phase], device, inner=inner)
                dense_s = statistics.median(times["dense"])
                for router in use:
                    mod = mods[router]
                    mod.experts_impl = "auto"
                    frac = active_fraction(mod, d_ffn)
                    before = statistics.median(times[f"{router}/before"])
                    after = statistics.median(times[f"{router}/after"])
                    records.append({
                        "shape": shape, "device": device, "phase": phase, "rows": int(x.shape[0]),
                        "layout": f"{E_total}x{d_ffn // E_total}", "sparsity": sparsity, "router": router,
                        "combine": mod.combine, "d_shared": mod.d_shared, "n_routed": mod.n_routed,
                        "expert_size": mod.expert_size, "top_k": mod.top_k, "active_fraction": frac,
                        "kernel_after": mod.experts.resolve_impl(x, torch.zeros(x.shape[0], mod.top_k, dtype=torch.long,
                                                                                device=x.device), False),
                        "dense_ms": dense_s * 1e3, "before_ms": before * 1e3, "after_ms": after * 1e3,
                        "speedup_before": dense_s / before, "speedup_after": dense_s / after,
                        "after_over_before": before / after, "ideal_speedup": 1 / frac,
                        "fraction_of_ideal_after": dense_s / after * frac, "inner": inner[f"{router}/after"],
                    })
                    print(f"  {shape}/{device} {phase:9s} {records[-1]['layout']:7s} {int(sparsity * 100)}% {router:14s} "
                          f"dense {dense_s * 1e3:8.3f} ms  before {dense_s / before:5.2f}x  after {dense_s / after:5.2f}x "
                          f"(ideal {1 / frac:.2f}x, {records[-1]['kernel_after']})", flush=True)
            del mods
    return records


def _run(mod: MoeFFN, x: torch.Tensor, impl: str) -> torch.Tensor:
    mod.experts_impl = impl
    return mod(x)


def whole_model(adapter, ids, act, repeats: int) -> dict:
    model = adapter.model
    dense_mlps = {lay.index: lay.mlp for lay in adapter.layers}
    blocks = [lay.block for lay in adapter.layers]
    T = ids.shape[1]

    def install(mlps):
        for i, blk in enumerate(blocks):
            blk.mlp = mlps[i]

    out = {}
    for layout, E_total in LAYOUTS.items():
        moe_mlps = {lay.index: make_moe((lay.gate_weight(), lay.up_weight(), lay.down_weight()), act, E_total, 0.5,
                                        "centroid", "sum", seed=lay.index) for lay in adapter.layers}

        def run(mlps, impl=None):
            def f():
                if impl is not None:
                    for m in mlps.values():
                        m.experts_impl = impl
                install(mlps)
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
            return f

        times = timed_interleaved({"dense": run(dense_mlps), "before": run(moe_mlps, "loop"),
                                   "after": run(moe_mlps, "auto")}, repeats)
        install(dense_mlps)
        td, tb, ta = (statistics.median(times[k]) for k in ("dense", "before", "after"))
        key = f"{E_total}x{adapter.layers[0].d_ffn // E_total}"
        out[key] = {
            "sparsity": 0.5, "router": "centroid", "top_k": moe_mlps[0].top_k, "d_shared": moe_mlps[0].d_shared,
            "n_routed": moe_mlps[0].n_routed, "tokens": T,
            "dense_tokens_per_s": T / td, "before_tokens_per_s": T / tb, "after_tokens_per_s": T / ta,
            "ratio_before": td / tb, "ratio_after": td / ta, "dense_s": times["dense"], "before_s": times["before"],
            "after_s": times["after"],
        }
        print(f"  whole model prefill {key}: before {td / tb:.2f}x after {td / ta:.2f}x", flush=True)
        del moe_mlps
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--big-repeats", type=int, default=3, help="prefill repeats of the 8B-shaped layer")
    ap.add_argument("--model-repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--skip-whole-model", action="store_true")
    ap.add_argument("--clock", choices=("auto", "cpu", "wall"), default="auto",
                    help="auto: process CPU time with --threads 1 (robust on a shared machine), else wall time")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "benchmarks" / "results" / "bench_moe_ffn.json")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="weights and inputs of the FFN cases (bfloat16: the dtype accelerators serve in)")
    ap.add_argument("--devices", nargs="+", choices=("cpu", "cuda"), default=None,
                    help="default: cpu, and cuda when a CUDA device is present")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    CLOCK["clock"] = args.clock if args.clock != "auto" else ("cpu" if args.threads == 1 else "wall")
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    dtype = getattr(torch, args.dtype)
    devices = args.devices or ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

    data_dir = Path(os.environ.get("MOELAB_DATA_DIR", "/tmp/mldata"))
    adapter = load_model("default", data_dir=data_dir, device="cpu", dtype="float32")  # moved per case below
    act = adapter.activation
    ids = bench_text(adapter.tokenizer, args.tokens)
    lay = adapter.layers[args.layer]
    captured = {}
    handle = lay.mlp.register_forward_pre_hook(lambda mod, inp: captured.setdefault("x", inp[0].detach()))
    with torch.inference_mode():
        adapter.decoder()(input_ids=ids, use_cache=False)
    handle.remove()
    x = captured["x"].reshape(-1, adapter.d_model).clone()
    T = x.shape[0]

    records = []
    for device in devices:
        # ---------------------------------------------------------------- default model's layer
        w = tuple(t.to(device, dtype) for t in (lay.gate_weight(), lay.up_weight(), lay.down_weight()))
        dense = DenseGLU(*w).to(device, dtype).eval()
        xd = x.to(device, dtype)
        inputs = {"prefill": xd, "decode_b1": xd[100:101].clone(), "decode_b8": xd[100:108].clone()}
        reps = {"prefill": args.repeats, "decode_b1": args.repeats, "decode_b8": args.repeats}
        print(f"default shape on {device}", flush=True)
        records += bench_case("default", device, dense, w, act, inputs, reps, {"centroid": "sum"},
                              {r: c for r, c in ROUTERS.items() if r != "centroid"})
        del dense, w
        # ---------------------------------------------------------------- Llama-3-8B-shaped layer
        if not args.skip_big:
            d, f = 4096, 14336
            g = torch.Generator().manual_seed(0)
            w = (torch.randn(f, d, generator=g) * d ** -0.5, torch.randn(f, d, generator=g) * d ** -0.5,
                 torch.randn(d, f, generator=g) * f ** -0.5)
            w = tuple(t.to(device, dtype) for t in w)
            dense = DenseGLU(*w).to(device, dtype).eval()
            xb = torch.randn(T, d, generator=g).to(device, dtype)
            inputs = {"prefill": xb, "decode_b1": xb[:1].clone(), "decode_b8": xb[:8].clone()}
            reps = {"prefill": args.big_repeats, "decode_b1": args.repeats, "decode_b8": args.repeats}
            print(f"llama3_8b shape on {device}", flush=True)
            records += bench_case("llama3_8b", device, dense, w, "silu", inputs, reps, {"centroid": "sum"}, {})
            del dense, w

    whole = {} if args.skip_whole_model else whole_model(adapter, ids, act, args.model_repeats)

    # ------------------------------------------------------------------ report
    def pick(shape, phase, layout_prefix, sparsity, device="cpu", router="centroid"):
        return next((r for r in records if (r["shape"], r["phase"], r["sparsity"], r["device"], r["router"])
                     == (shape, phase, sparsity, device, router) and r["layout"].startswith(layout_prefix)), None)

    summary, aims = {}, {}
    for device in devices:
        tag = "" if device == "cpu" else f"{device}/"
        for shape in ("default", "llama3_8b"):
            for phase in PHASES:
                for lp in LAYOUTS:
                    for sp in SPARSITIES:
                        r = pick(shape, phase, lp, sp, device)
                        if r:
                            summary[f"{tag}{shape}/{phase}/{r['layout']}/{int(sp * 100)}"] = {
                                "before": round(r["speedup_before"], 3), "after": round(r["speedup_after"], 3),
                                "ideal": round(r["ideal_speedup"], 3), "kernel": r["kernel_after"]}
        if device != "cpu":  # the aims are set for the 2-core CPU; accelerator numbers are recorded, not judged
            continue
        for lp in LAYOUTS:
            r = pick("llama3_8b", "decode_b1", lp, 0.5)
            if r:
                aims[f"8b_decode_b1_50_{lp}"] = {"speedup": r["speedup_after"], "aim": 1.6, "met": r["speedup_after"] >= 1.6}
        for shape in ("default", "llama3_8b"):
            r = pick(shape, "prefill", "64x", 0.5)
            if r:
                aims[f"{shape}_prefill_50_64x"] = {"speedup": r["speedup_after"], "aim": 1.0, "met": r["speedup_after"] >= 1.0}
            r = pick(shape, "prefill", "16x", 0.5)
            if r:
                aims[f"{shape}_prefill_50_16x_fraction_of_ideal"] = {
                    "fraction": r["fraction_of_ideal_after"], "aim": 0.6, "met": r["fraction_of_ideal_after"] >= 0.6}
    result = {
        "model": "default", "layer": args.layer, "tokens": T, "threads": torch.get_num_threads(), "clock": CLOCK["clock"],
        "repeats": args.repeats, "big_repeats": args.big_repeats, "torch": torch.__version__, "devices": devices,
        "dtype": args.dtype,
        "ffn": records, "whole_model": whole, "summary": summary, "aims": aims,
        "elapsed_s": time.perf_counter() - t_start,
        "loadavg_before_after": [load_before, os.getloadavg()],  # the machine may be shared
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    def fmt(shape, phase, device):
        parts = []
        for lp in LAYOUTS:
            for sp in SPARSITIES:
                r = pick(shape, phase, lp, sp, device)
                if r:
                    parts.append(f"{r['layout']}@{int(sp * 100)}% {r['speedup_before']:.2f}->{r['speedup_after']:.2f}x")
        return f"{device} {shape} {phase}: " + ", ".join(parts)

    lines = [fmt(s, p, dv) for dv in devices for s in ("default", "llama3_8b") for p in PHASES if pick(s, p, "64x", 0.5, dv)]
    wm = "; ".join(f"whole model {k} {v['ratio_before']:.2f}->{v['ratio_after']:.2f}x" for k, v in whole.items())
    met = ", ".join(f"{k} {'met' if v['met'] else 'MISSED'}" for k, v in aims.items())
    print(f"moe_ffn vs dense (before->after, centroid/sum, {args.dtype}, {args.threads} threads, {CLOCK['clock']} time): " + " | ".join(lines)
          + (f" | {wm}" if wm else "") + f" | aims: {met} -> {args.out}")


if __name__ == "__main__":
    main()
