"""A native (stock transformers) export on CUDA: loads, generates, and its speed against dense.

    python tests/benchmarks/bench_native_cuda.py --config CONVERSION/config.json [--config ...]
        [--dtype bfloat16] [--out results.json]

The layout comes from a conversion's ``config.json`` (its ``base_config`` and ``moe_layers``; e.g.
``--recipe portable`` recovered, so EW Eq. 11 with one expert count and top-k in every MoE layer).
Only the layout is needed, so a GPU machine that cannot receive the weights (the default model's
are larger than what travels there) builds the model with random weights of that exact shape:
speed depends on shapes, not values. The moelab model is exported with ``--format native``
(Qwen2-MoE), loaded with ``AutoModelForCausalLM.from_pretrained`` (no remote code) on the GPU,
checked against moelab's own model on the same device (logits, fp32) and timed against the dense
source model of the same config: prefill of 512 tokens and 128 greedy decode tokens (batch 1),
interleaved, best of ``--repeat``, CUDA-synchronised. Writes JSON, prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moelab.engine.runtime.modeling_moelab import MoelabConfig, MoelabForCausalLM  # noqa: E402
from moelab.engine.runtime.native_export import build_native_model, native_layout  # noqa: E402

PREFILL, DECODE = 512, 128


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.inference_mode()
def _speed(model: torch.nn.Module, device: str) -> dict[str, float]:
    ids = torch.randint(100, 20000, (1, PREFILL), generator=torch.Generator().manual_seed(0)).to(device)
    model(input_ids=ids[:, :16])
    _sync()
    t0 = time.perf_counter()
    model(input_ids=ids)
    _sync()
    prefill = PREFILL / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    model.generate(ids[:, :16], max_new_tokens=DECODE, min_new_tokens=DECODE, do_sample=False, pad_token_id=0)
    _sync()
    return {"prefill_tok_s": prefill, "decode_tok_s": DECODE / (time.perf_counter() - t0)}


def run(config_path: Path, device: str, dtype: torch.dtype, repeat: int) -> dict:
    from transformers import AutoModelForCausalLM

    config = MoelabConfig.from_dict(json.loads(config_path.read_text()))
    torch.manual_seed(0)
    moe = MoelabForCausalLM(config).eval()
    for mod in moe.modules():  # random weights of the exact shape; a small spread keeps logits finite
        if hasattr(mod, "reset_parameters") and mod is not moe:
            try:
                mod.reset_parameters()
            except TypeError:
                pass
    layout = native_layout(moe)
    native = build_native_model(moe)
    with tempfile.TemporaryDirectory() as tmp:  # through disk, as a user loads it
        native.save_pretrained(tmp)
        loaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval().to(device)
    moe = moe.to(device)
    ids = torch.randint(100, 20000, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.inference_mode():
        diff = float((loaded(input_ids=ids).logits - moe(input_ids=ids).logits).abs().max())
    loaded = loaded.to(dtype)
    dense = AutoModelForCausalLM.from_config(config.base_config, dtype=dtype).eval().to(device)
    best: dict[str, dict[str, float]] = {"dense": {}, "native": {}}
    for _ in range(repeat):
        for name, model in (("dense", dense), ("native", loaded)):
            for k, v in _speed(model, device).items():
                best[name][k] = max(v, best[name].get(k, 0.0))
    with torch.inference_mode():
        out = loaded.generate(ids[:1, :16], max_new_tokens=32, do_sample=False, pad_token_id=0)
    return {"config": str(config_path), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "dtype": str(dtype), "layout": {k: layout[k] for k in ("model_type", "num_experts", "expert_size", "top_k",
                                                                      "d_shared", "dense_layers")},
            "native_vs_moelab_max_logit_diff_fp32": diff, "generated_tokens": int(out.shape[1] - 16),
            "dense": best["dense"], "native": best["native"],
            "prefill_vs_dense": best["native"]["prefill_tok_s"] / best["dense"]["prefill_tok_s"],
            "decode_vs_dense": best["native"]["decode_tok_s"] / best["dense"]["decode_tok_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, nargs="+", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "benchmarks" / "results" / "bench_native_cuda.json")
    args = ap.parse_args()
    rows = [run(c, args.device, getattr(torch, args.dtype), args.repeat) for c in args.config]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    print("bench_native_cuda: " + "; ".join(
        f"{r['layout']['num_experts']}x{r['layout']['expert_size']} top-{r['layout']['top_k']}: prefill "
        f"{r['prefill_vs_dense']:.2f}x decode {r['decode_vs_dense']:.2f}x dense ({r['device']}, {r['dtype']}; "
        f"logit diff {r['native_vs_moelab_max_logit_diff_fp32']:.1e})" for r in rows))


if __name__ == "__main__":
    main()
