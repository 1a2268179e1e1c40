"""Whole models on a GPU in the three phases (decode batch 1 and 8, prefill of 512; ``evaluation.speed``), moelab's
runtime against dense, bf16, for the default model's shape and an 8B-shaped Llama.

    python tests/benchmarks/bench_gpu_speed.py [--shapes default 8b] [--impls triton gather grouped_mm]  # tiny: a smoke run
        [--repeats 3] [--out FILE]

Weights are random (speed depends on shapes, not values; the default model's weights do not travel to a lent GPU
machine): a Llama of the shape, and for each layout the same shape with every MLP replaced by moelab's ``MoeFFN``
(ridge router, sum combine) sized as a conversion at FFN cost about 0.5 would size it:

- ``paper``: a quarter of the FFN shared, 48 routed experts of D/64, top-16 (ExpertWeaver's paper shape);
- ``portable``: a quarter shared, 12 routed experts of D/16, top-3 (``--recipe portable``: the layout that exports);
- ``best``: a quarter shared, 96 routed experts of D/128, top-45, half of each expert's down rows (``--recipe best``).

Each MoE layout runs under every ``--impls`` kernel choice (``MoeExperts.experts_impl``; ``triton`` falls back to
``gather`` where ``moelab_triton.usable`` says no, e.g. ``best``'s ``down_keep``). Every model's decode steps run as
CUDA graphs (``evaluation.speed``); dense and the first kernel's models are then timed with eager steps, to show what
the graphs are for. Before timing, each kernel's output on one and on eight tokens is compared with the reference loop's (relative
max error, bf16). Routing of random weights is near uniform, so a batch touches more experts than a trained router's
would: batch-8 decode and prefill lean pessimistic. Writes JSON after each shape, prints one summary line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moelab.engine.evaluation.speed import SpeedProtocol, capture_blocker, time_phases  # noqa: E402
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


@torch.inference_mode()
def kernel_errors(model: torch.nn.Module, impls: list[str], d_model: int) -> dict:
    """Each kernel's max |error| over the reference loop's max |output|, first MoE layer, on 1 and 8 tokens."""
    layer = next(m for m in model.modules() if isinstance(m, MoeFFN))
    out = {}
    for tokens in (1, 8):
        x = torch.randn(tokens, d_model, generator=torch.Generator().manual_seed(tokens)).to(layer.experts.gate_up_proj)
        with _impl(model, "loop"):
            ref = layer(x).float()
        top = torch.zeros(tokens, layer.top_k, dtype=torch.long, device=x.device)
        for impl in impls:
            with _impl(model, impl):
                got = layer(x).float()
                kernel = layer.experts.resolve_impl(x, top, False)
            out[f"{impl}/{tokens}"] = {"rel_max_err": float((got - ref).abs().max() / ref.abs().max()), "kernel": kernel}
    return out


def run_shape(name: str, shape: dict, device: str, dtype: torch.dtype, impls: list[str], repeats: int) -> dict:
    tokens = torch.randint(0, shape["vocab_size"], (4096,), generator=torch.Generator().manual_seed(1))
    models = {"dense": build(shape, device, dtype)}
    rows = []
    for layout, v in layouts(shape["hidden_size"], shape["intermediate_size"]).items():
        model = build(shape, device, dtype, v["spec"])
        for impl in impls:
            models[f"{layout}/{impl}"] = model
        rows.append({"layout": layout, **v, "kernel_check": kernel_errors(model, impls, shape["hidden_size"])})
    setups = {key: (lambda m=model, i=key.split("/")[1]: _impl(m, i)) for key, model in models.items() if "/" in key}
    import transformers

    result = {"shape": name, "torch": torch.__version__, "transformers": transformers.__version__, "rows": rows}
    for mode, graphs in (("graphs", True), ("eager", False)):
        t0 = time.perf_counter()
        if graphs:  # a step with a host read cannot be captured: that model sits the graphed timing out, said why
            blocked = {k: blocker for k, m in models.items() if (blocker := _blocker(m, setups.get(k), tokens, shape))}
            result["not_captured"] = blocked
            timed = {k: m for k, m in models.items() if k not in blocked}
        else:
            timed = {k: m for k, m in models.items() if "/" not in k or k.endswith("/" + impls[0])}
        measured = time_phases(timed, tokens, protocol=SpeedProtocol(repeats=repeats, cuda_graphs=graphs), setups=setups)
        for row in rows:
            row.setdefault("speedup", {})[mode] = {
                key.split("/")[1]: {p: round(e["speedup"][key], 3) for p, e in measured["phases"].items()}
                for key in timed if key.startswith(row["layout"] + "/")}
        result.update({"device": measured["device"], "dtype": measured["dtype"], "protocol": measured["protocol"]})
        result.setdefault("runtime", {})[mode] = measured["runtime"]
        result.setdefault("timing_s", {})[mode] = round(time.perf_counter() - t0, 1)
        result.setdefault("dense_ms", {})[mode] = {p: round(1e3 * e["seconds"]["dense"], 3) for p, e in measured["phases"].items()}
        result.setdefault("cuda_graphs", {})[mode] = {p: e.get("cuda_graphs") for p, e in measured["phases"].items()}
    return result


def _blocker(model: torch.nn.Module, setup, tokens: torch.Tensor, shape: dict) -> str | None:
    if not torch.cuda.is_available():
        return None
    context = tokens[:32].view(1, 32).to(next(model.parameters()).device)
    with torch.inference_mode(), (setup or contextlib.nullcontext)():
        return capture_blocker(model, context, 16)


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
    ap.add_argument("--impls", nargs="+", default=["triton", "gather", "grouped_mm"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "benchmarks" / "results" / "bench_gpu_speed.json")
    args = ap.parse_args()
    results = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.shapes:
        results.append(run_shape(name, SHAPES[name], args.device, getattr(torch, args.dtype), args.impls, args.repeats))
        if args.device == "cuda":
            torch.cuda.empty_cache()
        args.out.write_text(json.dumps(results, indent=2) + "\n")  # what one shape measured survives the next
    print("bench_gpu_speed: " + "; ".join(
        f"{r['shape']} ({r['device']}, {r['dtype']}; dense decode b1 {r['dense_ms']['graphs']['decode_b1']} ms graphed, "
        f"{r['dense_ms']['eager']['decode_b1']} ms eager): " + ", ".join(
            f"{row['layout']} cost {row['ffn_flops_fraction']} "
            + " ".join(f"[{impl}] " + "/".join(f"{s[p]:.2f}" for p in ("decode_b1", "decode_b8", "prefill"))
                       for impl, s in row["speedup"]["graphs"].items()) for row in r["rows"]) for r in results)
          + " (× dense with CUDA graphs: decode b1 / decode b8 / prefill)")


if __name__ == "__main__":
    main()
