"""Whole models on a GPU in the three phases (decode batch 1 and 8, prefill of 512; ``evaluation.speed``), moelab's
runtime against dense, bf16, for the default model's shape and an 8B-shaped Llama.

    python tests/benchmarks/bench_gpu_speed.py [--shapes default 8b] [--impls auto grouped_mm gather]  # tiny: a smoke run
        [--repeats 3] [--out FILE]

Weights are random (speed depends on shapes, not values; the default model's weights do not travel to a lent GPU
machine): a Llama of the shape, and for each layout the same shape with every MLP replaced by moelab's ``MoeFFN``
(ridge router, sum combine) sized as a conversion at FFN cost about 0.5 would size it:

- ``paper``: a quarter of the FFN shared, 48 routed experts of D/64, top-16 (ExpertWeaver's paper shape);
- ``portable``: a quarter shared, 12 routed experts of D/16, top-3 (``--recipe portable``: the layout that exports);
- ``best``: a quarter shared, 96 routed experts of D/128, top-45, half of each expert's down rows (``--recipe best``).

Each MoE layout runs under every ``--impls`` kernel choice (``MoeExperts.experts_impl``). Routing of random weights is near uniform, so a batch
touches more experts than a trained router's would: batch-8 decode and prefill lean pessimistic. Writes JSON, prints
one summary line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moelab.engine.evaluation.speed import SpeedProtocol, time_phases  # noqa: E402
from moelab.engine.runtime.moelab_moe import MoeFFN  # noqa: E402

SHAPES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,  # a smoke run
             "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 1024, "tie_word_embeddings": True},
    "default": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": False},
}


def layouts(d_model: int, d_ffn: int) -> dict[str, dict]:
    """The MoE layer specs compared (see the module docstring), each with its FFN cost (multiply-adds over dense)."""
    shared = d_ffn // 4
    out = {}
    for name, per, top, keep in (("paper", 64, 16, 1.0), ("portable", 16, 3, 1.0), ("best", 128, 45, 0.5)):
        m = d_ffn // per
        routed = (d_ffn - shared) // m
        spec = {"kind": "moe", "d_model": d_model, "d_shared": shared, "n_routed": routed, "expert_size": m,
                "top_k": top, "router": "ridge", "combine": "sum", "down_keep": keep}
        cost = ((shared + top * m) * (2 + keep) / 3 + routed * (d_model + 1) / (3 * d_model)) / d_ffn
        out[name] = {"spec": spec, "ffn_flops_fraction": round(cost, 3)}
    return out


def build(shape: dict, device: str, dtype: torch.dtype, spec: dict | None = None) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 on the device: an 8B model never exists in fp32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**shape))
            if spec is not None:
                for layer in model.model.layers:
                    layer.mlp = MoeFFN(spec)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype).eval()


def run_shape(name: str, shape: dict, device: str, dtype: torch.dtype, impls: list[str], repeats: int) -> dict:
    tokens = torch.randint(0, shape["vocab_size"], (4096,), generator=torch.Generator().manual_seed(1))
    models = {"dense": build(shape, device, dtype)}
    rows = []
    for layout, v in layouts(shape["hidden_size"], shape["intermediate_size"]).items():
        model = build(shape, device, dtype, v["spec"])
        for impl in impls:
            models[f"{layout}/{impl}"] = model
        rows.append({"layout": layout, **v})
    setups = {key: (lambda m=model, i=key.split("/")[1]: _impl(m, i)) for key, model in models.items() if "/" in key}
    t0 = time.perf_counter()
    measured = time_phases(models, tokens, protocol=SpeedProtocol(repeats=repeats), setups=setups)
    for row in rows:
        row["speedup"] = {key.split("/")[1]: {p: round(e["speedup"][key], 3) for p, e in measured["phases"].items()}
                          for key in models if key.startswith(row["layout"] + "/")}
    return {"shape": name, "device": measured["device"], "dtype": measured["dtype"], "timing_s": round(time.perf_counter() - t0, 1),
            "dense_ms": {p: round(1e3 * e["seconds"]["dense"], 3) for p, e in measured["phases"].items()},
            "protocol": measured["protocol"], "rows": rows}


class _impl:
    """A context that sets every MoE layer's kernel choice for a model's rounds."""

    def __init__(self, model: torch.nn.Module, impl: str) -> None:
        self.mods = [m for m in model.modules() if isinstance(m, MoeFFN)]
        self.impl = impl

    def __enter__(self) -> None:
        for m in self.mods:
            m.experts_impl = self.impl

    def __exit__(self, *exc: object) -> None:
        for m in self.mods:
            m.experts_impl = "auto"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["default", "8b"], choices=sorted(SHAPES))
    ap.add_argument("--impls", nargs="+", default=["auto", "grouped_mm", "gather"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "benchmarks" / "results" / "bench_gpu_speed.json")
    args = ap.parse_args()
    results = []
    for name in args.shapes:
        results.append(run_shape(name, SHAPES[name], args.device, getattr(torch, args.dtype), args.impls, args.repeats))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print("bench_gpu_speed: " + "; ".join(
        f"{r['shape']} ({r['device']}, {r['dtype']}): " + ", ".join(
            f"{row['layout']} cost {row['ffn_flops_fraction']} "
            + " ".join(f"[{impl}] " + "/".join(f"{s[p]:.2f}" for p in ("decode_b1", "decode_b8", "prefill"))
                       for impl, s in row["speedup"].items()) for row in r["rows"]) for r in results)
          + " (× dense: decode b1 / decode b8 / prefill)")


if __name__ == "__main__":
    main()
