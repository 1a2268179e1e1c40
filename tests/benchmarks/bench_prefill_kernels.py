"""The routed experts at prefill, for one layer of the default model's width over expert sizes, selected shares k/E
and ``down_keep``: the native kernel (``moelab_native.moe_routed``, what ``auto`` runs on a CPU with a C compiler)
against the dense FFN of that width (its three GEMMs: what the layer replaces) and against the torch kernels that run
without the native one, ``sorted`` (pairs sorted by expert, gathered, multiplied, scattered back) and ``dense``
(``masked_dense``: the whole layer's two GEMMs, unselected experts zeroed), with the torch-only ``auto`` choice
(``select_kernel``: dense once k/E ≥ DENSE_SHARE + m/DENSE_NEURONS) beside each.

    python tests/benchmarks/bench_prefill_kernels.py [--tokens 512] [--threads 2] [--repeats 7] [--out FILE]

Random weights (std 0.02, as ``reset_parameters`` draws them: uninitialised memory holds denormals that slow every
kernel) and uniform random routing; both kernels interleaved, medians compared. Writes
tests/benchmarks/results/bench_prefill_kernels.json and prints one summary line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch.nn.functional as F  # noqa: E402

from moelab.engine.runtime import moelab_kernels as K, moelab_native  # noqa: E402
from moelab.engine.runtime.moelab_moe import MoeExperts  # noqa: E402

D_MODEL, D_FFN = 576, 1536
OUT = ROOT / "tests" / "benchmarks" / "results" / "bench_prefill_kernels.json"


@torch.inference_mode()
def case(n_experts: int, share: float, keep: float, tokens: int, repeats: int) -> dict:
    m = D_FFN // n_experts
    experts = MoeExperts(n_experts, m, D_MODEL).eval()
    experts.reset_parameters()
    experts.down_keep = max(1, round(keep * m))
    k = max(1, round(share * n_experts))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, D_MODEL, generator=g)
    top = torch.rand(tokens, n_experts, generator=g).argsort(dim=1)[:, :k]
    w = (experts.gate_up_proj, experts.down_proj)
    gate, up, down = (torch.randn(D_FFN, D_MODEL, generator=g) * 0.02 for _ in range(3))
    kernels = {"dense_ffn": lambda: F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down.T),
               "sorted": lambda: K.run_kernel("sorted", experts, x, w, top, None, None, False),
               "dense": lambda: K.masked_dense(experts, x, w, top, None, None)}
    if moelab_native.library() is not None:
        kernels["native"] = lambda: moelab_native.moe_routed(x, top, None, w[0].transpose(1, 2), w[1].transpose(1, 2), m,
                                                             experts.down_keep, "silu")
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for round_ in range(repeats + 1):
        for name, run in kernels.items():
            t0 = time.perf_counter()
            run()
            if round_:
                times[name].append(time.perf_counter() - t0)
    ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    return {"n_experts": n_experts, "expert_size": m, "top_k": k, "share": round(k / n_experts, 3), "down_keep": keep,
            "ms": {n: round(v, 2) for n, v in ms.items()},
            "auto": experts.resolve_impl(x, top, needs_grad=False)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=OUT,
                    help="the JSON result (another machine's need not replace the recorded one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [case(e, share, keep, args.tokens, args.repeats)
            for e in (128, 64, 32, 16) for share in (0.1, 0.25, 0.4, 0.6) for keep in (1.0, 0.5)]
    for r in rows:
        r["faster"] = min(("sorted", "dense"), key=r["ms"].get)  # of the torch kernels, which ``auto`` picks among
    agree = sum(r["auto"] == r["faster"] or abs(r["ms"]["sorted"] / r["ms"]["dense"] - 1) < 0.1 for r in rows)
    native = [r["ms"]["dense_ffn"] / r["ms"]["native"] for r in rows if "native" in r["ms"]]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"tokens": args.tokens, "threads": args.threads, "d_model": D_MODEL, "d_ffn": D_FFN,
                                    "dense_share": K.DENSE_SHARE, "dense_neurons": K.DENSE_NEURONS, "rows": rows},
                                   indent=2) + "\n")
    said = (f"native kernel {min(native):.2f}-{max(native):.2f}x the dense FFN's speed" if native else "no native kernel")
    print(f"bench_prefill_kernels: {said}; torch-only auto picks the faster kernel (or one within 10%) in {agree}/{len(rows)} "
          "cases; " + "; ".join(f"{r['n_experts']}x{r['expert_size']} k/E {r['share']} keep {r['down_keep']}: dense FFN "
                               f"{r['ms']['dense_ffn']}, native {r['ms'].get('native')}, sorted {r['ms']['sorted']}, masked "
                               f"{r['ms']['dense']} ms" for r in rows if r["down_keep"] == 1.0))


if __name__ == "__main__":
    main()
