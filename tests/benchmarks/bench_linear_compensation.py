"""A linear map of the MLP input for what the router drops, against the same multiply-adds spent on experts.

Issue 27 asks for fits that generalise out of domain. The skipped-expert means (``compensation=
"skipped_mean"``) add a constant per skipped expert; this study asks whether a reduced-rank linear
function of the input, ``ŷ += (x̃ B) P_r`` (``x̃ = [x 1]``, ``B`` the ridge solution of ``x̃ → y − ŷ`` on
calibration tokens, ``P_r`` the projection on the top-``r`` right singular vectors of ``x̃ B``: the
reduced-rank regression), predicts the rest. It costs ``2·d·r`` multiply-adds per token; the same
multiply-adds buy ``round(2r / (3m))`` more experts of ``m`` neurons, so each rank is compared with the
layer's top-k raised by that many (``more{r}``). A GLU's output has no first-order term in its input at
0 (``act(0) = 0``), so little is expected: this measures how little.

Layer by layer on the dense model's MLP inputs, on the held-out text of the four domains, one
``--recipe best`` conversion built in process from ``--profile`` (``--fit-tokens`` for its fits;
the linear map is fitted on ``--calib-tokens`` of the profile's text). Writes
``results/bench_linear_compensation.json`` and prints one summary line: per domain the geometric
mean over layers of ``Σ‖y − ŷ‖² / Σ‖y‖²``.

    python tests/benchmarks/bench_linear_compensation.py --profile runs/frontier_ldo/profile-without-code --sparsity 0.5
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_threshold_routing import DOMAINS, expert_outputs, open_profile_and_model, study_routed_layers  # noqa: E402
from moelab.engine.methods import get_method  # noqa: E402

OUT = ROOT / "tests" / "benchmarks" / "results" / "bench_linear_compensation.json"
RANKS = (16, 32, 64, 128)
RIDGE = 1e-3  # λ as a share of the mean diagonal of x̃ᵀx̃


def fit_linear(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``B`` ``[d + 1, d]`` (ridge, float64) and ``Vh`` ``[d, d]``, the right singular vectors of ``x̃ B``."""
    xt = torch.cat([x, torch.ones(len(x), 1)], 1).double()
    gram = xt.T @ xt
    lam = RIDGE * gram.diagonal().mean()
    b = torch.linalg.solve(gram + lam * torch.eye(len(gram), dtype=gram.dtype), xt.T @ residual.double())
    return b, torch.linalg.svd(xt @ b, full_matrices=False)[2]


def layer_study(module: Any, dense_mlp: Any, calib_x: torch.Tensor, texts: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One layer: the relative error of the conversion, with each rank's linear map, and with the same
    multiply-adds spent on more experts, on each text."""
    with torch.no_grad():
        b, vh = fit_linear(calib_x, dense_mlp(calib_x).float() - module(calib_x).float())
        mu = module.skip_mean.float() if module.compensated else torch.zeros(module.n_routed, module.d_model)
        row: dict[str, Any] = {"top_k": module.top_k, "n_routed": module.n_routed, "expert_size": module.expert_size}
        for name, x in texts.items():
            y = dense_mlp(x).float()
            den = float(y.pow(2).sum())
            yhat = module(x).float()
            pred = torch.cat([x, torch.ones(len(x), 1)], 1).double() @ b
            r = {"base": float((y - yhat).pow(2).sum()) / den}
            scores = module.router(x)[0].float()
            contrib = expert_outputs(module, x) - mu  # selecting e adds its output and removes its mean
            base = module._shared(x).float() + mu.sum(0)
            for rank in RANKS:
                r[f"lin{rank}"] = float((y - yhat - (pred @ vh[:rank].T @ vh[:rank]).float()).pow(2).sum()) / den
                k = min(module.n_routed, module.top_k + int(round(2 * rank / (3 * module.expert_size))))
                mask = torch.zeros_like(scores).scatter(1, scores.topk(k, dim=1).indices, 1.0)
                r[f"more{rank}"] = float((y - base - torch.einsum("te,ted->td", mask, contrib)).pow(2).sum()) / den
            row[name] = r
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", type=Path, required=True)
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--fit-tokens", type=int, default=4096)
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--windows", type=int, default=4, help="held-out windows of 256 tokens per domain")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    t0 = time.perf_counter()
    profile, adapter = open_profile_and_model(args.profile)
    params = replace(get_method("expertweaver").recipe("best", sparsity=args.sparsity), fit_tokens=args.fit_tokens,
                     down_keep=1.0)  # whole experts: what this study models
    _, _, layers = study_routed_layers(adapter, profile, params, args.calib_tokens, args.windows, layer_study)
    summary = {dom: {key: math.exp(sum(math.log(max(row[dom][key], 1e-12)) for row in layers.values()) / len(layers))
                     for key in next(iter(layers.values()))[dom]} for dom in DOMAINS}
    report = {"profile": str(args.profile), "calibration": profile.manifest["calibration"].get("source"),
              "params": params.to_dict(), "calib_tokens": args.calib_tokens, "windows": args.windows,
              "summary": summary, "layers": layers, "seconds": time.perf_counter() - t0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(args.out)
    print("bench_linear_compensation: FFN error (geomean over layers) per domain: " + "; ".join(
        f"{dom.split(':')[1]} base {v['base']:.4f}, " + ", ".join(f"lin{r} {v[f'lin{r}']:.4f} / more {v[f'more{r}']:.4f}" for r in RANKS)
        for dom, v in summary.items()))


if __name__ == "__main__":
    main()
